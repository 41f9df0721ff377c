"""Machine-readable renderings of a comparison, for CI systems: JSON and JUnit XML.

Both take the DataFrames :func:`zerobench.analysis.compare.gate.compare_runs` and
``config_mismatches`` return, decide nothing, and are written atomically.

[Note: JUnit layout]
One ``<testcase>`` per compared cell and metric (per cell, rank and metric with
``--per-rank``): ``classname`` is the cell id, ``name`` the metric, so that GitLab's test
report (which shows ``classname`` as the suite) and GitHub actions that read JUnit
(mikepenz/action-junit-report, dorny/test-reporter) group a cell's metrics together. A
cell's presence and status is the test case named ``status``. A gated regression is a
``<failure>`` whose message names the metric, the baseline, the new value and the
allowed change; unusable input (a cell or a gated metric in one run only, a
configuration that differs under the same id, a folder that cannot be read) is an
``<error>``; everything else passes, a metric that got worse but is not gated with a
``<system-out>`` line saying so. GitLab shows the element's text, not its ``message``
attribute (gitlab-org/gitlab#25098), so the text repeats the message.
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd

from zerobench.analysis.compare.gate import CELL_ROW
from zerobench.analysis.compare.report import (
    OUTCOME,
    ReportInfo,
    fmt_allowed,
    fmt_pct,
    fmt_value,
    summarize,
    summary_line,
)
from zerobench.runs.files import write_atomic

SUITE = "zerobench compare"


def _clean(value):
    """A JSON-safe value: NaN and NA become null, numpy scalars plain numbers."""
    if value is None or value is pd.NA:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _records(frame: pd.DataFrame) -> list[dict]:
    return [{k: _clean(v) for k, v in row.items()} for row in frame.to_dict("records")]


def json_report(comparison: pd.DataFrame, mismatches: pd.DataFrame, info: ReportInfo,
                error: str | None = None) -> dict:
    """Everything a CI step needs to decide and explain: the outcome, the counts, every
    compared row, the configuration differences; ``error`` when the input was unusable
    before anything could be compared."""
    return {
        "tool": SUITE,
        "outcome": OUTCOME.get(info.exit_code, str(info.exit_code)),
        "exit_code": info.exit_code,
        "baseline": info.baseline,
        "new": info.new,
        "gate": info.gate,
        "rules": list(info.rules),
        "summary": summarize(comparison) if len(comparison) else {},
        "summary_line": summary_line(comparison, info) if len(comparison) else error or "",
        "hardware_differences": list(info.hardware),
        "error": error,
        "config_differences": _records(mismatches),
        "rows": _records(comparison),
    }


def write_json(path: str | Path, comparison: pd.DataFrame, mismatches: pd.DataFrame, info: ReportInfo,
               error: str | None = None) -> Path:
    path = Path(path)
    report = json_report(comparison, mismatches, info, error)
    write_atomic(path, lambda f: json.dump(report, f, indent=1))
    return path


# --------------------------------------------------------------------------- JUnit


def failure_message(row) -> str:
    """One line naming the metric, the baseline, the new value and the allowed change."""
    metric = row["metric"]
    if metric == CELL_ROW:
        return f"{row['cell_id']}: {row['verdict']}: {row['note']}"
    change = fmt_value(row["change"], metric, signed=True)
    pct = fmt_pct(row["change_pct"])
    allowed = fmt_allowed(row["allowed_change"], metric) or "n/a"  # signed like the change: [Note: allowed change]
    text = (f"{metric}: baseline {fmt_value(row['baseline'], metric) or 'n/a'}, "
            f"new {fmt_value(row['new'], metric) or 'n/a'}")
    if change:
        text += f", change {change}" + (f" ({pct})" if pct else "")
    text += f", allowed {allowed} (rule: {row['rule']})"
    return text + (f"; {row['note']}" if row["note"] else "")


_BAD_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _text(s: str) -> str:
    return _BAD_XML.sub("?", str(s))


def _case_name(row) -> str:
    rank = row["rank"]
    return row["metric"] + ("" if rank is None or pd.isna(rank) else f" (rank {int(rank)})")


def junit_xml(comparison: pd.DataFrame, mismatches: pd.DataFrame, info: ReportInfo,
              error: str | None = None) -> str:
    """The comparison as JUnit XML. See [Note: JUnit layout]."""
    cases = []
    for _, row in comparison.iterrows():
        case = ET.Element("testcase", classname=_text(row["cell_id"]), name=_text(_case_name(row)), time="0")
        verdict, gated = row["verdict"], bool(row["gated"])
        if verdict in ("missing", "new") and (gated or row["metric"] == CELL_ROW):
            message = "unusable input: " + failure_message(row)
            ET.SubElement(case, "error", message=_text(message), type="unusable").text = _text(message)
        elif verdict == "regression" and gated:
            message = "regression: " + failure_message(row)
            ET.SubElement(case, "failure", message=_text(message), type="regression").text = _text(message)
        elif verdict == "regression":
            ET.SubElement(case, "system-out").text = _text("worse beyond its tolerance, not gated: "
                                                          + failure_message(row))
        cases.append(case)
    for _, m in mismatches.iterrows():
        if m["severity"] != "identity":
            continue
        message = (f"unusable input: {m['cell_id']}: {m['column']} is {m['baseline']!r} in the baseline "
                   f"and {m['new']!r} in the new run (the same cell id, another configuration)")
        case = ET.Element("testcase", classname=_text(m["cell_id"]), name=_text(f"configuration: {m['column']}"),
                          time="0")
        ET.SubElement(case, "error", message=_text(message), type="unusable").text = _text(message)
        cases.append(case)
    if error is not None:
        case = ET.Element("testcase", classname=SUITE, name="input", time="0")
        ET.SubElement(case, "error", message=_text(error), type="unusable").text = _text(error)
        cases.append(case)
    failures = sum(1 for c in cases if c.find("failure") is not None)
    errors = sum(1 for c in cases if c.find("error") is not None)
    counts = {"tests": str(len(cases)), "failures": str(failures), "errors": str(errors), "skipped": "0",
              "time": "0"}
    root = ET.Element("testsuites", name=SUITE, **counts)
    suite = ET.SubElement(root, "testsuite", name=_text(f"{SUITE}: {info.new} vs {info.baseline}"), **counts)
    props = ET.SubElement(suite, "properties")
    for key, value in (("outcome", OUTCOME.get(info.exit_code, str(info.exit_code))), ("gate", info.gate),
                       ("rules", "; ".join(info.rules))):
        ET.SubElement(props, "property", name=key, value=_text(value))
    suite.extend(cases)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(path: str | Path, comparison: pd.DataFrame, mismatches: pd.DataFrame, info: ReportInfo,
                error: str | None = None) -> Path:
    path = Path(path)
    text = junit_xml(comparison, mismatches, info, error)
    write_atomic(path, lambda f: f.write(text))
    return path
