"""The tables of a run folder, for reports and plots (reading and writing: zerobench.runs.folder)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from zerobench.runs.folder import RunFolder
from zerobench.spec.cell import CellId

REFERENCE_ENGINE = "ddp"  # every table and plot reads the others beside plain data parallelism


def reference_cells(cell_ids: pd.Series) -> pd.Series:
    """Which cells are the reference engine's default configuration (any world size and dtype)."""
    return default_cells(cell_ids, REFERENCE_ENGINE)


def is_reference(cell_id: str) -> bool:
    """Whether one cell id is the reference engine's default configuration."""
    return is_default_cell(cell_id, REFERENCE_ENGINE)


def default_cells(cell_ids: pd.Series, engine: str) -> pd.Series:
    """Which cells are ``engine`` with every axis at its default (False for what is no cell id)."""
    return cell_ids.map(lambda text: is_default_cell(text, engine)).astype(bool)


def is_default_cell(text, engine: str) -> bool:
    cid = CellId.try_parse(text)
    return cid is not None and cid.world_size is not None and cid.is_default_of(engine)


def cell_records(run_dir: Path) -> list[dict]:
    """Every cell file of the run, in the order the matrix listed them when known."""
    return RunFolder(run_dir).cell_records()


def matrix_order(run_dir: Path) -> dict[str, int]:
    """cell_id -> position in the matrix, from meta.json (tables and plots follow it)."""
    return RunFolder(run_dir).matrix_order()


def build_tables(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(results: one row per cell x rank, steps: one row per cell x rank x measured step)."""
    results, steps = RunFolder(run_dir).build_tables()
    return results, steps


def write_tables(run_dir: Path) -> pd.DataFrame:
    return RunFolder(run_dir).write_tables()


def load(run_dir: Path) -> pd.DataFrame:
    """results.csv of a run folder, with the dtypes plain ``pandas.read_csv`` gives it
    ([Note: types in results.csv] in zerobench/schema/columns.py); built from cells/ in
    memory when it is missing or older than a cell record, with the same dtypes."""
    return RunFolder(run_dir).results()


load_results = load


def summary(results: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: median step time over ranks, max peak memory over ranks, status."""
    if results.empty:
        return results
    agg = {"status": "first", "engine": "first", "error": "first"}
    if "note" in results.columns:
        agg["note"] = "first"
    for col, how in (("step_time_s", "median"), ("peak_mem_bytes", "max"), ("comm_total_bytes", "max"),
                     ("loss_max_abs_diff_ref", "max"), ("throughput_samples_s", "median")):
        if col in results.columns:
            agg[col] = how
    return results.groupby("cell_id", sort=False).agg(agg).reset_index()
