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
    m.nvmlDeviceGetHandleByUUID = lambda uuid: object()
    samples = iter(range(10_000))
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=50 + next(samples) % 2 * 10)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2**30)

    def power(h):
        if not power_supported:
            raise NVMLError("not supported")
        return 300_000  # mW

    m.nvmlDeviceGetPowerUsage = power
    return m


def _uuids(monkeypatch):
    """torch.cuda's device properties, device i with UUID 0000000i-...: NVML is asked by UUID."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid=f"{int(i):08d}-0000-0000-0000-000000000000"))


def test_samples_with_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _uuids(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(power_supported=True))
    with GpuTelemetry(interval_s=0.005) as tel:
        time.sleep(0.05)
    s = tel.summary()
    assert s["gpu_telemetry_samples"] >= 3
    assert 50 <= s["gpu_util_mean_pct"] <= 60 and s["gpu_util_max_pct"] == 60
    assert s["gpu_mem_used_max_bytes"] == 2**30
    assert s["gpu_power_mean_w"] == 300.0


def test_power_not_supported_leaves_power_out(monkeypatch):
    _uuids(monkeypatch)
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


def test_nvml_is_asked_for_the_devices_uuid_whatever_cuda_visible_devices_says(monkeypatch):
    """[Note: which GPU NVML reads]; the topologies: tests/test_topology.py."""
    fake = _fake_pynvml(True)
    asked = []
    fake.nvmlDeviceGetHandleByIndex = lambda i: asked.append(i) or object()
    fake.nvmlDeviceGetHandleByUUID = lambda uuid: asked.append(uuid) or object()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    _uuids(monkeypatch)
    with GpuTelemetry(1, interval_s=1.0) as tel:
        pass
    assert asked == ["GPU-00000001-0000-0000-0000-000000000000"] and tel.note is None


def test_a_device_nvml_does_not_know_is_said(monkeypatch):
    fake = _fake_pynvml(True)

    def unknown(uuid):
        raise fake.NVMLError("not found")

    fake.nvmlDeviceGetHandleByUUID = unknown
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    _uuids(monkeypatch)
    with GpuTelemetry(2) as tel:
        pass
    assert tel.summary() == {}
    assert tel.note == ("GPU telemetry: no NVML device has the UUID of CUDA device 2 "
                        "(GPU-00000002-0000-0000-0000-000000000000 or MIG-00000002-0000-0000-0000-000000000000)")
