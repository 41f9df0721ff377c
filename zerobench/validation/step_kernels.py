"""What a profiled step's GEMMs and attention ran at, kernel by kernel, beside the same
kernels timed alone: the evidence for what compute runs at in a training step
(``step_ratio``, [Note: clocks under load] in zerobench/instruments/vgpu/costs.py). It
reads the trace only; it fits nothing.

``python -m zerobench.validation.step_kernels [RUN] [--gpu NAME_OR_FILE]``

RUN is a ``zerobench run --profile`` folder of a real GPU (default: the shared H200 run,
results/gpu/h200-20261128/llama3-8b-l4-ws1-deepspeed). Each GEMM kernel is joined to the
``aten::mm`` that launched it (the profiler's ``External id``), whose shapes and strides
give its layout and (m, n, k) ([Note: GEMM layouts] in zerobench/instruments/vgpu/gemm.py);
attention kernels (cuDNN's, flash's, the memory-efficient one) to their SDPA operator. Per
cell and layout: the kernels' time per step in the trace, the time the preset's measured
GEMMs give the same kernels alone in a burst (``gemm_measured``; a kernel no row measured
is left out), and the ratio: below 1, the step ran them faster than alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

DEFAULT_RUN = Path("results/gpu/h200-20261128/llama3-8b-l4-ws1-deepspeed")
_DTYPES = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32"}


def _layout(strides: list, dims: list) -> str:
    from zerobench.instruments.vgpu.gemm import _side

    return "".join(_side(tuple(d), tuple(s)) for d, s in zip(dims, strides))


def gemm_kernels(trace) -> pd.DataFrame:
    """One row per GEMM kernel launched by an ``aten::mm`` of two 2-D operands: layout, m,
    n, k, dtype and its duration in seconds."""
    from zerobench.analysis.profiling.kernels import cuda_kernel_class

    ev = trace.events
    ops = ev[(ev["cat"] == "cpu_op") & (ev["name"] == "aten::mm")]
    by_id = {a.get("External id"): a for a in ops["args"] if isinstance(a, dict)}
    rows = []
    kernels = ev[ev["cat"] == "kernel"]
    for name, dur, args in zip(kernels["name"], kernels["dur"], kernels["args"]):
        if cuda_kernel_class(name) != "gemm" or not isinstance(args, dict):
            continue
        op = by_id.get(args.get("External id"))
        if op is None or len(op.get("Input Dims", [])) < 2:
            continue
        (m, k), (_, n) = op["Input Dims"][:2]
        rows.append({"layout": _layout(op["Input Strides"][:2], op["Input Dims"][:2]), "m": m, "n": n, "k": k,
                     "dtype": _DTYPES.get(op.get("Input type", [""])[0], "?"), "seconds": float(dur) * 1e-6})
    return pd.DataFrame(rows, columns=["layout", "m", "n", "k", "dtype", "seconds"])


def attention_seconds(trace) -> float:
    """Seconds of attention kernels (the kernel classes' rule) in the trace."""
    from zerobench.analysis.profiling.kernels import cuda_kernel_class

    ev = trace.events
    kernels = ev[ev["cat"] == "kernel"]
    return float(sum(d for n, d in zip(kernels["name"], kernels["dur"]) if cuda_kernel_class(n) == "attention")) * 1e-6


def step_table(run: Path, gpu="h200") -> pd.DataFrame:
    """Per cell and layout: ``kernels`` and ``step_ms`` (per step, in the trace), ``alone_ms``
    (the same kernels at the preset's measured times), ``ratio`` (step over alone)."""
    from zerobench.analysis.profiling.overlap import step_windows
    from zerobench.analysis.profiling.trace import load_trace
    from zerobench.instruments.vgpu.presets import DTYPES, gpu_preset
    from zerobench.whatif.predict.against import run_cells

    preset = gpu_preset(gpu)
    out = []
    for cell, path in sorted(run_cells(run).items()):
        trace = load_trace(path)
        steps = max(len(step_windows(trace)), 1)
        frame = gemm_kernels(trace)
        alone = [preset.measured_gemm(r.layout, r.m, r.n, r.k, DTYPES.get(r.dtype)) for r in frame.itertuples()]
        frame["alone"] = alone
        for layout, part in frame.groupby("layout"):
            known = part[part["alone"].notna()]
            step_ms, alone_ms = known["seconds"].sum() * 1e3 / steps, known["alone"].sum() * 1e3 / steps
            out.append({"cell": cell, "what": f"gemm {layout}", "kernels": len(known) / steps, "step_ms": step_ms,
                        "alone_ms": alone_ms, "ratio": step_ms / alone_ms if alone_ms else None})
        out.append({"cell": cell, "what": "gemm, every kernel", "kernels": len(frame) / steps,
                    "step_ms": frame["seconds"].sum() * 1e3 / steps, "alone_ms": None, "ratio": None})
        out.append({"cell": cell, "what": "attention", "kernels": None,
                    "step_ms": attention_seconds(trace) * 1e3 / steps, "alone_ms": None, "ratio": None})
    return pd.DataFrame(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerobench.validation.step_kernels", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("run", nargs="?", type=Path, default=DEFAULT_RUN)
    parser.add_argument("--gpu", default="h200")
    args = parser.parse_args(argv)
    try:
        frame = step_table(args.run, args.gpu)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from zerobench.analysis.render import markdown

    print(markdown(table(frame)))
    return 0


def table(frame: pd.DataFrame):
    """The table through the one renderer (zerobench/analysis/render.py)."""
    from zerobench.analysis.render import Column, Table

    out = Table([Column("cell", "left", "parts", role="group"), Column("kernels", "left", "words"),
                 Column("per step"), Column("ms in the step"), Column("ms alone"), Column("step / alone")],
                title="a profiled step's compute kernels beside the same kernels timed alone:")
    for r in frame.itertuples():
        out.add_row(r.cell, r.what, "" if r.kernels is None or r.kernels != r.kernels else f"{r.kernels:g}",
                    f"{r.step_ms:.3f}", "" if r.alone_ms is None or r.alone_ms != r.alone_ms else f"{r.alone_ms:.3f}",
                    "" if r.ratio is None or r.ratio != r.ratio else f"{r.ratio:.3f}")
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
