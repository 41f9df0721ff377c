"""Checking predictions against what the run measured.

* :func:`write_validation`: each cell predicted on the link it ran on, against its own
  measurement (``simulate/measured-link/validation.md``).
* :func:`cross_validate`: each cell predicted from *another* cell's schedule of the same
  engine -- its knobs and link applied to the other's compute and unit sizes -- which is
  how the simulator is used: one profiled run, predictions for settings not run.

What a prediction is compared with: the cell's median step time (untraced steps), and
:func:`measured_exposed`.
"""

from __future__ import annotations

import math
from pathlib import Path

from zerobench.instruments.link import Link

from .model import simulate

#: The emulated link sets a collective's time only where it is slower than the real
#: transport under it; the validation bar applies where it is this many times slower.
MIN_MARGIN = 2.0
#: The validation bars: step time within 15 %, exposed communication within 20 %.
STEP_BAR, EXPOSED_BAR = 0.15, 0.20


def relative_error(pred: float, meas) -> float:
    return (pred - meas) / meas if meas else math.nan


def compare(r, m: dict) -> dict:
    """A prediction ``r`` (a SimResult) against a cell's measurement ``m``: the measured
    step and exposed communication, the errors, and the no-overlap reference (compute
    plus every collective in turn, what a model without schedule rules would say)."""
    step, exposed, flat = m.get("step_time_s"), measured_exposed(m), r.compute_s + r.comm_s
    return {"measured_step_s": step, "step_error": relative_error(r.step_time_s, step),
            "measured_exposed_comm_s": exposed, "exposed_error": relative_error(r.exposed_comm_s, exposed),
            "no_overlap_step_s": flat, "no_overlap_error": relative_error(flat, step)}


def measured_exposed(m: dict):
    """The measurement the model's exposed communication is validated against: on CPU
    the time the main thread was blocked on communication in the traced steps
    (``blocked_comm_s``; the model's compute is the thread's busy time, so what it does
    not hide is what the thread waits for), on GPU HTA's exposed communication."""
    v = m.get("blocked_comm_s")
    return v if v is not None and v == v else m.get("exposed_comm_s")


