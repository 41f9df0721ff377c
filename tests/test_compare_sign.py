"""The allowed change reads in the direction of the change it bounds ([Note: allowed
change] in zerobench/analysis/compare/gate.py), in every rendering of ``zerobench
compare``: the console's table and pass lines, Markdown, JUnit and the plot. Once a
throughput that fell 80 % printed as ``-79.98 % (allowed +498.27)``. And the plot's words
stay inside its axes, every text inside the figure.

On the synthetic run folders of tests/helpers/compare_runs.py."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

import pytest

from tests.helpers.compare_runs import cli, run_folder
from zerobench.analysis.compare.gate import _allowed_change, compare_runs, load_run
from zerobench.analysis.compare.report import changes_figure


def _pair(tmp_path, step_new: float):
    base = run_folder(tmp_path, "base", step_mad=0.001)
    new = run_folder(tmp_path, f"new-{step_new}", step_median=step_new, step_mad=0.001)
    return base, new


def _row(comparison, metric, cell="ddp-ws2-fp32"):
    return comparison[(comparison["metric"] == metric) & (comparison["cell_id"] == cell)].iloc[0]


@pytest.mark.parametrize("step_new", [0.150, 0.050])  # slower, faster
def test_the_allowed_change_has_the_sign_of_the_change(tmp_path, step_new):
    base, new = _pair(tmp_path, step_new)
    comparison = compare_runs(load_run(base), load_run(new), gate="all")
    for metric in ("step_time_s", "throughput_samples_s"):
        row = _row(comparison, metric)
        assert math.copysign(1, row["allowed_change"]) == math.copysign(1, row["change"]), metric
        assert abs(row["allowed_change"]) == pytest.approx(row["limit"])
        assert math.copysign(1, row["allowed_change_pct"]) == math.copysign(1, row["change_pct"])


def test_no_change_is_bounded_in_the_direction_that_would_be_worse():
    assert _allowed_change(0.0, 2.0, 10.0, "lower")["allowed_change"] == 2.0
    assert _allowed_change(0.0, 2.0, 10.0, "higher")["allowed_change"] == -2.0
    assert _allowed_change(-1.0, 2.0, 10.0, "lower", one_sided=True)["allowed_change"] != \
        _allowed_change(-1.0, 2.0, 10.0, "lower", one_sided=True)["allowed_change"]  # a ceiling: no bound below
    assert _allowed_change(+1.0, 2.0, 10.0, "lower", one_sided=True) == {"allowed_change": 2.0,
                                                                         "allowed_change_pct": 20.0}


def test_console_markdown_and_junit_sign_the_bound_like_the_change(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # every pass line whole ([Note: a pass fits a CI log])
    base, slower = _pair(tmp_path, 0.150)  # step +50 %, throughput -33 %
    capsys.readouterr()
    assert cli(base, slower) == 0  # time is reported, not gated: the pass lines
    out = capsys.readouterr().out
    assert re.search(r"throughput_samples_s -33\.33% \(allowed -10\.00%\)", out), out
    assert re.search(r"step_time_s \+50\.00% \(allowed \+10\.00%\)", out), out
    md, xml = tmp_path / "r.md", tmp_path / "r.xml"
    assert cli(base, slower, "--gate", "all", "--markdown", md, "--junit-xml", xml) == 1
    out = capsys.readouterr().out
    table_row = next(line for line in out.splitlines() if line.startswith("throughput_samples_s"))
    change, allowed = re.findall(r"[+-][\d.,]+", table_row)[:2]
    assert change.startswith("-") and allowed.startswith("-"), table_row
    md_row = next(line for line in md.read_text().splitlines() if "| throughput_samples_s |" in line)
    cells = [c.strip() for c in md_row.split("|")]
    assert cells[cells.index("throughput_samples_s") + 3].startswith("-")  # change
    assert cells[cells.index("throughput_samples_s") + 5].startswith("-")  # allowed
    failures = [f.get("message") for f in ET.parse(xml).getroot().iter("failure")]
    throughput = next(m for m in failures if "throughput_samples_s" in m)
    assert re.search(r"change -[\d.]+ \(-33\.33%\), allowed -[\d.]+", throughput), throughput
    step = next(m for m in failures if "step_time_s:" in m)
    assert re.search(r"change \+50 ms \(\+50\.00%\), allowed \+", step), step


def _texts(fig):
    import matplotlib.text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return renderer, [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]


@pytest.mark.parametrize("step_new", [0.150, 0.050, 0.40])
def test_the_plots_words_stay_inside_and_its_ticks_on_the_side_of_the_change(tmp_path, step_new):
    base, new = _pair(tmp_path, step_new)
    comparison = compare_runs(load_run(base), load_run(new), gate="all")
    fig = changes_figure(comparison, title=f"{new.name} vs {base.name} -- a title long enough to need wrapping " * 4)
    try:
        renderer, texts = _texts(fig)
        ax = fig.axes[0]
        inside, page = ax.get_window_extent(renderer), fig.bbox
        for t in texts:
            box = t.get_window_extent(renderer)
            assert box.x0 >= page.x0 - 1 and box.x1 <= page.x1 + 1 and box.y0 >= page.y0 - 1 and \
                box.y1 <= page.y1 + 1, f"{t.get_text()!r} leaves the figure"
        words = [t for t in ax.texts if t.get_text().endswith(("worse", "better", "no change"))]
        assert words
        for t in words:
            box = t.get_window_extent(renderer)
            assert inside.x0 <= box.x0 and box.x1 <= inside.x1, f"{t.get_text()!r} runs past the axes"
        ticks = ax.collections[0].get_offsets()[:, 0]  # the allowed change, in % with positive = worse
        bars = [p.get_width() for p in ax.patches]
        for x, tick in zip(bars, ticks):
            if not math.isnan(tick) and x != 0:
                assert math.copysign(1, tick) == math.copysign(1, x), (x, tick)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
