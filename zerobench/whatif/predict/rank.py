"""One rank of one engine cell on the virtual GPU, at any world size, in this process.

The same engine code as ``zerobench run`` and ``zerobench estimate`` (zerobench/engines),
against a fake process group of the cell's world size, with fake tensors (shapes only)
and the virtual GPU installed (zerobench/vgpu, [Note: virtual device]): warm-up steps,
then one measured step whose timeline and memory are read off the virtual device.
Run as ``python -m zerobench.whatif.predict.rank`` by ``zerobench predict``, one process per
engine configuration, so that process-group state never leaks between cells.

[Note: predicted columns]
* ``step_time_s``: host time from the start of the measured step to the device being
  done with it (the host synchronises at both ends, as the harness's timing pass does);
* ``compute_s``: busy time of the compute stream in the step;
* ``exposed_comm_s``: time in which a collective runs and the compute stream is idle;
  ``overlap_ratio`` = 1 - exposed / total collective time;
* ``peak_{allocated,active,reserved}_bytes``: the caching-allocator model's peaks;
* ``max_unsharded_units``: peak active bytes of all-gather outputs over the largest
  all-gather output (units of gathered parameters alive at once, freed-but-pending
  ones included);
* ``host_lead_max_s``: how far the compute stream's queue ran ahead of the host at most;
* ``tokens_per_s``: this rank's tokens per second; ``tflops_per_gpu`` and ``mfu``: model
  FLOPs by torchtitan's formula ([Note: model FLOPs] in zerobench/spec/flops.py) per
  second, and over the preset's dense peak for the cell's dtype;
* ``num_alloc_retries``: times the allocator model freed its cache to make room (each
  synchronises the device), over the warm-up and measured steps;
* ``capacity_bytes``: what the allocator may reserve, the card less the memory held
  outside it (``outside_allocator_bytes``: CUDA context and NCCL communicators; [Note:
  capacity a process sees] in zerobench/instruments/vgpu/allocator.py);
* ``status``: ``ok``; ``capped`` when the reserved peak came within a large segment
  (20 MiB) of the capacity or the allocator had to retry, so that the figures are those
  of a card that was full, not a prediction of the memory the cell needs; ``oom`` when
  an allocation failed, ``oom_needed_bytes`` then being what the allocator would have
  had to reserve for it: at least what the cell needs, since the step stopped there.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from zerobench.runs.files import write_json_atomic
from zerobench.instruments.link import Link
from zerobench.instruments.vgpu.presets import gpu_preset
from zerobench.spec.matrix import Cell
from zerobench.spec.workload import parse_workload

#: engine options that would install the harness's own link emulation: the virtual GPU
#: times collectives itself.
EMULATION_OPTIONS = ("emulate_link", "emulate_gbps", "emulate_latency_us")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union ``a`` not covered by union ``b`` (both sorted, disjoint)."""
    total, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                total += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            total += end - cursor
    return total


def timeline_metrics(spans, start: float, end: float) -> dict:
    """compute_s, comm_s, exposed_comm_s, overlap_ratio from a trace's spans in [start, end]."""
    compute, comm = [], []
    for lane, _name, a, b, _args in spans:
        if b <= start or a >= end:
            continue
        (compute if lane == "compute" else comm if lane.startswith("comm") else []).append((max(a, start), min(b, end)))
    compute, comm = _union(compute), _union(comm)
    comm_s = _length(comm)
    exposed = _minus(comm, compute)
    return {"compute_s": _length(compute), "comm_s": comm_s, "exposed_comm_s": exposed,
            "overlap_ratio": 1 - exposed / comm_s if comm_s > 0 else 1.0}


#: How close to the capacity a reserved peak may come before the cell is reported capped.
CAPPED_MARGIN = 20 * 2**20


