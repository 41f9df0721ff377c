"""Optimizer state dicts of an FSDP tree (docs/behaviour.md §F12).

The optimizer holds state for each unit's flat shard (``exp_avg`` of shape
``(shard_numel,)``, a scalar ``step``, ...). These functions translate between that
and the *unflattened* view a checkpoint wants: one entry per original parameter, keyed
by its name in the unwrapped model.

* ``full_optim_state_dict``: all-gather each positive-dimension state over the unit's
  shard group, trim the padding, split per original parameter; scalars and non-tensors
  are replicated to each parameter. Rank 0 only by default.
* ``sharded_optim_state_dict``: the same per-parameter states sharded on dim 0, as
  ShardedTensors (DTensors for an instance built with a device_mesh), as PyTorch 2.x.
* ``shard_full_optim_state_dict`` / ``flatten_sharded_optim_state_dict``: back to this
  rank's flat shards, ready for ``optim.load_state_dict`` (no communication, except
  the gather of sharded values). Missing positive-dimension states become zeros
  (right for Adam's moments); scalars must agree across a unit's parameters.
* ``scatter_full_optim_state_dict``: rank 0 holds the full dict and broadcasts it (as
  one pickled object: simpler than 1.13's skeleton-then-tensors broadcast, at the cost
  of every rank briefly holding the full dict).
* ``rekey_optim_state_dict``: parameter names <-> parameter IDs.
* ``optim_state_dict`` / ``optim_state_dict_to_load``: PyTorch 2.x's pair, which picks
  FULL or SHARDED from ``state_dict_type``; the SHARDED form crosses between PyTorch's
  FSDP1 and impl through ``torch.distributed.checkpoint`` (docs/fsdp.md).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from impl import comm
from impl.fsdp import orig_optim_state
from impl.fsdp.api import OptimStateKeyType, StateDictType  # defined in api.py; OptimStateKeyType re-exported here
from impl.fsdp.state_dict import _clean, _join, full_tensor, to_sharded
from impl.fsdp.traversal import fsdp_states, state_of


class _Param(NamedTuple):
    """What one optimizer parameter is to the unflattened view."""

    unit: Any  # its FlatParamUnit, or None for a parameter outside every unit
    names: list[str]  # the unflattened names it holds: a flat shard's parameters, or one
    orig: int | None  # use_orig_params: its index in the unit's infos; None otherwise


def _param_map(model: nn.Module) -> dict[int, _Param]:
    """id(optimizer parameter) -> _Param: a unit's flat shard, an original parameter of a
    use_orig_params unit ([Note: optimizer state under use_orig_params]), or a parameter
    outside every unit."""
    out: dict[int, _Param] = {}
    for mod_name, mod in model.named_modules():
        state = state_of(mod)
        if state is not None:  # an FSDP instance: the optimizer sees its flat shard or its original parameters
            if state.unit is None:
                continue
            h = state.unit.handle
            names = [_clean(_join(mod_name, i.fqn)) for i in h.infos]
            if state.use_orig_params:
                for index, (param, name) in enumerate(zip(h.orig.params, names)):
                    out[id(param)] = _Param(state.unit, [name], index)
            else:
                out[id(h.sharded_flat)] = _Param(state.unit, names, None)
            continue
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in out:
                out[id(p)] = _Param(None, [_join(_clean(mod_name), name)], None)
    return out


def _optim_params(optim: torch.optim.Optimizer | None, model: nn.Module, optim_input=None) -> list[list[nn.Parameter]]:
    """The optimizer's parameters, group by group: from ``optim``, else from
    ``optim_input`` (parameters, or dicts with ``"params"``), else ``model.parameters()``."""
    if optim is not None:
        return [list(g["params"]) for g in optim.param_groups]
    if optim_input is not None:
        optim_input = list(optim_input)
        if optim_input and isinstance(optim_input[0], dict):
            return [list(g["params"]) for g in optim_input]
        return [optim_input]
    return [list(model.parameters())]


def _warn_optim_input(optim_input) -> None:
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. You may remove it "
            "from your code without changing its functionality.",
            FutureWarning,
            stacklevel=3,
        )


def _states(optim: torch.optim.Optimizer, params: list[list[nn.Parameter]], osd: dict | None = None) -> dict[int, dict]:
    """id(parameter) -> its optimizer state: ``optim.state``, or, when given, the state of
    ``osd`` (a dict ``optim.state_dict()`` returned), whose keys are parameter positions."""
    if osd is None:
        return {id(p): optim.state[p] for group in params for p in group if optim.state.get(p)}
    flat = [p for group in params for p in group]
    return {id(p): osd["state"][i] for i, p in enumerate(flat) if osd["state"].get(i)}


def _unflatten_state(unit, names: list[str], state: dict) -> dict[str, dict]:
    """One flat parameter's state -> per original parameter."""
    out: dict[str, dict] = {n: {} for n in names}
    h = unit.handle if unit is not None else None
    for key, value in state.items():
        if h is None:
            out[names[0]][key] = value.detach().clone() if torch.is_tensor(value) else value
            continue
        if torch.is_tensor(value) and value.dim() > 0:
            if unit.sharded and h.shard_world > 1:
                # Gathered on the compute device (NCCL needs device tensors), returned where
                # the optimizer keeps its state (the CPU under offload).
                full = torch.empty(h.padded_numel, dtype=value.dtype, device=h.device)
                comm.all_gather(full, value.detach().to(h.device), group=unit.shard_group, async_op=False)
                full = full.to(value.device)
            else:
                full = value.detach()
            for name, info in zip(names, h.infos):
                out[name][key] = full[info.offset : info.offset + info.numel].view(info.shape).clone()
        else:
            for name in names:
                out[name][key] = value.detach().clone() if torch.is_tensor(value) else copy.copy(value)
    return out


