"""Expanding a workload's matrix into cells.

Common axes (engine, world_size, dtype) multiply every engine. Engine-specific axes
(sharding_strategy, backward_prefetch, ...) multiply only the engines that declare
them, so ``ddp`` is not run once per sharding strategy. An axis value that no engine
of the matrix allows is an error (a typo); a value that some engines allow and
others do not gives a *skipped* cell for the others, with the reason recorded.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from zerobench.choices import not_allowed, unknown_key
from zerobench.engines import ENGINES, get_engine
from zerobench.engines.base import Axis
from zerobench.spec.axes import COMMON_AXES, engine_axes
from zerobench.spec.cell import Cell, CellId
from zerobench.spec.workload import Workload, WorkloadError


def _pin_inapplicable(axes: dict[str, Axis], values: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Set axes whose ``applies_when`` condition does not hold to their defaults."""
    chosen = dict(values)
    out = []
    for name, value in values:
        if not axes[name].applies(chosen):
            value = axes[name].default
        out.append((name, value))
    return out


def expand(workload: Workload, device_type: str = "cpu") -> list[Cell]:
    """The cells of the workload's matrix, in a stable order, unsupported ones marked.
    WorkloadError, naming the workload's file, for an engine, axis or value that none allows."""
    try:
        return _expand(workload, device_type)
    except WorkloadError as err:
        raise WorkloadError(_in_file(workload, str(err))) from None


def _in_file(workload: Workload, message: str) -> str:
    """``message`` prefixed with the workload's file and overrides, as parse_workload's errors are."""
    label = workload.label
    return message if message.startswith(f"{label}: ") else f"{label}: {message}"


def _check_engines(workload: Workload) -> None:
    for engine in workload.matrix["engine"]:
        if engine not in ENGINES:
            raise WorkloadError(_in_file(workload, not_allowed("matrix.engine", engine, ENGINES)))


def _expand(workload: Workload, device_type: str) -> list[Cell]:
    matrix = workload.matrix
    _check_engines(workload)
    axes_by_engine = {e: engine_axes(e) for e in matrix["engine"]}

    # Every extra axis must belong to some engine of this matrix (an axis of none is a typo;
    # one of other engines only is refused naming them: [Note: narrowing the engines] in
    # zerobench/spec/workload.py). Each value must be allowed by at least one engine of the
    # matrix that has the axis.
    check_axes(workload)
    for axis, values in matrix.items():
        if axis in COMMON_AXES:
            continue
        owners = [e for e, axes in axes_by_engine.items() if axis in axes]
        for value in values:
            errors = []
            for e in owners:
                try:
                    axes_by_engine[e][axis].check(f"matrix.{axis}", value)
                except ValueError as err:
                    errors.append(str(err))
            if len(errors) == len(owners):
                choices = [c for e in owners for c in (axes_by_engine[e][axis].choices or ())]
                if choices:  # a typo of one of them: say which
                    raise WorkloadError(not_allowed(f"matrix.{axis}", value, dict.fromkeys(choices)))
                raise WorkloadError(errors[0])

    cells: list[Cell] = []
    seen: set[Cell] = set()
    for engine in matrix["engine"]:
        cls = get_engine(engine)
        axes = axes_by_engine[engine]
        names = list(axes)
        choices = [matrix.get(n, [axes[n].default]) for n in names]  # dropped axes belong to no engine here
        for ws, dtype in itertools.product(matrix["world_size"], matrix["dtype"]):
            for combo in itertools.product(*choices):
                reason = None
                values = []
                for n, v in zip(names, combo):
                    try:
                        values.append((n, axes[n].check(n, v)))
                    except ValueError as err:
                        reason = f"{engine}: {err}"
                        values.append((n, v))
                values = _pin_inapplicable(axes, values)
                cell = Cell(engine, ws, dtype, tuple(values))
                if reason is None:
                    reason = cls.unsupported(cell.opts, dtype, ws, device_type)
                note = cls.notes(cell.opts, dtype, ws, device_type, workload.optimizer) if reason is None else None
                if cell in seen:
                    continue
                seen.add(cell)
                cells.append(Cell(engine, ws, dtype, tuple(values), skip_reason=reason, note=note))
    return cells


def _owners(axis: str, engines) -> list[str]:
    return [e for e in engines if axis in engine_axes(e)]


def check_axes(workload: Workload) -> None:
    """WorkloadError for an unknown engine, an axis of no engine at all (a typo: the axes
    there are), or an axis that no engine of matrix.engine takes (the engines that do)."""
    matrix = workload.matrix
    _check_engines(workload)
    chosen = list(matrix["engine"])
    for axis in matrix:
        if axis in COMMON_AXES or _owners(axis, chosen):
            continue
        owners = _owners(axis, ENGINES)
        if not owners:
            known = sorted({*COMMON_AXES, *(a for e in ENGINES for a in engine_axes(e))})
            raise WorkloadError(_in_file(workload, unknown_key(f"matrix.{axis}", known, "matrix",
                                                               note="`zerobench engines` lists each engine's axes")))
        raise WorkloadError(_in_file(workload, (
            f"matrix.{axis}: no engine of matrix.engine ({', '.join(chosen)}) takes it (allowed: the axes of "
            f"{', '.join(chosen)}; {axis} is {', '.join(owners)}'s: add one of them to matrix.engine, or remove "
            f"the axis)")))


def matrix_notes(workload: Workload) -> list[str]:
    """One line per axis the workload dropped as it was loaded ([Note: narrowing the
    engines] in zerobench/spec/workload.py), saying which engines it belongs to."""
    from zerobench.spec.axes import owners

    m = workload.matrix
    chosen = ", ".join(m["engine"])
    notes = [f"matrix.{axis} dropped: no engine of matrix.engine ({chosen}) has it "
             f"(it is {', '.join(owners(axis))}'s)" for axis in workload.dropped_axes]
    if workload.no_matrix:
        notes.append(f"no [matrix] table: runs the default matrix, engine {chosen} at world size "
                     f"{', '.join(map(str, m['world_size']))} in {', '.join(m['dtype'])} (add a [matrix] table "
                     f"to choose engines and axes: `zerobench engines` lists them)")
    return notes


def find_cell(workload: Workload, cell_id: str, device_type: str = "cpu") -> Cell | None:
    """The cell ``cell_id`` of the workload, expanding only its own engine's part of the
    matrix: a rank imports one engine adapter, not every engine the matrix names."""
    parsed = CellId.try_parse(cell_id)
    if parsed is None or parsed.world_size is None or parsed.engine not in workload.matrix["engine"]:
        return None
    engine = parsed.engine
    axes = engine_axes(engine)
    matrix = {k: v for k, v in workload.matrix.items() if k in COMMON_AXES}
    for name, values in workload.matrix.items():
        if name in axes:  # values this engine refuses only ever make skipped cells
            allowed = [v for v in values if _allows(axes[name], name, v)]
            matrix[name] = allowed or [axes[name].default]
    matrix["engine"] = [engine]
    own = dataclasses.replace(workload, matrix=matrix)
    return next((c for c in expand(own, device_type) if c.id == cell_id), None)


def _allows(axis: Axis, name: str, value: Any) -> bool:
    try:
        axis.check(name, value)
        return True
    except ValueError:
        return False
