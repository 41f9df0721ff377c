"""Measure this machine's GPU for the virtual GPU's cost model: a grid of GEMMs,
attention forward and backward per SDPA backend, memory-bound kernels (copy, cast,
pointwise, norm, cross-entropy, a pinned host copy), foreach optimizer steps (AdamW,
Adam, SGD), the host's costs per call, collectives' bus bandwidth over the GPUs present,
and a GEMM's sustained rate against its burst rate, each section within its budget
(under 5 minutes in all). Writes DIR/measurements.json (what was measured) and
DIR/preset.json (the preset built from it, each figure citing its measurement), which
`zerobench predict --gpu DIR/preset.json` and `zerobench estimate --gpu ...` take.
`--from FOLDER` builds the preset from measurements already taken (a folder calibrate
wrote, or results/gpu/h200-20261126) without measuring. Exits 2, before measuring or
writing anything, on a bad option or `--device cuda` without a CUDA device; exits 1 when
a section failed (its error is in measurements.json's "failed", the other sections kept:
the file is written after every section).
docs/vgpu.md, "Calibrating a GPU".
"""

from __future__ import annotations

import warnings
from pathlib import Path

from zerobench.commands.args import DEFAULT_RESULTS, ArgumentError, results_root

HELP = "measure this machine's GPU and write a preset for predict and estimate"

SECTIONS = ("gemm", "attention", "memory", "optimizer", "host", "collectives", "sustained")


def arguments(p) -> None:
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny shapes: the code path, no GPU figures)")
    p.add_argument("--section", action="append", metavar="NAME",
                   help=f"only this section (repeatable): {', '.join(SECTIONS)}")
    p.add_argument("--from", dest="source", type=Path, metavar="FOLDER", action="append",
                   help="build the preset from this folder's measurements instead of measuring (repeatable: "
                        "the folders of one GPU's calibrate runs, section by section, merged)")
    p.add_argument("--base", metavar="NAME_OR_FILE",
                   help="the preset whose data-sheet figures the measurements are laid over "
                        "(default: the shipped preset closest to the device's name)")
    p.add_argument("--name", help="the new preset's name (default: the base's, with -calibrated)")
    p.add_argument("--out", type=Path, metavar="FILE", help="where to write the preset (default: DIR/preset.json)")
    p.add_argument("--results", type=results_root, default=DEFAULT_RESULTS,
                   help="folder to make the calibrate folder in (default results)")
    p.add_argument("--workload", type=Path, metavar="FILE",
                   help="time the GEMMs of this workload's linear layers at its tokens per step, in the three "
                        "layouts training runs (default: a Llama 3 8B block's at 8192 tokens on a GPU)")
    p.add_argument("--within", type=float, default=None, metavar="SECONDS",
                   help="the seconds the measuring may take: the sections' budgets scaled down to fit "
                        "(default: their sum, 260 s for every section)")
    p.add_argument("--ranks", type=int, default=None,
                   help="cpu only: processes for the collectives section (default 1: skipped)")


def _check(args) -> list:
    """Every option checked before anything is measured or written."""
    sections = args.section or list(SECTIONS)
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise ArgumentError(f"--section: {bad[0]!r} is not allowed (allowed: {', '.join(SECTIONS)})")
    if args.device not in ("cuda", "cpu"):
        raise ArgumentError(f"--device: {args.device!r} is not allowed (allowed: cuda, cpu)")
    if args.workload is not None and args.source is not None:
        raise ArgumentError("--workload: not allowed with --from (allowed: one of them: --from measures nothing)")
    if args.within is not None and not args.within > 0:
        raise ArgumentError(f"--within: {args.within} is not allowed (allowed: seconds > 0)")
    if args.ranks is not None and args.ranks < 1:
        raise ArgumentError(f"--ranks: {args.ranks} is not allowed (allowed: ints >= 1)")
    for source in args.source or []:
        if not source.is_dir():
            raise ArgumentError(f"--from: {source}: no such folder")
    if args.out is not None and args.out.suffix != ".json":
        raise ArgumentError(f"--out: {args.out} is not allowed (allowed: a .json file)")
    return [s for s in SECTIONS if s in sections]


