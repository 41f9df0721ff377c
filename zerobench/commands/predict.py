"""Step time, overlap, the host's lead and the caching allocator's peaks of each engine
configuration on a virtual GPU (docs/vgpu.md): one rank per configuration and world
size runs the engines' CUDA code path on a modelled GPU, against a fake process group,
with fake tensors. Writes results/<date>-<workload>-predict/: predict.csv, a Chrome
trace per cell and plots. Nothing is measured: these are a model's predictions.
"""

from __future__ import annotations

from zerobench.commands.args import (
    DEFAULT_RESULTS,
    add_overrides,
    check_results_folder,
    config_id,
    resolve_folder,
    results_root,
)

HELP = "step time, overlap and allocator peaks of each engine on a virtual GPU"


def arguments(p) -> None:
    from zerobench.instruments.link import PRESETS

    p.add_argument("workload", help="workload TOML file or shipped workload name")
    add_overrides(p)
    p.add_argument("--world-sizes", default=None,
                   help="comma-separated (default 8,64; with --against, the run's)")
    p.add_argument("--gpu", default="h100-sxm",
                   help="GPU preset: a shipped name (default h100-sxm; docs/vgpu.md lists them, and so does a wrong "
                        "name) or a preset file, as `zerobench calibrate` writes one")
    p.add_argument("--host", default=None,
                   help="host preset: h200-host (measured), fast or slow (default: the GPU preset's own measured "
                        "host, else h200-host; docs/vgpu.md)")
    p.add_argument("--link", default="nvlink4-8gpu", help=f"intra-node link preset: {', '.join(PRESETS)}; or a link "
                   "file that zerobench calibrate measured (DIR/link.json)")
    p.add_argument("--inter-link", default=None, help="link of groups spanning nodes (default: --link)")
    p.add_argument("--node-size", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--results", type=results_root, default=DEFAULT_RESULTS,
                   help=f"folder to make the prediction's folder in (default: {DEFAULT_RESULTS})")
    p.add_argument("--matrix", action="store_true", help="sweep prefetch x limiter x reshard")
    p.add_argument("--config", "--cell", "--cells", action="append", dest="config", metavar="ID", type=config_id,
                   help="only this configuration id (repeatable; a cell id names its configuration)")
    p.add_argument("--alloc-conf", default="", help="caching-allocator settings in PYTORCH_CUDA_ALLOC_CONF syntax: "
                   "expandable_segments:True, max_split_size_mb:N (docs/vgpu.md)")
    p.add_argument("--context-mib", type=int, default=None,
                   help="device memory of the CUDA context, outside the allocator (default: the preset's, 512)")
    p.add_argument("--nccl-mib", type=int, default=None,
                   help="device memory of each NCCL communicator, outside the allocator (default: the preset's, 688)")
    p.add_argument("--sdpa-backend", default="auto",
                   help="attention backend: auto (torch's choice for the GPU, dtype and head size; docs/vgpu.md), "
                        "cudnn, flash, efficient or math")
    p.add_argument("--nccl-record-streams", action="store_true",
                   help="ProcessGroupNCCL record-streams collective tensors onto its stream, as PyTorch did before "
                        "TORCH_NCCL_AVOID_RECORD_STREAMS became the default (docs/vgpu.md)")
    p.add_argument("--against", default=None, metavar="RUN",
                   help="a `zerobench run --profile` folder (or latest:run): predict its traced cells and put each "
                        "beside its measurement, kernel class by kernel class (against.csv, against.md, "
                        "plots/against.png; docs/vgpu.md)")


def main(args) -> int:
    check_results_folder(args.results)
    if args.against is not None:
        args.against = resolve_folder(args.against, "--against")

    import sys
    import time
    from pathlib import Path

    from zerobench.analysis.render import make_console
    from zerobench.commands.progress import Progress
    from zerobench.runs.whatif import PredictFolder
    from zerobench.whatif.cells import parse_world_sizes
    from zerobench.whatif.predict import predict
    from zerobench.whatif.predict.report import model_kind, print_predict
    from zerobench.whatif.predict.request import PredictRequest

    started = time.perf_counter()
    world_sizes, only = args.world_sizes or "8,64", args.config
    if args.against is not None:  # its traced cells, unless the options say otherwise; bad input fails here
        from zerobench.whatif.predict.against import configurations

        configs, sizes = configurations(args.against)
        world_sizes = args.world_sizes or ",".join(map(str, sizes))
        only = only or configs
    request = PredictRequest(args.workload, parse_world_sizes(world_sizes), gpu=args.gpu, host=args.host,
                             link=args.link, inter_link=args.inter_link, node_size=args.node_size,
                             results_root=args.results, matrix=args.matrix, only=only, alloc_conf=args.alloc_conf,
                             context_mib=args.context_mib, nccl_mib=args.nccl_mib,
                             record_streams=args.nccl_record_streams, sdpa_backend=args.sdpa_backend,
                             overrides=args.overrides)
    with Progress(None, "predict") as progress:
        out_dir = predict(request, progress=progress, log=progress.print)
    folder = PredictFolder(out_dir)
    frame = folder.table()
    print_predict(frame, make_console(), model_kind(out_dir))
    print(f"predict: {folder.table_path} ({len(frame)} cells, {time.perf_counter() - started:.1f} s wall)")
    print(f"traces: {folder.traces_dir}")
    if args.against is not None:
        from zerobench.analysis.render import print_table
        from zerobench.whatif.predict import against

        frame = against.compare(args.against, out_dir)
        warning = against.device_warning(Path(args.against), args.gpu)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        title = (f"{Path(args.against).name} against its prediction, per step; measured on "
                 f"{against.measured_on(Path(args.against))}, predicted on a virtual {args.gpu}")
        against.write(frame, out_dir, title)
        print_table(against.against_table(frame, title))
        print(f"against: {out_dir / 'against.csv'}")
    for path in sorted((out_dir / "plots").glob("*.png")):
        print(f"plot: {path}")
    return 0
