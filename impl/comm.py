"""Collectives for the impl engines: asynchronous, labelled for the profiler, and
optionally slowed down to emulate a given interconnect.

Every collective the impl engines issue goes through this module, so that

* each one runs under ``record_function("impl::<name>")`` and each wait under
  ``record_function("impl::wait_<name>")``: traces can be read back by name;
* each returns a :class:`Handle` that the caller waits on when it needs the data, so
  that a collective issued early (a prefetch, a gradient reduction) really is in
  flight while the caller computes (gloo runs collectives on its own threads; NCCL on
  its own stream);
* the interconnect can be emulated. See [Note: interconnect emulation].

[Note: interconnect emulation]
On a 2-core machine gloo's copies compete with compute for the same cores, so the
effect of prefetching or of the all-gather rate limiter is hard to see. With
emulation on, a collective of ``nbytes`` is not complete before
``latency + wire_bytes / bandwidth`` seconds after it was issued, where
``wire_bytes`` follows the ring algorithm's bus traffic (nccl-tests convention:
(n-1)/n of the buffer for all-gather and reduce-scatter, 2(n-1)/n for all-reduce,
the whole buffer for broadcast). The extra time is spent *sleeping* in ``wait()``,
not burning a core, so compute issued in between really does hide it. Emulation
only ever adds time; it never makes a collective faster than the real one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class InterconnectEmulation:
    """An interconnect slower than the real one, for studying overlap on small machines."""

    bandwidth_gbps: float
    """Bus bandwidth in GB/s (10^9 bytes per second)."""
    latency_us: float = 0.0
    """Fixed cost of each collective, in microseconds."""

    def __post_init__(self):
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps}")
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")

    def duration_s(self, kind: str, nbytes: int, world_size: int) -> float:
        n = max(world_size, 1)
        factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}.get(kind, 1.0)
        return self.latency_us * 1e-6 + factor * nbytes / (self.bandwidth_gbps * 1e9)


# Process-wide setting: the harness turns it on for a cell, tests for a block of code.
_emulation: InterconnectEmulation | None = None


def set_emulation(emulation: InterconnectEmulation | None) -> None:
    global _emulation
    _emulation = emulation


def get_emulation() -> InterconnectEmulation | None:
    return _emulation


class Handle:
    """A collective in flight. ``wait()`` blocks until its result may be used."""

    __slots__ = ("_work", "kind", "nbytes", "_not_before", "_waited")

    def __init__(self, work, kind: str, nbytes: int, not_before: float):
        self._work = work  # dist.Work, or None when the collective ran synchronously
        self.kind = kind
        self.nbytes = nbytes
        self._not_before = not_before  # monotonic time before which emulation holds the result
        # Waiting again is a no-op, and records no second "impl::wait_*" span: trace
        # analysis counts each such span as one collective completing.
        self._waited = False

    def is_completed(self) -> bool:
        real = self._work is None or self._work.is_completed()
        return real and time.monotonic() >= self._not_before

    def wait(self) -> None:
        if self._waited:
            return
        with record_function(f"impl::wait_{self.kind}"):
            if self._work is not None:
                self._work.wait()
                self._work = None
            remaining = self._not_before - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)
        self._waited = True


def _start(kind: str, nbytes: int, group) -> float:
    if _emulation is None:
        return 0.0
    return time.monotonic() + _emulation.duration_s(kind, nbytes, dist.get_world_size(group))


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = True) -> Handle:
    """Gather equal 1-D shards ``input`` from every rank into ``output`` (rank order)."""
    nbytes = output.numel() * output.element_size()
    with record_function("impl::all_gather"):
        not_before = _start("all_gather", nbytes, group)
        work = _all_gather_single(output, input, group=group, async_op=async_op)
    handle = Handle(work, "all_gather", nbytes, not_before)
    if not async_op:
        handle.wait()
    return handle


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = True
) -> Handle:
    """Reduce ``input`` (1-D, world_size * output.numel()) across ranks; keep this rank's chunk."""
    nbytes = input.numel() * input.element_size()
    with record_function("impl::reduce_scatter"):
        not_before = _start("reduce_scatter", nbytes, group)
        work = _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    handle = Handle(work, "reduce_scatter", nbytes, not_before)
    if not async_op:
        handle.wait()
    return handle


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = True) -> Handle:
    nbytes = tensor.numel() * tensor.element_size()
    with record_function("impl::all_reduce"):
        not_before = _start("all_reduce", nbytes, group)
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    handle = Handle(work, "all_reduce", nbytes, not_before)
    if not async_op:
        handle.wait()
    return handle


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = True) -> Handle:
    """Broadcast from global rank ``src``."""
    nbytes = tensor.numel() * tensor.element_size()
    with record_function("impl::broadcast"):
        not_before = _start("broadcast", nbytes, group)
        work = dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    handle = Handle(work, "broadcast", nbytes, not_before)
    if not async_op:
        handle.wait()
    return handle
