"""The kernel table: every kernel measured on a GPU beside the virtual GPU's price of the
same kernel on the same shapes, row by row and class by class (docs/vgpu.md, "Kernels
against the H200").

``python -m zerobench.validation.kernels [FOLDER] [--gpu NAME_OR_FILE] [--before DIR] [--out TABLE.md]``

FOLDER holds the measurements (a folder ``zerobench calibrate`` wrote, or
results/gpu/h200-20261126, the default). Each measured row is the code of
zerobench/instruments/vgpu/microbench.py; here it runs on the virtual GPU with fake
tensors, at burst clocks (the rows were bursts), and its modelled time is put beside the
measured one: error = predicted / measured - 1. The sustained row runs the same GEMM at
the clocks of a card under load. Per class, the errors are of the sums over the class's
rows. ``--before DIR``: also price every row with the zerobench in DIR (a checkout of an
older commit: ``git worktree add DIR COMMIT``), in a child process that imports it.

The class totals are fitted: calibrate makes each class's modelled total its measured
one ([Note: calibrating on kernels] in zerobench/instruments/vgpu/calibration.py). The
rows are what the model's shapes and passes get right or wrong within a class.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DEFAULT_FOLDER = Path("results/gpu/h200-20261126")


def price_rows(rows: list[dict], preset, clocks: str = "burst") -> list[float]:
    """The virtual GPU's seconds for each measured row on ``preset``, its GEMMs by the tile
    model at their layout's efficiency, not by the preset's table of measured GEMMs (which
    would give each row back its own time: [Note: GEMM layouts] in gemm.py)."""
    import dataclasses

    from zerobench.instruments.vgpu.calibration import model_row
    from zerobench.instruments.vgpu.presets import gpu_preset

    gpu = dataclasses.replace(gpu_preset(preset), clocks=clocks, gemm_measured=())
    return [model_row(row, gpu)["seconds"] for row in rows]


#: Prices rows with another checkout's virtual GPU (``--before``): that tree's zerobench,
#: this tree's microbench.py loaded by path (it imports only torch).
_BEFORE = r"""
import importlib.util, json, sys
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("microbench", sys.argv[2])
microbench = importlib.util.module_from_spec(spec); spec.loader.exec_module(microbench)
from torch._subclasses.fake_tensor import FakeTensorMode
from zerobench.instruments.vgpu import HostPreset, VirtualGpu
out = []
for row in json.loads(sys.stdin.read()):
    gpu = VirtualGpu(gpu=sys.argv[3], host=HostPreset("none", 0.0, 0.0), trace=False)
    with FakeTensorMode(allow_non_fake_inputs=True), gpu:
        run = microbench.prepare(row, "cpu")
        gpu.synchronize(); start = gpu.default.tail
        run(); gpu.synchronize()
        out.append(gpu.default.tail - start)
