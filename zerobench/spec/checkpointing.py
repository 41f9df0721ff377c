"""Activation checkpointing, an axis of every engine: ``activation_checkpointing``.

* ``"none"``: every activation autograd saves stays until backward uses it.
* ``"full"``: every sharding unit (transformer block) keeps only its input; its
  forward runs again in backward to rebuild the rest.
* ``"every:K"``: the same for every K-th unit (the 1st, K+1-th, ...).
* ``"ops"``: op-level selective checkpointing in every unit: the outputs of every other
  matrix multiplication and of attention are kept, the rest recomputed (the "op" policy
  of torchtitan's ``apply_ac``), through ``torch.utils.checkpoint``'s
  ``create_selective_checkpoint_contexts``.

Applied as PyTorch users apply it: each chosen unit is replaced in its parent by a
non-reentrant ``checkpoint_wrapper`` before any engine wraps the model, so every engine
(DDP, ZeRO, FSDP1, fully_shard, impl's) shards and runs the same checkpointed units.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from zerobench.choices import did_you_mean
from zerobench.instruments.memory import marking_recompute, recomputing  # noqa: F401 (recomputing: re-exported)

MODES = ("none", "full", "every:K", "ops")


def parse_mode(value, name: str = "activation_checkpointing") -> tuple[str, int]:
    """("none" | "full" | "every" | "ops", K); ValueError naming the axis (``name``) and
    what it allows."""
    if isinstance(value, str):
        if value in ("none", "full", "ops"):
            return value, 1
        head, _, k = value.partition(":")
        if head == "every" and k.isdigit() and int(k) >= 1:
            return "every", int(k)
    hint = did_you_mean(value, ("none", "full", "ops", "every:K")) if isinstance(value, str) else ""
    raise ValueError(f"{name}: {value!r} is not allowed{hint} "
                     f"(allowed: 'none', 'full', 'every:K' with an int K >= 1, 'ops')")


def apply_activation_checkpointing(model: nn.Module, units: list[nn.Module], mode: str) -> list[nn.Module]:
    """Wrap the chosen ``units`` of ``model`` in place; return the units as the engines
    must now see them (a wrapped unit is replaced by its wrapper)."""
    kind, k = parse_mode(mode)
    if kind == "none":
        return list(units)
    parents = _parents(model, units)
    out = []
    for index, unit in enumerate(units):
        if kind == "every" and index % k:
            out.append(unit)
            continue
        wrapper = _wrap(unit, selective=kind == "ops")
        parent, name = parents[id(unit)]
        setattr(parent, name, wrapper)
        out.append(wrapper)
    return out


def _wrap(unit: nn.Module, selective: bool) -> nn.Module:
    """``unit`` in torch's non-reentrant ``checkpoint_wrapper``, its forward marked so that
    the memory tracker can tell a recomputation's tensors apart
    (:func:`zerobench.instruments.memory.recomputing`)."""
    return checkpoint_wrapper(unit, checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=_checkpoint_marked,
                              use_reentrant=False, context_fn=_selective_contexts if selective else _plain_contexts)


def _checkpoint_marked(function, *args, **kwargs):
    return checkpoint(partial(_run_marked, function), *args, **kwargs)


def _run_marked(function, *args, **kwargs):
    # Inside backward (a graph task is running) this call is the recomputation.
    with marking_recompute(torch._C._current_graph_task_id() != -1):
        return function(*args, **kwargs)


# -- selective (op-level) policy --------------------------------------------------------

def _sdpa_ops() -> set:
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}


#: Matrix multiplications, of which every other output is kept (nn.Linear without bias
#: dispatches to mm, with a bias on 2-D input to addmm).
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
#: Attention kernels, whose outputs (and logsumexp) are always kept.
_ATTENTION = _sdpa_ops()


def _op_policy():
    """A fresh policy for one checkpointed call: keep attention's outputs and those of the
    1st, 3rd, 5th ... matmul; recompute everything else. The matmul count restarts for
    the recomputation, so the same matmuls are kept in forward and found in backward."""
    matmuls_seen = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if func in _MATMULS:
            matmuls_seen[ctx.is_recompute] += 1
            if matmuls_seen[ctx.is_recompute] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_contexts():
    return create_selective_checkpoint_contexts(_op_policy())


def _plain_contexts():
    return contextlib.nullcontext(), contextlib.nullcontext()


def _parents(model: nn.Module, units: list[nn.Module]) -> dict[int, tuple[nn.Module, str]]:
    """id(unit) -> (its parent module, its attribute name there)."""
    wanted = {id(u) for u in units}
    found = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            if id(child) in wanted:
                found[id(child)] = (parent, name)
    missing = [type(u).__name__ for u in units if id(u) not in found]
    if missing:
        raise ValueError(f"activation_checkpointing: unit {missing[0]} is not a submodule of the model")
    return found


__all__ = ["MODES", "parse_mode", "apply_activation_checkpointing", "recomputing"]
