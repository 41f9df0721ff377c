"""zerobench.analysis.compare.gate on a run the size of a full matrix: 96 cells x 4 ranks x 25 steps."""

from __future__ import annotations

import numpy as np
import pandas as pd

from zerobench.analysis.compare.gate import RunTables, _classify_columns, compare_runs
from zerobench.schema.columns import METRICS


def _run(path: str, scale: float) -> RunTables:
    rng = np.random.default_rng(0)
    cells = [f"engine{e}-ws4-fp32-opt={o}" for e in range(8) for o in range(12)]
    results = pd.DataFrame([{"run_id": path, "cell_id": c, "status": "ok", "error": "", "engine": c.split("-")[0],
                             "world_size": 4, "dtype": "fp32", "rank": r} for c in cells for r in range(4)])
    for m in METRICS:
        results[m.name] = rng.uniform(1, 1e6, len(results)) * (scale if m.kind == "deterministic" else 1)
    steps = pd.DataFrame([{"cell_id": c, "rank": r, "step": s, "step_time_s": 0.1 + 0.001 * rng.standard_normal(),
                           "loss": 1.0} for c in cells for r in range(4) for s in range(25)])
    metrics, config = _classify_columns(results)
    return RunTables(path, results, steps, {}, metrics, config)


def test_compare_runs_full_matrix(benchmark):
    base, new = _run("base", 1.0), _run("new", 1.01)
    comparison = benchmark(compare_runs, base, new, (), "all")
    assert (comparison["verdict"] == "regression").any()
    assert comparison["cell_id"].nunique() == 96
