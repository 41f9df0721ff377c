"""Read a ``zerobench predict`` or ``zerobench estimate`` folder as the gate's table.

[Note: comparing what-if folders]
``zerobench compare BASE NEW`` takes two predict folders (``predict.csv``) or two estimate
folders (``estimate.csv``) as it takes two run folders, with the same options and exit
codes. What differs:

* A row is a configuration at a world size: its cell id is the one a run gives it
  (``impl-fsdp-ws8-bf16``, ``zerobench cells``).
  Its identity also takes in the presets it was predicted on (``gpu``, ``host``, ``link``,
  ``inter_link``, ``node_size``; an estimate's ``rank``, ``backend`` and ``fake_tensors``),
  the model's size (``params_total``) and the torch and zerobench versions (columns of the
  row). A row whose id matches and whose identity does not is unusable input (exit 2),
  as a run cell whose axes differ; so is a folder that does not record its versions,
  compared with one that does.
* Every figure is deterministic: the virtual GPU's timeline and the fake world's memory are
  pure functions of the program and the presets (zerobench/schema/columns.py,
  WHATIF_METRICS): unchanged code predicts identical figures, bit for bit (docs/ci.md,
  "Determinism"). So each gates exactly -- within 1e-9 of the baseline, the rounding a
  changed program makes when it only sums the same times in another order (seen: 1e-16
  to 5e-16 of comm_s) -- whatever kind the same name has in a run
  (``step_time_s`` is a noisy median there, ``peak_reserved_bytes`` and ``limiter_stalls``
  context); only the tool's own wall time (``predict_wall_s``, ``estimate_wall_s``) is
  reported, not judged. A figure whose direction a run does not say (a count) is worse
  when it grows.
* A status ``oom`` (predict: the model does not fit the GPU preset) is a failure: a
  configuration that fitted in the baseline and does not now is a regression.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from zerobench.runs.kinds import WHATIF_TABLES, folder_kind
from zerobench.schema.columns import COLUMN_ALIASES
from zerobench.spec.cell import CellId

#: tool -> the table its folder holds (zerobench/runs/whatif.py owns the paths)
TABLES = WHATIF_TABLES

#: columns that say what a row is without being its configuration
_NOT_CONFIG = ("config", "reason", "depth_from")

_STATUS = {"ok": "ok", "skipped": "skipped", "oom": "failed"}


def whatif_tool(path: str | Path) -> str | None:
    """``predict`` or ``estimate`` when ``path`` is such a folder (or its table), else None
    (zerobench/runs/kinds.py says what a folder is)."""
    path = Path(path)
    kind = folder_kind(path.parent if path.is_file() else path)
    return kind if kind in TABLES else None


def read_whatif(path: str | Path, tool: str) -> tuple[Path, pd.DataFrame]:
    """(folder, the table in the gate's layout) of a what-if folder: the gate's id columns
    (``cell_id``, ``rank``, ``status``, ``error``) added. Raises ValueError naming the file."""
    path = Path(path)
    root = path.parent if path.is_file() else path
    table = root / TABLES[tool]
    try:
        frame = pd.read_csv(table)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{table}: unreadable: {e}") from e
    frame = frame.rename(columns={old: new for old, new in COLUMN_ALIASES.items()
                                  if old in frame.columns and new not in frame.columns})
    missing = [c for c in ("config", "world_size", "status") if c not in frame.columns]
    if missing:
        raise ValueError(f"{table}: missing column(s) {', '.join(missing)} (is this a {tool} folder?)")
    frame.insert(0, "cell_id", [_cell_id(str(c), w) for c, w in zip(frame["config"], frame["world_size"])])
    if "rank" not in frame.columns:
        frame["rank"] = 0
    frame["error"] = frame["reason"].astype("string").fillna("").astype(str) if "reason" in frame.columns else ""
    frame["status"] = frame["status"].map(lambda s: _STATUS.get(str(s), "failed"))
    return root, frame.drop(columns=[c for c in _NOT_CONFIG if c in frame.columns])


def _cell_id(config: str, world_size) -> str:
    """The run's cell id of a configuration at a world size (``zerobench cells``):
    ``impl-fsdp-bf16`` at 8 ranks is ``impl-fsdp-ws8-bf16``; what is no configuration id,
    or has no world size, is kept with ``-ws?`` after it."""
    cid = CellId.try_parse(config)
    if cid is None or pd.isna(world_size):
        return f"{config}-ws?"
    return str(cid.at(int(world_size)))
