"""Every engine's options, declared once: a frozen dataclass per engine, one field per
matrix axis with its default, what it allows and what it does (as torchtitan's config
classes and FSDP2's ``MixedPrecisionPolicy`` declare theirs).

An engine adapter names its class (``Engine.Options``); its matrix axes
(``Engine.options``), the values it is built with (``Engine.settings``), the knob lists of
plots, simulate and ``predict --matrix`` and HYBRID_SHARD's shard group all come from
here. This module imports neither torch nor an engine, so that readers (plots, simulate's
extraction) can ask what an axis is.

A field's ``role`` says what kind of knob it is, for the tools that treat knobs alike:

* ``"sharding"``: what is sharded and when (``sharding_strategy``, ``reshard_after_forward``);
* ``"schedule"``: when collectives are issued (prefetch, the all-gather limiter): the
  x-axis and series of ``knobs.png`` and the knobs simulate re-times.

``sweep`` is what ``zerobench predict --matrix`` tries of the axis.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

ROLES = ("sharding", "schedule")


@dataclass(frozen=True)
class Axis:
    """One engine-specific matrix axis: its default and what values it allows."""

    default: Any
    choices: tuple | None = None
    """The allowed values; None means any value of ``type`` passing ``minimum``."""
    type: type | None = None
    minimum: float | None = None
    doc: str = ""
    applies_when: tuple[str, Any] | None = None
    """(other axis, value or predicate): this axis only means something when the other
    axis has that value (``limiter_depth`` only with ``limit_all_gathers=True``);
    otherwise the matrix pins it to its default so that no two cells run the same
    configuration."""

    def applies(self, chosen: dict[str, Any]) -> bool:
        if self.applies_when is None:
            return True
        other, want = self.applies_when
        return want(chosen.get(other)) if callable(want) else chosen.get(other) == want

    def allowed(self) -> str:
        """What values the axis allows, in words (``zerobench engines``)."""
        if self.choices is not None:
            return ", ".join(map(repr, self.choices))
        return f"{self.type.__name__} >= {self.minimum}" if self.minimum is not None else self.type.__name__

    def check(self, name: str, value: Any) -> Any:
        """Return ``value`` if allowed, else raise ValueError naming the axis and what it allows."""
        if self.choices is not None:
            if value not in self.choices:
                raise ValueError(f"{name}: {value!r} is not allowed (allowed: {', '.join(map(repr, self.choices))})")
            return value
        ok_type = isinstance(value, self.type) and not isinstance(value, bool)
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok_type = float(value), True
        finite = not (ok_type and isinstance(value, float)) or math.isfinite(value)
        if not ok_type or not finite or (self.minimum is not None and value < self.minimum):
            bound = f" >= {self.minimum}" if self.minimum is not None else ""
            kind = f"a finite {self.type.__name__}" if self.type is float else self.type.__name__
            raise ValueError(f"{name}: {value!r} is not allowed (allowed: {kind}{bound})")
        return value

    @property
    def is_flag(self) -> bool:
        return self.choices is not None and set(self.choices) == {False, True}


def option(default: Any, *, choices: tuple | None = None, type: type | None = None, minimum: float | None = None,
           applies_when: tuple[str, Any] | None = None, doc: str = "", role: str | None = None,
           sweep: tuple = ()) -> Any:
    """A field of an engine's options: its default and the :class:`Axis` the matrix offers."""
    assert role in (None, *ROLES), role
    axis = Axis(default, choices=choices, type=type, minimum=minimum, doc=doc, applies_when=applies_when)
    return dataclasses.field(default=default, metadata={"axis": axis, "role": role, "sweep": tuple(sweep)})


def flag(default: bool, doc: str = "", **kwargs) -> Any:
    """A boolean option (choices in the order its axis has always listed them)."""
    return option(default, choices=(False, True) if not default else (True, False), doc=doc, **kwargs)


@dataclass(frozen=True)
class EngineOptions:
    """The options of an engine with none. Built from a cell's options
    (:meth:`from_options`), each value checked by its axis: a bad value is a ValueError
    naming the field and what it allows, where the options are made."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            f.metadata["axis"].check(f.name, getattr(self, f.name))

    @classmethod
    def axes(cls) -> dict[str, Axis]:
        return {f.name: f.metadata["axis"] for f in dataclasses.fields(cls)}

    @classmethod
    def with_role(cls, role: str) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["role"] == role)

    @classmethod
    def sweeps(cls) -> dict[str, list]:
        """axis -> the values ``predict --matrix`` tries, for the axes that have some."""
        return {f.name: list(f.metadata["sweep"]) for f in dataclasses.fields(cls) if f.metadata["sweep"]}

    @classmethod
    def from_options(cls, options: dict[str, Any]):
        """This engine's options out of a cell's (which also hold the axes of every engine:
        activation checkpointing, emulation); an axis left out takes its declared default."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in names})


