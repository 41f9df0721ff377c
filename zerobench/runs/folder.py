"""One run folder ``results/<run-id>/``: where each file lives, how it is read back with
the right types, and how it is updated atomically. Every reader and writer of a run
folder goes through :class:`RunFolder` (layout: :mod:`zerobench.runs.schema`).

[Note: readers have no side effects]
Reading a run folder (``zerobench show``, ``plot``, ``compare``, :meth:`RunFolder.results`)
never writes, never trains and never imports user code: a folder may come from anyone,
and its ``workload.json`` may name any factory. Where ``results.csv`` is missing or older
than ``cells/`` (cells run under torchrun, a truncated file), the tables are built from
``cells/`` in memory. A cell without its single-process loss reference (cells run under
torchrun) reads with an empty ``loss_max_abs_diff_ref``, and :meth:`RunFolder.missing_references`
names it. The one repair is explicit: ``zerobench reference RUN``
(zerobench/harness/reference.py, :func:`complete_run`) computes the missing references and
writes the tables; ``zerobench run --resume RUN`` does it too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from zerobench.runs.files import write_csv_atomic, write_json_atomic
from zerobench.instruments.link import link_from_config
from zerobench.runs.schema import COLUMN_ALIASES, COLUMN_DTYPES, ID_COLUMNS, METRICS

#: traces/<cell_id>/rank<r>.json.gz: one folder per cell, so that trace tools which read a
#: folder as one job (Holistic Trace Analysis) never mix cells.
TRACE_FILE = re.compile(r"^rank(?P<rank>\d+)\.json(\.gz)?$")
#: traces/<cell_id>.rank<r>.json.gz: the flat layout of runs made before per-cell folders.
LEGACY_TRACE_FILE = re.compile(r"^(?P<cell>.+)\.rank(?P<rank>\d+)\.json(\.gz)?$")
#: Sidecar of results.csv: column -> pandas dtype, so booleans and integers read back as such.
DTYPES_FILE = "results.dtypes.json"


class RunFolderError(FileNotFoundError):
    """A folder that is not (yet) a zerobench run folder."""


class DamagedFile(ValueError):
    """A file of a run folder that cannot be read back (truncated, not JSON, not UTF-8);
    the message names it."""


STATUSES = ("ok", "failed", "skipped")
_CELL_ID = re.compile(r"^(?P<engine>.+?)-ws(?P<world_size>\d+)-(?P<dtype>[a-z0-9]+)")


def read_json(path: Path) -> Any:
    """A JSON file of the run folder; DamagedFile naming it when it cannot be read back."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedFile(f"{path}: damaged ({type(err).__name__}: {err})") from None


def damaged_record(path: Path, reason: str) -> dict:
    """What a cell file that cannot be read stands for: a failed cell saying why, with the
    configuration its id spells (engine, world size, dtype), so the other cells carry on."""
    m = _CELL_ID.match(path.stem)
    config = {"engine": m["engine"], "world_size": int(m["world_size"]), "dtype": m["dtype"]} if m else {}
    return {"cell_id": path.stem, "status": "failed", "error": f"damaged cell record {path}: {reason}",
            "config": config, "ranks": [], "damaged": True}


