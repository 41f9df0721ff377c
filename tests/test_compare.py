"""The CI gate: rules, verdicts, exit codes and reports of ``zerobench compare``.

All on small synthetic run folders written by :func:`write_run`; no distributed runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers.compare_runs import MiB, cli, make_run, run_folder, write_run
from zerobench.analysis.compare.gate import Rule, compare_runs, config_mismatches, exit_code, load_run
from zerobench.schema.columns import METRICS

# --------------------------------------------------------------------------- rules


@pytest.mark.parametrize("text, metrics, rel, abs_, k", [
    ("peak_mem:+2%", ("peak_mem_bytes",), 0.02, 0.0, None),
    ("peak_mem_bytes:+2%", ("peak_mem_bytes",), 0.02, 0.0, None),
    ("comm_total_bytes:+0", ("comm_total_bytes",), 0.0, 0.0, None),
    ("comm_total:0", ("comm_total_bytes",), 0.0, 0.0, None),
    ("loss_last:+1e-6", ("loss_last",), 0.0, 1e-6, None),
    ("step_time:+15%", ("step_time_s",), 0.15, 0.0, 3.0),   # time stays spread-aware
    ("step_time:+15%,k=5", ("step_time_s",), 0.15, 0.0, 5.0),
    ("step_time_p90:+20%, k=0", ("step_time_p90_s",), 0.20, 0.0, 0.0),
    ("throughput_samples:+5%", ("throughput_samples_s",), 0.05, 0.0, 3.0),
])
def test_rule_parse(text, metrics, rel, abs_, k):
    rule = Rule.parse(text)
    assert (rule.metrics, rule.rel, rule.abs, rule.k) == (metrics, rel, abs_, k)


def test_rule_glob_names_several_metrics():
    rule = Rule.parse("comm_*:+0")
    assert set(rule.metrics) == {m.name for m in METRICS if m.name.startswith("comm_")}


@pytest.mark.parametrize("text, message", [
    ("bogus:+2%", "unknown metric 'bogus'"),
    ("peak:+2%", "ambiguous"),
    ("throughput:+5%", "throughput_samples_s, throughput_tokens_s"),
    ("peak_mem+2%", "expected NAME:+TOL"),
    ("peak_mem:+2%%", "expected NAME:+TOL"),
    ("peak_mem:-2%", ">= 0"),
    ("peak_mem:+2%,k=3", "k= applies to time metrics only"),
    ("peak_mem:+two%", "expected NAME:+TOL"),
])
def test_rule_errors_name_the_rule(text, message):
    with pytest.raises(ValueError) as e:
        Rule.parse(text)
    assert repr(text) in str(e.value) and message in str(e.value)


def test_unknown_metric_error_lists_allowed_names():
    with pytest.raises(ValueError, match="allowed: .*peak_mem_bytes.*comm_total_bytes"):
        Rule.parse("bogus:+1%")


def test_rules_may_name_extra_engine_metrics():
    assert Rule.parse("limiter_stall:+50%", ["peak_mem_bytes", "limiter_stall_s"]).metrics == ("limiter_stall_s",)


# --------------------------------------------------------------------------- verdicts


def _row(comparison: pd.DataFrame, metric: str, cell: str = "ddp-ws2-fp32") -> pd.Series:
    hit = comparison[(comparison["metric"] == metric) & (comparison["cell_id"] == cell)]
    assert len(hit) == 1, hit
    return hit.iloc[0]


def test_identical_runs_pass(tmp_path, capsys):
    base, new = run_folder(tmp_path, "base"), run_folder(tmp_path, "new")
    assert cli(base, new, "--gate", "all") == 0
    assert "PASS" in capsys.readouterr().out
    comparison = compare_runs(load_run(base), load_run(new), gate="all")
    assert set(comparison["verdict"]) == {"ok"}
    assert "peak_allocated_bytes" not in set(comparison["metric"])  # empty in both: not a row


def test_time_rule_is_spread_aware(tmp_path):
    """Baseline MAD is 10% of the median, so k=3 allows 30%: +20% passes a +15% rule, +40% fails."""
    base = load_run(run_folder(tmp_path, "base", step_median=0.100, step_mad=0.010))
    rules = [Rule.parse("step_time:+15%")]
    within_mad = compare_runs(base, load_run(run_folder(tmp_path, "a", step_median=0.120)), rules)
    r = _row(within_mad, "step_time_s")
    assert r["verdict"] == "ok" and r["gated"] and r["limit"] == pytest.approx(0.030)
    beyond = compare_runs(base, load_run(run_folder(tmp_path, "b", step_median=0.140)), rules)
    assert _row(beyond, "step_time_s")["verdict"] == "regression"
    assert exit_code(beyond) == 1 and exit_code(within_mad) == 0
    # k=0: the tolerance alone decides, so +20% now fails
    exact = compare_runs(base, load_run(run_folder(tmp_path, "c", step_median=0.120)), [Rule.parse("step_time:+15%,k=0")])
    assert _row(exact, "step_time_s")["verdict"] == "regression"


def test_time_rule_tight_spread_falls_back_to_tolerance(tmp_path):
    """With a tiny MAD the tolerance is the bar: +12% passes +15%, +20% fails."""
    base = load_run(run_folder(tmp_path, "base", step_median=0.100, step_mad=0.0001))
    rules = [Rule.parse("step_time:+15%,k=3")]
    assert _row(compare_runs(base, load_run(run_folder(tmp_path, "a", step_median=0.112)), rules),
                "step_time_s")["verdict"] == "ok"
    assert _row(compare_runs(base, load_run(run_folder(tmp_path, "b", step_median=0.120)), rules),
                "step_time_s")["verdict"] == "regression"


def test_mad_falls_back_to_results_column_without_steps_csv(tmp_path):
    results, _ = make_run(step_mad=0.010)
    base = load_run(write_run(tmp_path / "base", results))  # no steps.csv
    new = load_run(run_folder(tmp_path, "new", step_median=0.120))
    r = _row(compare_runs(base, new, [Rule.parse("step_time:+15%")]), "step_time_s")
    assert r["verdict"] == "ok" and r["spread"] == pytest.approx(0.030)


def test_time_is_reported_not_gated_by_default(tmp_path, capsys):
    base, slow = run_folder(tmp_path, "base", step_mad=0.001), run_folder(tmp_path, "slow", step_median=0.2)
    assert cli(base, slow) == 0
    assert "worse (not gated)" in capsys.readouterr().out
    assert cli(base, slow, "--gate", "all") == 1
    assert cli(base, slow, "--fail-on", "step_time:+15%") == 1
    assert cli(base, slow, "--gate", "none", "--fail-on", "step_time:+150%") == 0


def test_deterministic_regression_fails(tmp_path, capsys):
    base, worse = run_folder(tmp_path, "base"), run_folder(tmp_path, "worse", peak_mem=40 * MiB + 64)
    assert cli(base, worse) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "peak_mem_bytes" in out and "+64 B" in out
    assert cli(base, worse, "--gate", "none") == 0


def test_peaks_a_memory_pass_could_not_make_exact_are_reported_not_gated(tmp_path):
    """memory_steps above MEMORY_PASS_ATTEMPTS: no step's peak was exact on every rank (a
    storage freed late on gloo's thread may be counted), so that cell's peaks do not gate;
    communication still does, and a rule naming the peak still gates it."""
    from zerobench.schema.columns import MEMORY_PASS_ATTEMPTS

    base_results, base_steps = make_run(run_id="base")
    new_results, new_steps = make_run(run_id="new", peak_mem=40 * MiB + 525_312)
    new_results["memory_steps"] = 1
    new_results.loc[new_results["cell_id"] == "ddp-ws2-fp32", "memory_steps"] = MEMORY_PASS_ATTEMPTS + 1
    base = write_run(tmp_path / "base", base_results, base_steps)
    new = write_run(tmp_path / "new", new_results, new_steps)
    comparison = compare_runs(load_run(base), load_run(new))
    doubtful = _row(comparison, "peak_mem_bytes")
    assert doubtful["verdict"] == "regression" and not doubtful["gated"] and "no exact peak" in doubtful["note"]
    exact = _row(comparison, "peak_mem_bytes", cell="fully_shard-ws2-fp32-reshard_true")
    assert exact["verdict"] == "regression" and exact["gated"]
    assert _row(comparison, "comm_total_bytes")["gated"]
    named = compare_runs(load_run(base), load_run(new), [Rule.parse("peak_mem:+0")])
    assert _row(named, "peak_mem_bytes")["gated"]


def test_fail_on_sets_the_tolerance(tmp_path):
    base = run_folder(tmp_path, "base")
    assert cli(base, run_folder(tmp_path, "p1", peak_mem=40 * MiB * 1.01), "--fail-on", "peak_mem:+2%") == 0
    assert cli(base, run_folder(tmp_path, "p3", peak_mem=40 * MiB * 1.03), "--fail-on", "peak_mem:+2%") == 1


def test_improvement_is_not_a_regression(tmp_path):
    comparison = compare_runs(load_run(run_folder(tmp_path, "base")),
                              load_run(run_folder(tmp_path, "less", peak_mem=30 * MiB, comm=4 * MiB)))
    assert _row(comparison, "peak_mem_bytes")["verdict"] == "improved"
    assert exit_code(comparison) == 0


@pytest.mark.parametrize("delta", [+1e-3, -1e-3])
def test_a_loss_that_moves_either_way_is_a_regression(tmp_path, delta):
    comparison = compare_runs(load_run(run_folder(tmp_path, "base")),
                              load_run(run_folder(tmp_path, "new", loss_last=2.5 + delta)))
    assert _row(comparison, "loss_last")["verdict"] == "regression"
    assert exit_code(comparison) == 1


def test_ranks_aggregate_worst_memory_and_mean_loss(tmp_path):
    base = load_run(run_folder(tmp_path, "base"))
    per_cell = compare_runs(base, base)
    assert _row(per_cell, "peak_mem_bytes")["baseline"] == 40 * MiB + 1024   # max over ranks
    assert _row(per_cell, "loss_last")["baseline"] == pytest.approx(3.0)      # mean of 2.5, 3.5
    assert per_cell["rank"].isna().all()
    per_rank = compare_runs(base, base, per_rank=True)
    assert set(per_rank["rank"].dropna()) == {0, 1}


def test_failed_cell_is_a_regression(tmp_path, capsys):
    base = run_folder(tmp_path, "base")
    failed = run_folder(tmp_path, "failed", status={"ddp-ws2-fp32": "failed"})
    assert cli(base, failed, "--gate", "none") == 1
    out = capsys.readouterr().out
    assert "ok -> failed: boom" in out
    assert cli(failed, base) == 0  # failed -> ok is an improvement


def test_missing_and_new_cells_are_unusable_input(tmp_path, capsys):
    base = run_folder(tmp_path, "base")
    other = run_folder(tmp_path, "other", cells=("ddp-ws2-fp32", "zero2-ws2-fp32"))
    assert cli(base, other) == 2
    out = capsys.readouterr().out
    assert "fully_shard-ws2-fp32-reshard_true" in out and "zero2-ws2-fp32" in out
    assert "missing" in out and "new" in out and "UNUSABLE" in out


def test_skipped_cell_is_missing(tmp_path):
    comparison = compare_runs(load_run(run_folder(tmp_path, "base")),
                              load_run(run_folder(tmp_path, "skip", status={"ddp-ws2-fp32": "skipped"})))
    assert _row(comparison, "status")["verdict"] == "missing" and exit_code(comparison) == 2


def test_same_id_with_a_different_configuration_is_unusable(tmp_path):
    base = load_run(run_folder(tmp_path, "base"))
    results, steps = make_run()
    results.loc[results["cell_id"] == "ddp-ws2-fp32", "dtype"] = "bf16"
    results.loc[:, "batch_size"] = 16  # context: reported only
    new = load_run(write_run(tmp_path / "new", results, steps))
    mismatches = config_mismatches(base, new)
    assert set(mismatches["severity"]) == {"identity", "context"}
    assert exit_code(compare_runs(base, new), mismatches) == 2
    assert cli(base.path, new.path) == 2


def test_context_difference_alone_is_reported_not_fatal(tmp_path, capsys):
    base = run_folder(tmp_path, "base")
    results, steps = make_run()
    results["batch_size"] = 16
    assert cli(base, write_run(tmp_path / "new", results, steps)) == 0
    assert "batch_size" in capsys.readouterr().out


def test_a_different_model_is_unusable_not_a_regression(tmp_path, capsys):
    """Two runs of different models share cell ids but not a configuration (README: exit 2)."""
    base = run_folder(tmp_path, "base")
    results, steps = make_run(peak_mem=80 * MiB, loss_last=1.0)
    results["model"] = "mlp(depth=1, width=8)"
    assert cli(base, write_run(tmp_path / "new", results, steps)) == 2
    assert "model" in capsys.readouterr().out


def test_unreadable_input(tmp_path, capsys):
    base = run_folder(tmp_path, "base")
    (tmp_path / "empty").mkdir()
    assert cli(base, tmp_path / "empty") == 2
    assert "no results.csv" in capsys.readouterr().out
    assert cli(base, base, "--fail-on", "bogus:+1%") == 2
    dup, steps = make_run()
    assert cli(base, write_run(tmp_path / "dup", pd.concat([dup, dup.head(1)]), steps)) == 2


def test_markdown_plot_and_csv_written(tmp_path):
    base = run_folder(tmp_path, "base")
    worse = run_folder(tmp_path, "worse", peak_mem=44 * MiB, step_median=0.115, loss_last=2.6)
    md, png, csv = tmp_path / "out/report.md", tmp_path / "out/changes.png", tmp_path / "out/cmp.csv"
    assert cli(base, worse, "--markdown", md, "--plot", png, "--csv", csv, "--all") == 1
    text = md.read_text()
    assert text.startswith("## zerobench compare: FAIL")
    assert "### Regressions" in text and "| ddp-ws2-fp32 | peak_mem_bytes |" in text
    assert "<details><summary>All compared metrics" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(pd.read_csv(csv)["verdict"]) >= {"regression", "ok"}


def test_plot_with_nothing_changed(tmp_path):
    from zerobench.analysis.compare.report import plot_changes

    base = load_run(run_folder(tmp_path, "base"))
    assert plot_changes(compare_runs(base, base), tmp_path / "none.png").stat().st_size > 0


def test_extra_engine_metrics_and_numeric_axes_as_the_harness_lays_them_out(tmp_path):
    """The harness puts engine extras (limiter_stall_s) and axes (emulate_gbps) before the
    schema metrics: extras are context metrics, axes are configuration."""
    def layout(stall: float, gbps: float) -> Path:
        results, steps = make_run()
        results.insert(8, "emulate_gbps", gbps)
        results = results.drop(columns="limiter_stall_s")
        results.insert(9, "limiter_stall_s", stall)
        return write_run(tmp_path / f"run-{stall}-{gbps}", results, steps)

    base, slower = load_run(layout(0.001, 10.0)), load_run(layout(0.002, 10.0))
    assert "limiter_stall_s" in base.metric_columns and "emulate_gbps" in base.config_columns
    comparison = compare_runs(base, slower, gate="all")
    r = _row(comparison, "limiter_stall_s")
    assert r["kind"] == "context" and r["verdict"] == "ok" and not r["gated"]
    assert exit_code(comparison, config_mismatches(base, slower)) == 0
    gated = compare_runs(base, slower, [Rule.parse("limiter_stall:+10%", base.metric_columns)])
    assert _row(gated, "limiter_stall_s")["verdict"] == "regression" and exit_code(gated) == 1
    other_axis = load_run(layout(0.001, 5.0))
    assert exit_code(compare_runs(base, other_axis), config_mismatches(base, other_axis)) == 2


def test_axis_added_since_the_baseline_at_its_default_is_the_same_cell(tmp_path):
    """A baseline written before impl-zero1 had overlap_hook stays usable while the run
    has the axis at its default; any other value is a different configuration."""
    cells = ("impl-zero1-ws2-fp32",)

    def run(name: str, hook: str | None) -> Path:
        results, steps = make_run(cells=cells)
        results["engine"] = "impl-zero1"
        if hook is not None:
            results.insert(8, "overlap_hook", hook)
        return write_run(tmp_path / name, results, steps)

    base = load_run(run("base", None))
    assert "overlap_hook" in load_run(run("probe", "step")).config_columns
    for hook, expected in (("step", 0), ("interleaved", 2)):
        new = load_run(run(f"new-{hook}", hook))
        mismatches = config_mismatches(base, new)
        assert list(mismatches["column"]) == ["overlap_hook"]
        assert mismatches["severity"].item() == ("context" if expected == 0 else "identity")
        assert exit_code(compare_runs(base, new), mismatches) == expected
        assert exit_code(compare_runs(new, base), config_mismatches(new, base)) == expected  # axis dropped


def test_report_only_ungates_defaults_but_not_rules(tmp_path):
    base = run_folder(tmp_path, "base")
    worse = run_folder(tmp_path, "worse", peak_mem=40 * MiB * 1.03)
    assert cli(base, worse, "--report-only", "peak_mem") == 0
    assert cli(base, worse, "--report-only", "peak_mem_*", "--fail-on", "peak_mem:+2%") == 1
    assert cli(base, worse, "--report-only", "peak_mem_*", "--fail-on", "peak_mem:+5%") == 0
    assert cli(base, worse, "--report-only", "bogus") == 2


def test_failed_cell_error_becomes_one_line(tmp_path):
    results, steps = make_run(status={"ddp-ws2-fp32": "failed"})
    results.loc[results["status"] == "failed", "error"] = "Traceback:\n  File x\nRuntimeError: boom\n"
    new = load_run(write_run(tmp_path / "new", results, steps))
    base = load_run(run_folder(tmp_path, "base"))
    row = _row(compare_runs(base, new), "status")
    assert row["note"] == "ok -> failed: Traceback: File x RuntimeError: boom"
    assert config_mismatches(base, new).empty  # a failed cell's missing context is not a difference


def test_committed_baseline_loads_and_passes_against_itself(tmp_path):
    """results/baselines/cpu-quickstart stays readable by compare as the schema moves on."""
    path = Path(__file__).parents[1] / "results" / "baselines" / "cpu-quickstart"
    if not (path / "results.csv").exists():
        pytest.skip("no committed baseline")
    baseline = load_run(path)
    assert {"peak_mem_bytes", "comm_total_bytes", "loss_last", "steady_mem_bytes"} <= set(baseline.metric_columns)
    assert baseline.steps is not None and len(baseline.steps)
    assert cli(path, path, "--fail-on", "peak_mem:+10%", "--report-only", "peak_mem_*", "--gate", "all") == 0


# --------------------------------------------------------------------------- losses across machines
# See [Note: losses across machines] in zerobench/analysis/compare/rules.py.

BASELINE = Path(__file__).parents[1] / "results" / "baselines" / "cpu-quickstart"


def _copy_run(src: Path, dst: Path, meta_update: dict | None = None, bf16_shift: dict | None = None,
              fp32_shift: dict | None = None) -> Path:
    """A copy of a run folder, with its losses shifted per dtype and meta.json edited."""
    dst.mkdir(parents=True)
    results = pd.read_csv(src / "results.csv")
    for dtype, shift in (("bf16", bf16_shift), ("fp32", fp32_shift)):
        for col, delta in (shift or {}).items():
            results.loc[results["dtype"] == dtype, col] += delta
    results.to_csv(dst / "results.csv", index=False)
    (dst / "steps.csv").write_bytes((src / "steps.csv").read_bytes())
    meta = json.loads((src / "meta.json").read_text())
    meta.update(meta_update or {})
    (dst / "meta.json").write_text(json.dumps(meta))
    return dst


#: What a fresh clone on another 2-core machine of the same model name measured against the
#: committed baseline: every bf16 cell moved by these amounts, fp32 cells not at all.
OTHER_MACHINE_BF16 = {"loss_first": 4.3e-6, "loss_last": -3.1e-5, "loss_max_abs_diff_ref": 3.0e-5}


def test_bf16_losses_from_another_machine_pass(tmp_path):
    if not (BASELINE / "results.csv").exists():
        pytest.skip("no committed baseline")
    flags = {"cpu_flags": ["avx", "avx2", "fma"]}
    base = _copy_run(BASELINE, tmp_path / "base", {**flags, "cpu_flags": ["avx", "avx2", "avx512f", "fma"]})
    new = _copy_run(BASELINE, tmp_path / "new", flags, bf16_shift=OTHER_MACHINE_BF16)
    comparison = compare_runs(load_run(base), load_run(new))
    bf16 = comparison[comparison["cell_id"].str.contains("bf16") & comparison["metric"].str.startswith("loss")]
    assert len(bf16) and (bf16["verdict"] == "ok").all(), bf16
    assert not bf16[bf16["metric"].isin(["loss_first", "loss_last"])]["gated"].any()
    assert exit_code(comparison) == 0
    assert cli(base, new, "--fail-on", "peak_mem:+10%", "--report-only", "peak_mem_*") == 0


def test_bf16_losses_on_the_same_machine_are_still_not_compared_exactly(tmp_path):
    """bf16 is judged against its own reference even when the hardware looks the same:
    the machine that failed CI reported the same model name as the baseline's."""
    if not (BASELINE / "results.csv").exists():
        pytest.skip("no committed baseline")
    same = {"cpu_flags": ["avx", "avx2"], "cpu_model": "AMD EPYC", "gpu_model": None}
    base = _copy_run(BASELINE, tmp_path / "base", same)
    new = _copy_run(BASELINE, tmp_path / "new", same, bf16_shift=OTHER_MACHINE_BF16)
    assert exit_code(compare_runs(load_run(base), load_run(new))) == 0