def emulation_margin(s, link: Link) -> float:
    """How many times longer the emulated ``link`` takes than the real transport under
    it (``measured["transport_s"]``, median per kind), for a unit's collective; the
    smallest over the kinds the cell ran. Below about 2 the cell's time is set by the
    transport (gloo on shared cores), which the link model does not describe. NaN
    without transport measurements."""
    transport = s.measured.get("transport_s") or {}
    nbytes = sorted(u.param_bytes for u in s.units)[len(s.units) // 2]
    ratios = [link.duration_s(k, nbytes, s.world_size) / t for k, t in transport.items()
              if k in ("all_gather", "reduce_scatter", "all_reduce") and t > 0]
    return min(ratios) if ratios else math.nan


def write_validation(pred, path: Path) -> None:
    """Markdown table: prediction, measurement and error per cell, and the summary."""
    from zerobench.runs.files import write_atomic

    lines = ["| cell | link / transport | step predicted (ms) | step measured (ms) | error | no overlap (ms) "
             "| error | exposed predicted (ms) | exposed measured (ms) | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ms = lambda v: "n/a" if v is None or v != v else f"{v * 1e3:.1f}"  # noqa: E731
    pct = lambda v: "n/a" if v is None or v != v else f"{v:+.1%}"  # noqa: E731
    for r in pred.itertuples():
        margin = getattr(r, "emulation_margin", math.nan)
        lines.append(f"| {r.cell_id} | {'n/a' if margin != margin else f'{margin:.1f}x'} "
                     f"| {ms(r.step_time_s)} | {ms(r.measured_step_s)} | {pct(r.step_error)} "
                     f"| {ms(r.no_overlap_step_s)} | {pct(r.no_overlap_error)} "
                     f"| {ms(r.exposed_comm_s)} | {ms(r.measured_exposed_comm_s)} | {pct(r.exposed_error)} |")
    lines += ["", *validation_summary(pred)]
    text = "\n".join(lines) + "\n"
    write_atomic(path, lambda f: f.write(text))


def _summary_line(what: str, pred, step_bar: float, exposed_bar: float) -> str:
    step, exp, flat = pred["step_error"].abs(), pred["exposed_error"].abs(), pred["no_overlap_error"].abs()
    return (f"{what}: step time within {step_bar:.0%}: {int((step <= step_bar).sum())} of {len(pred)} "
            f"(median |error| {step.median():.1%}, worst {step.max():.1%}); exposed communication within "
            f"{exposed_bar:.0%}: {int((exp <= exposed_bar).sum())} of {int(exp.notna().sum())} "
            f"(median |error| {exp.median():.1%}, worst {exp.max():.1%}); the no-overlap reference (compute + "
            f"every collective in turn): step time within {step_bar:.0%} in {int((flat <= step_bar).sum())} "
            f"(median |error| {flat.median():.1%}, worst {flat.max():.1%})")


def validation_summary(pred, step_bar: float = STEP_BAR, exposed_bar: float = EXPOSED_BAR) -> list[str]:
    """How many cells are within the bars, with the median and worst errors: all cells,
    then those where the emulated link is at least ``MIN_MARGIN`` times slower than the
    transport (:func:`emulation_margin`), where the bars apply."""
    lines = [_summary_line("all cells", pred, step_bar, exposed_bar)]
    if "emulation_margin" in pred and pred["emulation_margin"].notna().any():
        inside = pred[pred["emulation_margin"] >= MIN_MARGIN]
        what = f"cells whose emulated link is >= {MIN_MARGIN:g}x the transport"
        lines.append(_summary_line(what, inside, step_bar, exposed_bar) if len(inside) else f"{what}: none")
    return lines


def measured_link(s):
    """The emulated link the schedule's cell ran on, or None."""
    g = s.source.get("emulate_gbps")
    if not g or (isinstance(g, float) and math.isnan(g)):  # 0.0: the cell ran without emulation
        return None
    lat = s.source.get("emulate_latency_us") or 0.0
    return Link(float(g), 0.0 if isinstance(lat, float) and math.isnan(lat) else float(lat))


def cross_validate(schedules: dict, out: Path):
    """Predict every cell from every other cell of the same engine and world size (the
    other's schedule, this cell's knobs and emulated link); write ``cross.csv`` (one row
    per source -> target) and ``cross.md`` (per engine: pairs within the bars, median and
    worst errors). Returns the rows as a DataFrame."""
    import dataclasses

    import pandas as pd

    from zerobench.runs.files import write_atomic, write_csv_atomic

    rows = []
    for dst_id, dst in schedules.items():
        link = measured_link(dst)
        m = dst.measured
        if link is None or not m.get("step_time_s"):
            continue
        for src_id, src in schedules.items():
            if src_id == dst_id or src.engine != dst.engine or src.world_size != dst.world_size:
                continue
            variant = src.with_knobs(**dataclasses.asdict(dst.knobs))
            r = simulate(variant, link)
            rows.append({"engine": dst.engine, "source": src_id, "target": dst_id, "gbps": link.bandwidth_gbps,
                         "source_gbps": (measured_link(src) or link).bandwidth_gbps,
                         "step_time_s": r.step_time_s, "exposed_comm_s": r.exposed_comm_s, **compare(r, m),
                         "emulation_margin": emulation_margin(dst, link)})
    df = pd.DataFrame(rows)
    out.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out / "cross.csv", df)
    lines = ["Each cell predicted from every other cell of its engine (the other's schedule, this cell's "
             f"knobs and link). In range: the target's emulated link is >= {MIN_MARGIN:g}x the transport.", "",
             f"| engine | targets | pairs | step within {STEP_BAR:.0%} | median / worst step error "
             f"| exposed within {EXPOSED_BAR:.0%} | median / worst exposed error "
             f"| no-overlap reference: within {STEP_BAR:.0%} |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for engine, g in (df.groupby("engine", sort=False) if len(df) else []):
        for which, sub in (("all", g), ("in range", g[g["emulation_margin"] >= MIN_MARGIN])):
            if not len(sub):
                continue
            st, ex, fl = sub["step_error"].abs(), sub["exposed_error"].abs(), sub["no_overlap_error"].abs()
            lines.append(f"| {engine} | {which} | {len(sub)} | {int((st <= STEP_BAR).sum())} "
                         f"| {st.median():.1%} / {st.max():.1%} | {int((ex <= EXPOSED_BAR).sum())} "
                         f"| {ex.median():.1%} / {ex.max():.1%} | {int((fl <= STEP_BAR).sum())} |")
    text = "\n".join(lines) + "\n"
    write_atomic(out / "cross.md", lambda f: f.write(text))
    return df
