"""The hooks that drive FSDP through an iteration.

Each hook takes the instance's ``FSDPState`` (state.py) and reaches what the tree
shares through its ``root_state``; none needs the module class (fully_sharded.py,
which installs the hooks).

Per unit and iteration (docs/behaviour.md §F2)::

    pre_forward    unshard + wait; forward-prefetch the next unit; install the views
    (module forward)
    post_forward   reshard (free under FULL_SHARD, except the root); hook the outputs
    pre_backward   (first gradient reaching an output) unshard + wait; BACKWARD_PRE prefetch
    (module backward: gradients accumulate into each unsharded parameter's .grad)
    post_backward  (the unit's last parameter has its gradient) reshard; BACKWARD_POST
                   prefetch; start reducing the gradient asynchronously
    end_of_backward (root, once) wait for the reductions, set the sharded .grad, clean up

A forward run again inside backward (activation checkpointing around units) only
unshards and installs the parameters: [Note: recomputed forward].

[Note: reductions in flight]
A unit's reduce-scatter is issued asynchronously in its post-backward hook, so the
next unit's backward computes while it runs. Before issuing a new one, the hook waits
for the first stage of the older ones (as FSDP2 does with its reduce-scatter event):
that wait has had a whole unit's backward to hide behind, and it bounds the unsharded
gradients alive at once to two (the one being reduced and the one just produced)
instead of every unit's. The end of backward waits once for whatever is still in
flight (the last reduce-scatter, and HYBRID_SHARD's cross-replica all-reduces).

On a GPU that bound must hold for memory, not only for Python references: the host
runs ahead of the device, and a gradient handed to the post-backward stream with
``record_stream`` stays allocated, after its reference is dropped, until that stream
has passed the drop -- so with the host far ahead, every unit's gradient would be
alive at once. So the gradient is not handed over with ``record_stream``: the
pending reduction holds it, and when the next unit's post-backward advances it, the
*compute* stream waits on an event recorded after the reduce-scatter before the
reference is dropped (FSDP2 does the same with its reduce-scatter event). Compute
may then reuse the memory at once, and at most two unsharded gradients exist on
the device, at the price of the next unit's compute waiting for the older
reduce-scatter (which had a whole unit's backward to complete).

[Note: offloaded gradients]
Under CPU offload on an accelerator the optimizer steps on the host, so each reduced
gradient shard must reach pinned host memory. Waiting until the end of backward to
copy them would keep every unit's reduced shard on the device until then. Instead,
when a unit's post-backward advances the older reductions, it also finishes the
offloaded ones: on the post-backward stream, wait for the reduction (HYBRID_SHARD's
second stage included), then a non-blocking device-to-host copy into the unit's pinned
buffer; the device shard, allocated on that stream, is then let go. The host does not
wait for any of it: the copies queue behind the reduce-scatters, one unit behind, as
FSDP1's post-backward hook queues its offload copy behind each reduce-scatter. At most
two reduced shards are then on the device at a time. The end of backward finishes the
last one and synchronises the post-backward stream once before the gradients are read.

[Note: NO_SHARD's low-precision copy]
Under NO_SHARD (also what FULL_SHARD becomes on a shard group of one rank, world size
1 included) nothing is gathered, but mixed precision still computes with a copy of
each unit's parameters cast to ``param_dtype``. PyTorch's FSDP1 frees that copy at
every reshard, after forward (the root's too) and after backward, and casts again at
the next unshard (its ``post_reshard`` frees the low-precision shard; ``pre_unshard``
makes it again). impl does the same: the unit's post-forward frees it. Keeping it
from forward to backward instead held a cast copy of the whole model through the
step's peak, which fully_shard never holds: on a Llama 3 8B shape of four layers at
world size 1 under bf16, 3.85 GB, all of what the virtual GPU finds impl holding
beyond fully_shard there, and the size of the excess an H200 measured (docs/fsdp.md,
"Memory against fully_shard"). The cost is one cast per unit in backward, a copy at
memory bandwidth. Without a cast the unsharded parameters are the shard itself and
nothing is freed.
"""