def check_record(record: Any) -> str | None:
    """Why a parsed cell record is not one (None when it is)."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    if record.get("status") not in STATUSES:
        return f"status {record.get('status')!r} is not one of {', '.join(STATUSES)}"
    if not isinstance(record.get("cell_id"), str) or not isinstance(record.get("config"), dict):
        return "no cell_id or config"
    if not isinstance(record["config"].get("world_size"), int) or not isinstance(record.get("ranks", []), list):
        return "no config.world_size or ranks"
    return None


@dataclass(frozen=True)
class RunFolder:
    """The files of one run. Paths are properties; nothing is read until asked."""

    root: Path

    def __init__(self, root: str | Path):
        root = Path(root)
        object.__setattr__(self, "root", root.parent if root.name == "results.csv" else root)

    # -- paths ------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def meta_path(self) -> Path:
        return self.root / "meta.json"

    @property
    def workload_path(self) -> Path:
        return self.root / "workload.json"

    @property
    def cells_dir(self) -> Path:
        return self.root / "cells"

    @property
    def results_path(self) -> Path:
        return self.root / "results.csv"

    @property
    def steps_path(self) -> Path:
        return self.root / "steps.csv"

    @property
    def reference_path(self) -> Path:
        return self.root / "reference.json"

    @property
    def traces_dir(self) -> Path:
        return self.root / "traces"

    @property
    def analysis_dir(self) -> Path:
        return self.root / "analysis"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    def cell_path(self, cell_id: str) -> Path:
        return self.cells_dir / f"{cell_id}.json"

    def trace_path(self, cell_id: str, rank: int) -> Path:
        return self.traces_dir / cell_id / f"rank{rank}.json.gz"

    # -- reading ----------------------------------------------------------------------

    def meta(self) -> dict:
        """meta.json ({} when absent); DamagedFile naming it when it cannot be read."""
        if not self.meta_path.exists():
            return {}
        meta = read_json(self.meta_path)
        if not isinstance(meta, dict):
            raise DamagedFile(f"{self.meta_path}: damaged (expected a JSON object)")
        return meta

    def matrix_order(self) -> dict[str, int]:
        """cell_id -> position in the matrix, from meta.json (tables and plots follow it;
        file order when meta.json is damaged)."""
        try:
            cells = self.meta().get("cells", [])
        except DamagedFile:
            cells = []
        return {cid: i for i, cid in enumerate(cells)}

    def read_cell(self, cell_id: str) -> dict | None:
        """One cell's record; None when it is missing or damaged."""
        path = self.cell_path(cell_id)
        try:
            record = read_json(path)
        except (OSError, DamagedFile):
            return None
        return None if check_record(record) else record

    def cell_records(self) -> list[dict]:
        """Every cell file of the run, in the order the matrix listed them when known. A
        file that cannot be read stands as a failed cell naming it (:func:`damaged_record`)."""
        records = []
        for path in sorted(self.cells_dir.glob("*.json")):
            try:
                record = read_json(path)
                why = check_record(record)
            except DamagedFile as err:
                why = str(err).split(": damaged ", 1)[-1]
            except OSError as err:
                why = err.strerror or str(err)
            records.append(damaged_record(path, why) if why else record)
        order = self.matrix_order()
        return sorted(records, key=lambda r: order.get(r["cell_id"], len(order)))

    def cell_config(self, cell_id: str) -> dict:
        """The configuration a cell ran with ({} when its file is missing or unreadable)."""
        try:
            record = read_json(self.cell_path(cell_id))
        except (OSError, DamagedFile):
            return {}
        config = record.get("config") if isinstance(record, dict) else None
        return config if isinstance(config, dict) else {}

    def references(self) -> dict[int, list[float]]:
        """world size -> single-process reference losses (reference.json; {} when absent or damaged,
        so that it is computed again)."""
        if not self.reference_path.exists():
            return {}
        try:
            return {int(k): v for k, v in read_json(self.reference_path).items()}
        except (DamagedFile, AttributeError, ValueError):
            return {}

    def find_traces(self) -> list[tuple[str, int, Path]]:
        """(cell_id, rank, path) of every trace under traces/, per-cell folders and the
        older flat layout alike, sorted."""
        found = []
        if not self.traces_dir.is_dir():
            return found
        for p in sorted(self.traces_dir.iterdir()):
            if p.is_dir():
                for f in sorted(p.iterdir()):
                    m = TRACE_FILE.match(f.name)
                    if m:
                        found.append((p.name, int(m.group("rank")), f))
            else:
                m = LEGACY_TRACE_FILE.match(p.name)
                if m:
                    found.append((m.group("cell"), int(m.group("rank")), p))
        return sorted(found)

    def results(self) -> pd.DataFrame:
        """results.csv with its dtypes (see :func:`read_table`), or, when it is missing or
        stale (:meth:`tables_stale`), the same table built from cells/ in memory. Writes
        nothing ([Note: readers have no side effects])."""
        if self.tables_stale():
            results, _, dtypes = self.build_tables()
            return apply_dtypes(results, {**dtypes, **COLUMN_DTYPES})
        if not self.results_path.exists():
            raise RunFolderError(f"{self.root}: no results.csv and no cells/ to build it from "
                                 "(is this a zerobench run folder?)")
        return read_table(self.results_path, self._dtypes(), COLUMN_ALIASES)

    def steps(self) -> pd.DataFrame | None:
        """steps.csv (one row per cell x rank x measured step), built from cells/ in memory
        when stale; None when there is neither."""
        dtypes = {"cell_id": "string", "rank": "Int64", "step": "Int64"}
        if self.tables_stale():
            return apply_dtypes(self.build_tables()[1], dtypes)
        if not self.steps_path.exists():
            return None
        return read_table(self.steps_path, dtypes)

    def missing_references(self) -> list[str]:
        """The ok cells whose loss was never checked against the single-process reference
        (cells run under torchrun): ``zerobench reference RUN`` computes it."""
        return [r["cell_id"] for r in self.cell_records()
                if r.get("status") == "ok" and r.get("ranks") and "loss_max_abs_diff_ref" not in r]

    def _dtypes(self) -> dict[str, str]:
        sidecar = self.root / DTYPES_FILE
        try:
            recorded = read_json(sidecar) if sidecar.exists() else {}
        except DamagedFile:
            recorded = {}  # dtypes only refine how columns read back
        recorded = {COLUMN_ALIASES.get(k, k): v for k, v in (recorded if isinstance(recorded, dict) else {}).items()}
        return {**recorded, **COLUMN_DTYPES}

    # -- building and updating ----------------------------------------------------------

    def tables_stale(self) -> bool:
        """True when cells/ holds a record newer than results.csv, or results.csv is missing
        or does not hold exactly the rows cells/ gives (a truncated or edited file)."""
        cells = list(self.cells_dir.glob("*.json"))
        if not cells:
            return False
        if not self.results_path.exists():
            return True
        built = self.results_path.stat().st_mtime
        return any(p.stat().st_mtime > built for p in cells) or not self._results_match_cells()

    def _results_match_cells(self) -> bool:
        """Whether results.csv is whole (ends with its last line's newline) and has one row
        per cell x rank of cells/, no more, no fewer."""
        try:
            with open(self.results_path, "rb") as f:
                f.seek(-1, 2)
                whole = f.read(1) == b"\n"
            rows = pd.read_csv(self.results_path, usecols=["cell_id", "rank"], dtype=str)
        except (OSError, ValueError, pd.errors.ParserError, UnicodeDecodeError):
            return False
        if not whole:
            return False
        want = set()
        for rec in self.cell_records():
            ranks = [r.get("rank") for r in rec.get("ranks") or []] or range(rec["config"].get("world_size", 1))
            want |= {(rec["cell_id"], str(r)) for r in ranks}
        return set(zip(rows["cell_id"], rows["rank"])) == want and len(rows) == len(want)

    def build_tables(self) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, str]]:
        """(results: one row per cell x rank, steps: one row per cell x rank x measured
        step, dtypes of the configuration columns) from cells/ and analysis/summary.csv."""
        try:
            context = self.meta().get("context", {})
        except DamagedFile:
            context = {}  # the cells still make their rows
        rows, step_rows, dtypes = [], [], {}
        for rec in self.cell_records():
            for key, value in rec["config"].items():
                dtypes.setdefault(key, _dtype_of(value))
            base = {"run_id": self.name, "cell_id": rec["cell_id"], "status": rec["status"],
                    "error": rec.get("error"), **rec["config"], **context,
                    "backend": rec.get("backend"), "device": rec.get("device")}
            ranks = rec.get("ranks") or []
            if not ranks:  # failed or skipped: one row per rank, metrics empty
                for rank in range(rec["config"].get("world_size", 1)):
                    rows.append({**base, "rank": rank, "cell_wall_s": rec.get("cell_wall_s")})
                continue
            for r in ranks:
                metrics = {COLUMN_ALIASES.get(k, k): v for k, v in r["metrics"].items()}
                row = {**base, "rank": r["rank"], **metrics, "cell_wall_s": rec.get("cell_wall_s")}
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
        analysis = self.analysis_dir / "summary.csv"
        if analysis.exists() and len(results):  # columns added by `zerobench analyze` survive rebuilds
            results = merge_columns(results, pd.read_csv(analysis, dtype={"cell_id": "string"}))
        steps = pd.DataFrame(step_rows, columns=["cell_id", "rank", "step", "step_time_s", "loss"])
        return results, steps, {k: v for k, v in dtypes.items() if v}

    def write_tables(self) -> pd.DataFrame:
        """(Re)build results.csv, its dtypes sidecar and steps.csv from cells/, atomically."""
        results, steps, dtypes = self.build_tables()
        write_json_atomic(self.root / DTYPES_FILE, dtypes)
        write_csv_atomic(self.results_path, results)
        write_csv_atomic(self.steps_path, steps)
        return results

    def merge_into_results(self, columns: pd.DataFrame) -> bool:
        """Add per cell x rank columns (e.g. the analysis summary) to results.csv, replacing
        earlier values of the same columns. False (nothing written) without results.csv."""
        if not self.results_path.exists():
            return False
        current = read_table(self.results_path, self._dtypes(), COLUMN_ALIASES)  # the file as it is
        write_csv_atomic(self.results_path, merge_columns(current, columns))
        return True

    def emulation(self, cell_id: str):
        """The zerobench.instruments.link.Link a cell emulated, None when off."""
        return link_from_config(self.cell_config(cell_id))


