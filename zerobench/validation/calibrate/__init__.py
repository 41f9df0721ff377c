"""``zerobench calibrate``: measure what the virtual GPU's cost model needs on the GPU at
hand, and write the preset that prices kernels with it (docs/vgpu.md, "Calibrating a GPU").

Read in this order: this module (the driver: sections and their budgets, the
measurements file, the preset), kernels.py (the GEMM grid, attention per SDPA backend,
memory-bound kernels and optimizer steps, timed as
zerobench/instruments/vgpu/microbench.py builds them), host.py (the host's costs per call
and per hook), collectives.py (bus bandwidth over the GPUs present), sustained.py (a GEMM
back to back against its burst rate, with power and clocks), session.py (the H200
session's files read as measurements).

[Note: calibrate's sections]
Calibrate runs each section within its budget (``BUDGETS``, seconds, 260 in all: under
5 minutes on one GPU with the process's start), printing the budget, then a line per
row. What the budget leaves out is a note in the measurements file, not an error. The
measurements (``measurements.json``: raw rows, nothing fitted) and the preset built from
them (``preset.json``, through
:func:`zerobench.instruments.vgpu.calibration.preset_from_measurements`) go to one
folder; ``calibrate --from FOLDER`` rebuilds a preset from a folder of measurements
without measuring, which is how the shipped ``h200`` is made from
results/gpu/h200-20261126. On a CPU (``--device cpu``) every section runs on tiny shapes:
the code path, for tests; its figures say nothing about a GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

#: Sections in the order they run, and each one's budget in seconds.
BUDGETS = {"gemm": 45.0, "attention": 35.0, "memory": 25.0, "optimizer": 30.0, "host": 45.0, "collectives": 50.0,
           "sustained": 30.0}
SECTIONS = tuple(BUDGETS)


def environment(device: torch.device) -> dict:
    """What the preset takes from the device itself, and the versions."""
    env = {"torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(name=props.name, memory_bytes=props.total_memory, sm_count=props.multi_processor_count,
                   compute_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), device_count=torch.cuda.device_count())
        from zerobench.validation.calibrate.sustained import PowerSampler

        env.update(PowerSampler(device).limits())
    else:
        env.update(name="cpu")
    return env


def calibrate(device: torch.device, sections=SECTIONS, log=print, budget_scale: float = 1.0,
              ranks: int | None = None) -> dict:
    """Measure ``sections`` on ``device``; returns the measurements (calibration.py's format)."""
    from zerobench.instruments.vgpu.calibration import MEASUREMENT_FORMAT
    from zerobench.validation.calibrate import collectives, kernels, sustained

    size = "full" if device.type == "cuda" else "tiny"
    grid = kernels.grids(size, device)
    out: dict = {"format": MEASUREMENT_FORMAT, "env": environment(device), "kernels": [], "notes": []}
    total = sum(BUDGETS[s] for s in sections) * budget_scale
    log(f"calibrate on {out['env']['name']} ({device}), {len(sections)} sections, {total:.0f} s budget")
    for section in sections:
        budget = BUDGETS[section] * budget_scale
        log(f"{section}: up to {budget:.0f} s")
        started = time.monotonic()
        if section in grid:
            rows, notes = kernels.measure(grid[section], device, started + budget, log)
            out["kernels"] += rows
            out["notes"] += [f"{section}: {n}" for n in notes]
        elif section == "host":
            from zerobench.validation.calibrate import host

            out["host"] = host.measure(device, budget)
        elif section == "collectives":
            out["collectives"] = collectives.measure(device, size, budget, log, ranks)
        elif section == "sustained":
            out["sustained"] = sustained.measure(device, size, budget, log)
        log(f"{section}: {time.monotonic() - started:.1f} s")
    return out


def read_measurements(folder: Path) -> dict:
    """The measurements of ``folder``: calibrate's measurements.json, or the H200 session's files."""
    from zerobench.validation.calibrate import session

    folder = Path(folder)
    if (folder / "measurements.json").is_file():
        return json.loads((folder / "measurements.json").read_text())
    if session.is_session(folder):
        return session.read_session(folder)
    raise ValueError(f"--from: {folder} has no measurements (allowed: a folder calibrate wrote, with "
                     "measurements.json, or one with the H200 session's micro.json)")


def base_for(env: dict, base: str | None):
    """The preset the measured figures are laid over: ``--base``, or the shipped one closest
    to the device's name."""
    from zerobench.instruments.vgpu.presets import gpu_preset, preset_for_device

    return gpu_preset(base or preset_for_device(env.get("name") or ""))
