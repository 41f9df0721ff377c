"""Measurements into a GPU preset: the one function that turns what ``zerobench calibrate``
measured on a GPU (or what the H200 session of results/gpu/h200-20261126 measured) into a
preset file (presets.py).

[Note: calibrating on kernels]
Each figure is fitted to the kernels of its own class, and to nothing end to end:

* ``matmul_efficiency``: the GEMMs measured. Each is priced by the tile model at an
  efficiency of 1 (its FLOPs over the peak and its shape factor: gemm.py); the
  efficiency is the sum of those times over the sum of the measured ones, less each
  GEMM's floor. So the model's total over the grid equals the measurement's, and each
  shape's own error is what the tile model gets wrong (docs/vgpu.md, the kernel table);
  ``matmul_layouts``: per layout ([Note: GEMM layouts] in gemm.py), the geometric mean
  of the GEMMs' modelled over measured times: it prices shapes nobody measured, so each
  measured shape counts alike (a total would be the output layer's 12 ms GEMMs' alone);
  ``gemm_measured``: every GEMM's own time, which prices that layout, shape and dtype
  wherever a step runs it;
* ``attention_<backend>``: the same per backend and direction, on the attention FLOPs
  the cost model counts (half of them when causal); ``attention_grid``: each shape's own,
  for a backend measured at more than one (sequence length, head size);
* the memory-bound efficiencies: each measured kernel runs on the virtual GPU (fake
  tensors, burst clocks, every efficiency 1) and its class's bytes, counted as the cost
  model counts them ([Note: passes over memory] in costs.py), over the HBM peak, give
  its time at efficiency 1; the efficiency is their sum over the sum of the measured
  times, less the kernels' floors and the modelled time of kernels of other classes;
* ``pcie_efficiency``: the same for the pinned host-to-device copy (``h2d``), whose host
  buffer is pinned on the virtual GPU too, so that its bytes cross PCIe once
  (costs.pcie_duration) instead of being read and written in HBM. The H200's 256 MiB
  copy at 55 GB/s gives 0.86 of PCIe Gen5 x16's 64 GB/s a direction: after 128b/130b
  encoding (63 GB/s) and each packet's header (about 0.9 of what is left at a 256-byte
  payload) that is the link running at its ceiling. Priced as an HBM copy, the same
  measurement had given 0.023 (1.47 GB/s);
* ``sustained_ratio``: a GEMM's measured rate over back-to-back windows of seconds, over
  the rate the fitted model gives that GEMM in a burst. So a training step's GEMMs
  reproduce the sustained measurement whatever state the card was in while the grid
  was measured: a grid taken back to back reaches the power limit part way (the H200's
  8192x4096x14336 ran at 802 TFLOP/s early in its grid and at 708 later), and its
  fitted burst efficiency is then already partly a sustained one;
  ``idle_power_w`` and ``power_cap_w`` (when below the board's limit) as the card
  reported them ([Note: clocks under load] in costs.py);
* ``memory_bytes``, ``sm_count``, ``compute_capability``: as CUDA reports the device;
  ``host``: the host measurements, as measured (host.py prices them).

Figures nothing measured come from the ``base`` preset (the shipped preset of the same
part, with their data-sheet sources): the peaks, HBM and PCIe bandwidth, the board's
power limit, the floors and what the allocator cannot have.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from zerobench.instruments.vgpu import microbench
from zerobench.instruments.vgpu.host import HostPreset
from zerobench.instruments.vgpu.presets import (
    ATTENTION_BACKENDS,
    ATTENTION_ROW,
    FIGURES,
    GEMM_ROW,
    LAYOUTS,
    PRESET_FORMAT,
    GpuPreset,
)

#: The format tag of a measurements file (what ``zerobench calibrate`` writes).
MEASUREMENT_FORMAT = "zerobench-calibration/1"


def unit_preset(base: GpuPreset) -> GpuPreset:
    """``base`` at burst clocks with every efficiency 1: what a kernel's time is in units of."""
    ones = {f"attention_{b}": (1.0, 1.0) for b in ATTENTION_BACKENDS}
    return dataclasses.replace(base, matmul_efficiency=1.0, matmul_layouts=None, gemm_measured=(), sustained_ratio=1.0,
                               step_ratio=None, attention_grid=(), clocks="burst", copy_efficiency=1.0,
                               cast_efficiency=1.0, elementwise_efficiency=1.0, optimizer_efficiency=1.0,
                               pcie_efficiency=1.0, power_cap_w=None, **ones)


