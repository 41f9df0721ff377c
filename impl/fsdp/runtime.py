"""The hooks that drive FSDP through an iteration, and the state the root shares.

Per unit and iteration (docs/behaviour.md §F2)::

    pre_forward    unshard + wait; forward-prefetch the next unit; install the views
    (module forward)
    post_forward   reshard (free under FULL_SHARD, except the root); hook the outputs
    pre_backward   (first gradient reaching an output) unshard + wait; BACKWARD_PRE prefetch
    (module backward: gradients accumulate into each unsharded parameter's .grad)
    post_backward  (the unit's last parameter has its gradient) reshard; BACKWARD_POST
                   prefetch; start reducing the gradient asynchronously
    end_of_backward (root, once) wait for the reductions, set the sharded .grad, clean up

[Note: reductions in flight]
A unit's reduce-scatter is issued asynchronously in its post-backward hook, so the
next unit's backward computes while it runs. Before issuing a new one, the hook waits
for the first stage of the older ones (as FSDP2 does with its reduce-scatter event):
that wait has had a whole unit's backward to hide behind, and it bounds the unsharded
gradients alive at once to two (the one being reduced and the one just produced)
instead of every unit's. The end of backward waits once for whatever is still in
flight (the last reduce-scatter, and HYBRID_SHARD's cross-replica all-reduces).
"""

from __future__ import annotations

from collections import deque

import torch
from torch.autograd import Variable
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_leaves, tree_map_only

from impl.fsdp.api import BackwardPrefetch, ShardingStrategy, TrainingState
from impl.fsdp.exec_order import ExecutionOrder
from impl.fsdp.rate_limiter import RateLimiter
from impl.streams import Streams


class RootState:
    """What every FSDP instance under one root shares, created at the root's lazy init."""

    def __init__(self, root, instances: list, limiter: RateLimiter, streams: Streams | None = None):
        self.root = root
        self.instances = instances  # every FSDP instance in the tree, root first
        self.limiter = limiter
        # Compute/unshard/post-backward streams of the root's device. See [Note: streams].
        self.streams = streams if streams is not None else Streams(root.compute_device)
        self.exec_order = ExecutionOrder()
        # Reductions in flight, oldest first. See [Note: reductions in flight].
        self.pending_reductions: deque = deque()
        # False inside no_sync(): gradients accumulate unsharded and are not reduced.
        self.sync_gradients = True
        # Whether this backward's end-of-backward callback is already queued.
        self.end_of_backward_queued = False


# -- helpers -------------------------------------------------------------------------


def check_state(instance, *allowed: TrainingState) -> None:
    """Raise the ValueError PyTorch 1.13 raises when a hook or utility runs in the wrong state."""
    if instance.training_state not in allowed:
        names = ", ".join(s.name for s in allowed)
        raise ValueError(f"expected to be in states [{names}] but current state is {instance.training_state.name}")


def frees_after_forward(instance) -> bool:
    """FULL_SHARD (and HYBRID_SHARD) free after forward, except the root, whose
    parameters backward needs first (PyTorch 1.13)."""
    return instance._unit.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD) and (
        not instance._is_root
    )


def frees_after_backward(instance, sync: bool) -> bool:
    strategy = instance._unit.strategy
    if strategy is ShardingStrategy.NO_SHARD:
        return True  # only a mixed-precision copy, if any, is freed
    return sync or strategy is not ShardingStrategy.SHARD_GRAD_OP


def _tensors(obj):
    """The tensors of a (nested) forward output."""
    return [t for t in tree_leaves(obj) if torch.is_tensor(t)]