from __future__ import annotations

import functools
from collections import deque

import torch
from torch.autograd import Variable
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_leaves, tree_map_only

from impl.fsdp.api import BackwardPrefetch, ShardingStrategy, TrainingState
from impl.fsdp.state import FSDPState, RootState

# -- helpers -------------------------------------------------------------------------


def check_state(state: FSDPState, *allowed: TrainingState) -> None:
    """Raise the ValueError PyTorch 1.13 raises when a hook or utility runs in the wrong state."""
    if state.training_state not in allowed:
        names = ", ".join(s.name for s in allowed)
        raise ValueError(f"expected to be in states [{names}] but current state is {state.training_state.name}")


def frees_after_forward(state: FSDPState) -> bool:
    """FULL_SHARD (and HYBRID_SHARD) free after forward, except the root, whose
    parameters backward needs first (PyTorch 1.13). SHARD_GRAD_OP and
    _HYBRID_SHARD_ZERO2 keep them until backward. NO_SHARD frees its mixed-precision
    copy, the root's too: See [Note: NO_SHARD's low-precision copy]."""
    strategy = state.unit.strategy
    if strategy is ShardingStrategy.NO_SHARD:
        return True
    return strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD) and not state.is_root


def frees_after_backward(state: FSDPState, sync: bool) -> bool:
    strategy = state.unit.strategy
    if strategy is ShardingStrategy.NO_SHARD:
        return True  # See [Note: NO_SHARD's low-precision copy]
    return sync or strategy not in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)


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


def pre_forward(state: FSDPState, args, kwargs, training: bool):
    """``training``: the module's training flag (the order check runs in training only)."""
    shared: RootState = state.root_state
    if torch._C._current_graph_task_id() != -1:  # inside backward: See [Note: recomputed forward]
        return _pre_recomputed_forward(state, args, kwargs)
    mp = state.mixed_precision
    # See [Note: full precision in evaluation] (unit.py).
    full = state.full_precision_in_eval and not training and mp is not None
    if state.is_root:
        check_state(state, TrainingState.IDLE)
        # The sharded parameters are ready when what compute has queued so far is done
        # (the optimizer step): all-gathers wait for this event only. See [Note: streams].
        shared.streams.params_ready = shared.streams.record(shared.streams.compute)
        if not shared.end_of_backward_queued and shared.exec_order.forward_pending_backward:
            # The previous forward had no backward (evaluation): start a new iteration.
            _finish_iteration(shared)
        for other in shared.states:  # See [Note: use_orig_params]: what the user replaced
            if other.unit is not None and other.unit.handle.orig is not None:
                other.unit.handle.orig.writeback()
        if state.compute_device.type != "cpu":
            args, kwargs = to_device((args, kwargs), state.compute_device)
        _set_buffer_precision(shared, state.full_precision_in_eval and not training)
    if not full and mp is not None and mp.param_dtype is not None and (
        mp.cast_root_forward_inputs if state.is_root else mp.cast_forward_inputs
    ):
        args, kwargs = cast_floats(args, mp.param_dtype), cast_floats(kwargs, mp.param_dtype)
    state.training_state = TrainingState.FORWARD
    unit = state.unit
    if unit is None:
        return args, kwargs
    if unit.handle.sharded_flat.dtype != unit.handle.dtype:  # e.g. model.half() after wrapping
        raise TypeError(
            f"impl.fsdp: a flat parameter built as {unit.handle.dtype} is now {unit.handle.sharded_flat.dtype} "
            "(the module was cast after wrapping, e.g. with .half()); impl does not re-cast its unsharded buffers: "
            "cast the module before wrapping it, or use MixedPrecision(param_dtype=...)"
        )
    with record_function("impl::fsdp::pre_forward"):
        shared.exec_order.record_pre_forward(state, unit, check=training)
        unit.use_full_precision(full)
        unit.unshard(prefetch=False, ticketed=frees_after_forward(state))
        unit.wait_for_unshard()
        if state.forward_prefetch:
            nxt = shared.exec_order.next_forward(state)
            if nxt is not None:
                nxt.unit.unshard(prefetch=True, ticketed=frees_after_forward(nxt))
        unit.handle.sync_requires_grad(functools.partial(post_accumulate_grad, state))
        unit.handle.use_unsharded_params()
    return args, kwargs


