"""The GPU-only checks of ``scripts/gpu-check`` (also used by ``pytest -m cuda``).

``python -m zerobench.gpu_check probe-gloo OUT.json``: which collectives the engines use
work under gloo with CUDA tensors (two ranks on one GPU).
``python -m zerobench.gpu_check overlap OUT.json``: how much of the all-gather time
impl.fsdp's prefetch hides. ``python -m zerobench.gpu_check limiter OUT.json``: the peak
memory of a forward with and without ``limit_all_gathers``. Each writes its figures and
``"pass": true/false`` and exits 0 on pass, 1 on fail.

[Note: GPU checks]
Both impl checks run at world size 1 with NCCL and HYBRID_SHARD over a shard group of
one rank: every unit then goes through the real unshard path (all-gather on the unshard
stream, free after use, limiter) with a local copy as its "all-gather". The copy is
slowed down by ``torch.cuda._sleep`` enqueued on the stream it runs on (the way
PyTorch's FSDP overlap tests slow a collective), and each unit's compute is a
``_sleep`` on the compute stream, in forward and backward, so both durations are known
and the CPU thread runs far ahead of the GPU.

* overlap: exposed all-gather time = step time with the delay - step time without it.
  Hidden fraction = 1 - exposed(prefetch) / exposed(no prefetch). Passes at >= 0.9
  when a unit's compute (2x) is longer than its all-gather.
* limiter: forward under no_grad, units of ``UNIT_MB`` each, compute long enough for the
  CPU to enqueue every unit before the GPU finishes the first. Freed unsharded buffers
  stay allocated until compute passes the free (record_stream), so without the limiter
  the peak active memory grows with the number of units; with it, it stays within
  ``depth + 2`` units (``depth`` freed ahead, the unit computing, the one being gathered).
  Measured as the caching allocator's peak *active* bytes above the baseline, because
  blocks waiting for their stream events count as active, not allocated.
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


def _init_single() -> None:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from zerobench.launch import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))


def cycles_per_ms(samples: int = 10, trim: int = 2, cycles: int = 10_000_000) -> float:
    """How many ``torch.cuda._sleep`` cycles take a millisecond on this GPU.

    The mean of ``samples`` timed sleeps of ``cycles`` each, leaving out the ``trim``
    fastest and ``trim`` slowest: the first launch pays for initialisation and another
    process may share the GPU, and one sample would carry either into every duration
    the checks derive from it. (PyTorch's tests calibrate the same way:
    ``get_cycles_per_ms`` in torch/testing/_internal/common_utils.py.)"""
    if samples <= 2 * trim:
        raise ValueError(f"cycles_per_ms: samples ({samples}) must be more than 2 * trim ({trim})")
    torch.cuda.synchronize()
    rates = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / start.elapsed_time(end))
    kept = sorted(rates)[trim:samples - trim]
    return sum(kept) / len(kept)


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each keep the GPU busy for ``cycles``."""

    @staticmethod
    def forward(ctx, x, cycles):
        ctx.cycles = cycles
        torch.cuda._sleep(cycles)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(ctx.cycles)
        return grad.clone(), None


class _Unit(nn.Module):
    def __init__(self, width: int, cycles: int):
        super().__init__()
        self.lin = nn.Linear(width, width, bias=False)
        self.cycles = cycles

    def forward(self, x):
        return _Sleep.apply(self.lin(x), self.cycles)


class _Model(nn.Module):
    def __init__(self, units: int, width: int, cycles: int):
        super().__init__()
        self.units = nn.ModuleList(_Unit(width, cycles) for _ in range(units))

    def forward(self, x):
        for u in self.units:
            x = u(x)
        return x


def _wrap(model: nn.Module, **kwargs):
    from impl.fsdp import FullyShardedDataParallel as FSDP
    from impl.fsdp import ShardingStrategy

    pair = (dist.group.WORLD, dist.new_group([0]))  # shard group of 1: see [Note: GPU checks]
    wrap = dict(process_group=pair, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                device_id=torch.device("cuda", 0), **kwargs)
    for i, u in enumerate(model.units):
        model.units[i] = FSDP(u, **wrap)
    return FSDP(model, **wrap)


class _DelayedGathers:
    """Enqueue ``cycles`` of sleep on the stream each all-gather runs on."""

    def __init__(self, cycles: int):
        self.cycles = cycles
        self.count = 0

    def __enter__(self):
        from impl.fsdp import collectives

        self._real = collectives.all_gather_flat

        def slow(output, input, group, group_size):
            self.count += 1
            if self.cycles:
                torch.cuda._sleep(self.cycles)
            return self._real(output, input, group, group_size)

        collectives.all_gather_flat = slow
        return self

    def __exit__(self, *exc):
        from impl.fsdp import collectives

        collectives.all_gather_flat = self._real


def _step_ms(prefetch: bool, gather_cycles: int, compute_cycles: int, steps: int = 3) -> tuple[float, int]:
    from impl.fsdp import BackwardPrefetch

    torch.manual_seed(0)
    model = _wrap(_Model(OVERLAP_UNITS, 256, compute_cycles).cuda(), forward_prefetch=prefetch,
                  backward_prefetch=BackwardPrefetch.BACKWARD_PRE if prefetch else None)
    x = torch.randn(8, 256, device="cuda")
    model(x).sum().backward()  # warm-up (and the first-iteration order record)
    times = []
    with _DelayedGathers(gather_cycles) as delayed:
        for _ in range(steps):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(x).sum().backward()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return min(times), delayed.count // steps


