"""DDP communication hooks that run impl's ZeroRedundancyOptimizer step inside backward.

``ddp.register_comm_hook(state, hook_with_zero_step(allreduce_hook, ddp, zero))`` with
``zero = ZeroRedundancyOptimizer(..., overlap_with_ddp=True)``: PyTorch 1.13's contract
(``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook``), against impl's
optimizer. The wrapped ``hook`` (usually ``default_hooks.allreduce_hook``) still reduces
each bucket; the optimizer step and the parameter broadcasts ride on it:

* ``hook_with_zero_step``: backward computes contiguously; in the last bucket's hook
  each rank waits for the all-reduces of the buckets it owns, steps them with its
  functional optimizer, and every bucket's owner broadcasts it. The step overlaps the
  still outstanding all-reduces and the other broadcasts.
* ``hook_with_zero_step_interleaved``: a bucket's step runs as soon as its all-reduce
  completes (a callback on the all-reduce's future), while backward goes on computing
  the next buckets.

The first iterations only reduce (see impl/zero/overlap.py): nothing is updated until
DDP has rebuilt its buckets and one iteration has recorded them.

Differences from PyTorch (docs/zero.md): gloo is supported (torch refuses it because
its interleaved hook can hang there). To keep every rank's collectives in one order,
which gloo needs, the interleaved hook's callbacks only compute: the broadcasts are
issued from the autograd thread, in bucket order, at the end of backward.
"""

# No `from __future__ import annotations`: DDP checks the hooks' annotations at run time
# (the bucket must be annotated as dist.GradBucket, not as a string).

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from impl import comm
from impl.zero.optimizer import ZeroRedundancyOptimizer
from impl.zero.overlap import OverlapStatus

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def _check(zero: ZeroRedundancyOptimizer, shard_buckets: bool) -> None:
    if not zero._overlap_with_ddp:
        raise ValueError("ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use this hook properly")
    if shard_buckets:
        zero._overlap_info.shard_buckets = True
        zero._overlap_info.total_size = 0


def _setup(ddp_ref: weakref.ReferenceType, zero: ZeroRedundancyOptimizer, bucket: dist.GradBucket) -> None:
    """The deferred initialization's state machine, advanced once per bucket."""
    info = zero._overlap_info
    if not ddp_ref()._has_rebuilt_buckets:
        if info.status is not OverlapStatus.UNINITIALIZED:
            raise AssertionError("DDP rebuilt its buckets again after ZeroRedundancyOptimizer recorded them")
        return
    if info.status is OverlapStatus.UNINITIALIZED:
        info.status = OverlapStatus.DDP_HAS_REBUILT_BUCKETS
    if info.status is OverlapStatus.DDP_HAS_REBUILT_BUCKETS:
        if bucket.index() == 0 and info.params_per_bucket:
            zero._init_zero_for_overlap()  # the second time round: every bucket is recorded
        else:
            params = bucket.parameters()
            if not params:
                raise AssertionError("Empty bucket")
            info.params_per_bucket.append(params)
            if info.shard_buckets:
                info.total_size += sum(p.numel() for p in params)


def _local_step(bucket: dist.GradBucket, zero: ZeroRedundancyOptimizer) -> None:
    """Step the parameters of ``bucket`` this rank owns with the bucket's (reduced) gradients."""
    info = zero._overlap_info
    index = bucket.index()
    if len(zero.optim.param_groups) != 1:
        raise AssertionError("Overlapping DDP with ZeRO only supports a single parameter group")
    if index not in info.offsets:
        raise AssertionError(f"Bucket index {index} was not assigned to rank {zero.rank}")
    gradients: list[torch.Tensor | None] = [None] * len(zero.optim.param_groups[0]["params"])
    assignment = zero._bucket_assignments_per_rank[zero.rank][index]
    start = info.offsets[index]
    owned = bucket.gradients()[assignment.offset : assignment.offset + len(assignment.parameters)]
    gradients[start : start + len(owned)] = owned
    zero._local_step(gradients)


def _broadcast_bucket(index: int, zero: ZeroRedundancyOptimizer) -> None:
    """Every assignment of bucket ``index``, broadcast from its owner (asynchronously)."""
    info = zero._overlap_info
    owners = sorted(info.assigned_ranks_per_bucket[index])
    if not owners:
        raise AssertionError(f"Bucket {index} should be assigned to at least one rank")
    for owner in owners:
        tensor = zero._bucket_assignments_per_rank[owner][index].tensor
        src = dist.get_global_rank(zero.process_group, owner)
        info.broadcast_handles.append(comm.broadcast(tensor, src=src, group=zero.process_group))


def _owns(zero: ZeroRedundancyOptimizer, index: int) -> bool:
    return zero.rank in zero._overlap_info.assigned_ranks_per_bucket[index]


