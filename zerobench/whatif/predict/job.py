"""One rank of one engine cell on the virtual GPU, at any world size, in this process.

The same engine code as ``zerobench run`` and ``zerobench estimate`` (zerobench/engines),
against a fake process group of the cell's world size, with fake tensors (shapes only)
and the virtual GPU installed (zerobench/instruments/vgpu, [Note: virtual device]): the
rank session (zerobench/rank/session.py) warms up and runs one measured step whose timeline and memory are read off the virtual device.
Run as ``python -m zerobench.whatif.predict.job`` by ``zerobench predict``, every cell in
one process, each in a fake world of its own ([Note: one process for many cells] in
zerobench/whatif/jobs.py).

[Note: predicted columns]
* ``step_time_s``: host time from the start of the measured step to the device being
  done with it (the host synchronises at both ends, as the harness's timing pass does);
* ``compute_s``: busy time of the compute stream in the step;
* ``exposed_comm_s``: time in which a collective runs and the compute stream is idle;
  ``overlap_ratio`` = 1 - exposed / total collective time (NaN without communication);
* ``peak_{allocated,active,reserved}_bytes``, ``num_alloc_retries``, ``num_ooms``: the
  caching-allocator model's figures, under the names a run on a GPU gives them;
* ``max_unsharded_units``: peak active bytes of all-gather outputs over the largest
  all-gather output (units of gathered parameters alive at once, freed-but-pending
  ones included);
* ``host_lead_max_s``: how far the compute stream's queue ran ahead of the host at most;
* ``host_busy_s``: host time the step's work cost (operators, stream and collective
  calls, Python calls: [Note: host cost] in zerobench/instruments/vgpu/host.py), its
  Python calls' share ``host_python_s`` and their number ``host_python_calls``; with
  ``host_blocked_s`` (waiting for the device) it is the host's whole step;
* ``comm_<kind>_bytes``, ``comm_<kind>_calls``, ``comm_total_bytes``, ``comm_calls``: the
  measured step's collectives, as the run's memory pass counts them (schema/columns.py).
* ``tokens_per_s``: this rank's tokens per second; ``tflops_per_gpu`` and ``mfu``: model
  FLOPs by torchtitan's formula ([Note: model FLOPs] in zerobench/spec/flops.py) per
  second, and over the preset's dense peak for the cell's dtype;
* ``capacity_bytes``: what the allocator may reserve, the card less the memory held
  outside it (``outside_allocator_bytes``: CUDA context and NCCL communicators; [Note:
  capacity a process sees] in zerobench/instruments/vgpu/allocator.py);
* ``status``: ``ok``; ``capped`` when the reserved peak came within a large segment
  (20 MiB) of the capacity or the allocator had to retry (``num_alloc_retries`` over
  the warm-up and measured steps), so that the figures are those of a card that was
  full, not a prediction of the memory the cell needs; ``oom`` when an allocation
  failed, ``oom_needed_bytes`` then being what the allocator would have had to reserve
  for it: at least what the cell needs, since the step stopped there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
import traceback
from pathlib import Path

import torch

from zerobench.instruments import collectives
from zerobench.instruments.link import Link
from zerobench.instruments.vgpu.host import HostPreset
from zerobench.instruments.vgpu.presets import load_preset_file
from zerobench.runs.whatif import predicted_trace
from zerobench.spec.cell import Cell
from zerobench.spec.workload import parse_workload


def timeline_metrics(spans, start: float, end: float) -> dict:
    """compute_s, comm_s, exposed_comm_s, overlap_ratio from a trace's spans in [start, end]
    (overlap_ratio: NaN when nothing was communicated, as everywhere: zerobench/schema/columns.py)."""
    from zerobench.analysis.profiling import intervals as iv

    compute = iv.clip([(a, b) for lane, _name, a, b, _args in spans if lane == "compute"], start, end)
    comm = iv.clip([(a, b) for lane, _name, a, b, _args in spans if lane.startswith("comm")], start, end)
    comm_s = iv.total(comm)
    exposed = iv.total(iv.subtract(comm, compute))
    return {"compute_s": iv.total(compute), "comm_s": comm_s, "exposed_comm_s": exposed,
            "overlap_ratio": 1 - exposed / comm_s if comm_s > 0 else float("nan")}


#: How close to the capacity a reserved peak may come before the cell is reported capped.
CAPPED_MARGIN = 20 * 2**20


def virtual_gpu(gpu, host, link: Link, inter_link: Link | None, node_size: int,
                alloc_conf: str | None = None, record_streams: bool = False, sdpa_backend: str = "auto"):
    """The virtual GPU a cell is predicted on (zerobench/instruments/vgpu); ``host``: a host
    preset or its name, or None for the GPU preset's own (host.py's ``host_for``)."""
    from zerobench.instruments.vgpu import VirtualGpu
    from zerobench.instruments.vgpu.host import host_for
    from zerobench.instruments.vgpu.presets import gpu_preset

    return VirtualGpu(gpu=gpu, host=host_for(gpu_preset(gpu), host), link=link, inter_link=inter_link, node_size=node_size,
                      alloc_conf=alloc_conf, record_streams=record_streams, sdpa_backend=sdpa_backend,
                      host_factories=True)


def predict_one(w, cell: Cell, gpu, host, link: Link, inter_link: Link | None, node_size: int,
                trace_path: Path | None = None, alloc_conf: str | None = None,
                record_streams: bool = False, sdpa_backend: str = "auto") -> dict:
    """The rank session of ``cell`` (rank 0 of its world size) on a virtual GPU, fake
    tensors, a fake process group: warm-up, then one measured step read off the device."""
    vgpu = virtual_gpu(gpu, host, link, inter_link, node_size, alloc_conf, record_streams, sdpa_backend)
    return predict_on(w, cell, vgpu, trace_path)


def predict_on(w, cell: Cell, vgpu, trace_path: Path | None = None) -> dict:
    """:func:`predict_one` on a virtual GPU made by the caller, who can read its
    allocator when the step runs out of its memory (:func:`run_job`)."""
    from zerobench.engines.base import ran_record, row_note
    from zerobench.rank.session import Session
    from zerobench.rank.worlds import FakeWorld
    from zerobench.spec.models import samples_to_tokens

    started = time.perf_counter()
    with FakeWorld(cell.world_size, 0, fake_tensors=True, gpu=vgpu) as world:
        # Only the measured step's Python calls are counted, so that it starts the same
        # whatever the process ran before: [Note: host cost].
        with vgpu.python_uncounted():
            session = Session(w, cell, world)
            engine = session.build()
            ran = ran_record(engine)  # [Note: say what ran] (zerobench/engines/base.py)
            session.warm_up(engine, max(w.run.memory_warmup_steps, 1))
        world.synchronize()
        world.reset_peak_memory_stats()
        vgpu.trace.clear()
        blocked = vgpu.host.blocked_s  # the host's waits before the step are not the step's
        charged = dict(vgpu.host_counts)  # and what the host paid for before it ([Note: host cost])
        host_cpu = vgpu.host_cpu_s
        with collectives.intercepted(collectives.CommCounter()) as comm:  # bytes and calls of the step
            step = session.measured_step(engine, w.run.memory_warmup_steps)
        t1 = world.clock()
        host_counts = {kind: n - charged.get(kind, 0) for kind, n in vgpu.host_counts.items()}
        host_cpu = vgpu.host_cpu_s - host_cpu
        allocator = session.allocator_metrics()
        extra = engine.extra_metrics()
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(trace_path, "wt") as f:
            json.dump(vgpu.trace.chrome(label=f"{cell.id} (virtual {vgpu.preset.name})"), f)
    step_s = step.seconds
    tokens = w.data.batch_size * max(samples_to_tokens(w.model), 1)
    from zerobench.spec.flops import mfu_metrics, model_flops_per_token

    dtype = torch.bfloat16 if cell.dtype == "bf16" else torch.float32
    throughput = mfu_metrics(tokens / step_s if step_s > 0 and samples_to_tokens(w.model) else None,
                             model_flops_per_token(w.model), vgpu.preset.peak(dtype))
    largest = vgpu.allocator.largest_by_label.get("unsharded", 0)
    capacity = vgpu.allocator.capacity
    status, reason = "ok", None
    if allocator["peak_reserved_bytes"] + CAPPED_MARGIN > capacity or allocator["num_alloc_retries"] > 0:
        status = "capped"
        reason = (f"reserved memory reached the {capacity / 2**30:.2f} GiB the allocator may hold "
                  f"({allocator['num_alloc_retries']} allocator retries): the figures are a full card's")
    timeline = timeline_metrics(vgpu.trace.spans, t1 - step_s, t1)
    shares = vgpu.host_preset.seconds_by_share(host_counts)
    return {
        "status": status, "reason": reason, "note": row_note(cell.note, ran),
        "step_time_s": step_s,
        **timeline,
        **allocator,
        "max_unsharded_units": (vgpu.allocator.peak_active_by_label.get("unsharded", 0) / largest
                                if largest else 0.0),
        "host_lead_max_s": vgpu.host_lead_max_s,
        "host_blocked_s": vgpu.host.blocked_s - blocked,
        "host_busy_s": vgpu.host_preset.seconds(host_counts) + host_cpu,
        "device_busy_s": timeline["compute_s"] + timeline["exposed_comm_s"],
        **{f"host_{share}_s": seconds for share, seconds in shares.items()},
        "host_cpu_s": host_cpu,
        "host_python_calls": host_counts.get("python_frame", 0) + host_counts.get("generator", 0),
        **comm.columns(),
        "tokens_per_s": tokens / step_s if step_s > 0 else None,
        **throughput,
        "capacity_bytes": capacity,
        "outside_allocator_bytes": vgpu.preset.context_bytes + vgpu.allocator.outside_bytes,
        "limiter_stalls": extra.get("limiter_stalls"),
        "predict_wall_s": time.perf_counter() - started,
    }


def run_job(w, job, gpu, host, link: Link, inter_link: Link | None, node_size: int,
            traces: Path | None = None, alloc_conf: str = "", record_streams: bool = False,
            sdpa_backend: str = "auto") -> dict:
    """One job of ``zerobench predict`` (zerobench/whatif/jobs.py): its row, also when the
    cell runs out of the virtual GPU's memory (status ``oom``, with what it needed) or
    cannot run there (``skipped``, with why). ``gpu``: a preset with its memory settings;
    ``host``: a host preset (or its name)."""
    from zerobench.engines.deepspeed import torch_as_found

    cell = job.cell()
    trace = predicted_trace(traces, cell.id) if traces else None
    vgpu = None
    try:
        vgpu = virtual_gpu(gpu, host, link, inter_link, node_size, alloc_conf, record_streams, sdpa_backend)
        with torch_as_found():  # a cell never changes the next one's torch
            return predict_on(w, cell, vgpu, trace)
    except torch.OutOfMemoryError as err:
        traceback.print_exc()
        allocator = vgpu.allocator if vgpu is not None else None
        first = str(err).strip().splitlines()[0]
        return {"status": "oom", "reason": f"out of memory on the virtual GPU: {first[:400]}",
                "oom_needed_bytes": allocator.needed_bytes if allocator else None,
                "num_alloc_retries": allocator.stats["num_alloc_retries"] if allocator else None,
                "capacity_bytes": allocator.capacity if allocator else None}
    except Exception as err:  # one cell never stops the others
        traceback.print_exc()
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return {"status": "skipped",
                "reason": f"cannot run on the virtual GPU: {type(err).__name__}: {first[:300]}"}


def main(argv=None) -> None:
    from zerobench.whatif.jobs import child_loop

    parser = argparse.ArgumentParser(prog="python -m zerobench.whatif.predict.job")
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--jobs", type=Path, required=True, help="JSON: the cells to predict (zerobench/whatif/jobs.py)")
    parser.add_argument("--gpu-file", type=Path, required=True, help="the GPU preset, as predict wrote it")
    parser.add_argument("--host", required=True, help="JSON of the host preset")
    parser.add_argument("--link", required=True, help="JSON of the intra-node link")
    parser.add_argument("--inter-link", default=None, help="JSON of the inter-node link")
    parser.add_argument("--node-size", type=int, default=8)
    parser.add_argument("--traces", type=Path, default=None)
    parser.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF syntax")
    parser.add_argument("--record-streams", action="store_true")
    parser.add_argument("--sdpa-backend", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    w = parse_workload(json.loads(args.workload.read_text()), source=str(args.workload))
    link = Link(**json.loads(args.link))
    inter = Link(**json.loads(args.inter_link)) if args.inter_link else None
    # Resolved and checked by ``zerobench predict`` (resolve_devices): read back, not looked up again.
    gpu = load_preset_file(args.gpu_file)
    host = HostPreset(**json.loads(args.host))

    def run_one(job) -> dict:
        return run_job(w, job, gpu, host, link, inter, args.node_size, args.traces, args.alloc_conf,
                       args.record_streams, args.sdpa_backend)

    child_loop(args.jobs, args.out, run_one)


if __name__ == "__main__":
    main()
