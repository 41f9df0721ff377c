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

from zerobench.runs.folder import DamagedFile, RunFolder
from zerobench.runs.tables import REFERENCE_ENGINE, load_results, reference_cells, summary


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
            _num(r.get("comm_total_bytes"), 2**-20, "{:.2f}"), _num(r.get("loss_max_abs_diff_ref"), 1, "{:.1e}"),
            Text(_text(r.get("note"))[:100]),  # what the engine ignored here (Engine.notes)
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


def _text(value) -> str:
    return "" if value is None or pd.isna(value) else str(value)


def _num(value, scale, fmt) -> str:
    if value is None or pd.isna(value):
        return "-"
    return fmt.format(value * scale)


def list_runs(results_root: Path, console: Console | None = None) -> None:
    """Every results folder under ``results_root`` (zerobench.runs.kinds): runs with the
    status of their cells -- from cells/, or from results.csv where a curated run or a
    baseline keeps only its tables -- and estimates and predictions with their
    configurations' statuses."""
    from zerobench.runs.kinds import results_folders

    console = console or wide_console()
    folders = results_folders(results_root)
    if not folders:
        console.print(Text(f"no runs, estimates or predictions under {results_root}"))
        return
    table = Table(title=f"results under {results_root}")
    for name in ("folder", "kind", "workload", "date", "cells", "ok", "failed", "skipped", "git"):
        table.add_column(name, justify="right" if name in ("cells", "ok", "failed", "skipped") else "left",
                         no_wrap=name != "folder", overflow="fold")
    for kind, folder in folders:
        row = _list_row(kind, folder)
        table.add_row(Text(str(folder.relative_to(results_root))), kind, Text(row["workload"]), row["date"],
                      *(str(row[k]) for k in ("cells", "ok", "failed", "skipped")), row["git"])
    console.print(table)


def _list_row(kind: str, folder: Path) -> dict:
    """What `zerobench list` shows of one folder; a damaged file says so instead of failing."""
    from zerobench.runs.kinds import FOLDER_KINDS, workload_name

    row = {"workload": "?", "date": _stamp(folder.name), "cells": "-", "ok": "-", "failed": "-", "skipped": "-",
           "git": ""}
    if kind == "run":
        run = RunFolder(folder)
        try:
            meta = run.meta()
        except DamagedFile:
            meta = {"workload": f"(damaged {run.meta_path.name})"}
        row.update(workload=str(meta.get("workload", "?")), git=(meta.get("git_commit") or "")[:8])
        row["date"] = str(meta.get("date", row["date"]))[:19].replace("T", " ")
        if run.cells_dir.is_dir():
            statuses = [r["status"] for r in run.cell_records()]
        else:  # a curated run or a baseline: its tables are what it kept
            statuses = _statuses(run.results_path, "cell_id")
        row["cells"] = len(meta.get("cells") or []) or len(statuses)
    else:
        row["workload"] = str(workload_name(folder))
        statuses = _statuses(folder / FOLDER_KINDS[kind][0], None)  # its table: estimate.csv, predict.csv
        row["cells"] = len(statuses)
    counts = {k: statuses.count(k) for k in ("ok", "failed", "skipped")}
    row.update(counts, failed=counts["failed"] + sum(s not in counts for s in statuses))
    return row


def _statuses(table: Path, per: str | None) -> list[str]:
    """The status of each cell (``per`` = "cell_id": one per cell) or row of a table."""
    try:
        frame = pd.read_csv(table, usecols=[c for c in ("status", per) if c], dtype=str)
    except (OSError, ValueError, pd.errors.ParserError, UnicodeDecodeError):
        return ["failed"]  # unreadable: counted as failed, as a damaged cell record is
    if per:
        frame = frame.drop_duplicates(per)
    return frame["status"].fillna("failed").tolist()


def _stamp(name: str) -> str:
    """"2026-11-24 12:00:00" from a folder named <date>-<time>-..., else "?"."""
    import re

    m = re.match(r"(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})(\d{2})", name)
    return f"{m[1]}-{m[2]}-{m[3]} {m[4]}:{m[5]}:{m[6]}" if m else "?"
