"""Model state dicts of an FSDP tree: FULL, LOCAL and SHARDED (docs/behaviour.md §F11).

Keys are those of the unwrapped model (FSDP's ``_fsdp_wrapped_module.`` prefixes are
stripped), except LOCAL's ``<unit>._flat_param`` entries (PyTorch 2.x's name):

* FULL: every original parameter and buffer, unsharded, full precision (buffers back in
  their original dtype under mixed precision). ``rank0_only`` returns ``{}`` elsewhere;
  ``offload_to_cpu`` copies to the CPU. Parameters outside every unit (ignored) and
  buffers are the module's own tensors (detached, not copied), as in PyTorch.
* LOCAL: each unit's ``_flat_param`` shard as this rank holds it (padded, 1-D), plus
  buffers and unmanaged parameters. Sharded strategies only.
* SHARDED: each original parameter sharded on dim 0 over the unit's shard group
  (torch.chunk's split), plus buffers: a ``ShardedTensor``, or a ``DTensor`` when the
  instance was built with a ``device_mesh``, as PyTorch 2.x's FSDP1 gives them
  (``to_sharded``). A unit that is not sharded (NO_SHARD, a one-rank group) is chunked
  over its group the same way.

Loading SHARDED takes either kind, gathered over its group; PyTorch's LOCAL dicts are refused (docs/fsdp.md, "Checkpoints across PyTorch's
FSDP and impl").

An FSDP root's ``load_state_dict`` loads the whole tree here. When the root is a plain
module with FSDP children, ``nn.Module.load_state_dict`` walks the tree itself; each
instance's load pre-hook (``pre_load_hook``) then renames the keys under it to the
wrapped module's (adding ``_fsdp_wrapped_module.``) and exposes its own parameters with
``summon_full_params``, and the post-hook writes them back (as PyTorch's FSDP1 does).

Use it as in PyTorch::

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
        model.load_state_dict(sd)
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from impl import comm
from impl.fsdp.api import (  # the policies are defined in api.py, re-exported here
    STATE_DICT_CONFIGS,
    StateDictSettings,
    StateDictType,
)
from impl.fsdp.api import FullStateDictConfig as FullStateDictConfig
from impl.fsdp.api import LocalStateDictConfig as LocalStateDictConfig
from impl.fsdp.api import ShardedStateDictConfig as ShardedStateDictConfig
from impl.fsdp.traversal import fsdp_states, named_fsdp_states, state_of
from impl.fsdp.utils import FLAT_PARAM, summon_full_params  # FLAT_PARAM: LOCAL's key

_CONFIG_OF = {kind: configs[0] for kind, configs in STATE_DICT_CONFIGS.items()}


def set_state_dict_type(module: nn.Module, type: StateDictType, config=None, optim_config=None) -> StateDictSettings:
    """Set the state-dict type and configs of every FSDP instance in ``module``; returns
    the previous settings (PyTorch 2.x's ``FSDP.set_state_dict_type``)."""
    if not isinstance(type, StateDictType):
        raise ValueError(f"Unknown StateDictType {type!r}; expected one of {[t.name for t in StateDictType]}")
    model_class, optim_class = STATE_DICT_CONFIGS[type]
    config = config if config is not None else model_class()
    optim_config = optim_config if optim_config is not None else optim_class()
    if not isinstance(config, model_class):
        raise RuntimeError(f"Expected state_dict_config of type {model_class.__name__} but got {config.__class__.__name__}")
    if not isinstance(optim_config, optim_class):
        raise RuntimeError(
            f"Expected optim_state_dict_config of type {optim_class.__name__} but got {optim_config.__class__.__name__}"
        )
    previous = get_state_dict_type(module)
    for s in fsdp_states(module):
        s.state_dict_type, s.state_dict_config, s.optim_state_dict_config = type, config, optim_config
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings every FSDP instance in ``module`` shares (ValueError if none, or if they differ)."""
    settings = {
        StateDictSettings(s.state_dict_type, s.state_dict_config, s.optim_state_dict_config)
        for s in fsdp_states(module)
    }
    if not settings:
        raise ValueError(f"get_state_dict_type: no FSDP instance in {type(module).__name__}")
    if len(settings) > 1:
        raise ValueError(f"All FSDP modules must have the same state dict settings. Got {settings}")
    return settings.pop()


@contextlib.contextmanager
def state_dict_type(module: nn.Module, type: StateDictType, config=None, optim_config=None):
    """Set the state dict type (and configs) of every FSDP instance in ``module`` while inside."""
    states = fsdp_states(module)
    previous = [(s.state_dict_type, s.state_dict_config, s.optim_state_dict_config) for s in states]
    if len({t for t, _, _ in previous}) > 1:
        raise RuntimeError("All FSDP module should the same state_dict_type.")
    set_state_dict_type(module, type, config, optim_config)
    try:
        yield
    finally:
        for s, (t, c, o) in zip(states, previous):
            s.state_dict_type, s.state_dict_config, s.optim_state_dict_config = t, c, o


# -- naming ---------------------------------------------------------------------------


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""What FSDP and torch's checkpoint_wrapper add to names; state-dict keys leave both out,
as PyTorch's ``clean_tensor_name`` does."""


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix + ".", "").replace(prefix, "")
    return name.strip(".")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Entries:
    """Where each state-dict entry of an FSDP tree lives, under its unwrapped name."""

    def __init__(self, root: nn.Module):
        self.managed = []  # (name, instance's FSDPState, ParamInfo or SharedParamInfo)
        self.unmanaged = []  # (name, module, attribute): parameters outside every unit
        self.buffers = []  # (name, module, attribute)
        for mod_name, mod in root.named_modules(remove_duplicate=False):
            state = state_of(mod)
            if state is not None:  # an FSDP instance: its parameters are the unit's
                if state.unit is not None:
                    h = state.unit.handle
                    for ref in [*h.infos, *h.shared]:
                        self.managed.append((_clean(_join(mod_name, ref.fqn)), state, ref))
                    for fqn, ref in h.aliases:  # a module registered under a second name
                        self.managed.append((_clean(_join(mod_name, fqn)), state, ref))
                continue
            prefix = _clean(mod_name)
            for name, p in mod._parameters.items():
                # Skip the units' own: flat shards, and original parameters under use_orig_params.
                if p is not None and not getattr(p, "_impl_fsdp_flattened", False) and not getattr(p, "_impl_fsdp_flat", False):
                    self.unmanaged.append((_join(prefix, name), mod, name))
            for name, b in mod._buffers.items():
                if b is not None and name not in mod._non_persistent_buffers_set:
                    self.buffers.append((_join(prefix, name), mod, name))
        self.states = fsdp_states(root)
        # LOCAL's entries: (name, state) of each unit's flat shard.
        self.flat_params = [
            (_join(_clean(name), FLAT_PARAM), state)
            for name, state in named_fsdp_states(root)
            if state.unit is not None
        ]
        # Buffers cast by mixed precision are saved in their original dtype.
        self.buffer_dtypes = {k: v for state in self.states for k, v in state.original_buffer_dtypes.items()}

    def buffer_value(self, mod: nn.Module, name: str) -> torch.Tensor:
        """The buffer itself (detached, as ``nn.Module.state_dict`` gives it), or a copy in
        its original dtype where mixed precision cast it."""
        b = mod._buffers[name].detach()
        original = self.buffer_dtypes.get((id(mod), name))
        return b.to(original) if original is not None and original != b.dtype else b


