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
from rich.text import Text

from zerobench.analysis.render import Column, Table, format_column, make_console, memory_unit, print_table
from zerobench.instruments.load import verdict
from zerobench.runs.folder import DamagedFile, RunFolder
from zerobench.runs.tables import REFERENCE_ENGINE, load_results, reference_cells, summary


def with_reference_ratios(cells: pd.DataFrame, results: pd.DataFrame, steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """Add step_time_x_ref and peak_mem_x_ref: each cell over the reference engine's
    default cell of the same world size and dtype, from the same run; with the run's
    ``steps`` (steps.csv), also step_time_x_ref_p10 and _p90, the spread of the step-time
    ratio ([Note: ratio spread])."""
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
    spread = ratio_spread(cells, ref, steps)
    cells["step_time_x_ref_p10"], cells["step_time_x_ref_p90"] = spread[0], spread[1]
    return cells


# [Note: ratio spread]
# A step-time ratio to DDP is two noisy numbers divided, so it carries its spread: the 10th
# and 90th percentiles of t_cell / t_ref over every pair of one measured step of the cell and
# one of the reference cell (a step's time is the median over its ranks; steps.csv holds
# them). Pairs, not step i with step i: the two cells ran one after the other, so no step of
# one belongs with a step of the other, and every pair is an equally likely draw of the two.
# Its middle is close to the ratio of the medians. It is the spread of one step against one
# step, wider than the uncertainty of the medians: on the 2-core CPU VM single steps jitter,
# and DDP's fp32 cell against itself reads 1.00 (0.66-1.52) in
# results/curated/20261121-165230-quickstart (`zerobench show` of it). A ratio whose range
# spans 1 does not say which cell is faster; two runs giving 1.51 and 3.37 should be read
# with theirs. Memory, bytes and losses carry no spread: they are deterministic.


def ratio_spread(cells: pd.DataFrame, ref: pd.DataFrame, steps: pd.DataFrame | None) -> tuple[list, list]:
    """(p10, p90) of each cell's step-time ratio to its reference cell, NaN where either
    has no per-step times ([Note: ratio spread])."""
    nan = [float("nan")] * len(cells)
    if steps is None or steps.empty or ref.empty or "step_time_s" not in steps.columns or "cell_id" not in ref:
        return nan, list(nan)
    per_step = steps.assign(t=pd.to_numeric(steps["step_time_s"], errors="coerce")) \
        .groupby(["cell_id", "step"], sort=False)["t"].median().dropna()
    times = {cell: group.to_numpy() for cell, group in per_step.groupby(level=0, sort=False)}
    low, high = [], []
    for _, r in cells.iterrows():
        ref_cell = ref["cell_id"].get((r["world_size"], r["dtype"])) if "cell_id" in ref else None
        mine, theirs = times.get(r["cell_id"]), times.get(ref_cell)
        if mine is None or theirs is None or not len(mine) or not len(theirs):
            low.append(float("nan"))
            high.append(float("nan"))
            continue
        ratios = pd.Series((mine[:, None] / theirs[None, :]).ravel())
        low.append(float(ratios.quantile(0.1)))
        high.append(float(ratios.quantile(0.9)))
    return low, high


def summary_table(run_dir: Path) -> Table:
    """The summary of a run: one row per cell that finished, with its step time, peak
    memory and communication and their ratios to the reference engine, an error or an
    engine's note under its row ([Note: tables at any width] in zerobench/analysis/render.py)."""
    results = load_results(run_dir)
    cells = with_reference_ratios(summary(results), results, RunFolder(run_dir).steps())
    ok = cells[cells["status"] == "ok"] if len(cells) else cells
    ref_rows = ok[reference_cells(ok["cell_id"]).fillna(False).astype(bool).to_numpy()] if len(ok) else ok
    peak_unit, peak_size = memory_unit(ok.get("peak_mem_bytes", []), ref_rows.get("peak_mem_bytes", []))
    comm_unit, comm_size = memory_unit(ok.get("comm_total_bytes", []), ref_rows.get("comm_total_bytes", []))
    ref = f"x{REFERENCE_ENGINE}"
    table = Table([Column("cell", "left", "parts"), Column("status", "left"), Column("step ms"), Column(ref),
                   Column("p10-p90", optional=True), Column(f"peak {peak_unit}"), Column(ref), Column(f"comm {comm_unit}/step"), Column("loss dev"),
                   Column("error", "left", "words", role="note"), Column("note", "left", "words", role="note")],
                  title=f"{Path(run_dir).name}  " + (
                      f"({ref}: ratio to {REFERENCE_ENGINE} at the same world size and dtype; p10-p90: "
                      f"the step-time ratio's spread)"
                      if cells.get("step_time_x_ref", pd.Series(dtype=float)).notna().any()
                      else f"(no {REFERENCE_ENGINE} cell to give ratios to)"))

    def column(name, scale, decimals=None):
        values = [ok[name].get(i) if name in ok else None for i in cells.index]
        return format_column(values, scale, decimals)

    numbers = list(zip(column("step_time_s", 1e3), column("step_time_x_ref", 1, 2), _spreads(cells, ok),
                       column("peak_mem_bytes", 1 / peak_size), column("peak_mem_x_ref", 1, 2),
                       column("comm_total_bytes", 1 / comm_size)))
    for k, (_, r) in enumerate(cells.iterrows()):
        note = _text(r.get("note"))  # what the engine ignored here (Engine.notes)
        if r["status"] != "ok":
            reason = _text(r.get("error")).splitlines()
            error = " | ".join(dict.fromkeys([reason[0], reason[-1]])) if reason else ""
            table.add_row(r["cell_id"], r["status"], *[""] * 7, error[:300], note,
                          style="yellow" if r["status"] == "skipped" else "red")
            continue
        dev = r.get("loss_max_abs_diff_ref")
        table.add_row(r["cell_id"], "ok", *numbers[k], "-" if dev is None or pd.isna(dev) else f"{dev:.1e}", "", note)
    return table


def print_summary(run_dir: Path, console: Console | None = None, running: dict | None = None) -> None:
    """The summary table of a run, and what a reader should know that it does not say
    (:func:`folder_notes`); ``running``: the registry entry of a harness running this
    folder now (zerobench.harness.active), when there is one."""
    console = console or make_console()
    folder = RunFolder(run_dir)
    if folder.cell_records() or folder.results_path.exists():
        print_table(summary_table(run_dir), console)
    else:
        console.print(Text(f"{Path(run_dir).name}: no cell has finished yet"), style="bold")
    for note in folder_notes(run_dir, running):
        for line in note.splitlines():  # prose wrapped to the width; a command on a line of its own, whole
            console.print(Text(line), style="yellow", soft_wrap=line.startswith("  "))


def unfinished_cells(run_dir: Path) -> list[str]:
    """The cells meta.json lists that have no record (nor a row of results.csv, for a
    folder kept without cells/): a run stopped before them, or still running them."""
    folder = RunFolder(run_dir)
    try:
        listed = list(folder.meta().get("cells") or [])
    except DamagedFile:
        return []
    if folder.cells_dir.is_dir():
        done = {r["cell_id"] for r in folder.cell_records()}
    else:
        try:
            done = set(pd.read_csv(folder.results_path, usecols=["cell_id"], dtype=str)["cell_id"])
        except (OSError, ValueError, pd.errors.ParserError, UnicodeDecodeError):
            done = set()
    return [c for c in listed if c not in done]


def folder_notes(run_dir: Path, running: dict | None = None) -> list[str]:
    """What a reader of the folder should know that the table does not say: cells not run
    yet (a run interrupted, or running now) and how to finish them, tables shown from
    cells/ (or, without cells/, from results.csv alone) and cells never checked against the reference ([Note: readers have no side
    effects] in zerobench/runs/folder.py). A command to copy is on a line of its own,
    indented."""
    folder = RunFolder(run_dir)
    notes = []
    left = unfinished_cells(run_dir)
    if left:
        listed = len(left) + len(folder.cell_records() or [])
        if running:
            notes.append(f"running: {len(left)} of {listed} cell(s) still to run (pid {running.get('pid', '?')}, "
                         f"started {running.get('started', '?')}); show it again for more:\n  zerobench show {run_dir}")
        else:
            notes.append(f"interrupted: {listed - len(left)} of {listed} cell(s) finished, {len(left)} not run "
                         f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}). Resume with:\n"
                         f"  zerobench run --resume {run_dir}")
    missing = folder.missing_references()
    if missing:
        notes.append(f"note: {len(missing)} cell(s) have no single-process loss reference (run under torchrun); "
                     f"this computes it:\n  zerobench reference {run_dir}")
    if folder.tables_stale():
        notes.append(f"note: results.csv is missing or older than cells/, so this was read from cells/; this writes "
                     f"the tables:\n  zerobench reference {run_dir}")
    elif not folder.cells_dir.is_dir() and folder.results_path.is_file():
        notes.append(f"note: {folder.cells_dir} is missing (as in curated runs and baselines), so this was read "
                     "from results.csv as saved: its cells cannot be rebuilt or resumed")
    try:
        loaded = verdict(folder.meta().get("machine_load"))  # [Note: machine load]
    except DamagedFile:
        loaded = None
    if loaded:
        notes.append(loaded)
    return notes


