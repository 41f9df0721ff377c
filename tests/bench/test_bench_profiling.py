"""zerobench.analysis.profiling hot paths, on the checked-in traces of tests/data (make_traces.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from zerobench.analysis.profiling import intervals
from zerobench.analysis.profiling.analyze import analyze_trace
from zerobench.analysis.profiling.trace import load_trace

TRACE = Path(__file__).parents[1] / "data" / "fsdp2.rank0.json.gz"


def test_load_trace(benchmark):
    trace = benchmark(load_trace, TRACE)
    assert len(trace.events) > 0


def test_analyze_trace(benchmark):
    trace = load_trace(TRACE)
    summary = benchmark(analyze_trace, trace)
    assert summary["rank"] == 0


def test_interval_algebra(benchmark):
    rng = np.random.default_rng(0)
    starts = rng.uniform(0, 1e6, 20_000)
    a = np.column_stack([starts, starts + rng.uniform(1, 200, len(starts))])
    starts = rng.uniform(0, 1e6, 20_000)
    b = np.column_stack([starts, starts + rng.uniform(1, 200, len(starts))])

    def exposed():
        return intervals.total(intervals.subtract(a, b))

    value = benchmark(exposed)
    assert 0 < value <= intervals.total(a)
