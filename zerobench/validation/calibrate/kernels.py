"""Timing the cost model's kernels on a device: the GEMM grid, attention per backend,
memory-bound kernels and optimizer steps, each one of zerobench/instruments/vgpu/microbench.py's
rows, timed as that module builds it.

[Note: timing a kernel]
A kernel is run ``warmup`` times, then ``repeats`` times between CUDA events (one event
pair per call: the median of the calls is the row's ``seconds``; ``min_s`` and ``max_s``
beside it). Repeats are chosen so that the timed calls keep the GPU busy for about
``BURST_S`` at most, and the device idles ``COOL_S`` between rows: each row is a burst,
measured before the card reaches its power limit (the sustained rate is a section of
its own, sustained.py). On the CPU the clock is ``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from zerobench.instruments.vgpu import microbench

#: Busy time of one row's timed calls at most, and the idle time between rows (seconds).
BURST_S = 0.03
COOL_S = 0.25
WARMUP = 2
MAX_REPEATS = 15
MIN_REPEATS = 3


def time_kernel(run: Callable[[], object], device: torch.device, repeats: int | None = None) -> dict:
    """The median, min and max seconds of ``run`` on ``device`` ([Note: timing a kernel])."""
    cuda = device.type == "cuda"
    for _ in range(WARMUP):
        run()
    if cuda:
        torch.cuda.synchronize(device)
    if repeats is None:  # how many calls fit the burst, from one timed call
        once = _time_once(run, cuda, device)
        repeats = int(min(MAX_REPEATS, max(MIN_REPEATS, BURST_S // max(once, 1e-9))))
    times = [_time_once(run, cuda, device) for _ in range(repeats)]
    return {"seconds": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeats": repeats}


def _time_once(run, cuda: bool, device) -> float:
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def grids(size: str, device: torch.device) -> dict[str, list[dict]]:
    """The rows each section measures: ``full`` on a GPU, ``tiny`` to run the code path on a CPU."""
    if size == "tiny":  # small, yet long enough on a CPU that the GPU's kernel floors are a small part
        return {
            "gemm": [_gemm(m, n, k, "fp32") for m, n, k in ((256, 256, 256), (256, 128, 192), (128, 256, 256))],
            "attention": [_attention("flash", d, 1, 2, 256, 32, "fp32") for d in ("forward", "backward")],
            "memory": [
                {"kernel": "copy", "params": {"numel": 1 << 20, "dtype": "fp32"}},
                {"kernel": "cast", "params": {"shape": [256, 2048], "dtype": "bf16", "to": "fp32"}},
                {"kernel": "pointwise", "params": {"shape": [256, 2048], "dtype": "fp32"}},
                {"kernel": "rms_norm", "params": {"shape": [256, 2048], "dtype": "fp32"}},
                {"kernel": "cross_entropy", "params": {"shape": [64, 8192], "dtype": "fp32"}},
            ],
            "optimizer": [{"kernel": "optimizer", "params": {"optimizer": o, "shapes": [[256, 256], [256]],
                                                             "dtype": "fp32"}} for o in ("adamw", "adam", "sgd")],
        }
    bf16 = "bf16"
    squares = [_gemm(s, s, s, bf16) for s in (1024, 2048, 4096, 8192)]
    llama = [_gemm(m, n, k, bf16) for m, n, k in ((8192, 4096, 4096), (8192, 1024, 4096), (8192, 14336, 4096),
                                                  (8192, 4096, 14336), (4096, 4096, 8192), (8192, 128256, 4096))]
    odd = [_gemm(m, n, k, bf16) for m, n, k in ((8192, 8192, 256), (256, 8192, 8192), (2048, 2048, 13312))]
    return {
        "gemm": squares + llama + odd,
        "attention": [_attention(b, d, 1, 32, 4096, 128, bf16) for b in ("cudnn", "flash", "efficient")
                      for d in ("forward", "backward")],
        "memory": [
            {"kernel": "copy", "params": {"numel": 1 << 29, "dtype": bf16}},
            {"kernel": "cast", "params": {"shape": [8192, 32768], "dtype": bf16, "to": "fp32"}},
            {"kernel": "pointwise", "params": {"shape": [8192, 14336], "dtype": bf16}},
            {"kernel": "rms_norm", "params": {"shape": [8192, 4096], "dtype": bf16}},
            {"kernel": "cross_entropy", "params": {"shape": [4096, 128256], "dtype": "fp32"}},
            {"kernel": "h2d", "params": {"numel": 1 << 27, "dtype": bf16}},
        ],
        "optimizer": [{"kernel": "optimizer", "params": {"optimizer": o, "shapes": [list(s) for s in
                                                                                      microbench.LLAMA3_8B_BLOCK],
                                                         "dtype": "fp32"}} for o in ("adamw", "adam", "sgd")],
    }


def _gemm(m, n, k, dtype) -> dict:
    return {"kernel": "gemm", "params": {"m": m, "n": n, "k": k, "dtype": dtype}}


def _attention(backend, direction, batch, heads, seq, head_dim, dtype) -> dict:
    return {"kernel": "attention", "params": {"backend": backend, "direction": direction, "batch": batch,
                                              "heads": heads, "seq": seq, "head_dim": head_dim, "causal": True,
                                              "dtype": dtype}}


def measure(rows: list[dict], device: torch.device, deadline: float, log) -> tuple[list[dict], list[str]]:
    """Each row timed, until ``deadline`` (time.monotonic()); returns (rows with their
    times, notes on what was skipped and why)."""
    done, notes = [], []
    for i, row in enumerate(rows):
        name = microbench.describe(row)
        if time.monotonic() > deadline:
            notes.append(f"{len(rows) - i} rows left out: the section's budget ran out ({name} onwards)")
            break
        try:
            run = microbench.prepare(row, device)
            timed = time_kernel(run, device)
        except (RuntimeError, torch.OutOfMemoryError) as err:  # a backend this device does not have, or no room
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            notes.append(f"{name}: not measured ({first[:160]})")
            log(f"  {name}: not measured ({first[:100]})")
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        done.append({**row, **timed, "name": name})
        log(f"  {name}: {timed['seconds'] * 1e3:.3f} ms")
        if device.type == "cuda":
            time.sleep(COOL_S)
    return done, notes
