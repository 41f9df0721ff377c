"""A virtual CUDA device that runs on the CPU: streams, events, a host clock, an
operator cost model and a caching-allocator model. See [Note: virtual device] in
device.py and docs/vgpu.md."""

from zerobench.instruments.vgpu import comm
from zerobench.instruments.vgpu.device import VirtualGpu, VirtualWork, current
from zerobench.instruments.vgpu.host import HOST_PRESETS, HostPreset
from zerobench.instruments.vgpu.presets import GPU_PRESETS, GpuPreset

__all__ = ["comm", "VirtualGpu", "VirtualWork", "current", "GPU_PRESETS", "HOST_PRESETS", "GpuPreset", "HostPreset"]