def _groups_by_name(optim, params, pmap, osd_groups=None) -> list[dict]:
    """The parameter groups with names for parameters; hyperparameters from ``osd_groups``
    (a given ``optim.state_dict()``'s) when given, else from ``optim``."""
    groups = []
    for i, (group, members) in enumerate(zip(optim.param_groups, params)):
        source = osd_groups[i] if osd_groups is not None else group
        g = {k: v for k, v in source.items() if k != "params"}
        g["params"] = [n for p in members for n in pmap[id(p)].names]
        groups.append(g)
    return groups


def full_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, optim_input=None, rank0_only: bool = True, group=None,
    *, optim_state_dict: dict | None = None,
) -> dict:
    """The unflattened optimizer state, keyed by parameter name; ``{}`` on ranks other
    than 0 under ``rank0_only`` (every rank still takes part in the all-gathers).

    Which flat shards have state is rank 0's view, as in PyTorch: a rank missing state
    that rank 0 has raises RuntimeError on every rank; state that only other ranks hold
    is left out. See [Note: stepped on some ranks]. The original parameters of
    use_orig_params units have state where any rank has it ([Note: optimizer state under
    use_orig_params]). ``optim_state_dict``: read the state from this dict (what
    ``optim.state_dict()`` returned) instead of ``optim``; without ``"param_groups"``
    in it, the result has none either (PyTorch 2.x)."""
    _warn_optim_input(optim_input)
    pmap = _param_map(model)
    params = _optim_params(optim, model)
    states = _states(optim, params, optim_state_dict)
    flat_with_state = {
        tuple(pmap[id(p)].names): p for members in params for p in members
        if id(p) in states and pmap[id(p)].unit is not None and pmap[id(p)].orig is None
    }
    keys = _rank0_state_keys(list(flat_with_state), group)
    state: dict[str, dict] = {}
    for names in keys:
        p = flat_with_state[names]
        state.update(_unflatten_state(pmap[id(p)].unit, list(names), states[id(p)]))
    # Parameters outside every unit are this rank's own (model parallelism may give each
    # rank different ones, as PyTorch allows): their state is kept as this rank has it.
    for members in params:
        for p in members:
            if pmap[id(p)].unit is None and id(p) in states:
                state.update(_unflatten_state(None, pmap[id(p)].names, states[id(p)]))
    orig = [(pmap[id(p)].names[0], pmap[id(p)].unit, pmap[id(p)].orig)
            for members in params for p in members if pmap[id(p)].orig is not None]
    if orig:
        local = {pmap[id(p)].names[0]: states[id(p)] for members in params for p in members
                 if pmap[id(p)].orig is not None and id(p) in states}
        state.update(orig_optim_state.gather_states(orig, local, group))
    if rank0_only and dist.get_rank(group) != 0:
        return {}
    out = {"state": state}
    if optim_state_dict is None or "param_groups" in optim_state_dict:
        osd_groups = optim_state_dict["param_groups"] if optim_state_dict is not None else None
        out["param_groups"] = _groups_by_name(optim, params, pmap, osd_groups)
    return out


