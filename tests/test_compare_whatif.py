"""``zerobench compare`` on predict and estimate folders ([Note: comparing what-if folders]).

On small synthetic predict.csv / estimate.csv tables; the predict gate of .ci/gate runs
the real thing (docs/ci.md).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from tests.helpers.compare_runs import cli, run_folder
from zerobench.analysis.compare.gate import compare_runs, config_mismatches, exit_code, load_run

GiB = 2**30
CONFIGS = ("impl-fsdp-bf16", "torch-fsdp2-bf16")


def predict_folder(tmp_path: Path, name: str, drop: tuple[str, ...] = (), **changes) -> Path:
    """A predict folder: two configurations at world size 8; ``changes`` maps a column to
    a value for every row, or to {config: value}."""
    rows = []
    for i, config in enumerate(CONFIGS):
        row = {"config": config, "engine": config.rsplit("-", 1)[0], "dtype": "bf16", "world_size": 8,
               "gpu": "h100-sxm", "host": "fast", "link": "nvlink4-8gpu", "inter_link": "", "node_size": 8,
               "torch_version": "2.13.0+cpu", "zerobench_version": "0.1.0", "status": "ok", "reason": "",
               "step_time_s": 0.0105 + i * 1e-3, "compute_s": 0.008, "comm_s": 0.004, "exposed_comm_s": 1.9e-4,
               "overlap_ratio": 0.95, "peak_allocated_bytes": 1.2 * GiB, "peak_active_bytes": 1.5 * GiB,
               "peak_reserved_bytes": 1.7 * GiB, "num_alloc_retries": 0, "num_ooms": 0,
               "max_unsharded_units": 3.0, "host_lead_max_s": 2.1e-3, "host_blocked_s": 1e-3,
               "comm_all_gather_bytes": 3_000_000, "comm_reduce_scatter_bytes": 2_000_000, "comm_all_reduce_bytes": 0,
               "comm_broadcast_bytes": 0, "comm_other_bytes": 0, "comm_total_bytes": 5_000_000, "comm_calls": 14,
               "tokens_per_s": 24000.0, "limiter_stalls": 3, "predict_wall_s": 5.0 + i}
        for column, value in changes.items():
            row[column] = value.get(config, row[column]) if isinstance(value, dict) else value
        rows.append({k: v for k, v in row.items() if k not in drop})
    folder = tmp_path / name
    folder.mkdir()
    pd.DataFrame(rows).to_csv(folder / "predict.csv", index=False)
    return folder


def _rows(base: Path, new: Path) -> pd.DataFrame:
    return compare_runs(load_run(base), load_run(new))


def test_unchanged_predictions_pass_and_every_figure_gates_exactly(tmp_path):
    base, same = predict_folder(tmp_path, "base"), predict_folder(tmp_path, "same")
    assert cli(base, same) == 0
    rows = _rows(base, same)
    figures = rows[rows["metric"] != "status"].set_index(["cell_id", "metric"])
    assert set(figures.index.get_level_values("cell_id")) == {"impl-fsdp-ws8-bf16", "torch-fsdp2-ws8-bf16"}
    for metric in ("step_time_s", "exposed_comm_s", "overlap_ratio", "peak_allocated_bytes", "peak_active_bytes",
                   "peak_reserved_bytes", "max_unsharded_units", "host_lead_max_s", "comm_total_bytes", "comm_calls",
                   "limiter_stalls"):
        row = figures.loc[("impl-fsdp-ws8-bf16", metric)]
        assert row["kind"] == "deterministic" and row["gated"] and row["rule"] == "default exact (1e-9)", metric
    assert not figures.loc[("impl-fsdp-ws8-bf16", "predict_wall_s")]["gated"]   # reported only


@pytest.mark.parametrize("metric, value, code", [
    ("step_time_s", {"impl-fsdp-bf16": 0.0105 + 1e-9}, 1),          # one nanosecond slower
    ("step_time_s", {"impl-fsdp-bf16": 0.0105 * (1 + 1e-13)}, 0),   # the same times summed in another order
    ("step_time_s", {"impl-fsdp-bf16": 0.0104}, 0),                 # faster: improved
    ("host_lead_max_s", {"torch-fsdp2-bf16": 2.0e-3}, 1),           # less run-ahead (higher is better)
    ("overlap_ratio", 0.94, 1),
    ("max_unsharded_units", {"impl-fsdp-bf16": 3.5}, 1),
    ("comm_calls", 15, 1),
    ("peak_reserved_bytes", 1.7 * GiB + 2 * 2**20, 1),
    ("predict_wall_s", 50.0, 0),                                    # context
])
def test_any_worse_predicted_figure_is_a_regression(tmp_path, capsys, metric, value, code):
    base = predict_folder(tmp_path, "base")
    new = predict_folder(tmp_path, "new", **{metric: value})
    capsys.readouterr()
    assert cli(base, new) == code
    if code == 1:
        assert metric in capsys.readouterr().out


def test_a_configuration_that_no_longer_fits_is_a_regression(tmp_path):
    base = predict_folder(tmp_path, "base")
    new = predict_folder(tmp_path, "oom", status={"torch-fsdp2-bf16": "oom"},
                         reason={"torch-fsdp2-bf16": "cannot run on the virtual GPU: OutOfMemoryError"})
    rows = _rows(base, new)
    status = rows[(rows["metric"] == "status") & (rows["cell_id"] == "torch-fsdp2-ws8-bf16")].iloc[0]
    assert status["verdict"] == "regression" and "OutOfMemoryError" in status["note"]
    assert cli(base, new) == 1


@pytest.mark.parametrize("column, value", [("gpu", "a100-sxm"), ("link", "pcie4"), ("host", "slow"),
                                           ("node_size", 4), ("torch_version", "2.14.0"),
                                           ("zerobench_version", "0.2.0")])
def test_other_presets_or_versions_are_unusable_not_compared(tmp_path, capsys, column, value):
    base = predict_folder(tmp_path, "base")
    new = predict_folder(tmp_path, "new", step_time_s=1.0, **{column: value})
    capsys.readouterr()
    assert cli(base, new) == 2
    mismatches = config_mismatches(load_run(base), load_run(new))
    assert set(mismatches.loc[mismatches["severity"] == "identity", "column"]) == {column}
    assert column in capsys.readouterr().out


def test_a_folder_that_does_not_record_its_versions_is_not_compared_with_one_that_does(tmp_path, capsys):
    older = predict_folder(tmp_path, "older", drop=("torch_version", "zerobench_version"))
    capsys.readouterr()
    assert cli(older, predict_folder(tmp_path, "new")) == 2
    assert "torch_version" in capsys.readouterr().out
    assert cli(older, predict_folder(tmp_path, "older-too", drop=("torch_version", "zerobench_version"))) == 0


def test_options_a_rule_a_subset_and_the_reports_work_on_predictions(tmp_path):
    base = predict_folder(tmp_path, "base")
    slower = predict_folder(tmp_path, "slower", step_time_s={"impl-fsdp-bf16": 0.0105 * 1.04})
    assert cli(base, slower) == 1
    assert cli(base, slower, "--fail-on", "step_time:+5%") == 0
    assert cli(base, slower, "--report-only", "step_time_s") == 0
    assert cli(base, slower, "--fail-on", "step_time:+5%,k=3") == 2            # no spread in a prediction
    assert cli(base, slower, "--cells", "torch-fsdp2-*") == 0
    xml, md, csv = tmp_path / "c.xml", tmp_path / "c.md", tmp_path / "c.csv"
    assert cli(base, slower, "--junit-xml", xml, "--markdown", md, "--csv", csv, "--plot", tmp_path / "c.png") == 1
    assert "step_time_s: baseline 10.5 ms, new 10.9 ms" in xml.read_text()
    assert md.read_text().startswith("## zerobench compare: FAIL")


def test_a_prediction_is_not_compared_with_a_run(tmp_path, capsys):
    base = predict_folder(tmp_path, "base")
    run = run_folder(tmp_path, "run")
    capsys.readouterr()
    assert cli(base, run) == 2
    err = capsys.readouterr().err
    assert "is a run folder (allowed: a predict folder, or latest:predict)" in err


def test_estimate_folders_compare_the_same_way(tmp_path):
    def estimate_folder(name: str, peak: int, backend: str = "nccl") -> Path:
        folder = tmp_path / name
        folder.mkdir()
        pd.DataFrame([{"config": "impl-fsdp-fp32", "engine": "impl-fsdp", "dtype": "fp32", "world_size": ws,
                       "rank": 0, "fake_tensors": False, "backend": backend, "params_total": 1_300_000,
                       "torch_version": "2.13.0+cpu", "zerobench_version": "0.1.0", "zero_stage": 3,
                       "status": "ok", "reason": "", "peak_mem_bytes": peak // ws, "peak_mem_params_bytes": 1000,
                       "state_params_bytes": 4000, "analytic_params_bytes": 4000, "estimate_wall_s": 3.0}
                      for ws in (8, 64)]).to_csv(folder / "estimate.csv", index=False)
        return folder

    base = estimate_folder("base", 64_000_000)
    assert load_run(base).tool == "estimate"
    assert cli(base, estimate_folder("same", 64_000_000)) == 0
    assert cli(base, estimate_folder("worse", 64_000_640)) == 1
    assert cli(base, estimate_folder("gloo", 64_000_000, backend="gloo")) == 2   # another backend modelled
    assert exit_code(compare_runs(load_run(base), load_run(base))) == 0
