"""One run folder ``results/<run-id>/``: where each file lives, how it is read back with
the right types, and how it is updated atomically. Every reader and writer of a run
folder goes through :class:`RunFolder`, the one piece of code that knows its layout
(the columns of its tables are :mod:`zerobench.schema.columns`'s)::

    workload.json        the fully resolved workload the run used (what the ranks read)
    meta.json            workload, git commit, torch version, backend, machine, date, command line
    reference.json       world size -> the single-process reference losses
    cells/<cell>.json    one file per cell: status, config, per-rank metrics, per-step series
    results.csv          the tidy table: one row per cell x rank (built from cells/)
    steps.csv            one row per cell x rank x measured step: step time and loss
    logs/<cell>.rank<r>.log          each rank's output
    traces/<cell>/rank<r>.json.gz    ``--profile``: each rank's trace
    analysis/*.csv       ``zerobench analyze``: the traces' summary, steps, collectives
    schedules/<cell>.json            ``zerobench simulate``: the schedule read off the traces
    simulate/<setting>/  ``zerobench simulate``: the re-timed tables and plots of one setting
    plots/*.png

Every file is written atomically (temporary file + rename, zerobench/runs/files.py), so a
killed run leaves only whole files behind and ``--resume`` can trust what it finds.

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
from typing import TYPE_CHECKING, Any

import pandas as pd

from zerobench.instruments.link import link_from_config
from zerobench.runs.files import write_csv_atomic, write_json_atomic
from zerobench.runs.kinds import WORKLOAD_FILE, workload_name
from zerobench.schema.columns import COLUMN_ALIASES, COLUMN_DTYPES, ID_COLUMNS, METRICS
from zerobench.schema.records import CellRecord, RecordError
from zerobench.spec.cell import CellId

if TYPE_CHECKING:  # parsed on demand: readers of the tables need no workload
    from zerobench.spec.workload import Workload

#: traces/<cell_id>/rank<r>.json.gz: one folder per cell, so that trace tools which read a
#: folder as one job (Holistic Trace Analysis) never mix cells.
TRACE_FILE = re.compile(r"^rank(?P<rank>\d+)\.json(\.gz)?$")
#: traces/<cell_id>.rank<r>.json.gz: the flat layout of runs made before per-cell folders.
LEGACY_TRACE_FILE = re.compile(r"^(?P<cell>.+)\.rank(?P<rank>\d+)\.json(\.gz)?$")


class RunFolderError(FileNotFoundError):
    """A folder that is not (yet) a zerobench run folder."""


class DamagedFile(ValueError):
    """A file of a run folder that cannot be read back (truncated, not JSON, not UTF-8);
    the message names it."""




def read_json(path: Path) -> Any:
    """A JSON file of the run folder; DamagedFile naming it when it cannot be read back."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedFile(f"{path}: damaged ({type(err).__name__}: {err})") from None


def damaged_record(path: Path, reason: str) -> dict:
    """What a cell file that cannot be read stands for: a failed cell saying why, with the
    configuration its id spells (engine, world size, dtype), so the other cells carry on."""
    cid = CellId.try_parse(path.stem)
    config = {"engine": cid.engine, "world_size": cid.world_size, "dtype": cid.dtype} if cid and cid.world_size else {}
    return CellRecord(cell_id=path.stem, status="failed", error=f"damaged cell record {path}: {reason}",
                      config=config, damaged=True).to_json()


