"""DeepSpeed's accelerator over the virtual GPU, so that ZeRO takes its CUDA code path there.

DeepSpeed reaches the device only through its accelerator (``deepspeed.accelerator.
get_accelerator()``): streams, events, synchronisation, memory statistics, and whether the
device is synchronous. Its CPU accelerator says it is (``is_synchronized_device``), so
ZeRO makes no side streams and records no events on CPU: ``overlap_comm`` does nothing
there. :class:`VirtualGpuAccelerator` is that CPU accelerator (tensors stay CPU tensors,
see [Note: virtual device] in zerobench/instruments/vgpu/device.py) except that, while a
virtual GPU is installed, it answers as a CUDA device would, with the virtual device's
streams, events, synchronisation and caching-allocator statistics: ZeRO then makes its
reduction stream (``overlap_comm``), double-buffers its bucket, prefetches on its
all-gather stream and records streams, as on a GPU. With no virtual GPU installed it is
the CPU accelerator unchanged.

Installed once per process, before DeepSpeed builds anything
(:func:`install`, called by the engines' start: zerobench/engines/deepspeed.py). Checked
on DeepSpeed 0.19.8 (``deepspeed/accelerator/cpu_accelerator.py`` and
``deepspeed/accelerator/cuda_accelerator.py`` for what a device answers).
"""

from __future__ import annotations

from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

from zerobench.instruments.vgpu import device as vgpu


class VirtualGpuAccelerator(CPU_Accelerator):
    """DeepSpeed's CPU accelerator, answering as a CUDA device while a virtual GPU is
    installed (``zerobench.instruments.vgpu.device.current()``)."""

    def __init__(self):
        super().__init__()
        self._name = "cpu"  # tensors stay CPU tensors; DeepSpeed compares op builds by this name

    # -- what kind of device ----------------------------------------------------------

    def is_synchronized_device(self):
        return vgpu.current() is None

    def use_host_timers(self):
        return self.is_synchronized_device()

    def resolves_data_dependency(self):
        return self.is_synchronized_device()

    def handles_memory_backpressure(self):
        return self.is_synchronized_device()

    # -- streams and events ---------------------------------------------------------

    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name
        gpu = vgpu.current()
        return gpu.Stream if gpu is not None else super().Stream

    def stream(self, stream):
        gpu = vgpu.current()
        return gpu.stream(stream) if gpu is not None else super().stream(stream)

    def current_stream(self, device_index=None):
        gpu = vgpu.current()
        return gpu.current_stream() if gpu is not None else super().current_stream(device_index)

    def default_stream(self, device_index=None):
        gpu = vgpu.current()
        return gpu.default_stream() if gpu is not None else super().default_stream(device_index)

    @property
    def Event(self):  # noqa: N802 - DeepSpeed's name
        gpu = vgpu.current()
        return gpu.Event if gpu is not None else super().Event

    def synchronize(self, device_index=None):
        gpu = vgpu.current()
        return gpu.synchronize() if gpu is not None else super().synchronize(device_index)

    # -- memory: the caching-allocator model's statistics ---------------------------

    def _device(self, name: str, device_index, *args):
        """The virtual GPU's ``name`` (torch.cuda's API), else the CPU accelerator's."""
        gpu = vgpu.current()
        return getattr(gpu, name)(*args) if gpu is not None else getattr(super(), name)(device_index, *args)

    def memory_stats(self, device_index=None):
        return self._device("memory_stats", device_index)

    def memory_allocated(self, device_index=None):
        return self._device("memory_allocated", device_index)

    def max_memory_allocated(self, device_index=None):
        return self._device("max_memory_allocated", device_index)

    def memory_reserved(self, device_index=None):
        return self._device("memory_reserved", device_index)

    def max_memory_reserved(self, device_index=None):
        return self._device("max_memory_reserved", device_index)

    def memory_cached(self, device_index=None):
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index=None):
        return self.max_memory_reserved(device_index)

    def reset_peak_memory_stats(self, device_index=None):
        return self._device("reset_peak_memory_stats", device_index)

    def reset_max_memory_allocated(self, device_index=None):
        return self.reset_peak_memory_stats(device_index)

    def reset_max_memory_cached(self, device_index=None):
        return self.reset_peak_memory_stats(device_index)

    def empty_cache(self):
        gpu = vgpu.current()
        return gpu.empty_cache() if gpu is not None else super().empty_cache()

    def total_memory(self, device_index=None):
        gpu = vgpu.current()
        return gpu.preset.memory_bytes if gpu is not None else super().total_memory(device_index)

    def available_memory(self, device_index=None):
        if vgpu.current() is None:
            return super().available_memory(device_index)
        return self.total_memory() - self.memory_reserved()


def install() -> None:
    """Make :class:`VirtualGpuAccelerator` DeepSpeed's accelerator (once per process), where
    DeepSpeed would pick its CPU accelerator anyway; a CUDA machine keeps its own."""
    current = get_accelerator()
    if isinstance(current, VirtualGpuAccelerator) or current.device_name() != "cpu":
        return
    accelerator = VirtualGpuAccelerator()
    accelerator._communication_backend_name = current.communication_backend_name()
    set_accelerator(accelerator)