def _check_sharded(states, what: str) -> None:
    for state in states:
        if state.unit is not None and not state.unit.sharded:
            raise RuntimeError(
                "sharded_state_dict/local_state_dict can only be called when parameters are flatten and sharded."
                f" ({what} with {state.unit.strategy.name})"
            )


# -- save -----------------------------------------------------------------------------


def model_state_dict(root) -> dict[str, torch.Tensor]:
    kind, config = state_of(root).state_dict_type, state_of(root).state_dict_config
    entries = _Entries(root)
    out: dict[str, torch.Tensor] = {}
    if kind is StateDictType.FULL_STATE_DICT:
        rank0_only = config.rank0_only
        with summon_full_params(root, writeback=False, rank0_only=rank0_only, offload_to_cpu=config.offload_to_cpu):
            if rank0_only and dist.get_rank() != 0:
                return {}
            for name, _, ref in entries.managed:
                out[name] = ref.module.__dict__[ref.name].detach().clone()
            for name, mod, attr in entries.unmanaged:
                out[name] = mod._parameters[attr].detach()
            for name, mod, attr in entries.buffers:
                out[name] = entries.buffer_value(mod, attr)
        if config.offload_to_cpu:
            out = {k: v.cpu() for k, v in out.items()}
        return out
    if kind is StateDictType.LOCAL_STATE_DICT:
        _check_sharded(entries.states, "LOCAL_STATE_DICT")
        for name, state in entries.flat_params:
            out[name] = state.unit.handle.sharded_flat.detach().clone()
    elif kind is StateDictType.SHARDED_STATE_DICT:
        with summon_full_params(root, writeback=False):
            for name, state, ref in entries.managed:
                out[name] = to_sharded(ref.module.__dict__[ref.name].detach(), state)
    else:
        raise ValueError(f"Unknown StateDictType {kind!r}")
    for name, mod, attr in entries.unmanaged:
        out[name] = mod._parameters[attr].detach()
    for name, mod, attr in entries.buffers:
        out[name] = entries.buffer_value(mod, attr)
    if getattr(config, "offload_to_cpu", False):
        out = {k: v.cpu() if torch.is_tensor(v) else v for k, v in out.items()}
    return out


