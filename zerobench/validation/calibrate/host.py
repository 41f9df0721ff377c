"""The host's costs on this machine, as host.json holds them ([Note: host cost] in
zerobench/instruments/vgpu/host.py):

* per call, enqueue only (the loop is timed, the device synchronised after it):
  ``x + 1``, ``x.add_(1)``, a small ``F.linear``, ``torch.empty``, ``Event.record``,
  ``Stream.wait_event``, ``with stream(s)``, ``record_stream``, and a call of nothing
  (``python_noop_us``, the loop's own cost);
* the Python work the host model prices by kind: a one-line call (``python_noop_us``),
  the same calling ``len`` (``c_builtin_us``), ``x.dim()`` (``torch_entry_us``),
  ``next`` of a generator (``generator_resume_us``), and the CPU's speed on host memory
  (``host_bytes_per_s``);
* a 1 MiB all-gather at world size 1, synchronous, and asynchronous with its ``wait()``;
* one training step of each of host.py's programs (``PROGRAMS``: an 8-layer MLP plain,
  under fully_shard, under FSDP1, and under the DDP, impl ZeRO-2 and DeepSpeed ZeRO-3
  adapters), timed, with its count of aten operators, and a cProfile of DeepSpeed
  ZeRO-3's step (where its host time goes, function by function);
* ``counts``: what one step of each program makes the host execute, counted on the
  virtual GPU in a fresh process (:func:`count_in_a_fresh_process`), which
  :func:`~zerobench.instruments.vgpu.host.from_measurements` fits the line and foreach
  prices with.

On a CPU it runs too (tests): the device module is ``torch.cpu``, whose streams and
events are stubs, and whose tensors cannot be ``record_stream``-ed: there is nothing to
record, and ``record_stream_us`` is 0.

    python -m zerobench.validation.calibrate.host measure OUT.json [--device cuda] [--budget-s 60] [--programs a,b]
    python -m zerobench.validation.calibrate.host count OUT.json      # the programs' counts only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import torch

from zerobench.engines.deepspeed import torch_as_found
from zerobench.instruments.vgpu.host import COUNTING, KINDS, PROGRAMS
from zerobench.validation.calibrate.devices import device_of

#: Steps run before the one counted or the ones timed (host.json's three).
WARMUP_STEPS = 3
#: The share of the budget the training steps get (the per-call loops share the rest).
PROGRAM_SHARE = 0.6


#: host.py's programs that are an engine's step, by the engine (zerobench/engines) that runs it.
ENGINE_PROGRAMS = {"ddp_mlp8": "ddp", "impl_zero2_mlp8": "impl-zero2", "deepspeed_zero3_mlp8": "deepspeed-zero3"}


def build_program(name: str, device: torch.device):
    """One of host.py's ``PROGRAMS`` on ``device``: a function running one training step
    (forward, backward, AdamW's foreach step, ``zero_grad``). FSDP's wrappers and the
    engines need a process group (of one rank) to be initialised."""
    import torch.nn as nn

    torch.manual_seed(0)
    width, layers, batch = 256, 8, 32
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]).to(device)
    data = torch.randn(batch, width, device=device)
    if name in ENGINE_PROGRAMS:
        return _engine_step(ENGINE_PROGRAMS[name], model, device, data)
    if name == "fsdp2_mlp8":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (1,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name == "fsdp1_mlp8":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
                                         device_id=device, use_orig_params=True)
    elif name != "plain_mlp8":
        raise ValueError(f"program: {name!r} is not allowed (allowed: {', '.join(PROGRAMS)})")
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)

    def step():
        model(data).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _engine_step(engine_name: str, model, device: torch.device, data):
    """One step of ``engine_name``'s adapter (zerobench/engines, with its default options,
    fp32) around the MLP: what ``zerobench run`` drives, a mean-squared loss against zeros."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from zerobench.engines import get_engine
    from zerobench.engines.base import OptimizerSpec, RankContext
    from zerobench.spec.matrix import engine_axes

    options = {name: axis.default for name, axis in engine_axes(engine_name).items()}
    ctx = RankContext(0, 1, 0, device, dist.get_backend())
    engine = get_engine(engine_name)(options, ctx, "fp32")
    engine.wrap(model, list(model))
    engine.build_optimizer(OptimizerSpec("adamw", 1e-3, {"foreach": True}))
    target = torch.zeros_like(data)
    return lambda: engine.train_step(data, target, F.mse_loss)


