"""A cell's record (``cells/<cell_id>.json``) and each rank's part of it, as typed values:
checked where they are made (the rank, the harness) as well as where they are read back
(RunFolder), so a bad field is caught by the code that wrote it.

The JSON is the run folder's format, unchanged: ``to_json`` writes the same keys as the
dicts it replaces (an optional one only when set), and ``from_json`` reads every record
an earlier zerobench wrote, keeping keys it does not know (``extra``) so that nothing read
is lost when written again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

STATUSES = ("ok", "failed", "skipped")


class RecordError(ValueError):
    """A record that is not one; the message names the field and what it allows."""


def _need(ok: bool, where: str, what: str, value: Any) -> None:
    if not ok:
        raise RecordError(f"{where}: {value!r} is not allowed (allowed: {what})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class RankRecord:
    """What one rank measured of a cell: its metrics (columns of results.csv, named in
    columns.py), each measured step's time and loss, and the memory pass's timeline."""

    rank: int
    metrics: dict[str, Any]
    """metric name -> value, as results.csv's columns hold them."""
    step_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    timeline: dict[str, list] | None = None
    """The memory pass's samples (memory_timeline.png), when it ran."""
    phases: list | None = None
    """Where the memory pass's steps begin and end (forward, backward, optimizer)."""
    pass_wall_s: float | None = None
    ran: dict | None = None
    """What the engine ran instead of what it was asked ([Note: say what ran])."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not know, kept as read."""
    nulls: tuple[str, ...] = field(default=(), repr=False, compare=False)
    """Optional keys read (or given) as null: written back as null, not left out."""

    def __post_init__(self):
        where = "rank record"
        _need(_is_int(self.rank) and self.rank >= 0, f"{where}.rank", "an int >= 0", self.rank)
        where = f"rank {self.rank}'s record"
        _need(isinstance(self.metrics, dict), f"{where}.metrics", "an object of metric name -> value", self.metrics)
        for name in ("step_times", "losses"):
            value = getattr(self, name)
            _need(isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  for v in value), f"{where}.{name}", "a list of numbers", value)
        _need(self.timeline is None or isinstance(self.timeline, dict), f"{where}.timeline", "an object or null",
              self.timeline)
        _need(self.phases is None or isinstance(self.phases, list), f"{where}.phases", "a list or null", self.phases)

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: Any) -> RankRecord:
        _need(isinstance(data, dict), "rank record", "a JSON object", type(data).__name__)
        _need("rank" in data and "metrics" in data, "rank record", "an object with rank and metrics", sorted(data))
        return _from_json(cls, data)


@dataclass
class CellRecord:
    """One cell of a run: its id, status, configuration and every rank's record (none when
    it failed before the ranks reported, or was skipped), and what the harness adds."""

    cell_id: str
    status: Literal["ok", "failed", "skipped"]
    error: str | None
    """Why it failed or was skipped (None when ok)."""
    config: dict[str, Any]
    """engine, world_size, dtype and every axis of the engine (Cell.config())."""
    backend: str | None = None
    device: str | None = None
    code_root: str | None = None
    ranks: list[RankRecord] = field(default_factory=list)
    harness_pid: int | None = None
    ran: dict | None = None
    note: str | None = None
    loss_max_abs_diff_ref: float | None = None
    cell_wall_s: float | None = None
    reference_error: str | None = None
    concurrent_runs: list | None = None
    machine_load: dict | None = None
    damaged: bool | None = None
    """A cell file that could not be read back stands as a failed record saying so."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not know, kept as read."""
    nulls: tuple[str, ...] = field(default=(), repr=False, compare=False)
    """Optional keys read (or given) as null: written back as null, not left out."""

    def __post_init__(self):
        _need(isinstance(self.cell_id, str) and bool(self.cell_id), "cell record.cell_id", "a cell id", self.cell_id)
        where = f"cell record {self.cell_id}"
        _need(self.status in STATUSES, f"{where}.status", ", ".join(STATUSES), self.status)
        _need(self.error is None or isinstance(self.error, str), f"{where}.error", "a string or null", self.error)
        _need(isinstance(self.config, dict), f"{where}.config", "an object", self.config)
        if not self.damaged:
            ws = self.config.get("world_size")
            _need(_is_int(ws) and ws >= 1, f"{where}.config.world_size", "an int >= 1", ws)
        _need(isinstance(self.ranks, list), f"{where}.ranks", "a list of rank records", self.ranks)
        self.ranks = [r if isinstance(r, RankRecord) else RankRecord.from_json(r) for r in self.ranks]

    def to_json(self) -> dict[str, Any]:
        return _to_json(self, always=("cell_id", "status", "error", "config", "ranks"))

    @classmethod
    def from_json(cls, data: Any) -> CellRecord:
        _need(isinstance(data, dict), "cell record", "a JSON object", type(data).__name__)
        missing = [k for k in ("cell_id", "status", "config") if k not in data]
        _need(not missing, "cell record", "an object with cell_id, status and config", sorted(data))
        return _from_json(cls, {"error": None, **data})


def _to_json(record, always: tuple[str, ...] = ("rank", "metrics", "step_times", "losses")) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.name in ("extra", "nulls"):
            continue
        if f.name == "ranks":
            value = [r.to_json() for r in value]
        if value is not None or f.name in always or f.name in record.nulls:
            out[f.name] = value
    return {**out, **record.extra}


def _from_json(cls, data: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)} - {"extra", "nulls"}
    try:
        return cls(**{k: v for k, v in data.items() if k in names},
                   extra={k: v for k, v in data.items() if k not in names},
                   nulls=tuple(k for k, v in data.items() if k in names and v is None))
    except TypeError as err:  # a value of the wrong kind where a field expects another
        raise RecordError(f"{cls.__name__}: {err}") from None
