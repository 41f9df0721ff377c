"""``zerobench simulate RUN``: re-time a profiled run's cells with the simulator.

Writes into ``RUN/simulate/<what-if>/`` (``measured-link`` when nothing is changed,
else e.g. ``ib-400g_ws64_x20``): ``predictions.csv`` (one row per cell x world size:
predicted step time, exposed communication, overlap, link utilisation, unsharded
units and bytes; and, at the measured world size and link, the measurement and the
error), one Gantt per prediction, and with ``--matrix`` ``matrix.csv`` and a heatmap
per cell (knob setting x link bandwidth -> predicted step time).
"""

from __future__ import annotations

from pathlib import Path

from zerobench.instruments.link import PRESETS, Link, resolve_link

from .model import simulate
from .schedule import Schedule
from .validate import compare, cross_validate, emulation_margin, measured_link, validation_summary, write_validation


def _tag(link: Link | None, world_sizes, compute_scale: float, async_collectives: bool = False) -> str:
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

    from .extract import load_schedules

    run = Path(run)
    schedules = load_schedules(run, cells)
    if not schedules:
        raise FileNotFoundError(f"{run}: no profiled cells to simulate (run with `zerobench run --profile`)")
    out = run / "simulate" / _tag(link, world_sizes, compute_scale, async_collectives)
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
                   "compute_scale": compute_scale, **r.row()}
            if same and s.measured:
                m = s.measured
                row.update(**compare(r, m), measured_traced_step_s=m.get("traced_step_s"),
                           measured_hta_exposed_comm_s=m.get("exposed_comm_s"),
                           emulation_margin=emulation_margin(s, cell_link))
            rows.append(row)
            if plots:
                from .plots import plot_gantt

                plot_gantt(r, out / f"gantt_{cell_id}_ws{ws}.png",
                           title=f"{cell_id}: simulated, {ws} ranks, {cell_link.describe()}, compute / {compute_scale:g}")
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
        cross_validate(schedules, run / "simulate" / "cross")
    pred = pd.DataFrame(rows)
    write_csv_atomic(out / "predictions.csv", pred)
    if "measured_step_s" in pred:
        measured = pred.dropna(subset=["measured_step_s"])
        write_validation(measured, out / "validation.md")
        if plots and len(measured):
            from .plots import plot_validation

            plot_validation(measured, out / "validation.png")
    mat = None
    if matrix:
        mat = pd.DataFrame(mrows)
        write_csv_atomic(out / "matrix.csv", mat)
        if plots:
            from .plots import plot_heatmap

            for (cell_id, ws), g in mat.groupby(["cell_id", "world_size"], sort=False):
                plot_heatmap(g, out / f"heatmap_{cell_id}_ws{ws}.png",
                             title=f"{cell_id}: predicted step time, {ws} ranks")
    return pred, mat


def _cmd_simulate(args) -> int:
    import pandas as pd

    link = None
    if args.link or args.gbps is not None:
        link = resolve_link(args.link, args.gbps, args.latency_us)
    inter = resolve_link(args.inter_link) if args.inter_link else None
    for ws in args.world_sizes or []:
        if ws < 1:
            raise ValueError(f"--world-sizes: {ws} is not allowed (allowed: ints >= 1)")
    if not args.compute_scale > 0:
        raise ValueError(f"--compute-scale: must be > 0, got {args.compute_scale}")
    pred, mat = simulate_run(args.run, args.cell, link, args.world_sizes, args.compute_scale, args.matrix,
                             plots=not args.no_plots, inter_link=inter, async_collectives=args.async_collectives,
                             cross=args.cross)
    cols = [c for c in ("cell_id", "world_size", "step_time_s", "exposed_comm_s", "overlap_ratio", "max_unsharded_units",
                        "measured_step_s", "step_error", "measured_exposed_comm_s", "exposed_error") if c in pred]
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 60):
        print(pred[cols].round(4).to_string(index=False))
    if "step_error" in pred and pred["step_error"].notna().any():
        print("\n".join(validation_summary(pred.dropna(subset=["step_error"]))))
    if args.cross:
        print((Path(args.run) / "simulate" / "cross" / "cross.md").read_text())
    tag = _tag(link, args.world_sizes, args.compute_scale, args.async_collectives)
    print(f"wrote {Path(args.run) / 'simulate' / tag}/")
    return 0


def register_cli(subparsers) -> None:
    """Add ``simulate RUN`` to the ``zerobench`` command line."""
    p = subparsers.add_parser("simulate", help="predict step time / exposed comm of a profiled run's cells "
                              "on another link, world size or device speed", description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="run folder recorded with --profile (or holding schedules/)")
    p.add_argument("--cell", action="append", metavar="ID", help="only this cell (repeatable)")
    p.add_argument("--link", choices=sorted(PRESETS), help="link preset (default: the emulated link the cell ran on)")
    p.add_argument("--gbps", type=float, help="link bus bandwidth in GB/s (overrides the preset's)")
    p.add_argument("--latency-us", type=float, help="per-collective latency in microseconds")
    p.add_argument("--inter-link", choices=sorted(PRESETS), help="HYBRID_SHARD: the link across nodes")
    p.add_argument("--world-sizes", type=int, nargs="+", metavar="N", help="ranks to predict for (default: as measured)")
    p.add_argument("--compute-scale", type=float, default=1.0, metavar="F", help="compute F times faster (default 1)")
    p.add_argument("--matrix", action="store_true", help="also sweep knob settings x link bandwidth (heatmap)")
    p.add_argument("--cross", action="store_true",
                   help="also predict each cell from every other cell of its engine (its knobs and link on the "
                        "other's schedule) and compare with its measurement: simulate/cross/")
    p.add_argument("--async-collectives", action="store_true",
                   help="model PyTorch's FSDPs' collectives as asynchronous, as on CUDA, where the measured "
                        "CPU run blocked on them")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=_cmd_simulate)