def predict_one(w, cell: Cell, gpu, host: str, link: Link, inter_link: Link | None, node_size: int,
                trace_path: Path | None = None, alloc_conf: str | None = None,
                avoid_record_streams: bool = False) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    from zerobench.engines import OptimizerSpec, RankContext, get_engine
    from zerobench.whatif.estimate.rank import _batch, _fake_tensor_mode, _single_rank_ddp
    from zerobench.spec.models import build_for_cell, loss_fn
    from zerobench.instruments.vgpu import VirtualGpu

    world = cell.world_size
    started = time.perf_counter()
    dist.init_process_group("fake", world_size=world, rank=0, store=FakeStore())
    try:
        ctx = RankContext(0, world, 0, torch.device("cpu"), "fake")
        spec = OptimizerSpec(w.optimizer.kind, w.optimizer.lr, w.optimizer.hyper())
        loss = loss_fn(w.model)
        vgpu = VirtualGpu(gpu=gpu, host=host, link=link, inter_link=inter_link, node_size=node_size,
                          alloc_conf=alloc_conf, avoid_record_streams=avoid_record_streams)
        current_gpu.append(vgpu)  # for the report of a cell that runs out of memory
        with _fake_tensor_mode(), _single_rank_ddp(), vgpu:
            with vgpu.deferred():  # [Note: build as users do]
                engine = get_engine(cell.engine)(cell.opts, ctx, cell.dtype)
                model, units = build_for_cell(w.model, w.seed, None, cell.opts.get("activation_checkpointing", "none"))
                engine.wrap(model, units)
            vgpu.materialize()
            engine.build_optimizer(spec)
            for step in range(max(w.run.memory_warmup_steps, 1)):
                engine.train_step(*_batch(w, world, 0, step, True), loss)
            inputs, targets = _batch(w, world, 0, w.run.memory_warmup_steps, True)
            vgpu.synchronize()
            vgpu.reset_peak_memory_stats()
            vgpu.trace.clear()
            t0 = vgpu.host.now
            engine.train_step(inputs, targets, loss)
            vgpu.synchronize()
            t1 = vgpu.host.now
            stats = vgpu.memory_stats()
            extra = engine.extra_metrics() if hasattr(engine, "extra_metrics") else {}
        if trace_path is not None:
            trace_path.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(trace_path, "wt") as f:
                json.dump(vgpu.trace.chrome(label=f"{cell.id} (virtual {vgpu.preset.name})"), f)
        step_s = t1 - t0
        from zerobench.spec.models import samples_to_tokens

        tokens = w.data.batch_size * max(samples_to_tokens(w.model), 1)
        from zerobench.spec.flops import mfu_metrics, model_flops_per_token

        dtype = torch.bfloat16 if cell.dtype == "bf16" else torch.float32
        throughput = mfu_metrics(tokens / step_s if step_s > 0 and samples_to_tokens(w.model) else None,
                                 model_flops_per_token(w.model), vgpu.preset.peak(dtype))
        largest = vgpu.allocator.largest_by_label.get("unsharded", 0)
        capacity = vgpu.allocator.capacity
        full = (stats["reserved_bytes.all.peak"] + CAPPED_MARGIN > capacity) or stats["num_alloc_retries"] > 0
        status, reason = "ok", None
        if full:
            status = "capped"
            reason = (f"reserved memory reached the {capacity / 2**30:.2f} GiB the allocator may hold "
                      f"({stats['num_alloc_retries']} allocator retries): the figures are a full card's")
        return {
            "status": status, "reason": reason,
            "step_time_s": step_s,
            **timeline_metrics(vgpu.trace.spans, t0, t1),
            "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
            "peak_active_bytes": stats["active_bytes.all.peak"],
            "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
            "max_unsharded_units": (vgpu.allocator.peak_active_by_label.get("unsharded", 0) / largest
                                    if largest else 0.0),
            "host_lead_max_s": vgpu.host_lead_max_s,
            "host_blocked_s": vgpu.host.blocked_s,
            "tokens_per_s": tokens / step_s if step_s > 0 else None,
            **throughput,
            "limiter_stalls": extra.get("limiter_stalls"),
            "num_ooms": stats["num_ooms"],
            "num_alloc_retries": stats["num_alloc_retries"],
            "capacity_bytes": capacity,
            "outside_allocator_bytes": vgpu.preset.context_bytes + vgpu.allocator.outside_bytes,
            "predict_wall_s": time.perf_counter() - started,
        }
    finally:
        dist.destroy_process_group()


#: The virtual GPU of the cell being predicted (read after an out-of-memory error).
current_gpu: list = []


def _needed(allocator) -> int | None:
    """What the allocator would have had to reserve for the request that failed: at least
    what the cell needs (it stopped there)."""
    return allocator.needed_bytes if allocator is not None else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zerobench.whatif.predict.rank")
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--cell-config", type=Path, required=True, help="JSON: engine, dtype, options")
    parser.add_argument("--world-sizes", required=True)
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--link", required=True, help="JSON of the intra-node link")
    parser.add_argument("--inter-link", default=None, help="JSON of the inter-node link")
    parser.add_argument("--node-size", type=int, default=8)
    parser.add_argument("--traces", type=Path, default=None)
    parser.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF syntax")
    parser.add_argument("--context-mib", type=int, default=None)
    parser.add_argument("--nccl-mib", type=int, default=None)
    parser.add_argument("--avoid-record-streams", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    w = parse_workload(json.loads(args.workload.read_text()), source=str(args.workload))
    conf = json.loads(args.cell_config.read_text())
    link = Link(**json.loads(args.link))
    inter = Link(**json.loads(args.inter_link)) if args.inter_link else None
    gpu = gpu_preset(args.gpu).with_memory(
        context_bytes=None if args.context_mib is None else args.context_mib * 2**20,
        nccl_bytes_per_group=None if args.nccl_mib is None else args.nccl_mib * 2**20)
    rows = []
    for ws in [int(x) for x in args.world_sizes.split(",")]:
        cell = Cell(conf["engine"], ws, conf["dtype"], tuple(tuple(kv) for kv in conf["options"]))
        trace = args.traces / f"{cell.id}.trace.json.gz" if args.traces else None
        current_gpu.clear()
        try:
            row = predict_one(w, cell, gpu, args.host, link, inter, args.node_size, trace, args.alloc_conf,
                              args.avoid_record_streams)
        except torch.OutOfMemoryError as err:
            traceback.print_exc()
            allocator = current_gpu[-1].allocator if current_gpu else None
            first = str(err).strip().splitlines()[0]
            row = {"status": "oom", "reason": f"out of memory on the virtual GPU: {first[:400]}",
                   "oom_needed_bytes": _needed(allocator),
                   "num_alloc_retries": allocator.stats["num_alloc_retries"] if allocator else None,
                   "capacity_bytes": allocator.capacity if allocator else None}
        except Exception as err:  # one cell never stops the others
            traceback.print_exc()
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            row = {"status": "skipped", "reason": f"cannot run on the virtual GPU: {type(err).__name__}: {first[:300]}"}
        rows.append({"world_size": ws, **row})
        write_json_atomic(args.out, rows)


if __name__ == "__main__":
    main()
