"""What a folder under ``results/`` is: a run (``zerobench run``: meta.json, cells/,
results.csv), an estimate (estimate.csv) or a prediction (predict.csv). Standard
library only: the command line asks before it imports anything else."""

from __future__ import annotations

import json
from pathlib import Path

#: The resolved workload a results folder of any kind was made from.
WORKLOAD_FILE = "workload.json"

#: what-if tool -> the table its folder holds (zerobench/runs/whatif.py owns the paths)
WHATIF_TABLES = {"estimate": "estimate.csv", "predict": "predict.csv"}

#: kind -> the files that mark it, looked for in this order (a run that also holds an
#: estimate.csv, as a curated one may, is a run).
FOLDER_KINDS: dict[str, tuple[str, ...]] = {
    "run": ("meta.json", "cells", "results.csv"),
    **{tool: (table,) for tool, table in WHATIF_TABLES.items()},
}


def folder_kind(path: Path) -> str | None:
    """"run", "estimate" or "predict" for a results folder, None for anything else."""
    for kind, markers in FOLDER_KINDS.items():
        if any((Path(path) / m).exists() for m in markers):
            return kind
    return None


def results_folders(root: Path, depth: int = 3, kind_of=None) -> list[tuple[str, Path]]:
    """(kind, folder) of every results folder under ``root`` down to ``depth`` levels
    (results/<run>, results/curated/<run>, results/ci/<run>), not looking inside one.
    ``kind_of``: what a folder is (default :func:`folder_kind`; None for no results folder)."""
    kind_of = kind_of or folder_kind
    found = []
    try:
        children = sorted(p for p in Path(root).iterdir() if p.is_dir())
    except OSError:
        return found
    for child in children:
        kind = kind_of(child)
        if kind is not None:
            found.append((kind, child))
        elif depth > 1:
            found += results_folders(child, depth - 1, kind_of)
    return found


def workload_name(folder: Path) -> str:
    """The name of the workload a results folder was made from (its workload.json), else
    the folder's own name."""
    try:
        return json.loads((Path(folder) / WORKLOAD_FILE).read_text())["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return Path(folder).name