def _check_order(zero: ZeroRedundancyOptimizer, index: int) -> None:
    seen = zero._overlap_info.bucket_indices_seen
    if seen and seen[-1] != index - 1:
        raise AssertionError("Bucket indices are not in incremental order")
    if not seen and index != 0:
        raise AssertionError("Bucket indices do not start from 0")
    seen.append(index)


def _overlapped_hook(name: str, hook: Hook, ddp, zero: ZeroRedundancyOptimizer, shard_buckets: bool,
                     on_bucket: Callable[..., torch.futures.Future[torch.Tensor]]) -> Hook:
    """The comm hook DDP calls, named ``name``: it runs the wrapped hook and the
    overlap's setup, and once ZeRO steps in hooks (after the warm-up iterations,
    docs/behaviour.md §Z1.8) hands each bucket to ``on_bucket(fut, bucket, index, info)``,
    whose future it returns. Raises ValueError if ``zero`` was not built with
    ``overlap_with_ddp=True``."""
    _check(zero, shard_buckets)
    ddp_ref = weakref.ref(ddp)

    def overlapped(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = hook(state, bucket)
        _setup(ddp_ref, zero, bucket)
        if zero._overlap_info.status is not OverlapStatus.INITIALIZED:
            return fut
        index = bucket.index()
        _check_order(zero, index)
        return on_bucket(fut, bucket, index, zero._overlap_info)

    overlapped.__name__ = overlapped.__qualname__ = name
    return overlapped


def hook_with_zero_step(hook: Hook, ddp, zero: ZeroRedundancyOptimizer, shard_buckets: bool = False) -> Hook:
    """Wrap ``hook`` so that the last bucket's hook runs the optimizer step.

    After the last bucket's all-reduce is issued, each rank waits for the all-reduces of
    the buckets it owns, steps them, and every bucket is broadcast from its owner(s);
    the hook returns once the broadcasts are done. ``shard_buckets``: split buckets
    across ranks to even out the work (impl/zero/overlap.py). Raises ValueError if
    ``zero`` was not built with ``overlap_with_ddp=True``.
    """
    def step_after_last(fut, bucket, index, info):
        if _owns(zero, index):
            info.bucket_index_to_bucket[index] = bucket
            info.bucket_index_to_future[index] = fut
        if index != len(info.params_per_bucket) - 1:
            return fut
        for i in range(len(info.params_per_bucket)):
            if _owns(zero, i):
                if i not in info.bucket_index_to_future:
                    raise AssertionError(f"All-reduce future for bucket {i} not saved on rank {zero.rank}")
                info.bucket_index_to_future[i].wait()
                _local_step(info.bucket_index_to_bucket[i], zero)
            _broadcast_bucket(i, zero)
        info.wait_for_broadcasts()
        info.clear_per_iter_info()
        return fut

    return _overlapped_hook("hook_with_zero_fn", hook, ddp, zero, shard_buckets, step_after_last)


def hook_with_zero_step_interleaved(
    hook: Hook, ddp, zero: ZeroRedundancyOptimizer, shard_buckets: bool = False
) -> Hook:
    """Wrap ``hook`` so that each bucket is stepped as soon as its all-reduce completes.

    The step runs in a callback on the all-reduce's future, overlapping the backward
    computation of the buckets still to come. The broadcasts are issued at the end of
    backward, in bucket order, from the autograd thread (see the module docstring), and
    waited for there. Raises ValueError if ``zero`` was not built with
    ``overlap_with_ddp=True``.
    """
    def step_when_reduced(fut, bucket, index, info):
        if index == 0:
            # Queued before DDP's own finalization (queued when its last bucket is
            # ready); both run on the autograd thread once the graph is done, this first.
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish_interleaved(zero))
        owns = _owns(zero, index)

        def zero_step(done: torch.futures.Future) -> torch.Tensor:
            done.value()  # re-raise a failed all-reduce here
            if owns:
                _local_step(bucket, zero)
            return bucket.buffer()

        stepped = fut.then(zero_step)
        info.bucket_index_to_future[index] = stepped
        return stepped

    return _overlapped_hook("hook_with_zero_interleaved_fn", hook, ddp, zero, shard_buckets, step_when_reduced)


def _finish_interleaved(zero: ZeroRedundancyOptimizer) -> None:
    """End of backward: once each bucket's step is done, broadcast it; then wait."""
    info = zero._overlap_info
    if len(info.bucket_indices_seen) != len(info.params_per_bucket):
        raise AssertionError(f"saw {len(info.bucket_indices_seen)} of {len(info.params_per_bucket)} buckets this iteration")
    for index in range(len(info.params_per_bucket)):
        info.bucket_index_to_future[index].wait()
        _broadcast_bucket(index, zero)
    info.wait_for_broadcasts()
    info.clear_per_iter_info()