print(json.dumps(out))
"""


def price_rows_before(rows: list[dict], code: Path, preset: str) -> list[float]:
    """Each row priced by the zerobench in ``code`` on its preset named ``preset``."""
    from zerobench.instruments.vgpu import microbench

    done = subprocess.run([sys.executable, "-c", _BEFORE, str(code), microbench.__file__, preset],
                          input=json.dumps(rows), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ValueError(f"--before {code}: pricing failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def kernel_table(measured: dict, preset, before: Path | None = None):
    """One row per measured kernel (and the sustained GEMM): class, name, measured and
    predicted seconds, the error; ``before_s`` / ``before_error`` with ``before``."""
    import pandas as pd

    from zerobench.instruments.vgpu import microbench
    from zerobench.instruments.vgpu.presets import gpu_preset

    preset = gpu_preset(preset)
    rows = [r for r in measured.get("kernels", []) if r.get("seconds")]
    predicted = price_rows(rows, preset)
    names = [r.get("name") or microbench.describe(r) for r in rows]
    classes = [microbench.CLASS_OF[r["kernel"]] for r in rows]
    seconds = [r["seconds"] for r in rows]
    sustained = measured.get("sustained") or {}
    if sustained.get("windows") and sustained.get("params"):
        row = {"kernel": "gemm", "params": sustained["params"]}
        rate = sum(w["tflops"] for w in sustained["windows"]) / len(sustained["windows"])
        names.append(f"{microbench.describe(row)}, sustained")
        classes.append("gemm (sustained)")
        seconds.append(microbench.gemm_flops(sustained["params"]) / (rate * 1e12))
        predicted += price_rows([row], preset, clocks="sustained")
        rows = rows + [row]
    frame = pd.DataFrame({"class": classes, "kernel": names, "measured_s": seconds, "predicted_s": predicted})
    frame["error"] = frame["predicted_s"] / frame["measured_s"] - 1
    if before is not None:
        frame["before_s"] = price_rows_before(rows, before, preset.name)
        frame["before_error"] = frame["before_s"] / frame["measured_s"] - 1
    return frame


def by_class(frame):
    """Per class: the sums of measured and predicted seconds, and the error of the sums."""
    columns = [c for c in ("measured_s", "predicted_s", "before_s") if c in frame.columns]
    out = frame.groupby("class", sort=False)[columns].sum().reset_index()
    out["rows"] = frame.groupby("class", sort=False).size().values
    out["error"] = out["predicted_s"] / out["measured_s"] - 1
    if "before_s" in out.columns:
        out["before_error"] = out["before_s"] / out["measured_s"] - 1
    return out


def _ms(value) -> str:
    return f"{value * 1e3:.3f}"


def _pct(value) -> str:
    return f"{100 * value:+.1f} %"


def to_markdown(frame, classes) -> str:
    before = "before_s" in frame.columns
    head = "| class | rows | measured ms |" + (" before ms | before error |" if before else "") + \
        " predicted ms | error |"
    lines = [head, "|---|---:|---:|" + ("---:|---:|" if before else "") + "---:|---:|"]
    for _, r in classes.iterrows():
        lines.append(f"| {r['class']} | {r['rows']} | {_ms(r['measured_s'])} |"
                     + (f" {_ms(r['before_s'])} | {_pct(r['before_error'])} |" if before else "")
                     + f" {_ms(r['predicted_s'])} | {_pct(r['error'])} |")
    lines += ["", "| class | kernel | measured ms |" + (" before ms | before error |" if before else "")
              + " predicted ms | error |", "|---|---|---:|" + ("---:|---:|" if before else "") + "---:|---:|"]
    for _, r in frame.iterrows():
        lines.append(f"| {r['class']} | {r['kernel']} | {_ms(r['measured_s'])} |"
                     + (f" {_ms(r['before_s'])} | {_pct(r['before_error'])} |" if before else "")
                     + f" {_ms(r['predicted_s'])} | {_pct(r['error'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerobench.validation.kernels",
                                     description="measured kernels beside the virtual GPU's price of them")
    parser.add_argument("folder", nargs="?", type=Path, default=DEFAULT_FOLDER,
                        help=f"measurements: a calibrate folder or the H200 session (default {DEFAULT_FOLDER})")
    parser.add_argument("--gpu", default="h200", help="the preset to price them on (default h200)")
    parser.add_argument("--before", type=Path, metavar="DIR",
                        help="also price them with the zerobench checked out in DIR (an older commit)")
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    args = parser.parse_args(argv)
    from zerobench.instruments.vgpu.presets import gpu_preset
    from zerobench.validation.calibrate import read_measurements

    try:
        preset = gpu_preset(args.gpu)
        if args.before is not None and not (args.before / "zerobench").is_dir():
            raise ValueError(f"--before: {args.before} holds no zerobench/ (allowed: a checkout of this repository)")
        measured = read_measurements(args.folder)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    frame = kernel_table(measured, preset, args.before)
    text = to_markdown(frame, by_class(frame))
    from zerobench.runs.files import print_and_write

    print_and_write(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
