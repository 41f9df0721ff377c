"""Render a comparison from :mod:`zerobench.analysis.compare.gate`: terminal table, Markdown, plot.

Every function takes the DataFrames ``compare_runs`` and ``config_mismatches`` return;
nothing here decides a verdict. matplotlib is imported only by :func:`plot_changes`.
"""

from __future__ import annotations

import math
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from zerobench.analysis.compare.gate import CELL_ROW
from zerobench.analysis.compare.rules import metric_info

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


def fmt_limit(limit: float, metric: str) -> str:
    """The allowed worsening in the metric's unit: ``±`` for losses (either way), else ``+``."""
    if limit is None or math.isnan(limit):
        return ""
    prefix = "±" if metric.startswith("loss") and metric_info(metric)[1] == "none" else "+"
    text = fmt_value(limit, metric)
    return prefix + text if text and text[0] not in "+-" else text


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


def display_table(comparison: pd.DataFrame, show_all: bool = False) -> pd.DataFrame:
    """The rows and formatted columns every rendering shows, the worst first."""
    rows = comparison if show_all else comparison[notable(comparison)]
    rows = rows.assign(_o=rows["verdict"].map(_ORDER) + (~rows["gated"]) * 0.5).sort_values(
        ["_o", "cell_id", "rank", "metric"], kind="stable")
    return pd.DataFrame({
        "cell": rows["cell_id"] + rows["rank"].map(lambda r: "" if pd.isna(r) else f" r{r}"),
        "metric": rows["metric"],
        "baseline": [fmt_value(v, m) for v, m in zip(rows["baseline"], rows["metric"])],
        "new": [fmt_value(v, m) for v, m in zip(rows["new"], rows["metric"])],
        "change": [fmt_value(v, m, signed=True) for v, m in zip(rows["change"], rows["metric"])],
        "change %": rows["change_pct"].map(fmt_pct),
        "allowed": [fmt_limit(v, m) for v, m in zip(rows["limit"], rows["metric"])],
        "verdict": [verdict_label(r) for _, r in rows.iterrows()],
        "note": rows["note"].fillna(""),
    })


# --------------------------------------------------------------------------- terminal


