"""The life of one flat parameter: flatten a unit's parameters, shard, unshard, reshard.

A unit's original parameters are concatenated into one 1-D tensor, right-padded to a
multiple of the shard group's size, and split into equal shards; each rank keeps only
its own (ZeRO, arXiv 1910.02054, stage 3; PyTorch 1.13's FlatParameter). The
optimizer sees only the shard, ``sharded_flat``. While the unit runs, its parameters
are all-gathered into ``all_gather_output`` and the module's original parameter
attributes become ``unsharded_params``: one tensor per original parameter, each a view
of ``all_gather_output``'s storage at that parameter's offset.

Tensors, for a unit of ``numel`` parameters at shard group size ``n``::

    sharded_flat       nn.Parameter, 1-D (shard_numel,)       the optimizer's parameter
    all_gather_output  1-D (n * shard_numel,), compute dtype   storage freed when sharded
    unsharded_params   autograd leaves over all_gather_output's storage, one per
                       original parameter; their .grad are the unsharded gradients,
                       copied into one padded flat reduce_scatter_input after backward

With ``use_orig_params=True`` the original parameters also stay on their modules, as
views of ``sharded_flat`` (orig_params.py, [Note: use_orig_params]).

[Note: one autograd leaf per parameter]
The unsharded parameters are leaves of their own, not differentiable views of one flat
leaf. A view made in pre-forward (``torch.split``) gets an early autograd sequence
number, and the autograd engine runs ready nodes latest-created first, so the flat
gradient of a unit whose views were made early (the root's: embeddings, the head) would
only be assembled at the very end of backward, keeping its parameters unsharded and
its per-parameter gradients alive the whole time. A leaf's gradient is accumulated as
soon as it is ready (AccumulateGrad runs first), so each unit's post-backward fires as
soon as its last parameter's gradient lands, as in FSDP2. The leaves are separate
tensor objects over the storage, so the all-gather writing ``all_gather_output`` never
bumps the version counters autograd checks on the parameters it saved for backward.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from impl.fsdp.orig_params import OrigParamViews
from impl.streams import accelerator


class ShardedState(enum.Enum):
    """Whether a flat parameter's unsharded storage exists and holds gathered data."""

    SHARDED = enum.auto()
    """Only ``sharded_flat`` exists; ``all_gather_output`` has no storage."""
    UNSHARDING = enum.auto()
    """An all-gather into ``all_gather_output`` was issued and not yet waited on."""
    UNSHARDED = enum.auto()
    """``all_gather_output`` holds the full parameters; ``unsharded_params`` may be used."""


@dataclass(frozen=True)
class ParamInfo:
    """Where one original parameter lives: on which module, under which name, and at
    which offset of the flat parameter."""

    fqn: str  # name relative to the wrapped module, e.g. "layers.0.weight"
    module: nn.Module
    name: str
    shape: torch.Size
    numel: int
    offset: int


