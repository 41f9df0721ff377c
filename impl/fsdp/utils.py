"""Utilities over a whole FSDP tree: gradient clipping and summoning the full parameters.

They take the (root) module, as PyTorch's do, find its instances with traversal.py
and work on their ``FSDPState``; the only FSDP methods they call are on that module.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from impl import comm
from impl.fsdp.api import TrainingState
from impl.fsdp.runtime import check_state
from impl.fsdp.traversal import fsdp_modules, fsdp_states, state_of

FLAT_PARAM = "_flat_param"
"""The attribute (and, unless use_orig_params, the registered parameter) holding a
unit's flat shard on its wrapped module: PyTorch 2.x's name and place."""


def clip_grad_norm_(root, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most ``max_norm``; return the
    global norm, as PyTorch 2.x does (1.13 returned None despite its docstring): in the
    gradients' dtype when they share one (low-precision gradients give a low-precision
    norm), else in float32; with no gradient at all, a warning and a float32 zero.

    Sharded gradients are disjoint across the shard group, so their ``norm**p`` is
    summed over it; NO_SHARD gradients and parameters outside any unit (ignored modules)
    are identical on every rank and counted once.
    """
    if not root.check_is_root():  # runs the lazy init if needed
        raise RuntimeError("clip_grad_norm_ should only be called on the root FSDP instance")
    check_state(state_of(root), TrainingState.IDLE)
    p = float(norm_type)
    states = fsdp_states(root)
    for state in states:  # use_orig_params: the flat gradient follows what the parameters show
        if state.unit is not None and state.unit.handle.orig is not None:
            state.unit.handle.orig.writeback()
    sharded, replicated, groups = [], [], set()
    for state in states:
        unit = state.unit
        if unit is None or unit.handle.sharded_flat.grad is None:
            continue
        if unit.sharded and unit.handle.shard_world > 1:
            sharded.append(unit.handle.sharded_flat.grad)
            groups.add(unit.shard_group)
        else:
            replicated.append(unit.handle.sharded_flat.grad)
    flat_ids = {id(state.unit.handle.sharded_flat) for state in states if state.unit is not None}
    others = [q.grad for q in root.parameters()
              if id(q) not in flat_ids and not getattr(q, "_impl_fsdp_flattened", False) and q.grad is not None]  # ignored
    replicated += others
    if len(groups) > 1:
        raise NotImplementedError("clip_grad_norm_ with units in different shard groups is not supported")
    device = state_of(root).compute_device
    grads = sharded + replicated
    dtypes = {g.dtype for g in grads}
    norm_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    if not grads:
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank()} with no gradients -- returning the total "
            "norm in the default dtype torch.float32"
        )

    def local(grads):
        if not grads:
            return torch.zeros((), device=device)
        if math.isinf(p):
            return torch.stack([g.detach().abs().max().float() for g in grads]).max()
        norms = torch.stack([torch.linalg.vector_norm(g.detach(), p, dtype=torch.float32) for g in grads])
        return (norms**p).sum()

    sharded_part = local(sharded).to(device)  # offloaded gradients are on the CPU
    if groups:
        op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
        comm.all_reduce(sharded_part, op=op, group=next(iter(groups)), async_op=False)
    replicated_part = local(replicated).to(device)
    if math.isinf(p):
        total = torch.maximum(sharded_part, replicated_part)
    else:
        total = (sharded_part + replicated_part) ** (1.0 / p)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if coef < 1:
        for g in grads:
            g.detach().mul_(coef.to(device=g.device, dtype=g.dtype))
    return total.to(norm_dtype)


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
):
    """Expose the full, full-precision original parameters of every FSDP instance in
    ``module`` (or only ``module`` itself if not ``recurse``), as PyTorch 1.13 does.

    Inside the context each original parameter is an ``nn.Parameter`` registered on its
    module again, with its full shape: ``model.named_parameters()`` / ``parameters()``
    yield them under the unwrapped model's names (FSDP's ``_fsdp_wrapped_module.``
    prefixes are stripped, the flat shards are hidden), and they can be read and edited.
    With ``rank0_only`` only global rank 0 gets them; the other ranks keep the flat
    shards. ``offload_to_cpu`` puts the full copies of sharded units in CPU memory.

    On exit, with ``writeback``, each rank copies its own slice of any edits back into its
    shard (NO_SHARD edits persist regardless: the full parameter is the shard). Not
    allowed during forward or backward (AssertionError, as PyTorch 2.x), nor nested in
    another summon of the same units.

    ``with_grads`` (PyTorch 2.x, use_orig_params only): each original parameter's
    ``.grad`` is its full gradient too (None where no rank has one), written back like
    the parameters.
    """
    if writeback and rank0_only:
        raise NotImplementedError(  # PyTorch 2.x's type (1.13 raised ValueError)
            "writeback=True and rank0_only=True is not supported, as model parameter shapes will be different "
            "across ranks, and writing to them can lead to inconsistencies across ranks when the context is exited."
        )
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "offload_to_cpu and rank0_only=False will result in full parameters being redundantly copied to CPU "
            "memory for GPUs that reside on the same machine, which may incur the risk of CPU OOM. It is "
            "recommended to use ``offload_to_cpu`` with rank0_only=True."
        )
    if recurse:
        instances = fsdp_modules(module)
    else:
        instances = [module] if state_of(module) is not None else []
    states = [state_of(inst) for inst in instances]
    busy = (TrainingState.FORWARD, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)
    if any(state.training_state in busy for state in fsdp_states(module)):
        raise AssertionError("Cannot manually unshard parameters during forward/backward")
    for state in states:
        check_state(state, TrainingState.IDLE)
    if with_grads and (offload_to_cpu or not all(state.use_orig_params for state in states if state.unit is not None)):
        raise NotImplementedError(
            "summon_full_params(with_grads=True) is only supported with use_orig_params=True and offload_to_cpu=False"
        )
    exposes = not rank0_only or dist.get_rank() == 0
    summoned = []  # (instance, its handle, full copy, exposed parameters, attribute snapshot)
    try:
        for inst, state in zip(instances, states):
            state.training_state = TrainingState.SUMMON_FULL_PARAMS
            unit = state.unit
            if unit is None:
                continue
            h = unit.handle
            sharded = unit.sharded and h.shard_world > 1
            shard = h.device_shard(h.dtype)  # copied from host memory under offload
            if sharded:
                full = torch.empty(h.padded_numel, dtype=shard.dtype, device=shard.device)
                comm.all_gather(full, shard, group=unit.shard_group, async_op=False)
                if offload_to_cpu:
                    full = full.cpu()
            elif state.cpu_offload.offload_params and shard.data_ptr() == h.sharded_flat.data_ptr():
                full = shard.clone()  # offloaded: a device copy, kept only with writeback (even on a CPU device)
            else:
                full = shard  # NO_SHARD (or a one-rank shard group): the shard is the full parameter
            full_grad = _gather_grad(unit, sharded) if with_grads else None  # every rank takes part
            if not exposes:
                continue  # rank0_only, not rank 0: keep the flat shard
            snapshot = h.views_snapshot()
            params = h.expose_full_params(full)
            # The flat shard (registered unless use_orig_params) leaves named_parameters(),
            # and shows the unsharded values meanwhile, as FSDP1's flat parameter does
            # (without the padding, except under use_orig_params).
            # Registered on the wrapped module, which may since sit inside a wrapper (activation
            # checkpointing applied after FSDP): found by identity.
            owner = next((m for m in inst._fsdp_wrapped_module.modules()
                          if m._parameters.get(FLAT_PARAM) is h.sharded_flat), None)
            hidden = owner._parameters.pop(FLAT_PARAM) if owner is not None else None
            shard_data = h.sharded_flat.data
            h.sharded_flat.data = full[: h.padded_numel] if h.orig is not None else full[: h.numel]
            if full_grad is not None:
                for param, info in zip(params, h.infos):
                    param.grad = full_grad[info.offset : info.offset + info.numel].view(info.shape)
            summoned.append((inst, h, full, params, snapshot, (owner, hidden), shard_data, full_grad))
        yield
    finally:
        for inst, h, full, params, snapshot, (owner, hidden), shard_data, full_grad in reversed(summoned):
            h.sharded_flat.data = shard_data
            if with_grads:
                for param in params:
                    param.grad = None  # the sharded gradient views return below
                if writeback and full_grad is not None and h.sharded_flat.grad is not None and (
                        full_grad.data_ptr() != h.sharded_flat.grad.data_ptr()):
                    with torch.no_grad():
                        h.sharded_flat.grad.copy_(h.shard_slice(full_grad))
            h.hide_full_params(params, full, snapshot)  # drops the references to the full copy
            if with_grads and h.orig is not None:
                h.orig.use_sharded_grad_views()
            if hidden is not None:
                owner._parameters[FLAT_PARAM] = hidden
            if writeback and full.data_ptr() != h.sharded_flat.data_ptr():
                with torch.no_grad():
                    h.sharded_flat.copy_(h.shard_slice(full.to(h.sharded_flat.device)))
        for state in states:
            state.training_state = TrainingState.IDLE


def _gather_grad(unit, sharded: bool) -> torch.Tensor | None:
    """The unit's full, padded gradient (None when no rank of the group has one): its
    shard's gradient all-gathered over the shard group (missing shards count as zeros)."""
    h = unit.handle
    grad = h.sharded_flat.grad
    if not sharded:
        return None if grad is None else grad.detach()
    has = torch.tensor([0 if grad is None else 1], device=h.device)
    comm.all_reduce(has, op=dist.ReduceOp.MAX, group=unit.shard_group, async_op=False)
    if not has.item():
        return None
    local = grad.detach().to(h.device) if grad is not None else torch.zeros(h.shard_numel, dtype=h.dtype, device=h.device)
    full = torch.empty(h.padded_numel, dtype=local.dtype, device=h.device)
    comm.all_gather(full, local, group=unit.shard_group, async_op=False)
    return full
