"""The GPU-only checks of ``scripts/gpu-check`` (also used by ``pytest -m cuda``).

``python -m zerobench.validation.gpu_check probe-gloo OUT.json``: which collectives the engines use
work under gloo with CUDA tensors (two ranks on one GPU).
``python -m zerobench.validation.gpu_check overlap OUT.json``: how much of the all-gather time
impl.fsdp's prefetch hides, and how much is exposed without it.
``python -m zerobench.validation.gpu_check limiter OUT.json``: the memory a forward holds with
and without ``limit_all_gathers``. Each writes its figures and ``"pass": true/false`` and
exits 0 on pass, 1 on fail; ``--virtual`` before the check's name runs it on the virtual GPU,
``--ranks N`` with one rank per GPU ([Note: checks on every GPU]).
``python -m zerobench.validation.gpu_check busbw OUT.json``: all-gather and reduce-scatter bus
bandwidth over the GPUs present.

[Note: GPU checks]
On one GPU both impl checks run at world size 1 with NCCL and HYBRID_SHARD over a shard
group of one rank (on several, FULL_SHARD across them: [Note: checks on every GPU]): every unit then goes through the real unshard path (all-gather on the unshard
stream, free after use, limiter) with a local copy as its "all-gather". Compute is
``torch.cuda._sleep`` on the compute stream, in forward and backward, so its duration
is known. What each check measures, and why, comes from what PyTorch's caching
allocator does (c10/cuda/CUDACachingAllocator.cpp) and from the first run on a real GPU
(results/gpu/h200-20261126/, the checks at 37a988a), which the virtual GPU now
reproduces (zerobench/validation/replay.py):

* What the limiter bounds. impl frees a unit's unsharded buffer (allocated on the
  unshard stream, read on compute) after ``record_stream(compute)``. The allocator then
  lowers *allocated* at once, but keeps the block *active* -- out of the cache, not
  reusable -- until an event it records on the compute stream at the free has
  completed. It looks at those events only at the top of its next ``malloc`` (and in
  ``empty_cache``); ``torch.cuda.synchronize()`` and ``memory_stats()`` do not. So a
  host that runs ahead of the device piles up active blocks: one per unit whose free
  it has passed and the device has not. That pile, the peak of ``active_bytes`` above
  what is allocated before the pass, is what ``limit_all_gathers`` bounds: before each
  all-gather the host blocks on the free event ``depth`` frees back, whose block the
  next ``malloc`` then reuses, so about ``depth`` unit buffers are active at a time.
  The check's bound is ``depth + 1`` units. No NCCL collective touches these buffers
  (the shard group has one rank: the "all-gather" is a copy on the unshard stream), so
  how ProcessGroupNCCL keeps a collective's tensors alive (``record_stream`` onto its
  own stream, or stashed until ``wait()``: [Note: collective tensors] in
  zerobench/instruments/vgpu/device.py) does not enter this check; in a world of many
  ranks, where it records them, the NCCL stream's uses join the same pile.
* The baseline. At 37a988a the check read ``active_bytes`` after ``synchronize()`` as
  its baseline. The blocks the warm-up forward freed were still active then (no
  ``malloc`` had looked at their events), so the baseline held the whole pile already:
  on the H200, peak active above it was 0.003 units with the limiter and without, and
  peak *allocated* above it -1 and -11 (the pile of 2 and of 12 units). The check now
  makes the allocator notice the completed frees first (one small allocation after the
  synchronisation), resets the peaks, and then takes the baseline, before any
  all-gather of the measured forward. It records what was still pending there
  (``pending_at_base_units``, 0 by construction).
* Reserved memory and host time are reported beside it: the limiter also bounds how
  many unshard-stream segments the allocator ever needs (H200: 1.81 GB reserved with it,
  3.36 GB without), and it costs host time (H200: 202 ms to enqueue the forward with it,
  40 stalls over the warm-up and measured forwards, against 3.4 ms without).
* Overlap. At 37a988a the host ran far ahead of the device (the H200's host spent about
  0.3 ms on a unit, by the limiter check's 3.4 ms for 12, against 4 ms of compute per
  unit and direction), so every all-gather was issued long before
  its unit computed, prefetch or not: the unshard stream waits only for the sharded
  parameters (``params_ready``), not for compute, and ran every delayed gather ahead of
  the compute that needed it. Prefetch hid 0.985 of the delay and no prefetch 0.981.
  Prefetch matters where the host is not ahead (PyTorch's docs: forward prefetch is for
  CPU-bound steps): the host reaches a unit's pre-forward only once the device is about
  done with the previous unit. The check now builds that step: the host waits for each
  unit's compute before it goes on (``_Sleep`` with ``host_waits``), in forward and in
  backward. Without prefetch each all-gather is then issued to an idle unshard stream
  while compute waits for it: all of its time is exposed. With prefetch (forward
  prefetch and BACKWARD_PRE) the next unit's all-gather is issued before the current
  unit's compute and runs beside it; only the first gather of forward and of backward
  has nothing to hide behind. Exposed time = step time with the delay - step time
  without it; the check passes when prefetch hides at least ``HIDDEN_MIN`` of the
  delayed gathers' time and no prefetch exposes at least ``EXPOSED_MIN`` of it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

UNITS = 12  # limiter check
UNIT_MB = 64
OVERLAP_UNITS = 24  # overlap check: only the first gather of forward and of backward cannot be hidden
HIDDEN_MIN = 0.9  # overlap check: the share of the delayed gathers' time prefetch must hide
EXPOSED_MIN = 0.8  # ... and the share that must be exposed without prefetch


#: Target's worlds: a world of one rank of its own, or the world the environment describes.
WORLDS = ("one", "env")


class Target:
    """Where a check runs: a world of one rank (zerobench/rank/worlds.py) on a real GPU
    (``torch.cuda``, the first visible GPU, NCCL) or on the virtual one
    (zerobench.instruments.vgpu: its device module, CPU tensors, a fake process group).
    The checks below are written once against this, so ``--virtual`` runs the same check
    code as a GPU does. The device is the world's, always with its index."""

    def __init__(self, virtual: bool = False, world: str = "one", **vgpu_options):
        """``world``: "one", a world of one rank of its own; "env", this process as one rank
        of the world its torchrun environment describes (the checks on every GPU of a node,
        :func:`on_ranks`: NCCL between GPUs, or with ``virtual`` gloo between virtual GPUs)."""
        if world not in WORLDS:
            raise ValueError(f"Target: world {world!r} is not allowed (allowed: {', '.join(WORLDS)})")
        self.virtual = virtual
        self.world_kind = world
        self.size = 1  # ranks in the world, once entered
        if virtual:
            from zerobench.instruments.vgpu import VirtualGpu

            self.gpu = VirtualGpu(**vgpu_options)
            self.module = self.gpu
            self.device = torch.device("cpu")
            self.device_id = None
        else:
            self.gpu = None
            self.module = torch.cuda
            self.device = self.device_id = None  # the world's, once entered
        self.world = None
        self.sharding: str | None = None  # how _wrap shards the check's model (FULL_SHARD over N ranks, or one)

    def __enter__(self) -> "Target":
        from zerobench.rank.worlds import FakeWorld, TorchrunWorld

        self.groups = None
        if dist.is_initialized():  # inside a world someone else made (pytest -m cuda)
            if self.gpu is not None:
                self.gpu.__enter__()
            elif self.device is None:
                self.device = self.device_id = torch.device("cuda", torch.cuda.current_device())
            return self
        if self.world_kind == "one" and self.virtual:
            self.world = FakeWorld(1, gpu=self.gpu)
        else:
            if self.world_kind == "one":
                _one_rank_env()
            self.world = TorchrunWorld("cpu" if self.virtual else "cuda")
            if not self.virtual:
                self.device = self.device_id = self.world.device
        self.world.__enter__()
        self.size = self.world.size
        if self.virtual and self.world_kind == "env":  # a virtual GPU per rank, over real gloo collectives
            self.gpu.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.virtual and self.world_kind == "env" and self.world is not None:
            self.gpu.__exit__(*exc)
        if self.world is not None:
            world, self.world = self.world, None
            world.__exit__(*exc)
        elif self.gpu is not None:
            self.gpu.__exit__(*exc)