def _spreads(cells: pd.DataFrame, ok: pd.DataFrame) -> list[str]:
    """"1.42-1.63" per cell: the p10-p90 of its step-time ratio ([Note: ratio spread])."""
    out = []
    for i in cells.index:
        low = ok["step_time_x_ref_p10"].get(i) if "step_time_x_ref_p10" in ok else None
        high = ok["step_time_x_ref_p90"].get(i) if "step_time_x_ref_p90" in ok else None
        out.append("-" if low is None or high is None or pd.isna(low) or pd.isna(high) else f"{low:.2f}-{high:.2f}")
    return out


def _text(value) -> str:
    return "" if value is None or pd.isna(value) else str(value)


def list_runs(results_root: Path, console: Console | None = None) -> None:
    """Every results folder under ``results_root`` (zerobench.runs.kinds): runs with the
    status of their cells -- from cells/, or from results.csv where a curated run or a
    baseline keeps only its tables -- and estimates and predictions with their
    configurations' statuses."""
    from zerobench.runs.kinds import results_folders

    console = console or make_console()
    folders = sorted(results_folders(results_root) + _calibrate_folders(results_root), key=lambda kf: str(kf[1]))
    if not folders:
        console.print(Text(f"no runs, estimates or predictions under {results_root}"))
        return
    table = Table([Column("folder", "left", "parts", breaks="-/", role="key"), Column("kind", "left"),
                   Column("workload", "left", "parts"), Column("date", "left"), Column("cells"),
                   Column("ok"), Column("failed"), Column("skipped"), Column("not run"), Column("git", "left")],
                  title=f"results under {results_root}")
    for kind, folder in folders:
        row = _list_row(kind, folder) if kind != "calibrate" else _calibrate_row(folder)
        table.add_row(str(folder.relative_to(results_root)), kind, row["workload"], row["date"],
                      *(str(row[k]) for k in ("cells", "ok", "failed", "skipped", "not run")), row["git"])
    undated = [row for row in table.rows if row[3] == "-"]
    if undated:
        table.notes.append("date -: the folder records none (a baseline or curated folder keeps only its tables; "
                           "its README.md says when and how it was made)")
    print_table(table, console)


