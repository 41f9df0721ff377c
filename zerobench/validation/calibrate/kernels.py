"""Timing the cost model's kernels on a device: the GEMM grid, attention per backend,
memory-bound kernels and optimizer steps, each one of zerobench/instruments/vgpu/microbench.py's
rows, timed as that module builds it.

[Note: timing a kernel]
A kernel is run ``WARMUP`` times, then timed as a training step runs it: ``repeats``
calls back to back between two CUDA events (one pair per batch, not per call, so that
no event and no host gap sits between the calls), ``BATCHES`` times; the row's
``seconds`` is the median batch's time per call, ``min_s`` and ``max_s`` the fastest and
slowest batch's. Repeats are chosen so that a batch keeps the GPU busy for about
``BURST_S`` (between ``MIN_REPEATS`` and ``MAX_REPEATS`` calls), and the device idles
``COOL_S`` between rows: each row is a burst, measured before the card reaches its
power limit (the sustained rate is a section of its own, sustained.py). On the CPU the
clock is ``time.perf_counter`` around the batch.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from zerobench.instruments.vgpu import microbench

#: Busy time of one batch of a row's calls, and the idle time between rows (seconds).
BURST_S = 0.01
COOL_S = 0.25
WARMUP = 2
BATCHES = 3
MAX_REPEATS = 50
MIN_REPEATS = 2


def time_kernel(run: Callable[[], object], device: torch.device, repeats: int | None = None) -> dict:
    """Seconds per call of ``run`` on ``device``: the median, fastest and slowest of
    ``BATCHES`` batches of ``repeats`` calls ([Note: timing a kernel])."""
    cuda = device.type == "cuda"
    for _ in range(WARMUP):
        run()
    if cuda:
        torch.cuda.synchronize(device)
    if repeats is None:  # how many calls fill a batch, from one timed call
        once = _time_batch(run, 1, cuda)
        repeats = int(min(MAX_REPEATS, max(MIN_REPEATS, BURST_S // max(once, 1e-9))))
    times = [_time_batch(run, repeats, cuda) for _ in range(BATCHES)]
    return {"seconds": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeats": repeats,
            "batches": BATCHES}


def _time_batch(run, repeats: int, cuda: bool) -> float:
    """Seconds per call of ``repeats`` calls back to back."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats


