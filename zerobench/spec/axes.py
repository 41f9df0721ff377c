"""The axes of a cell: the three every engine has (``COMMON_AXES``), each engine's own
(``Engine.options``), activation checkpointing (every engine) and interconnect emulation
(every engine that supports it). ``engine_axes`` gathers them for one engine; the matrix
(matrix.py) multiplies them and a cell's id (cell.py) names those off their defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerobench.engines import get_engine
from zerobench.engines.options import OPTIONS, Axis
from zerobench.instruments.link import PRESETS

#: Axes the matrix offers to engines that support interconnect emulation (all of them):
#: a preset name (docs/link.md) or explicit numbers, which override the preset's.
EMULATION_AXES = {
    "emulate_link": Axis("", choices=("", *PRESETS), doc="emulated interconnect preset (docs/link.md; '': off)"),
    "emulate_gbps": Axis(0.0, type=float, minimum=0.0, doc="emulated bus bandwidth in GB/s (0: off)"),
    "emulate_latency_us": Axis(0.0, type=float, minimum=0.0, applies_when=("emulate_gbps", lambda gbps: bool(gbps)),
                               doc="emulated latency per collective in µs (with emulate_gbps > 0)"),
}
COMMON_AXES = ("engine", "world_size", "dtype")


@dataclass(frozen=True)
class CheckpointingAxis(Axis):
    """``activation_checkpointing``: "none", "full", "every:K" or "ops" (zerobench/spec/checkpointing.py)."""

    def allowed(self) -> str:
        return "'none', 'full', 'every:K' (K >= 1), 'ops'"

    def check(self, name: str, value: Any) -> Any:
        from zerobench.spec.checkpointing import parse_mode

        parse_mode(value, name)  # ValueError naming the axis and what it allows
        return value


#: Axes every engine has: activation checkpointing, applied to the model before the
#: engine wraps it, the same way for all of them.
MODEL_AXES = {
    "activation_checkpointing": CheckpointingAxis(
        "none", doc="none | full (every block) | every:K (every K-th block) | ops (every other matmul's and "
                    "attention's outputs kept, the rest recomputed); non-reentrant, applied before wrapping"),
}


def engine_axes(engine: str) -> dict[str, Axis]:
    cls = get_engine(engine)
    axes = dict(cls.options)
    axes.update(MODEL_AXES)
    if cls.supports_emulation:
        axes.update(EMULATION_AXES)
    return axes


def declared_axes(engine: str) -> set[str] | None:
    """The names of ``engine``'s axes, read from its options class without importing the
    engine (or torch); None for an engine the registry does not declare options for."""
    if engine not in OPTIONS:
        return None
    return {*OPTIONS[engine].axes(), *MODEL_AXES, *EMULATION_AXES}


def owners(axis: str) -> list[str]:
    """The engines that declare ``axis`` (torch-free, like :func:`declared_axes`)."""
    return [e for e in OPTIONS if axis in declared_axes(e)]
