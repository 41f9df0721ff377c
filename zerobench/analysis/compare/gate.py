"""Compare two runs cell by cell and decide whether the new one regressed: the CI gate.

``zerobench compare BASELINE RUN`` lines up the cells of two run folders by their
configuration (``cell_id``, derived from engine + axes), and reports for each metric
the baseline, the new value, the change, the allowed change and a verdict. The
functions here return DataFrames, so a notebook can call them directly; rendering
(terminal table, Markdown, plot) lives in :mod:`zerobench.analysis.compare.report`.

Exit codes of the CLI: 0 within bounds, 1 on a gated regression, 2 on unusable input
(a run folder that cannot be read, cells present in one run only, a cell whose
configuration differs under the same id, a gated metric that disappeared). 2 wins over
1: a comparison with holes in it is not a pass.

[Note: compare rules]
Each metric has a kind in :mod:`zerobench.schema.columns`:

* ``deterministic`` (tracker memory, communication bytes, losses): the same on every run
  on the same machine and software, so compared within a tight tolerance: relative
  1e-6 of the baseline, absolute 1e-6 for losses. Losses (``better="none"``) fail on a
  change in either direction; the others only when worse.
* ``time``: noisy, so compared on medians with a spread-aware rule, as in
  pyperf / asv: a regression only when the new value is worse by more than the
  tolerance (+10% by default) *and* by more than ``k`` (3) times the baseline's spread.
  The spread is the median absolute deviation (MAD, unscaled) of the baseline's
  measured step times (``steps.csv``; else the ``step_time_mad_s`` column), taken
  relative to their median and applied to each time metric: ``k * MAD / median * |baseline|``.
  For the median step time that is exactly ``k * MAD``.
* ``context``: reported, never gated unless a ``--fail-on`` rule names it.

Which default rules gate is chosen by ``gate``: ``deterministic`` (the default: time is
reported, not gated, because shared CI runners are noisy), ``all``, or ``none``. A
``--fail-on`` rule always gates the metrics it names, replacing their default rule.
Status always gates: a cell that was ok in the baseline and failed in the new run is a
regression.

[Note: aggregating ranks]
By default a cell is compared as a whole: time metrics take the median over ranks
(ranks of a synchronous data-parallel step take the same time), metrics where lower is
better take the worst (max) rank -- peak memory is the memory of the largest rank --
and higher-is-better the min; losses (``better="none"``) take the mean over ranks, so
that a change on any one rank shows. ``per_rank=True`` compares rank by rank instead.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import pandas as pd

from zerobench.analysis.compare.rules import (
    DEFAULT_DET_REL,
    DEFAULT_LOSS_ABS,
    DEFAULT_TIME_K,
    DEFAULT_TIME_REL,
    GATES,
    Rule,
    default_rule,
    is_timelike,
    metric_info,
    parse_rules,
)
from zerobench.analysis.compare.whatif import TABLES, read_whatif, whatif_tool
from zerobench.choices import did_you_mean
from zerobench.runs.folder import DamagedFile, RunFolder, RunFolderError
from zerobench.schema.columns import CONTEXT_COLUMNS, ID_COLUMNS, MEMORY_PASS_ATTEMPTS, METRIC_BY_NAME

__all__ = ["RunLoadError", "RunTables", "load_run", "same_tool", "select_cells", "Rule", "parse_rules", "default_rule",
           "cell_table", "baseline_spread", "compare_runs", "hardware_differences", "config_mismatches", "exit_code", "CELL_ROW",
           "DEFAULT_DET_REL", "DEFAULT_LOSS_ABS", "DEFAULT_TIME_K", "DEFAULT_TIME_REL"]

Gate = Literal["all", "deterministic", "none"]
VERDICTS = ("ok", "regression", "improved", "missing", "new")

#: The metric name used for rows about a whole cell (its presence and status).
CELL_ROW = "status"



# --------------------------------------------------------------------------- loading


class RunLoadError(ValueError):
    """A run folder that cannot be compared: missing files, columns or duplicate rows."""


@dataclass
class RunTables:
    """One run folder, read: the tables compare needs and where they came from."""

    path: Path
    results: pd.DataFrame
    """results.csv: one row per cell x rank."""
    steps: pd.DataFrame | None
    """steps.csv: one row per cell x rank x measured step; None when absent."""
    meta: dict = field(default_factory=dict)
    """meta.json; empty when absent."""
    metric_columns: tuple[str, ...] = ()
    """Numeric metric columns present: schema metrics, then extra engine metrics."""
    config_columns: tuple[str, ...] = ()
    """Columns that identify a cell's configuration: engine, world_size, dtype, axes."""
    tool: str = "run"
    """What made the folder: run, predict or estimate ([Note: comparing what-if folders])."""


