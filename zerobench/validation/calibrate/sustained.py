"""The sustained rate: one GEMM run back to back for several windows of seconds, against
its rate in a burst, with the board's power and SM clock sampled through NVML (pynvml,
from nvidia-ml-py) where it is there; and the board's power while idle. What the preset
builder makes of it: ``sustained_ratio`` and ``idle_power_w`` ([Note: calibrating on
kernels] in zerobench/instruments/vgpu/calibration.py; [Note: clocks under load] in
costs.py).
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

from zerobench.instruments.telemetry import nvml_handle
from zerobench.instruments.vgpu import microbench
from zerobench.validation.calibrate.kernels import time_kernel

#: The GEMM run back to back, on a GPU and (for the code path) on a CPU.
SHAPE = {"full": {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16"},
         "tiny": {"m": 256, "n": 256, "k": 256, "dtype": "fp32"}}
SAMPLE_S = 0.25


class PowerSampler:
    """NVML's board power and SM clock every ``SAMPLE_S`` in a thread, while entered; no
    samples where NVML is not there (a CPU, a driver without it)."""

    def __init__(self, device: torch.device):
        self.samples: list[dict] = []
        self._handle = None
        self._stop = threading.Event()
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                # the GPU the kernels run on, by its UUID ([Note: which GPU NVML reads])
                self._handle, _ = nvml_handle(pynvml, _indexed(device))
            except Exception:  # noqa: BLE001 - no NVML: the section runs without power and clocks
                self._handle = None

    def limits(self) -> dict:
        """The enforced and the default power limit (W), where NVML gives them."""
        if self._handle is None:
            return {}
        nvml = self._nvml
        try:
            return {"power_limit_w": nvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1e3,
                    "power_default_limit_w": nvml.nvmlDeviceGetPowerManagementDefaultLimit(self._handle) / 1e3}
        except Exception:  # noqa: BLE001
            return {}

    def _run(self) -> None:
        nvml = self._nvml
        while not self._stop.wait(SAMPLE_S):
            try:
                self.samples.append({"t": time.monotonic(),
                                     "power_w": nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3,
                                     "sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM)})
            except Exception:  # noqa: BLE001 - a failed read is a missing sample
                pass

    def __enter__(self):
        if self._handle is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._handle is not None:
            self._thread.join()


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` alone is the current device, as torch reads it."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def measure(device: torch.device, size: str, budget_s: float, log) -> dict:
    """Idle power, the burst rate and back-to-back windows of the GEMM within ``budget_s``."""
    params = SHAPE[size]
    row = {"kernel": "gemm", "params": params}
    flops = microbench.gemm_flops(params)
    run = microbench.prepare(row, device)
    cuda = device.type == "cuda"
    sampler = PowerSampler(device)
    out: dict = {"params": params, **sampler.limits()}
    with sampler:
        time.sleep(min(1.0, budget_s * 0.1) if cuda else 0.0)  # idle samples
        idle = list(sampler.samples)
        burst = time_kernel(run, device)
        out["burst_tflops"] = flops / burst["seconds"] / 1e12
        windows, window_s = [], max(budget_s * 0.8 / 5, 0.05)
        for i in range(5):
            started, calls = time.perf_counter(), 0
            while time.perf_counter() - started < window_s:
                for _ in range(8):
                    run()
                calls += 8
                if cuda:
                    torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
            windows.append({"seconds": seconds, "tflops": flops * calls / seconds / 1e12})
            log(f"  window {i}: {windows[-1]['tflops']:.1f} TFLOP/s over {seconds:.1f} s")
    out["windows"] = windows
    out["samples"] = sampler.samples
    if idle:
        out["idle_power_w"] = statistics.median(s["power_w"] for s in idle)
    busy = [s for s in sampler.samples if s not in idle]
    if busy:
        out["busy_power_w"] = statistics.median(s["power_w"] for s in busy)
        out["busy_sm_clock_mhz"] = statistics.median(s["sm_clock_mhz"] for s in busy)
    return out
