"""Re-time a profiled run's cells with the simulator: predicted step time and exposed
communication on another link, world size or device speed (docs/simulate.md). Writes
RUN/simulate/<what-if>/: predictions.csv, a Gantt per prediction, and with --matrix a
heatmap per cell (knob setting x link bandwidth). Pure Python: no torch.
"""

from __future__ import annotations

from zerobench.commands.args import ArgumentError, resolve_folder

HELP = "predict step time / exposed comm of a profiled run's cells on another link, world size or device speed"


def arguments(p) -> None:
    from zerobench.instruments.link import PRESETS

    p.add_argument("run", help="run folder recorded with --profile (or holding schedules/), or `latest:run`")
    p.add_argument("--cell", "--cells", action="append", dest="cell", metavar="ID", help="only this cell (repeatable)")
    p.add_argument("--link", choices=sorted(PRESETS), metavar="PRESET",
                   help=f"link preset: {', '.join(sorted(PRESETS))} (default: the emulated link the cell ran on)")
    p.add_argument("--gbps", type=float, help="link bus bandwidth in GB/s (overrides the preset's)")
    p.add_argument("--latency-us", type=float, help="per-collective latency in microseconds")
    p.add_argument("--inter-link", choices=sorted(PRESETS), metavar="PRESET",
                   help="HYBRID_SHARD: the link across nodes (a --link preset)")
    p.add_argument("--world-sizes", type=int, nargs="+", metavar="N", help="ranks to predict for (default: as measured)")
    p.add_argument("--compute-scale", type=float, default=1.0, metavar="F", help="compute F times faster (default 1)")
    p.add_argument("--matrix", action="store_true", help="also sweep knob settings x link bandwidth (heatmap)")
    p.add_argument("--cross", action="store_true",
                   help="also predict each cell from every other cell of its engine (its knobs and link on the "
                        "other's schedule) and compare with its measurement: simulate/cross/")
    p.add_argument("--async-collectives", action="store_true",
                   help="model PyTorch's FSDPs' collectives as asynchronous, as on CUDA, where the measured "
                        "CPU run blocked on them")
    p.add_argument("--no-plots", action="store_true", help="write the tables only, no plots")


def main(args) -> int:
    import math

    run = resolve_folder(args.run, "RUN")

    from zerobench.analysis.render import print_table
    from zerobench.instruments.link import resolve_link
    from zerobench.runs.folder import RunFolder
    from zerobench.whatif.simulate.against import validation_summary
    from zerobench.whatif.simulate.run import simulate_run, tag

    for option, value, low, allowed in (("--gbps", args.gbps, 0, "a finite number > 0"),
                                        ("--latency-us", args.latency_us, None, "a finite number >= 0"),
                                        ("--compute-scale", args.compute_scale, 0, "a finite number > 0")):
        if value is not None and not (math.isfinite(value) and (value > low if low is not None else value >= 0)):
            raise ArgumentError(f"{option}: {value} is not allowed (allowed: {allowed})")
    if args.latency_us is not None and not (args.link or args.gbps is not None):
        raise ArgumentError(f"--latency-us {args.latency_us}: a latency needs a link (allowed: with --link PRESET or "
                            f"--gbps N)")
    for ws in args.world_sizes or []:
        if ws < 1:
            raise ArgumentError(f"--world-sizes: {ws} is not allowed (allowed: ints >= 1)")
    link = None
    if args.link or args.gbps is not None:
        link = resolve_link(args.link, args.gbps, args.latency_us)
    inter = resolve_link(args.inter_link) if args.inter_link else None
    pred, mat = simulate_run(run, args.cell, link, args.world_sizes, args.compute_scale, args.matrix,
                             plots=not args.no_plots, inter_link=inter, async_collectives=args.async_collectives,
                             cross=args.cross)
    print_table(prediction_table(pred))
    if "step_error" in pred and pred["step_error"].notna().any():
        print("\n".join(validation_summary(pred.dropna(subset=["step_error"]))))
    folder = RunFolder(run)
    if args.cross:
        print((folder.simulate_dir("cross") / "cross.md").read_text())
    print(f"wrote {folder.simulate_dir(tag(link, args.world_sizes, args.compute_scale, args.async_collectives))}/")
    return 0


def prediction_table(pred):
    """The simulator's predictions, each beside the cell's measured step as it ran (its
    own link and world size); where the what-if is the measured setting itself, also the
    measured exposed communication and the errors (zerobench/analysis/render.py)."""
    from zerobench.analysis.render import Column, Table, format_column

    def column(name, scale=1.0, decimals=None, signed=False):
        return format_column(pred[name] if name in pred else [None] * len(pred), scale, decimals, signed)

    links = ", ".join(dict.fromkeys(pred["link"])) if "link" in pred else "the measured link"
    ran = ", ".join(dict.fromkeys(pred["as_run_link"].dropna())) if "as_run_link" in pred else ""
    table = Table([Column("cell", "left", "parts", role="key"), Column("ws"), Column("step ms"),
                   Column("exposed ms"), Column("overlap"), Column("units"), Column("measured step ms"),
                   Column("step error %"), Column("measured exposed ms"), Column("exposed error %")],
                  title=f"simulated on {links}; measured: the step as the cell ran" + (f" ({ran})" if ran else "")
                        + "; errors where the simulation is of the measured setting:")
    measured = pred["measured_step_s"] if "measured_step_s" in pred else pred.get("as_run_step_s")
    if measured is not None and "as_run_step_s" in pred:
        measured = measured.fillna(pred["as_run_step_s"])
    figures = list(zip(column("step_time_s", 1e3), column("exposed_comm_s", 1e3), column("overlap_ratio", 1, 2),
                       column("max_unsharded_units"),
                       format_column(measured if measured is not None else [None] * len(pred), 1e3),
                       column("step_error", 100, 1, signed=True), column("measured_exposed_comm_s", 1e3),
                       column("exposed_error", 100, 1, signed=True)))
    for k, (_, r) in enumerate(pred.iterrows()):
        table.add_row(r["cell_id"], int(r["world_size"]), *figures[k])
    if {"as_run_step_s", "as_run_traced_step_s"} <= set(pred):
        cost = (pred["as_run_traced_step_s"] / pred["as_run_step_s"] - 1).dropna()
        if len(cost) and cost.max() > 0.05:
            low, high = f"{100 * cost.min():.0f}", f"{100 * cost.max():.0f}"
            table.notes.append(f"the profiled steps ran {low if low == high else f'{low}-{high}'} % longer than "
                               f"the timed ones (the profiler's own cost); simulated steps are built from the "
                               f"traced compute, so they carry it")
    return table