def load_run(path: str | Path) -> RunTables:
    """Read ``results/<run-id>/`` (or a results.csv inside one) through
    :class:`zerobench.runs.folder.RunFolder`: the tables are built from cells/ in memory
    when they are missing or stale (cells run under torchrun); nothing is written. A
    predict or estimate folder is read as one too ([Note: comparing what-if folders] in
    zerobench/analysis/compare/whatif.py). Raises RunLoadError."""
    tool = whatif_tool(path)
    if tool is not None:
        try:
            root, results = read_whatif(path, tool)
        except ValueError as e:
            raise RunLoadError(str(e)) from e
        results = _normalised(results, root / TABLES[tool])
        metrics, config = _classify_columns(results, tool)
        return RunTables(root, results, None, {}, metrics, config, tool)
    folder = RunFolder(path)
    results_csv = folder.results_path
    try:
        results = folder.results()
    except RunFolderError:
        raise RunLoadError(f"{folder.root}: no results.csv (is this a run folder?)") from None
    except DamagedFile as e:
        raise RunLoadError(str(e)) from e
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunLoadError(f"{results_csv}: unreadable: {e}") from e
    results = _normalised(results, results_csv)

    steps = folder.steps()
    if steps is not None:
        if not {"cell_id", "rank", "step_time_s"} <= set(steps.columns):
            raise RunLoadError(f"{folder.steps_path}: needs columns cell_id, rank, step_time_s")
        steps["cell_id"] = steps["cell_id"].astype(str)
    try:
        meta = folder.meta()
    except DamagedFile as e:
        raise RunLoadError(str(e)) from e
    metrics, config = _classify_columns(results)
    return RunTables(folder.root, results, steps, meta, metrics, config)


def _normalised(results: pd.DataFrame, source: Path) -> pd.DataFrame:
    """The id columns typed as the judging needs them, and no two rows of one cell and rank."""
    missing = [c for c in ("cell_id", "rank", "status") if c not in results.columns]
    if missing:
        raise RunLoadError(f"{source}: missing column(s) {', '.join(missing)}")
    # an all-empty column reads as float64 ([Note: types in results.csv]): text first, then fill
    results["status"] = results["status"].astype(object).fillna("").astype(str)
    results["error"] = results["error"].astype(object).fillna("").astype(str) if "error" in results else ""
    results["cell_id"] = results["cell_id"].astype(str)
    results["rank"] = pd.to_numeric(results["rank"], errors="coerce").astype("Int64")
    for c in results.columns:  # the judging works on floats (NaN for missing), not nullable integers
        if c in METRIC_BY_NAME and isinstance(results[c].dtype, pd.Int64Dtype):
            results[c] = results[c].astype("float64")
    dup = results.duplicated(["cell_id", "rank"], keep=False)
    if dup.any():
        keys = sorted({f"{c}/rank{r}" for c, r in results.loc[dup, ["cell_id", "rank"]].itertuples(index=False)})
        raise RunLoadError(f"{source}: duplicate rows for {', '.join(keys[:10])}")
    return results