def main(args) -> int:
    sections = _check(args)
    import sys

    import torch

    from zerobench.instruments.vgpu.calibration import preset_from_measurements
    from zerobench.instruments.vgpu.presets import load_preset_file
    from zerobench.runs.files import new_stamped_dir, write_json_atomic
    from zerobench.validation import calibrate

    if args.base:
        calibrate.base_for({}, args.base)  # a bad --base fails before anything runs
    if args.source is not None:
        measured = calibrate.merge_measurements([calibrate.read_measurements(f) for f in args.source])
        where = " + ".join(str(f) for f in args.source)
        folder = None if args.out is not None else new_stamped_dir(args.results, "calibrate-from")
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ArgumentError("--device cuda: no CUDA device here (torch.cuda.is_available() is False; "
                                "allowed: --device cpu, which runs the code path on tiny shapes)")
        layers = None
        if args.workload is not None:  # parsed and its model's shapes read before anything is measured
            from zerobench.spec.workload import WorkloadError, load_workload
            from zerobench.validation.calibrate.kernels import workload_layers

            try:
                layers = workload_layers(load_workload(args.workload))
            except (OSError, WorkloadError, ValueError) as err:
                raise ArgumentError(f"--workload {args.workload}: {err}") from None
        device = calibrate.device_of(args.device)
        folder = new_stamped_dir(args.results, f"calibrate-{device.type}")
        where = str(folder / "measurements.json")
        with warnings.catch_warnings():  # torch's deprecations and FSDP's world-size-1 notice: not the user's
            warnings.filterwarnings("ignore", module=r"torch\.")
            measured = calibrate.calibrate(device, sections, ranks=args.ranks, within=args.within, layers=layers,
                                           save=lambda found: write_json_atomic(folder / "measurements.json", found))
    failed = [f["section"] for f in measured.get("failed", [])]
    for note in measured.get("notes", []):
        print(f"note: {note}")
    print(f"measurements: {where}")
    base = calibrate.base_for(measured.get("env", {}), args.base)
    name = args.name or f"{base.name}-calibrated"
    try:
        preset = preset_from_measurements(measured, base, name, where)
    except ValueError as err:  # the measurements are kept; what they could not give is said
        print(f"zerobench calibrate: no preset: {err}", file=sys.stderr)
        return 1
    out = args.out or folder / "preset.json"
    write_json_atomic(out, preset)
    load_preset_file(out)  # what was written reads back as a preset
    print(f"preset: {out} (zerobench predict WORKLOAD --gpu {out})")
    from zerobench.validation.calibrate.collectives import link_file

    link = link_file(measured)  # the collectives measured over several GPUs, for predict --link
    if link is not None:
        link_out = out.with_name("link.json")
        write_json_atomic(link_out, link)
        print(f"link: {link_out} (zerobench predict WORKLOAD --link {link_out})")
    from zerobench.analysis.render import print_table

    print_table(fitted_table(preset))
    if failed:
        print(f"zerobench calibrate: section(s) failed: {', '.join(failed)} (their errors: {where}, \"failed\"); "
              "the preset is built from the others", file=sys.stderr)
        return 1
    return 0


def fitted_table(preset: dict):
    """The figures calibrate fitted, one row each: what it is and its value (a fraction of
    the part's peak, or the sustained rate against the burst one)."""
    from zerobench.analysis.render import Column, Table

    table = Table([Column("figure", "left"), Column("value"), Column("from", "left", "words")],
                  title=f"fitted figures of {preset.get('name', 'the preset')} (fractions of the part's peak):")
    for key, figure in preset["figures"].items():
        value = figure["value"]
        if not (key.endswith("efficiency") or key.startswith("attention") or key == "sustained_ratio"):
            continue
        values = value.items() if isinstance(value, dict) else [("", value)]
        for part, v in values:
            if isinstance(v, (int, float)) and not isinstance(v, bool):  # a grid or a table is in the preset file
                table.add_row(f"{key} {part}".strip(), f"{v:.3g}", str(figure.get("source", "")))
    return table