def _rank0_state_keys(mine: list[tuple[str, ...]], group) -> list[tuple[str, ...]]:
    """Rank 0's parameters with optimizer state (each as its tuple of unflattened names),
    after checking that every rank has them all.

    [Note: stepped on some ranks]
    A rank whose optimizer has not stepped (or has stepped fewer parameters) would skip
    all-gathers that the others issue, leaving every later collective out of step. So
    rank 0's list is broadcast first, and every rank takes part in the same check (an
    all-reduce of the count missing, then an all-gather of what is missing where it is
    not zero) before any all-gather of state. As PyTorch 2.x's FSDP1: if any rank lacks
    state rank 0 has, every rank raises the same RuntimeError; if rank 0 is the one
    without state, every rank returns the state rank 0 has (none) and training goes on.
    """
    source = dist.get_global_rank(group, 0) if group is not None else 0
    box = [mine if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=source, group=group)
    keys = box[0]
    have = set(mine)
    missing = [k for k in keys if k not in have]
    # On the device the group communicates on (NCCL needs CUDA tensors).
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    count = torch.tensor([len(missing)], device=device)
    dist.all_reduce(count, group=group)
    if count.item() > 0:
        per_rank: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(per_rank, missing, group=group)
        message = (
            "FSDP currently requires each rank to have at least the optimizer states needed by rank 0's "
            "optimizer but some ranks are missing some of those states"
        )
        for rank, names in enumerate(per_rank):
            if names:
                message += f"\nRank {rank} is missing states for the parameters: {names}"
        raise RuntimeError(message)
    return keys


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group=None,
    *, optim_input=None, optim_state_dict: dict | None = None,
) -> dict:
    """Like ``full_optim_state_dict`` on every rank, positive-dimension states sharded
    (``state_dict.to_sharded``: ShardedTensors, or DTensors under a device_mesh)
    (PyTorch 2.x's signature; 1.13's ``optim_input`` is keyword-only and ignored)."""
    pmap = _param_map(model)
    full = full_optim_state_dict(model, optim, rank0_only=False, group=group, optim_state_dict=optim_state_dict)
    state_of_unit = {id(s.unit): s for s in fsdp_states(model) if s.unit is not None}
    unit_of = {n: entry.unit for entry in pmap.values() for n in entry.names}
    for name, st in full["state"].items():
        unit = unit_of[name]
        if unit is not None and unit.sharded:
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    st[k] = to_sharded(v, state_of_unit[id(unit)])
    return full


def shard_full_optim_state_dict(full_osd: dict, model: nn.Module, optim_input=None, optim=None) -> dict:
    """This rank's flat state, loadable with ``optim.load_state_dict`` (no communication).

    Entries of ``full_osd["state"]`` that name no parameter of ``model`` are user-defined
    state and kept as they are (copied), as PyTorch keeps them."""
    _warn_optim_input(optim_input)
    return _shard_full(full_osd, model, optim_input, optim)