def _classify_columns(results: pd.DataFrame, tool: str = "run") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split the columns into metrics and configuration.

    Schema metrics are known by name. Other columns are engine axes (configuration),
    except numeric ones named with a unit suffix (``_s``, ``_bytes``, ``_pct``,
    ``_calls``, ``_count``: e.g. ``limiter_stall_s``), which are extra engine metrics,
    reported as context. No axis is named that way (emulate_* axes aside). In a what-if
    folder the presets and versions are configuration too, ``backend`` included.
    """
    known = set(ID_COLUMNS) | (set(CONTEXT_COLUMNS) if tool == "run" else set())
    metrics = [c for c in results.columns if c in METRIC_BY_NAME]
    config = ["engine", "world_size", "dtype"]
    for c in results.columns:
        if c in known or c in METRIC_BY_NAME:
            continue
        if (c.endswith(_EXTRA_METRIC_SUFFIXES) and not c.startswith("emulate_")
                and pd.api.types.is_numeric_dtype(results[c])):
            metrics.append(c)
        else:
            config.append(c)
    return tuple(metrics), tuple(c for c in config if c in results.columns)


_EXTRA_METRIC_SUFFIXES = ("_s", "_bytes", "_pct", "_calls", "_count")


def select_cells(run: RunTables, patterns: Sequence[str]) -> RunTables:
    """The run with only the cells whose id matches one of ``patterns`` (an id or a glob;
    comma-separated lists allowed). Raises ValueError naming a pattern that matches none
    of the run's cells, and the cell ids there are. Used on the baseline and the new run
    alike (``--cells``): the baseline's other cells are then not missing."""
    wanted = [p.strip() for text in patterns for p in str(text).split(",") if p.strip()]
    ids = sorted(set(run.results["cell_id"]))
    keep: set[str] = set()
    for pattern in wanted:
        hits = fnmatch.filter(ids, pattern)
        if not hits:
            raise ValueError(f"--cells: {pattern!r} matches no cell of {run.path}{did_you_mean(pattern, ids, show=str)} "
                             f"(cells: {', '.join(ids)})")
        keep.update(hits)
    results = run.results[run.results["cell_id"].isin(keep)].reset_index(drop=True)
    steps = None if run.steps is None else run.steps[run.steps["cell_id"].isin(keep)].reset_index(drop=True)
    return dataclasses.replace(run, results=results, steps=steps)


# --------------------------------------------------------------------------- comparing


_STATUS_ORDER = {"ok": 0, "skipped": 1, "failed": 2}


def cell_table(run: RunTables, per_rank: bool = False) -> pd.DataFrame:
    """One row per cell (or cell x rank): status, first error, metrics aggregated over ranks.

    See [Note: aggregating ranks].
    """
    df = run.results
    keys = ["cell_id", "rank"] if per_rank else ["cell_id"]
    g = df.groupby(keys, sort=True, dropna=False)
    out = pd.DataFrame({
        "status": g["status"].agg(lambda s: max(s, key=lambda v: _STATUS_ORDER.get(v, 3))),
        "error": g["error"].agg(lambda s: next((e for e in s if e), "")),
    })
    for name in run.metric_columns:
        kind, better, _ = metric_info(name, run.tool)
        values = pd.to_numeric(df[name], errors="coerce")
        if kind == "time":
            how = "median"
        elif better == "higher":
            how = "min"
        elif better == "none" and name.startswith("loss"):
            how = "mean"
        else:
            how = "max"
        out[name] = values.groupby([df[k] for k in keys], sort=True, dropna=False).agg(how)
    return out


def baseline_spread(run: RunTables, per_rank: bool = False) -> pd.Series:
    """Relative spread of the step times per cell (or cell x rank): MAD / median.

    From steps.csv when present, else from the step_time_mad_s and step_time_s
    columns. A cell's spread is the median of its ranks' spreads.
    """
    if run.steps is not None and len(run.steps):
        keys = [run.steps["cell_id"], run.steps["rank"]]
        times = pd.to_numeric(run.steps["step_time_s"], errors="coerce")
        g = times.groupby(keys)
        deviation = (times - g.transform("median")).abs()
        rel = deviation.groupby(keys).median() / g.median()
    elif {"step_time_mad_s", "step_time_s"} <= set(run.results.columns):
        r = run.results.set_index(["cell_id", "rank"])
        rel = pd.to_numeric(r["step_time_mad_s"], errors="coerce") / pd.to_numeric(r["step_time_s"], errors="coerce")
    else:
        return pd.Series(dtype=float)
    return rel if per_rank else rel.groupby(level="cell_id").median()


def _is_gated(name: str, explicit: bool, gate: str, report_only: set[str], tool: str = "run") -> bool:
    if explicit:
        return True
    if name in report_only:
        return False
    kind = metric_info(name, tool)[0]
    return (gate == "all" and kind in ("time", "deterministic")) or (gate == "deterministic" and kind == "deterministic")