def _calibrate_folders(root: Path) -> list[tuple[str, Path]]:
    """("calibrate", folder) of every folder ``zerobench calibrate`` wrote under ``root``
    (its measurements.json), as deep as the results folders are looked for."""
    from zerobench.runs.kinds import results_folders

    return results_folders(root, kind_of=lambda p: "calibrate" if (p / "measurements.json").is_file() else None)


def _calibrate_row(folder: Path) -> dict:
    """What `zerobench list` shows of a calibrate folder: the GPU it measured (as its
    workload), its sections as cells: measured, or failed (measurements.json's "failed")."""
    import json

    row = {"workload": "?", "date": _stamp(folder.name), "cells": "-", "ok": "-", "failed": "-", "skipped": "-",
           "not run": "", "git": ""}
    try:
        measured = json.loads((folder / "measurements.json").read_text())
    except (OSError, ValueError):
        return {**row, "workload": "(damaged measurements.json)"}
    if not isinstance(measured, dict):
        return {**row, "workload": "(damaged measurements.json)"}
    section_of = {"gemm": "gemm", "attention": "attention", "optimizer": "optimizer"}  # else a memory kernel
    done = {section_of.get(str(r.get("kernel")), "memory") for r in measured.get("kernels", []) if isinstance(r, dict)}
    done |= {key for key in ("host", "collectives", "sustained") if key in measured}
    failed = len(measured.get("failed", []))
    env = measured.get("env", {})
    row.update(workload=str(env.get("name") or env.get("device") or "?"), ok=len(done), failed=failed,
               cells=len(done) + failed)
    return row


def _list_row(kind: str, folder: Path) -> dict:
    """What `zerobench list` shows of one folder; a damaged file says so instead of failing."""
    from zerobench.runs.kinds import FOLDER_KINDS, workload_name

    row = {"workload": "?", "date": _stamp(folder.name), "cells": "-", "ok": "-", "failed": "-", "skipped": "-",
           "not run": "", "git": ""}
    if kind == "run":
        run = RunFolder(folder)
        try:
            meta = run.meta()
        except DamagedFile:
            meta = {"workload": f"(damaged {run.meta_path.name})"}
        row.update(workload=str(meta.get("workload", "?")), git=(meta.get("git_commit") or "")[:8])
        row["date"] = str(meta.get("date", row["date"]))[:16].replace("T", " ")
        if run.cells_dir.is_dir():
            statuses = [r["status"] for r in run.cell_records()]
        elif run.results_path.exists():  # a curated run or a baseline: its tables are what it kept
            statuses = _statuses(run.results_path, "cell_id")
        else:  # interrupted (or still running) before its first cell finished
            statuses = []
        row["cells"] = len(meta.get("cells") or []) or len(statuses)
        left = len(unfinished_cells(folder))
        row["not run"] = str(left) if left else ""
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
    """"2026-11-24 12:00" from a folder named <date>-<time>-..., else "-" (no date recorded)."""
    import re

    m = re.match(r"(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})(\d{2})", name)
    return f"{m[1]}-{m[2]}-{m[3]} {m[4]}:{m[5]}" if m else "-"