@dataclass(frozen=True)
class SharedParamInfo:
    """A second (third, ...) reference to an already-flattened parameter (tied weights)."""

    fqn: str
    module: nn.Module
    name: str
    primary: int  # index into FlatParamHandle.infos


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory but keep the tensor (and its aliases) usable after ``alloc_storage``."""
    if _storage_nbytes(t) != 0:
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if _storage_nbytes(t) != nbytes:
        t.untyped_storage().resize_(nbytes)


def _uniform(infos: list[ParamInfo], unique: list[nn.Parameter], use_orig_params: bool) -> tuple[bool, torch.dtype]:
    """(requires_grad, dtype) that every parameter of a unit shares: ValueError naming
    them where they differ (with use_orig_params, frozen ones simply get no gradient)."""
    requires_grad = {p.requires_grad for p in unique}
    if len(requires_grad) > 1 and use_orig_params:
        requires_grad = {True}  # frozen parameters simply get no gradient (as FSDP1 with use_orig_params)
    if len(requires_grad) > 1:
        names = [f"{i.fqn}(requires_grad={p.requires_grad})" for i, p in zip(infos, unique)]
        raise ValueError(
            "FlatParameter requires uniform requires_grad within one FSDP unit; wrap frozen and "
            f"trainable parameters in different units. Got: {', '.join(names)}"
        )
    dtypes = {p.dtype for p in unique}
    if len(dtypes) > 1:
        raise ValueError(f"FlatParameter requires uniform dtype within one FSDP unit, got {sorted(map(str, dtypes))}")
    return requires_grad.pop(), dtypes.pop()


class FlatParamHandle:
    """One unit's flat parameter: the shard this rank owns and the unsharded buffer.

    ``params`` are ``(fqn, module, attribute name, parameter)`` in flattening order;
    a parameter object that appears twice (tied weights) is flattened once and aliased.
    Communication is not done here (see unit.py); this class only owns the tensors and
    points the module's attributes at them.
    """

    def __init__(
        self,
        params: list[tuple[str, nn.Module, str, nn.Parameter]],
        shard_rank: int,
        shard_world: int,
        compute_dtype: torch.dtype | None,
        keep_unsharded_alias: bool,
        offload_to_cpu: bool = False,
        use_orig_params: bool = False,
    ):
        """``keep_unsharded_alias``: NO_SHARD without a cast, where the unsharded
        parameters are the sharded ones and are never freed. ``offload_to_cpu``: keep
        ``sharded_flat`` in pinned host memory while the unsharded parameters live on
        the parameters' device, when that device is an accelerator (on plain CPU there
        is nowhere else to put it). ``use_orig_params``: keep the original parameters
        on their modules as views of the shard ([Note: use_orig_params])."""
        self.use_orig_params = use_orig_params
        unique = self._index_params(params)  # self.infos, self.shared, self.aliases
        self.requires_grad, self.dtype = _uniform(self.infos, unique, use_orig_params)
        self.device = unique[0].device  # the compute device: where the unsharded parameters live
        self.numel = sum(info.numel for info in self.infos)
        self.shard_rank = shard_rank
        self.shard_world = shard_world
        self.shard_numel = math.ceil(self.numel / shard_world)  # per-rank numel, padding included
        self.padded_numel = self.shard_numel * shard_world
        self.compute_dtype = compute_dtype or self.dtype
        # What compute_dtype is outside FSDP_USE_FULL_PREC_IN_EVAL's full-precision
        # evaluation (set_compute_dtype switches between the two).
        self.mixed_compute_dtype = self.compute_dtype
        # Split sizes of views of a full copy (summon_full_params): every original parameter,
        # then the right padding.
        self._split_sizes = [i.numel for i in self.infos] + [self.padded_numel - self.numel]

        # CPU offload: the shard (and so its gradient and optimizer state) lives in host
        # memory; each all-gather copies it to the device first (device_shard).
        self.offloaded = offload_to_cpu and accelerator(self.device) is not None
        # The optimizer's parameter: this rank's shard, in the original dtype.
        self.sharded_flat = nn.Parameter(self._shard_of(unique), requires_grad=self.requires_grad)

        # All-gather destination; its storage exists only while unsharded. When the
        # unsharded parameters are the shard itself (NO_SHARD, no cast) it aliases the shard.
        self.keeps_unsharded = keep_unsharded_alias
        self._make_unsharded([p.requires_grad for p in unique])
        # Where the unsharded storage is in its life; unit.py moves it, the hooks read it.
        self.sharded_state = ShardedState.UNSHARDED if keep_unsharded_alias else ShardedState.SHARDED

        # The original parameters leave the module (unsharded_params replace them while
        # unsharded), or, with use_orig_params, stay as views of the shard.
        self.orig: OrigParamViews | None = None
        if use_orig_params:
            self.orig = OrigParamViews(self, unique)
            self.orig.use_sharded_views()
        else:
            self._remove_originals()

    # -- construction, in steps ------------------------------------------------------

    def _index_params(self, params) -> list[nn.Parameter]:
        """Each distinct parameter once, in flattening order (``infos``, at its offset in
        the flat parameter); a parameter met again (tied weights) as ``shared``; a module's
        attribute met again under another name as ``aliases``. Returns the distinct ones."""
        self.infos: list[ParamInfo] = []
        self.shared: list[SharedParamInfo] = []
        seen: dict[int, int] = {}  # id(parameter) -> index into self.infos
        # A module registered under two names (``self.b = self.a``) is one module: its
        # parameters are flattened once, and the second name is only an alias (state dicts
        # list it, as nn.Module.state_dict does).
        first_ref: dict[tuple[int, str], ParamInfo | SharedParamInfo] = {}
        self.aliases: list[tuple[str, ParamInfo | SharedParamInfo]] = []
        unique: list[nn.Parameter] = []
        offset = 0
        for fqn, module, name, param in params:
            if (id(module), name) in first_ref:
                self.aliases.append((fqn, first_ref[(id(module), name)]))
                continue
            if id(param) in seen:
                self.shared.append(SharedParamInfo(fqn, module, name, seen[id(param)]))
                first_ref[(id(module), name)] = self.shared[-1]
                continue
            seen[id(param)] = len(self.infos)
            unique.append(param)
            self.infos.append(ParamInfo(fqn, module, name, param.shape, param.numel(), offset))
            first_ref[(id(module), name)] = self.infos[-1]
            offset += param.numel()
        return unique

    def _shard_of(self, unique: list[nn.Parameter]) -> torch.Tensor:
        """This rank's slice of the parameters flattened and padded (1D, shard_numel), in
        pinned host memory when offloaded."""
        with torch.no_grad():
            full = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
            for info, param in zip(self.infos, unique):
                full[info.offset : info.offset + info.numel].copy_(param.reshape(-1))
            start = self.shard_rank * self.shard_numel
            shard = full if self.shard_world == 1 else full[start : start + self.shard_numel].clone()
        del full
        if self.offloaded:
            host = torch.empty(shard.shape, dtype=shard.dtype, device="cpu", pin_memory=True)
            host.copy_(shard)
            shard = host
        return shard

    def _remove_originals(self) -> None:
        """The original parameters off their modules (the unsharded ones replace them)."""
        for info in self.infos:
            del info.module._parameters[info.name]
        for s in self.shared:
            del s.module._parameters[s.name]

    # -- storage -------------------------------------------------------------------

    def _make_unsharded(self, requires_grad: list[bool]) -> None:
        """Make ``all_gather_output`` (storage freed unless it aliases the shard) and the
        unsharded parameters over it, in ``compute_dtype``."""
        if self.keeps_unsharded:
            self.all_gather_output = self.sharded_flat.detach()
        else:
            self.all_gather_output = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=self.device)
            free_storage(self.all_gather_output)
        # The parameters the module computes with, made once and valid while unsharded.
        # See [Note: one autograd leaf per parameter].
        storage = self.all_gather_output.untyped_storage()
        self.unsharded_params: list[torch.Tensor] = [
            torch.empty(0, dtype=self.compute_dtype, device=self.device)
            .set_(storage, info.offset, info.shape, _contiguous_strides(info.shape))
            .requires_grad_(wants)
            for info, wants in zip(self.infos, requires_grad)
        ]
        # id() of the unsharded parameters with a gradient hook (sync_requires_grad adds them).
        self._hooked: set[int] = set()

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """Compute in ``dtype`` from the next unshard: new unsharded parameters over a new
        ``all_gather_output`` (only while sharded; FSDP_USE_FULL_PREC_IN_EVAL switches
        between the mixed-precision dtype and full precision, see unit.py)."""
        if dtype == self.compute_dtype:
            return
        if self.sharded_state is not ShardedState.SHARDED or self.keeps_unsharded:
            raise RuntimeError("set_compute_dtype needs the flat parameter sharded and not aliasing its shard")
        self.compute_dtype = dtype
        self._make_unsharded([p.requires_grad for p in self.unsharded_params])

    def alloc_unsharded(self) -> torch.Tensor:
        """Give ``all_gather_output`` its storage back; returns it for the all-gather to fill."""
        alloc_storage(self.all_gather_output)
        return self.all_gather_output

    def device_shard(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard on the compute device in ``dtype`` (an all-gather's input):
        a non-blocking host-to-device copy under CPU offload, else a cast (or the shard
        itself). Allocated on the current stream."""
        shard = self.sharded_flat.detach()
        if not self.offloaded:
            return shard.to(dtype=dtype)
        on_device = torch.empty(shard.numel(), dtype=dtype, device=self.device)
        on_device.copy_(shard, non_blocking=True)
        return on_device

    def free_unsharded(self) -> None:
        if not self.keeps_unsharded:
            free_storage(self.all_gather_output)

    @property
    def unsharded_allocated(self) -> bool:
        return _storage_nbytes(self.all_gather_output) != 0

    # -- module attributes ---------------------------------------------------------------------

    def use_unsharded_params(self) -> None:
        """Point the module attributes at the unsharded parameters."""
        for param, info in zip(self.unsharded_params, self.infos):
            info.module.__dict__[info.name] = param
        for s in self.shared:
            s.module.__dict__[s.name] = self.unsharded_params[s.primary]

    def use_orig_param_attributes(self) -> None:
        """With use_orig_params, let ``module.<name>`` be the original parameter again
        (the instance dict entry shadowing ``_parameters`` goes); else nothing."""
        if self.orig is None:
            return
        for ref in [*self.infos, *self.shared]:
            ref.module.__dict__.pop(ref.name, None)

    def sync_requires_grad(self, on_grad_ready) -> None:
        """Let each unsharded parameter require grad as its original does now: the
        original parameter with use_orig_params, else the flat shard (``requires_grad_``
        on ``model.parameters()`` reaches only that). ``on_grad_ready`` is hooked on a
        parameter's gradient accumulation the first time it requires grad."""
        if self.orig is not None:
            wants = [p.requires_grad for p in self.orig.params]
        else:
            wants = [self.sharded_flat.requires_grad] * len(self.unsharded_params)
        for param, want in zip(self.unsharded_params, wants):
            if param.requires_grad != want:
                param.requires_grad_(want)
            if want and id(param) not in self._hooked:
                param.register_post_accumulate_grad_hook(on_grad_ready)
                self._hooked.add(id(param))

    @property
    def flat_param(self) -> nn.Parameter:
        """``sharded_flat`` under the name PyTorch 2.x's ``FlatParamHandle`` gives it."""
        return self.sharded_flat

    @property
    def uses_sharded_strategy(self) -> bool:
        return self.shard_world > 1

    @property
    def requires_grad_count(self) -> int:
        """Unsharded parameters that get a gradient in backward (frozen ones do not)."""
        return sum(p.requires_grad for p in self.unsharded_params)

    def expose_full_params(self, full: torch.Tensor) -> list[nn.Parameter]:
        """Register the original parameters again, as ``nn.Parameter`` views of ``full``
        (1-D, at least ``numel``): ``module.weight`` and ``named_parameters()`` see them,
        with their original names and shapes, as on the unwrapped model
        (``summon_full_params``). Tied names get the same object. Returns the parameters,
        in ``infos`` order; ``hide_full_params`` undoes this."""
        if self.orig is not None:  # the same parameter objects, pointed at the full copy
            params = self.orig.use_full_views(full)
        else:
            pieces = torch.split(full[: self.padded_numel], self._split_sizes)
            # requires_grad as the flat shard has it now (it may have been frozen after wrapping).
            params = [
                nn.Parameter(piece.view(info.shape), requires_grad=self.sharded_flat.requires_grad)
                for piece, info in zip(pieces, self.infos)
            ]
        for param, info in zip(params, self.infos):
            info.module._parameters[info.name] = param
            info.module.__dict__[info.name] = param
        for s in self.shared:
            s.module._parameters[s.name] = params[s.primary]
            s.module.__dict__[s.name] = params[s.primary]
        return params

    @torch.no_grad()
    def hide_full_params(self, params: list[nn.Parameter], full: torch.Tensor, snapshot: list) -> None:
        """Undo ``expose_full_params``: unregister the parameters and put back the
        attribute values of ``snapshot``. A parameter the user replaced
        (``module.weight = nn.Parameter(...)``, ``p.data = ...``) is first copied into
        ``full``, so that a writeback sees it like an in-place edit."""
        pieces = torch.split(full[: self.padded_numel], self._split_sizes)
        for param, piece, info in zip(params, pieces, self.infos):
            current = info.module._parameters.get(info.name, param)
            if current is not param or current.data_ptr() != piece.data_ptr():
                piece.copy_(current.detach().reshape(-1))
        if self.orig is not None:
            for ref, param in zip(self.infos, params):  # a replaced parameter object: the original returns
                ref.module._parameters[ref.name] = param
            for s in self.shared:
                s.module._parameters[s.name] = params[s.primary]
            self.orig.use_sharded_views()
        else:
            for ref in [*self.infos, *self.shared]:
                ref.module._parameters.pop(ref.name, None)
        self.restore_views(snapshot)

    # -- gradients -------------------------------------------------------------------

    def has_unsharded_grads(self) -> bool:
        return any(p.grad is not None for p in self.unsharded_params)

    def take_unsharded_grad(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The unsharded gradients as one padded flat tensor in ``dtype`` (the reduce
        dtype; default: the gradients' own), the reduce-scatter input; parameters without
        a gradient contribute zeros. Clears each per-parameter .grad as it is copied.

        Cast while copied, so that no flat copy in the gradients' own dtype exists beside
        the reduce-scatter input (FSDP2 copies into its reduce-scatter input the same
        way): under bf16 mixed precision with fp32 reduction that copy was half a unit's
        fp32 gradient, kept alive until the reduce-scatter completed."""
        grads = [p.grad for p in self.unsharded_params]
        dtype = dtype or next(g.dtype for g in grads if g is not None)
        flat = torch.empty(self.padded_numel, dtype=dtype, device=self.device)
        for grad, info, param in zip(grads, self.infos, self.unsharded_params):
            piece = flat[info.offset : info.offset + info.numel]
            if grad is None:
                piece.zero_()
            else:
                piece.copy_(grad.reshape(-1))
                param.grad = None
        flat[self.numel :].zero_()
        return flat

    def views_snapshot(self) -> list:
        """The current attribute values, to put back with ``restore_views``."""
        return [i.module.__dict__.get(i.name) for i in self.infos] + [s.module.__dict__.get(s.name) for s in self.shared]

    def restore_views(self, snapshot: list) -> None:
        for ref, value in zip([*self.infos, *self.shared], snapshot):
            if value is None:
                ref.module.__dict__.pop(ref.name, None)
            else:
                ref.module.__dict__[ref.name] = value

    def param_fqns(self) -> list[str]:
        return [i.fqn for i in self.infos]

    def shard_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a padded, unsharded flat tensor."""
        start = self.shard_rank * self.shard_numel
        return full[start : start + self.shard_numel]
