"""Terminal summaries of runs: the per-cell table with each engine beside the reference.

[Note: plain text]
Everything a run produced -- cell ids, error messages, log excerpts, paths -- reaches
the terminal as plain text: rich ``Text`` objects in tables, ``escape()`` in printed
lines. A rank's error often carries brackets (gloo's "[/__w/pytorch/.../pair.cc:553]
Connection closed by peer"), which rich would otherwise parse as markup and, for a
closing tag it does not know, raise ``MarkupError`` -- killing the harness between cells.
Only the fixed words we write ourselves ("ok", "FAIL") carry markup.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from zerobench.runs.tables import REFERENCE_ENGINE, load_results, reference_cells, summary
from zerobench.runs.folder import DamagedFile, RunFolder


def with_reference_ratios(cells: pd.DataFrame, results: pd.DataFrame) -> pd.DataFrame:
    """Add step_time_x_ref and peak_mem_x_ref: each cell over the reference engine's
    default cell of the same world size and dtype, from the same run."""
    cells = cells.copy()
    config = results.drop_duplicates("cell_id").set_index("cell_id")[["world_size", "dtype"]]
    cells = cells.join(config, on="cell_id")
    ref = cells[reference_cells(cells["cell_id"])].set_index(["world_size", "dtype"])
    for col, out in (("step_time_s", "step_time_x_ref"), ("peak_mem_bytes", "peak_mem_x_ref")):
        if col not in cells.columns or ref.empty:
            cells[out] = float("nan")
            continue
        base = cells.apply(lambda r: ref[col].get((r["world_size"], r["dtype"]), float("nan")), axis=1)
        cells[out] = cells[col] / base
    return cells


def wide_console() -> Console:
    """A console at least 160 columns wide: cell ids are long, and logs are not terminals."""
    probe = Console()
    return Console(width=max(probe.width, 160)) if not probe.is_terminal else probe


def print_summary(run_dir: Path, console: Console | None = None) -> None:
    console = console or wide_console()
    results = load_results(run_dir)
    cells = with_reference_ratios(summary(results), results)
    table = Table(title=escape(f"{run_dir.name}  (x{REFERENCE_ENGINE}: ratio to {REFERENCE_ENGINE} at the same world size and dtype)"))
    for name in ("cell", "status", "step ms", f"x{REFERENCE_ENGINE}", "peak MiB", f"x{REFERENCE_ENGINE} ",
                 "comm MiB/step", "loss dev", "note"):
        # numbers never wrap or truncate; long cell ids fold onto a second line instead
        table.add_column(name, justify="left" if name in ("cell", "status", "note") else "right",
                         no_wrap=name not in ("cell", "note"), overflow="fold")
    for _, r in cells.iterrows():
        if r["status"] != "ok":
            style = "yellow" if r["status"] == "skipped" else "red"
            reason = str(r.get("error") or "").splitlines()
            note = " | ".join(dict.fromkeys([reason[0], reason[-1]])) if reason else ""
            table.add_row(Text(str(r["cell_id"])), Text(str(r["status"]), style=style), *[""] * 6, Text(note[:100]))
            continue
        table.add_row(
            Text(str(r["cell_id"])), "ok",
            _num(r.get("step_time_s"), 1e3, "{:.1f}"), _num(r.get("step_time_x_ref"), 1, "{:.2f}"),
            _num(r.get("peak_mem_bytes"), 2**-20, "{:.1f}"), _num(r.get("peak_mem_x_ref"), 1, "{:.2f}"),
            _num(r.get("comm_total_bytes"), 2**-20, "{:.2f}"), _num(r.get("loss_max_abs_diff_ref"), 1, "{:.1e}"), "",
        )
    console.print(table)
    for note in folder_notes(run_dir):
        console.print(Text(note), style="yellow", soft_wrap=True)  # commands stay whole, for copying


def folder_notes(run_dir: Path) -> list[str]:
    """What a reader of the folder should know that the table does not say: tables shown
    from cells/ and cells never checked against the reference ([Note: readers have no
    side effects] in zerobench/runs/folder.py)."""
    folder = RunFolder(run_dir)
    notes = []
    missing = folder.missing_references()
    if missing:
        notes.append(f"note: {len(missing)} cell(s) have no single-process loss reference (run under torchrun); "
                     f"`zerobench reference {run_dir}` computes it")
    if folder.tables_stale():
        notes.append(f"note: results.csv is missing or older than cells/, so this was read from cells/; "
                     f"`zerobench reference {run_dir}` writes the tables")
    return notes


def _num(value, scale, fmt) -> str:
    if value is None or pd.isna(value):
        return "-"
    return fmt.format(value * scale)


def list_runs(results_root: Path, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"runs under {results_root}")
    for name in ("run", "workload", "date", "cells", "ok", "failed", "skipped", "git"):
        table.add_column(name)
    runs = sorted(p.parent for p in results_root.glob("**/meta.json"))
    for run in runs:
        folder = RunFolder(run)
        try:
            meta = folder.meta()
        except DamagedFile:  # the run is listed all the same, saying which file is damaged
            meta = {"workload": f"(damaged {folder.meta_path.name})"}
        statuses = [r["status"] for r in folder.cell_records()]
        table.add_row(Text(str(run.relative_to(results_root))), Text(str(meta.get("workload", "?"))),
                      str(meta.get("date", "?")),
                      str(len(meta.get("cells", []))), str(statuses.count("ok")), str(statuses.count("failed")),
                      str(statuses.count("skipped")), (meta.get("git_commit") or "")[:8])
    if not runs:
        console.print(Text(f"no runs under {results_root}"))
        return
    console.print(table)