# -- DDP and ZeRO ------------------------------------------------------------------------


@dataclass(frozen=True)
class DDPOptions(EngineOptions):
    """``torch.nn.parallel.DistributedDataParallel``."""

    gradient_as_bucket_view: bool = flag(False, "gradients are views into DDP's all-reduce buckets "
                                                "(saves one gradient copy)")


@dataclass(frozen=True)
class TorchZero1Options(EngineOptions):
    """``torch.distributed.optim.ZeroRedundancyOptimizer`` over DDP."""

    parameters_as_bucket_view: bool = flag(False, "pack each rank's parameters into one flat bucket per device")


@dataclass(frozen=True)
class ImplZero1Options(EngineOptions):
    """impl's drop-in ``ZeroRedundancyOptimizer``, with its overlap with DDP."""

    parameters_as_bucket_view: bool = flag(False, "pack each rank's parameters into one flat bucket per device",
                                           applies_when=("overlap_with_ddp", False))
    overlap_with_ddp: bool = flag(False, "run the optimizer step inside DDP's communication hook, bucket by bucket")
    overlap_hook: Literal["step", "interleaved"] = option(
        "step", choices=("step", "interleaved"), applies_when=("overlap_with_ddp", True),
        doc="step: all buckets after the last all-reduce (hook_with_zero_step); "
            "interleaved: each bucket as its all-reduce completes")


@dataclass(frozen=True)
class ImplZero2Options(EngineOptions):
    """impl's ZeRO-2: gradients reduce-scattered in buckets."""

    bucket_cap_mb: float = option(25.0, type=float, minimum=0,
                                  doc="reduce-scatter (and all-gather) bucket size; 0 sends every gradient alone")
    max_in_flight: int = option(2, type=int, minimum=1,
                                doc="reduce-scatters in flight before backward waits for the oldest")


# -- FSDP ---------------------------------------------------------------------------------

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


@dataclass(frozen=True)
class FSDP1Options(EngineOptions):
    """FSDP1's knobs (``torch.distributed.fsdp.FullyShardedDataParallel``), as torch-fsdp1
    and impl-fsdp both take them. The defaults are PyTorch 2.x's (BACKWARD_PRE,
    ``limit_all_gathers=True``), which impl's class also has, so a workload that leaves
    them out compares the same schedule on both."""

    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = option(
        "FULL_SHARD", choices=SHARDING_STRATEGIES, role="sharding", sweep=("FULL_SHARD", "SHARD_GRAD_OP"),
        doc="HYBRID_SHARD shards within groups of world/2 ranks (or LOCAL_WORLD_SIZE) and replicates across them")
    backward_prefetch: Literal["none", "pre", "post"] = option(
        "pre", choices=("none", "pre", "post"), role="schedule", sweep=("pre", "post", "none"),
        doc="BACKWARD_PRE / BACKWARD_POST / no backward prefetch")
    forward_prefetch: bool = flag(False, "prefetch the next unit's all-gather in forward (recorded order)",
                                  role="schedule")
    limit_all_gathers: bool = flag(True, "bound the unsharded units in flight (impl-fsdp: to limiter_depth)",
                                   role="schedule", sweep=(True, False))

    def shard_group_size(self, world_size: int) -> int:
        """The ranks one copy of the parameters is sharded over: HYBRID_SHARD's shard
        group (one node's ranks, ``LOCAL_WORLD_SIZE``, else half the world:
        impl/fsdp/process_groups.py), 1 under NO_SHARD, else the world."""
        if self.sharding_strategy == "NO_SHARD":
            return 1
        if self.sharding_strategy == "HYBRID_SHARD":
            from impl.fsdp.process_groups import default_shard_size  # imports impl (torch) only when asked

            return default_shard_size(world_size)
        return world_size


@dataclass(frozen=True)
class TorchFSDP1Options(FSDP1Options):
    """torch-fsdp1: FSDP1's knobs."""

    use_orig_params: bool = flag(False, "the optimizer sees the original parameters (per-parameter groups)")


@dataclass(frozen=True)
class ImplFSDPOptions(FSDP1Options):
    """impl-fsdp: FSDP1's knobs, the limiter's depth and CPU offload."""

    limiter_depth: int = option(2, type=int, minimum=1, applies_when=("limit_all_gathers", True), role="schedule",
                                doc="units in flight allowed by limit_all_gathers")
    use_orig_params: bool = flag(False, "the optimizer sees the original parameters (views of each unit's shard) "
                                        "instead of flat shards: per-parameter groups (optimizer.no_decay)")
    cpu_offload: bool = flag(False, "keep sharded parameters and gradients in host memory "
                                    "(on a GPU or the virtual GPU; a no-op on a CPU device)")


