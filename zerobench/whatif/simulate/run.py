"""Re-time a profiled run's cells with the simulator (``zerobench simulate RUN``;
the command line is zerobench/commands/simulate.py).

Writes into ``RUN/simulate/<what-if>/`` (``measured-link`` when nothing is changed,
else e.g. ``ib-400g_ws64_x20``): ``predictions.csv`` (one row per cell x world size:
predicted step time, exposed communication, overlap, link utilisation, unsharded
units and bytes; and, at the measured world size and link, the measurement and the
error), one Gantt per prediction, and with ``--matrix`` ``matrix.csv`` and a heatmap
per cell (knob setting x link bandwidth -> predicted step time).
"""

from __future__ import annotations

from pathlib import Path

from zerobench.instruments.link import PRESETS, Link

from .against import compare, cross_validate, emulation_margin, measured_link, write_validation
from .model import simulate
from .schedule import Schedule


def tag(link: Link | None, world_sizes, compute_scale: float, async_collectives: bool = False) -> str:
    """Sub-folder of ``RUN/simulate/`` for one what-if, so several sit side by side."""
    parts = [(link.name or f"{link.bandwidth_gbps:g}gbps-{link.latency_us:g}us") if link else "measured-link"]
    if world_sizes:
        parts.append("ws" + "-".join(map(str, world_sizes)))
    if compute_scale != 1.0:
        parts.append(f"x{compute_scale:g}")
    if async_collectives:
        parts.append("async")
    return "_".join(parts)


def knob_settings(s: Schedule) -> dict[str, dict]:
    """The prefetch / limiter settings ``--matrix`` sweeps for the schedule's engine."""
    if s.engine in ("ddp", "impl-zero", "torch-zero1"):
        return {f"bucket {mb:g} MiB": {"bucket_mb": mb} for mb in (1.0, 5.0, 25.0, 100.0)}
    if s.engine == "torch-fsdp2":
        return {f"reshard={r} fwd_prefetch={f}": {"reshard_after_forward": r, "forward_prefetch": f}
                for r in (True, False) for f in (False, True)}
    out = {}
    for bp in ("none", "pre", "post"):
        for fp in (False, True):
            for lim in (None, 1, 2):
                name = f"bwd={bp} fwd={'on' if fp else 'off'} limit={lim or 'off'}"
                out[name] = {"backward_prefetch": bp, "forward_prefetch": fp, "limit_all_gathers": lim is not None,
                             "limiter_depth": lim or 2}
    return out


def simulate_run(run, cells=None, link: Link | None = None, world_sizes=None, compute_scale: float = 1.0,
                 matrix: bool = False, plots: bool = True, inter_link: Link | None = None,
                 async_collectives: bool = False, cross: bool = False):
    """Predictions for the run's cells; returns (predictions, matrix or None) DataFrames.

    ``cross``: also predict each cell from every other cell of its engine
    (:func:`.validate.cross_validate`, into ``RUN/simulate/cross/``).

    ``async_collectives``: model every collective as asynchronous, as on CUDA, also for
    cells measured where they blocked (``Knobs.blocking_collectives``)."""
    import pandas as pd

    from zerobench.runs.files import write_csv_atomic
    from zerobench.runs.folder import RunFolder

    from .extract import load_schedules

    run = Path(run)
    schedules = load_schedules(run, cells)
    if not schedules:
        raise FileNotFoundError(f"{run}: no profiled cells to simulate (run with `zerobench run --profile`)")
    out = RunFolder(run).simulate_dir(tag(link, world_sizes, compute_scale, async_collectives))
    where = _measured_on(run)  # every plot title names the workload and the measured device
    rows, mrows = [], []
    for cell_id, s in schedules.items():
        as_measured = not (async_collectives and s.knobs.blocking_collectives)
        if not as_measured:
            s = s.with_knobs(blocking_collectives=False)
        cell_link = link or measured_link(s)
        if cell_link is None:
            raise ValueError(f"{cell_id}: measured without an emulated link; give --link "
                             f"(one of {', '.join(PRESETS)}) or --gbps")
        for ws in world_sizes or [s.world_size]:
            same = ws == s.world_size and compute_scale == 1.0 and cell_link == measured_link(s) and as_measured
            r = simulate(s, cell_link, world_size=ws, compute_scale=compute_scale, inter_link=inter_link)
            row = {"cell_id": cell_id, "engine": s.engine, "world_size": ws, "link": cell_link.describe(),
                   "compute_scale": compute_scale, **r.row(),
                   # the step as the cell ran (its own link and world size): beside every what-if
                   "as_run_step_s": (s.measured or {}).get("step_time_s"),
                   "as_run_traced_step_s": (s.measured or {}).get("traced_step_s"),
                   "as_run_link": measured_link(s).describe() if measured_link(s) else "no emulated link"}
            if same and s.measured:
                m = s.measured
                row.update(**compare(r, m), measured_traced_step_s=m.get("traced_step_s"),
                           measured_hta_exposed_comm_s=m.get("exposed_comm_s"),
                           emulation_margin=emulation_margin(s, cell_link))
            rows.append(row)
            if plots:
                from .plots import plot_gantt

                plot_gantt(r, out / f"gantt_{cell_id}_ws{ws}.png",
                           title=f"{cell_id}: simulated, {ws} ranks, {cell_link.describe()}, compute / {compute_scale:g}"
                                 f"\n{where}")
        if matrix:
            base = cell_link.bandwidth_gbps
            for name, knobs in knob_settings(s).items():
                variant = s.with_knobs(**knobs)
                for f in (0.25, 0.5, 1.0, 2.0, 4.0):
                    lk = Link(base * f, cell_link.latency_us)
                    for ws in world_sizes or [s.world_size]:
                        r = simulate(variant, lk, world_size=ws, compute_scale=compute_scale, inter_link=inter_link)
                        mrows.append({"cell_id": cell_id, "setting": name, "gbps": lk.bandwidth_gbps, "world_size": ws,
                                      **r.row()})
    if cross:
        cross_validate(schedules, RunFolder(run).simulate_dir("cross"))
    pred = pd.DataFrame(rows)
    write_csv_atomic(out / "predictions.csv", pred)
    if "measured_step_s" in pred:
        measured = pred.dropna(subset=["measured_step_s"])
        write_validation(measured, out / "validation.md")
        if plots and len(measured):
            from .plots import plot_validation

            plot_validation(measured, out / "validation.png", heading=where)
    mat = None
    if matrix:
        mat = pd.DataFrame(mrows)
        write_csv_atomic(out / "matrix.csv", mat)
        if plots:
            from .plots import plot_heatmap

            for (cell_id, ws), g in mat.groupby(["cell_id", "world_size"], sort=False):
                plot_heatmap(g, out / f"heatmap_{cell_id}_ws{ws}.png",
                             title=f"{cell_id}: predicted step time, {ws} ranks\n{where}")
    return pred, mat


def _measured_on(run: Path) -> str:
    """"<workload> · simulated from its run on <device>" for the plots' titles."""
    from zerobench.runs.folder import DamagedFile, RunFolder

    try:
        meta = RunFolder(run).meta()
    except DamagedFile:
        meta = {}
    device = meta.get("gpu_model") or f"CPU ({meta.get('cpu_model') or 'unknown'})"
    return f"{meta.get('workload') or run.name} · simulated from its run on {device}, {meta.get('backend') or 'gloo'}"