def _set_buffer_precision(shared: RootState, full: bool) -> None:
    """Buffers cast by mixed precision: back to their original dtypes for a
    full-precision evaluation, to the mixed-precision dtype otherwise
    ([Note: full precision in evaluation], unit.py)."""
    for state in shared.states:
        for module, name in state.cast_buffers:
            buf = module._buffers[name]
            dtype = state.original_buffer_dtypes[(id(module), name)] if full else state.mixed_precision.buffer_dtype
            if buf is not None and buf.dtype != dtype:
                module._buffers[name] = buf.to(dtype)


def _pre_recomputed_forward(state: FSDPState, args, kwargs):
    """[Note: recomputed forward]
    Activation checkpointing applied around FSDP instances (``apply_activation_checkpointing``
    on a container of units, or ``checkpoint(fsdp_module, x)``) runs their forward again
    during backward, to recompute what it saved. That forward is not a new iteration and
    is not part of the recorded order: like PyTorch's FSDP1 (which skips its pre- and
    post-forward logic for a handle already in BACKWARD_PRE), the unit only needs its
    parameters unsharded and installed. They are when its pre-backward already ran;
    otherwise they are gathered here (every rank recomputes the same region, so the
    collectives match). They then stay unsharded until the unit's own backward reshards
    them (or the end of backward, for a unit that gets no gradient), since the backward
    of the recomputed operations uses them. The unsharded parameters are the same tensor
    objects at every unshard, so what the recomputation saved stays valid.
    Non-reentrant checkpointing only reads the recomputed values; reentrant
    checkpointing runs backward through the recomputed outputs, which carry the usual
    pre-backward hook."""
    mp = state.mixed_precision
    if mp is not None and mp.param_dtype is not None and (
        mp.cast_root_forward_inputs if state.is_root else mp.cast_forward_inputs
    ):
        args, kwargs = cast_floats(args, mp.param_dtype), cast_floats(kwargs, mp.param_dtype)
    state.recomputing = True
    unit = state.unit
    if unit is None:
        return args, kwargs
    with record_function("impl::fsdp::pre_forward"):
        unit.unshard(prefetch=False)  # nothing to do when already unsharded
        unit.wait_for_unshard()
        unit.handle.use_unsharded_params()
    return args, kwargs


def post_forward(state: FSDPState, output):
    shared: RootState = state.root_state
    unit = state.unit
    if state.recomputing:  # See [Note: recomputed forward]
        state.recomputing = False
        _hook_outputs(state, output)
        return output
    if unit is not None:
        with record_function("impl::fsdp::post_forward"):
            shared.exec_order.record_post_forward(state)
            unit.reshard(free=frees_after_forward(state) or not torch.is_grad_enabled())
            unit.handle.use_orig_param_attributes()
    _hook_outputs(state, output)
    state.training_state = TrainingState.IDLE
    return output


def _hook_outputs(state: FSDPState, output) -> None:
    """Run the unit's pre-backward when the first gradient reaches one of its outputs."""
    if torch.is_grad_enabled():
        hook = _make_pre_backward_hook(state)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(hook)


# -- backward --------------------------------------------------------------------------


def _make_pre_backward_hook(state: FSDPState):
    def hook(grad):
        pre_backward(state)
        return None

    return hook


def pre_backward(state: FSDPState) -> None:
    if state.ran_pre_backward:
        return
    state.ran_pre_backward = True
    shared: RootState = state.root_state
    if not shared.end_of_backward_queued:
        shared.end_of_backward_queued = True
        Variable._execution_engine.queue_callback(lambda: end_of_backward(shared))
    state.training_state = TrainingState.BACKWARD_PRE
    unit = state.unit
    if unit is None:
        return
    with record_function("impl::fsdp::pre_backward"):
        unit.unshard(prefetch=False)
        unit.wait_for_unshard()
        unit.handle.use_unsharded_params()  # a checkpointed forward may run again in backward
        if state.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            _prefetch_backward(shared, state)