def compare_runs(baseline: RunTables, new: RunTables, rules: Sequence[Rule] = (),
                 gate: Gate = "deterministic", per_rank: bool = False,
                 report_only: Sequence[str] = ()) -> pd.DataFrame:
    """Line up the two runs' cells and judge every metric. See [Note: compare rules].

    Returns one row per cell (x rank) x metric with columns cell_id, rank (NA when
    aggregated), metric, kind, baseline, new, change, change_pct, limit (the allowed
    worsening, in the metric's unit), limit_pct, allowed_change and allowed_change_pct
    (the bound on the change in the change's own direction: [Note: allowed change]),
    spread (k x MAD used, time metrics), rule, gated, verdict, note. Rows with metric ``status`` speak for a whole cell: its
    presence in both runs and its status. ``report_only`` names metric columns that are
    judged and shown but not gated by ``gate``'s defaults (a rule naming one still gates it).
    """
    if gate not in GATES:
        raise ValueError(f"gate: {gate!r} is not allowed (allowed: {', '.join(GATES)})")
    tool = same_tool(baseline, new)
    explicit: dict[str, Rule] = {}
    for rule in rules:  # later rules win
        explicit.update({m: rule for m in rule.metrics})
    # plain dicts: per-value DataFrame.loc is the slow part on a large matrix
    base = cell_table(baseline, per_rank).to_dict("index")
    cur = cell_table(new, per_rank).to_dict("index")
    spread = baseline_spread(baseline, per_rank).to_dict()
    dtypes = _cell_dtypes(new)
    cross_machine = bool(hardware_differences(baseline.meta, new.meta))
    metrics = list(dict.fromkeys([*baseline.metric_columns, *new.metric_columns]))
    nan = float("nan")
    rows: list[dict] = []
    for key in sorted(set(base) | set(cur), key=str):
        cell_id, rank = (key if per_rank else (key, pd.NA))
        ident = {"cell_id": cell_id, "rank": rank}
        b_cell, n_cell = base.get(key), cur.get(key)
        row = _status_row(b_cell, n_cell)
        rows.append({**ident, "metric": CELL_ROW, "kind": "status", "gated": True, **row})
        if row["verdict"] in ("missing", "new") or b_cell["status"] != "ok" or n_cell["status"] != "ok":
            continue
        doubt = _peak_in_doubt(b_cell, n_cell)
        for name in metrics:
            b, n = float(b_cell.get(name, nan)), float(n_cell.get(name, nan))
            if math.isnan(b) and math.isnan(n):
                continue  # not measured in either run (cuda_* on CPU, tokens for non-GPT models)
            rule = explicit.get(name) or default_rule(name, dtypes.get(cell_id, "fp32"), cross_machine,
                                                      _loss_scale(n_cell), tool)
            rel_spread = spread.get(key, nan) if is_timelike(name, tool) else nan
            judged = _judge(name, b, n, rule, rel_spread, name in explicit, tool)
            gated = rule.gates and _is_gated(name, name in explicit, gate, set(report_only), tool)
            if doubt and name.startswith("peak_mem") and name not in explicit:
                gated, judged["note"] = False, " ".join(filter(None, (judged["note"], doubt)))
            rows.append({**ident, "metric": name, **judged, "gated": gated})
    cols = ["cell_id", "rank", "metric", "kind", "baseline", "new", "change", "change_pct", "limit",
            "limit_pct", "allowed_change", "allowed_change_pct", "spread", "rule", "gated", "verdict", "note"]
    out = pd.DataFrame(rows, columns=cols)
    out["rank"] = out["rank"].astype("Int64")
    for c in ("baseline", "new", "change", "change_pct", "limit", "limit_pct", "allowed_change", "allowed_change_pct",
              "spread"):
        out[c] = out[c].astype(float)
    out["gated"] = out["gated"].astype(bool)
    return out