def _one_rank_env() -> None:
    """The torchrun environment of a world of one rank on this machine, whatever the
    environment held: values inherited from a Slurm step or a torchrun job (RANK 5 of 16,
    a MASTER_ADDR on another node) would make this process wait for ranks that never come."""
    from zerobench.harness.launch import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def _init_single() -> None:
    """A process group of one rank on the first visible GPU (NCCL), left open: for GPU tests and scripts."""
    if not dist.is_initialized():
        from zerobench.rank.worlds import TorchrunWorld

        _one_rank_env()
        TorchrunWorld("cuda").__enter__()


def cycles_per_ms(module=torch.cuda, samples: int = 10, trim: int = 2, cycles: int = 10_000_000) -> float:
    """How many ``_sleep`` cycles take a millisecond on this GPU (``module``: torch.cuda,
    or the virtual GPU standing in for it).

    The mean of ``samples`` timed sleeps of ``cycles`` each, leaving out the ``trim``
    fastest and ``trim`` slowest: the first launch pays for initialisation and another
    process may share the GPU, and one sample would carry either into every duration
    the checks derive from it. (PyTorch's tests calibrate the same way:
    ``get_cycles_per_ms`` in torch/testing/_internal/common_utils.py.)"""
    if samples <= 2 * trim:
        raise ValueError(f"cycles_per_ms: samples ({samples}) must be more than 2 * trim ({trim})")
    module.synchronize()
    rates = []
    for _ in range(samples):
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        start.record()
        module._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / start.elapsed_time(end))
    kept = sorted(rates)[trim:samples - trim]
    return sum(kept) / len(kept)


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each keep the device busy for ``cycles``; with
    ``host_waits`` the host then waits for that compute before it goes on (a step whose
    host has no lead over the device: see [Note: GPU checks])."""

    @staticmethod
    def forward(ctx, x, cycles, module, host_waits=False):
        ctx.cycles, ctx.module, ctx.host_waits = cycles, module, host_waits
        module._sleep(cycles)
        if host_waits:
            module.current_stream().synchronize()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.module._sleep(ctx.cycles)
        if ctx.host_waits:
            ctx.module.current_stream().synchronize()
        return grad.clone(), None, None, None


class _Unit(nn.Module):
    def __init__(self, width: int, cycles: int, module, host_waits: bool = False):
        super().__init__()
        self.lin = nn.Linear(width, width, bias=False)
        self.cycles = cycles
        self.module = module
        self.host_waits = host_waits

    def forward(self, x):
        return _Sleep.apply(self.lin(x), self.cycles, self.module, self.host_waits)


class _Model(nn.Module):
    def __init__(self, units: int, width: int, cycles: int, module, host_waits: bool = False):
        super().__init__()
        self.units = nn.ModuleList(_Unit(width, cycles, module, host_waits) for _ in range(units))

    def forward(self, x):
        for u in self.units:
            x = u(x)
        return x


def _wrap(model: nn.Module, target: Target, **kwargs):
    from impl.fsdp import FullyShardedDataParallel as FSDP
    from impl.fsdp import ShardingStrategy

    if dist.get_world_size() > 1:  # every GPU of the node: real all-gathers between them ([Note: checks on every GPU])
        target.sharding = f"FULL_SHARD over {dist.get_world_size()} ranks"
        wrap = dict(process_group=dist.group.WORLD, sharding_strategy=ShardingStrategy.FULL_SHARD,
                    device_id=target.device_id, **kwargs)
    else:
        target.sharding = "HYBRID_SHARD, a shard group of one rank"
        if getattr(target, "groups", None) is None:  # shard group of 1: see [Note: GPU checks]
            target.groups = (dist.group.WORLD, dist.new_group([0]))
        wrap = dict(process_group=target.groups, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                    device_id=target.device_id, **kwargs)
    for i, u in enumerate(model.units):
        model.units[i] = FSDP(u, **wrap)
    return FSDP(model, **wrap)


class _DelayedGathers:
    """Enqueue ``cycles`` of sleep on the stream each all-gather runs on."""

    def __init__(self, cycles: int, module):
        self.cycles = cycles
        self.module = module
        self.count = 0

    def __enter__(self):
        from impl.fsdp import collectives

        self._real = collectives.all_gather_flat

        def slow(output, input, group, group_size):
            self.count += 1
            if self.cycles:
                self.module._sleep(self.cycles)
            return self._real(output, input, group, group_size)

        collectives.all_gather_flat = slow
        return self

    def __exit__(self, *exc):
        from impl.fsdp import collectives

        collectives.all_gather_flat = self._real


def _step_ms(target: Target, prefetch: bool, gather_cycles: int, compute_cycles: int, units: int,
             steps: int = 3) -> tuple[float, int]:
    """The shortest of ``steps`` timed steps (forward and backward, the host waiting for
    each unit's compute) and the all-gathers per step, with each gather delayed by
    ``gather_cycles``."""
    from impl.fsdp import BackwardPrefetch

    m = target.module
    torch.manual_seed(0)
    model = _wrap(_Model(units, 256, compute_cycles, m, host_waits=True).to(target.device), target,
                  forward_prefetch=prefetch, backward_prefetch=BackwardPrefetch.BACKWARD_PRE if prefetch else None)
    return timed_steps(target, model, torch.randn(8, 256, device=target.device), gather_cycles, steps)


def timed_steps(target: Target, model: nn.Module, x: torch.Tensor, gather_cycles: int,
                steps: int) -> tuple[float, int]:
    """After one warm-up step (and the first-iteration order record): the shortest of
    ``steps`` steps of ``model`` timed by device events, each all-gather delayed by
    ``gather_cycles``, and the all-gathers per step."""
    m = target.module
    model(x).sum().backward()
    times = []
    with _DelayedGathers(gather_cycles, m) as delayed:
        for _ in range(steps):
            m.synchronize()
            start, end = m.Event(enable_timing=True), m.Event(enable_timing=True)
            start.record()
            model(x).sum().backward()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return min(times), delayed.count // steps


def overlap_check(target: Target | None = None, gather_ms: float = 2.0, compute_ms: float = 4.0,
                  units: int = OVERLAP_UNITS, steps: int = 3) -> dict:
    """How much of the delayed all-gathers' time is exposed, with prefetch and without, in
    a step whose host waits for each unit's compute. See [Note: GPU checks].

    exposed = step with the delay - step without it; hidden fraction = 1 - exposed /
    (gathers x delay). Passes when prefetch hides at least ``HIDDEN_MIN`` and no prefetch
    exposes at least ``EXPOSED_MIN`` (a check that passed either way would show nothing)."""
    target = target or Target()
    with target:
        m = target.module
        cpm = cycles_per_ms(m)
        g, c = int(gather_ms * cpm), int(compute_ms * cpm)
        out = {"cycles_per_ms": cpm, "units": units, "gather_ms": gather_ms, "compute_ms": compute_ms,
               "host_waits_for_compute": True, "hidden_min": HIDDEN_MIN, "exposed_min": EXPOSED_MIN,
               "virtual": target.virtual}
        for name, prefetch in (("prefetch", True), ("no_prefetch", False)):
            base, _ = _step_ms(target, prefetch, 0, c, units, steps)
            delayed, gathers = _step_ms(target, prefetch, g, c, units, steps)
            all_gather_ms = gathers * gather_ms
            exposed = max(delayed - base, 0.0)
            share = min(exposed / all_gather_ms, 1.0) if all_gather_ms > 0 else 0.0
            out[name] = {"step_ms_without_delay": base, "step_ms_with_delay": delayed, "gathers_per_step": gathers,
                         "all_gather_ms": all_gather_ms, "exposed_ms": exposed, "exposed_fraction": share,
                         "hidden_fraction": 1 - share if all_gather_ms > 0 else 0.0}
    out["hidden_fraction"] = out["prefetch"]["hidden_fraction"]
    out["exposed_fraction_without_prefetch"] = out["no_prefetch"]["exposed_fraction"]
    out["pass"] = out["hidden_fraction"] >= HIDDEN_MIN and out["exposed_fraction_without_prefetch"] >= EXPOSED_MIN
    return out


WARMUP_LIMIT = 8  # warm-up forwards of the limiter check, at most


def notice_completed_frees(target: Target) -> None:
    """Make the caching allocator release the freed blocks whose streams have passed their
    free: it looks at those events only when it next allocates (see [Note: GPU checks]),
    so allocate one small block. Call after synchronising."""
    torch.empty(1, device=target.device)


def _wrap_fsdp1(model: nn.Module, target: Target, limit: bool):
    """``model`` under torch's FSDP1, one unit per block, FULL_SHARD over every rank (FSDP1's
    limiter has a fixed depth of 2: ``_FreeEventQueue``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp import ShardingStrategy

    device_id = target.device_id if target.device_id is not None else torch.device("cpu")
    wrap = dict(process_group=dist.group.WORLD, sharding_strategy=ShardingStrategy.FULL_SHARD,
                device_id=device_id, limit_all_gathers=limit)
    for i, u in enumerate(model.units):
        model.units[i] = FSDP1(u, **wrap)
    return FSDP1(model, **wrap)


#: The engines of the limiter check: impl's FSDP, and torch's FSDP1 beside it (on 2 ranks or more).
LIMITER_ENGINES = ("impl", "torch-fsdp1")


def _on_every_rank(flag: bool, target: Target) -> bool:
    """Whether ``flag`` holds on every rank of the check's world (a MIN all-reduce that no
    instrument sees, as zerobench/rank/worlds.py's ``World.all_true``)."""
    if dist.get_world_size() == 1:
        return flag
    from torch.distributed import distributed_c10d

    agreed = torch.tensor([int(flag)], dtype=torch.int32, device=target.device)
    distributed_c10d.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def _forward_peak(target: Target, limit: bool, depth: int, compute_cycles: int, units: int, unit_mb: float,
                  empty_cache: bool = False, engine: str = "impl") -> dict:
    m = target.module
    width = int((unit_mb * 2**20 / 4) ** 0.5)
    unit_bytes = width * width * 4
    # What an earlier model still holds (impl's units are kept alive by a reference cycle
    # through their gradient hooks, which Python's collector does not break), so that
    # this model's reserved memory can be told from it.
    reserved_before = m.memory_stats()["reserved_bytes.all.current"]
    torch.manual_seed(0)
    if engine == "impl":
        model = _wrap(_Model(units, width, compute_cycles, m).to(target.device), target, limit_all_gathers=limit,
                      limiter_depth=depth)
    else:
        model = _wrap_fsdp1(_Model(units, width, compute_cycles, m).to(target.device), target, limit)
    x = torch.randn(4, width, device=target.device)
    with torch.no_grad():
        # Warm-up, until the cache stops growing: it leaves the blocks the measured forward
        # reuses in the cache. One is not enough where cudaMalloc synchronises: each new
        # segment stops the host's run-ahead, so a forward caches only as many blocks as
        # it got ahead by, and the next forward gets further.
        reserved = -1
        for _ in range(WARMUP_LIMIT):
            model(x)
            m.synchronize()
            # every rank stops together: one that went on alone would wait for its peers' gathers
            if _on_every_rank(m.memory_stats()["reserved_bytes.all.current"] == reserved, target):
                break
            reserved = m.memory_stats()["reserved_bytes.all.current"]
        # No empty_cache() here (``empty_cache`` is for the test that shows why): cudaFree
        # and the cudaMallocs it makes necessary can synchronise the host, and the measured
        # forward needs the host free to run ahead.
        if empty_cache:
            m.empty_cache()
        # The baseline, before any all-gather of the measured forward: see [Note: GPU checks].
        notice_completed_frees(target)
        m.reset_peak_memory_stats()
        base = m.memory_stats()
        if engine == "impl":
            model.limiter_metrics()  # the warm-up's counters, dropped
        start = target.gpu.host_clock() if target.virtual else time.perf_counter()
        model(x)
        enqueue_s = (target.gpu.host_clock() if target.virtual else time.perf_counter()) - start
        m.synchronize()
    stats = m.memory_stats()
    metrics = model.limiter_metrics() if engine == "impl" else {"limiter_stalls": None}
    del model
    m.empty_cache()
    active, allocated = base["active_bytes.all.current"], base["allocated_bytes.all.current"]
    return {"peak_active_above_base_units": (stats["active_bytes.all.peak"] - allocated) / unit_bytes,
            "peak_allocated_above_base_units": (stats["allocated_bytes.all.peak"] - allocated) / unit_bytes,
            "pending_at_base_units": (active - allocated) / unit_bytes,
            "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
            "model_reserved_bytes": stats["reserved_bytes.all.peak"] - reserved_before, "unit_bytes": unit_bytes,
            "cpu_enqueue_ms": enqueue_s * 1e3, "limiter_stalls": metrics["limiter_stalls"]}


def limiter_check(target: Target | None = None, depth: int = 2, compute_ms: float = 20.0, units: int = UNITS,
                  unit_mb: float = UNIT_MB, empty_cache: bool = False) -> dict:
    """The peak of the unit buffers a forward holds (active above what is allocated before
    it), with and without ``limit_all_gathers``, in units. Passes when it is within
    ``depth + 1`` units with the limiter and beyond that without it. See [Note: GPU checks]."""
    target = target or Target()
    fsdp1 = None
    with target:
        c = int(compute_ms * cycles_per_ms(target.module))
        on, off = (_forward_peak(target, limit, depth, c, units, unit_mb, empty_cache) for limit in (True, False))
        if target.size > 1:  # FSDP1 runs NO_SHARD, nothing gathered, with a shard group of one rank
            fsdp1 = {"with_limiter": _forward_peak(target, True, 2, c, units, unit_mb, empty_cache, "torch-fsdp1"),
                     "without_limiter": _forward_peak(target, False, 2, c, units, unit_mb, empty_cache, "torch-fsdp1")}
    bound = depth + 1
    for result in (on, off):
        result["within_bound"] = result["peak_active_above_base_units"] <= bound + 0.25
    out = {"units": units, "unit_mb": unit_mb, "depth": depth, "compute_ms": compute_ms, "bound_units": bound,
           "with_limiter": on, "without_limiter": off, "virtual": target.virtual}
    out["torch_fsdp1"] = fsdp1 if fsdp1 is not None else (
        "not run: torch's FSDP1 runs NO_SHARD with a shard group of one rank (one GPU); it runs on every GPU of a "
        "node of several")
    out["pass"] = on["within_bound"] and not off["within_bound"] and on["limiter_stalls"] > 0
    return out


# -- gloo with CUDA tensors -------------------------------------------------------------

# The collectives the engines issue (impl via impl.comm; DDP, ZeRO-1 and FSDP1/2 inside torch).
PROBES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast", "all_gather",
          "reduce_scatter", "barrier")


