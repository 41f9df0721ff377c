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
row. What the budget leaves out is a note in the measurements file, not an error. A
section that raises is one too: its error (type, message, traceback) goes to the
measurements' ``failed`` list and its notes, the sections after it still run, and the
measurements are handed to ``save`` after every section, so that what was measured
before a crash is kept (the command writes the file atomically each time, and exits 1
when a section failed). The H200's first calibrate lost four measured sections to the
host section's crash (results/gpu/h200-20261128/calibrate/host-section-error.log).
``within`` (``--within``) is a deadline for the whole run: the budgets are scaled down
to fit it, and a section with less than ``MIN_SECTION_S`` left is not started (a note);
scripts/gpu-calibrate runs the kernel, host and sustained sections within 180 s, so that
one command measures a GPU in under 4 minutes (docs/gpu.md).
Every CUDA device calibrate makes names its index (:func:`device_of`): torch refuses an
unindexed one as ``init_process_group``'s ``device_id``, and NVML needs the index too.
The measurements (``measurements.json``: raw rows, nothing fitted) and the preset built
from them (``preset.json``, through
:func:`zerobench.instruments.vgpu.calibration.preset_from_measurements`) go to one
folder; ``calibrate --from FOLDER`` rebuilds a preset from a folder of measurements
without measuring, which is how the shipped ``h200`` is made from
results/gpu/h200-20261126. On a CPU (``--device cpu``) every section runs on tiny shapes:
the code path, for tests; its figures say nothing about a GPU.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from zerobench.validation.calibrate.devices import device_of

#: Sections in the order they run, and each one's budget in seconds.
BUDGETS = {"gemm": 45.0, "attention": 35.0, "memory": 25.0, "optimizer": 30.0, "host": 45.0, "collectives": 50.0,
           "sustained": 30.0}
SECTIONS = tuple(BUDGETS)
#: The least time a section is started with when the whole run has a deadline (seconds).
MIN_SECTION_S = 2.0


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


def calibrate(device: str | torch.device, sections=SECTIONS, log=print, budget_scale: float = 1.0,
              ranks: int | None = None, save: Callable[[dict], None] | None = None,
              within: float | None = None, size: str | None = None, layers: tuple | None = None) -> dict:
    """Measure ``sections`` on ``device``; returns the measurements (calibration.py's format).
    ``save(measurements)`` is called after each section, failed or not; ``within``: the
    seconds the whole run may take, the budgets scaled down to fit when they add up to
    more, and no section started with less than ``MIN_SECTION_S`` of it left ([Note:
    calibrate's sections]). ``size``: the grids' (kernels.grids): ``full`` on a GPU,
    ``tiny`` elsewhere, unless given; ``layers``: the linear layers whose GEMMs the gemm
    section times (kernels.workload_layers), instead of Llama 3 8B's."""
    from zerobench.instruments.vgpu.calibration import MEASUREMENT_FORMAT

    device = device_of(device)
    if device.type == "cuda":  # what follows the current device (a mesh, NCCL, FSDP1) measures this one
        torch.cuda.set_device(device)
    bad = [s for s in sections if s not in BUDGETS]
    if bad:
        raise ValueError(f"sections: {bad[0]!r} is not allowed (allowed: {', '.join(SECTIONS)})")
    size = size or ("full" if device.type == "cuda" else "tiny")
    if size not in ("full", "tiny"):
        raise ValueError(f"size: {size!r} is not allowed (allowed: full, tiny)")
    if within is not None and not within > 0:
        raise ValueError(f"within: {within!r} is not allowed (allowed: seconds > 0)")
    out: dict = {"format": MEASUREMENT_FORMAT, "env": environment(device), "kernels": [], "notes": [], "failed": []}
    began = time.monotonic()
    total = sum(BUDGETS[s] for s in sections) * budget_scale
    if within is not None and total > within:
        budget_scale *= within / total
        total = within
    log(f"calibrate on {out['env']['name']} ({device}), {len(sections)} sections, {total:.0f} s budget")
    for section in sections:
        budget = BUDGETS[section] * budget_scale
        if within is not None:
            left = within - (time.monotonic() - began)
            budget = min(budget, left)
            if left < MIN_SECTION_S:
                out["notes"].append(f"{section}: left out: the run's {within:.0f} s had passed")
                log(f"{section}: left out ({within:.0f} s passed)")
                continue
        log(f"{section}: up to {budget:.0f} s")
        started = time.monotonic()
        try:
            _measure_section(section, out, device, size, budget, started, log, ranks, layers)
        except Exception as err:  # noqa: BLE001 - a section's failure is recorded; the others still run
            message = f"{type(err).__name__}: {str(err).strip()}"
            out["failed"].append({"section": section, "error": message, "traceback": traceback.format_exc()})
            out["notes"].append(f"{section}: failed ({message.splitlines()[0][:200]})")
            log(f"{section}: FAILED after {time.monotonic() - started:.1f} s: {message.splitlines()[0]}")
        else:
            log(f"{section}: {time.monotonic() - started:.1f} s")
        if save is not None:
            save(out)
    return out


def _measure_section(section: str, out: dict, device: torch.device, size: str, budget: float, started: float,
                     log, ranks: int | None, layers: tuple | None = None) -> None:
    """One section's measurements, added to ``out``."""
    from zerobench.validation.calibrate import collectives, kernels, sustained

    grid = kernels.grids(size, device, layers)
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


def merge_measurements(parts: list[dict]) -> dict:
    """Several measurements of one GPU as one (``calibrate --from A --from B``: a calibrate
    run per few sections, as the H200's of 2026-11-28): the kernel rows, notes and
    failures of all, the environment of the first that names the device, and each of
    ``host``, ``collectives`` and ``sustained`` from the last that has it."""
    if len(parts) == 1:
        return parts[0]
    names = {p.get("env", {}).get("name") for p in parts} - {None, "cpu"}
    if len(names) > 1:
        raise ValueError(f"--from: measurements of different devices ({', '.join(sorted(names))}) are not allowed "
                         "(allowed: folders measured on one GPU)")
    out = {"format": parts[0].get("format"), "env": next((p["env"] for p in parts if p.get("env", {}).get("name")),
                                                         parts[0].get("env", {})),
           "kernels": [r for p in parts for r in p.get("kernels", [])],
           "notes": [n for p in parts for n in p.get("notes", [])],
           "failed": [f for p in parts for f in p.get("failed", [])]}
    for key in ("host", "collectives", "sustained"):
        found = [p[key] for p in parts if p.get(key)]
        if found:
            out[key] = found[-1]
    return out


def base_for(env: dict, base: str | None):
    """The preset the measured figures are laid over: ``--base``, or the shipped one closest
    to the device's name."""
    from zerobench.instruments.vgpu.presets import gpu_preset, preset_for_device

    return gpu_preset(base or preset_for_device(env.get("name") or ""))