def _peak_in_doubt(b: dict, n: dict) -> str:
    """Why a cell's tracker peaks are not gated ("" when they are): a memory pass that found
    no step whose peak was exact on every rank (``memory_steps`` above
    MEMORY_PASS_ATTEMPTS) measured an upper bound, which a storage freed late on gloo's
    thread may have raised ([Note: frees on other threads] in
    zerobench/instruments/memory.py). A rule that names the metric still gates it."""
    which = [side for side, cell in (("baseline", b), ("new run", n))
             if float(cell.get("memory_steps", float("nan")) or 0) > MEMORY_PASS_ATTEMPTS]
    if not which:
        return ""
    return (f"not gated: no exact peak in the {' and '.join(which)} (memory_steps > {MEMORY_PASS_ATTEMPTS}; "
            "a late free on gloo's thread may be counted)")


def _status_row(b: dict | None, n: dict | None) -> dict:
    """Verdict on a cell's presence and status in the two runs."""
    if b is None:
        return {"verdict": "new", "note": f"only in the new run (status {n['status']})"}
    if n is None:
        return {"verdict": "missing", "note": f"in the baseline (status {b['status']}) but not in the new run"}
    bs, ns = b["status"], n["status"]
    error = " ".join(str(n["error"]).split())[:200]  # one line: tracebacks end up in tables
    note = f"{bs} -> {ns}" + (f": {error}" if error else "")
    if bs == ns:
        verdict, note = "ok", (bs if bs == "ok" else f"{bs} in both runs")
    elif ns == "failed":
        verdict = "regression"
    elif bs == "ok":  # ok -> skipped: nothing to compare against the baseline
        verdict = "missing"
    elif ns == "ok" and bs == "skipped":
        verdict = "new"
    else:  # failed -> ok, failed -> skipped
        verdict = "improved" if ns == "ok" else "ok"
    return {"verdict": verdict, "note": note}


def same_tool(baseline: RunTables, new: RunTables) -> str:
    """The tool both folders come from; a ValueError when they differ (a run is not a prediction)."""
    if baseline.tool != new.tool:
        raise ValueError(f"{baseline.path} is a {baseline.tool} folder and {new.path} a {new.tool} folder: "
                         f"compare two folders of one kind (run, predict or estimate)")
    return new.tool


def _judge(name: str, b: float, n: float, rule: Rule, rel_spread: float, explicit: bool, tool: str = "run") -> dict:
    kind, better, _ = metric_info(name, tool)
    out = {"kind": kind, "baseline": b, "new": n, "rule": rule.text or str(rule.metrics), "note": ""}
    if math.isnan(n):
        return {**out, "verdict": "missing", "note": "measured in the baseline, not in the new run"}
    if math.isnan(b):
        return {**out, "verdict": "new", "note": "not measured in the baseline"}
    change = n - b
    pct = 100 * change / abs(b) if b != 0 else (0.0 if change == 0 else math.copysign(math.inf, change))
    if rule.ceiling is not None:  # judged against an absolute bound, not the baseline
        verdict = "regression" if n > rule.ceiling else "ok"
        limit = rule.ceiling - b
        return {**out, "change": change, "change_pct": pct, "limit": limit,
                "limit_pct": 100 * limit / abs(b) if b != 0 else math.inf,
                **_allowed_change(change, limit, b, "lower", one_sided=True), "spread": float("nan"),
                "verdict": verdict, "note": f"ceiling {rule.ceiling:.3g}, from the dtype's precision"}
    if not rule.gates:
        return {**out, "change": change, "change_pct": pct, "limit": float("nan"), "limit_pct": float("nan"),
                **_allowed_change(change, float("nan"), b, better), "spread": float("nan"), "verdict": "ok",
                "note": rule.text}
    spread = rel_spread * abs(b) if rule.k is not None else float("nan")
    limit = rule.allowed(b, spread)
    if better == "none" and name.startswith("loss"):
        worse = abs(change)  # a loss that moves either way means the numerics changed
    else:
        worse = -change if better == "higher" else change
    if worse > limit:
        verdict = "regression"
    elif -worse > limit and better != "none":
        verdict = "improved"
    else:
        verdict = "ok"
    if kind == "context" and not explicit:
        verdict, limit = "ok", float("nan")  # context metrics are reported, not judged, unless a rule names them
    tol = max(rule.rel * abs(b), rule.abs)
    note = ""
    if rule.k is not None and not math.isnan(spread) and tol < worse <= limit and verdict == "ok":
        note = f"worse than the tolerance but within {rule.k:g} x MAD of the baseline"
    elif rule.k is not None and math.isnan(spread):
        note = "no baseline spread (steps.csv or step_time_mad_s): tolerance only"
    limit_pct = 100 * limit / abs(b) if b != 0 else (limit if limit == 0 or math.isnan(limit) else math.inf)
    return {**out, "change": change, "change_pct": pct, "limit": limit, "limit_pct": limit_pct,
            **_allowed_change(change, limit, b, better), "spread": rule.k * spread if rule.k is not None else float("nan"),
            "verdict": verdict, "note": note}


