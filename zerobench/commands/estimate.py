"""Per-rank peak memory of each engine configuration of a workload at any world size:
one rank of the real engine runs a warm-up and one measured step against a fake
process group of each world size, under the memory pass's storage tracker
(docs/estimate.md). Writes results/<date>-<workload>-estimate/: estimate.csv and plots.
"""

from __future__ import annotations

import argparse

from zerobench.commands.args import (
    DEFAULT_RESULTS,
    add_overrides,
    check_results_folder,
    config_id,
    resolve_folder,
    results_root,
)

HELP = "per-rank peak memory of each engine at any world size, on a fake process group"


def arguments(p) -> None:
    p.add_argument("workload", help="workload TOML file or shipped workload name")
    add_overrides(p)
    p.add_argument("--world-sizes", default="8,64,1024", help="comma-separated world sizes (default: 8,64,1024)")
    p.add_argument("--rank", type=int, default=0, help="the rank to run (default 0)")
    p.add_argument("--results", type=results_root, default=DEFAULT_RESULTS, help="folder of result folders")
    p.add_argument("--fake-tensors", action=argparse.BooleanOptionalAction, default=None,
                   help="build the model on FakeTensors (default: on when model states exceed 4 GiB)")
    p.add_argument("--hybrid-shard-size", type=int, default=None,
                   help="HYBRID_SHARD shard group size (must divide every world size)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="whose communication buffers to count besides the engine's tensors: nccl (default) none; "
                        "gloo also its reduce-scatter's full-input-size buffer, as the CPU memory pass sees it")
    p.add_argument("--full-depth", action="store_true",
                   help="run every block of a deep llama/gpt on fake tensors instead of extrapolating from 3 and 4 "
                        "blocks (slower; docs/models.md#depth-extrapolation-in-zerobench-estimate)")
    p.add_argument("--config", "--cell", "--cells", action="append", dest="config", metavar="ID", type=config_id,
                   help="only this configuration (repeatable; a cell id names its configuration)")
    p.add_argument("--gpu", metavar="NAME_OR_FILE",
                   help="a GPU preset (a shipped name or a file `zerobench calibrate` wrote): each row then says what "
                        "the caching allocator may reserve on it (capacity_bytes) and whether the peak fits")
    p.add_argument("--against", metavar="RUN",
                   help="a run folder (with the memory pass), or `latest:run`, to compare the estimates with, per rank")


def main(args) -> int:
    check_results_folder(args.results)
    against = resolve_folder(args.against, "--against") if args.against else None

    import time

    from zerobench.analysis.render import make_console, print_table
    from zerobench.commands.progress import Progress
    from zerobench.runs.whatif import EstimateFolder
    from zerobench.whatif.cells import parse_world_sizes
    from zerobench.whatif.estimate import against_run, check_against, estimate
    from zerobench.whatif.estimate.report import against_table, print_estimate
    from zerobench.whatif.estimate.request import EstimateRequest

    started = time.perf_counter()
    real = check_against(against) if against is not None else None  # before any work: [Note: refuse early] in zerobench/cli.py
    request = EstimateRequest(args.workload, parse_world_sizes(args.world_sizes), rank=args.rank,
                              results_root=args.results, fake_tensors=args.fake_tensors,
                              hybrid_shard_size=args.hybrid_shard_size, only=args.config, backend=args.backend,
                              full_depth=args.full_depth, overrides=args.overrides, gpu=args.gpu)
    with Progress(None, "estimate") as progress:
        out_dir = estimate(request, progress=progress, log=progress.print)
    frame = EstimateFolder(out_dir).table()
    console = make_console()
    print_estimate(frame, console)
    if real is not None:
        print_table(against_table(against_run(frame, real), str(against)), console)
    print(f"estimate: {out_dir / 'estimate.csv'} ({len(frame)} cells, {time.perf_counter() - started:.1f} s wall)")
    for path in sorted((out_dir / "plots").glob("*.png")):
        print(f"plot: {path}")
    return 0
