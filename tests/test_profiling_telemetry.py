"""GpuTelemetry: absent without NVML, never raising; columns when NVML answers."""

import sys
import time
import types

from zerobench.analysis.profiling import GpuTelemetry


def test_without_gpu_summary_is_empty_and_nothing_raises():
    # On the CPU machine pynvml is installed but NVML's library is not: nvmlInit raises
    # NVMLError_LibraryNotFound, which must be swallowed.
    with GpuTelemetry(interval_s=0.01) as tel:
        time.sleep(0.03)
    assert tel.summary() == {}


def _fake_pynvml(power_supported: bool):
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError
    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetHandleByIndex = lambda i: object()
    samples = iter(range(10_000))
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=50 + next(samples) % 2 * 10)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2**30)

    def power(h):
        if not power_supported:
            raise NVMLError("not supported")
        return 300_000  # mW

    m.nvmlDeviceGetPowerUsage = power
    return m


def test_samples_with_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(power_supported=True))
    with GpuTelemetry(interval_s=0.005) as tel:
        time.sleep(0.05)
    s = tel.summary()
    assert s["gpu_telemetry_samples"] >= 3
    assert 50 <= s["gpu_util_mean_pct"] <= 60 and s["gpu_util_max_pct"] == 60
    assert s["gpu_mem_used_max_bytes"] == 2**30
    assert s["gpu_power_mean_w"] == 300.0


def test_power_not_supported_leaves_power_out(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(power_supported=False))
    with GpuTelemetry(interval_s=0.005) as tel:
        pass
    s = tel.summary()
    assert s["gpu_telemetry_samples"] >= 1 and "gpu_power_mean_w" not in s


def test_init_failure_is_absent(monkeypatch):
    fake = _fake_pynvml(True)

    def boom():
        raise fake.NVMLError("driver not loaded")

    fake.nvmlInit = boom
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with GpuTelemetry() as tel:
        pass
    assert tel.summary() == {}


def test_cuda_visible_devices_maps_to_nvml_index(monkeypatch):
    fake = _fake_pynvml(True)
    asked = []
    fake.nvmlDeviceGetHandleByIndex = lambda i: asked.append(i) or object()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with GpuTelemetry(device_index=1, interval_s=1.0):
        pass
    assert asked == [5]