def linear_shapes(model: torch.nn.Module) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of each distinct shape of ``model``'s ``nn.Linear``
    layers, in the order they come (a model built on the meta device will do)."""
    seen: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            seen.setdefault((module.in_features, module.out_features), name)
    return [(name, i, o) for (i, o), name in seen.items()]


def layer_gemms(shapes: list[tuple[str, int, int]], tokens: int, dtype: str) -> list[dict]:
    """The three GEMMs a step runs for each linear layer over ``tokens`` tokens, in their
    layouts (forward, input gradient, weight gradient: [Note: GEMM layouts] in
    microbench.py)."""
    rows = []
    for name, fan_in, fan_out in shapes:
        for layout, (m, n, k) in (("forward", (tokens, fan_out, fan_in)), ("input_grad", (tokens, fan_in, fan_out)),
                                  ("weight_grad", (fan_out, fan_in, tokens))):
            rows.append({"kernel": "gemm", "params": {"m": m, "n": n, "k": k, "dtype": dtype, "layout": layout,
                                                      "layer": name}})
    return rows


def attention_grid(backends, seqs, head_dims, tokens: int, width: int, dtype: str) -> list[dict]:
    """Causal attention forward and backward for each backend, sequence length and head
    size, at ``tokens`` tokens a batch (batch = tokens / seq) and ``width / head_dim`` heads."""
    return [_attention(backend, direction, max(tokens // seq, 1), width // head_dim, seq, head_dim, dtype)
            for backend in backends for seq in seqs for head_dim in head_dims
            for direction in ("forward", "backward")]


def workload_layers(workload) -> tuple[list[tuple[str, int, int]], int, str]:
    """A workload's linear layers (built on the meta device: shapes only), the tokens one
    rank's step runs through them (batch size x sequence length; the batch size for a
    model without tokens) and the dtype it trains in (bf16 when its matrix has it, fp16,
    else fp32): the GEMMs calibrate times for ``--workload``."""
    from zerobench.spec.models import construct, samples_to_tokens

    with torch.device("meta"):
        model = construct(workload.model)
    shapes = linear_shapes(model)
    if not shapes:
        raise ValueError(f"--workload {workload.name}: its model has no nn.Linear layer (allowed: a workload whose "
                         "model has some)")
    tokens = workload.data.batch_size * max(samples_to_tokens(workload.model), 1)
    dtypes = workload.matrix.get("dtype", ["fp32"])
    dtype = next((d for d in ("bf16", "fp16") if d in dtypes), "fp32")
    return shapes, tokens, dtype


def llama3_8b_block():
    """One block and the output layer of Llama 3 8B (zerobench/spec's preset), on the meta device."""
    from zerobench.spec.models import construct
    from zerobench.spec.workload import LLAMA_PRESETS, LlamaConfig

    with torch.device("meta"):
        return construct(LlamaConfig(**{**LLAMA_PRESETS["llama3-8b"], "layers": 1}))


#: Tokens a batch of the GPU grid's layer GEMMs and attention: Llama 3 8B at sequence 8192.
LLAMA_TOKENS = 8192
#: The attention grid's sequence lengths and head sizes (per backend, forward and backward).
ATTENTION_SEQS = (1024, 4096, 8192)
ATTENTION_HEAD_DIMS = (64, 128)


def grids(size: str, device: torch.device, layers: tuple[list, int, str] | None = None) -> dict[str, list[dict]]:
    """The rows each section measures: ``full`` on a GPU, ``tiny`` to run the code path on a
    CPU. ``layers``: (shapes, tokens, dtype) whose GEMMs the gemm section times in their
    three layouts instead of Llama 3 8B's (:func:`workload_layers`), first, so that a
    budget running out leaves out the other shapes before them."""
    grid = _grids(size)
    if layers is not None:
        shapes, tokens, dtype = layers
        plain = [r for r in grid["gemm"] if not r["params"].get("layout")]
        grid["gemm"] = layer_gemms(shapes, tokens, dtype) + plain
    return grid


def _grids(size: str) -> dict[str, list[dict]]:
    if size == "tiny":  # small, yet long enough on a CPU that the GPU's kernel floors are a small part
        return {
            "gemm": [_gemm(m, n, k, "fp32") for m, n, k in ((256, 256, 256), (256, 128, 192))]
                    + layer_gemms([("w", 192, 128)], 256, "fp32"),
            "attention": attention_grid(("flash",), (64, 128), (16, 32), 256, 64, "fp32"),
            "memory": [
                {"kernel": "copy", "params": {"numel": 1 << 20, "dtype": "fp32"}},
                {"kernel": "cast", "params": {"shape": [256, 2048], "dtype": "bf16", "to": "fp32"}},
                {"kernel": "pointwise", "params": {"shape": [256, 2048], "dtype": "fp32"}},
                {"kernel": "rms_norm", "params": {"shape": [256, 2048], "dtype": "fp32"}},
                {"kernel": "cross_entropy", "params": {"shape": [64, 8192], "dtype": "fp32"}},
            ],  # no h2d: a CPU's copy out of its cache can outrun the preset's PCIe, which the fit refuses
            "optimizer": [{"kernel": "optimizer", "params": {"optimizer": o, "shapes": [[256, 256], [256]],
                                                             "dtype": "fp32"}} for o in ("adamw", "adam", "sgd")],
        }
    bf16 = "bf16"
    squares = [_gemm(s, s, s, bf16) for s in (1024, 2048, 4096, 8192)]
    layers = layer_gemms(linear_shapes(llama3_8b_block()), LLAMA_TOKENS, bf16)
    odd = [_gemm(m, n, k, bf16) for m, n, k in ((8192, 8192, 256), (256, 8192, 8192), (2048, 2048, 13312))]
    return {
        "gemm": squares + layers + odd,
        "attention": attention_grid(("cudnn", "flash", "efficient"), ATTENTION_SEQS, ATTENTION_HEAD_DIMS,
                                    LLAMA_TOKENS, 4096, bf16),
        "memory": [
            {"kernel": "copy", "params": {"numel": 1 << 29, "dtype": bf16}},
            {"kernel": "cast", "params": {"shape": [8192, 32768], "dtype": bf16, "to": "fp32"}},
            {"kernel": "pointwise", "params": {"shape": [8192, 14336], "dtype": bf16}},
            {"kernel": "rms_norm", "params": {"shape": [8192, 4096], "dtype": bf16}},
            {"kernel": "cross_entropy", "params": {"shape": [4096, 128256], "dtype": "fp32"}},
            {"kernel": "h2d", "params": {"numel": 1 << 27, "dtype": bf16}},
            {"kernel": "d2h", "params": {"numel": 1 << 27, "dtype": bf16}},
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