def count_programs(names=PROGRAMS) -> dict[str, dict[str, int]]:
    """What one step of each program makes the host execute on the virtual GPU, after
    :data:`WARMUP_STEPS` steps: program -> kind (host.py's KINDS) -> count. Each program
    runs in a fake process group of one rank, made and destroyed here (so none may be
    initialised). The counts depend on torch's code, not on this machine."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zerobench.instruments.vgpu import VirtualGpu

    if dist.is_initialized():
        raise RuntimeError("count_programs: a process group is initialised; the programs need one of their own")
    counts = {}
    for name in names:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        try:
            with torch_as_found(), VirtualGpu(gpu="h100-sxm", host=COUNTING) as gpu:
                step = build_program(name, torch.device("cpu"))
                for _ in range(WARMUP_STEPS):
                    step()
                gpu.host.block_until(max(s.tail for s in gpu.streams))
                before = Counter(gpu.host_counts)  # read after the clock, which charges the calls so far
                step()
                gpu.host.now  # noqa: B018 - reading the clock charges the step's last Python calls
                counts[name] = {kind: gpu.host_counts[kind] - before[kind] for kind in KINDS}
        finally:
            dist.destroy_process_group()
    return counts


def _sync_of(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _per_call_us(fn, sync, budget_s: float, reps: int = 5, most: int = 2000) -> float:
    """Median over ``reps`` loops of host time per call (enqueue only), microseconds; as
    many calls a loop as ``budget_s`` allows, between 20 and ``most``."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    per_call = max((time.perf_counter() - t0) / 20, 1e-7)
    sync()
    n = int(min(max(budget_s / reps / per_call, 20), most))
    loops = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        loops.append((time.perf_counter() - t0) / n)
        sync()
    return statistics.median(loops) * 1e6


def _aten_ops(step) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        step()
    return count.n


def _step_us(step, sync, budget_s: float, most: int = 30) -> float:
    for _ in range(WARMUP_STEPS):
        step()
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    n = int(min(max(budget_s / max(time.perf_counter() - t0, 1e-6), 3), most))
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def _forever():
    while True:
        yield None


def _host_bytes_per_s(budget_s: float) -> float:
    """The CPU's speed on host memory, one thread, as the virtual GPU prices an operator on
    host tensors (bytes read plus written a second): an fp32 multiply of 16 MiB into 16 MiB."""
    a, b = torch.ones(1 << 22), torch.empty(1 << 22)
    seconds = _per_call_us(lambda: torch.mul(a, 2.0, out=b), lambda: None, budget_s, reps=3, most=200) * 1e-6
    return 2 * a.numel() * a.element_size() / seconds


