"""Batch many small reduce-scatters into few large ones, asynchronously.

The semantics of fairscale's ``ReduceScatterBucketer`` (docs/behaviour.md §Z2.2), with
the collectives made asynchronous: the callback of an input that is not buffered fires
when it is waited, not before the call returns, so the fairscale tests that assert the
early callback (four of its five) fail here by design. See [Note: bucketer semantics].

[Note: bucketer semantics]
``reduce_scatter_async(tensors_per_rank, group, callback_fn)`` takes one tensor per
rank (equal shapes); the reduction's result on this rank — the sum over ranks of
``tensors_per_rank[this rank]`` — is handed to ``callback_fn`` as its first argument.

* **Buffered** iff ``bucket_cap_mb > 0`` and ``numel * world_size * element_size <
  bucket_cap_mb * 2**20`` (strict, docs/behaviour.md §Z2.2): the inputs are copied
  into row ``r`` of an open ``(world_size, shard_capacity)`` bucket, so the caller
  may free them at once. A bucket without room for the next input is issued first.
* **Oversized** inputs are issued at once, alone, *without* issuing the open bucket:
  a large gradient does not wait for small ones, so callbacks may fire out of
  submission order.
* Every issued reduction is asynchronous (an ``impl.comm`` Handle). Its callbacks fire
  when it is waited: at ``flush()`` (issues the open buckets, then waits for
  everything), at ``wait_issued()`` (waits only for what was issued), or earlier,
  opportunistically, once it has completed (checked on every call). fairscale's
  unbucketed path fires the callback before the call returns; here that would block
  backward on every large gradient, which is exactly what stage 2 wants to overlap.
* At most ``max_in_flight`` reductions stay in flight; issuing one more first waits
  for the oldest. This bounds the memory held by bucket buffers to about
  ``(max_in_flight + 1) * bucket_cap_mb`` (the open bucket plus those in flight).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from impl import comm
from impl.streams import Streams

Callback = Callable[[torch.Tensor], Any] | None


@dataclass
class _OpenBucket:
    """A bucket being filled: row r holds what goes to rank r."""

    data: torch.Tensor  # 2D (world_size, shard_capacity)
    offset: int = 0  # columns used so far
    pending: list[tuple[Callback, int, torch.Size]] = field(default_factory=list)  # (callback, column, shape)


@dataclass
class _Issued:
    """A reduce-scatter in flight and what to do once it lands."""

    handle: comm.Handle
    reduce_scatter_input: torch.Tensor  # kept alive until the collective is done
    results: list[tuple[Callback, torch.Tensor]]  # (callback, its view of the output shard)
    streams: Streams


def _rank_rows(tensors_per_rank: list[torch.Tensor]) -> torch.Tensor | None:
    """The inputs as one (ranks, numel) view, when they are consecutive slices of one
    buffer (the usual case: the chunks of one gradient); else None."""
    first = tensors_per_rank[0]
    numel = first.numel()
    base = first.untyped_storage().data_ptr()
    consecutive = all(
        t.is_contiguous()
        and t.untyped_storage().data_ptr() == base
        and t.storage_offset() == first.storage_offset() + rank * numel
        for rank, t in enumerate(tensors_per_rank)
    )
    return first.as_strided((len(tensors_per_rank), numel), (numel, 1)) if consecutive else None


def _rank_major(tensors_per_rank: list[torch.Tensor]) -> torch.Tensor:
    """The inputs back to back as one 1-D tensor; without a copy when they already are
    consecutive slices of one buffer."""
    rows = _rank_rows(tensors_per_rank)
    if rows is not None:
        return rows.view(-1)
    return torch.cat([t.reshape(-1) for t in tensors_per_rank])


class ReduceScatterBucketer:
    """See [Note: bucketer semantics]."""

    def __init__(self, bucket_cap_mb: float = 25.0, max_in_flight: int = 2):
        if bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.bucket_cap_mb = bucket_cap_mb
        self.max_in_flight = max_in_flight
        # One open bucket per (dtype, device, group): inputs of one kind batch together.
        self._open: dict[tuple, _OpenBucket] = {}
        # Issued reductions, oldest first; their callbacks have not fired yet.
        self._in_flight: deque[_Issued] = deque()
        # Reductions run on streams.post_backward (a stream of their own on CUDA), set
        # from the first input's device. See [Note: streams] in impl/streams.py.
        self.streams: Streams | None = None

    # -- sizes ------------------------------------------------------------------------

    def shard_capacity(self, element_size: int, world_size: int) -> int:
        """Elements per rank that one bucket holds (0 when bucketing is off)."""
        if self.bucket_cap_mb <= 0:
            return 0
        return int(self.bucket_cap_mb * 2**20 // (element_size * world_size))

    def is_buffered(self, numel: int, element_size: int, world_size: int) -> bool:
        return self.bucket_cap_mb > 0 and numel * world_size * element_size < self.bucket_cap_mb * 2**20

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_buffered(self) -> int:
        """Inputs waiting in open buckets (not issued yet)."""
        return sum(len(b.pending) for b in self._open.values())

    # -- the paired actions: reduce_scatter_async / flush ---------------------------------

    @torch.no_grad()
    def reduce_scatter_async(self, tensors_per_rank: list[torch.Tensor], group=None, callback_fn: Callback = None) -> None:
        world_size = dist.get_world_size(group)
        if len(tensors_per_rank) != world_size:
            raise ValueError(f"expected {world_size} tensors (one per rank), got {len(tensors_per_rank)}")
        first = tensors_per_rank[0]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors_per_rank):
            raise ValueError("tensors_per_rank must all have the same shape and dtype")
        if self.streams is None:
            self.streams = Streams(first.device)
        self._fire_completed()
        numel = first.numel()
        if not self.is_buffered(numel, first.element_size(), world_size):
            reduce_scatter_input = _rank_major(tensors_per_rank)  # 1D, rank-major
            output = torch.empty(numel, dtype=first.dtype, device=first.device)
            self._issue(reduce_scatter_input, output, [(callback_fn, output.view(first.shape))], group)
            return
        key = (first.dtype, first.device, group)
        bucket = self._open.get(key)
        if bucket is not None and bucket.offset + numel > bucket.data.shape[1]:
            self._issue_open(key)
            bucket = None
        if bucket is None:
            capacity = self.shard_capacity(first.element_size(), world_size)
            bucket = self._open[key] = _OpenBucket(torch.empty(world_size, capacity, dtype=first.dtype, device=first.device))
        target = bucket.data[:, bucket.offset : bucket.offset + numel]
        rows = _rank_rows(tensors_per_rank)
        if rows is not None:  # one copy, not one per rank (1024 kernels a parameter at 1024 ranks)
            target.copy_(rows)
        else:
            for rank, tensor in enumerate(tensors_per_rank):
                target[rank].copy_(tensor.reshape(-1))
        bucket.pending.append((callback_fn, bucket.offset, first.shape))
        bucket.offset += numel

    def flush(self) -> None:
        """Issue every open bucket, then wait for all reductions and fire their callbacks."""
        for key in list(self._open):
            self._issue_open(key)
        self.wait_issued()

    def wait_issued(self) -> None:
        """Wait for the reductions already issued (oldest first); open buckets stay open."""
        while self._in_flight:
            self._complete(self._in_flight.popleft())

    # -- internals --------------------------------------------------------------------

    def _issue_open(self, key: tuple) -> None:
        bucket = self._open.pop(key)
        used = bucket.offset
        reduce_scatter_input = bucket.data[:, :used].contiguous().view(-1)  # 1D, rank-major
        output = torch.empty(used, dtype=bucket.data.dtype, device=bucket.data.device)
        results = [(cb, output[col : col + shape.numel()].view(shape)) for cb, col, shape in bucket.pending]
        self._issue(reduce_scatter_input, output, results, group=key[2])

    def _issue(self, reduce_scatter_input: torch.Tensor, output: torch.Tensor, results, group) -> None:
        while len(self._in_flight) >= self.max_in_flight:
            self._complete(self._in_flight.popleft())
        s = self.streams
        produced = s.record(s.compute)  # the gradient (or the bucket holding it) is written
        # Both were allocated on compute; the reduction stream reads and writes them.
        s.hand_over(reduce_scatter_input, s.post_backward)
        s.hand_over(output, s.post_backward)
        with s.on(s.post_backward):
            s.wait(s.post_backward, produced)
            handle = comm.reduce_scatter(output, reduce_scatter_input, group=group)
        self._in_flight.append(_Issued(handle, reduce_scatter_input, results, s))

    def _fire_completed(self) -> None:
        while self._in_flight and self._in_flight[0].handle.is_completed():
            self._complete(self._in_flight.popleft())

    @staticmethod
    def _complete(issued: _Issued) -> None:
        s = issued.streams
        with s.on(s.post_backward):
            issued.handle.wait()
            done = s.record(s.post_backward)
        s.wait(s.compute, done)  # the callbacks read the output on compute
        for callback, result in issued.results:
            if callback is not None:
                callback(result)