def _probe_rank(rank: int, world: int, port: int, out: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device("cuda", 0)
    results = {}
    for name in PROBES:
        try:
            x = torch.full((4,), float(rank + 1), device=dev)
            if name == "all_gather_into_tensor":
                o = torch.empty(4 * world, device=dev)
                dist.all_gather_into_tensor(o, x)
                ok = o.view(world, 4)[:, 0].tolist() == [float(r + 1) for r in range(world)]
            elif name == "reduce_scatter_tensor":
                o = torch.empty(2, device=dev)
                dist.reduce_scatter_tensor(o, x)
                ok = o.tolist() == [float(sum(range(1, world + 1)))] * 2
            elif name == "all_reduce":
                dist.all_reduce(x)
                ok = x[0].item() == sum(range(1, world + 1))
            elif name == "broadcast":
                dist.broadcast(x, src=0)
                ok = x[0].item() == 1.0
            elif name == "all_gather":
                outs = [torch.empty(4, device=dev) for _ in range(world)]
                dist.all_gather(outs, x)
                ok = [t[0].item() for t in outs] == [float(r + 1) for r in range(world)]
            elif name == "reduce_scatter":
                o = torch.empty(2, device=dev)
                dist.reduce_scatter(o, list(x.chunk(world)))
                ok = o[0].item() == sum(range(1, world + 1))
            else:
                dist.barrier()
                ok = True
            torch.cuda.synchronize()
            results[name] = "ok" if ok else "wrong result"
        except Exception as e:  # noqa: BLE001 - the answer is what failed and how
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def probe_gloo(world: int = 2, timeout_s: float = 120.0) -> dict:
    """Run the probe's ranks; any rank still running after ``timeout_s`` (one stuck in a
    collective its peer never joined, say) is killed, with the others, before this returns."""
    from zerobench.harness.launch import free_port, start_module

    port = free_port()
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"zerobench-gloo-probe-{os.getpid()}.json"
    procs = [start_module("zerobench.validation.gpu_check", ["_probe-rank", str(r), str(world), str(port), str(out)])
             for r in range(world)]
    timed_out = _wait_all(procs, timeout_s)
    codes = [p.returncode for p in procs]
    results = json.loads(out.read_text()) if out.exists() else {}
    out.unlink(missing_ok=True)
    result = {"torch": torch.__version__, "world_size": world, "exit_codes": codes, "collectives": results,
              "all_ok": bool(results) and all(v == "ok" for v in results.values()),
              "pass": not timed_out and codes == [0] * world}
    if timed_out:
        result["error"] = f"timed out after {timeout_s:g} s; ranks still running were killed"
    return result


def _wait_all(procs: list, timeout_s: float) -> bool:
    """Wait for every process; kill those still running after ``timeout_s`` (or when this
    process is interrupted). Returns whether it timed out."""
    import subprocess

    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for p in procs:  # on a timeout, or when this process is interrupted
            if p.poll() is None:
                p.kill()
                p.wait()
    return timed_out


# -- the checks on every GPU of a node ----------------------------------------------------

# [Note: checks on every GPU]
# On a node of N > 1 GPUs, scripts/gpu-check runs the overlap and limiter checks with one
# rank per GPU (:func:`on_ranks`): N processes started as torchrun would (RANK, LOCAL_RANK,
# WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_*), each a ``Target(world="env")`` on its own GPU
# (zerobench/rank/devices.py), FULL_SHARD over all N ranks: every all-gather moves real
# data between GPUs over NCCL, and ProcessGroupNCCL's own hold on a collective's tensors
# joins the pile the limiter bounds ([Note: GPU checks]). Each rank writes its result;
# the check passes when every rank's does, and reports rank 0's figures with every rank's
# verdict. With ``virtual`` the same ranks run on CPUs over gloo, a virtual GPU each
# (whose collectives still move real data): the code path, tested without a GPU
# (tests/test_gpu_check_ranks.py).

#: The checks :func:`on_ranks` runs on every rank.
RANK_CHECKS = ("overlap", "limiter")


def on_ranks(check: str, ranks: int, out: Path, virtual: bool = False, timeout_s: float = 120.0,
             **check_kwargs) -> dict:
    """Run ``check`` ("overlap" or "limiter") with one rank per GPU (``ranks`` of them):
    [Note: checks on every GPU]. Ranks still running after ``timeout_s`` are killed."""
    if check not in RANK_CHECKS:
        raise ValueError(f"on_ranks: check {check!r} is not allowed (allowed: {', '.join(RANK_CHECKS)})")
    if ranks < 2:
        raise ValueError(f"on_ranks: ranks must be at least 2, got {ranks}")
    from zerobench.harness.launch import free_port, start_module

    out = Path(out)
    port = free_port()
    rank_files = [out.with_name(f".{out.name}.rank{r}") for r in range(ranks)]
    args = ["_rank-check", check, json.dumps(check_kwargs)] + (["--virtual"] if virtual else [])
    procs = []
    for rank, path in enumerate(rank_files):
        path.unlink(missing_ok=True)
        env = {**os.environ, **rank_environ(rank, ranks, port)}
        procs.append(start_module("zerobench.validation.gpu_check", [*args, str(path)], env=env))
    timed_out = _wait_all(procs, timeout_s)
    results = []
    for path in rank_files:
        results.append(json.loads(path.read_text()) if path.exists() else None)
        path.unlink(missing_ok=True)
    codes = [p.returncode for p in procs]
    first = results[0] or {}
    merged = {**first, "world_size": ranks, "exit_codes": codes,
              "ranks": [None if r is None else {"pass": r["pass"], "device": r.get("device"), "sharding": r.get("sharding")}
                        for r in results],
              "pass": not timed_out and all(r is not None and r["pass"] for r in results)}
    if timed_out:
        merged["error"] = f"timed out after {timeout_s:g} s; ranks still running were killed"
    elif any(r is None for r in results):
        merged["error"] = f"rank(s) {', '.join(str(i) for i, r in enumerate(results) if r is None)} wrote no result"
    return merged


def rank_environ(rank: int, ranks: int, port: int) -> dict[str, str]:
    """The torchrun variables of rank ``rank`` of :func:`on_ranks`' world on this node."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _rank_check(check: str, kwargs: dict, virtual: bool, out: Path) -> int:
    """One rank of :func:`on_ranks`: the check on this rank's device, its result to ``out``."""
    from zerobench.runs.files import write_json_atomic

    target = Target(virtual=virtual, world="env")
    result = {"overlap": overlap_check, "limiter": limiter_check}[check](target, **kwargs)
    result.update(device=str(target.device), sharding=target.sharding)
    result["rank"] = int(os.environ["RANK"])
    write_json_atomic(out, result)
    return 0


def busbw(budget_s: float = 30.0, ranks: int | None = None, device_type: str = "cuda", size: str = "check") -> dict:
    """All-gather and reduce-scatter bus bandwidth over the GPUs present (or ``ranks`` CPU
    ranks over gloo), at a few sizes: zerobench/validation/calibrate/collectives.py."""
    from zerobench.validation.calibrate import collectives

    measured = collectives.measure(torch.device(device_type), size, budget_s, print, ranks,
                                   kinds=("all_gather", "reduce_scatter"))
    rows = measured.get("rows", [])
    return {**measured, "pass": bool(rows) and all(r["busbw_gbps"] > 0 for r in rows)}


def cells_check(runs_root: str) -> dict:
    """The status of every cell of the one run folder under ``runs_root``."""
    from zerobench.runs.folder import RunFolder

    runs = sorted(p for p in Path(runs_root).iterdir() if RunFolder(p).workload_path.exists())
    if len(runs) != 1:
        return {"pass": False, "error": f"expected one run folder under {runs_root}, found {len(runs)}"}
    cells = {}
    for rec in RunFolder(runs[0]).cell_records():  # a damaged record reads as a failed cell naming it
        cells[rec["cell_id"]] = {"status": rec.get("status"), "error": (rec.get("error") or "")[:300],
                                 "backend": rec.get("backend"), "device": rec.get("device")}
    statuses = [c["status"] for c in cells.values()]
    return {"run": str(runs[0]), "cells": cells, "ok": statuses.count("ok"),
            "skipped": statuses.count("skipped"), "failed": len(statuses) - statuses.count("ok") - statuses.count("skipped"),
            "pass": bool(statuses) and all(s in ("ok", "skipped") for s in statuses) and "ok" in statuses}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "_probe-rank":
        _probe_rank(int(argv[1]), int(argv[2]), int(argv[3]), argv[4])
        return 0
    if argv and argv[0] == "_rank-check":
        virtual = "--virtual" in argv
        check, kwargs, out = [a for a in argv[1:] if a != "--virtual"]
        return _rank_check(check, json.loads(kwargs), virtual, Path(out))
    if argv and argv[0] == "cells" and len(argv) == 3:
        result = cells_check(argv[1])
        from zerobench.runs.files import write_json_atomic

        write_json_atomic(Path(argv[2]), result)
        print(json.dumps({k: v for k, v in result.items() if k != "cells"}))
        return 0 if result["pass"] else 1
    virtual = bool(argv) and argv[0] == "--virtual"
    if virtual:
        argv = argv[1:]
    ranks = 1
    if argv[:1] == ["--ranks"]:
        if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
            print(f"zerobench.validation.gpu_check: --ranks needs a whole number >= 1, got {argv[1:2]}",
                  file=sys.stderr)
            return 2
        ranks, argv = int(argv[1]), argv[2:]
    checks = {"probe-gloo": probe_gloo, "overlap": overlap_check, "limiter": limiter_check, "busbw": busbw}
    if (len(argv) != 2 or argv[0] not in checks or (virtual and argv[0] in ("probe-gloo", "busbw"))
            or (ranks > 1 and argv[0] not in RANK_CHECKS)):
        print("usage: python -m zerobench.validation.gpu_check [--virtual] [--ranks N] {overlap,limiter} OUT.json\n"
              "       python -m zerobench.validation.gpu_check {probe-gloo,busbw} OUT.json", file=sys.stderr)
        return 2
    if not virtual and not torch.cuda.is_available():
        print("zerobench.validation.gpu_check: no CUDA device (--virtual runs the overlap and limiter checks on the "
              "virtual GPU)", file=sys.stderr)
        return 2
    if ranks > 1:
        result = on_ranks(argv[0], ranks, Path(argv[1]), virtual, timeout_s=600.0 if virtual else 120.0)  # CPU ranks: slower
    elif argv[0] == "busbw":
        result = busbw()
    else:
        result = checks[argv[0]](Target(virtual=True)) if virtual else checks[argv[0]]()
    from zerobench.runs.files import write_json_atomic

    write_json_atomic(Path(argv[1]), result)
    print(json.dumps(result, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