# [Note: allowed change]
# ``limit`` is how much *worse* a metric may get: a band of +-limit around the baseline
# (a change beyond it the other way is "improved"), or, under a ceiling rule, a bound on
# a rise alone. A report that printed it as "+limit" beside every change read wrong for
# half of them: a throughput that fell 80% beside "allowed +498" (the fall is the
# worsening there), a step time that fell beside a bound on rises. So every rendering
# (console, Markdown, JUnit, the plot) shows ``allowed_change``: the bound on the change
# in the change's own direction, signed like it -- a fall is bounded by -limit, a rise by
# +limit -- and, with no change, in the direction that would be worse. A direction
# without a bound (a fall under a ceiling rule) has none (NaN).


def _allowed_change(change: float, limit: float, baseline: float, better: str, one_sided: bool = False) -> dict:
    """allowed_change and allowed_change_pct of one row. See [Note: allowed change]."""
    if math.isnan(limit) or math.isnan(change):
        allowed = float("nan")
    else:
        if change != 0:
            direction = math.copysign(1.0, change)
        else:  # no change: the direction that would be worse
            direction = -1.0 if better == "higher" else 1.0
        if one_sided:  # a ceiling bounds a rise only
            allowed = limit if direction > 0 else float("nan")
        else:
            allowed = direction * abs(limit)
    if math.isnan(allowed):
        pct = float("nan")
    elif baseline != 0:
        pct = 100 * allowed / abs(baseline)
    else:
        pct = allowed if allowed == 0 else math.copysign(math.inf, allowed)
    return {"allowed_change": allowed, "allowed_change_pct": pct}


def config_mismatches(baseline: RunTables, new: RunTables) -> pd.DataFrame:
    """Configuration differences between cells with the same id, and between the runs.

    ``severity`` is ``identity`` for an engine / world_size / dtype / axis column (the
    two cells are not the same configuration: unusable input) and ``context`` for the
    workload's fixed columns and meta.json (reported, e.g. a different torch version).
    A what-if folder's presets and versions are identity ([Note: comparing what-if
    folders] in whatif.py).
    """
    rows = []
    b = baseline.results.drop_duplicates("cell_id").set_index("cell_id")
    n = new.results.drop_duplicates("cell_id").set_index("cell_id")
    columns = [(c, "identity") for c in dict.fromkeys([*baseline.config_columns, *new.config_columns])]
    if new.tool == "run":  # A different model is a different configuration under the same cell id.
        columns += [(c, "identity" if c in IDENTITY_CONTEXT else "context") for c in CONTEXT_COLUMNS]
    for cell_id in sorted(set(b.index) & set(n.index)):
        both_ok = b.loc[cell_id, "status"] == "ok" and n.loc[cell_id, "status"] == "ok"
        for col, severity in columns:
            if col in IDENTITY_CONTEXT and not (col in b.columns and col in n.columns):
                continue  # a run that does not record its model says nothing about it
            if severity == "context" and not both_ok:
                continue  # a failed cell records no backend / device: not a difference worth a line
            bv = _text(b.loc[cell_id, col]) if col in b.columns else ""
            nv = _text(n.loc[cell_id, col]) if col in n.columns else ""
            if bv != nv:
                if severity == "identity" and _axis_unrecorded_at_default(n.loc[cell_id, "engine"], col, bv, nv):
                    severity = "context"  # an axis added (or dropped) since: the same configuration
                rows.append({"cell_id": cell_id, "column": col, "baseline": bv, "new": nv, "severity": severity})
    for key in _META_KEYS:
        bv, nv = baseline.meta.get(key), new.meta.get(key)
        if bv is not None and nv is not None and bv != nv:
            rows.append({"cell_id": "(meta.json)", "column": key, "baseline": _text(bv), "new": _text(nv),
                         "severity": "context"})
    return pd.DataFrame(rows, columns=["cell_id", "column", "baseline", "new", "severity"])