def to_sharded(full: torch.Tensor, state):
    """SHARDED's value of one tensor of ``state``'s unit: its rows chunked over the unit's
    group (``torch.chunk`` on dim 0), this rank's chunk local. As PyTorch 2.x's FSDP1: a
    ``ShardedTensor``, or a ``DTensor`` when the instance was built with a
    ``device_mesh``. A zero-dimension tensor stays whole."""
    if full.dim() == 0:
        return full.clone()
    if state.device_mesh is not None:
        return _to_dtensor(full, state.unit)
    return _to_sharded_tensor(full, state.unit)


def _to_sharded_tensor(full: torch.Tensor, unit):
    # Imported on first use, not with impl.fsdp (as torch.distributed.tensor below).
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    group = unit.shard_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = torch.chunk(full, world, dim=0)
    starts = [sum(c.shape[0] for c in chunks[:i]) for i in range(len(chunks))]
    device = full.device.type if full.device.type == "cpu" else f"{full.device.type}:{full.device.index}"
    # Every rank describes every chunk (placements name global ranks), so building the
    # tensor needs no communication; ranks past the last chunk hold none.
    ranks = dist.get_process_group_ranks(group)
    shards_metadata = [
        ShardMetadata([start] + [0] * (full.dim() - 1), list(chunk.shape), f"rank:{ranks[r]}/{device}")
        for r, (start, chunk) in enumerate(zip(starts, chunks))
    ]
    local = []
    if rank < len(chunks):
        local = [Shard(chunks[rank].clone(), shards_metadata[rank])]
    properties = TensorProperties(dtype=full.dtype, layout=full.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    metadata = ShardedTensorMetadata(shards_metadata, full.shape, properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=group)


def _mesh(unit):
    if getattr(unit, "_mesh", None) is None:
        unit._mesh = DeviceMesh.from_group(unit.shard_group, unit.handle.device.type)
    return unit._mesh


def _to_dtensor(full: torch.Tensor, unit):
    # On first use, not with impl.fsdp: torch.distributed.tensor takes over a second to import.
    from torch.distributed.tensor import DTensor, Shard

    if full.dim() == 0:
        return full.clone()
    # The unit's group: its shard group when sharded, the ranks that replicate it otherwise.
    world, rank = dist.get_world_size(unit.shard_group), dist.get_rank(unit.shard_group)
    chunks = torch.chunk(full, world, dim=0)
    local = chunks[rank].clone() if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(local, _mesh(unit), [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


# -- load -----------------------------------------------------------------------------


def _is_sharded_tensor(value) -> bool:
    # By name: importing torch.distributed._shard costs time, and only PyTorch's FSDP makes these.
    return type(value).__name__ == "ShardedTensor"


def full_tensor(value):
    """The whole tensor behind a state-dict value: a DTensor or a ShardedTensor (the
    SHARDED forms, impl's or PyTorch FSDP1's, so either loads here directly) is
    gathered over its group; anything else is returned as it is. A collective for the
    sharded kinds: every rank of the group must call it for the same entries."""
    # On first use, not with impl.fsdp: torch.distributed.tensor takes over a second to import.
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if _is_sharded_tensor(value):
        return _gather_sharded_tensor(value)
    return value


def _gather_sharded_tensor(st) -> torch.Tensor:
    """All-gather a ShardedTensor's shards (each rank's packed back to back, padded to
    the largest rank's) and place each where its metadata says."""
    group = st._process_group
    world = dist.get_world_size(group)
    group_rank = {g: r for r, g in enumerate(dist.get_process_group_ranks(group))}  # placements name global ranks
    metadata = st.metadata()
    packed_at, numel_of_rank = {}, [0] * world  # shard metadata -> (rank in group, offset in that rank's pack)
    for shard in metadata.shards_metadata:
        rank = group_rank[shard.placement.rank()]
        packed_at[shard] = (rank, numel_of_rank[rank])
        numel_of_rank[rank] += math.prod(shard.shard_sizes)
    width = max(numel_of_rank)
    locals_ = st.local_shards()
    device = locals_[0].tensor.device if locals_ else torch.device("cpu")
    dtype = metadata.tensor_properties.dtype
    packed = torch.zeros(width, dtype=dtype, device=device)  # 1D, this rank's shards back to back
    for shard in locals_:
        _, offset = packed_at[shard.metadata]
        packed[offset : offset + shard.tensor.numel()].copy_(shard.tensor.reshape(-1))
    all_gather_output = torch.empty(world * width, dtype=dtype, device=device)  # 1D, rank-major
    comm.all_gather(all_gather_output, packed, group=group, async_op=False)
    full = torch.empty(metadata.size, dtype=dtype, device=device)
    for shard, (rank, offset) in packed_at.items():
        numel = math.prod(shard.shard_sizes)
        region = tuple(slice(o, o + n) for o, n in zip(shard.shard_offsets, shard.shard_sizes))
        start = rank * width + offset
        full[region] = all_gather_output[start : start + numel].view(shard.shard_sizes)
    return full


def _refuse_foreign_local(state_dict: dict) -> None:
    """PyTorch FSDP1's LOCAL_STATE_DICT (``<unit>._flat_param`` ShardedTensors) holds
    PyTorch's flat-parameter layout, which impl's flat shards need not share: refuse it
    with the way that works, rather than copying bytes that may mean other parameters."""
    foreign = [k for k, v in state_dict.items() if _is_sharded_tensor(v)]
    if foreign:
        raise RuntimeError(
            f"LOCAL_STATE_DICT entries {foreign[:3]}{' ...' if len(foreign) > 3 else ''} come from PyTorch's FSDP "
            "(ShardedTensor flat parameters): a LOCAL state dict is tied to one library's flat-parameter layout and "
            "does not load into impl.fsdp. Save with SHARDED_STATE_DICT through torch.distributed.checkpoint and load "
            "that (docs/fsdp.md, \"Checkpoints across PyTorch's FSDP and impl\")."
        )


def load_model_state_dict(root, state_dict: dict, strict: bool = True):
    kind = state_of(root).state_dict_type
    entries = _Entries(root)
    if kind is StateDictType.LOCAL_STATE_DICT:
        _check_sharded(entries.states, "LOCAL_STATE_DICT")
        _refuse_foreign_local(state_dict)
        expected = dict(entries.flat_params)
    elif kind in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        expected = {name: (state, ref) for name, state, ref in entries.managed}
    else:
        raise ValueError(f"Unknown StateDictType {kind!r}")
    names = set(expected) | {n for n, _, _ in entries.unmanaged} | {n for n, _, _ in entries.buffers}
    missing, unexpected = sorted(names - set(state_dict)), sorted(set(state_dict) - names)
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict: missing keys {missing}, unexpected keys {unexpected}")

    with torch.no_grad():
        if kind is StateDictType.LOCAL_STATE_DICT:
            for name, state in expected.items():
                if name in state_dict:
                    state.unit.handle.sharded_flat.copy_(state_dict[name])
        else:
            with summon_full_params(root, writeback=True):
                for name, (_, ref) in expected.items():
                    if name in state_dict:
                        ref.module.__dict__[ref.name].copy_(full_tensor(state_dict[name]))
        for name, mod, attr in entries.unmanaged:
            if name in state_dict:
                mod._parameters[attr].copy_(full_tensor(state_dict[name]))
        for name, mod, attr in entries.buffers:
            if name in state_dict:
                mod._buffers[attr].copy_(full_tensor(state_dict[name]))
    return missing, unexpected


# -- loading under a plain root (nn.Module's own walk) ---------------------------------

_WRAPPED = "_fsdp_wrapped_module."


def pre_load_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Before ``nn.Module`` loads this instance's part of a parent's state dict: give the
    keys under ``prefix`` the wrapped module's names, gather sharded values, and expose
    this instance's own parameters (``summon_full_params(recurse=False)``) so the walk
    copies into them. ``post_load_hook`` writes them back into the shard."""
    state = state_of(module)
    kind = state.state_dict_type
    for key in [k for k in state_dict if k.startswith(prefix) and not k[len(prefix):].startswith(_WRAPPED)]:
        rest = key[len(prefix):]
        value = state_dict.pop(key)
        state_dict[prefix + _WRAPPED + rest] = full_tensor(value) if kind is StateDictType.SHARDED_STATE_DICT else value
    if kind is not StateDictType.LOCAL_STATE_DICT:
        summon = summon_full_params(module, recurse=False, writeback=True)
        summon.__enter__()
        state.load_summon = summon


def post_load_hook(module, incompatible_keys) -> None:
    summon = getattr(state_of(module), "load_summon", None)
    if summon is not None:
        state_of(module).load_summon = None
        summon.__exit__(None, None, None)
