"""The public entry point: ``FullyShardedDataParallel``, PyTorch 1.13's constructor.

Construction (docs/behaviour.md §F2) validates the arguments, wraps children as the
auto-wrap policy says, and flattens and shards the parameters this instance manages:
those of its module that are neither inside a nested instance nor ignored ("the outer
unit takes the leftovers"). Everything that needs the whole tree (which instance is
the root, the shared rate limiter and execution order) waits for the first forward
(``_lazy_init``). The optimizer must be built after wrapping: it sees ``flat_param``,
each instance's shard.

Unlike PyTorch 1.13 this runs on CPU with gloo as well as on CUDA with NCCL.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from impl import comm
from impl.fsdp import process_groups, runtime
from impl.fsdp.api import (
    DEFAULT_LIMITER_DEPTH,
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
    TrainingState,
)
from impl.fsdp import optim_state
from impl.fsdp import state_dict as state_dict_module
from impl.fsdp.flat_param import FlatParamHandle
from impl.fsdp.rate_limiter import RateLimiter
from impl.fsdp.unit import FlatParamUnit
from impl.streams import Streams
from impl.fsdp.wrap import recursive_wrap

# What each nesting level adds to parameter names; summon_full_params strips it.
_WRAPPED_PREFIX = "_fsdp_wrapped_module."

# Construction order of units in this process, for the first-iteration order check.
# Every rank builds the same model the same way, so equal indices mean the same unit.
_next_unit_index = 0


class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state across ranks (ZeRO-3).

    Arguments as in PyTorch 1.13; ``limiter_depth`` (keyword-only, an extension) sets how
    many unsharded units ``limit_all_gathers`` allows in flight (PyTorch fixes it at 2).
    ``process_group`` may be a ``(shard_group, replicate_group)`` pair for HYBRID_SHARD.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable[..., bool] | None = None,
        backward_prefetch: BackwardPrefetch | None = None,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = False,
        *,
        limiter_depth: int = DEFAULT_LIMITER_DEPTH,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("FullyShardedDataParallel needs torch.distributed to be initialized")
        if isinstance(limiter_depth, bool) or not isinstance(limiter_depth, int) or limiter_depth < 1:
            raise ValueError(f"limiter_depth must be an int >= 1, got {limiter_depth!r}")
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise ValueError(f"backward_prefetch must be a BackwardPrefetch or None, got {backward_prefetch!r}")
        if sharding_strategy is not None and not isinstance(sharding_strategy, ShardingStrategy):
            raise ValueError(f"sharding_strategy must be a ShardingStrategy or None, got {sharding_strategy!r}")

        # Steps in the order docs/behaviour.md §F2 lists them.
        # 1. ignored modules, expanded over their subtrees and nested instances' sets.
        ignored = _ignored_modules(module, ignored_modules)
        ignored_params = {id(p) for m in ignored for p in m.parameters()}

        # 2. auto-wrap the children; each child instance gets the same arguments.
        if auto_wrap_policy is not None:
            for name, sub in module.named_modules():
                if isinstance(sub, FullyShardedDataParallel):
                    raise ValueError(
                        f"Expected {name or 'the module'} to NOT be FullyShardedDataParallel if using an "
                        "`auto_wrap_policy`"
                    )
            child_kwargs = dict(
                process_group=process_group,
                sharding_strategy=sharding_strategy,
                cpu_offload=cpu_offload,
                backward_prefetch=backward_prefetch,
                mixed_precision=mixed_precision,
                param_init_fn=param_init_fn,
                device_id=device_id,
                sync_module_states=sync_module_states,
                forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers,
                limiter_depth=limiter_depth,
            )

            def wrap_child(child: nn.Module) -> nn.Module:
                child_ignored = [m for m in ignored if any(m is c for c in child.modules())]
                return FullyShardedDataParallel(child, ignored_modules=child_ignored, **child_kwargs)

            recursive_wrap(module, auto_wrap_policy, wrap_child, ignored, ignored_params, only_wrap_children=True)

        # 3-6. devices: materialize meta modules, move to device_id.
        _materialize(module, param_init_fn, device_id, ignored)
        managed = list(_managed_params(module, ignored))
        devices = {p.device for _, _, _, p in managed}
        if len(devices) > 1:
            raise RuntimeError(f"FSDP only supports single device modules but got params on {sorted(map(str, devices))}")
        self.compute_device = devices.pop() if devices else _default_device(device_id)
        if device_id is not None and torch.device(device_id).type == "cuda":
            want = torch.device("cuda", torch.device(device_id).index or torch.cuda.current_device())
            if self.compute_device != want:
                raise ValueError(
                    f"Inconsistent compute device and `device_id`: {self.compute_device} vs {want}"
                )

        # 7. groups and the effective strategy.
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        if strategy is ShardingStrategy.HYBRID_SHARD:
            shard_group, replicate_group = process_groups.hybrid_groups(process_group)
            if dist.get_world_size(replicate_group) == 1:
                replicate_group = None
            world = dist.get_world_size(shard_group) * (dist.get_world_size(replicate_group) if replicate_group else 1)
        else:
            if isinstance(process_group, tuple):
                raise ValueError(f"a (shard_group, replicate_group) pair is only valid with HYBRID_SHARD, not {strategy.name}")
            shard_group = process_group if process_group is not None else dist.group.WORLD
            replicate_group = None
            world = dist.get_world_size(shard_group)
            if world == 1:
                strategy = ShardingStrategy.NO_SHARD  # as in PyTorch: nothing to shard over
        self.process_group = shard_group
        self.sharding_strategy = strategy
        # PyTorch 1.13's public attributes: rank and size in the (shard) process group.
        self.rank = dist.get_rank(shard_group)
        self.world_size = dist.get_world_size(shard_group)
        # 8. sync_module_states: rank 0's parameters and buffers everywhere.
        if sync_module_states:
            _broadcast_module_states(module, ignored, managed)

        # Policies this instance applies (the root's limiter settings win at lazy init).
        self._mixed_precision = mixed_precision
        self._cpu_offload = cpu_offload or CPUOffload()
        self._backward_prefetch = backward_prefetch
        self._forward_prefetch = forward_prefetch
        self._limit_all_gathers = limit_all_gathers
        self._limiter_depth = limiter_depth
        self._ignored_modules = ignored
        # The same settings under PyTorch 1.13's public attribute names.
        self.mixed_precision = mixed_precision
        self.cpu_offload = self._cpu_offload
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self.training_state = TrainingState.IDLE
        # Set at lazy init: whether this is the root, and the state shared under it.
        self._is_root: bool | None = None
        self._root_state: runtime.RootState | None = None
        # Whether this backward already ran this instance's pre-backward hook, and how many
        # of its parameters have their gradient (post-backward runs when all have).
        self._ran_pre_backward = False
        self._grads_ready = 0
        # What state_dict() returns; set with FSDP.state_dict_type (state_dict.py).
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config = FullStateDictConfig()
        # (id(module), buffer name) -> dtype before mixed precision cast it, for FULL state dicts.
        self._original_buffer_dtypes: dict[tuple[int, str], torch.dtype] = {}

        # 9. flatten and shard.
        self._fsdp_wrapped_module = module
        self.params: list[nn.Parameter] = []
        self._unit: FlatParamUnit | None = None
        if managed:
            for fqn, _, _, p in managed:
                if getattr(p, "_impl_fsdp_flattened", False):
                    raise ValueError(
                        f"parameter {fqn} is already managed by another FSDP unit: shared (tied) parameters "
                        "must be wrapped in the same unit (their lowest common ancestor)"
                    )
            sharded = strategy is not ShardingStrategy.NO_SHARD
            param_dtype = mixed_precision.param_dtype if mixed_precision else None
            handle = FlatParamHandle(
                managed,
                shard_rank=dist.get_rank(shard_group) if sharded else 0,
                shard_world=dist.get_world_size(shard_group) if sharded else 1,
                compute_dtype=param_dtype,
                keep_unsharded_alias=not sharded
                and (param_dtype is None or param_dtype == managed[0][3].dtype)
                and not (self._cpu_offload.offload_params and self.compute_device.type != "cpu"),
                offload_to_cpu=self._cpu_offload.offload_params,
            )
            for _, _, _, p in managed:
                p._impl_fsdp_flattened = True
            global _next_unit_index
            self._unit = FlatParamUnit(
                handle, strategy, shard_group, replicate_group, world, mixed_precision, _next_unit_index
            )
            _next_unit_index += 1
            self.flat_param = handle.sharded_flat
            self.params = [handle.sharded_flat]  # PyTorch 1.13: this instance's flat parameters
            if handle.requires_grad:
                for param in handle.unsharded_params:
                    param.register_post_accumulate_grad_hook(functools.partial(_post_accumulate_grad, self))
            if handle.keeps_unsharded:
                handle.use_unsharded_params()

    # -- forward ---------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._root_state is None:
            self._lazy_init()
        args, kwargs = runtime.pre_forward(self, args, kwargs)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return runtime.post_forward(self, output)

    def _lazy_init(self) -> None:
        """Make this instance the root of every instance below it (docs/behaviour.md §F2, lazy init)."""
        instances = [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        for inst in instances[1:]:
            if inst._root_state is not None and inst._is_root:
                raise RuntimeError("an FSDP instance that already ran as a root cannot be nested under another root")
            if inst._limit_all_gathers != self._limit_all_gathers or inst._limiter_depth != self._limiter_depth:
                warnings.warn("nested FSDP instances' limit_all_gathers/limiter_depth differ: the root's settings apply")
        # See [Note: streams]; the device of the units (a root without parameters may not know it).
        streams = Streams(next((i.compute_device for i in instances if i._unit is not None), self.compute_device))
        limiter = RateLimiter(self._limit_all_gathers, self._limiter_depth, use_events=streams.cuda)
        state = runtime.RootState(self, instances, limiter, streams)
        for inst in instances:
            inst._is_root = inst is self
            inst._root_state = state
            if inst._unit is not None:
                inst._unit.limiter = limiter
                inst._unit.streams = streams
            inst._cast_buffers()

    def _cast_buffers(self) -> None:
        mp = self._mixed_precision
        if mp is None or mp.buffer_dtype is None:
            return
        for module in _managed_modules(self._fsdp_wrapped_module, self._ignored_modules):
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point() and buf.dtype != mp.buffer_dtype:
                    self._original_buffer_dtypes[(id(module), name)] = buf.dtype
                    module._buffers[name] = buf.to(mp.buffer_dtype)

    def __getattr__(self, name: str) -> Any:
        """Attributes not found here come from the wrapped module, as in PyTorch."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__["_modules"].get("_fsdp_wrapped_module")
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def __getitem__(self, key):
        return self._fsdp_wrapped_module.__getitem__(key)

    # -- names inside summon_full_params (as PyTorch 1.13) ---------------------------------

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]:
        """Inside ``summon_full_params`` the names lose every ``_fsdp_wrapped_module.``
        prefix (nested instances add one each), so they are the unwrapped model's."""
        in_summon = self.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, param in super().named_parameters(*args, **kwargs):
            yield (name.replace(_WRAPPED_PREFIX, "") if in_summon else name), param

    def named_buffers(self, *args, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
        """As ``named_parameters``: clean names inside ``summon_full_params``."""
        in_summon = self.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, buf in super().named_buffers(*args, **kwargs):
            yield (name.replace(_WRAPPED_PREFIX, "") if in_summon else name), buf

    # -- utilities (utils.py holds the mechanics) --------------------------------------

    @property
    def is_root(self) -> bool | None:
        return self._is_root

    @property
    def module(self) -> nn.Module:
        """The wrapped module (like DistributedDataParallel's ``module``)."""
        return self._fsdp_wrapped_module

    def check_is_root(self) -> bool:
        """Whether this instance is the root; runs the lazy initialization if needed (as in 1.13)."""
        if self._root_state is None:
            self._lazy_init()
        return bool(self._is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every FSDP instance in ``module`` (``module`` included), only the roots with ``root_only``."""
        return [
            m
            for m in module.modules()
            if isinstance(m, FullyShardedDataParallel) and (not root_only or m.check_is_root())
        ]

    @property
    def params_with_grad(self) -> list[nn.Parameter]:
        """Every parameter of this tree that has a gradient (the flat shards, outside summon)."""
        return [p for p in self.parameters() if p.grad is not None]

    def fsdp_instances(self) -> list["FullyShardedDataParallel"]:
        """Every FSDP instance in this tree, this one first."""
        return [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]

    def limiter_metrics(self) -> dict[str, float]:
        """The rate limiter's counters since the previous call (see rate_limiter.py)."""
        if self._root_state is None:
            return RateLimiter(False, 1).take_metrics()
        return self._root_state.limiter.take_metrics()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally instead of reducing them (root only).

        Costs memory: every unit keeps a full-size gradient until the next synced backward.
        """
        if self._root_state is None:
            self._lazy_init()
        if not self._is_root:
            raise RuntimeError("no_sync() must be called on the root FSDP instance")
        runtime.check_state(self, TrainingState.IDLE)
        state = self._root_state
        previous = state.sync_gradients
        state.sync_gradients = False
        try:
            yield
        finally:
            state.sync_gradients = previous

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``nn.Module.apply`` with this instance's full parameters summoned around it
        (writeback on), as in PyTorch 1.13: ``fn`` sees every module's original
        parameters with their full shapes (nested instances summon their own as the
        recursion reaches them), and each rank keeps its shard of what ``fn`` wrote.
        Typical use: ``model.apply(init_fn)``. Not allowed inside ``summon_full_params``."""
        from impl.fsdp.utils import summon_full_params

        runtime.check_state(self, TrainingState.IDLE)
        with summon_full_params(self, recurse=False, writeback=True):
            return super().apply(fn)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Not implemented (docs/fsdp.md, "Differences from PyTorch FSDP 1.13"): raise
        rather than fall through to the wrapped module's attribute lookup."""
        raise NotImplementedError(
            "impl.fsdp does not support register_comm_hook: its gradient reduction "
            "(pre/post divide, HYBRID_SHARD's two stages, bounded reductions in flight) has no hook point"
        )

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        from impl.fsdp.utils import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type)

    # -- state dicts (state_dict.py) ----------------------------------------------------

    @staticmethod
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None):
        """Context manager: what ``state_dict()`` / ``load_state_dict()`` of every FSDP
        instance in ``module`` produce and accept (FULL by default)."""
        return state_dict_module.state_dict_type(module, state_dict_type, state_dict_config)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if self.training_state is not TrainingState.IDLE:
            runtime.check_state(self, TrainingState.IDLE)
        out = state_dict_module.model_state_dict(self)
        if destination is None:
            return out
        for k, v in out.items():
            destination[prefix + k] = v
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        from torch.nn.modules.module import _IncompatibleKeys

        missing, unexpected = state_dict_module.load_model_state_dict(self, state_dict, strict)
        return _IncompatibleKeys(missing, unexpected)

    # Optimizer state dicts, as static methods like PyTorch's (optim_state.py).
    full_optim_state_dict = staticmethod(optim_state.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(optim_state.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(optim_state.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(optim_state.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(optim_state.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(optim_state.rekey_optim_state_dict)

    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
    ):
        from impl.fsdp.utils import summon_full_params

        return summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu)


def _post_accumulate_grad(instance: FullyShardedDataParallel, _param: torch.Tensor) -> None:
    """One of the unit's parameters has its gradient; the unit's post-backward runs
    with the last one (or, for parameters that get none, at the end of backward)."""
    instance._grads_ready += 1
    if instance._grads_ready == len(instance._unit.handle.unsharded_params):
        runtime.post_backward(instance)


# -- construction helpers ----------------------------------------------------------------


def _ignored_modules(root: nn.Module, ignored_modules) -> set[nn.Module]:
    if ignored_modules is None:
        ignored: set[nn.Module] = set()
    else:
        try:
            given = list(ignored_modules)
        except TypeError:
            raise TypeError(
                f"`ignored_modules` should be an iterable of `torch.nn.Module`s but got {type(ignored_modules)}"
            ) from None
        ignored = set()
        for m in given:
            if not isinstance(m, nn.Module):
                raise TypeError(f"`ignored_modules` should be an iterable of `torch.nn.Module`s but got an element {type(m)}")
            if isinstance(m, FullyShardedDataParallel):
                raise ValueError("`ignored_modules` should not include FSDP modules")
            ignored.update(m.modules())
    if root in ignored:
        warnings.warn("Trying to ignore the top-level module passed to FSDP: its parameters stay unmanaged")
    for sub in root.modules():
        if isinstance(sub, FullyShardedDataParallel):
            ignored.update(sub._ignored_modules)
    return ignored


def _managed_modules(module: nn.Module, ignored: set[nn.Module]) -> Iterator[nn.Module]:
    """``module`` and its descendants, stopping at nested instances and ignored modules."""
    if module in ignored:
        return
    yield module
    for child in module._modules.values():
        if child is None or isinstance(child, FullyShardedDataParallel):
            continue
        yield from _managed_modules(child, ignored)


def _managed_params(module: nn.Module, ignored: set[nn.Module]):
    """(fqn, owner module, attribute name, parameter) of the parameters this unit flattens."""
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    for m in _managed_modules(module, ignored):
        prefix = names.get(id(m), "")
        for name, p in m._parameters.items():
            if p is not None:
                yield (f"{prefix}.{name}" if prefix else name), m, name, p


def _default_device(device_id) -> torch.device:
    if device_id is not None:
        return torch.device(device_id)
    return torch.device("cpu")


def _materialize(module: nn.Module, param_init_fn, device_id, ignored) -> None:
    is_meta = any(p.is_meta for m in _managed_modules(module, ignored) for p in m._parameters.values() if p is not None)
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"Expected param_init_fn to be a callable but got {type(param_init_fn)}")
    if is_meta:
        if param_init_fn is not None:
            param_init_fn(module)
        else:
            # Only this unit's own modules: nested instances (built first by auto-wrap)
            # already hold their initialized shards, which to_empty would overwrite.
            for m in _managed_modules(module, ignored):
                m.to_empty(device=_default_device(device_id), recurse=False)
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    if device_id is not None:
        device = torch.device(device_id)
        for m in _managed_modules(module, ignored):
            for name, p in m._parameters.items():
                if p is not None and p.device != device:
                    m._parameters[name] = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
            for name, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[name] = b.to(device)


def _broadcast_module_states(module: nn.Module, ignored, managed) -> None:
    with torch.no_grad():
        for _, _, _, p in managed:
            comm.broadcast(p.data, src=0, async_op=False)
        for m in _managed_modules(module, ignored):
            for b in m._buffers.values():
                if b is not None:
                    comm.broadcast(b, src=0, async_op=False)
