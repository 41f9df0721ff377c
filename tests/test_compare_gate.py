"""The gate catches a real regression: real runs of the harness, compared.

A baseline run of tests/data/compare_gate.toml, the same workload run again (must pass the
default gate: its deterministic figures, FSDP peaks included, are reproducible), and
compare_gate_worse.toml, the same cells with four times the batch (must fail on peak
memory). Three runs of three small cells, about a minute.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zerobench.analysis.compare.gate import compare_runs, config_mismatches, exit_code, load_run
from zerobench.cli import main as cli_main

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data"


def _run(workload: str, root: Path) -> Path:
    from zerobench.cli import main

    assert main(["run", str(DATA / workload), "--results", str(root), "--no-plots"]) == 0
    (run_dir,) = root.iterdir()
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    return {name: _run(toml, root / name) for name, toml in
            (("baseline", "compare_gate.toml"), ("again", "compare_gate.toml"), ("worse", "compare_gate_worse.toml"))}


def test_unchanged_run_passes(runs, tmp_path):
    md = tmp_path / "report.md"
    assert cli_main(["compare", str(runs["baseline"]), str(runs["again"]), "--markdown", str(md)]) == 0
    comparison = compare_runs(load_run(runs["baseline"]), load_run(runs["again"]))
    det = comparison[comparison["kind"] == "deterministic"]
    assert {"peak_mem_bytes", "comm_total_bytes", "loss_last"} <= set(det["metric"])
    assert (det["verdict"] == "ok").all(), det[det["verdict"] != "ok"]
    memory = det[det["metric"].str.startswith("peak_mem")]
    assert memory["cell_id"].nunique() == 3 and (memory["change"] == 0).all(), memory[memory["change"] != 0]
    assert md.read_text().startswith("## zerobench compare: PASS")


def test_worse_configuration_fails(runs, tmp_path, capsys):
    png = tmp_path / "changes.png"
    assert cli_main(["compare", str(runs["baseline"]), str(runs["worse"]), "--plot", str(png)]) == 1
    out = capsys.readouterr().out
    assert "peak_mem_bytes" in out and "batch_size" in out  # the regression, and why
    base, worse = load_run(runs["baseline"]), load_run(runs["worse"])
    comparison = compare_runs(base, worse)
    peaks = comparison[comparison["metric"] == "peak_mem_bytes"]
    assert len(peaks) == 3 and (peaks["verdict"] == "regression").all() and (peaks["new"] > peaks["baseline"]).all()
    assert set(config_mismatches(base, worse)["severity"]) == {"context"}  # same cell, not unusable
    assert exit_code(comparison) == 1
    assert png.stat().st_size > 0
