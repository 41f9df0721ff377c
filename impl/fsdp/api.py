"""Public policies of the reference FSDP: small enums and frozen dataclasses.

They mirror ``torch.distributed.fsdp``'s configuration objects: PyTorch 1.13's
(docs/behaviour.md §F1) and the ones PyTorch 2.x added (``_HYBRID_SHARD_ZERO2``,
``MixedPrecision.cast_forward_inputs``, the optimizer state-dict configs,
``StateDictSettings``), so that code written against either API reads the same here.
Every other module of the package may import this one; it imports none of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn.modules.batchnorm import _BatchNorm


class ShardingStrategy(enum.Enum):
    """What each rank keeps of a unit's parameters, and when the gathered copy is freed."""

    FULL_SHARD = enum.auto()
    """ZeRO stage 3: shard parameters, gradients and optimizer state. Gather before
    forward and again before backward; free after each."""
    SHARD_GRAD_OP = enum.auto()
    """ZeRO stage 2-like: gather before forward, keep the parameters unsharded until the
    unit's backward is done, then free (except under ``no_sync``)."""
    NO_SHARD = enum.auto()
    """DDP: every rank keeps everything; gradients are all-reduced."""
    HYBRID_SHARD = enum.auto()
    """FULL_SHARD within a shard group, replicated across groups: gradients are
    reduce-scattered in the shard group, then all-reduced across replicas. Not in 1.13
    (its docstring only announces it); behaves as PyTorch 2.x documents it."""
    _HYBRID_SHARD_ZERO2 = enum.auto()
    """HYBRID_SHARD's groups with SHARD_GRAD_OP's schedule: parameters stay unsharded
    from forward to the end of the unit's backward (PyTorch 2.x)."""


class BackwardPrefetch(enum.Enum):
    """When to issue the next unit's all-gather during backward."""

    BACKWARD_PRE = enum.auto()
    """Before this unit's backward compute: most overlap, one more unit unsharded at once."""
    BACKWARD_POST = enum.auto()
    """After this unit's parameters are freed: no extra peak memory, less overlap."""


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute, gradient reduction and buffers. ``None`` keeps the original dtype.

    Only explicitly given dtypes apply; only floating-point tensors are cast.
    """

    param_dtype: torch.dtype | None = None
    """Dtype of the gathered parameters the forward and backward compute with."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduced in; defaults to ``param_dtype``, else the original."""
    buffer_dtype: torch.dtype | None = None
    """Dtype buffers are cast to, once, at lazy initialization."""
    keep_low_precision_grads: bool = False
    """Leave the reduced gradients in ``param_dtype``: ``.grad`` is a low-precision tensor
    on a full-precision parameter, as in PyTorch 2.x (set through ``.grad.data``)."""
    cast_forward_inputs: bool = False
    """Cast the floating-point forward inputs of every instance (not only the root's) to
    ``param_dtype`` (PyTorch 2.x)."""
    cast_root_forward_inputs: bool = True
    """Cast the root's floating-point forward inputs to ``param_dtype`` (PyTorch 2.x;
    1.13 always did)."""
    _module_classes_to_ignore: Sequence[type] = (_BatchNorm,)
    """With an ``auto_wrap_policy``, modules of these classes become instances of their own
    without mixed precision, computing in float32 (PyTorch 2.x; wrap.py, [Note: modules
    exempt from mixed precision])."""

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecision.{field} must be a floating-point torch.dtype or None, got {value!r}")

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


@dataclass(frozen=True)
class CPUOffload:
    """Keep the sharded parameters (and so their gradients) on the CPU between uses.

    On a CPU compute device this is a no-op: the parameters already live there.
    """

    offload_params: bool = False
    """Offloading parameters also offloads their gradients, as in PyTorch 1.13."""


class TrainingState(enum.Enum):
    """Where one FSDP instance is in the iteration; checked by the hooks and utilities.
    (PyTorch 2.x folds FORWARD and the backward states into one FORWARD_BACKWARD.)"""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


DEFAULT_LIMITER_DEPTH = 2
"""Unsharded units in flight allowed by ``limit_all_gathers`` (PyTorch's fixed 2)."""


class StateDictType(enum.Enum):
    """What ``state_dict()`` / ``load_state_dict()`` of an FSDP tree produce and accept
    (state_dict.py; set with ``FSDP.state_dict_type``)."""

    FULL_STATE_DICT = enum.auto()
    """Every original parameter and buffer, unsharded, under the unwrapped model's names."""
    LOCAL_STATE_DICT = enum.auto()
    """Each unit's flat shard as this rank holds it (padded, 1-D), plus buffers."""
    SHARDED_STATE_DICT = enum.auto()
    """Each original parameter as a DTensor sharded on dim 0, plus buffers."""


@dataclass(frozen=True)
class StateDictConfig:
    """What every state-dict config has (PyTorch 2.x's base class)."""

    offload_to_cpu: bool = False
    """Copy the returned tensors to the CPU."""


@dataclass(frozen=True)
class FullStateDictConfig(StateDictConfig):
    """Options of ``StateDictType.FULL_STATE_DICT``."""

    rank0_only: bool = False
    """Only rank 0 returns (and keeps in memory) the full state dict; others get ``{}``."""


@dataclass(frozen=True)
class LocalStateDictConfig(StateDictConfig):
    """Options of ``StateDictType.LOCAL_STATE_DICT``."""


@dataclass(frozen=True)
class ShardedStateDictConfig(StateDictConfig):
    """Options of ``StateDictType.SHARDED_STATE_DICT``."""

    _use_dtensor: bool = True
    """Accepted for PyTorch 2.x's signature: impl's sharded values are always DTensors."""


@dataclass(frozen=True)
class OptimStateDictConfig:
    """What every optimizer state-dict config has (PyTorch 2.x)."""

    offload_to_cpu: bool = True
    """Copy the returned optimizer state to the CPU (PyTorch's default)."""


@dataclass(frozen=True)
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Options of ``FSDP.optim_state_dict`` under FULL_STATE_DICT."""

    rank0_only: bool = False
    """Only rank 0 returns the state; others get ``{}``."""


@dataclass(frozen=True)
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Options under LOCAL_STATE_DICT (which ``optim_state_dict`` refuses)."""

    offload_to_cpu: bool = False


@dataclass(frozen=True)
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Options of ``FSDP.optim_state_dict`` under SHARDED_STATE_DICT."""

    _use_dtensor: bool = True


@dataclass(frozen=True)
class StateDictSettings:
    """What ``FSDP.set_state_dict_type`` set and ``get_state_dict_type`` returns."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


STATE_DICT_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}
"""The (model, optimizer) config classes of each state-dict type."""


class OptimStateKeyType(enum.Enum):
    """How ``rekey_optim_state_dict`` keys an unflattened optimizer state dict."""

    PARAM_NAME = enum.auto()
    """By the parameter's name in the unwrapped model."""
    PARAM_ID = enum.auto()
    """By the parameter's position in the unflattened optimizer order."""
