"""The folders of ``zerobench estimate`` and ``zerobench predict``: every path in them, and
their table read and written, as :class:`~zerobench.runs.folder.RunFolder` does for a run.
Nothing else names ``estimate.csv``, ``predict.csv`` or a predicted trace's file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pandas as pd

from zerobench.runs.files import write_csv_atomic
from zerobench.runs.folder import read_table
from zerobench.runs.kinds import WHATIF_TABLES, WORKLOAD_FILE


@dataclass(frozen=True)
class WhatIfFolder:
    """The files of one estimate or prediction. Paths are properties; nothing is read
    until asked. ``root`` may be given as the folder or as its table."""

    root: Path
    tool: ClassVar[str]

    def __init__(self, root: str | Path):
        root = Path(root)
        object.__setattr__(self, "root", root.parent if root.name == WHATIF_TABLES[self.tool] else root)

    @property
    def table_path(self) -> Path:
        return self.root / WHATIF_TABLES[self.tool]

    @property
    def workload_path(self) -> Path:
        return self.root / WORKLOAD_FILE

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    def exists(self) -> bool:
        return self.table_path.is_file()

    def table(self) -> pd.DataFrame:
        """The tool's table, with the types plain ``read_csv`` gives it (booleans checked:
        zerobench/runs/folder.py, read_table)."""
        return read_table(self.table_path)

    def write_table(self, frame: pd.DataFrame) -> None:
        write_csv_atomic(self.table_path, frame)


class EstimateFolder(WhatIfFolder):
    """``zerobench estimate``'s folder: estimate.csv, workload.json, plots/."""

    tool = "estimate"


class PredictFolder(WhatIfFolder):
    """``zerobench predict``'s folder: predict.csv, workload.json, gpu.json (the preset the
    cells ran on), traces/ (one Chrome trace per cell), plots/."""

    tool = "predict"

    @property
    def gpu_path(self) -> Path:
        return self.root / "gpu.json"

    @property
    def traces_dir(self) -> Path:
        return self.root / "traces"

    def trace_path(self, cell_id: str) -> Path:
        """The virtual GPU's trace of one cell (a cell id: the configuration at a world size)."""
        return predicted_trace(self.traces_dir, cell_id)


def predicted_trace(traces_dir: Path, cell_id: str) -> Path:
    """Where the predicting process, given only the traces folder, writes a cell's trace."""
    return Path(traces_dir) / f"{cell_id}.trace.json.gz"
