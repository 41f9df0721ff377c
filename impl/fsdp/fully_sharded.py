"""The public entry point: ``FullyShardedDataParallel``, PyTorch 2.x FSDP1's constructor.

Construction (docs/behaviour.md §F2) validates the arguments, wraps children as the
auto-wrap policy says, and flattens and shards the parameters this instance manages:
those of its module that are neither inside a nested instance nor ignored ("the outer
unit takes the leftovers"). Everything that needs the whole tree (which instance is
the root, the shared rate limiter and execution order) waits for the first forward
(``_lazy_init``). The optimizer must be built after wrapping: it sees ``_flat_param``,
each instance's shard, or with ``use_orig_params=True`` the original parameters as
views of it (orig_params.py, [Note: use_orig_params]).

What the hooks and utilities need of an instance lives in its ``FSDPState``
(state.py, kept as ``_fsdp_state``); the attributes PyTorch 1.13 exposes on the module
(``training_state``, ``sharding_strategy``, ...) are properties reading it. No other
module of the package but its ``__init__`` imports this one: the hooks and utilities
find instances with traversal.py.

Unlike PyTorch 1.13 this runs on CPU with gloo as well as on CUDA with NCCL.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.module import _IncompatibleKeys

from impl import comm
from impl.fsdp import optim_state, process_groups, runtime, traversal, utils, wrap
from impl.fsdp import state_dict as state_dict_module
from impl.fsdp.api import (
    DEFAULT_LIMITER_DEPTH,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
    TrainingState,
)
from impl.fsdp.flat_param import FlatParamHandle
from impl.fsdp.rate_limiter import RateLimiter
from impl.fsdp.state import FSDPState, RootState
from impl.fsdp.unit import FlatParamUnit
from impl.fsdp.wrap import recursive_wrap
from impl.streams import Streams, accelerator

# What each nesting level adds to parameter names; summon_full_params strips it.
_WRAPPED_PREFIX = "_fsdp_wrapped_module."



def _state_attribute(name: str, doc: str | None = None) -> property:
    """A public attribute of the instance that lives in its FSDPState."""
    return property(lambda self: getattr(self._fsdp_state, name),
                    lambda self, value: setattr(self._fsdp_state, name, value), doc=doc)


class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state across ranks (ZeRO-3).

    Arguments as in PyTorch 2.x's FSDP1, with its defaults (``backward_prefetch=
    BACKWARD_PRE``, ``limit_all_gathers=True``; 1.13 had None and False);
    ``limiter_depth`` (keyword-only, an extension) sets how many unsharded units
    ``limit_all_gathers`` allows in flight (PyTorch fixes it at 2). ``process_group``
    may be a ``(shard_group, replicate_group)`` pair for HYBRID_SHARD, or give
    ``device_mesh``: 1-D for the other strategies, 2-D ``(replicate, shard)`` for hybrid.
    ``ignored_states`` takes modules or parameters (not both kinds); ``ignored_modules``
    is its older form.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable[..., bool] | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
        *,
        limiter_depth: int = DEFAULT_LIMITER_DEPTH,
    ):
        super().__init__()
        _check_arguments(process_group, sharding_strategy, backward_prefetch, use_orig_params, device_mesh,
                         limiter_depth)
        hybrid = sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
        process_group, child_process_group = _resolve_process_groups(process_group, device_mesh, sharding_strategy,
                                                                     hybrid, auto_wrap_policy)

        # Steps in the order docs/behaviour.md §F2 lists them.
        # 1. ignored modules (and parameters), expanded over subtrees and nested instances' sets.
        ignored, ignored_param_list, ignored_params = _init_ignored(module, ignored_modules, ignored_states)

        # 2. auto-wrap the children; each child instance gets the same arguments.
        if auto_wrap_policy is not None:
            _auto_wrap_children(module, auto_wrap_policy, ignored, ignored_param_list, ignored_params, dict(
                process_group=child_process_group, sharding_strategy=sharding_strategy, cpu_offload=cpu_offload,
                backward_prefetch=backward_prefetch, mixed_precision=mixed_precision, param_init_fn=param_init_fn,
                device_id=device_id, sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params, device_mesh=device_mesh,
                limiter_depth=limiter_depth,
            ))

        # 3-6. devices: materialize meta modules, move to device_id.
        _materialize(module, param_init_fn, device_id, ignored)
        managed = list(_managed_params(module, ignored, ignored_params))
        devices = {p.device for _, _, _, p in managed}
        if len(devices) > 1:
            raise RuntimeError(f"FSDP only supports single device modules but got params on {sorted(map(str, devices))}")
        compute_device = devices.pop() if devices else _default_device(device_id)
        if device_id is not None and torch.device(device_id).type == "cuda":
            want = cuda_device_of(device_id)
            if compute_device != want:
                raise ValueError(
                    f"Inconsistent compute device and `device_id`: {compute_device} vs {want}"
                )

        # 7. groups and the effective strategy.
        strategy, shard_group, replicate_group, world = self._init_groups(process_group, sharding_strategy, hybrid)
        self._device_mesh = device_mesh  # PyTorch 2.x's attribute
        # 8. sync_module_states: rank 0's parameters and buffers everywhere.
        if sync_module_states:
            _broadcast_module_states(module, ignored, managed)

        # Everything the hooks and utilities read; the root's lazy init completes it.
        # Kept under traversal.STATE_ATTR, which is what makes this module an FSDP instance.
        state = FSDPState(
            compute_device=compute_device,
            sharding_strategy=strategy,
            mixed_precision=mixed_precision,
            cpu_offload=cpu_offload or CPUOffload(),
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            limiter_depth=limiter_depth,
            ignored_modules=ignored,
            ignored_params=ignored_params,
            use_orig_params=use_orig_params,
            device_mesh=device_mesh,
            # As PyTorch's FSDP1, read at construction ([Note: full precision in evaluation]).
            full_precision_in_eval=os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL", "") == "1",
        )
        self._fsdp_state = state

        # Loading under a plain (non-FSDP) parent goes through nn.Module's own walk.
        self._register_load_state_dict_pre_hook(state_dict_module.pre_load_hook, with_module=True)
        self.register_load_state_dict_post_hook(state_dict_module.post_load_hook)

        # 9. flatten and shard.
        self._fsdp_wrapped_module = module
        self.params: list[nn.Parameter] = []
        if managed:
            self._flatten_and_shard(module, managed, state, shard_group, replicate_group, world)

    def _init_groups(self, process_group, sharding_strategy, hybrid: bool):
        """Step 7: (the effective strategy, shard group, replicate group or None, ranks
        in all), with PyTorch's public attributes of them. NO_SHARD where the shard group
        has one rank, as in PyTorch: nothing to shard over."""
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        if hybrid:
            shard_group, replicate_group = process_groups.hybrid_groups(process_group)
            self._inter_node_pg = replicate_group  # PyTorch 2.x's name for the replicate group (even of one rank)
            if dist.get_world_size(replicate_group) == 1:
                replicate_group = None
            world = dist.get_world_size(shard_group) * (dist.get_world_size(replicate_group) if replicate_group else 1)
        else:
            if isinstance(process_group, tuple):
                raise ValueError(f"a (shard_group, replicate_group) pair is only valid with HYBRID_SHARD, not {strategy.name}")
            shard_group = process_group if process_group is not None else dist.group.WORLD
            replicate_group = self._inter_node_pg = None
            world = dist.get_world_size(shard_group)
            if world == 1:
                strategy = ShardingStrategy.NO_SHARD  # as in PyTorch: nothing to shard over
        # PyTorch 1.13's public attributes: the (shard) process group, rank and size in it.
        # Descriptive only: the unit keeps the groups it communicates over.
        self.process_group = shard_group
        self.rank = dist.get_rank(shard_group)
        self.world_size = dist.get_world_size(shard_group)
        return strategy, shard_group, replicate_group, world

    def _flatten_and_shard(self, module: nn.Module, managed, state: FSDPState, shard_group, replicate_group,
                           world: int) -> None:
        """Step 9: the managed parameters into one flat parameter, sharded (or not, under
        NO_SHARD), its unit in ``state``, and the flat parameter on the wrapped module."""
        strategy, mixed_precision, use_orig_params = state.sharding_strategy, state.mixed_precision, state.use_orig_params
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
            and not (state.cpu_offload.offload_params and accelerator(state.compute_device) is not None),
            offload_to_cpu=state.cpu_offload.offload_params,
            use_orig_params=use_orig_params,
        )
        for _, _, _, p in managed:
            p._impl_fsdp_flattened = True
        state.unit = FlatParamUnit(handle, strategy, shard_group, replicate_group, world, mixed_precision)
        # On the wrapped module, under PyTorch 2.x's name: a registered parameter, or
        # with use_orig_params a plain attribute (the original parameters are the module's).
        handle.sharded_flat._impl_fsdp_flat = True  # what state dicts and clipping skip
        if use_orig_params:
            module.__dict__[utils.FLAT_PARAM] = handle.sharded_flat
        else:
            module.register_parameter(utils.FLAT_PARAM, handle.sharded_flat)
        self.params = [handle.sharded_flat]  # PyTorch 1.13: this instance's flat parameters
        handle.sync_requires_grad(functools.partial(runtime.post_accumulate_grad, state))
        if not use_orig_params:
            # The attributes exist from the start, as in PyTorch (``repr``, ``hasattr``): the
            # unsharded parameters, whose storage is freed while sharded (stale until used).
            handle.use_unsharded_params()

    # -- forward ---------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._fsdp_state
        if state.root_state is None:
            self._lazy_init()
        args, kwargs = runtime.pre_forward(state, args, kwargs, training=self.training)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return runtime.post_forward(state, output)

    def _lazy_init(self) -> None:
        """Make this instance the root of every instance below it (docs/behaviour.md §F2, lazy init)."""
        me = self._fsdp_state
        instances = traversal.fsdp_modules(self)
        states = [inst._fsdp_state for inst in instances]
        for other in states:
            unit = other.unit
            if unit is not None and other.cpu_offload.offload_params and unit.handle.sharded_flat.device.type != "cpu":
                raise RuntimeError(  # the module was moved after construction (as PyTorch's FSDP1 checks)
                    "An FSDP-managed module with parameter CPU offloading enabled has parameters on "
                    f"{unit.handle.sharded_flat.device}. Make sure to not move the module from CPU when offloading "
                    "parameters."
                )
        for other in states[1:]:
            if other.root_state is not None and other.is_root:
                raise RuntimeError("an FSDP instance that already ran as a root cannot be nested under another root")
            if other.limit_all_gathers != me.limit_all_gathers or other.limiter_depth != me.limiter_depth:
                warnings.warn("nested FSDP instances' limit_all_gathers/limiter_depth differ: the root's settings apply")
        # See [Note: streams]; the device of the units (a root without parameters may not know it).
        streams = Streams(next((s.compute_device for s in states if s.unit is not None), me.compute_device))
        limiter = RateLimiter(me.limit_all_gathers, me.limiter_depth, use_events=streams.cuda,
                              clock=getattr(streams.module, "host_clock", None))
        shared = RootState(states, limiter, streams)
        # Each unit's index is its position in this root's tree: the same on every rank
        # that builds the same tree, however many other FSDP modules each rank has built.
        for index, state in enumerate(s for s in states if s.unit is not None):
            state.unit.index = index
        for inst, state in zip(instances, states):
            state.is_root = state is me
            state.root_state = shared
            if state.unit is not None:
                state.unit.limiter = limiter
                state.unit.streams = streams
            inst._cast_buffers()

    def _cast_buffers(self) -> None:
        state = self._fsdp_state
        mp = state.mixed_precision
        if mp is None or mp.buffer_dtype is None:
            return
        for module in traversal.managed_modules(self._fsdp_wrapped_module, state.ignored_modules):
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point() and buf.dtype != mp.buffer_dtype:
                    state.original_buffer_dtypes[(id(module), name)] = buf.dtype
                    state.cast_buffers.append((module, name))
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

    # -- the state, under PyTorch 1.13's attribute names ----------------------------------
    # Reads and assignments go to the instance's FSDPState, which the runtime reads: as in
    # 1.13, where these are plain attributes, an assignment takes effect from the next use.

    compute_device = _state_attribute("compute_device")
    sharding_strategy = _state_attribute("sharding_strategy",
                                         "The effective strategy (NO_SHARD when the shard group has a single rank).")
    @property
    def mixed_precision(self) -> MixedPrecision:
        """The instance's mixed precision; ``MixedPrecision()`` (nothing cast) when none was
        given, as PyTorch 2.x reports it."""
        return self._fsdp_state.mixed_precision or MixedPrecision()

    cpu_offload = _state_attribute("cpu_offload")
    backward_prefetch = _state_attribute("backward_prefetch")
    forward_prefetch = _state_attribute("forward_prefetch")
    limit_all_gathers = _state_attribute("limit_all_gathers")
    training_state = _state_attribute("training_state")
    is_root = _state_attribute("is_root")
    _is_root = _state_attribute("is_root")

    @property
    def _root_state(self) -> RootState | None:
        """What the tree shares (streams, limiter, execution order); None before lazy init."""
        return self._fsdp_state.root_state

    @property
    def _handle(self):
        """This instance's FlatParamHandle (its ``flat_param`` is the shard), or None:
        the attribute PyTorch 2.x's FSDP1 has, which much user and test code reads."""
        unit = self._fsdp_state.unit
        return unit.handle if unit is not None else None

    @property
    def _unit(self) -> FlatParamUnit | None:
        """This instance's flat parameter and its collectives; None if it manages none."""
        return self._fsdp_state.unit

    @property
    def flat_param(self) -> nn.Parameter | None:
        """This instance's flat shard (PyTorch 1.13's name; 2.x calls it ``_flat_param``)."""
        unit = self._fsdp_state.unit
        return unit.handle.sharded_flat if unit is not None else None

    @property
    def _use_orig_params(self) -> bool:
        return self._fsdp_state.use_orig_params

    @property
    def _state_dict_type(self) -> StateDictType:
        """The state-dict type this instance is set to (PyTorch 2.x's attribute)."""
        return self._fsdp_state.state_dict_type

    def _assert_state(self, state) -> None:
        """Raise ValueError unless in ``state`` (or one of a list): PyTorch's check, which
        common test code calls. States compare by name, so PyTorch's enum works too."""
        allowed = state if isinstance(state, (list, tuple)) else [state]
        if self.training_state.name not in {s.name for s in allowed}:
            raise ValueError(f"expected to be in states {[s.name for s in allowed]} but current state is "
                             f"{self.training_state.name}")

    @property
    def module(self) -> nn.Module:
        """The wrapped module (like DistributedDataParallel's ``module``)."""
        return self._fsdp_wrapped_module

    # -- utilities (utils.py holds the mechanics) --------------------------------------

    def check_is_root(self) -> bool:
        """Whether this instance is the root; runs the lazy initialization if needed (as in 1.13)."""
        if self._fsdp_state.root_state is None:
            self._lazy_init()
        return bool(self._fsdp_state.is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every FSDP instance in ``module`` (``module`` included), only the roots with ``root_only``."""
        return [m for m in traversal.fsdp_modules(module) if not root_only or m.check_is_root()]

    @property
    def params_with_grad(self) -> list[nn.Parameter]:
        """Every parameter of this tree that has a gradient (the flat shards, outside summon)."""
        return [p for p in self.parameters() if p.grad is not None]

    def fsdp_instances(self) -> list["FullyShardedDataParallel"]:
        """Every FSDP instance in this tree, this one first."""
        return traversal.fsdp_modules(self)

    def limiter_metrics(self) -> dict[str, float]:
        """The rate limiter's counters since the previous call (see rate_limiter.py)."""
        shared = self._fsdp_state.root_state
        if shared is None:
            return RateLimiter(False, 1).take_metrics()
        return shared.limiter.take_metrics()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally instead of reducing them (root only).

        Costs memory: every unit keeps a full-size gradient until the next synced backward.
        """
        if not self.check_is_root():  # runs the lazy init if needed
            raise RuntimeError("no_sync() must be called on the root FSDP instance")
        runtime.check_state(self._fsdp_state, TrainingState.IDLE)
        shared = self._fsdp_state.root_state
        previous = shared.sync_gradients
        shared.sync_gradients = False
        try:
            yield
        finally:
            shared.sync_gradients = previous

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``nn.Module.apply`` with this instance's full parameters summoned around it
        (writeback on), as in PyTorch 1.13: ``fn`` sees every module's original
        parameters with their full shapes (nested instances summon their own as the
        recursion reaches them), and each rank keeps its shard of what ``fn`` wrote.
        Typical use: ``model.apply(init_fn)``. Not allowed inside ``summon_full_params``."""
        runtime.check_state(self._fsdp_state, TrainingState.IDLE)
        with utils.summon_full_params(self, recurse=False, writeback=True):
            return super().apply(fn)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Not implemented (docs/fsdp.md, "Differences from PyTorch FSDP 1.13"): raise
        rather than fall through to the wrapped module's attribute lookup."""
        raise NotImplementedError(
            "impl.fsdp does not support register_comm_hook: its gradient reduction "
            "(pre/post divide, HYBRID_SHARD's two stages, bounded reductions in flight) has no hook point"
        )

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return utils.clip_grad_norm_(self, max_norm, norm_type)

    # -- state dicts (state_dict.py) ----------------------------------------------------

    @staticmethod
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                        optim_state_dict_config=None):
        """Context manager: what ``state_dict()`` / ``load_state_dict()`` of every FSDP
        instance in ``module`` produce and accept (FULL by default), and the optimizer
        state-dict config ``optim_state_dict`` follows; the previous settings return on exit."""
        return state_dict_module.state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                            optim_state_dict_config=None):
        """Set the state-dict type and configs of every FSDP instance in ``module`` (PyTorch
        2.x); returns the previous ``StateDictSettings``."""
        return state_dict_module.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                     optim_state_dict_config)

    @staticmethod
    def get_state_dict_type(module: nn.Module):
        """The ``StateDictSettings`` of the FSDP instances in ``module``; ValueError if they
        differ (PyTorch 2.x)."""
        return state_dict_module.get_state_dict_type(module)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if self.training_state is not TrainingState.IDLE:
            runtime.check_state(self._fsdp_state, TrainingState.IDLE)
        out = state_dict_module.model_state_dict(self)
        if destination is None:
            destination = OrderedDict()
        for k, v in out.items():
            destination[prefix + k] = v
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing, unexpected = state_dict_module.load_model_state_dict(self, state_dict, strict)
        return _IncompatibleKeys(missing, unexpected)

    # Optimizer state dicts, as static methods like PyTorch's (optim_state.py).
    full_optim_state_dict = staticmethod(optim_state.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(optim_state.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(optim_state.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(optim_state.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(optim_state.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(optim_state.rekey_optim_state_dict)
    # PyTorch 2.x's pair, FULL or SHARDED as state_dict_type says.
    optim_state_dict = staticmethod(optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state.optim_state_dict_to_load)
    # The full parameters of every FSDP instance under a module, as a context (utils.py).
    summon_full_params = staticmethod(utils.summon_full_params)


# -- construction helpers ----------------------------------------------------------------


def _check_arguments(process_group, sharding_strategy, backward_prefetch, use_orig_params, device_mesh,
                     limiter_depth) -> None:
    """The constructor's arguments of a kind it takes (ValueError naming the argument)."""
    if not dist.is_initialized():
        raise RuntimeError("FullyShardedDataParallel needs torch.distributed to be initialized")
    if isinstance(limiter_depth, bool) or not isinstance(limiter_depth, int) or limiter_depth < 1:
        raise ValueError(f"limiter_depth must be an int >= 1, got {limiter_depth!r}")
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise ValueError(f"backward_prefetch must be a BackwardPrefetch or None, got {backward_prefetch!r}")
    if sharding_strategy is not None and not isinstance(sharding_strategy, ShardingStrategy):
        raise ValueError(f"sharding_strategy must be a ShardingStrategy or None, got {sharding_strategy!r}")
    if not isinstance(use_orig_params, bool):
        raise ValueError(f"use_orig_params must be True or False, got {use_orig_params!r}")
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got {device_mesh!r}")
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh at the same time. Please just pass only one of them."
        )


def _resolve_process_groups(process_group, device_mesh, sharding_strategy, hybrid: bool, auto_wrap_policy):
    """(this instance's process group(s), the children's), resolved before wrapping so that
    auto-wrapped children share them: a mesh's groups, or HYBRID_SHARD's built once."""
    child_process_group = process_group
    if device_mesh is not None:
        process_group = process_groups.groups_of_mesh(device_mesh, hybrid)
    elif hybrid and process_group is None:
        if auto_wrap_policy is None:  # as PyTorch 2.x: instances wrapped one by one may not agree on groups
            raise ValueError(f"Manual wrapping with {sharding_strategy} requires explicit specification of "
                             "process group or device_mesh.")
        process_group = child_process_group = process_groups.hybrid_groups(None)
    return process_group, child_process_group


def _init_ignored(module: nn.Module, ignored_modules, ignored_states):
    """Step 1: (ignored modules, over their subtrees; ignored parameters as given; ids of
    every ignored parameter, nested instances' too)."""
    ignored_modules, ignored_param_list = _ignored_states(ignored_modules, ignored_states)
    ignored = _ignored_modules(module, ignored_modules)
    ignored_params = {id(p) for m in ignored for p in m.parameters()} | {id(p) for p in ignored_param_list}
    for state in traversal.fsdp_states(module):
        ignored_params |= state.ignored_params
    return ignored, ignored_param_list, ignored_params


def _auto_wrap_children(module: nn.Module, auto_wrap_policy, ignored, ignored_param_list, ignored_params,
                        child_kwargs: dict) -> None:
    """Step 2: each child the policy picks wrapped in its own instance, with this one's
    arguments (``child_kwargs``), its own ignored states, and the policy's overrides."""
    for name, _ in traversal.named_fsdp_states(module):
        raise ValueError(
            f"Expected {name or 'the module'} to NOT be FullyShardedDataParallel if using an "
            "`auto_wrap_policy`"
        )
    mixed_precision = child_kwargs["mixed_precision"]
    overrides_of = getattr(auto_wrap_policy, "wrap_kwargs", None)  # CustomPolicy's per-module arguments
    # See [Note: modules exempt from mixed precision] (wrap.py).
    exempt = tuple(mixed_precision._module_classes_to_ignore) if mixed_precision is not None else ()
    found = wrap.exempt_from_mixed_precision(module, exempt, ignored)
    policy = wrap.or_classes_policy(auto_wrap_policy, exempt) if found else auto_wrap_policy
    if found:
        warnings.warn(
            "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped module "
            f"has submodules of type:\n{found}\nThese modules will be wrapped as separate FSDP instances "
            "with mixed precision disabled.",
            stacklevel=3,  # the caller of the constructor
        )

    def wrap_child(child: nn.Module) -> nn.Module:
        inside = set(child.modules())
        child_ignored = [m for m in ignored if m in inside]
        child_params = [p for p in ignored_param_list if any(p is q for q in child.parameters())]
        kwargs = {**child_kwargs, **(overrides_of(child) if overrides_of else {})}
        if found and isinstance(child, exempt):
            kwargs["mixed_precision"] = None
        if child_params:
            return FullyShardedDataParallel(child, ignored_states=child_params, **kwargs)
        return FullyShardedDataParallel(child, ignored_modules=child_ignored, **kwargs)

    recursive_wrap(module, policy, wrap_child, ignored, ignored_params, only_wrap_children=True)


def _ignored_states(ignored_modules, ignored_states) -> tuple[list | None, list[nn.Parameter]]:
    """(ignored modules, ignored parameters) from the two ways of giving them, checked as
    PyTorch 2.x checks them (ValueError for a mix of kinds, or for both arguments)."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. Please just pass ignored_states."
        )
    if ignored_states is None:
        if ignored_modules is not None and not isinstance(ignored_modules, nn.Module):
            try:
                given = list(ignored_modules)
            except TypeError:
                return ignored_modules, []  # _ignored_modules names the wrong type
            if not all(isinstance(m, nn.Module) for m in given):
                kinds = sorted({type(m) for m in given}, key=repr)
                raise ValueError(f"ignored_modules expects nn.Module list elements but got types {kinds}")
            return given, []
        return ignored_modules, []
    try:
        states = list(ignored_states)
    except TypeError:
        raise TypeError(
            f"ignored_states must be an iterable of nn.Parameter or of nn.Module, got {type(ignored_states)}"
        ) from None
    if all(isinstance(x, nn.Parameter) for x in states):
        return None, states
    if all(isinstance(x, nn.Module) for x in states):
        return states, []
    kinds = sorted({type(x) for x in states}, key=repr)
    raise ValueError(f"ignored_states expects all nn.Parameter or all nn.Module list elements but got types {kinds}")


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
            if traversal.is_fsdp(m):
                raise ValueError("`ignored_modules` should not include FSDP modules")
            ignored.update(m.modules())
    if root in ignored:
        warnings.warn(
            "Trying to ignore the top-level module passed into the FSDP constructor itself will result in all "
            f"parameters being ignored and is not well-supported: {root}",
            stacklevel=3,
        )
    for state in traversal.fsdp_states(root):
        ignored.update(state.ignored_modules)
    return ignored


def _managed_params(module: nn.Module, ignored: set[nn.Module], ignored_params: set[int] = frozenset()):
    """(fqn, owner module, attribute name, parameter) of the parameters this unit flattens,
    depth first in registration order, stopping at nested instances and ignored modules.
    A module registered under two names is visited under both (FlatParamHandle keeps the
    second as an alias)."""

    def walk(prefix: str, m: nn.Module):
        if m in ignored:
            return
        for name, p in m._parameters.items():
            if p is not None and id(p) not in ignored_params:
                yield (f"{prefix}.{name}" if prefix else name), m, name, p
        for child_name, child in m._modules.items():
            if child is not None and not traversal.is_fsdp(child):
                yield from walk(f"{prefix}.{child_name}" if prefix else child_name, child)

    yield from walk("", module)


def cuda_device_of(device_id) -> torch.device:
    """The CUDA device ``device_id`` (a device, a string or an index) names, with its index:
    ``cuda`` alone is the current device, as in torch's FSDP1. Index 0 is an index."""
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


def _default_device(device_id) -> torch.device:
    if device_id is not None:
        return torch.device(device_id)
    return torch.device("cpu")


def _materialize(module: nn.Module, param_init_fn, device_id, ignored) -> None:
    is_meta = any(p.is_meta for m in traversal.managed_modules(module, ignored) for p in m._parameters.values() if p is not None)
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"Expected param_init_fn to be a callable but got {type(param_init_fn)}")
    if is_meta:
        if param_init_fn is not None:
            param_init_fn(module)
        else:
            # Only this unit's own modules: nested instances (built first by auto-wrap)
            # already hold their initialized shards, which to_empty would overwrite.
            for m in traversal.managed_modules(module, ignored):
                m.to_empty(device=_default_device(device_id), recurse=False)
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    if device_id is not None:
        device = torch.device(device_id)
        for m in traversal.managed_modules(module, ignored):
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
        for m in traversal.managed_modules(module, ignored):
            for b in m._buffers.values():
                if b is not None:
                    comm.broadcast(b, src=0, async_op=False)
