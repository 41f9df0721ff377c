"""The interface every engine adapter implements: wrap a model, build its optimizer, step.

An engine is a small adapter around one way of training data-parallel: PyTorch's DDP,
ZeroRedundancyOptimizer, FSDP1, fully_shard, or this project's ``impl`` engines. The
harness only ever talks to this interface, so every engine is measured the same way.

Engine-specific matrix axes (sharding strategy, prefetch, ...) are declared once, as the
fields of the engine's frozen options class (``Options``, zerobench/engines/options.py);
``options`` maps each axis name to its :class:`Axis` (its default and the values it
allows), and ``settings`` is the engine's options as a value. A cell only carries the
axes its engine declares, so an axis never multiplies the cells of an engine it does
not apply to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from zerobench.engines.options import Axis, EngineOptions


@dataclass(frozen=True)
class RankContext:
    """Where this rank runs: read from the torchrun environment by the worker."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "gloo" or "nccl"


#: optimizer.implementation -> the torch.optim keyword that selects it ("default": none,
#: torch's own choice: foreach on a GPU and the virtual GPU, the for-loop on a CPU, where an
#: explicit foreach holds its whole lists' temporaries at once: 3 MiB more at the CPU gate's peak)
IMPLEMENTATION_FLAGS: dict[str, dict[str, bool]] = {
    "default": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for-loop": {"foreach": False},
}


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer a workload asks for; every engine builds it from this."""

    kind: str  # "adam" | "adamw" | "sgd"
    lr: float
    hyper: dict[str, Any]  # the remaining keyword arguments of the torch.optim class
    no_decay: str = "none"  # "none" | "norms_and_biases" (workload.OptimizerConfig.no_decay)
    max_grad_norm: float = 0.0  # the global 2-norm gradients are clipped to; 0: none (OptimizerConfig)
    implementation: str = "default"  # "default" | "foreach" | "fused" | "for-loop" (OptimizerConfig.implementation)

    @classmethod
    def of(cls, config) -> "OptimizerSpec":
        """The spec of a workload's ``[optimizer]`` (zerobench/spec/workload.py's OptimizerConfig)."""
        return cls(config.kind, config.lr, config.hyper(), config.no_decay, config.max_grad_norm,
                   config.implementation)

    @property
    def cls(self) -> type[torch.optim.Optimizer]:
        return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[self.kind]

    def kwargs(self) -> dict[str, Any]:
        """The torch.optim class's keyword arguments: ``lr``, the hyperparameters and the
        implementation's flag (as torch.optim names it: ``IMPLEMENTATION_FLAGS``)."""
        return {"lr": self.lr, **self.hyper, **IMPLEMENTATION_FLAGS[self.implementation]}

    def build(self, params) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs())

    def build_for(self, module: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``module``'s parameters: one group, or with
        ``no_decay="norms_and_biases"`` two, weight decay off for the parameters of norm
        modules and for biases (the usual recipe for transformers)."""
        if self.no_decay == "none":
            return self.build(module.parameters())
        return self.cls(no_decay_groups(module), **self.kwargs())

    def refuse_groups(self, engine: str) -> None:
        """For engines whose optimizer wrapper takes one flat list of parameters."""
        if self.no_decay != "none":
            raise ValueError(f"optimizer.no_decay = {self.no_decay!r} is not supported by {engine}: its optimizer "
                             "takes one parameter list (allowed there: \"none\")")


def no_decay_groups(module: nn.Module) -> list[dict[str, Any]]:
    """``[{"params": decayed}, {"params": norms and biases, "weight_decay": 0.0}]``, told
    apart by module type and attribute name, not by shape: under FSDP's
    ``use_orig_params=True`` a parameter's local shape is its 1-D slice of the shard.
    Flat parameters (FSDP with ``use_orig_params=False``) cannot be split by role."""
    flat = [n for n, p in module.named_parameters()
            if type(p).__name__ == "FlatParameter" or getattr(p, "_impl_fsdp_flat", False)]
    if flat:
        raise ValueError(
            f"optimizer.no_decay = \"norms_and_biases\" needs the original parameters, but the optimizer would see "
            f"flat parameters ({flat[0]}, ...): set the engine option use_orig_params = true"
        )
    no_decay: set[int] = set()
    for m in module.modules():
        is_norm = "norm" in type(m).__name__.lower()
        for name, p in m.named_parameters(recurse=False):
            if is_norm or name == "bias":
                no_decay.add(id(p))
    params = list(module.parameters())
    return [
        {"params": [p for p in params if id(p) not in no_decay]},
        {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
    ]


# [Note: say what ran]
# A library may run something other than what it was asked, saying so only in a warning
# in the rank's log: torch's FSDP1 runs NO_SHARD whenever its shard group has one rank
# (world size 1, or HYBRID_SHARD over shard groups of one rank, where the replicas'
# gradients are then not averaged at all), and impl's FSDP does as FSDP1 does at world
# size 1. A row reading FULL_SHARD would then compare figures of NO_SHARD with FULL_SHARD.
# The cell's config keeps what the matrix asked (it names the cell and lines it up with
# baselines); what ran is read from the wrapped module after wrap (Engine.ran), kept in
# the cell record under ``ran`` and said in its note ("ran sharding_strategy=NO_SHARD:
# ..."), which the results table shows in the cell's row; predict's and estimate's rows
# carry the same note, printed under their tables (zerobench/whatif/cells.py, ran_notes). ``Engine.notes`` says before a
# cell runs what the engine will ignore of it; ``Engine.ran`` says what it changed.


# [Note: say what surprises]
# Some figures of a correct engine look like bugs. In bf16 the FSDPs and DeepSpeed run the
# forward with bf16 copies of the parameters, so on a model whose head computes the loss
# from its logits (GPT, Llama) the loss itself is bf16, where DDP and ZeRO-1/2 autocast
# and keep it fp32: their "loss dev" is then bf16's rounding of the loss (about 4e-3 of
# it: 5e-2 at a loss of 11) against DDP's 1e-4. The rank sees the loss's dtype, so the
# note says so where it happened (the worker, :data:`BF16_LOSS_NOTE`), not by engine.
# DeepSpeed allocates its gradient bucket whole, so a small model's ZeRO-3 peaks above
# DDP's (DeepSpeedZeroEngine.notes). Each note names the setting that changes it;
# docs/deepspeed.md says why.

#: The note of a bf16 cell whose loss came out bf16 ([Note: say what surprises]).
BF16_LOSS_NOTE = ("loss in bf16: the engine's mixed precision runs the forward, and so the loss, in bf16 (DDP "
                  "autocasts: its loss is fp32), so loss dev is bf16's rounding of the loss, not a bug; "
                  "model.loss_dtype = \"fp32\" (GPT and Llama) computes the loss in fp32")


def ran_note(ran: dict[str, dict[str, Any]]) -> str | None:
    """The note for what an engine ran instead (``{axis: {"value": ..., "why": ...}}``, a
    cell record's ``ran``), or None."""
    parts = [f"ran {axis}={item['value']}: {item['why']}" for axis, item in ran.items()]
    return "; ".join(parts) or None


def ran_record(engine: "Engine") -> dict[str, dict[str, Any]]:
    """``engine.ran()`` as a cell record keeps it: ``{axis: {"value": ..., "why": ...}}``."""
    return {axis: {"value": value, "why": why} for axis, (value, why) in engine.ran().items()}


def row_note(cell_note: str | None, ran: dict[str, dict[str, Any]], seen: str | None = None) -> str | None:
    """A row's note: what the engine ignored of the cell (``Cell.note``, from
    :meth:`Engine.notes`), what it ran instead (:func:`ran_note`) and what the rank saw
    that reads as a bug (``seen``: [Note: say what surprises]), or None."""
    return "; ".join(filter(None, (cell_note, ran_note(ran), seen))) or None


class Engine:
    """Base class of the engine adapters.

    Lifecycle, once per cell and rank::

        engine = EngineClass(options, ctx, dtype)
        module = engine.wrap(model, blocks)          # model already on ctx.device
        engine.build_optimizer(OptimizerSpec(...))
        for batch in batches:
            loss = engine.train_step(inputs, targets, loss_fn)

    Subclasses set ``name`` and ``options`` and implement ``wrap``; most keep the
    default ``build_optimizer`` and ``train_step``.
    """

    name: ClassVar[str]
    #: the engine's options, declared once (zerobench/engines/options.py)
    Options: ClassVar[type[EngineOptions]] = EngineOptions
    #: engine-specific matrix axes: those of ``Options``
    options: ClassVar[dict[str, Axis]] = {}
    #: dtypes ("fp32", "bf16") this engine can run
    dtypes: ClassVar[tuple[str, ...]] = ("fp32", "bf16")
    #: whether the interconnect can be emulated for it (the matrix then offers it the
    #: emulate_link / emulate_gbps / emulate_latency_us axes). Every engine can: the
    #: emulation wraps torch.distributed (zerobench/instruments/emulation.py, [Note: emulation]).
    supports_emulation: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "Options" in cls.__dict__:
            cls.options = cls.Options.axes()

    def __init__(self, options: dict[str, Any], ctx: RankContext, dtype: str):
        self.opts = options
        #: this engine's options as a value: every axis, the cell's or its declared default
        self.settings = self.Options.from_options(options)
        self.ctx = ctx
        self.dtype = dtype
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        # Called with the phase name as each phase of a step starts; the memory pass
        # sets it to tag allocations and to find the gradients before zero_grad.
        self.on_phase = None
        #: the global 2-norm the gradients are clipped to before each step (0: none), set
        #: from the workload's optimizer.max_grad_norm before build_optimizer
        #: (DeepSpeed puts it in its config there); see [Note: clipping as each engine does]
        self.max_grad_norm = 0.0

    # -- what the harness asks before launching ranks -----------------------------

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this engine cannot run in this environment at all (an optional dependency
        missing, with the command that installs it), or None. ``zerobench engines`` lists
        it; every cell of the engine is skipped with it."""
        return None

    @classmethod
    def unsupported(cls, options: dict[str, Any], dtype: str, world_size: int, device_type: str) -> str | None:
        """Why this combination cannot run, or None. Checked before any rank starts."""
        why = cls.unavailable()
        if why is not None:
            return f"{cls.name} is unavailable: {why}"
        if dtype not in cls.dtypes:
            return f"{cls.name} does not support dtype {dtype!r} (supported: {', '.join(cls.dtypes)})"
        return None

    @classmethod
    def notes(cls, options: dict[str, Any], dtype: str, world_size: int, device_type: str,
              optimizer: Any = None) -> str | None:
        """What of this combination the engine ignores on this device, or does that a reader
        would take for a bug, or None: the cell runs, and its record and table row carry the
        note (``note``), so that a figure is never read as the effect of a setting that had
        none ([Note: say what surprises]). ``optimizer``: the workload's ``[optimizer]``
        (OptimizerConfig), for what an engine cannot do of it (optimizer.implementation)."""
        return None

    def ran(self) -> dict[str, tuple[Any, str]]:
        """What this rank's wrapped engine runs where that is not what the cell asked, read
        from the wrapped module after :meth:`wrap`: ``{axis: (value it runs, why)}``, empty
        when it runs what it was asked. See [Note: say what ran]."""
        return {}

    # -- per-rank lifecycle --------------------------------------------------------

    def wrap(self, model: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        """Return the distributed module. ``blocks`` are the units to shard separately
        (transformer blocks, MLP layers); the root takes whatever is left."""
        raise NotImplementedError

    def build_optimizer(self, spec: OptimizerSpec) -> torch.optim.Optimizer:
        assert self.module is not None, "wrap() first"
        self.optimizer = spec.build_for(self.module)
        return self.optimizer

    def autocast(self):
        """Context for the forward pass. Engines whose mixed precision is a wrapper
        policy (FSDP) keep the default no-op; the others autocast under bf16."""
        import contextlib

        return contextlib.nullcontext()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn) -> torch.Tensor:
        """One optimizer step on this rank's micro-batch; returns the detached loss.

        Engines that override this must keep the three ``self.phase(...)`` blocks: they
        label the profiler trace and tell the memory tracker which phase allocated what
        (gradients are identified when the optimizer phase starts)."""
        with self.phase("forward"):
            with self.autocast():
                loss = loss_fn(self.module(inputs), targets)
        with self.phase("backward"):
            loss.backward()
        with self.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    # [Note: clipping as each engine does]
    # optimizer.max_grad_norm clips with the API a user of each engine calls, so that its
    # cost is the engine's own: torch.nn.utils.clip_grad_norm_ over DDP's full gradients
    # and over fully_shard's DTensor gradients (a norm per DTensor, an all-reduce of the
    # partial norm, then a scaling pass: pytorch/pytorch#128317 measured it), FSDP1's and
    # impl's FullyShardedDataParallel.clip_grad_norm_ over the flat shards, a sharded norm
    # (each rank's sum of squares, one all-reduce: impl/zero/clip.py) for the ZeRO-1/2
    # engines, and DeepSpeed's gradient_clipping in its config. All of them scale by
    # max_norm / (norm + 1e-6), at most 1, as the single-process reference does. The clip
    # runs as a step pre-hook of the optimizer (clip_every_step), inside the optimizer
    # phase: a step without clipping runs not one line more (the virtual GPU prices the
    # host's Python lines, and predict's figures must not move when clipping is off).

    def clip_every_step(self) -> None:
        """Clip to ``max_grad_norm`` before every optimizer step, as a step pre-hook of the
        optimizer (zerobench/rank/session.py calls it once the optimizer is built, when
        the workload clips)."""
        max_norm = self.max_grad_norm

        def clip(optimizer, args, kwargs) -> None:  # a pre-hook returns None (or new arguments)
            self.clip_gradients(max_norm)

        self.optimizer.register_step_pre_hook(clip)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip this rank's gradients to the global 2-norm ``max_norm``; return the norm.
        A collective where the gradients are sharded. See [Note: clipping as each engine does]."""
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def phase(self, name: str):
        """Label a phase of the step ("forward", "backward", "optimizer") for the
        profiler (``zerobench::<name>``) and for whoever set ``on_phase``."""
        if self.on_phase is not None:
            self.on_phase(name)
        return record_function(f"zerobench::{name}")

    # -- what the memory pass uses to tell storages apart --------------------------

    def parameter_tensors(self) -> list[torch.Tensor]:
        """Tensors holding this rank's parameters (sharded where the engine shards)."""
        return [p for p in self.module.parameters()]

    def gradient_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        opt = self.optimizer
        inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard in .optim
        return [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]

    def extra_metrics(self) -> dict[str, float]:
        """Engine-specific numbers for the results table, accumulated since the previous
        call (e.g. ``limiter_stall_s``, ``max_inflight_all_gathers``). The harness calls
        it once after warm-up (discarding the result) and once after the measured steps,
        and stores what the second call returns, per rank, as columns."""
        return {}


class AutocastEngine(Engine):
    """An engine whose bf16 mode is ``torch.autocast`` over fp32 parameters."""

    def autocast(self):
        import contextlib

        if self.dtype == "bf16":
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