def _profile(step, steps: int = 3, top: int = 40) -> list[dict]:
    """cProfile of ``steps`` steps: the ``top`` functions by their own time, per step
    (cProfile's own cost per call included: it says where the time goes, not what it is)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{path}:{line}({name})", "calls": calls / steps, "own_us": own / steps * 1e6,
             "cumulative_us": cumulative / steps * 1e6}
            for (path, line, name), (_, calls, own, cumulative, _) in rows]


def measure(device: str | torch.device = "cuda", budget_s: float = 60.0, count: bool = True,
            programs=None) -> dict:
    """host.json's figures on ``device`` (cuda, or cpu for a test), within about
    ``budget_s`` seconds of timing, plus ``counts`` unless ``count`` is false
    (:func:`count_programs`, outside the budget: it runs on the virtual GPU). Makes its
    own process group of one rank. ``programs``: host.py's PROGRAMS (default all); one that
    fails is a ``<program>_error`` beside the others' figures. DeepSpeed ZeRO-3's step is
    also profiled (``deepspeed_zero3_mlp8_profile``: :func:`_profile`)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    device = device_of(device)  # init_process_group(device_id=...) needs cuda:N, not cuda
    programs = tuple(PROGRAMS if programs is None else programs)
    if budget_s <= 0:
        raise ValueError(f"budget_s: {budget_s!r} is not allowed (allowed: seconds > 0)")
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown:
        raise ValueError(f"programs: {', '.join(unknown)} not allowed (allowed: {', '.join(PROGRAMS)})")
    if dist.is_initialized():
        raise RuntimeError("measure: a process group is initialised; the measurement needs one of its own")
    sync = _sync_of(device)
    module = getattr(torch, device.type)
    calls_s = budget_s * (1 - PROGRAM_SHARE) / 15  # fifteen per-call figures
    out: dict = {"torch": torch.__version__, "python": sys.version.split()[0], "device": device.type,
                 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    x = torch.ones(16, device=device)
    w = torch.randn(64, 64, device=device)
    a = torch.randn(8, 64, device=device)
    few = [1, 2, 3]
    generator = _forever()
    out["python_noop_us"] = _per_call_us(lambda: None, sync, calls_s)
    out["c_builtin_us"] = _per_call_us(lambda: len(few), sync, calls_s)
    out["torch_entry_us"] = _per_call_us(lambda: x.dim(), sync, calls_s)
    out["generator_resume_us"] = _per_call_us(lambda: next(generator), sync, calls_s)
    out["host_bytes_per_s"] = _host_bytes_per_s(calls_s)
    out["add_out_of_place_us"] = _per_call_us(lambda: x + 1, sync, calls_s)
    out["add_inplace_us"] = _per_call_us(lambda: x.add_(1), sync, calls_s)
    out["linear_small_us"] = _per_call_us(lambda: F.linear(a, w), sync, calls_s)
    out["empty_alloc_us"] = _per_call_us(lambda: torch.empty(1024, device=device), sync, calls_s)
    stream, event = module.Stream(), module.Event()
    out["event_record_us"] = _per_call_us(lambda: event.record(), sync, calls_s)
    out["wait_event_us"] = _per_call_us(lambda: stream.wait_event(event), sync, calls_s)

    def switch():
        with module.stream(stream):
            pass

    out["stream_ctx_us"] = _per_call_us(switch, sync, calls_s)
    out["record_stream_us"] = (_per_call_us(lambda: x.record_stream(stream), sync, calls_s)
                               if device.type == "cuda" else 0.0)  # a CPU tensor has no stream to record
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        shard, gathered = torch.empty(1 << 18, device=device), torch.empty(1 << 18, device=device)  # 1 MiB
        out["all_gather_1mib_ws1_us"] = _per_call_us(lambda: dist.all_gather_into_tensor(gathered, shard), sync,
                                                     calls_s, most=500)
        out["all_gather_1mib_ws1_async_wait_us"] = _per_call_us(
            lambda: dist.all_gather_into_tensor(gathered, shard, async_op=True).wait(), sync, calls_s, most=500)
        for name in programs:
            try:
                with torch_as_found():  # what DeepSpeed leaves changed is not the next program's
                    step = build_program(name, device)
                    out[f"{name}_step_us"] = _step_us(step, sync, budget_s * PROGRAM_SHARE / len(programs))
                    out[f"{name}_aten_ops"] = _aten_ops(step)
                    if name == "deepspeed_zero3_mlp8":
                        out[f"{name}_profile"] = _profile(step)
            except Exception as err:  # noqa: BLE001 - one program's failure is a note; the others are kept
                out[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
    finally:
        dist.destroy_process_group()
    if count:
        out["counts"] = count_in_a_fresh_process(programs)
    return out


def count_in_a_fresh_process(programs=PROGRAMS) -> dict[str, dict[str, int]]:
    """:func:`count_programs` in a child process that sees no GPU: the counts are of the
    virtual GPU's CPU code path, and a process that has run the programs on a GPU is not
    fresh (DeepSpeed keeps the accelerator it chose, CUDA's, for the life of the process;
    its ZeRO-3 leaves ``F.linear`` replaced: ``torch_as_found``)."""
    import json
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "counts.json")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
        done = subprocess.run([sys.executable, "-m", "zerobench.validation.calibrate.host", "count", out,
                               "--programs", ",".join(programs)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"counting the host programs failed (exit {done.returncode}): "
                               f"{done.stderr.strip().splitlines()[-1:] or ''}")
        return json.loads(open(out).read())["counts"]


def main(argv=None) -> int:
    import json

    from zerobench.runs.files import write_json_atomic

    parser = argparse.ArgumentParser(prog="python -m zerobench.validation.calibrate.host",
                                     description="the host's costs (host.json), or the programs' counts")
    parser.add_argument("what", choices=("measure", "count"))
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    parser.add_argument("--budget-s", type=float, default=60.0, help="seconds of timing (default 60)")
    parser.add_argument("--programs", default=",".join(PROGRAMS),
                        help=f"comma-separated programs to time and count (default all: {', '.join(PROGRAMS)})")
    args = parser.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        parser.error(f"--device: {args.device!r} is not allowed (allowed: cuda, cpu)")
    programs = tuple(p for p in args.programs.split(",") if p)
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown or not programs:
        parser.error(f"--programs: {', '.join(unknown) or 'none'} not allowed (allowed: {', '.join(PROGRAMS)})")
    if args.what == "count":
        result = {"torch": torch.__version__, "counts": count_programs(programs)}
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device (use --device cpu)")
        result = measure(args.device, args.budget_s, programs=programs)
    write_json_atomic(args.out, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
