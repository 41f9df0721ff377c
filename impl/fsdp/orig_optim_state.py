"""Optimizer state of units built with ``use_orig_params=True`` (optim_state.py calls
these; docs/behaviour.md §F12).

[Note: optimizer state under use_orig_params]
With ``use_orig_params=True`` the optimizer holds the original parameters, each a view
of its part of this rank's flat shard ([Note: use_orig_params]): its positive-dimension
states (Adam's moments) have that part's shape, 1-D and possibly partial, and a
parameter with no part here gets no gradient and so no state at all. The unflattened
(checkpoint) form keys each parameter's whole state by its name, as with flat shards.

* Save (``gather_states``): which parameters have state, and of what kind, is the
  union over the ranks (one ``all_gather_object`` of each rank's description), since a
  parameter legitimately has state only on the ranks that hold part of it. Then, unit by
  unit and state name by state name, every rank of the unit's shard group writes the
  parts it holds into a zero-filled flat shard, all-gathers it, and each parameter's
  state is cut out of the padded result at the parameter's offset, as for a flat shard.
  Zero-dimension tensors (Adam's ``step``) and non-tensors come from the description of
  a rank that has them. Every rank runs the same all-gathers in the same order.
* Load (``shard_state``): this rank's part of each positive-dimension state, in the
  shape its parameter's view has; nothing for a parameter with no part here (its local
  optimizer holds no state for it either). No communication.

PyTorch 2.x's FSDP1 gathers the same per-parameter state (``_optim_utils``'s
``_gather_all_orig_param_state``), with its own flat layout (alignment padding); the
unflattened values are the same, so checkpoints cross as with flat shards.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from impl import comm


def _describe(value) -> tuple:
    """How one state travels in the description: a positive-dimension tensor by its
    dtype (its values are all-gathered), anything else by value."""
    if torch.is_tensor(value) and value.dim() > 0:
        return ("tensor", value.dtype)
    if torch.is_tensor(value):
        return ("value", value.detach().cpu().clone())
    return ("value", value)


def gather_states(entries: list[tuple[str, object, int]], local: dict[str, dict], group) -> dict[str, dict]:
    """The whole state of each original parameter that has state on some rank.

    ``entries``: ``(name, unit, index in the unit's infos)`` of every original parameter
    of a use_orig_params unit that the optimizer holds, in the same order on every rank;
    ``local``: name -> this rank's optimizer state for it (absent when none). A
    collective over ``group`` and over each unit's shard group. See [Note: optimizer
    state under use_orig_params]."""
    mine = {name: {k: _describe(v) for k, v in st.items()} for name, st in local.items()}
    per_rank: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, mine, group=group)
    described: dict[str, dict] = {}  # name -> state name -> description, over every rank
    for rank_states in per_rank:
        for name, st in rank_states.items():
            for key, d in st.items():
                described.setdefault(name, {}).setdefault(key, d)
    units: dict[int, tuple[object, list[tuple[str, int]]]] = {}  # id(unit) -> (unit, [(name, index)])
    for name, unit, index in entries:
        units.setdefault(id(unit), (unit, []))[1].append((name, index))
    out: dict[str, dict] = {name: {} for name, _, _ in entries if name in described}
    for unit, members in units.values():
        tensor_keys = sorted({k for n, _ in members for k, d in described.get(n, {}).items() if d[0] == "tensor"})
        for key in tensor_keys:
            full = _gather_flat(unit, members, key, described, local)
            for name, index in members:
                if described.get(name, {}).get(key, ("",))[0] == "tensor":
                    info = unit.handle.infos[index]
                    out[name][key] = full[info.offset : info.offset + info.numel].view(info.shape).clone()
        for name, _ in members:
            for key, d in described.get(name, {}).items():
                if d[0] == "value":
                    out[name][key] = d[1].clone() if torch.is_tensor(d[1]) else copy.copy(d[1])
    return out


def _gather_flat(unit, members, key: str, described: dict, local: dict) -> torch.Tensor:
    """State ``key`` of the unit's parameters as one padded flat tensor: this rank's
    parts written into a zero-filled shard, all-gathered over the unit's shard group."""
    h = unit.handle
    dtypes = {described[n][key][1] for n, _ in members if described.get(n, {}).get(key, ("",))[0] == "tensor"}
    if len(dtypes) > 1:
        raise ValueError(f"Differing dtypes for optimizer state {key!r}: {dtypes}")
    dtype = dtypes.pop()
    held = [local[n][key] for n, _ in members if key in local.get(n, {})]
    home = held[0].device if held else h.sharded_flat.device  # where the optimizer keeps state
    shard = torch.zeros(h.shard_numel, dtype=dtype, device=h.device)  # 1-D, this rank's shard
    for name, index in members:
        value = local.get(name, {}).get(key)
        offset, numel = h.orig.in_shard[index]
        if value is not None and numel > 0:
            shard[offset : offset + numel].copy_(value.detach().reshape(-1))
    if not (unit.sharded and h.shard_world > 1):
        return shard.to(home)
    full = torch.empty(h.padded_numel, dtype=dtype, device=h.device)  # 1-D, padded
    comm.all_gather(full, shard, group=unit.shard_group, async_op=False)
    return full.to(home)


def shard_state(unit, index: int, name: str, state: dict, param: torch.Tensor) -> dict | None:
    """This rank's optimizer state for original parameter ``index`` of ``unit`` from its
    whole state (``None`` when the parameter has no part in this rank's shard)."""
    h = unit.handle
    offset, numel = h.orig.in_shard[index]
    if numel == 0:
        return None
    info = h.infos[index]
    start = h.shard_rank * h.shard_numel + offset - info.offset  # first element of this rank's part
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.shape != info.shape:
                raise ValueError(f"optimizer state {key!r} of {name} does not have same shape as its parameter")
            part = value.reshape(-1)[start : start + numel]
            out[key] = (part.view(param.shape) if h.shard_world == 1 else part).to(param.device).clone()
        else:
            out[key] = value.clone() if torch.is_tensor(value) else copy.copy(value)
    return out