def _shard_full(full_osd: dict, model: nn.Module, optim_input=None, optim=None) -> dict:
    if "state" not in full_osd:
        raise ValueError("full_osd must contain 'state' (did rank 0 pass in the full optimizer state dict?)")
    pmap = _param_map(model)
    groups = _optim_params(optim, model, optim_input)
    flat_state: dict = {}
    pid = 0
    for params in groups:
        for p in params:
            unit, names, orig = pmap[id(p)]
            entries = [full_osd["state"].get(n) for n in names]
            if orig is not None:
                if entries[0] is not None:
                    mine = orig_optim_state.shard_state(unit, orig, names[0], entries[0], p)
                    if mine is not None:
                        flat_state[pid] = mine
            elif any(e is not None for e in entries):
                flat_state[pid] = _flatten_state(unit, names, entries, p)
            pid += 1
    known = {n for entry in pmap.values() for n in entry.names}
    for key, value in full_osd["state"].items():
        if key not in known:
            flat_state[key] = copy.copy(value)
    # Each group lists the IDs of this optimizer's parameters that the saved group names
    # (all of them when the dict has no groups): a parameter the checkpoint does not
    # know (unmanaged, added since) is left out, as PyTorch leaves it out.
    param_groups, pid = [], 0
    full_groups = full_osd.get("param_groups") or [None] * len(groups)
    for saved, params in zip(full_groups, groups):
        g = {k: v for k, v in (saved or {}).items() if k != "params"}
        named = None if saved is None or "params" not in saved else set(saved["params"])
        g["params"] = [pid + i for i, p in enumerate(params)
                       if named is None or any(n in named for n in pmap[id(p)].names)]
        pid += len(params)
        param_groups.append(g)
    return {"state": flat_state, "param_groups": param_groups}


def _state_kind(value) -> str:
    """How a state flattens: positive-dimension tensors are concatenated, zero-dimension
    tensors and non-tensors must agree across the unit's parameters."""
    if torch.is_tensor(value):
        return "positive-dimension tensor" if value.dim() > 0 else "zero-dimension tensor"
    return "non-tensor"


def _flatten_state(unit, names, entries, param) -> dict:
    present = [(n, e) for n, e in zip(names, entries) if e is not None]
    if unit is None:
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in present[0][1].items()}
    keys = set(present[0][1])
    for n, e in present[1:]:
        if set(e) != keys:
            raise ValueError(f"Differing optimizer state names for the unflattened parameters {names}")
    h = unit.handle
    out = {}
    for key in sorted(keys):
        values = [e[key] if e is not None else None for e in entries]  # None: no state for that parameter
        given = [v for v in values if v is not None]
        if not given:
            out[key] = None
            continue
        # As PyTorch's _optim_utils: one Python type and one kind per state, else ValueError.
        if len({type(v) for v in given}) != 1 or len({_state_kind(v) for v in given}) != 1:
            kinds = [f"{n}: {type(v).__name__} ({_state_kind(v)})" for n, v in zip(names, values) if v is not None]
            raise ValueError(
                f"Differing optimizer state types for state {key!r}, values of the unflattened parameters "
                f"{kinds}; all must be positive-dimension tensors, or all zero-dimension tensors, or all the "
                "same non-tensor type"
            )
        first = given[0]
        if _state_kind(first) == "positive-dimension tensor":
            dtypes = {v.dtype for v in given}
            if len(dtypes) > 1:
                raise ValueError(f"Differing dtypes for optimizer state {key!r}: {dtypes}")
            full = torch.zeros(h.padded_numel, dtype=first.dtype, device=param.device)
            for name, info, v in zip(names, h.infos, values):
                if v is None:
                    continue  # missing: zeros
                if v.shape != info.shape:
                    raise ValueError(f"optimizer state {key!r} of {name} does not have same shape as its parameter")
                full[info.offset : info.offset + info.numel].copy_(v.reshape(-1))
            out[key] = h.shard_slice(full).clone() if unit.sharded else full[: h.padded_numel].clone()
        else:
            # A scalar cannot be zero-filled (Adam's missing step means full bias
            # correction), so every parameter of the unit must have it, all equal.
            same = len(given) == len(values) and all(
                (torch.equal(v, first) and v.dtype == first.dtype) if torch.is_tensor(v) else v == first for v in given
            )
            if not same:
                raise ValueError(
                    f"All unflattened parameters comprising a single flat parameter must have scalar state with "
                    f"the same value and dtype; {key!r} differs across {names} (values {values})"
                )
            out[key] = first.clone() if torch.is_tensor(first) else first
    return out