def cast_floats(obj, dtype: torch.dtype):
    """Cast the floating-point tensors of a (nested) forward input, keeping requires_grad."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, obj)


def to_device(obj, device: torch.device):
    """Move the tensors of a (nested) forward input to the compute device."""
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), obj)


# -- forward ---------------------------------------------------------------------------


def pre_forward(instance, args, kwargs):
    state: RootState = instance._root_state
    if instance._is_root:
        check_state(instance, TrainingState.IDLE)
        # The sharded parameters are ready when what compute has queued so far is done
        # (the optimizer step): all-gathers wait for this event only. See [Note: streams].
        state.streams.params_ready = state.streams.record(state.streams.compute)
        if not state.end_of_backward_queued and state.exec_order.forward_pending_backward:
            # The previous forward had no backward (evaluation): start a new iteration.
            _finish_iteration(state)
        if instance.compute_device.type != "cpu":
            args, kwargs = to_device((args, kwargs), instance.compute_device)
        mp = instance._mixed_precision
        if mp is not None and mp.param_dtype is not None:
            args, kwargs = cast_floats(args, mp.param_dtype), cast_floats(kwargs, mp.param_dtype)
    instance.training_state = TrainingState.FORWARD
    unit = instance._unit
    if unit is None:
        return args, kwargs
    with record_function("impl::fsdp::pre_forward"):
        state.exec_order.record_pre_forward(instance, unit)
        unit.unshard(prefetch=False, ticketed=frees_after_forward(instance))
        unit.wait_for_unshard()
        if instance._forward_prefetch:
            nxt = state.exec_order.next_forward(instance)
            if nxt is not None:
                nxt._unit.unshard(prefetch=True, ticketed=frees_after_forward(nxt))
        unit.handle.use_unsharded_params()
    return args, kwargs


def post_forward(instance, output):
    state: RootState = instance._root_state
    unit = instance._unit
    if unit is not None:
        with record_function("impl::fsdp::post_forward"):
            state.exec_order.record_post_forward(instance)
            unit.reshard(free=frees_after_forward(instance) or not torch.is_grad_enabled())
    if torch.is_grad_enabled():
        hook = _make_pre_backward_hook(instance)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(hook)
    instance.training_state = TrainingState.IDLE
    return output


# -- backward --------------------------------------------------------------------------


def _make_pre_backward_hook(instance):
    def hook(grad):
        pre_backward(instance)
        return None

    return hook


def pre_backward(instance) -> None:
    if instance._ran_pre_backward:
        return
    instance._ran_pre_backward = True
    state: RootState = instance._root_state
    if not state.end_of_backward_queued:
        state.end_of_backward_queued = True
        Variable._execution_engine.queue_callback(lambda: end_of_backward(state))
    instance.training_state = TrainingState.BACKWARD_PRE
    unit = instance._unit
    if unit is None:
        return
    with record_function("impl::fsdp::pre_backward"):
        unit.unshard(prefetch=False)
        unit.wait_for_unshard()
        if instance._backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            _prefetch_backward(state, instance)


def _prefetch_backward(state: RootState, instance) -> None:
    nxt = state.exec_order.next_backward(instance)
    if nxt is not None and not nxt._ran_pre_backward and nxt._unit is not None:
        nxt._unit.unshard(prefetch=True)


def post_backward(instance) -> None:
    """Runs when the unit's parameters have their gradients (hooked on each unsharded
    parameter's gradient accumulation; for parameters that get none, from end_of_backward)."""
    state: RootState = instance._root_state
    check_state(instance, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)
    instance.training_state = TrainingState.BACKWARD_POST
    instance._grads_ready = 0
    unit = instance._unit
    handle = unit.handle
    if not handle.has_unsharded_grads():
        return
    if any(p.grad is not None and p.grad.requires_grad for p in handle.unsharded_params):
        raise RuntimeError("FSDP only works with gradients that don't require gradients")
    with record_function("impl::fsdp::post_backward"):
        unit.reshard(free=frees_after_backward(instance, state.sync_gradients))
        if instance._backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            _prefetch_backward(state, instance)
        if not state.sync_gradients:
            return  # no_sync: the unsharded gradients keep accumulating in each .grad
        grad = handle.take_unsharded_grad()
        with state.streams.on(state.streams.post_backward):
            for _, older in state.pending_reductions:  # See [Note: reductions in flight]
                older.advance()
        state.pending_reductions.append((unit, unit.reduce_grad(grad)))


def end_of_backward(state: RootState) -> None:
    with record_function("impl::fsdp::end_of_backward"):
        for instance in state.instances:
            # Units some of whose parameters got no gradient: their hook never completed.
            if instance._grads_ready and instance._unit is not None:
                post_backward(instance)
        finished = []
        while state.pending_reductions:
            unit, pending = state.pending_reductions.popleft()
            finished.append((unit, unit.finish_reduction(pending)))
        if state.streams.cuda and any(u._pinned_grad is not None for u, _ in finished):
            # CPU offload: the non-blocking copies into pinned memory must land before the
            # optimizer step reads the gradients.
            state.streams.post_backward.synchronize()
        for unit, reduced in finished:
            unit.accumulate_sharded_grad(reduced)
        for instance in state.instances:
            if instance._unit is not None:  # catch-all: frozen or unused units
                instance._unit.reshard(free=frees_after_backward(instance, state.sync_gradients))
            instance.training_state = TrainingState.IDLE
            instance._ran_pre_backward = False
            instance._grads_ready = 0
        state.end_of_backward_queued = False
        _finish_iteration(state)


def _finish_iteration(state: RootState) -> None:
    state.limiter.end_of_backward()
    state.exec_order.end_iteration()
