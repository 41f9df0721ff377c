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
writing anything, on a bad option or `--device cuda` without a CUDA device.
docs/vgpu.md, "Calibrating a GPU".
"""

from __future__ import annotations

from pathlib import Path

from zerobench.commands.args import DEFAULT_RESULTS, ArgumentError, results_root

HELP = "measure this machine's GPU and write a preset for predict and estimate"

SECTIONS = ("gemm", "attention", "memory", "optimizer", "host", "collectives", "sustained")


def arguments(p) -> None:
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny shapes: the code path, no GPU figures)")
    p.add_argument("--section", action="append", metavar="NAME",
                   help=f"only this section (repeatable): {', '.join(SECTIONS)}")
    p.add_argument("--from", dest="source", type=Path, metavar="FOLDER",
                   help="build the preset from this folder's measurements instead of measuring")
    p.add_argument("--base", metavar="NAME_OR_FILE",
                   help="the preset whose data-sheet figures the measurements are laid over "
                        "(default: the shipped preset closest to the device's name)")
    p.add_argument("--name", help="the new preset's name (default: the base's, with -calibrated)")
    p.add_argument("--out", type=Path, metavar="FILE", help="where to write the preset (default: DIR/preset.json)")
    p.add_argument("--results", type=results_root, default=DEFAULT_RESULTS,
                   help="folder to make the calibrate folder in (default results)")
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
    if args.ranks is not None and args.ranks < 1:
        raise ArgumentError(f"--ranks: {args.ranks} is not allowed (allowed: ints >= 1)")
    if args.source is not None and not args.source.is_dir():
        raise ArgumentError(f"--from: {args.source}: no such folder")
    if args.out is not None and args.out.suffix != ".json":
        raise ArgumentError(f"--out: {args.out} is not allowed (allowed: a .json file)")
    return [s for s in SECTIONS if s in sections]


def main(args) -> int:
    sections = _check(args)
    import json

    import torch

    from zerobench.instruments.vgpu.calibration import preset_from_measurements
    from zerobench.instruments.vgpu.presets import load_preset_file
    from zerobench.runs.files import new_stamped_dir, write_json_atomic
    from zerobench.validation import calibrate

    if args.base:
        calibrate.base_for({}, args.base)  # a bad --base fails before anything runs
    if args.source is not None:
        measured = calibrate.read_measurements(args.source)
        where = str(args.source)
        folder = None if args.out is not None else new_stamped_dir(args.results, "calibrate-from")
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ArgumentError("--device cuda: no CUDA device here (torch.cuda.is_available() is False; "
                                "allowed: --device cpu, which runs the code path on tiny shapes)")
        device = torch.device(args.device)
        measured = calibrate.calibrate(device, sections, ranks=args.ranks)
        folder = new_stamped_dir(args.results, f"calibrate-{device.type}")
        write_json_atomic(folder / "measurements.json", measured)
        where = str(folder / "measurements.json")
    base = calibrate.base_for(measured.get("env", {}), args.base)
    name = args.name or f"{base.name}-calibrated"
    preset = preset_from_measurements(measured, base, name, where)
    out = args.out or folder / "preset.json"
    write_json_atomic(out, preset)
    load_preset_file(out)  # what was written reads back as a preset
    from zerobench.validation.calibrate.collectives import link_file

    link = link_file(measured)  # the collectives measured over several GPUs, for predict --link
    if link is not None:
        link_out = out.with_name("link.json")
        write_json_atomic(link_out, link)
    for note in measured.get("notes", []):
        print(f"note: {note}")
    print(f"measurements: {where}")
    print(f"preset: {out} (zerobench predict WORKLOAD --gpu {out})")
    if link is not None:
        print(f"link: {link_out} (zerobench predict WORKLOAD --link {link_out})")
    print(json.dumps({k: v["value"] for k, v in preset["figures"].items()
                      if k.endswith("efficiency") or k.startswith("attention") or k == "sustained_ratio"}))
    return 0