def make_console():
    """A rich console; wide when not a terminal (CI logs), so cell ids are not cut."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=180)


_STYLE = {"regression": "bold red", "worse (not gated)": "yellow", "improved": "green",
          "missing": "magenta", "new": "magenta", "ok": "dim"}


def pass_lines(comparison: pd.DataFrame) -> list[str]:
    """At most one line per cell: the rows worth a look on a pass (moved within their
    tolerance, worse but not gated, a gated metric improved), as
    ``cell: metric +x% (allowed +y%), ...``."""
    rows = comparison[notable(comparison) & (comparison["metric"] != CELL_ROW)
                      & ~((comparison["verdict"] == "improved") & ~comparison["gated"])]  # a faster shared runner
    lines = []
    for cell, group in rows.groupby("cell_id", sort=True):
        parts = []
        for _, r in group.iterrows():
            label = verdict_label(r)
            where = "" if pd.isna(r["rank"]) else f" r{r['rank']}"
            allowed = fmt_limit(r["limit"], r["metric"])
            parts.append(f"{r['metric']}{where} {fmt_pct(r['change_pct']) or fmt_value(r['change'], r['metric'], True)}"
                         + (f" (allowed {allowed})" if allowed else "") + ("" if label == "ok" else f" {label}"))
        lines.append(f"{cell}: " + ", ".join(parts))
    return lines


def print_report(console, comparison: pd.DataFrame, mismatches: pd.DataFrame, info: ReportInfo,
                 show_all: bool = False) -> None:
    """Print the table of changed / failing rows (all rows with ``show_all``) and the summary.

    On a pass (exit 0) without ``show_all`` the log stays short: at most one line per
    cell that has anything worth a look, one line of configuration differences, the
    hardware line and the summary; the reports (--markdown, --junit-xml) hold the rest."""
    from rich.markup import escape
    from rich.table import Table

    title = f"{info.new}  vs baseline  {info.baseline}   (gate: {info.gate}" + (
        f"; rules: {', '.join(info.rules)})" if info.rules else ")")
    if info.exit_code == 0 and not show_all:
        console.print(escape(title), highlight=False)
        for line in pass_lines(comparison):  # soft_wrap: one line each, however wide
            console.print("  " + escape(line), style="dim", highlight=False, soft_wrap=True)
        if len(mismatches):
            columns = ", ".join(dict.fromkeys(mismatches["column"]))
            console.print(escape(f"  context differences (reported only): {columns}"), style="dim", highlight=False,
                          soft_wrap=True)
        if info.hardware:
            console.print("[yellow]" + escape(info.hardware_line()) + "[/]")
        console.print("[bold green]" + escape(summary_line(comparison, info)) + "[/]")
        return
    table = display_table(comparison, show_all)
    if len(table):
        t = Table(title=escape(title), title_justify="left")
        for col in table.columns:
            right = col in ("baseline", "new", "change", "change %", "allowed")
            t.add_column(col, justify="right" if right else "left", overflow="fold")
        for _, r in table.iterrows():
            t.add_row(*(escape(str(v)) for v in r.values), style=_STYLE.get(r["verdict"], ""))
        console.print(t)
    else:
        console.print(escape(title))
    hidden = len(comparison) - len(table)
    if hidden and not show_all:
        console.print(f"[dim]{hidden} row(s) within bounds not shown (--all shows them)[/]")
    if len(mismatches):
        console.print("[bold]Configuration differences[/]")
        for _, m in mismatches.iterrows():
            style = "magenta" if m["severity"] == "identity" else "dim"
            console.print(f"  [{style}]" + escape(f"{m['cell_id']}: {m['column']}: {m['baseline']!r} -> "
                                                  f"{m['new']!r} ({m['severity']})") + "[/]")
    if info.hardware:
        console.print("[yellow]" + escape(info.hardware_line()) + "[/]")
    style = {0: "bold green", 1: "bold red", 2: "bold magenta"}.get(info.exit_code, "bold")
    console.print(f"[{style}]" + escape(summary_line(comparison, info)) + "[/]")


# --------------------------------------------------------------------------- Markdown


def _md_table(df: pd.DataFrame) -> str:
    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def markdown_report(comparison: pd.DataFrame, mismatches: pd.DataFrame, info: ReportInfo) -> str:
    """Summary line, regressions, other changes, configuration differences, all rows."""
    full = display_table(comparison, show_all=True)
    verdict = full["verdict"]
    out = [f"## zerobench compare: {OUTCOME.get(info.exit_code, info.exit_code)}", "",
           f"`{info.new}` against baseline `{info.baseline}`; gate: `{info.gate}`"
           + (f"; rules: {', '.join(f'`{r}`' for r in info.rules)}" if info.rules else ""), "",
           f"**{summary_line(comparison, info)}**", ""]
    if info.hardware:
        out += [info.hardware_line() + ".", ""]
    regressions = full[verdict == "regression"]
    out += ["### Regressions", "", _md_table(regressions) if len(regressions) else "None.", ""]
    others = full[verdict.isin(["missing", "new", "improved", "worse (not gated)"])]
    if len(others):
        out += ["### Other changes", "", _md_table(others), ""]
    if len(mismatches):
        out += ["### Configuration differences", "",
                "`identity` differences make the comparison unusable (exit 2); `context` ones are reported.", "",
                _md_table(mismatches), ""]
    out += [f"<details><summary>All compared metrics ({len(full)} rows)</summary>", "", _md_table(full), "",
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


def worse_pct(comparison: pd.DataFrame) -> pd.Series:
    """Change in % with the sign turned so that positive is worse (losses: |change|)."""
    better = comparison["metric"].map(lambda m: metric_info(m)[1])
    pct = comparison["change_pct"]
    return pct.where(better == "lower", -pct).where(better != "none", pct.abs())


def plot_changes(comparison: pd.DataFrame, path: str | Path, title: str = "", max_rows: int = 40) -> Path:
    """Horizontal bars of the % change (positive = worse) per cell x metric, coloured by
    verdict, with each row's allowed worsening drawn as a black tick.

    Plots the rows that are not ok or that moved (context metrics left out): regressions
    first, then the rest, at most ``max_rows`` (the most severe kept).
    """
    import matplotlib.ticker  # matplotlib only when a plot is asked for: compare runs in CI gates
    from matplotlib.patches import Patch

    from zerobench.analysis.figures import plt, save_figure

    c = comparison[(comparison["metric"] != CELL_ROW) & (comparison["kind"] != "context")].copy()
    c["worse"] = worse_pct(c)
    c = c[c["verdict"].isin(SHOW_VERDICTS) | (c["change"].fillna(0) != 0)].dropna(subset=["worse"])
    c["label"] = [verdict_label(r) for _, r in c.iterrows()]
    group = c["label"].map({"regression": 0, "missing": 1, "new": 1, "worse (not gated)": 2, "improved": 3}).fillna(4)
    severity = (c["worse"] / c["limit_pct"].where(c["limit_pct"] > 0, 1e-9)).fillna(0)
    total = len(c)
    c = c.assign(_g=group, _sev=severity).sort_values(["_g", "_sev"], ascending=[True, False]).head(max_rows)
    dropped = total - len(c)
    # regressions at the top; within a group, a cell's metrics together
    c = c.sort_values(["_g", "cell_id", "rank", "metric"], kind="stable").iloc[::-1]

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = [f"{cid}{'' if pd.isna(r) else f' r{r}'}  ·  {m}" for cid, r, m in zip(c["cell_id"], c["rank"], c["metric"])]
    width = 7 + 0.065 * max((len(s) for s in labels), default=0)  # inches: the bars keep ~7 whatever the labels
    heading = (title or "zerobench compare").split("\n")  # each line wrapped on its own
    cells = comparison[(comparison["metric"] == CELL_ROW) & (comparison["verdict"] != "ok")]
    if len(cells):
        heading.append("cells: " + "; ".join(f"{cid} {v} ({note.split(':')[0]})"
                                             for cid, v, note in zip(cells["cell_id"], cells["verdict"], cells["note"])))
    if dropped:
        heading.append(f"{dropped} less severe rows not shown")
    heading_text = "\n".join(textwrap.fill(h, int(width * 12)) for h in heading)
    fig, ax = plt.subplots(figsize=(width, 1.6 + 0.3 * max(len(c), 1) + 0.18 * heading_text.count("\n")))
    if c.empty:
        ax.text(0.5, 0.5, "no metric changed", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        finite = c["worse"].replace([math.inf, -math.inf], math.nan).abs()
        limits = c["limit_pct"].replace(math.inf, math.nan)
        cap = max(finite.max() if finite.notna().any() else 1.0,
                  limits.max() if limits.notna().any() else 0.0, 1.0) * 1.5
        x = c["worse"].clip(-cap, cap)
        lim = c["limit_pct"].clip(upper=cap)
        y = list(range(len(c)))
        ax.barh(y, x, color=[_COLOURS.get(v, "grey") for v in c["label"]], height=0.7)
        ax.scatter(lim, y, marker="|", s=220, color="black", linewidths=2, zorder=3)
        for yi, xi, li, worse, metric in zip(y, x, lim, c["worse"], c["metric"]):
            right = max(xi, li) if not pd.isna(li) else xi
            ax.annotate(change_words(worse, metric), (right if xi >= 0 else xi, yi), xytext=(6 if xi >= 0 else -6, 0),
                        textcoords="offset points", ha="left" if xi >= 0 else "right", va="center", fontsize=8)
        ax.set_yticks(y, labels, fontsize=8)
        ax.set_ylim(-0.6, len(c) - 0.4)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_xscale("symlog", linthresh=1.0)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
        ax.set_xlim(-cap * 2 if (x < 0).any() else -0.3, cap * 2)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlabel("change vs baseline, % (positive = worse; losses: |change|; symlog axis)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        handles = [Patch(color=_COLOURS[v], label=v) for v in dict.fromkeys(c["label"].iloc[::-1]) if v in _COLOURS]
        handles.append(plt.Line2D([], [], marker="|", color="black", linestyle="", markersize=12,
                                  markeredgewidth=2, label="allowed worsening"))
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(heading_text, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))
    return save_figure(fig, path, dpi=120, tight=False)
