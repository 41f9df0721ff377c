"""GPU telemetry: NVML samples of utilization, memory used and power, in the background.

Used around the timed pass of a cell::

    with GpuTelemetry(device_index=local_rank, interval_s=0.05) as tel:
        run_timed_steps()
    row.update(tel.summary())      # {} without a GPU or without NVML

Without NVML (no ``nvidia-ml-py``, no driver, no GPU) it records nothing and
``summary()`` is empty, so the columns are simply absent from the results; it never
raises (``pynvml.NVMLError`` is caught at every call). Utilization is NVML's: the
fraction of the last sample period (1/6 s to 1 s depending on the GPU) during which
one or more kernels ran -- not how busy the SMs were.
"""

from __future__ import annotations

import os
import threading


class GpuTelemetry:
    """Context manager sampling one GPU every ``interval_s`` seconds on a daemon thread."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.1):
        """``device_index``: the CUDA device index the rank uses (as torch numbers it:
        mapped through ``CUDA_VISIBLE_DEVICES`` to NVML's numbering)."""
        self.device_index = device_index
        self.interval_s = interval_s
        # Samples, appended by the sampling thread only: (utilization %, memory used B, power W or None).
        self.samples: list[tuple[float, float, float | None]] = []
        self._stop = threading.Event()  # set by __exit__ to end the sampling thread
        self._thread: threading.Thread | None = None
        self._nvml = None  # the pynvml module once nvmlInit succeeded; None means "absent"
        self._handle = None

    def __enter__(self) -> "GpuTelemetry":
        try:
            import pynvml
        except ImportError:
            return self
        try:
            pynvml.nvmlInit()
            self._handle = _nvml_handle(pynvml, self.device_index)
        except (pynvml.NVMLError, ValueError):
            return self
        self._nvml = pynvml
        self._sample()  # one sample even for a pass shorter than the interval
        self._thread = threading.Thread(target=self._run, name="zerobench-gpu-telemetry", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1.0)
        if self._nvml is not None:
            try:
                self._sample()
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        nv = self._nvml
        try:
            util = nv.nvmlDeviceGetUtilizationRates(self._handle).gpu
            mem = nv.nvmlDeviceGetMemoryInfo(self._handle).used
        except nv.NVMLError:
            return
        try:
            power = nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0  # mW -> W
        except nv.NVMLError:  # not supported on every board
            power = None
        self.samples.append((float(util), float(mem), power))

    def summary(self) -> dict:
        """Columns for the results table; ``{}`` when nothing was sampled."""
        if not self.samples:
            return {}
        util = [s[0] for s in self.samples]
        mem = [s[1] for s in self.samples]
        power = [s[2] for s in self.samples if s[2] is not None]
        out = {
            "gpu_util_mean_pct": sum(util) / len(util),
            "gpu_util_max_pct": max(util),
            "gpu_mem_used_max_bytes": max(mem),
            "gpu_telemetry_samples": len(self.samples),
        }
        if power:
            out["gpu_power_mean_w"] = sum(power) / len(power)
            out["gpu_power_max_w"] = max(power)
        return out




def _nvml_handle(pynvml, cuda_index: int):
    """NVML handle of CUDA device ``cuda_index``: NVML numbers every GPU of the machine,
    CUDA only the visible ones, in ``CUDA_VISIBLE_DEVICES`` order (indices or UUIDs)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entry = visible[cuda_index]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)