def merge_columns(results: pd.DataFrame, columns: pd.DataFrame) -> pd.DataFrame:
    """results with the columns of ``columns`` (keyed on cell_id and rank) merged in; the
    one place analysis columns enter the results table."""
    new = [c for c in columns.columns if c not in ("cell_id", "rank")]
    results = results.drop(columns=[c for c in new if c in results.columns])
    columns = columns.astype({"cell_id": results["cell_id"].dtype, "rank": results["rank"].dtype})
    return results.merge(columns, on=["cell_id", "rank"], how="left")


def read_table(path: Path, dtypes: dict[str, str], aliases: dict[str, str] | None = None) -> pd.DataFrame:
    """A CSV of the run folder, its columns renamed by ``aliases`` (old name -> new), with
    the given column dtypes (see :func:`apply_dtypes`)."""
    frame = pd.read_csv(path, dtype={c: "string" for c, d in dtypes.items() if d == "string"},
                        keep_default_na=True)
    return apply_dtypes(frame.rename(columns=aliases or {}), dtypes)


def apply_dtypes(frame: pd.DataFrame, dtypes: dict[str, str]) -> pd.DataFrame:
    """``frame`` with the given column dtypes: "string", "boolean" and "Int64" (nullable,
    so empty cells of other engines' axes keep the type). A column whose values do not
    fit the dtype (an integer column holding 2.5) stays as it was."""
    for col in frame.columns:
        want = dtypes.get(col)
        if want == "Int64":
            values = pd.to_numeric(frame[col], errors="coerce")
            if (values.dropna() % 1 == 0).all():
                frame[col] = values.astype("Int64")
        elif want == "boolean":
            text = frame[col].astype("string").str.strip().str.lower()
            if text.dropna().isin(["true", "false"]).all():
                frame[col] = text.map({"true": True, "false": False}).astype("boolean")
        elif want == "string" and frame[col].dtype != "string":
            frame[col] = frame[col].astype("string")
    return frame


def zerobench_version() -> str | None:
    """The installed zerobench's version; from pyproject.toml when run from a checkout."""
    from importlib import metadata

    try:
        return metadata.version("zerobench")
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib

        return tomllib.loads(pyproject.read_text())["project"]["version"]
    except (OSError, KeyError, ValueError):
        return None


def _dtype_of(value) -> str | None:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "Int64"
    if isinstance(value, str):
        return "string"
    return None  # floats: pandas reads them as float64 already
