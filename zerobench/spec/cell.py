"""A cell and its id: the one place a cell id is built, parsed, shortened or stripped of
its world size.

A :class:`Cell` is one configuration of a workload's matrix at one world size. Its id, a
:class:`CellId`, names it in file names (``cells/<id>.json``), in the ``cell_id`` column
of every table and in plots:

    impl-fsdp-ws8-bf16-sharding_strategy=SHARD_GRAD_OP-limit_all_gathers=off
    ^engine   ^ws ^dtype ^the axes off their engine's defaults, in the engine's order

Without its world size it is a *configuration id* (``impl-fsdp-bf16-...``): what
``zerobench estimate`` and ``predict`` run at many world sizes (their ``config``
column). Its :attr:`CellId.short` form is how plots label it.

This module imports neither torch nor the engines: readers of a run folder parse ids
with it. Only :attr:`Cell.cell_id`, which needs the engine's defaults, imports them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from zerobench.spec.workload import DTYPES

_DTYPE = "|".join(DTYPES)
#: engine, world size, dtype, then "-name=value" per option (an engine's name has hyphens,
#: hence the shortest engine that a world size or a dtype follows).
_CELL = re.compile(rf"^(?P<engine>[a-z][a-z0-9-]*?)-ws(?P<world_size>\d+)-(?P<dtype>{_DTYPE})(?P<options>(-.*)?)$")
_CONFIG = re.compile(rf"^(?P<engine>[a-z][a-z0-9-]*?)-(?P<dtype>{_DTYPE})(?P<options>(-.*)?)$")
#: Where one option of the id's tail starts: "-" before an axis name and its "=".
_OPTION = re.compile(r"-(?=[a-z][a-z0-9_]*=)")


@dataclass(frozen=True)
class CellId:
    """A cell id, or a configuration id when ``world_size`` is None. ``options`` are the
    ``(axis, value)`` pairs the id spells, as text (``("limit_all_gathers", "off")``)."""

    engine: str
    dtype: str
    world_size: int | None = None
    options: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        ws = [] if self.world_size is None else [f"ws{self.world_size}"]
        return "-".join([self.engine, *ws, self.dtype, *(f"{n}={v}" for n, v in self.options)])

    @classmethod
    def parse(cls, text: str) -> CellId:
        """A cell id or a configuration id read back; ValueError saying what an id looks like."""
        text = str(text)
        m = _CELL.match(text) or _CONFIG.match(text)
        if m is None:
            raise ValueError(f"cell id {text!r} is not one (allowed: ENGINE-wsN-DTYPE[-AXIS=VALUE...] or, without "
                             f"the world size, a configuration id; DTYPE one of {', '.join(DTYPES)})")
        options = tuple(tuple(o.split("=", 1)) for o in _OPTION.split(m["options"])[1:])
        ws = m.groupdict().get("world_size")
        return cls(m["engine"], m["dtype"], None if ws is None else int(ws), options)

    @classmethod
    def try_parse(cls, text: Any) -> CellId | None:
        """:meth:`parse`, or None for what is not an id (a missing value in a table)."""
        try:
            return cls.parse(text) if isinstance(text, str) else None
        except ValueError:
            return None

    @property
    def config(self) -> str:
        """The configuration id: this id without its world size."""
        return str(self.at(None))

    def at(self, world_size: int | None) -> CellId:
        """The same configuration at ``world_size`` (None: the configuration id)."""
        return CellId(self.engine, self.dtype, None if world_size is None else int(world_size), self.options)

    def is_default_of(self, engine: str) -> bool:
        """Whether this is ``engine`` with every axis at its default (any world size and dtype)."""
        return self.engine == engine and not self.options

    @property
    def short(self) -> str:
        """How plots label it, with no world size or dtype (the panel says them) and its
        options shortened: ``impl-fsdp SHARD_GRAD_OP, bwd post``."""
        tail = "".join(f"-{n}={v}" for n, v in self.options)
        engine, *options = re.split(r"-(?=[a-z_]+=)", self.engine + tail)
        for long, short in _SHORT_OPTIONS:
            options = [o.replace(long, short) if o.startswith(long) else o for o in options]
        options = [re.sub(r"^emulate_gbps=(.*)$", r"\1 GB/s", re.sub(r"^emulate_latency_us=(.*)$", r"\1 µs", o))
                   for o in options]
        return engine + (" " + ", ".join(options) if options else "")


#: How an id's options read in a plot's labels (the id spells them in full). The split
#: before an option stops at a digit in its name (``stage3_...`` stays with the option
#: before it), as plots have always labelled DeepSpeed's stage-3 options.
_SHORT_OPTIONS = (("sharding_strategy=", ""), ("backward_prefetch=", "bwd "), ("forward_prefetch=", "fwd "),
                  ("limit_all_gathers=", "limiter "), ("limiter_depth=", "depth "), ("reshard_after_forward=", "reshard "),
                  ("activation_checkpointing=", "ckpt "),
                  ("emulate_link=", "link "), ("parameters_as_bucket_view=", "bucket view "),
                  ("gradient_as_bucket_view=", "grad view "), ("cpu_offload=", "offload "))


def format_value(value: Any) -> str:
    """An option's value as an id spells it: booleans on/off, whole floats as ints."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class Cell:
    """One configuration of the matrix: run as one torch.distributed world."""

    engine: str
    world_size: int
    dtype: str
    options: tuple[tuple[str, Any], ...] = ()
    """Every axis of the engine with its value, in the engine's declared order."""
    skip_reason: str | None = field(default=None, compare=False)
    note: str | None = field(default=None, compare=False)
    """What the engine ignores of this configuration on this device (``Engine.notes``)."""

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def settings(self):
        """The engine's options as a value (zerobench/engines/options.py): every axis of
        the engine, checked, with its declared default where the cell has none."""
        from zerobench.engines.options import OPTIONS

        if self.engine in OPTIONS:
            return OPTIONS[self.engine].from_options(self.opts)
        from zerobench.engines import get_engine  # an engine registered at run time (tests)

        return get_engine(self.engine).Options.from_options(self.opts)

    @property
    def shard_group_size(self) -> int | None:
        """HYBRID_SHARD's shard group at this cell's world size (one node's ranks,
        ``LOCAL_WORLD_SIZE``, else half the world: impl/fsdp/process_groups.py); None for
        any other strategy or engine."""
        settings = self.settings
        if getattr(settings, "sharding_strategy", None) != "HYBRID_SHARD":
            return None
        return settings.shard_group_size(self.world_size)

    @property
    def cell_id(self) -> CellId:
        """Stable across runs: engine, world size, dtype, then the axes that differ
        from the engine's defaults (so adding an axis to an engine keeps old ids)."""
        from zerobench.spec.axes import engine_axes  # the engine's defaults: imports it, hence torch

        defaults = engine_axes(self.engine)
        off_default = tuple((n, format_value(v)) for n, v in self.options if n in defaults and v != defaults[n].default)
        return CellId(self.engine, self.dtype, self.world_size, off_default)

    @property
    def id(self) -> str:
        return str(self.cell_id)

    @property
    def config_id(self) -> str:
        """The id without the world size: what estimate and predict call a configuration."""
        return self.cell_id.config

    def config(self) -> dict[str, Any]:
        return {"engine": self.engine, "world_size": self.world_size, "dtype": self.dtype, **self.opts}