def model_row(row: dict, preset: GpuPreset) -> dict:
    """What the virtual GPU makes of a measured row on ``preset``: its modelled seconds,
    and per kernel class the device seconds, kernels and bytes (fake tensors, no host
    time, burst clocks unless the preset says otherwise)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerobench.instruments.vgpu.device import VirtualGpu

    backend = row["params"].get("backend", "auto") if row["kernel"] == "attention" else "auto"
    gpu = VirtualGpu(gpu=preset, host=HostPreset("none", 0.0, 0.0), trace=False, sdpa_backend=backend)
    with FakeTensorMode(allow_non_fake_inputs=True), gpu:
        run = microbench.prepare(row, "cpu", pin=True)  # h2d's host buffer is host memory here too
        gpu.synchronize()
        seconds = dict(gpu.class_seconds)
        kernels = dict(gpu.class_kernels)
        nbytes = dict(gpu.class_bytes)
        # the kernel starts once the host has issued it: after making a pinned host buffer
        # (the CPU's own work on the host's clock) that is later than the device's tail
        start = max(gpu.default.tail, gpu.host.now)
        run()
        gpu.synchronize()
        end = gpu.default.tail
    return {"seconds": end - start,
            "class_seconds": {k: v - seconds[k] for k, v in gpu.class_seconds.items()},
            "class_kernels": {k: v - kernels[k] for k, v in gpu.class_kernels.items()},
            "class_bytes": {k: v - nbytes[k] for k, v in gpu.class_bytes.items()}}


def _floor(preset: GpuPreset, kind: str) -> float:
    return preset.gemm_floor_s if kind == "gemm" else preset.kernel_floor_s


def _fit(rows: list[dict], unit: GpuPreset, what: str, at_most_peak: bool = True) -> tuple[float, list[str]]:
    """The efficiency that makes the model's total time over ``rows`` the measured total
    (see the Note); ``what`` names the figure in errors. ``at_most_peak=False`` lets it
    exceed 1 (one row's own figure, where the model's shape factor is what is off)."""
    work = measured = 0.0
    names = []
    for row in rows:
        model = model_row(row, unit)
        kind = microbench.CLASS_OF[row["kernel"]]
        kernels = model["class_kernels"][kind]
        floors = kernels * _floor(unit, kind)
        other = sum(s for k, s in model["class_seconds"].items() if k != kind)
        work += model["class_seconds"][kind] - floors
        measured += row["seconds"] - floors - other
        names.append(microbench.describe(row))
    if work <= 0 or measured <= 0:
        raise ValueError(f"{what}: the measured rows ({'; '.join(names)}) leave no time to fit")
    efficiency = work / measured
    if efficiency > 1.0 and at_most_peak:
        raise ValueError(f"{what}: the measured rows ({'; '.join(names)}) ran faster than the peak allows "
                         f"({efficiency:.3f} of it): the base preset's peak is too low for this device")
    return efficiency, names


def _fit_shapes(rows: list[dict], unit: GpuPreset, what: str) -> float:
    """The efficiency that makes the model's time right on the average shape of ``rows``:
    the geometric mean of each row's modelled over measured time (see the Note), every
    shape weighted alike, where :func:`_fit` weights each by its time."""
    logs = []
    for row in rows:
        efficiency, _ = _fit([row], unit, what)
        logs.append(math.log(efficiency))
    efficiency = math.exp(statistics.fmean(logs))
    if efficiency > 1.0:
        raise ValueError(f"{what}: the measured rows ran faster than the peak allows ({efficiency:.3f} of it): the "
                         "base preset's peak is too low for this device")
    return efficiency


def preset_from_measurements(measured: dict, base: GpuPreset, name: str, where: str,
                             description: str | None = None) -> dict:
    """The preset file (a dict, presets.py's format) ``measured`` gives over ``base``.

    ``measured``: a measurements file's contents (MEASUREMENT_FORMAT: ``env``, ``kernels``,
    ``sustained``, ``host``); ``where``: what the sources cite (the measurements file).
    Every figure fitted here says which rows it came from ([Note: calibrating on kernels])."""
    if measured.get("format") != MEASUREMENT_FORMAT:
        raise ValueError(f"{where}: format {measured.get('format')!r} is not allowed (allowed: {MEASUREMENT_FORMAT})")
    env = measured.get("env", {})
    figures: dict = {}

    def put(figure: str, value, source: str) -> None:
        figures[figure] = {"value": value, "source": source}

    device = env.get("name", "the device")
    if env.get("memory_bytes"):
        put("memory_bytes", int(env["memory_bytes"]), f"{where}: CUDA's total_memory of {device}")
    if env.get("sm_count"):
        put("sm_count", int(env["sm_count"]), f"{where}: multi_processor_count of {device}")
    if env.get("compute_capability"):
        put("compute_capability", str(env["compute_capability"]), f"{where}: compute capability of {device}")
    limit = env.get("power_limit_w")
    if limit and limit < base.power_w - 1:
        put("power_cap_w", float(limit), f"{where}: the enforced power limit NVML reported")
    rows = [r for r in measured.get("kernels", []) if r.get("seconds")]
    unit = unit_preset(_overlay(base, figures))
    gemms = [r for r in rows if r["kernel"] == "gemm"]
    if gemms:
        value, names = _fit(gemms, unit, "matmul_efficiency")
        put("matmul_efficiency", round(value, 6), f"{where}: {len(names)} GEMMs ({names[0]} ...), the tile model's "
            "total fitted to theirs (burst)")
        layouts, counts = {}, {}
        for layout in LAYOUTS:
            chosen = [r for r in gemms if microbench.gemm_layout(r["params"]) == layout]
            if chosen:
                layouts[layout] = round(_fit_shapes(chosen, unit, f"matmul_layouts {layout}"), 6)
                counts[layout] = len(chosen)
        put("matmul_layouts", layouts, f"{where}: per layout, the geometric mean of the tile model's time over the "
            f"measured one of the GEMMs measured in it ({', '.join(f'{k}: {n}' for k, n in counts.items())}), burst")
        put("gemm_measured", _measured_gemms(gemms), f"{where}: each GEMM's measured time, burst")
    for backend in ATTENTION_BACKENDS:
        pair = {}
        for direction in ("forward", "backward"):
            chosen = [r for r in rows if r["kernel"] == "attention" and r["params"]["backend"] == backend
                      and r["params"]["direction"] == direction]
            if chosen:
                pair[direction], names = _fit(chosen, unit, f"attention_{backend} {direction}")
        if len(pair) == 2:
            put(f"attention_{backend}", {d: round(v, 6) for d, v in pair.items()},
                f"{where}: {backend} SDPA forward and backward ({names[0]}), burst")
    grid = _attention_grid(rows, unit)
    if grid:
        put("attention_grid", grid, f"{where}: SDPA per backend, sequence length and head size, forward and backward, "
            "burst")
    by_figure: dict = {}
    for row in rows:
        figure = microbench.EFFICIENCY_OF.get(row["kernel"])
        if figure is not None:
            by_figure.setdefault(figure, []).append(row)
    for figure, chosen in by_figure.items():
        value, names = _fit(chosen, unit, figure)
        put(figure, round(value, 6), f"{where}: {'; '.join(names)} (bytes as the cost model counts them)")
    sustained = measured.get("sustained") or {}
    windows = [w["tflops"] for w in sustained.get("windows", [])]
    if windows and sustained.get("params"):
        rate = statistics.fmean(windows)
        from zerobench.instruments.vgpu.presets import figure_value

        # against the tile model, not the GEMM's own measured time: a grid measured back to back
        # is partly sustained already, and its fitted efficiency with it (see the Note)
        fitted = dataclasses.replace(_overlay(base, figures), clocks="burst", gemm_measured=(), **{
            k: figure_value(k, figures[k]["value"]) for k in ("matmul_efficiency", "matmul_layouts") if k in figures})
        row = {"kernel": "gemm", "params": sustained["params"]}
        model = microbench.gemm_flops(sustained["params"]) / (model_row(row, fitted)["seconds"]) / 1e12
        burst = sustained.get("burst_tflops")
        put("sustained_ratio", round(min(rate / model, 1.0), 6),
            f"{where}: {microbench.describe(row)} at {rate:.1f} TFLOP/s over {len(windows)} back-to-back windows, "
            f"over the {model:.1f} the fitted model gives it in a burst"
            + (f" (measured in a burst: {burst:.1f})" if burst else ""))
    if sustained.get("idle_power_w"):
        put("idle_power_w", round(float(sustained["idle_power_w"]), 1),
            f"{where}: board power with a context and nothing running (median of the idle samples)")
    table = measured_kernels(rows, unit)
    merged = {**base.to_file()["figures"], **figures}
    out = {"format": PRESET_FORMAT, "name": name,
           "description": description or (base.description if name == base.name
                                           else f"{device}, calibrated by zerobench calibrate"),
           "figures": {k: merged[k] for k in FIGURES if k in merged}}
    if measured.get("host"):
        out["host"] = {"value": measured["host"], "source": f"{where}: host costs per call (microseconds)"}
    if table:
        counts = ", ".join(f"{len(v)} {k}" for k, v in table.items())
        out["measured_kernels"] = {"value": table, "source": f"{where}: {counts} rows as measured, each with the "
                                                             "efficiency it alone fits"}
    return out


#: The parameters a row of ``measured_kernels`` keeps, by kernel ([Note: measured kernels in a preset]).
_TABLE_PARAMS = {"gemm": ("m", "n", "k", "dtype", "layout", "layer"),
                 "attention": ("backend", "direction", "batch", "heads", "seq", "head_dim", "causal", "dtype")}


def measured_kernels(rows: list[dict], unit: GpuPreset) -> dict:
    """Every measured GEMM and attention row for the preset's ``measured_kernels``: its
    parameters, seconds, how it was timed, and the efficiency it alone fits on ``unit``
    ([Note: measured kernels in a preset] in presets.py)."""
    table: dict = {}
    for row in rows:
        keys = _TABLE_PARAMS.get(row["kernel"])
        if keys is None:
            continue
        efficiency, _ = _fit([row], unit, microbench.describe(row), at_most_peak=False)
        table.setdefault(row["kernel"], []).append(
            {**{k: row["params"].get(k) for k in keys}, "seconds": row["seconds"],
             "timing": "batch" if row.get("batches") else "per call", "efficiency": round(efficiency, 6)})
    return table


def _attention_grid(rows: list[dict], unit: GpuPreset) -> list[dict]:
    """The attention grid (presets.ATTENTION_ROW) of the backends measured at more than one
    (sequence length, head size), both directions: [Note: attention over shapes] in costs.py."""
    shapes: dict = {}
    for row in rows:
        if row["kernel"] == "attention":
            p = row["params"]
            shapes.setdefault(p["backend"], {}).setdefault((p["seq"], p["head_dim"]), {}).setdefault(
                p["direction"], []).append(row)
    out = []
    for backend in ATTENTION_BACKENDS:
        measured = shapes.get(backend, {})
        if len(measured) < 2:
            continue
        for (seq, head_dim), directions in sorted(measured.items()):
            if set(directions) != {"forward", "backward"}:
                continue
            fitted = {d: round(_fit(chosen, unit, f"attention_grid {backend} {d}")[0], 6)
                      for d, chosen in directions.items()}
            out.append(dict(zip(ATTENTION_ROW, (backend, seq, head_dim, fitted["forward"], fitted["backward"]))))
    return out


def _measured_gemms(rows: list[dict]) -> list[dict]:
    """The measured GEMMs as a preset gives them (presets.GEMM_ROW); a shape measured more
    than once at the mean of its times."""
    times: dict = {}
    for row in rows:
        p = row["params"]
        times.setdefault((microbench.gemm_layout(p), p["m"], p["n"], p["k"], p["dtype"]), []).append(row["seconds"])
    return [dict(zip(GEMM_ROW, (*key, statistics.fmean(seconds)))) for key, seconds in times.items()]


def _overlay(base: GpuPreset, figures: dict) -> GpuPreset:
    """``base`` with the device's own memory, SMs and compute capability (what the fits price on)."""
    from zerobench.instruments.vgpu.presets import figure_value

    changes = {k: figure_value(k, f["value"]) for k, f in figures.items() if k in ("memory_bytes", "sm_count",
                                                                               "compute_capability")}
    return dataclasses.replace(base, **changes) if changes else base

