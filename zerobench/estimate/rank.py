"""One rank of one engine cell at any world size, in this process, against a fake process group.

``python -m zerobench.estimate.rank --workload W.json --cell-config C.json --world-sizes 2,4 --out O.json``
runs, for each world size in turn, a warm-up (the workload's ``run.memory_warmup_steps``)
and one measured step of the real engine adapter under the storage tracker, exactly as
the worker's memory pass does, but on a process group of backend "fake"
(``torch.testing._internal.distributed.fake_pg``): collectives return at once with
garbage contents, so memory is right and numerics are not. The parent
(``zerobench.estimate``) starts one such process per cell, so process-group state never
leaks between engines.

With ``--fake-tensors`` the model, batches and everything the engine allocates are
FakeTensors (no data), so a 7.5B-parameter model fits on a laptop; the tracker then
follows their meta storages. Engines whose code needs real data (DDP's C++ reducer,
``.item()`` in the optimizer) fail there; the cell is reported skipped with the error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from zerobench import data as data_mod
from zerobench.engines import OptimizerSpec, RankContext, get_engine
from zerobench.files import write_json_atomic
from zerobench.matrix import Cell
from zerobench.memory import StorageTracker
from zerobench.models import GPT, MLP, loss_fn
from zerobench.workload import Workload, parse_workload


def _unique_nbytes(tensors) -> tuple[int, int]:
    """(bytes of the distinct storages, elements) of tensors, DTensors by their local shard."""
    seen, nbytes, numel = set(), 0, 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        local = getattr(t, "_local_tensor", None)
        t = local if local is not None else t
        if t.dim() == 0:  # optimizer step counters
            continue
        numel += t.numel()
        s = t.untyped_storage()
        key = (id(s), s.nbytes()) if t.device.type == "meta" else s.data_ptr()
        if key not in seen:
            seen.add(key)
            nbytes += s.nbytes()
    return nbytes, numel


def _model(w: Workload):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(w.seed)
        return MLP(w.model) if w.model.kind == "mlp" else GPT(w.model)


def _batch(w: Workload, world: int, rank: int, step: int, fake: bool):
    d, m = w.data, w.model
    if fake:  # shapes only
        if m.kind == "mlp":
            return torch.randn(d.batch_size, m.width), torch.randn(d.batch_size, m.width)
        return (torch.randint(0, m.vocab, (d.batch_size, m.seq_len)),
                torch.randint(0, m.vocab, (d.batch_size, m.seq_len)))
    inputs, targets = data_mod.rank_batch(m, d.batch_size, world, rank, d.seed, step)
    return inputs.clone(), targets.clone()  # own storages, not views of the global batch


def _fake_pg_ddp_hook(module) -> None:
    """DDP's built-in all-reduce hook asserts on the fake group's result (not a tensor).
    A hook that hands back the bucket, reduced in place as gloo's all-reduce does, keeps
    the same buffers alive for the same time."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        def hook(_state, bucket):
            buffer = bucket.buffer()
            dist.all_reduce(buffer)
            future = torch.futures.Future()
            future.set_result(buffer)
            return future

        module.register_comm_hook(None, hook)


def estimate_one(w: Workload, cell: Cell, rank: int, fake: bool) -> dict:
    """Peak and composition of ``rank`` for ``cell`` (its world size) on a fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    world = cell.world_size
    started = time.perf_counter()
    dist.init_process_group("fake", world_size=world, rank=rank, store=FakeStore())
    try:
        ctx = RankContext(rank, world, rank, torch.device("cpu"), "fake")
        spec = OptimizerSpec(w.optimizer.kind, w.optimizer.lr, w.optimizer.hyper())
        loss = loss_fn(w.model)
        mode = contextlib.nullcontext()
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            tracker = StorageTracker("meta" if fake else "cpu", timeline=False)
            grads = []
            with tracker:
                engine = get_engine(cell.engine)(cell.opts, ctx, cell.dtype)
                model = _model(w)
                engine.wrap(model, list(model.blocks))
                _fake_pg_ddp_hook(engine.module)
                engine.build_optimizer(spec)
                for step in range(w.run.memory_warmup_steps):
                    engine.train_step(*_batch(w, world, rank, step, fake), loss)
                inputs, targets = _batch(w, world, rank, w.run.memory_warmup_steps, fake)

                def on_phase(name):
                    tracker.set_phase(name)
                    if name == "optimizer":
                        found = engine.gradient_tensors()
                        grads[:] = [_unique_nbytes(found)]
                        tracker.note_roles("grads", found)

                engine.on_phase = on_phase
                tracker.reset_peak()
                engine.train_step(inputs, targets, loss)
                tracker.set_phase("after")
                params, optim = engine.parameter_tensors(), engine.optimizer_state_tensors()
                tracker.classify(params=params, optim=optim)
                engine.on_phase = None
            breakdown = tracker.peak_breakdown()
            p_bytes, p_numel = _unique_nbytes(params)
            o_bytes, o_numel = _unique_nbytes(optim)
            g_bytes, g_numel = grads[0] if grads else (0, 0)
        return {
            "status": "ok", "reason": None,
            "peak_mem_bytes": tracker.peak_bytes,
            **{f"peak_mem_{k}_bytes": v for k, v in breakdown.items()},
            "state_params_bytes": p_bytes, "state_params_numel": p_numel,
            "state_grads_bytes": g_bytes, "state_grads_numel": g_numel,
            "state_optim_bytes": o_bytes, "state_optim_numel": o_numel,
            "estimate_wall_s": time.perf_counter() - started,
        }
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zerobench.estimate.rank")
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--cell-config", type=Path, required=True, help="JSON: engine, dtype, options")
    parser.add_argument("--world-sizes", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--fake-tensors", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    w = parse_workload(json.loads(args.workload.read_text()), source=str(args.workload))
    conf = json.loads(args.cell_config.read_text())
    rows = []
    for ws in [int(x) for x in args.world_sizes.split(",")]:
        cell = Cell(conf["engine"], ws, conf["dtype"], tuple(tuple(kv) for kv in conf["options"]))
        try:
            row = estimate_one(w, cell, min(args.rank, ws - 1), args.fake_tensors)
        except Exception as err:  # one cell never stops the others
            traceback.print_exc()
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            row = {"status": "skipped",
                   "reason": f"cannot run under {'fake tensors' if args.fake_tensors else 'the fake process group'}: "
                             f"{type(err).__name__}: {first[:200]}"}
        rows.append({"world_size": ws, **row})
        write_json_atomic(args.out, rows)


if __name__ == "__main__":
    main()
