"""Public policies of the reference FSDP: small enums and frozen dataclasses.

They mirror PyTorch 1.13's ``torch.distributed.fsdp`` configuration objects
(docs/behaviour.md §F1) so that code written against that API reads the same here.
Every other module of the package may import this one; it imports none of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


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
    """Round the reduced gradients to ``param_dtype``. The ``.grad`` tensor keeps the
    parameter's dtype (PyTorch refuses a gradient of another dtype on a parameter), so
    only its values are low precision. See docs/fsdp.md."""

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
    """Where one FSDP instance is in the iteration; checked by the hooks and utilities."""

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
class FullStateDictConfig:
    """Options of ``StateDictType.FULL_STATE_DICT``."""

    offload_to_cpu: bool = False
    """Copy the full tensors to the CPU."""
    rank0_only: bool = False
    """Only rank 0 returns (and keeps in memory) the full state dict; others get ``{}``."""


@dataclass(frozen=True)
class LocalStateDictConfig:
    """Options of ``StateDictType.LOCAL_STATE_DICT`` (none)."""


@dataclass(frozen=True)
class ShardedStateDictConfig:
    """Options of ``StateDictType.SHARDED_STATE_DICT`` (none)."""


class OptimStateKeyType(enum.Enum):
    """How ``rekey_optim_state_dict`` keys an unflattened optimizer state dict."""

    PARAM_NAME = enum.auto()
    """By the parameter's name in the unwrapped model."""
    PARAM_ID = enum.auto()
    """By the parameter's position in the unflattened optimizer order."""
