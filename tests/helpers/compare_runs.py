"""Small synthetic run folders for the tests of ``zerobench compare`` (tests/test_compare*.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from zerobench.cli import main as cli_main
from zerobench.schema.columns import CONTEXT_COLUMNS, ID_COLUMNS

MiB = 2**20


def write_run(folder: Path, results: pd.DataFrame, steps: pd.DataFrame | None = None,
              meta: dict | None = None) -> Path:
    """Write a run folder (results.csv, steps.csv, meta.json) from DataFrames."""
    folder.mkdir(parents=True, exist_ok=True)
    results.to_csv(folder / "results.csv", index=False)
    if steps is not None:
        steps.to_csv(folder / "steps.csv", index=False)
    (folder / "meta.json").write_text(json.dumps(meta or {"torch_version": "2.13.0+cpu", "backend": "gloo"}))
    return folder


def make_run(step_median: float = 0.100, step_mad: float = 0.010, peak_mem: float = 40 * MiB,
             comm: float = 8 * MiB, loss_last: float = 2.5, run_id: str = "base",
             cells: tuple[str, ...] = ("ddp-ws2-fp32", "fully_shard-ws2-fp32-reshard_true"),
             status: dict[str, str] | None = None, world_size: int = 2) -> tuple[pd.DataFrame, pd.DataFrame]:
    """results and steps of a small run: every cell the same figures, ranks slightly apart.

    Step times per (cell, rank) are median +- {0, 1, 2} x mad, so their median is exactly
    ``step_median`` and their MAD exactly ``step_mad``.
    """
    rows, steps = [], []
    for cell in cells:
        engine = cell.split("-")[0]
        st = (status or {}).get(cell, "ok")
        for rank in range(world_size):
            row = {c: "" for c in ID_COLUMNS}
            row.update(run_id=run_id, cell_id=cell, status=st, error="boom" if st == "failed" else "",
                       engine=engine, world_size=world_size, dtype="fp32", rank=rank,
                       reshard_after_forward="True" if engine == "fully_shard" else "")
            row.update({c: "" for c in CONTEXT_COLUMNS})
            row.update(workload="quickstart", model="mlp", backend="gloo", device="cpu", batch_size=8, steps=20)
            if st == "ok":
                row.update(step_time_s=step_median, step_time_p10_s=step_median - step_mad,
                           step_time_p90_s=step_median + step_mad, step_time_mad_s=step_mad,
                           throughput_samples_s=8 * world_size / step_median, loss_first=3.0 + rank,
                           loss_last=loss_last + rank, peak_mem_bytes=peak_mem + rank * 1024,
                           comm_total_bytes=comm, comm_calls=12, rss_max_bytes=300 * MiB + rank,
                           peak_allocated_bytes=None, limiter_stall_s=0.001)
                for i, d in enumerate([-2, -1, 0, 1, 2] * 4):
                    steps.append({"cell_id": cell, "rank": rank, "step": i,
                                  "step_time_s": step_median + d * step_mad, "loss": 3.0})
            rows.append(row)
    return pd.DataFrame(rows), pd.DataFrame(steps, columns=["cell_id", "rank", "step", "step_time_s", "loss"])


def run_folder(tmp_path: Path, name: str, **kw) -> Path:
    results, steps = make_run(run_id=name, **kw)
    return write_run(tmp_path / name, results, steps)


def cli(*argv) -> int:
    return cli_main(["compare", *(str(a) for a in argv)])