def overlap_check(gather_ms: float = 2.0, compute_ms: float = 4.0) -> dict:
    _init_single()
    cpm = cycles_per_ms()
    g, c = int(gather_ms * cpm), int(compute_ms * cpm)
    out = {"cycles_per_ms": cpm, "units": OVERLAP_UNITS, "gather_ms": gather_ms, "compute_ms": compute_ms}
    for name, prefetch in (("prefetch", True), ("no_prefetch", False)):
        base, _ = _step_ms(prefetch, 0, c)
        delayed, gathers = _step_ms(prefetch, g, c)
        out[name] = {"step_ms_without_delay": base, "step_ms_with_delay": delayed, "gathers_per_step": gathers,
                     "all_gather_ms": gathers * gather_ms, "exposed_ms": max(delayed - base, 0.0)}
    exposed_off = out["no_prefetch"]["exposed_ms"]
    out["hidden_fraction"] = 1 - out["prefetch"]["exposed_ms"] / exposed_off if exposed_off > 0 else 0.0
    out["pass"] = out["hidden_fraction"] >= 0.9
    return out


def _forward_peak(limit: bool, depth: int, compute_cycles: int) -> dict:
    width = int((UNIT_MB * 2**20 / 4) ** 0.5)
    torch.manual_seed(0)
    model = _wrap(_Model(UNITS, width, compute_cycles).cuda(), limit_all_gathers=limit, limiter_depth=depth)
    x = torch.randn(4, width, device="cuda")
    with torch.no_grad():
        model(x)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_stats()["active_bytes.all.current"]
        start = time.perf_counter()
        model(x)
        enqueue_s = time.perf_counter() - start
        torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    metrics = model.limiter_metrics()
    unit_bytes = width * width * 4
    del model
    torch.cuda.empty_cache()
    return {"peak_active_above_base_units": (stats["active_bytes.all.peak"] - base) / unit_bytes,
            "peak_allocated_above_base_units": (stats["allocated_bytes.all.peak"] - base) / unit_bytes,
            "peak_reserved_bytes": stats["reserved_bytes.all.peak"], "unit_bytes": unit_bytes,
            "cpu_enqueue_ms": enqueue_s * 1e3, "limiter_stalls": metrics["limiter_stalls"]}


def limiter_check(depth: int = 2, compute_ms: float = 20.0) -> dict:
    _init_single()
    c = int(compute_ms * cycles_per_ms())
    on, off = _forward_peak(True, depth, c), _forward_peak(False, depth, c)
    bound = depth + 2
    out = {"units": UNITS, "unit_mb": UNIT_MB, "depth": depth, "bound_units": bound, "with_limiter": on,
           "without_limiter": off}
    out["pass"] = (on["peak_active_above_base_units"] <= bound + 0.25
                   and off["peak_active_above_base_units"] >= on["peak_active_above_base_units"] + 1.0)
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
    import subprocess

    from zerobench.launch import free_port

    port = free_port()
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"zerobench-gloo-probe-{os.getpid()}.json"
    procs = [subprocess.Popen([sys.executable, "-m", "zerobench.gpu_check", "_probe-rank", str(r), str(world),
                               str(port), str(out)]) for r in range(world)]
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
    codes = [p.returncode for p in procs]
    results = json.loads(out.read_text()) if out.exists() else {}
    out.unlink(missing_ok=True)
    result = {"torch": torch.__version__, "world_size": world, "exit_codes": codes, "collectives": results,
              "all_ok": bool(results) and all(v == "ok" for v in results.values()),
              "pass": not timed_out and codes == [0] * world}
    if timed_out:
        result["error"] = f"timed out after {timeout_s:g} s; ranks still running were killed"
    return result


def cells_check(runs_root: str) -> dict:
    """The status of every cell of the one run folder under ``runs_root``."""
    runs = sorted(p for p in Path(runs_root).iterdir() if (p / "workload.json").exists())
    if len(runs) != 1:
        return {"pass": False, "error": f"expected one run folder under {runs_root}, found {len(runs)}"}
    cells = {}
    for f in sorted((runs[0] / "cells").glob("*.json")):
        rec = json.loads(f.read_text())
        cells[rec.get("cell_id", f.stem)] = {"status": rec.get("status"), "error": (rec.get("error") or "")[:300],
                                              "backend": rec.get("backend"), "device": rec.get("device")}
    statuses = [c["status"] for c in cells.values()]
    return {"run": str(runs[0]), "cells": cells, "ok": statuses.count("ok"),
            "skipped": statuses.count("skipped"), "failed": len(statuses) - statuses.count("ok") - statuses.count("skipped"),
            "pass": bool(statuses) and all(s in ("ok", "skipped") for s in statuses) and "ok" in statuses}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "_probe-rank":
        _probe_rank(int(argv[1]), int(argv[2]), int(argv[3]), argv[4])
        return 0
    if argv and argv[0] == "cells" and len(argv) == 3:
        result = cells_check(argv[1])
        from zerobench.files import write_json_atomic

        write_json_atomic(Path(argv[2]), result)
        print(json.dumps({k: v for k, v in result.items() if k != "cells"}))
        return 0 if result["pass"] else 1
    checks = {"probe-gloo": probe_gloo, "overlap": overlap_check, "limiter": limiter_check}
    if len(argv) != 2 or argv[0] not in checks:
        print(f"usage: python -m zerobench.gpu_check {{{','.join(checks)}}} OUT.json", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("zerobench.gpu_check: no CUDA device", file=sys.stderr)
        return 2
    result = checks[argv[0]]()
    from zerobench.files import write_json_atomic

    write_json_atomic(Path(argv[1]), result)
    print(json.dumps(result, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
