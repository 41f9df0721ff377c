"""One rank of one engine cell at any world size, in this process, against a fake process group.

``python -m zerobench.whatif.estimate.rank --workload W.json --cell-config C.json --world-sizes 2,4 --out O.json``
runs, for each world size in turn, a warm-up (the workload's ``run.memory_warmup_steps``)
and one measured step of the real engine adapter under the storage tracker, exactly as
the worker's memory pass does, but on a process group of backend "fake"
(``torch.testing._internal.distributed.fake_pg``): collectives return at once with
garbage contents, so memory is right and numerics are not. The parent
(``zerobench.whatif.estimate``) starts one such process per cell, so process-group state never
leaks between engines.

With ``--fake-tensors`` the model, batches and everything the engine allocates are
FakeTensors (no data), so a 7.5B-parameter model fits on a laptop; the tracker then
follows their meta storages. DDP's C++ reducer runs there too, with its small integer
bookkeeping kept real (``_fake_tensor_mode``). Engines whose code needs real data
(``.item()`` in an optimizer) fail there; the cell is reported skipped with the error.

``--backend`` names whose buffers the estimate counts besides the engine's own tensors:
``nccl`` (the default) none, as the fake group allocates nothing; ``gloo`` also the
full-input-size buffer gloo's reduce-scatter holds (``_gloo_reduce_scatter_buffers``),
to compare with the harness's CPU memory pass like for like.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from zerobench.spec import data as data_mod
from zerobench.instruments import collectives
from zerobench.instruments.collectives import Layer
from zerobench.engines import OptimizerSpec, RankContext, get_engine
from zerobench.runs.files import write_json_atomic
from zerobench.spec.matrix import Cell
from zerobench.instruments.memory import StorageTracker
from zerobench.spec.models import build_for_cell, loss_fn
from zerobench.spec.workload import Workload, parse_workload


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
        # A FakeTensor reports its fake device (cpu) but holds a meta storage, with no data pointer.
        key = (id(s), s.nbytes()) if s.device.type == "meta" else s.data_ptr()
        if key not in seen:
            seen.add(key)
            nbytes += s.nbytes()
    return nbytes, numel


def _batch(w: Workload, world: int, rank: int, step: int, fake: bool):
    d, m = w.data, w.model
    if fake:  # shapes only
        if getattr(m, "batch", ""):
            return data_mod.global_batch(m, d.batch_size, d.seed, step)
        if m.kind == "mlp":
            return torch.randn(d.batch_size, m.width), torch.randn(d.batch_size, m.width)
        return (torch.randint(0, m.vocab, (d.batch_size, m.seq_len)),
                torch.randint(0, m.vocab, (d.batch_size, m.seq_len)))
    inputs, targets = data_mod.rank_batch(m, d.batch_size, world, rank, d.seed, step)
    return inputs.clone(), targets.clone()  # own storages, not views of the global batch


def _fake_tensor_mode():
    """FakeTensorMode, except that small integer tensors on the host stay real.

    Engines keep bookkeeping in small int tensors that they exchange with the other
    ranks and then read as data: DDP's C++ reducer its bucket indices and sizes (through
    data pointers, when it rebuilds its buckets after the first iteration), impl's FSDP
    its first-iteration execution-order check (``.tolist()``), a DeviceMesh its rank
    layout. A FakeTensor has no data, so those stay real: what a non-random factory
    (``empty``, ``zeros``, ``arange``, ...) makes when the result is an integer host
    tensor of at most ``_HOST_CONTROL_MAX_NUMEL`` elements, and what any op makes from
    inputs that are all such real tensors. A few hundred bytes, outside the tracked
    (meta) storages. Every floating-point tensor, whatever its size, and every tensor
    derived from a fake one (the token ids of a fake batch included) stays fake.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._pytree import tree_leaves

    def small_host_int(t, device: torch.device) -> bool:
        return (device.type == "cpu" and not t.is_floating_point() and not t.is_complex()
                and t.numel() <= _HOST_CONTROL_MAX_NUMEL)

    class HostControlFakeMode(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if tensors and all(not isinstance(t, FakeTensor) and small_host_int(t, t.device) for t in tensors):
                with no_dispatch():
                    return func(*args, **kwargs)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if (not tensors and func.overloadpacket in _HOST_CONTROL_FACTORIES and isinstance(out, FakeTensor)
                    and small_host_int(out, out.fake_device)):
                with no_dispatch():  # the fake result said what it is: a small integer host tensor
                    return func(*args, **kwargs)
            return out

    return HostControlFakeMode(allow_non_fake_inputs=True)


#: The largest integer host tensor _fake_tensor_mode leaves real (elements).
_HOST_CONTROL_MAX_NUMEL = 1 << 16
#: Factories whose small integer host results _fake_tensor_mode leaves real (never random ones).
_HOST_CONTROL_FACTORIES = {torch.ops.aten.empty, torch.ops.aten.zeros, torch.ops.aten.ones, torch.ops.aten.full,
                           torch.ops.aten.arange, torch.ops.aten.scalar_tensor}


#: Backends whose own buffers the estimate can model (see the module docstring).
BACKENDS = ("nccl", "gloo")


class _GlooReduceScatterWork:
    """A fake group's reduce-scatter Work that, once waited, holds what gloo's does.

    gloo (torch 2.13) reduces a copy of the whole input: its Work allocates a buffer of
    the input's size when the collective is issued (on gloo's thread) and keeps it until
    the Work is dropped; ``wait()`` then splits it on the waiting thread and copies this
    rank's chunk into the output. The storage tracker, which sees only the waiting
    thread's operators, counts the buffer from that split until the Work is dropped, and
    so does this Work: ``wait()`` allocates it, and it lives as long as the Work.
    """

    def __init__(self, work, input_tensor: torch.Tensor):
        self._work = work
        self._input = input_tensor
        self._buffer = None

    def wait(self, timeout=None) -> bool:
        if self._buffer is None and self._input is not None:
            self._work.wait()
            self._buffer = torch.empty(self._input.numel(), dtype=self._input.dtype, device=self._input.device)
            self._input = None
        return True

    def __getattr__(self, name):  # is_completed, get_future, exception, ...: the fake group's
        return getattr(self._work, name)


class GlooReduceScatterBuffers(Layer):
    """A collective layer ([Note: one interception]) that gives the fake group's
    reduce-scatters the buffer gloo's hold: their Work is a :class:`_GlooReduceScatterWork`.
    A synchronous call is waited at once and its Work dropped on return, as gloo's is."""

    def issue(self, call, issue):
        work = issue()
        if call.name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            return _GlooReduceScatterWork(work, call.input())
        return work


def _backend_buffers(backend: str):
    """The backend's own buffers to model (``estimate`` has checked ``backend``)."""
    return collectives.intercepted(GlooReduceScatterBuffers()) if backend == "gloo" else contextlib.nullcontext()


@contextlib.contextmanager
def _single_rank_ddp():
    """DDP's constructor checks that every rank holds parameters of the same shapes by
    exchanging them as data. One rank against a fake group has no one to disagree with,
    and under fake tensors the shapes cannot be read as data: the check is skipped."""
    from unittest import mock

    with mock.patch("torch.nn.parallel.distributed._verify_param_shape_across_processes", lambda *a, **k: None):
        yield


def estimate_one(w: Workload, cell: Cell, rank: int, fake: bool, backend: str = "nccl") -> dict:
    """Peak and composition of ``rank`` for ``cell`` (its world size) on a fake process group,
    with ``backend``'s own buffers (see the module docstring)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    world = cell.world_size
    started = time.perf_counter()
    dist.init_process_group("fake", world_size=world, rank=rank, store=FakeStore())
    try:
        ctx = RankContext(rank, world, rank, torch.device("cpu"), "fake")
        spec = OptimizerSpec(w.optimizer.kind, w.optimizer.lr, w.optimizer.hyper())
        loss = loss_fn(w.model)
        mode = _fake_tensor_mode() if fake else contextlib.nullcontext()
        with mode, (_single_rank_ddp() if fake else contextlib.nullcontext()), _backend_buffers(backend):
            tracker = StorageTracker("meta" if fake else "cpu", timeline=False)
            grads = []
            with tracker:
                engine = get_engine(cell.engine)(cell.opts, ctx, cell.dtype)
                model, units = build_for_cell(w.model, w.seed, None, cell.opts.get("activation_checkpointing", "none"))
                engine.wrap(model, units)
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
    parser = argparse.ArgumentParser(prog="python -m zerobench.whatif.estimate.rank")
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--cell-config", type=Path, required=True, help="JSON: engine, dtype, options")
    parser.add_argument("--world-sizes", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--fake-tensors", action="store_true")
    parser.add_argument("--backend", choices=BACKENDS, default="nccl")
    parser.add_argument("--layers", default="",
                        help="comma-separated depths to run the model at instead of its own (see zerobench.whatif.estimate.depth)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    w = parse_workload(json.loads(args.workload.read_text()), source=str(args.workload))
    conf = json.loads(args.cell_config.read_text())
    rows = []
    depths = [int(x) for x in args.layers.split(",")] if args.layers else [None]
    for ws, layers in [(int(x), d) for x in args.world_sizes.split(",") for d in depths]:
        cell = Cell(conf["engine"], ws, conf["dtype"], tuple(tuple(kv) for kv in conf["options"]))
        at_depth = w if layers is None else dataclasses.replace(w, model=dataclasses.replace(w.model, layers=layers))
        try:
            row = estimate_one(at_depth, cell, min(args.rank, ws - 1), args.fake_tensors, args.backend)
        except Exception as err:  # one cell never stops the others
            traceback.print_exc()
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            row = {"status": "skipped",
                   "reason": f"cannot run under {'fake tensors' if args.fake_tensors else 'the fake process group'}: "
                             f"{type(err).__name__}: {first[:200]}"}
        rows.append({"world_size": ws, **({} if layers is None else {"layers": layers}), **row})
        write_json_atomic(args.out, rows)


if __name__ == "__main__":
    main()
