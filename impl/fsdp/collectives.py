"""The collectives of one unit, as stateless functions over impl.comm.

Every call goes through :mod:`impl.comm`, so each collective and each wait is labelled
for the profiler (``impl::all_gather``, ``impl::wait_reduce_scatter``, ...) and obeys
the interconnect emulation. Nothing here keeps state between calls: the caller holds
the returned handle or :class:`PendingReduction` for as long as the data is in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from impl import comm


def divide_factors(world_size: int) -> tuple[float, float]:
    """(predivide, postdivide) whose product is ``world_size``.

    Dividing part of the average out before the sum and the rest after it keeps
    low-precision gradients from overflowing in the sum or underflowing in the
    division (PyTorch's default FSDP comm hook; not in the 1.13 seed, see
    docs/behaviour.md §F13): ws=2 -> (2, 1), ws=4 -> (2, 2), ws=64 -> (8, 8).
    """
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor), world_size / factor


def all_gather_flat(
    all_gather_output: torch.Tensor, all_gather_input: torch.Tensor, group, group_size: int
) -> comm.Handle | None:
    """Start gathering every rank's ``all_gather_input`` shard into ``all_gather_output``.

    Returns the handle to wait on, or None when the group has one rank (a local copy).
    """
    if group_size == 1:
        all_gather_output.copy_(all_gather_input)
        return None
    return comm.all_gather(all_gather_output, all_gather_input, group=group, async_op=True)


class PendingReduction:
    """One unit's gradient reduction in flight.

    Stages: the reduce-scatter (or, for NO_SHARD, the all-reduce) over the shard group;
    for HYBRID_SHARD then an all-reduce of the shard over the replicate group.
    :meth:`advance` waits for the first stage (which frees the unsharded gradient) and
    starts the second; :meth:`wait` finishes and returns this rank's averaged gradient
    shard in the reduce dtype.
    """

    __slots__ = ("_handle", "_input", "output", "_replicate_group", "_postdivide", "_advanced")

    def __init__(self, handle, reduce_scatter_input, output, replicate_group, postdivide):
        self._handle = handle  # comm.Handle of the stage in flight, or None
        # The gradient being reduced (and its cast, under mixed precision): kept alive
        # until the first stage completes. See [Note: reductions in flight] (runtime.py).
        self._input = reduce_scatter_input
        self.output = output  # 1-D, shard_numel, reduce dtype
        self._replicate_group = replicate_group  # None unless HYBRID_SHARD with >1 replica
        self._postdivide = postdivide
        self._advanced = False

    def advance(self, streams=None) -> None:
        """Finish the first stage on the current stream. With ``streams`` on a device with
        queues, the compute stream then waits for it before the gradient's memory is
        let go, so that compute may reuse that memory at once."""
        if self._advanced:
            return
        self._advanced = True
        if self._handle is not None:
            self._handle.wait()
        if streams is not None and streams.cuda and self._input is not None:
            streams.wait(streams.compute, streams.record(streams.post_backward))
        self._input = None
        self._handle = None
        if self._replicate_group is not None:
            self._handle = comm.all_reduce(self.output, group=self._replicate_group, async_op=True)

    def wait(self, streams=None) -> torch.Tensor:
        self.advance(streams)
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        if self._postdivide != 1:
            self.output.div_(self._postdivide)
        return self.output


def reduce_gradient(
    unsharded_grad: torch.Tensor,
    *,
    sharded: bool,
    shard_group,
    shard_size: int,
    replicate_group,
    reduce_dtype: torch.dtype,
    world_size: int,
) -> PendingReduction:
    """Start averaging ``unsharded_grad`` (1-D, padded, this rank's full-size gradient)
    over ``world_size`` ranks: reduce-scatter in the shard group when ``sharded``, else
    all-reduce; then all-reduce across replicas when ``replicate_group`` is given.

    ``unsharded_grad`` is consumed (divided in place when already in ``reduce_dtype``).
    """
    predivide, postdivide = divide_factors(world_size)
    source = unsharded_grad
    reduce_scatter_input = unsharded_grad.to(reduce_dtype)
    if predivide != 1:
        reduce_scatter_input.div_(predivide)
    if not sharded:
        handle = comm.all_reduce(reduce_scatter_input, group=shard_group, async_op=True) if shard_size > 1 else None
        return PendingReduction(handle, (source,), reduce_scatter_input, replicate_group, postdivide)
    if shard_size == 1:
        return PendingReduction(None, (source,), reduce_scatter_input, replicate_group, postdivide)
    output = torch.empty(
        reduce_scatter_input.numel() // shard_size, dtype=reduce_dtype, device=reduce_scatter_input.device
    )
    handle = comm.reduce_scatter(output, reduce_scatter_input, op=dist.ReduceOp.SUM, group=shard_group, async_op=True)
    return PendingReduction(handle, (source, reduce_scatter_input), output, replicate_group, postdivide)