def flatten_sharded_optim_state_dict(sharded_osd: dict, model: nn.Module, optim=None, *, optim_input=None) -> dict:
    """This rank's flat state from a sharded optimizer state dict (ShardedTensors or
    DTensors, impl's or PyTorch FSDP1's), gathered entry by entry on every rank (PyTorch
    2.x's signature: ``optim`` third; 1.13's ``optim_input`` is keyword-only)."""
    full = {
        "state": {
            n: {k: full_tensor(v) for k, v in st.items()} if isinstance(st, dict) else st
            for n, st in sharded_osd["state"].items()
        },
        "param_groups": sharded_osd.get("param_groups"),
    }
    return _shard_full(full, model, optim_input, optim)


def scatter_full_optim_state_dict(full_osd, model: nn.Module, optim_input=None, optim=None, group=None) -> dict:
    """Rank 0 passes the full dict (others None); every rank gets its flat shard."""
    _warn_optim_input(optim_input)
    return _scatter_full(full_osd, model, optim_input, optim, group)


def _scatter_full(full_osd, model: nn.Module, optim_input=None, optim=None, group=None) -> dict:
    rank0 = dist.get_rank(group) == 0
    if rank0 and full_osd is None:
        raise ValueError("Rank 0 must pass in the full optimizer state dict")
    box = [full_osd if rank0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return _shard_full(box[0], model, optim_input, optim)


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict=None, group=None) -> dict:
    """PyTorch 2.x's entry point (``FSDP.optim_state_dict``): the optimizer state dict of
    the kind ``state_dict_type`` set on ``model``'s FSDP instances (``model`` may be a
    plain module holding them), following its optimizer config (``rank0_only``,
    ``offload_to_cpu``). FULL: ``full_optim_state_dict``, on every rank by default
    (PyTorch's default ``FullOptimStateDictConfig`` has ``rank0_only=False``); SHARDED:
    ``sharded_optim_state_dict``, which ``torch.distributed.checkpoint`` saves and loads
    like PyTorch FSDP1's. ``optim_state_dict``: a precomputed ``optim.state_dict()`` to
    read the state from instead of ``optim``."""
    kind, fsdp_state = _state_dict_kind(model, "optim_state_dict")
    config = fsdp_state.optim_state_dict_config  # set with state_dict_type / set_state_dict_type
    if kind is StateDictType.FULL_STATE_DICT:
        out = full_optim_state_dict(model, optim, rank0_only=getattr(config, "rank0_only", False), group=group,
                                    optim_state_dict=optim_state_dict)
    else:
        out = sharded_optim_state_dict(model, optim, group=group, optim_state_dict=optim_state_dict)
    if getattr(config, "offload_to_cpu", False) and out:
        out["state"] = {k: {n: v.cpu() if torch.is_tensor(v) else v for n, v in st.items()} if isinstance(st, dict) else st
                        for k, st in out["state"].items()}
    return out


