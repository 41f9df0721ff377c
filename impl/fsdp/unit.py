"""One communication unit: a flat parameter and the collectives that move it.

``unshard`` starts the all-gather (or queues it behind the rate limiter),
``wait_for_unshard`` makes the gathered parameters usable, ``reshard`` frees them, and
``reduce_grad`` starts averaging the unit's gradient. Which of these runs when is the
business of the hooks (runtime.py); this class only knows how.
"""

from __future__ import annotations

import torch
from torch.autograd.profiler import record_function

from impl.fsdp import collectives
from impl.fsdp.api import MixedPrecision, ShardingStrategy
from impl.fsdp.flat_param import FlatParamHandle, ShardedState
from impl.fsdp.rate_limiter import RateLimiter
from impl.streams import Streams

_SHARDED = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.HYBRID_SHARD,
    ShardingStrategy._HYBRID_SHARD_ZERO2,
)


class FlatParamUnit:
    """The flat parameter of one FSDP instance and its communication."""

    def __init__(
        self,
        handle: FlatParamHandle,
        strategy: ShardingStrategy,
        shard_group,
        replicate_group,
        world_size: int,
        mixed_precision: MixedPrecision | None,
    ):
        self.handle = handle
        self.strategy = strategy
        self.shard_group = shard_group  # all-gathers and reduce-scatters run here
        self.replicate_group = replicate_group  # HYBRID_SHARD's cross-replica all-reduce, else None
        # Ranks in shard_group: equals handle.shard_world when sharded; NO_SHARD keeps the
        # whole flat parameter (shard_world 1) and all-reduces over the group.
        self.group_size = torch.distributed.get_world_size(shard_group)
        self.world_size = world_size  # ranks the gradient is averaged over (shard x replicate)
        self.mp = mixed_precision
        # Position among the units of the root's tree, set at lazy init; identical on
        # every rank, named by the order check.
        self.index = -1
        # Set at lazy init to the root's limiter, shared by every unit under it.
        self.limiter: RateLimiter | None = None
        # Set at lazy init to the root's streams (made here only if used before that).
        # See [Note: streams].
        self._streams: Streams | None = None
        # CPU offload on an accelerator: a pinned host buffer for the reduced gradient
        # shard, reused every iteration. See [Note: offloaded gradients] (runtime.py).
        self._pinned_grad: torch.Tensor | None = None
        # The all-gather in flight, while UNSHARDING.
        self._all_gather: collectives.comm.Handle | None = None
        # Its input (a low-precision copy of the shard under mixed precision): must stay
        # alive until the gather completes.
        self._all_gather_input: torch.Tensor | None = None
        # Whether the gather in flight holds a limiter ticket, and whether the limiter held
        # it back (then waiting for it counts as a limiter stall).
        self._ticketed = False
        self._was_deferred = False
        self._reduce_dtype = (mixed_precision.effective_reduce_dtype if mixed_precision else None) or handle.dtype
        # Whether the current iteration runs in full precision despite mixed precision
        # (FSDP_USE_FULL_PREC_IN_EVAL in evaluation; see use_full_precision).
        self.full_precision = False

    @property
    def streams(self) -> Streams:
        if self._streams is None:
            self._streams = Streams(self.handle.device)
        return self._streams

    @streams.setter
    def streams(self, streams: Streams) -> None:
        self._streams = streams

    @property
    def sharded(self) -> bool:
        return self.strategy in _SHARDED

    @property
    def state(self) -> ShardedState:
        return self.handle.sharded_state

    def use_full_precision(self, full: bool) -> None:
        """[Note: full precision in evaluation]
        With the environment variable ``FSDP_USE_FULL_PREC_IN_EVAL=1`` (read at
        construction, as PyTorch's FSDP1 reads it), a module under mixed precision that is
        not training computes, reduces and keeps its gradients in full precision, and its
        buffers are in their original dtypes (runtime.py switches those), as in PyTorch
        2.x. Switching changes the dtype of the unsharded parameters, so a unit still
        holding them in the other dtype (a forward prefetch issued under the previous
        mode) frees them first and gathers again."""
        dtype = self.handle.dtype if full else self.handle.mixed_compute_dtype
        if self.handle.compute_dtype != dtype:
            self.reshard(free=True)
            self.handle.set_compute_dtype(dtype)
        self.full_precision = full

    # -- unshard -------------------------------------------------------------------

    def unshard(self, prefetch: bool = False, ticketed: bool = True) -> None:
        """Start making the unsharded parameters available. Returns before they are."""
        h = self.handle
        if h.sharded_state is not ShardedState.SHARDED:
            return
        if not self.sharded:  # NO_SHARD under mixed precision: a local cast, no collective
            h.alloc_unsharded().copy_(h.sharded_flat.detach())
            h.sharded_state = ShardedState.UNSHARDED
            return
        limiter = self.limiter
        if limiter.is_deferred(self):
            if prefetch:
                return
            limiter.cancel(self)
        elif not limiter.admit(self, prefetch, ticketed):
            self._ticketed, self._was_deferred = ticketed, True
            return
        else:
            self._ticketed, self._was_deferred = ticketed, False
        self._issue_all_gather()

    def issue_deferred_all_gather(self) -> None:
        """Called by the limiter when a ticket frees up for this queued prefetch."""
        self._issue_all_gather()

    def _issue_all_gather(self) -> None:
        h = self.handle
        s = self.streams
        self.limiter.before_all_gather()  # CUDA: may block the CPU on an old free's event
        # The shard is ready once the compute recorded at the root's pre-forward (the
        # optimizer step) is done; nothing later on compute is waited for.
        ready = s.params_ready if s.params_ready is not None else s.record(s.compute)
        with s.on(s.unshard):
            s.wait(s.unshard, ready)
            # Output, and the input (cast for mixed precision, copied host-to-device under
            # CPU offload), allocated on the unshard stream. See [Note: streams].
            output = h.alloc_unsharded()
            self._all_gather_input = h.device_shard(output.dtype)
            self._all_gather = collectives.all_gather_flat(
                output, self._all_gather_input, self.shard_group, h.shard_world
            )
        h.sharded_state = ShardedState.UNSHARDING
        self.limiter.on_issue(self, self._ticketed)

    def wait_for_unshard(self) -> None:
        """Block until the unsharded parameters hold the gathered data."""
        h = self.handle
        if h.sharded_state is ShardedState.SHARDED:
            self.unshard(prefetch=False)
        if h.sharded_state is ShardedState.UNSHARDING:
            if self._was_deferred:
                with record_function("impl::rate_limiter_wait"):
                    start = self.limiter.clock()
                    self._wait_all_gather()
                    self.limiter.record_stall(self.limiter.clock() - start)
            else:
                self._wait_all_gather()

    def _wait_all_gather(self) -> None:
        s = self.streams
        with s.on(s.unshard):  # CUDA: the unshard stream waits for the collective
            if self._all_gather is not None:
                self._all_gather.wait()
            gathered = s.record(s.unshard)
        s.wait(s.compute, gathered)
        self._all_gather = None
        self._all_gather_input = None
        self.handle.sharded_state = ShardedState.UNSHARDED

    # -- reshard -------------------------------------------------------------------

    def reshard(self, free: bool) -> None:
        """Free the unsharded parameters if ``free`` (and the strategy ever frees them)."""
        h = self.handle
        if free and self.limiter is not None and self.limiter.is_deferred(self):
            self.limiter.cancel(self)  # a prefetch still queued is no longer wanted
        if not free or h.keeps_unsharded or h.sharded_state is ShardedState.SHARDED:
            return
        if h.sharded_state is ShardedState.UNSHARDING:  # prefetched but unused: let the write land
            self._wait_all_gather()
        s = self.streams
        if h.unsharded_allocated:  # its memory is not reused before compute is done with it
            s.hand_over(h.all_gather_output, s.compute)
        h.free_unsharded()
        h.sharded_state = ShardedState.SHARDED
        if self.sharded:
            # Event mode only (CUDA): the limiter bounds the host's lead with it.
            self.limiter.on_free(self, s.record(s.compute) if self.limiter.wants_free_events else None)

    # -- gradients -----------------------------------------------------------------

    def reduce_grad(self, unsharded_grad: torch.Tensor) -> collectives.PendingReduction:
        """Start averaging this rank's unsharded gradient (1-D, padded) across ranks, on
        the post-backward stream once the gradient is produced.

        The gradient was allocated on compute and is read on post-backward. It is not
        handed over with ``record_stream``: the pending reduction keeps it alive, and
        compute waits for the reduction before letting it go (``advance_reduction``), so
        its memory is free as soon as the reference is dropped. See [Note: reductions in
        flight] in runtime.py."""
        s = self.streams
        produced = s.record(s.compute)
        with s.on(s.post_backward):
            s.wait(s.post_backward, produced)
            return collectives.reduce_gradient(
                unsharded_grad,
                sharded=self.sharded,
                shard_group=self.shard_group,
                shard_size=self.group_size,
                replicate_group=self.replicate_group,
                reduce_dtype=self.reduce_dtype,
                world_size=self.world_size,
            )

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are averaged in this iteration (full precision under
        [Note: full precision in evaluation])."""
        return self.handle.dtype if self.full_precision else self._reduce_dtype

    @property
    def offloads_grads(self) -> bool:
        """Whether reduced gradient shards go to pinned host memory (CPU offload on an
        accelerator)."""
        return self.handle.offloaded and self.streams.cuda

    def advance_reduction(self, pending: collectives.PendingReduction) -> None:
        """Finish the first stage of an older reduction, letting its gradient go."""
        s = self.streams
        with s.on(s.post_backward):
            pending.advance(s)

    def finish_reduction(self, pending: collectives.PendingReduction) -> torch.Tensor:
        """Wait for a reduction on the post-backward stream; return the reduced shard.

        Under CPU offload on an accelerator the shard is copied, non-blocking, into a
        pinned host buffer on the post-backward stream, and the device copy is let go at
        once (it was allocated on that stream); the caller synchronises the post-backward
        stream before the optimizer step reads it. See [Note: offloaded gradients]."""
        s = self.streams
        with s.on(s.post_backward):
            reduced = pending.wait(s)
            if s.cuda and self.handle.offloaded:
                pinned = self._pinned_grad
                if pinned is None or pinned.numel() != reduced.numel() or pinned.dtype != reduced.dtype:
                    pinned = self._pinned_grad = torch.empty(
                        reduced.numel(), dtype=reduced.dtype, device="cpu", pin_memory=True
                    )
                pinned.copy_(reduced, non_blocking=True)
                return pinned
            done = s.record(s.post_backward)
        s.wait(s.compute, done)
        s.hand_over(reduced, s.compute)  # it becomes .grad, used and freed on compute
        return reduced

    def accumulate_sharded_grad(self, reduced: torch.Tensor) -> None:
        """Store a reduced gradient shard as ``sharded_flat.grad`` (adding to an existing one)."""
        param = self.handle.sharded_flat
        low = (self.mp is not None and self.mp.keep_low_precision_grads and self.mp.param_dtype is not None
               and not self.full_precision)
        grad_dtype = self.mp.param_dtype if low else param.dtype
        if reduced.dtype != grad_dtype:
            reduced = reduced.to(grad_dtype)
        if reduced.device != param.device:  # a device shard for a host parameter: copy it over
            reduced = reduced.to(param.device)
        if param.grad is None:
            reduced = reduced.clone() if reduced is self._pinned_grad else reduced
            if reduced.dtype == param.dtype:
                param.grad = reduced
            else:  # keep_low_precision_grads: a low-precision .grad, set through .data as FSDP1 does
                param.grad = torch.empty_like(param)
                param.grad.data = reduced
        else:
            param.grad.add_(reduced.to(param.grad.dtype))  # in place: .grad may be low precision
