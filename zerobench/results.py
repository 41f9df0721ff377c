"""Run folders and the tables built from them (see zerobench.schema for the layout)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from zerobench.files import write_csv_atomic
from zerobench.schema import ID_COLUMNS, METRICS


REFERENCE_ENGINE = "ddp"  # every table and plot reads the others beside plain data parallelism


def reference_cells(cell_ids: pd.Series) -> pd.Series:
    """Which cells are the reference engine's default configuration (any world size and dtype)."""
    return cell_ids.str.fullmatch(rf"{REFERENCE_ENGINE}-ws\d+-\w+")


def cell_records(run_dir: Path) -> list[dict]:
    """Every cell file of the run, in the order the matrix listed them when known."""
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "cells").glob("*.json"))]
    order = matrix_order(run_dir)
    return sorted(records, key=lambda r: order.get(r["cell_id"], len(order)))


def matrix_order(run_dir: Path) -> dict[str, int]:
    """cell_id -> position in the matrix, from meta.json (tables and plots follow it)."""
    meta = run_dir / "meta.json"
    if not meta.exists():
        return {}
    return {cid: i for i, cid in enumerate(json.loads(meta.read_text()).get("cells", []))}


def build_tables(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(results: one row per cell x rank, steps: one row per cell x rank x measured step)."""
    meta = json.loads((run_dir / "meta.json").read_text()) if (run_dir / "meta.json").exists() else {}
    context = meta.get("context", {})
    rows, step_rows = [], []
    for rec in cell_records(run_dir):
        base = {"run_id": run_dir.name, "cell_id": rec["cell_id"], "status": rec["status"],
                "error": rec.get("error"), **rec["config"], **context,
                "backend": rec.get("backend"), "device": rec.get("device")}
        ranks = rec.get("ranks") or []
        if not ranks:  # failed or skipped: one row per rank, metrics empty
            for rank in range(rec["config"]["world_size"]):
                rows.append({**base, "rank": rank, "cell_wall_s": rec.get("cell_wall_s")})
            continue
        for r in ranks:
            row = {**base, "rank": r["rank"], **r["metrics"], "cell_wall_s": rec.get("cell_wall_s")}
            row["loss_max_abs_diff_ref"] = rec.get("loss_max_abs_diff_ref")
            rows.append(row)
            for i, (t, loss) in enumerate(zip(r["step_times"], r["losses"])):
                step_rows.append({"cell_id": rec["cell_id"], "rank": r["rank"], "step": i,
                                  "step_time_s": t, "loss": loss})
    results = pd.DataFrame(rows)
    metric_names = [m.name for m in METRICS]
    leading = [c for c in ID_COLUMNS if c in results.columns]
    metrics = [c for c in metric_names if c in results.columns]
    rest = [c for c in results.columns if c not in leading and c not in metrics]
    results = results[leading + rest + metrics] if len(results) else results
    analysis = run_dir / "analysis" / "summary.csv"
    if analysis.exists() and len(results):  # columns added by `zerobench analyze` survive rebuilds
        extra = pd.read_csv(analysis)
        results = results.merge(extra.drop(columns=[c for c in extra.columns if c in results.columns
                                                    and c not in ("cell_id", "rank")]),
                                on=["cell_id", "rank"], how="left")
    steps = pd.DataFrame(step_rows, columns=["cell_id", "rank", "step", "step_time_s", "loss"])
    return results, steps


def write_tables(run_dir: Path) -> pd.DataFrame:
    results, steps = build_tables(run_dir)
    write_csv_atomic(run_dir / "results.csv", results)
    write_csv_atomic(run_dir / "steps.csv", steps)
    return results


def load_results(run_dir: Path) -> pd.DataFrame:
    path = run_dir / "results.csv"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: no results.csv (is this a zerobench run folder?)")
    return pd.read_csv(path)


def summary(results: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: median step time over ranks, max peak memory over ranks, status."""
    if results.empty:
        return results
    agg = {"status": "first", "engine": "first", "error": "first"}
    for col, how in (("step_time_median_s", "median"), ("peak_mem_bytes", "max"), ("comm_total_bytes", "max"),
                     ("loss_max_abs_diff_ref", "max"), ("throughput_samples_s", "median")):
        if col in results.columns:
            agg[col] = how
    return results.groupby("cell_id", sort=False).agg(agg).reset_index()
