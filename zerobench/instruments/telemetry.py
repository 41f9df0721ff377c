"""GPU telemetry: NVML samples of utilization, memory used and power, in the background.

Used around the timed pass of a cell::

    with GpuTelemetry(torch.device("cuda", 3), interval_s=0.05) as tel:
        run_timed_steps()
    row.update(tel.summary())      # {} without a GPU or without NVML

Without NVML (no ``nvidia-ml-py``, no driver, no GPU) it records nothing and
``summary()`` is empty, so the columns are simply absent from the results; it never
raises (``pynvml.NVMLError`` is caught at every call); what it could not sample, and why,
is in ``note``. Utilization is NVML's: the
fraction of the last sample period (1/6 s to 1 s depending on the GPU) during which
one or more kernels ran -- not how busy the SMs were.

[Note: which GPU NVML reads]
NVML numbers every GPU of the machine in PCI bus order; CUDA numbers the visible ones,
fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, after ``CUDA_VISIBLE_DEVICES``
(indices in CUDA's order, or UUIDs and their prefixes, or MIG instances). No index
arithmetic maps one onto the other on every node, so the GPU is looked up by the UUID
CUDA itself gives the rank's device (``torch.cuda.get_device_properties(i).uuid``):
``GPU-<uuid>`` for a whole GPU, ``MIG-<uuid>`` for a MIG instance. A MIG instance's
handle answers memory but neither utilization nor power (NVML reports them per board,
shared by every instance): the utilization and power columns are then absent and
``note`` says why.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: reading results (zerobench.analysis) needs no torch
    import torch


class GpuTelemetry:
    """Context manager sampling one GPU every ``interval_s`` seconds on a daemon thread."""

    def __init__(self, device: torch.device | int = 0, interval_s: float = 0.1):
        """``device``: the rank's CUDA device (or its index, as torch numbers it); NVML's
        device is found by its UUID ([Note: which GPU NVML reads])."""
        self.device = device
        self.interval_s = interval_s
        # Samples, appended by the sampling thread only: (utilization % or None, memory used B, power W or None).
        self.samples: list[tuple[float | None, float, float | None]] = []
        self.note: str | None = None  # why a column is absent (not found, a MIG instance), for the rank's record
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
        except pynvml.NVMLError:
            return self
        try:
            self._handle, mig = nvml_handle(pynvml, self.device)
        except (pynvml.NVMLError, LookupError, ValueError, RuntimeError, AssertionError) as err:
            self.note = f"GPU telemetry: {err}"
            _shutdown(pynvml)
            return self
        if mig:
            self.note = ("GPU telemetry: a MIG instance; NVML gives utilization and power only per board, "
                         "so only memory is sampled")
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
            finally:
                _shutdown(self._nvml)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        nv = self._nvml
        try:
            mem = nv.nvmlDeviceGetMemoryInfo(self._handle).used
        except nv.NVMLError:
            return
        try:
            util = float(nv.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except nv.NVMLError:  # a MIG instance
            util = None
        try:
            power = nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0  # mW -> W
        except nv.NVMLError:  # not supported on every board, nor on a MIG instance
            power = None
        self.samples.append((util, float(mem), power))

    def summary(self) -> dict:
        """Columns for the results table; ``{}`` when nothing was sampled."""
        if not self.samples:
            return {}
        util = [s[0] for s in self.samples if s[0] is not None]
        mem = [s[1] for s in self.samples]
        power = [s[2] for s in self.samples if s[2] is not None]
        out = {"gpu_mem_used_max_bytes": max(mem), "gpu_telemetry_samples": len(self.samples)}
        if util:
            out["gpu_util_mean_pct"] = sum(util) / len(util)
            out["gpu_util_max_pct"] = max(util)
        if power:
            out["gpu_power_mean_w"] = sum(power) / len(power)
            out["gpu_power_max_w"] = max(power)
        return out


def _shutdown(pynvml) -> None:
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass


def nvml_handle(pynvml, device: torch.device | int):
    """(NVML's handle of the CUDA device ``device``, whether it is a MIG instance), found
    by the UUID CUDA gives the device: [Note: which GPU NVML reads]. LookupError naming the
    UUID when no NVML device has it; ValueError for a CUDA device without an index."""
    import torch

    if isinstance(device, torch.device):
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"nvml_handle needs a CUDA device with an index, got {device}")
        device = device.index
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    if uuid.startswith(("GPU-", "MIG-")):
        names = [uuid]
    else:
        names = [f"GPU-{uuid}", f"MIG-{uuid}"]
    for name in names:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(name)
        except pynvml.NVMLError:
            continue
        return handle, name.startswith("MIG-") or _is_mig(pynvml, handle)
    raise LookupError(f"no NVML device has the UUID of CUDA device {device} ({' or '.join(names)})")


def _is_mig(pynvml, handle) -> bool:
    try:
        return bool(pynvml.nvmlDeviceIsMigDeviceHandle(handle))
    except (pynvml.NVMLError, AttributeError):  # a driver or binding without MIG
        return False