def check_record(record: Any) -> str | None:
    """Why a parsed cell record is not one (None when it is): :class:`CellRecord`'s check."""
    try:
        CellRecord.from_json(record)
    except RecordError as err:
        return str(err)
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
        return self.root / WORKLOAD_FILE

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

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def schedules_dir(self) -> Path:
        return self.root / "schedules"

    def simulate_dir(self, setting: str) -> Path:
        """``simulate/<setting>/``: one simulation's outputs (``cross`` for the cross-validation)."""
        return self.root / "simulate" / setting

    def cell_path(self, cell_id: str) -> Path:
        return self.cells_dir / f"{cell_id}.json"

    def trace_path(self, cell_id: str, rank: int) -> Path:
        return self.traces_dir / cell_id / f"rank{rank}.json.gz"

    def log_path(self, cell_id: str, rank: int) -> Path:
        return self.logs_dir / f"{cell_id}.rank{rank}.log"

    def schedule_path(self, cell_id: str) -> Path:
        return self.schedules_dir / f"{cell_id}.json"

    def analysis_path(self, table: str) -> Path:
        """``analysis/<table>.csv``: summary, steps, collectives, inflight."""
        return self.analysis_dir / f"{table}.csv"

    def plot_path(self, name: str) -> Path:
        """``plots/<name>``: a figure of the run (its format from the suffix)."""
        return self.plots_dir / name

    # -- reading ----------------------------------------------------------------------

    def meta(self) -> dict:
        """meta.json ({} when absent); DamagedFile naming it when it cannot be read."""
        if not self.meta_path.exists():
            return {}
        meta = read_json(self.meta_path)
        if not isinstance(meta, dict):
            raise DamagedFile(f"{self.meta_path}: damaged (expected a JSON object)")
        return meta

    def workload(self) -> Workload:
        """The workload the run was made for (workload.json, validated; WorkloadError or
        DamagedFile naming the file). Parsing imports nothing the workload names."""
        from zerobench.spec.workload import parse_workload

        return parse_workload(read_json(self.workload_path), source=str(self.workload_path))

    def workload_name(self) -> str:
        """The name of the workload, read without validating the rest of workload.json
        (the folder's own name when the file is missing or damaged)."""
        return workload_name(self.root)

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
        """results.csv as plain ``pandas.read_csv`` reads it ([Note: types in results.csv] in
        zerobench/schema/columns.py), or, when it is missing or stale (:meth:`tables_stale`),
        the same table built from cells/ in memory, with the types the file would have.
        Writes nothing ([Note: readers have no side effects])."""
        if self.tables_stale():
            return as_written(self.build_tables()[0])
        if not self.results_path.exists():
            raise RunFolderError(f"{self.root}: no results.csv and no cells/ to build it from "
                                 "(is this a zerobench run folder?)")
        if not self.results_path.is_file():
            raise DamagedFile(f"{self.results_path}: not a file (allowed: the results table; remove it, and "
                              f"zerobench rebuilds it from cells/)")
        self._check_without_cells()
        return read_table(self.results_path, COLUMN_ALIASES)

    def _check_without_cells(self) -> None:
        """A folder without cells/ (curated runs and baselines keep only their tables) is
        read from results.csv as saved, once that holds exactly the cells meta.json lists:
        DamagedFile naming both otherwise (cells/ deleted after more cells ran, say)."""
        if self.cells_dir.is_dir():
            return
        try:
            listed = set(self.meta().get("cells") or [])
            have = set(pd.read_csv(self.results_path, usecols=["cell_id"], dtype=str)["cell_id"])
        except (DamagedFile, ValueError, OSError, pd.errors.ParserError, UnicodeDecodeError):
            return  # the readers below say what is wrong with those files
        if listed and have != listed:
            missing, extra = sorted(listed - have), sorted(have - listed)
            raise DamagedFile(
                f"{self.results_path}: does not hold the cells meta.json lists "
                + (f"(missing: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}) " if missing else "")
                + (f"(not listed: {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}) " if extra else "")
                + f"and {self.cells_dir} is gone, so it cannot be checked or rebuilt (allowed: the run folder "
                  f"with its cells/, or a results.csv holding every cell meta.json lists)")

    def steps(self) -> pd.DataFrame | None:
        """steps.csv (one row per cell x rank x measured step), built from cells/ in memory
        when stale; None when there is neither."""
        if self.tables_stale():
            return as_written(self.build_tables()[1])
        if not self.steps_path.exists():
            return None
        return read_table(self.steps_path, COLUMN_ALIASES)

    def missing_references(self) -> list[str]:
        """The ok cells whose loss was never checked against the single-process reference
        (cells run under torchrun): ``zerobench reference RUN`` computes it."""
        return [r["cell_id"] for r in self.cell_records()
                if r.get("status") == "ok" and r.get("ranks") and "loss_max_abs_diff_ref" not in r]

    # -- writing ------------------------------------------------------------------------

    def write_workload(self, workload: Workload) -> None:
        """workload.json: the resolved workload (a ``Workload``), which the ranks read."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.workload_path, workload.to_dict())

    def write_meta(self, meta: dict) -> None:
        write_json_atomic(self.meta_path, meta)

    def write_references(self, references: dict[int, list[float]]) -> None:
        """reference.json: world size -> the single-process reference losses."""
        write_json_atomic(self.reference_path, {str(k): v for k, v in sorted(references.items())})

    def write_cell(self, record: CellRecord | dict) -> None:
        """cells/<cell>.json: one cell's record (its ``cell_id`` names the file), checked
        before it is written (RecordError naming the field)."""
        record = record if isinstance(record, CellRecord) else CellRecord.from_json(record)
        write_json_atomic(self.cell_path(record.cell_id), record.to_json())

    def discard_cell(self, cell_id: str) -> None:
        """Remove a cell's record, so that a stale one never passes for a new attempt's."""
        self.cell_path(cell_id).unlink(missing_ok=True)

    def has_cells(self) -> bool:
        """Whether any cell record has been written."""
        return any(self.cells_dir.glob("*.json"))

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

    def build_tables(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(results: one row per cell x rank, steps: one row per cell x rank x measured
        step) from cells/ and analysis/summary.csv."""
        try:
            context = self.meta().get("context", {})
        except DamagedFile:
            context = {}  # the cells still make their rows
        rows, step_rows = [], []
        for rec in self.cell_records():
            base = {"run_id": self.name, "cell_id": rec["cell_id"], "status": rec["status"],
                    "error": rec.get("error"), **({"note": rec["note"]} if rec.get("note") else {}),
                    **rec["config"], **context,
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
        analysis = self.analysis_path("summary")
        if analysis.exists() and len(results):  # columns added by `zerobench analyze` survive rebuilds
            results = merge_columns(results, pd.read_csv(analysis, dtype={"cell_id": "string"}))
        steps = pd.DataFrame(step_rows, columns=["cell_id", "rank", "step", "step_time_s", "loss"])
        return results, steps

    def write_tables(self) -> pd.DataFrame:
        """(Re)build results.csv and steps.csv from cells/, atomically."""
        results, steps = self.build_tables()
        write_csv_atomic(self.results_path, integers_as_written(results))
        write_csv_atomic(self.steps_path, steps)
        return results

    def merge_into_results(self, columns: pd.DataFrame) -> bool:
        """Add per cell x rank columns (e.g. the analysis summary) to results.csv, replacing
        earlier values of the same columns. False (nothing written) without results.csv."""
        if not self.results_path.exists():
            return False
        current = read_table(self.results_path, COLUMN_ALIASES)  # the file as it is
        write_csv_atomic(self.results_path, integers_as_written(merge_columns(current, columns)))
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


def read_table(source, aliases: dict[str, str] | None = None) -> pd.DataFrame:
    """A CSV of the run folder as plain ``pandas.read_csv`` reads it, its columns renamed
    by ``aliases`` (old name -> new): the types a user's own ``read_csv`` gets
    ([Note: types in results.csv] in zerobench/schema/columns.py), each boolean column
    holding booleans (:func:`booleans_as_read`)."""
    frame = pd.read_csv(source).rename(columns=aliases or {})
    try:
        return booleans_as_read(frame)
    except DamagedFile as err:
        raise DamagedFile(f"{source}: {err}" if isinstance(source, (str, Path)) else str(err)) from None


def booleans_as_read(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each boolean column (an engine's on/off axis:
    zerobench/engines/options.py) holding True, False or NaN, as ``read_csv`` gives a
    column of True / False written with gaps; text in it other than True / False is
    DamagedFile naming the column (no "1" or "on" passes for True)."""
    from zerobench.engines.options import flag_axes

    for col in flag_axes() & set(frame.columns):
        if frame[col].dtype == bool:
            continue
        frame[col] = [_boolean(col, v) for v in frame[col]]
    return frame


def _boolean(column: str, value):
    if isinstance(value, bool) or pd.isna(value):
        return value
    if hasattr(value, "dtype") and value.dtype == bool:  # numpy's
        return bool(value)
    if value in ("True", "False"):
        return value == "True"
    raise DamagedFile(f"{column}: {value!r} is not allowed in a boolean column (allowed: True, False or empty)")


def integers_as_written(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with its integer columns (COLUMN_DTYPES) as nullable integers, so that the
    CSV holds ``4`` and an empty field, never ``4.0``."""
    out = frame.copy()
    for col in out.columns:
        if COLUMN_DTYPES.get(col) == "Int64" and not isinstance(out[col].dtype, pd.Int64Dtype):
            values = pd.to_numeric(out[col], errors="coerce")
            if (values.dropna() % 1 == 0).all():
                out[col] = values.astype("Int64")
    return out


def as_written(frame: pd.DataFrame) -> pd.DataFrame:
    """A table built in memory with the types it has once written and read back: what
    ``results()`` returns must not depend on whether the file was stale."""
    import io

    text = io.StringIO()
    integers_as_written(frame).to_csv(text, index=False)
    text.seek(0)
    return read_table(text)


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
