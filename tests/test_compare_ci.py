"""What a CI system gets from ``zerobench compare``: JSON and JUnit reports, a subset of
the baseline's cells, a short log on a pass, and ``python -m zerobench compare``.

On the small synthetic run folders of tests/helpers/compare_runs.py; no distributed runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.helpers.compare_runs import MiB, cli, make_run, run_folder, write_run

ROOT = Path(__file__).parents[1]
CELLS = ("ddp-ws2-fp32", "fully_shard-ws2-fp32-reshard_true")


def _cases(xml_path: Path) -> dict[tuple[str, str], ET.Element]:
    root = ET.parse(xml_path).getroot()
    assert root.tag == "testsuites"
    return {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}


# --------------------------------------------------------------------------- JUnit, JSON


def test_junit_has_one_case_per_cell_and_metric_and_a_failure_that_names_everything(tmp_path):
    base = run_folder(tmp_path, "base")
    worse = run_folder(tmp_path, "worse", peak_mem=44 * MiB)
    xml_path, json_path = tmp_path / "out" / "compare.xml", tmp_path / "out" / "compare.json"
    assert cli(base, worse, "--junit-xml", xml_path, "--json", json_path) == 1

    cases = _cases(xml_path)
    report = json.loads(json_path.read_text())
    compared = {(r["cell_id"], r["metric"]) for r in report["rows"]}
    assert set(cases) == compared                               # one test case per cell and metric
    assert {cell for cell, _ in cases} == set(CELLS) and ("ddp-ws2-fp32", "status") in cases
    failing = {key for key, case in cases.items() if case.find("failure") is not None}
    assert failing == {(cell, "peak_mem_bytes") for cell in CELLS}
    failure = cases[("ddp-ws2-fp32", "peak_mem_bytes")].find("failure")
    message = failure.get("message")
    # the metric, the baseline, the new value and the allowed change, in the attribute and the text
    assert "peak_mem_bytes" in message and "baseline 40.001 MiB" in message and "new 44.001 MiB" in message
    assert "allowed +42 B" in message and "default +1e-6 rel" in message
    assert failure.text == message
    suite = ET.parse(xml_path).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == (str(len(cases)), "2", "0")

    assert report["exit_code"] == 1 and report["outcome"] == "FAIL (regression)"
    assert report["summary"]["regressions"] == 2
    row = next(r for r in report["rows"] if r["cell_id"] == "ddp-ws2-fp32" and r["metric"] == "peak_mem_bytes")
    assert row["verdict"] == "regression" and row["baseline"] == 40 * MiB + 1024 and row["gated"] is True


def test_a_pass_writes_reports_without_failures(tmp_path):
    base, same = run_folder(tmp_path, "base"), run_folder(tmp_path, "same")
    xml_path = tmp_path / "c.xml"
    assert cli(base, same, "--junit-xml", xml_path, "--json", tmp_path / "c.json") == 0
    root = ET.parse(xml_path).getroot()
    assert root.get("failures") == "0" and root.get("errors") == "0" and int(root.get("tests")) > 10
    assert json.loads((tmp_path / "c.json").read_text())["outcome"] == "PASS"


def test_time_worse_but_not_gated_passes_with_a_note(tmp_path):
    base = run_folder(tmp_path, "base", step_mad=0.001)
    slow = run_folder(tmp_path, "slow", step_median=0.150, step_mad=0.001)
    xml_path = tmp_path / "c.xml"
    assert cli(base, slow, "--junit-xml", xml_path) == 0
    case = _cases(xml_path)[("ddp-ws2-fp32", "step_time_s")]
    assert case.find("failure") is None and "not gated" in case.find("system-out").text


def test_unusable_input_is_an_error_case(tmp_path):
    base = run_folder(tmp_path, "base")
    other = run_folder(tmp_path, "other", cells=("ddp-ws2-fp32",))
    xml_path = tmp_path / "c.xml"
    assert cli(base, other, "--junit-xml", xml_path) == 2
    cases = _cases(xml_path)
    error = cases[("fully_shard-ws2-fp32-reshard_true", "status")].find("error")
    assert error is not None and "unusable input" in error.get("message") and "missing" in error.get("message")


def test_an_unreadable_folder_still_gives_the_ci_its_reports(tmp_path, capsys):
    base = run_folder(tmp_path, "base")
    xml_path, json_path = tmp_path / "c.xml", tmp_path / "c.json"
    assert cli(base, tmp_path / "does-not-exist", "--junit-xml", xml_path, "--json", json_path) == 2
    (case,) = _cases(xml_path).values()
    assert "does-not-exist" in case.find("error").get("message")
    report = json.loads(json_path.read_text())
    assert report["exit_code"] == 2 and "does-not-exist" in report["error"]
    said = capsys.readouterr()
    assert "does-not-exist" in said.out + said.err


# --------------------------------------------------------------------------- --cells


def test_a_subset_of_the_baselines_cells(tmp_path, capsys):
    base = run_folder(tmp_path, "base")
    subset = run_folder(tmp_path, "subset", cells=("ddp-ws2-fp32",))
    assert cli(base, subset) == 2                                  # without --cells: a missing cell
    assert cli(base, subset, "--cells", "ddp-ws2-fp32") == 0
    assert cli(base, subset, "--cells", "ddp-*") == 0              # a glob
    worse = run_folder(tmp_path, "worse", cells=("ddp-ws2-fp32",), peak_mem=50 * MiB)
    assert cli(base, worse, "--cells", "ddp-ws2-fp32") == 1       # the subset still gates
    assert cli(base, subset, "--cells", "ddp-ws2-fp32,fully_shard-*") == 2   # asked for, and missing


def test_cells_that_match_nothing_are_bad_input_naming_the_cells(tmp_path, capsys):
    base = run_folder(tmp_path, "base")
    capsys.readouterr()
    assert cli(base, base, "--cells", "impl-fsdp-*") == 2
    out = capsys.readouterr().out
    assert "'impl-fsdp-*' matches no cell" in out and "ddp-ws2-fp32" in out


# --------------------------------------------------------------------------- the log


def test_a_pass_prints_at_most_one_line_per_cell(tmp_path, capsys):
    cells = tuple(f"ddp-ws2-fp32-x{i}" for i in range(6))
    results, steps = make_run(cells=cells, step_mad=0.001)
    base = write_run(tmp_path / "base", results, steps)
    results, steps = make_run(cells=cells, step_median=0.150, step_mad=0.001, run_id="new")
    new = write_run(tmp_path / "new", results, steps)
    capsys.readouterr()
    assert cli(base, new) == 0                                      # time worse, not gated: a pass
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("PASS")
    body = [line for line in lines[:-1] if "ddp-ws2" in line]  # under the header (one line, or three)
    assert len(body) == len(cells) and all(line.strip().split(":")[0] in cells for line in body)
    assert all("step_time_s +50.00%" in line and "worse (not gated)" in line for line in body)
    capsys.readouterr()
    assert cli(base, new, "--all") == 0                             # the whole table on request
    assert len(capsys.readouterr().out.splitlines()) > 3 * len(cells)


def test_a_failure_prints_the_table(tmp_path, capsys):
    base = run_folder(tmp_path, "base")
    worse = run_folder(tmp_path, "worse", comm=9 * MiB)
    capsys.readouterr()
    assert cli(base, worse) == 1
    out = capsys.readouterr().out
    assert "comm_total_bytes" in out and "regression" in out and "allowed" in out


# --------------------------------------------------------------------------- python -m


@pytest.mark.parametrize("folder, code", [("same", 0), ("missing", 2)])
def test_python_m_zerobench_compare_is_the_same_command(tmp_path, folder, code):
    base = run_folder(tmp_path, "base")
    if folder == "same":
        run_folder(tmp_path, "same")
    proc = subprocess.run([sys.executable, "-m", "zerobench", "compare", str(base), str(tmp_path / folder)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert ("PASS" if code == 0 else str(tmp_path / folder)) in proc.stdout + proc.stderr


def test_a_pass_fits_the_log_one_line_per_cell_and_one_for_metrics_the_baseline_lacks(tmp_path, capsys, monkeypatch):
    """[Note: a pass fits a CI log]: a slower run (reported, not gated) whose results have
    columns the baseline does not: every line fits COLUMNS, each cell is one line, and the
    new metrics are one line whatever their number."""
    from tests.helpers.compare_runs import make_run, write_run
    from zerobench.schema.columns import METRICS

    cells = tuple(f"torch-fsdp1-ws2-fp32-sharding_strategy=SHARD_GRAD_OP-backward_prefetch=post-n{i}" for i in range(3))
    base = write_run(tmp_path / "base", *make_run(run_id="base", cells=cells, step_mad=0.001))
    results, steps = make_run(run_id="new", cells=cells, step_median=0.2)
    added = [m.name for m in METRICS if m.kind == "deterministic" and m.name not in results.columns][:6]
    assert len(added) == 6
    for metric in added:
        results[metric] = 1024.0
    new = write_run(tmp_path / "new", results, steps)
    monkeypatch.setenv("COLUMNS", "72")
    assert cli(base, new) == 0
    out = capsys.readouterr().out.splitlines()
    wide = [line for line in out if len(line) > 72]
    assert all(len(line.split()) <= 3 and str(tmp_path) in line for line in wide), wide  # a path, kept whole
    assert sum(line.startswith("  torch-fsdp1-") for line in out) == len(cells)  # each cell once
    at = next(i for i, line in enumerate(out) if "not in the baseline" in line)
    assert out[at + 1].strip().startswith(added[0]) and out[at + 1].endswith(" more"), out  # six in 72: counted
    assert out[at + 2].startswith("PASS"), out  # the summary follows (wrapped at the width by rich)
    assert any(line.startswith("PASS") for line in out)


@pytest.mark.parametrize("width", [40, 60, 80, 100])
def test_a_pass_line_never_passes_the_width_whatever_its_parts(width):
    """_fit_parts: a head and parts of every length, the count of what was left out
    included; only a part wider than the log itself is kept whole."""
    from zerobench.analysis.compare.report import _fit_parts

    parts = [f"step_time_s +{n}.75% (allowed +19.41%) worse (not gated)"[: 20 + 7 * n] for n in range(1, 7)]
    for head in ("ddp-ws2-bf16: ", "impl-fsdp-ws2-bf16-sharding_strategy=SHARD_GRAD_OP: ", ""):
        for k in range(1, len(parts) + 1):
            lines = _fit_parts(head, parts[:k], width)
            assert all(len(line) <= width for line in lines if len(line.split(", ")[0]) <= width - 12), lines
            shown = sum(line.count(", ") + 1 for line in lines if line.strip() and not line.endswith(":"))
            assert shown >= 1