def _axis_unrecorded_at_default(engine, column: str, baseline: str, new: str) -> bool:
    """Whether one run does not record an axis and the other has it at the engine's default.

    An engine that gains an axis keeps its cell ids (Cell.id names only non-default
    axes), so a baseline written before the axis existed still describes the same
    configuration: the axis was at what is now its default. The same holds the other
    way round for an axis a newer engine dropped. Any other value is a different cell.
    """
    if (baseline == "") == (new == ""):
        return False
    from zerobench.spec.axes import engine_axes  # imports the engines, hence torch: only when needed

    try:
        axis = engine_axes(str(engine)).get(column)
    except (KeyError, ValueError):
        return False  # an engine this version does not know: nothing to say what its default was
    return axis is not None and _text(axis.default) == (baseline or new)


#: Workload columns that identify the configuration as much as the axes do.
IDENTITY_CONTEXT = ("model",)

#: meta.json fields whose difference is worth a line (git_commit, date, hostname always differ).
_META_KEYS = ("torch_version", "python_version", "backend", "cpu_model", "cpu_count", "cpu_flags", "gpu_model",
              "gpu_count")

#: meta.json fields that say which hardware produced the numbers. See [Note: losses across machines].
HARDWARE_KEYS = ("cpu_model", "cpu_flags", "gpu_model")


def hardware_differences(baseline_meta: dict, new_meta: dict) -> list[str]:
    """Why two runs count as coming from different hardware (empty: same hardware).

    A field that one run records and the other does not (a baseline older than the
    field) counts as a difference: its numbers cannot be assumed reproducible. A field
    neither records says nothing. See [Note: losses across machines] in rules.py.
    """
    reasons = []
    for key in HARDWARE_KEYS:
        bv, nv = baseline_meta.get(key, _UNRECORDED), new_meta.get(key, _UNRECORDED)
        if bv is _UNRECORDED and nv is _UNRECORDED:
            continue
        if bv is _UNRECORDED or nv is _UNRECORDED:
            which = "baseline" if bv is _UNRECORDED else "run"
            reasons.append(f"{key} not recorded by the {which}")
        elif bv != nv:
            if isinstance(bv, list) and isinstance(nv, list):
                only_b, only_n = sorted(set(bv) - set(nv)), sorted(set(nv) - set(bv))
                reasons.append(f"{key}: baseline only {only_b or '[]'}, run only {only_n or '[]'}")
            else:
                reasons.append(f"{key}: {bv!r} vs {nv!r}")
    return reasons


_UNRECORDED = object()


def _loss_scale(cell: dict) -> float:
    """The magnitude of a cell's loss, which a loss bound is relative to."""
    values = [abs(float(cell.get(k, math.nan))) for k in ("loss_first", "loss_last")]
    values = [v for v in values if math.isfinite(v)]
    return max(values) if values else 1.0


def _cell_dtypes(run: RunTables) -> dict[str, str]:
    if "dtype" not in run.results:
        return {}
    first = run.results.drop_duplicates("cell_id").set_index("cell_id")["dtype"]
    return {c: str(d) for c, d in first.items() if isinstance(d, str)}


def _text(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return ""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def exit_code(comparison: pd.DataFrame, mismatches: pd.DataFrame | None = None) -> int:
    """2 on unusable input, else 1 on a gated regression, else 0. See the module docstring."""
    cells = comparison[comparison["metric"] == CELL_ROW]
    unusable = (
        cells.empty
        or cells["verdict"].isin(["missing", "new"]).any()
        or ((comparison["verdict"] == "missing") & comparison["gated"]).any()
        or (mismatches is not None and (mismatches["severity"] == "identity").any())
    )
    if unusable:
        return 2
    return 1 if ((comparison["verdict"] == "regression") & comparison["gated"]).any() else 0
