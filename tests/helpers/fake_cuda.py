"""A CUDA device faked on a CPU-only build, for code that is written for ``cuda:N``
(``zerobench calibrate``'s sections) and must be tested without one.

[Note: one faked CUDA device]
While :func:`one_cuda_device` is entered, torch believes there is one CUDA device, index 0:

* ``torch.accelerator`` answers ``cuda`` and one device, so that torch's own
  ``init_process_group(device_id=...)`` runs its own checks on the device it is given
  (``distributed_c10d.py``: a CUDA ``device_id`` without an index is refused with
  ``ValueError: Please use a device_id with index.``, as on the H200). The group is then
  made over gloo (this build has no NCCL), bound to that device;
* ``torch.cuda``'s calls that need a driver (``is_available``, ``current_device``,
  ``device_count``, ``set_device``, ``synchronize``, ``get_device_name``, ``get_device_properties``, ``Stream``, ``Event``,
  ``stream``, ``empty_cache``) answer as for one idle device: its streams the CPU's
  stubs, its events timed on the host's clock;
* a ``TorchFunctionMode`` puts every tensor asked for on ``cuda`` on the CPU instead, and
  refuses a CUDA device without an index wherever a tensor is made or moved (``device=``,
  ``.to(...)``), unless told not to: every device calibrate makes has one;
  ``record_stream`` is a no-op (a CPU tensor has no stream to record).

``FakeCuda.process_groups`` lists the ``device_id`` of every ``init_process_group``, and
``FakeCuda.devices`` every CUDA device a tensor was asked for on. ``stop_after_init``
ends the code under test right after its process group is made (raising
:class:`StoppedAfterInit`), where what follows would need a real GPU (FSDP on a CUDA mesh).
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


class UnindexedCudaDevice(ValueError):
    """A CUDA device without an index reached a tensor factory or ``.to``."""


class StoppedAfterInit(Exception):
    """Raised by the faked ``init_process_group`` once the group is made, when asked to stop there."""


def _cuda(value) -> torch.device | None:
    if isinstance(value, torch.device) and value.type == "cuda":
        return value
    if isinstance(value, str) and value.split(":")[0] == "cuda":
        return torch.device(value)
    return None


class _OnCpu(TorchFunctionMode):
    """Tensors asked for on ``cuda:N`` made on the CPU ([Note: one faked CUDA device])."""

    def __init__(self, fake: "FakeCuda", refuse_unindexed: bool):
        super().__init__()
        self.fake = fake
        self.refuse_unindexed = refuse_unindexed

    def _move(self, value):
        device = _cuda(value)
        if device is None:
            return value
        if device.index is None and self.refuse_unindexed:
            raise UnindexedCudaDevice(f"a tensor was asked for on {device!r}: a CUDA device without an index")
        self.fake.devices.append(device)
        return torch.device("cpu")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = self._move(kwargs["device"])
        kwargs.pop("pin_memory", None)  # this build cannot pin
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            args = tuple(self._move(a) for a in args)
            if func is torch.Tensor.cuda:
                return args[0]
        return func(*args, **kwargs)


class _Event:
    """A CUDA event on the host's clock: recorded when ``record`` is called (the faked
    device runs everything at once), ``elapsed_time`` in milliseconds as CUDA's."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None):
        pass

    def elapsed_time(self, end: "_Event") -> float:
        return (end.at - self.at) * 1e3


#: What ``torch.cuda.get_device_properties`` answers for the faked device.
_PROPERTIES = SimpleNamespace(name="Fake GPU", total_memory=80 << 30, multi_processor_count=132, major=9, minor=0)


class FakeCuda:
    def __init__(self, stop_after_init: bool):
        self.stop_after_init = stop_after_init
        self.process_groups: list = []  # device_id of each init_process_group
        self.devices: list[torch.device] = []  # every CUDA device a tensor was asked for on

    def set_device(self, device) -> None:
        """``torch.cuda.set_device``: the one device there is, named with its index."""
        if not (isinstance(device, int) and device == 0 or _cuda(device) == torch.device("cuda", 0)):
            raise ValueError(f"set_device({device!r}): the faked CUDA has one device, cuda:0")

    def init_process_group(self, real):
        def init(backend=None, *args, device_id=None, **kwargs):
            self.process_groups.append(device_id)
            real("gloo", *args, device_id=device_id, **kwargs)  # torch's own checks of device_id
            if self.stop_after_init:
                dist.destroy_process_group()
                raise StoppedAfterInit(f"init_process_group(device_id={device_id!r}) passed")

        return init


@contextlib.contextmanager
def one_cuda_device(stop_after_init: bool = False, refuse_unindexed: bool = True):
    """Enter a CPU-only process where torch sees one CUDA device ([Note: one faked CUDA
    device]); ``refuse_unindexed=False`` lets tensors be made on ``cuda`` without an index
    (as real torch does: the current device), leaving ``init_process_group`` to refuse it."""
    fake = FakeCuda(stop_after_init)
    cuda = torch.cuda
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        patch(mock.patch.object(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda")))
        patch(mock.patch.object(torch.accelerator, "device_count", lambda: 1))
        patch(mock.patch.object(cuda, "is_available", lambda: True))
        patch(mock.patch.object(cuda, "device_count", lambda: 1))
        patch(mock.patch.object(cuda, "current_device", lambda: 0))
        patch(mock.patch.object(cuda, "set_device", fake.set_device))
        patch(mock.patch.object(cuda, "synchronize", lambda device=None: None))
        patch(mock.patch.object(cuda, "empty_cache", lambda: None))
        patch(mock.patch.object(cuda, "get_device_name", lambda device=None: "Fake GPU"))
        patch(mock.patch.object(cuda, "get_device_properties", lambda device=None: _PROPERTIES))
        patch(mock.patch.object(cuda, "Stream", torch.cpu.Stream))
        patch(mock.patch.object(cuda, "Event", _Event))
        patch(mock.patch.object(cuda, "stream", torch.cpu.stream))
        patch(mock.patch.object(torch.Tensor, "record_stream", lambda self, stream: None))
        patch(mock.patch.object(dist, "init_process_group", fake.init_process_group(dist.init_process_group)))
        patch(_OnCpu(fake, refuse_unindexed))
        yield fake