def optim_state_dict_to_load(
    model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict, is_named_optimizer: bool = False,
    load_directly: bool = False, group=None,
) -> dict:
    """PyTorch 2.x's way back (``FSDP.optim_state_dict_to_load``): this rank's flat state
    for ``optim.load_state_dict``, from what ``optim_state_dict`` gave under the same
    ``state_dict_type`` (impl's or PyTorch FSDP1's). Under a FULL optimizer config with
    ``rank0_only`` only rank 0's dict is read, and sent to the others (every rank of
    ``group`` calls this). ``load_directly=True`` also loads it."""
    kind, fsdp_state = _state_dict_kind(model, "optim_state_dict_to_load")
    if kind is StateDictType.FULL_STATE_DICT and getattr(fsdp_state.optim_state_dict_config, "rank0_only", False):
        flat = _scatter_full(optim_state_dict if dist.get_rank(group) == 0 else None, model, optim=optim, group=group)
    elif kind is StateDictType.FULL_STATE_DICT:
        flat = _shard_full(optim_state_dict, model, optim=optim)
    else:
        flat = flatten_sharded_optim_state_dict(optim_state_dict, model, optim=optim)
    if is_named_optimizer:
        flat = _keyed_by_name(flat, optim)
    if load_directly:
        optim.load_state_dict(flat)
    return flat


def _keyed_by_name(flat: dict, optim) -> dict:
    """A flat optimizer state dict keyed as ``torch.distributed.optim._NamedOptimizer``'s
    ``state_dict`` is: by its ``ordered_param_keys`` instead of positions."""
    keys = getattr(optim, "ordered_param_keys", None)
    if keys is None:
        raise ValueError(
            "is_named_optimizer=True needs a named optimizer (torch.distributed.optim._NamedOptimizer, with "
            f"ordered_param_keys); got a {type(optim).__name__}"
        )
    state = {keys[k] if isinstance(k, int) else k: v for k, v in flat["state"].items()}
    groups = [dict(g, params=sorted(keys[i] for i in g["params"])) for g in flat["param_groups"]]
    return {"state": state, "param_groups": groups}


def _state_dict_kind(model: nn.Module, what: str):
    """The state-dict type of ``model``'s FSDP instances and the first instance's state."""
    states = fsdp_states(model)
    if not states:
        raise ValueError(f"{what} needs a module with FSDP instances, got a {type(model).__name__} without any")
    state = states[0]
    if state.state_dict_type not in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        raise NotImplementedError(
            f"{what} supports FULL_STATE_DICT and SHARDED_STATE_DICT, not {state.state_dict_type.name}"
        )
    return state.state_dict_type, state


def rekey_optim_state_dict(osd: dict, key_type: OptimStateKeyType, model: nn.Module, optim_input=None, optim=None) -> dict:
    """Re-key an unflattened optimizer state dict by parameter name or by parameter ID
    (the position of the name in the unflattened optimizer order)."""
    _warn_optim_input(optim_input)
    pmap = _param_map(model)
    order = [n for params in _optim_params(optim, model, optim_input) for p in params for n in pmap[id(p)].names]
    keys = list(osd["state"])
    if any(isinstance(k, str) for k in keys) and any(not isinstance(k, str) for k in keys):
        raise ValueError(f"Invalid parameter keys: mixed names and IDs {keys}")
    by_name = all(isinstance(k, str) for k in keys)
    if (key_type is OptimStateKeyType.PARAM_NAME) == by_name:
        return osd
    if key_type is OptimStateKeyType.PARAM_ID:
        index = {n: i for i, n in enumerate(order)}
        convert = lambda k: index[k]  # noqa: E731
    else:
        if len(set(order)) != len(order):
            raise RuntimeError("Each parameter must have exactly one name to re-key by name")
        convert = lambda k: order[k]  # noqa: E731
    groups = [dict(g, params=sorted(convert(k) for k in g["params"]) if key_type is OptimStateKeyType.PARAM_ID
                   else [convert(k) for k in g["params"]]) for g in osd["param_groups"]]
    return {"state": {convert(k): v for k, v in osd["state"].items()}, "param_groups": groups}
