"""Render a comparison from :mod:`zerobench.analysis.compare.gate`: terminal table, Markdown, plot.

Every function takes the DataFrames ``compare_runs`` and ``config_mismatches`` return;
nothing here decides a verdict. matplotlib is imported only by :func:`plot_changes`.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from zerobench.analysis.compare.gate import CELL_ROW
from zerobench.analysis.compare.rules import metric_info
from zerobench.analysis.render import Column, Table, markdown, print_table, wrap_id

#: Verdicts always shown; deterministic metrics are also shown whenever they moved at all.
SHOW_VERDICTS = ("regression", "improved", "missing", "new")


@dataclass
class ReportInfo:
    """What was compared and how: the header of every rendering."""

    baseline: str
    new: str
    gate: str
    rules: list[str] = field(default_factory=list)
    exit_code: int = 0
    hardware: list[str] = field(default_factory=list)
    """Why baseline and run count as different hardware (empty: the same). Losses then
    follow the cross-machine rules: see [Note: losses across machines] in rules.py."""

    def hardware_line(self) -> str:
        if not self.hardware:
            return ""
        return ("baseline and run come from different hardware (" + "; ".join(self.hardware)
                + "): losses are judged by the cross-machine rules (distance to the run's own reference)")


def notable(comparison: pd.DataFrame) -> pd.Series:
    """Rows worth showing by default: not ok, or a deterministic metric that moved at all."""
    return comparison["verdict"].isin(SHOW_VERDICTS) | (
        (comparison["kind"] == "deterministic") & (comparison["change"].fillna(0) != 0)
    )


def summarize(comparison: pd.DataFrame) -> dict[str, int]:
    """Counts behind the summary line."""
    c = comparison
    cells = c[c["metric"] == CELL_ROW]
    reg = c["verdict"] == "regression"
    return {
        "cells": int(cells["cell_id"].nunique()),
        "metrics": int((c["metric"] != CELL_ROW).sum()),
        "regressions": int((reg & c["gated"]).sum()),
        "regressed_cells": int(c.loc[reg & c["gated"], "cell_id"].nunique()),
        "worse_not_gated": int((reg & ~c["gated"]).sum()),
        "improved": int((c["verdict"] == "improved").sum()),
        "missing": int((c["verdict"] == "missing").sum()),
        "new": int((c["verdict"] == "new").sum()),
    }


OUTCOME = {0: "PASS", 1: "FAIL (regression)", 2: "UNUSABLE INPUT"}


def summary_line(comparison: pd.DataFrame, info: ReportInfo) -> str:
    s = summarize(comparison)
    parts = [f"{s['regressions']} regression(s) in {s['regressed_cells']} of {s['cells']} cell(s)",
             f"{s['metrics']} metric values compared"]
    for key, label in (("missing", "missing"), ("new", "new"), ("improved", "improved"),
                       ("worse_not_gated", "worse beyond tolerance but not gated")):
        if s[key]:
            parts.append(f"{s[key]} {label}")
    return f"{OUTCOME.get(info.exit_code, info.exit_code)}: " + ", ".join(parts)


# --------------------------------------------------------------------------- formatting


def fmt_value(v: float, metric: str, signed: bool = False) -> str:
    """A metric value in a readable unit; exact bytes below 1 MiB so small changes show."""
    if v is None or (isinstance(v, float) and math.isnan(v)) or metric == CELL_ROW:
        return ""
    unit = metric_info(metric)[2]
    sign = "+" if signed and v > 0 else ""
    if math.isinf(v):
        return f"{sign}{v}"
    if unit == "B":
        return f"{sign}{v / 2**20:,.3f} MiB" if abs(v) >= 2**20 else f"{sign}{v:,.0f} B"
    if unit == "s":
        return f"{sign}{v * 1e3:.3g} ms" if abs(v) < 1 else f"{sign}{v:.3g} s"
    if float(v).is_integer() and abs(v) < 1e15:
        return f"{sign}{int(v):,}"
    return f"{sign}{v:.6g}"


def fmt_pct(v: float, signed: bool = True) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if math.isinf(v):
        return "+inf%" if v > 0 else "-inf%"
    sign = "+" if signed and v > 0 else ""
    return f"{sign}{v:.2f}%" if abs(v) >= 0.01 or v == 0 else f"{sign}{v:.2g}%"


def _either_way(metric: str) -> bool:
    """A loss judged by its distance either way ([Note: compare rules])."""
    return metric.startswith("loss") and metric_info(metric)[1] == "none"


def fmt_allowed(allowed: float, metric: str, pct: bool = False) -> str:
    """The allowed change (``allowed_change``, or ``allowed_change_pct`` with ``pct``),
    signed like the change it bounds ([Note: allowed change] in gate.py); ``±`` for a loss,
    bounded the same either way."""
    if allowed is None or (isinstance(allowed, float) and math.isnan(allowed)):
        return ""
    if _either_way(metric):
        text = fmt_pct(abs(allowed), signed=False) if pct else fmt_value(abs(allowed), metric)
        return "±" + text
    return fmt_pct(allowed) if pct else fmt_value(allowed, metric, signed=True)


def change_words(worse: float, metric: str) -> str:
    """A bar's label in the bar's own direction: "3.1% worse" (bar to the right), "3.1%
    better" (to the left), "moved 0.2%" for a loss (either way counts). A throughput that
    rose 3.1% is "3.1% better", never "+3.1%" beside a bar pointing left."""
    if worse is None or (isinstance(worse, float) and math.isnan(worse)):
        return ""
    if worse == 0:
        return "no change"
    size = fmt_pct(abs(worse), signed=False)
    if metric_info(metric)[1] == "none":
        return f"moved {size}"
    return f"{size} {'worse' if worse > 0 else 'better'}"


def verdict_label(row) -> str:
    if row["verdict"] == "regression" and not row["gated"]:
        return "worse (not gated)"
    return row["verdict"]


_ORDER = {"regression": 0, "missing": 1, "new": 2, "improved": 3, "ok": 4}


def display_rows(comparison: pd.DataFrame, show_all: bool = False) -> pd.DataFrame:
    """The rows every rendering shows (all with ``show_all``), the worst first, a cell's
    metrics together."""
    rows = comparison if show_all else comparison[notable(comparison)]
    return rows.assign(_o=rows["verdict"].map(_ORDER) + (~rows["gated"]) * 0.5).sort_values(
        ["_o", "cell_id", "rank", "metric"], kind="stable")


def display_table(comparison: pd.DataFrame, show_all: bool = False, title: str = "") -> Table:
    """The compared rows as a table (zerobench/analysis/render.py): the cell as a heading
    over its metrics, values in their units, the allowed change signed like the change
    ([Note: allowed change] in gate.py), a note under its row."""
    rows = display_rows(comparison, show_all)
    table = Table([Column("cell", "left", "parts", role="group"), Column("metric", "left", "parts", breaks="_"),
                   Column("baseline"), Column("new"), Column("change"), Column("change %", optional=True), Column("allowed"),
                   Column("verdict", "left", "words"), Column("note", "left", "words", role="note")], title=title)
    for _, r in rows.iterrows():
        metric = r["metric"]
        cell = r["cell_id"] + ("" if pd.isna(r["rank"]) else f" r{r['rank']}")
        label = verdict_label(r)
        table.add_row(cell, metric, fmt_value(r["baseline"], metric), fmt_value(r["new"], metric),
                      fmt_value(r["change"], metric, signed=True), fmt_pct(r["change_pct"]),
                      fmt_allowed(r["allowed_change"], metric), label, "" if pd.isna(r["note"]) else r["note"],
                      style=_STYLE.get(label, ""))
    return table


# --------------------------------------------------------------------------- terminal


_STYLE = {"regression": "bold red", "worse (not gated)": "yellow", "improved": "green",
          "missing": "magenta", "new": "magenta", "ok": "dim"}


def pass_lines(comparison: pd.DataFrame, width: int = 160) -> list[str]:
    """What a pass says beyond its summary, each line at most ``width`` characters: a
    line per cell with rows worth a look (moved within their tolerance, worse but
    not gated, a gated metric improved), as ``cell: metric +x% (allowed +y%), ...``, its
    overflow counted (``+3 more``); then one folded line for the metrics the baseline
    lacks ([Note: a pass fits a CI log]). A cell id too wide to share its line has its
    figures on the line under it."""
    rows = comparison[notable(comparison) & (comparison["metric"] != CELL_ROW)
                      & ~((comparison["verdict"] == "improved") & ~comparison["gated"])]  # a faster shared runner
    new = rows[rows["verdict"] == "new"]
    lines = []
    for cell, group in rows[rows["verdict"] != "new"].groupby("cell_id", sort=True):
        parts = []
        for (metric, rank), r in group.groupby(["metric", "rank"], dropna=False, sort=False):
            r = r.iloc[0]
            label = verdict_label(r)
            where = "" if pd.isna(rank) else f" r{rank}"
            pct = fmt_pct(r["change_pct"])  # the change and its bound in one unit, signed alike
            change = pct or fmt_value(r["change"], r["metric"], True)
            allowed = fmt_allowed(r["allowed_change_pct"] if pct else r["allowed_change"], r["metric"], pct=bool(pct))
            parts.append(f"{metric}{where} {change}" + (f" (allowed {allowed})" if allowed else "")
                         + ("" if label == "ok" else f" {label}"))
        lines += _fit_parts(f"{cell}: ", parts, width)
    if len(new):
        metrics = list(dict.fromkeys(new["metric"]))
        head = f"not in the baseline, not gated ({len(new)} values, {new['cell_id'].nunique()} cells): "
        lines += _fit_parts(head, metrics, width)
    return lines


def _fit_parts(head: str, parts: list[str], width: int) -> list[str]:
    """``head`` and as many of ``parts`` as fit in ``width`` characters, comma-separated,
    then ``+N more`` for the rest: one line, or two when ``head`` leaves no room (a cell
    id nearly as wide as the log), the parts then indented under it."""
    def tail(left: int) -> str:
        return f", +{left} more" if left else ""

    line, shown = head, 0
    for i, part in enumerate(parts):
        candidate = line + (", " if shown else "") + part
        if len(candidate) + len(tail(len(parts) - i - 1)) > width:
            if shown:
                return [line + tail(len(parts) - i)]
            if head.strip():  # not even one part beside the head: the parts go under it
                return [*wrap_id(head.rstrip(), width), *_fit_parts("    ", parts, width)]
            return [candidate + tail(len(parts) - i - 1)]  # one part wider than the log: kept whole
        line, shown = candidate, shown + 1
    return [line]


def _title_lines(info: ReportInfo, title: str, width: int) -> list[str]:
    """The header in one line when it fits ``width``, else the new folder, the baseline
    and the gate a line each (a path is never cut: it is there to be copied)."""
    if len(title) <= width:
        return [title]
    return [info.new, f"  vs baseline {info.baseline}", "  " + title[title.index("(gate:"):]]


# [Note: a pass fits a CI log]
# A gate that passes prints little, and nothing wider than the log (COLUMNS, else 160):
# the header, one line per cell that moved within its tolerance, one line naming the
# metrics the baseline does not have (a baseline made before a column was added; they
# are reported, never gated), the hardware line and the summary. Each line is cut at the
# width with a count of what was left out; --markdown and --junit-xml keep every row.


def print_report(console, comparison: pd.DataFrame, mismatches: pd.DataFrame, info: ReportInfo,
                 show_all: bool = False) -> None:
    """Print the table of changed / failing rows (all rows with ``show_all``) and the summary.

    On a pass (exit 0) without ``show_all`` the log stays short: at most one line per
    cell that has anything worth a look, one line of configuration differences, the
    hardware line and the summary; the reports (--markdown, --junit-xml) hold the rest."""
    from rich.markup import escape

    title = f"{info.new}  vs baseline  {info.baseline}   (gate: {info.gate}" + (
        f"; rules: {', '.join(info.rules)})" if info.rules else ")")
    if info.exit_code == 0 and not show_all:
        for line in _title_lines(info, title, console.width):  # whole paths, for copying them
            console.print(escape(line), highlight=False, soft_wrap=True)
        for line in pass_lines(comparison, width=console.width - 2):
            console.print("  " + escape(line), style="dim", highlight=False, soft_wrap=True)
        if len(mismatches):
            columns = ", ".join(dict.fromkeys(mismatches["column"]))
            console.print(escape(f"  context differences (reported only): {columns}"), style="dim", highlight=False,
                          soft_wrap=True)
        if info.hardware:
            console.print("[yellow]" + escape(info.hardware_line()) + "[/]")
        console.print("[bold green]" + escape(summary_line(comparison, info)) + "[/]")
        return
    table = display_table(comparison, show_all, title)
    if table.rows:
        print_table(table, console)
    else:
        console.print(escape(title), highlight=False, soft_wrap=True)  # one line, for copying the paths
    hidden = len(comparison) - len(table.rows)
    if hidden and not show_all:
        console.print(f"[dim]{hidden} row(s) within bounds not shown (--all shows them)[/]")
    if len(mismatches):
        print_table(mismatch_table(mismatches), console)
    if info.hardware:
        console.print("[yellow]" + escape(info.hardware_line()) + "[/]")
    style = {0: "bold green", 1: "bold red", 2: "bold magenta"}.get(info.exit_code, "bold")
    console.print(f"[{style}]" + escape(summary_line(comparison, info)) + "[/]")


# --------------------------------------------------------------------------- Markdown


def _md_rows(comparison: pd.DataFrame, verdicts) -> str:
    """The Markdown table of the compared rows whose verdict label is in ``verdicts``."""
    rows = comparison[[verdict_label(r) in verdicts for _, r in comparison.iterrows()]] if len(comparison) else comparison
    return markdown(display_table(rows, show_all=True)) if len(rows) else ""


def mismatch_table(mismatches: pd.DataFrame) -> Table:
    """Configuration differences between cells of the same id: identity ones make the
    comparison unusable, context ones are reported."""
    table = Table([Column("cell", "left", "parts", role="group"), Column("column", "left", "parts", breaks="_"),
                   Column("baseline", "left", "words"), Column("new", "left", "words"), Column("severity", "left")],
                  title="Configuration differences")
    for _, m in mismatches.iterrows():
        table.add_row(m["cell_id"], m["column"], repr(m["baseline"]), repr(m["new"]), m["severity"],
                      style="magenta" if m["severity"] == "identity" else "dim")
    return table


def markdown_report(comparison: pd.DataFrame, mismatches: pd.DataFrame, info: ReportInfo) -> str:
    """Summary line, regressions, other changes, configuration differences, all rows."""
    out = [f"## zerobench compare: {OUTCOME.get(info.exit_code, info.exit_code)}", "",
           f"`{info.new}` against baseline `{info.baseline}`; gate: `{info.gate}`"
           + (f"; rules: {', '.join(f'`{r}`' for r in info.rules)}" if info.rules else ""), "",
           f"**{summary_line(comparison, info)}**", ""]
    if info.hardware:
        out += [info.hardware_line() + ".", ""]
    regressions = _md_rows(comparison, ("regression",))
    out += ["### Regressions", "", regressions or "None.", ""]
    others = _md_rows(comparison, ("missing", "new", "improved", "worse (not gated)"))
    if others:
        out += ["### Other changes", "", others, ""]
    if len(mismatches):
        out += ["### Configuration differences", "",
                "`identity` differences make the comparison unusable (exit 2); `context` ones are reported.", "",
                markdown(mismatch_table(mismatches)), ""]
    full = markdown(display_table(comparison, show_all=True)) if len(comparison) else "(nothing compared)"
    out += [f"<details><summary>All compared metrics ({len(comparison)} rows)</summary>", "", full, "",
            "</details>", ""]
    return "\n".join(out)


def write_markdown(path: str | Path, comparison: pd.DataFrame, mismatches: pd.DataFrame, info: ReportInfo) -> Path:
    from zerobench.runs.files import write_atomic

    path = Path(path)
    text = markdown_report(comparison, mismatches, info)
    write_atomic(path, lambda f: f.write(text))
    return path


# --------------------------------------------------------------------------- plot


_COLOURS = {"regression": "#d62728", "worse (not gated)": "#ff9f1c", "improved": "#2ca02c",
            "ok": "#7f9fbf", "missing": "#9467bd", "new": "#9467bd"}


def worse_pct(comparison: pd.DataFrame, column: str = "change_pct") -> pd.Series:
    """A % column (the change, or the allowed change) with the sign turned so that
    positive is worse (losses: its size either way)."""
    better = comparison["metric"].map(lambda m: metric_info(m)[1])
    pct = comparison[column]
    return pct.where(better == "lower", -pct).where(better != "none", pct.abs())


def plot_changes(comparison: pd.DataFrame, path: str | Path, title: str = "", max_rows: int = 40) -> Path:
    """Write :func:`changes_figure` to ``path``."""
    from zerobench.analysis.figures import save_figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(changes_figure(comparison, title, max_rows), path, dpi=120, tight=False)


def changes_figure(comparison: pd.DataFrame, title: str = "", max_rows: int = 40):
    """Horizontal bars of the % change (positive = worse) per cell x metric, coloured by
    verdict, with the allowed change drawn as a black tick on the bar's own side ([Note:
    allowed change] in gate.py), each bar's words to the right of it, inside the axes.

    Plots the rows that are not ok or that moved (context metrics left out): regressions
    first, then the rest, at most ``max_rows`` (the most severe kept).
    """
    import matplotlib.ticker  # matplotlib only when a plot is asked for: compare runs in CI gates
    from matplotlib.patches import Patch

    from zerobench.analysis.figures import plt

    c = comparison[(comparison["metric"] != CELL_ROW) & (comparison["kind"] != "context")].copy()
    c["worse"] = worse_pct(c)
    c["allowed_worse"] = worse_pct(c, "allowed_change_pct") if len(c) else c["worse"]
    c = c[c["verdict"].isin(SHOW_VERDICTS) | (c["change"].fillna(0) != 0)].dropna(subset=["worse"])
    c["label"] = [verdict_label(r) for _, r in c.iterrows()]
    group = c["label"].map({"regression": 0, "missing": 1, "new": 1, "worse (not gated)": 2, "improved": 3}).fillna(4)
    severity = (c["worse"] / c["limit_pct"].where(c["limit_pct"] > 0, 1e-9)).fillna(0)
    total = len(c)
    c = c.assign(_g=group, _sev=severity).sort_values(["_g", "_sev"], ascending=[True, False]).head(max_rows)
    dropped = total - len(c)
    # regressions at the top; within a group, a cell's metrics together
    c = c.sort_values(["_g", "cell_id", "rank", "metric"], kind="stable").iloc[::-1]

    labels = [f"{cid}{'' if pd.isna(r) else f' r{r}'}  ·  {m}" for cid, r, m in zip(c["cell_id"], c["rank"], c["metric"])]
    width = 7 + 0.065 * max((len(s) for s in labels), default=0)  # inches: the bars keep ~7 whatever the labels
    heading = (title or "zerobench compare").split("\n")  # each line wrapped on its own
    cells = comparison[(comparison["metric"] == CELL_ROW) & (comparison["verdict"] != "ok")]
    if len(cells):
        heading.append("cells: " + "; ".join(f"{cid} {v} ({note.split(':')[0]})"
                                             for cid, v, note in zip(cells["cell_id"], cells["verdict"], cells["note"])))
    if dropped:
        heading.append(f"{dropped} less severe rows not shown")
    chars = int(width * 12)
    heading_text = "\n".join(textwrap.fill(h, chars) for h in heading)
    fig, ax = plt.subplots(figsize=(width, 1.6 + 0.3 * max(len(c), 1) + 0.18 * heading_text.count("\n")))
    words = []
    if c.empty:
        ax.text(0.5, 0.5, "no metric changed", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        finite = c["worse"].replace([math.inf, -math.inf], math.nan).abs()
        limits = c["allowed_worse"].replace([math.inf, -math.inf], math.nan).abs()
        cap = max(finite.max() if finite.notna().any() else 1.0,
                  limits.max() if limits.notna().any() else 0.0, 1.0) * 1.5
        x = c["worse"].clip(-cap, cap)
        tick = c["allowed_worse"].clip(-cap, cap)
        y = list(range(len(c)))
        ax.barh(y, x, color=[_COLOURS.get(v, "grey") for v in c["label"]], height=0.7)
        ax.scatter(tick, y, marker="|", s=220, color="black", linewidths=2, zorder=3)
        for yi, xi, ti, worse, metric in zip(y, x, tick, c["worse"], c["metric"]):
            # right of the bar, its tick and zero: never over the cell names left of the axes
            right = max(v for v in (xi, ti, 0.0) if not pd.isna(v))
            words.append(ax.annotate(change_words(worse, metric), (right, yi), xytext=(6, 0),
                                     textcoords="offset points", ha="left", va="center", fontsize=8))
        ax.set_yticks(y, labels, fontsize=8)
        ax.set_ylim(-0.6, len(c) - 0.4)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_xscale("symlog", linthresh=1.0)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
        ax.set_xlim(-cap * 2 if (x < 0).any() or (tick < 0).any() else -0.3, cap * 2)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlabel("change vs baseline, % (positive = worse; losses: |change|; symlog axis)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        handles = [Patch(color=_COLOURS[v], label=v) for v in dict.fromkeys(c["label"].iloc[::-1]) if v in _COLOURS]
        handles.append(plt.Line2D([], [], marker="|", color="black", linestyle="", markersize=12,
                                  markeredgewidth=2, label="allowed change (on the side of the change)"))
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    title_artist = fig.suptitle(heading_text, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))
    _keep_inside(fig, ax, words, title_artist, heading, chars)
    return fig


def _keep_inside(fig, ax, words, title_artist, heading: list[str], chars: int) -> None:
    """Widen the x axis until every bar's words end inside the axes, and wrap the title
    narrower until it fits the figure: what a reader pastes in an issue must be whole."""
    renderer = fig.canvas.get_renderer()
    for _ in range(12):
        inside = ax.get_window_extent(renderer).x1
        if not words or max(w.get_window_extent(renderer).x1 for w in words) <= inside:
            break
        low, high = ax.get_xlim()
        ax.set_xlim(low, high * 2)
    for _ in range(12):
        box = title_artist.get_window_extent(renderer)
        if box.x1 <= fig.bbox.x1 and box.x0 >= fig.bbox.x0:
            break
        chars = max(20, int(chars * 0.85))
        title_artist.set_text("\n".join(textwrap.fill(h, chars) for h in heading))
        fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))
