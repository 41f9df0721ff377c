"""Streams and events for the impl engines: real CUDA streams on a GPU, in-order
execution on CPU, through one code path.

[Note: streams]
On a GPU the CPU thread only *enqueues* work; each stream runs its queue in order and
streams run concurrently. If every collective were issued from the compute stream, a
prefetched all-gather would queue behind all compute already issued and overlap
nothing. So, as PyTorch 1.13's FSDP does, the engines use three streams:

* ``compute``: the stream the caller runs on (forward, backward, optimizer).
* ``unshard``: all-gathers. Before one starts, the unshard stream waits on
  ``params_ready``, an event recorded on the compute stream at the root's pre-forward:
  the sharded parameters are ready once the optimizer step queued before it is done.
  Nothing later on compute is waited for, so a prefetched all-gather overlaps the
  compute queued before it. Before compute uses the unsharded parameters it waits on an
  event recorded on the unshard stream after the all-gather.
* ``post_backward``: gradient reduce-scatters (and CPU offload's device-to-host copy).
  It waits on an event recorded on the compute stream once the gradient is produced;
  compute waits on an event recorded after the reduction before it reads the result.

Buffer lifetimes across streams. The caching allocator ties a block to the stream it
was allocated on and reuses it for that stream as soon as it is freed, regardless of
other streams. The rules used here:

* the unsharded parameter buffer is allocated on the unshard stream that writes it,
  and read on compute: before it is freed, ``record_stream(compute)``, so its memory
  goes back to the unshard stream's pool only once compute has passed the free. This
  is why the CPU thread running ahead of the GPU holds memory (every freed-but-not-yet-
  computed unit stays allocated) and why ``limit_all_gathers`` bounds it with events
  (rate_limiter.py);
* all-gather inputs (a cast or host-to-device copy of the shard) and reduce-scatter
  outputs are allocated *on the stream that uses them* (inside ``streams.on(...)``);
* the unsharded gradient comes from autograd on compute and is consumed by the
  post-backward stream: ``record_stream(post_backward)`` so its memory is not reused
  while the reduce-scatter still reads it;
* a reduced gradient handed to compute (it becomes ``.grad``) gets
  ``record_stream(compute)``.

On CPU a "stream" is the calling thread: every operation runs when it is issued, and
collectives' ``wait()`` blocks the host. Events and waits are no-ops there, but they
are logged in issue order (``Streams.log``) so tests can check that the engines wait
on what they should, in the order they should, without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from typing import Iterator

import torch

_event_ids = itertools.count()
LOG_LENGTH = 100_000


class CpuEvent:
    """An event on a CPU "stream": already complete when recorded."""

    __slots__ = ("id", "stream")

    def __init__(self, stream: "CpuStream"):
        self.id = next(_event_ids)
        self.stream = stream

    def synchronize(self) -> None:
        """The host "blocks" on it: logged, returns at once."""
        self.stream._log.append(("host_wait", self.stream.name, self.id))

    def query(self) -> bool:
        return True


class CpuStream:
    """The calling thread, named, logging the events recorded and waited on it."""

    def __init__(self, name: str, log: collections.deque):
        self.name = name
        self._log = log

    def record_event(self) -> CpuEvent:
        event = CpuEvent(self)
        self._log.append(("record", self.name, event.id))
        return event

    def wait_event(self, event: CpuEvent) -> None:
        self._log.append(("wait", self.name, event.id))

    def synchronize(self) -> None:
        self._log.append(("synchronize", self.name, None))


# Device modules standing in for torch.cuda on a device type (a virtual GPU on "cpu").
# See [Note: device module].
_ACCELERATORS: dict[str, object] = {}


@contextlib.contextmanager
def use_accelerator(device_type: str, module) -> Iterator[None]:
    """While active, tensors on ``device_type`` run with ``module``'s streams and events.

    [Note: device module]
    Every stream, event and ``record_stream`` of the engines goes through one *device
    module*: ``torch.cuda`` for CUDA tensors. A module with the same API can stand in for
    it on another device type; zerobench's virtual GPU registers itself for "cpu" here,
    so that the engines take their CUDA code path (the same code, with the virtual
    device's clock and allocator) on CPU tensors. As PyTorch's own FSDP resolves its
    ``device_handle`` from the device type.
    """
    previous = _ACCELERATORS.get(device_type)
    _ACCELERATORS[device_type] = module
    try:
        yield
    finally:
        if previous is None:
            _ACCELERATORS.pop(device_type, None)
        else:
            _ACCELERATORS[device_type] = previous


def accelerator(device: torch.device | str):
    """The device module of ``device`` (``torch.cuda``, or what stands in for it), or None
    for a device with no queue of its own (plain CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda
    return _ACCELERATORS.get(device.type)


class Streams:
    """The compute, unshard and post-backward streams of one engine on one device."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        # The device module (torch.cuda or a stand-in); None on plain CPU.
        self.module = accelerator(self.device)
        # True when the device has stream queues of its own: the CUDA code path.
        self.cuda = self.module is not None
        # (action, stream, event id) on CPU, in issue order, the latest LOG_LENGTH only (a
        # long run must not grow it without bound); stays empty on CUDA.
        self.log: collections.deque = collections.deque(maxlen=LOG_LENGTH)
        # Recorded on compute at the root's pre-forward: the sharded parameters are ready.
        self.params_ready = None
        if self.cuda:
            m = self.module
            self.compute = m.current_stream(self.device)
            self.unshard = m.Stream(self.device)
            self.post_backward = m.Stream(self.device)
        else:
            self.compute = CpuStream("compute", self.log)
            self.unshard = CpuStream("unshard", self.log)
            self.post_backward = CpuStream("post_backward", self.log)

    def record(self, stream) -> object:
        """An event marking everything enqueued on ``stream`` so far."""
        if self.cuda:
            event = self.module.Event()
            event.record(stream)
            return event
        return stream.record_event()

    def wait(self, stream, event) -> None:
        """Work enqueued on ``stream`` from now on runs after ``event``."""
        stream.wait_event(event)

    @contextlib.contextmanager
    def on(self, stream) -> Iterator[None]:
        """Make ``stream`` current: kernels, collectives and allocations go to it."""
        if self.cuda:
            with self.module.stream(stream):
                yield
        else:
            yield

    def hand_over(self, tensor: torch.Tensor | None, stream) -> None:
        """``tensor`` (allocated on another stream) is used by ``stream`` too."""
        if self.cuda and tensor is not None and tensor.device.type == self.device.type:
            tensor.record_stream(stream)

    def name(self, stream) -> str:
        for name in ("compute", "unshard", "post_backward"):
            if getattr(self, name) is stream:
                return name
        return "?"