def _prefetch_backward(shared: RootState, state: FSDPState) -> None:
    nxt = shared.exec_order.next_backward(state)
    if nxt is not None and not nxt.ran_pre_backward and nxt.unit is not None:
        nxt.unit.unshard(prefetch=True)


def post_accumulate_grad(state: FSDPState, _param: torch.Tensor) -> None:
    """Hooked on each unsharded parameter's gradient accumulation: one of the unit's
    parameters has its gradient; the unit's post-backward runs with the last one (or,
    for parameters that get none, at the end of backward)."""
    state.grads_ready += 1
    if state.grads_ready == state.unit.handle.requires_grad_count:
        post_backward(state)


def post_backward(state: FSDPState) -> None:
    """Runs when the unit's parameters have their gradients (from post_accumulate_grad;
    for parameters that get none, from end_of_backward)."""
    shared: RootState = state.root_state
    check_state(state, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)
    state.training_state = TrainingState.BACKWARD_POST
    state.grads_ready = 0
    unit = state.unit
    handle = unit.handle
    if not handle.has_unsharded_grads():
        return
    if any(p.grad is not None and p.grad.requires_grad for p in handle.unsharded_params):
        raise RuntimeError("FSDP only works with gradients that don't require gradients")
    with record_function("impl::fsdp::post_backward"):
        unit.reshard(free=frees_after_backward(state, shared.sync_gradients))
        if state.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            _prefetch_backward(shared, state)
        if not shared.sync_gradients:
            return  # no_sync: the unsharded gradients keep accumulating in each .grad
        grad = handle.take_unsharded_grad(unit.reduce_dtype)
        for older_unit, older in shared.pending_reductions:  # See [Note: reductions in flight]
            older_unit.advance_reduction(older)
        _offload_older_reductions(shared)
        shared.pending_reductions.append((unit, unit.reduce_grad(grad)))


def _offload_older_reductions(shared: RootState) -> None:
    """Under CPU offload, start the older reductions' copies to host memory now, one unit
    behind their reduce-scatter. See [Note: offloaded gradients]."""
    if not any(unit.offloads_grads for unit, _ in shared.pending_reductions):
        return
    still_pending = deque()
    for unit, pending in shared.pending_reductions:
        if unit.offloads_grads:
            shared.offloaded_reductions.append((unit, unit.finish_reduction(pending)))
        else:
            still_pending.append((unit, pending))
    shared.pending_reductions = still_pending


def end_of_backward(shared: RootState) -> None:
    with record_function("impl::fsdp::end_of_backward"):
        for state in shared.states:
            # Units some of whose parameters got no gradient: their hook never completed.
            if state.grads_ready and state.unit is not None:
                post_backward(state)
        finished, shared.offloaded_reductions = shared.offloaded_reductions, []
        while shared.pending_reductions:
            unit, pending = shared.pending_reductions.popleft()
            finished.append((unit, unit.finish_reduction(pending)))
        if any(unit.offloads_grads for unit, _ in finished):
            # CPU offload: the non-blocking copies into pinned memory must land before the
            # optimizer step reads the gradients (on the host, which has no stream to wait).
            shared.streams.post_backward.synchronize()
        for unit, reduced in finished:
            unit.accumulate_sharded_grad(reduced)
            if unit.handle.orig is not None:  # See [Note: use_orig_params]
                unit.handle.orig.use_sharded_grad_views()
        for state in shared.states:
            if state.unit is not None:  # catch-all: frozen or unused units
                state.unit.reshard(free=frees_after_backward(state, shared.sync_gradients))
                state.unit.handle.use_orig_param_attributes()
            state.training_state = TrainingState.IDLE
            state.ran_pre_backward = False
            state.grads_ready = 0
        shared.end_of_backward_queued = False
        _finish_iteration(shared)


def _finish_iteration(shared: RootState) -> None:
    shared.limiter.end_of_backward()
    shared.exec_order.end_iteration()
