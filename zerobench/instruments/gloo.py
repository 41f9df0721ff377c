"""What gloo's own collectives hold, for one rank of a fake process group: a layer of the
one interception of collectives (zerobench/instruments/collectives.py) that gives the fake
group's reduce-scatters the buffer gloo's would hold, so an estimate of a gloo run counts
it (zerobench/rank/worlds.py installs it in a FakeWorld modelling gloo)."""

from __future__ import annotations

import torch

from zerobench.instruments.collectives import Layer


class _GlooReduceScatterWork:
    """A fake group's reduce-scatter Work that, once waited, holds what gloo's does.

    gloo (torch 2.13) reduces a copy of the whole input: its Work allocates a buffer of
    the input's size when the collective is issued (on gloo's thread) and keeps it until
    the Work is dropped; ``wait()`` then splits it on the waiting thread and copies this
    rank's chunk into the output. The storage tracker, which sees only the waiting
    thread's operators, counts the buffer from that split until the Work is dropped, and
    so does this Work: ``wait()`` allocates it, and it lives as long as the Work.
    """

    def __init__(self, work, input_tensor: torch.Tensor | None):
        self._work = work
        self._input = input_tensor
        self._buffer = None

    def wait(self, timeout=None) -> bool:
        if self._buffer is None and self._input is not None:
            self._work.wait()
            self._buffer = torch.empty(self._input.numel(), dtype=self._input.dtype, device=self._input.device)
            self._input = None
        return True

    def __getattr__(self, name):  # is_completed, get_future, exception, ...: the fake group's
        return getattr(self._work, name)


class GlooReduceScatterBuffers(Layer):
    """A collective layer ([Note: one interception] in zerobench/instruments/collectives.py)
    that gives the fake group's reduce-scatters the buffer gloo's hold. A synchronous call
    is waited at once and its Work dropped on return, as gloo's is."""

    def issue(self, call, issue):
        work = issue()
        if call.name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            return _GlooReduceScatterWork(work, call.input())
        return work