@dataclass(frozen=True)
class TorchFSDP2Options(EngineOptions):
    """``fully_shard`` (FSDP2)."""

    reshard_after_forward: bool = flag(True, "free each block's unsharded parameters after its forward (False: keep "
                                             "them until backward, as SHARD_GRAD_OP)", role="sharding",
                                       sweep=(True, False))
    forward_prefetch: bool = flag(False, "explicitly prefetch the next block's all-gather in forward",
                                  role="schedule")
    cpu_offload: bool = flag(False, "torch's CPUOffloadPolicy: sharded parameters, gradients and the optimizer "
                                    "step in host memory (pinned on a GPU; on a CPU device they are there already)")


# -- DeepSpeed -----------------------------------------------------------------------------
# DeepSpeed's zero_optimization knobs, with DeepSpeed 0.19.8's defaults
# (deepspeed/runtime/zero/config.py). Sizes are in elements, as DeepSpeed counts them.

def _elements(default: int, doc: str, minimum: int = 0) -> Any:
    return option(default, type=int, minimum=minimum, doc=doc)


_OVERLAP = "reduce gradients on a side stream while backward goes on (double-buffers the bucket)"
_CONTIGUOUS = "copy gradients into one contiguous buffer as they are produced"
_REDUCE_BUCKET = "elements reduced at a time: the gradient bucket, allocated whole"


@dataclass(frozen=True)
class DeepSpeedZero12Options(EngineOptions):
    """deepspeed-zero1 and deepspeed-zero2."""

    overlap_comm: bool = option(False, choices=(False, True), doc=_OVERLAP)
    contiguous_gradients: bool = flag(True, _CONTIGUOUS)
    reduce_bucket_size: int = _elements(500_000_000, _REDUCE_BUCKET, minimum=1)
    allgather_bucket_size: int = _elements(500_000_000, "elements all-gathered at a time after the step (an even "
                                                        "number; unused where torch has all_gather_into_tensor)",
                                           minimum=2)


@dataclass(frozen=True)
class DeepSpeedZero3Options(EngineOptions):
    """deepspeed-zero3 (overlap_comm is on by default for stage 3 only, as in DeepSpeed)."""

    overlap_comm: bool = option(True, choices=(False, True), doc=_OVERLAP)
    contiguous_gradients: bool = flag(True, _CONTIGUOUS)
    reduce_bucket_size: int = _elements(500_000_000, _REDUCE_BUCKET, minimum=1)
    stage3_prefetch_bucket_size: int = _elements(50_000_000, "elements of parameters fetched ahead of use")
    stage3_max_live_parameters: int = _elements(1_000_000_000, "unsharded elements kept before releasing")
    stage3_max_reuse_distance: int = _elements(1_000_000_000, "keep a parameter gathered if it is used again "
                                                              "within this many elements")
    stage3_param_persistence_threshold: int = _elements(100_000, "parameters this small are never sharded")


#: engine name -> its options (the registry of adapters is zerobench/engines/__init__.py)
OPTIONS: dict[str, type[EngineOptions]] = {
    "ddp": DDPOptions,
    "torch-zero1": TorchZero1Options,
    "torch-fsdp1": TorchFSDP1Options,
    "torch-fsdp2": TorchFSDP2Options,
    "impl-zero1": ImplZero1Options,
    "impl-zero2": ImplZero2Options,
    "impl-fsdp": ImplFSDPOptions,
    "deepspeed-zero1": DeepSpeedZero12Options,
    "deepspeed-zero2": DeepSpeedZero12Options,
    "deepspeed-zero3": DeepSpeedZero3Options,
}


def axes_with_role(*roles: str) -> tuple[str, ...]:
    """Every engine's axes of these roles, once each, in the registry's order."""
    return tuple(dict.fromkeys(n for cls in OPTIONS.values() for role in roles for n in cls.with_role(role)))


def flag_axes() -> frozenset[str]:
    """Every engine's on/off axes: boolean columns of results.csv, estimate.csv and predict.csv."""
    return frozenset(n for cls in OPTIONS.values() for n, axis in cls.axes().items() if axis.is_flag)


def axis_named(name: str) -> Axis:
    """The axis ``name`` as the first engine that has it declares it (engines that share an
    axis's name share its kind of value); KeyError for an axis of no engine."""
    return next(cls.axes()[name] for cls in OPTIONS.values() if name in cls.axes())


def matrix_sweeps() -> dict[str, dict[str, list]]:
    """engine -> {axis: the values ``predict --matrix`` tries}, for the engines with some."""
    return {engine: cls.sweeps() for engine, cls in OPTIONS.items() if cls.sweeps()}
