"""Collectives for the impl engines: asynchronous and labelled for the profiler.

Every collective the impl engines issue goes through this module, so that

* each one runs under ``record_function("impl::<name>")`` and each wait under
  ``record_function("impl::wait_<name>")``: traces can be read back by name;
* each returns a :class:`Handle` that the caller waits on when it needs the data, so
  that a collective issued early (a prefetch, a gradient reduction) really is in
  flight while the caller computes (gloo runs collectives on its own threads; NCCL on
  its own stream).

The interconnect is emulated by the harness for every engine alike, by wrapping the
torch.distributed functions (zerobench/instruments/emulation.py, [Note: emulation]). This module
looks those functions up at each call, so the wrappers see impl's collectives too: a
Handle's wait then also waits out the emulated wire time, inside its
``impl::wait_<name>`` span.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function


# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn). Looked
# up at each call: an emulation installed later replaces them in ``dist``.
def _all_gather_single():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """A collective in flight. ``wait()`` blocks until its result may be used."""

    __slots__ = ("_work", "kind", "nbytes", "_waited")

    def __init__(self, work, kind: str, nbytes: int):
        self._work = work  # dist.Work (or the emulation's), None when the collective ran synchronously
        self.kind = kind
        self.nbytes = nbytes
        # Waiting again is a no-op, and records no second "impl::wait_*" span: trace
        # analysis counts each such span as one collective completing.
        self._waited = False

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._waited:
            return
        with record_function(f"impl::wait_{self.kind}"):
            if self._work is not None:
                self._work.wait()
                self._work = None
        self._waited = True


def _issue(kind: str, buffer: torch.Tensor, start, async_op: bool) -> Handle:
    """Start one collective under its ``impl::<kind>`` label; ``buffer`` is the tensor
    whose size is the collective's (nccl-tests convention). Always issued asynchronously,
    so a synchronous call's whole wait shows as one ``impl::wait_<kind>`` span."""
    nbytes = buffer.numel() * buffer.element_size()
    with record_function(f"impl::{kind}"):
        work = start()
    handle = Handle(work, kind, nbytes)
    if not async_op:
        handle.wait()
    return handle


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = True) -> Handle:
    """Gather equal 1-D shards ``input`` from every rank into ``output`` (rank order)."""
    return _issue("all_gather", output,
                  lambda: _all_gather_single()(output, input, group=group, async_op=True), async_op)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = True
) -> Handle:
    """Reduce ``input`` (1-D, world_size * output.numel()) across ranks; keep this rank's chunk."""
    return _issue("reduce_scatter", input,
                  lambda: _reduce_scatter_single()(output, input, op=op, group=group, async_op=True), async_op)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = True) -> Handle:
    return _issue("all_reduce", tensor, lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True), async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = True) -> Handle:
    """Broadcast from global rank ``src``."""
    return _issue("broadcast", tensor, lambda: dist.broadcast(tensor, src=src, group=group, async_op=True), async_op)