def test_bf16_loss_far_from_the_reference_fails(tmp_path):
    if not (BASELINE / "results.csv").exists():
        pytest.skip("no committed baseline")
    base = _copy_run(BASELINE, tmp_path / "base")
    # a wrong reduction: 0.05 away from single-process training, well past bf16's 2^-8 * |loss|
    new = _copy_run(BASELINE, tmp_path / "new", bf16_shift={"loss_max_abs_diff_ref": 0.05})
    comparison = compare_runs(load_run(base), load_run(new))
    rows = comparison[(comparison["metric"] == "loss_max_abs_diff_ref") & comparison["cell_id"].str.contains("bf16")]
    assert (rows["verdict"] == "regression").all() and rows["gated"].all()
    assert exit_code(comparison) == 1


def test_fp32_losses_exact_on_same_hardware_bounded_across(tmp_path):
    if not (BASELINE / "results.csv").exists():
        pytest.skip("no committed baseline")
    same = {"cpu_flags": ["avx", "avx2"], "cpu_model": "AMD EPYC", "gpu_model": None}
    base = _copy_run(BASELINE, tmp_path / "base", same)
    moved = {"loss_last": 2e-6, "loss_max_abs_diff_ref": 2e-6}
    new_same = _copy_run(BASELINE, tmp_path / "same", same, fp32_shift=moved)
    assert exit_code(compare_runs(load_run(base), load_run(new_same))) == 1  # same machine: exact
    new_other = _copy_run(BASELINE, tmp_path / "other", {**same, "cpu_flags": ["avx", "avx2", "avx512f"]},
                          fp32_shift=moved)
    assert exit_code(compare_runs(load_run(base), load_run(new_other))) == 0  # across: bounded
    far = _copy_run(BASELINE, tmp_path / "far", {**same, "cpu_flags": ["avx512f"]},
                    fp32_shift={"loss_max_abs_diff_ref": 1e-3})
    assert exit_code(compare_runs(load_run(base), load_run(far))) == 1


def test_hardware_difference_is_reported(tmp_path, capsys):
    from zerobench.analysis.compare.gate import hardware_differences

    assert hardware_differences({}, {}) == []
    assert hardware_differences({"cpu_flags": ["avx2"]}, {"cpu_flags": ["avx2"]}) == []
    assert hardware_differences({}, {"cpu_flags": ["avx2"]}) == ["cpu_flags not recorded by the baseline"]
    assert "avx512f" in hardware_differences({"cpu_flags": ["avx512f"]}, {"cpu_flags": ["avx2"]})[0]
    base = write_run(tmp_path / "base", *make_run(), meta={"cpu_flags": ["avx512f"]})
    new = write_run(tmp_path / "new", *make_run(), meta={"cpu_flags": ["avx2"]})
    assert cli(base, new) == 0
    assert "different hardware" in capsys.readouterr().out
