"""Workloads: what to train and which matrix of engines and configurations to run.

A workload is a TOML file (see ``workloads/``) validated on load into the dataclasses
below. Every error names the offending field and what it allows. A workload may
``extends = "other.toml"`` (a path relative to itself) and override fields: tables
merge key by key, so a variant states only what it changes; a ``[model]`` of another
``kind`` replaces the parent's model table as a whole; ``axis = []`` under ``[matrix]``
removes an inherited axis.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence, Union

from zerobench.choices import did_you_mean, not_allowed, unknown_key

__all__ = ["WorkloadError", "Workload", "load_workload", "parse_workload"]


class WorkloadError(ValueError):
    """A workload file is invalid; the message names the field and the allowed values."""


# [Note: a field's range]
# Each numeric field declares the values it allows beside its type, once:
# ``steps: Annotated[int, Range(1)] = 10``. Loading checks the type, then the range
# (:func:`_coerce`), and the error names the field and the range in words ("int >= 1", "a
# finite float > 0"). A float is always finite: nothing here means anything at inf or NaN.
# tests/test_bad_input.py reads the same declarations to try, for every field, a value of
# the wrong type and one out of its range; a new numeric field without a Range fails there.


@dataclass(frozen=True)
class Range:
    """The values a numeric field allows: ``low <= value`` (``low < value`` when
    ``low_open``), ``value <= high`` (``value < high`` when ``high_open``)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def allows(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self, typ: type) -> str:
        """The range in words: "int >= 1", "int from 1 to 2**63 - 1", "a finite float > 0"."""
        kind = "a finite float" if typ is float else typ.__name__
        if self.low is not None and self.high is not None:
            if not (self.low_open or self.high_open):
                return f"{kind} from {_number(self.low)} to {_number(self.high)}"
            return f"{kind} in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}" \
                   f"{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {_number(self.low)}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {_number(self.high)}"
        return kind


def _number(value) -> str:
    return {2**63 - 1: "2**63 - 1", 2**32 - 1: "2**32 - 1"}.get(value, f"{value:g}" if isinstance(value, float) else
                                                                 str(value))


#: Largest size accepted: torch holds sizes as int64, and a larger one fails inside its C++
#: code. Sizes below it that no machine can hold are the preflight's to refuse, naming the
#: bytes (zerobench/harness/preflight.py).
MAX_DIMENSION = 2**63 - 1
#: A size of a model or a batch: [Note: a field's range].
Size = Annotated[int, Range(1, MAX_DIMENSION)]
#: A seed of torch's generators, as numpy's are bounded: 0 to 2**32 - 1.
Seed = Annotated[int, Range(0, 2**32 - 1)]
Count = Annotated[int, Range(1)]
"""A number of steps, threads, ... (>= 1)."""
NonNegative = Annotated[int, Range(0)]
PositiveFloat = Annotated[float, Range(0, low_open=True)]
NonNegativeFloat = Annotated[float, Range(0)]
SeqLen = Annotated[int, Range(2, MAX_DIMENSION)]
"""Tokens per sample: a next-token target needs two."""


@dataclass(frozen=True)
class MLPConfig:
    """A stack of ``depth`` blocks Linear(width, width) + ReLU, trained to regress
    random targets with MSE. Each block is one sharding unit."""

    kind: Literal["mlp"] = "mlp"
    depth: Size = 4
    """Number of blocks (>= 1)."""
    width: Size = 256
    """Hidden size (>= 1)."""

    def check(self) -> None:
        """Nothing beyond each field's type and range ([Note: a field's range])."""


@dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer (pre-LayerNorm, causal self-attention, GELU MLP),
    trained on next-token prediction over random tokens. Each block is one sharding unit."""

    kind: Literal["gpt"] = "gpt"
    layers: Size = 2
    """Number of transformer blocks (>= 1)."""
    d_model: Size = 128
    """Embedding width; must be divisible by ``heads``."""
    heads: Size = 4
    seq_len: SeqLen = 64
    """Tokens per sample (>= 2)."""
    vocab: Size = 512
    mlp_ratio: Size = 4
    """Hidden width of each block's MLP as a multiple of d_model."""
    loss_dtype: Literal["model", "fp32"] = "model"
    """dtype of the cross-entropy: ``"model"``, the logits' own (bf16 under bf16 compute);
    ``"fp32"``, the logits upcast first, as torchtitan's ``cross_entropy_loss`` does."""

    def check(self) -> None:
        _check_loss_dtype(self.loss_dtype)
        if self.d_model % self.heads:
            raise WorkloadError(
                f"model.heads: {self.heads} does not divide model.d_model={self.d_model} "
                f"(allowed: a divisor of d_model, e.g. {_divisors(self.d_model)})"
            )


#: Published shapes of the Llama family, filled in by ``preset``; explicit keys override them.
#: Llama 2: arXiv 2307.09288 (Table 1 and the released params.json); Llama 3: arXiv 2407.21783 (Table 3).
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(layers=32, d_model=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000,
                      seq_len=4096, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    "llama2-13b": dict(layers=40, d_model=5120, heads=40, kv_heads=40, ffn_hidden=13824, vocab=32000,
                       seq_len=4096, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    "llama3-8b": dict(layers=32, d_model=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
                      seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False),
    "llama3-70b": dict(layers=80, d_model=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256,
                       seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False),
}


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family decoder (RMSNorm, RoPE, grouped-query causal attention through
    ``scaled_dot_product_attention``, SwiGLU feed-forward), trained on next-token
    prediction over random tokens. Each block is one sharding unit."""

    kind: Literal["llama"] = "llama"
    preset: str = ""
    """A published shape (see ``LLAMA_PRESETS``) that fills every key not given explicitly."""
    layers: Size = 2
    d_model: Size = 128
    """Embedding width; must be divisible by ``heads``."""
    heads: Size = 4
    """Query heads."""
    kv_heads: Size = 2
    """Key/value heads (grouped-query attention); must divide ``heads``. ``heads`` is plain multi-head."""
    ffn_hidden: Size = 352
    """Hidden width of the SwiGLU feed-forward (its gate and up projections)."""
    vocab: Size = 512
    seq_len: SeqLen = 64
    """Tokens per sample (>= 2)."""
    rope_theta: PositiveFloat = 10000.0
    """Base of the rotary position embedding's frequencies."""
    norm_eps: PositiveFloat = 1e-5
    """RMSNorm's epsilon."""
    tie_embeddings: bool = False
    """Share the token embedding's weight with the output head."""
    loss_dtype: Literal["model", "fp32"] = "model"
    """dtype of the cross-entropy: ``"model"``, the logits' own (bf16 under bf16 compute);
    ``"fp32"``, the logits upcast first, as torchtitan's ``cross_entropy_loss`` does."""

    def check(self) -> None:
        _check_loss_dtype(self.loss_dtype)
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise WorkloadError(
                f"model.heads: {self.heads} does not divide model.d_model={self.d_model} into heads of even width "
                f"(allowed: a divisor of d_model leaving an even head width, e.g. {_divisors(self.d_model)})"
            )
        if self.heads % self.kv_heads:
            raise WorkloadError(f"model.kv_heads: {self.kv_heads} does not divide model.heads={self.heads} "
                                f"(allowed: a divisor of heads, e.g. {_divisors(self.heads)})")


LOSS_DTYPES = ("model", "fp32")


def _check_loss_dtype(value) -> None:
    if value not in LOSS_DTYPES:
        raise WorkloadError(not_allowed("model.loss_dtype", value, LOSS_DTYPES))


#: Keys of ``[model]`` that a user model (``factory``) does not receive as keyword arguments.
FACTORY_RESERVED = ("factory", "wrap", "batch", "loss")
LOSSES = ("cross_entropy", "mse")


@dataclass(frozen=True)
class FactoryConfig:
    """Any model the user brings: ``factory = "package.module:function"`` is called with the
    other keys of ``[model]`` as keyword arguments and returns an ``nn.Module``.
    See docs/models.md for the contract."""

    kind: Literal["factory"] = "factory"
    factory: str = ""
    """"package.module:function", imported from the harness's sys.path (the current folder first)."""
    wrap: tuple[str, ...] = ()
    """Class names whose instances are the sharding units (as ModuleWrapPolicy takes classes)."""
    batch: str = ""
    """"package.module:function" called as ``function(batch_size, generator) -> (inputs, targets)``;
    empty: token ids of ``vocab`` and ``seq_len`` (keys then required), next-token targets."""
    loss: str = "cross_entropy"
    """"cross_entropy", "mse" or "package.module:function", applied to ``(model(inputs), targets)``."""
    kwargs: tuple[tuple[str, Any], ...] = ()
    """The other keys of ``[model]``, passed to the factory."""

    def check(self) -> None:
        _check_entry_point("model.factory", self.factory)
        if not self.wrap:
            raise WorkloadError("model.wrap: missing (allowed: a list of one or more module class names, "
                                "e.g. wrap = [\"Block\"])")
        if self.batch:
            _check_entry_point("model.batch", self.batch)
        else:
            for key in ("vocab", "seq_len"):
                if not isinstance(dict(self.kwargs).get(key), int) or dict(self.kwargs)[key] < 1:
                    raise WorkloadError(f"model.{key}: required as an int >= 1 without model.batch "
                                        f"(the model then takes token ids of vocab and seq_len)")
        if self.loss not in LOSSES and ":" not in self.loss:
            raise WorkloadError(f"model.loss: {self.loss!r} is not allowed "
                                f"(allowed: 'cross_entropy', 'mse' or 'package.module:function')")
        if self.loss not in LOSSES:
            _check_entry_point("model.loss", self.loss)

    @property
    def vocab(self) -> int:
        return dict(self.kwargs).get("vocab", 0)

    @property
    def seq_len(self) -> int:
        return dict(self.kwargs).get("seq_len", 0)

    def table(self) -> dict[str, Any]:
        """The ``[model]`` table this config was read from."""
        out = {"kind": self.kind, "factory": self.factory, "wrap": list(self.wrap), "loss": self.loss}
        if self.batch:
            out["batch"] = self.batch
        return {**out, **dict(self.kwargs)}


@dataclass(frozen=True)
class HFConfig:
    """A Hugging Face transformers causal LM built from its ``config.json`` alone (no
    weights, nothing downloaded; needs the optional extra ``pip install -e '.[hf]'``).
    Its decoder layers (the model's ``_no_split_modules``, or ``wrap``) are the sharding units."""

    kind: Literal["hf"] = "hf"
    config: str = ""
    """Path to a config.json, relative to the workload file."""
    seq_len: SeqLen = 64
    """Tokens per sample (>= 2); the vocabulary is the config's ``vocab_size``."""
    wrap: tuple[str, ...] = ()
    """Class names of the sharding units; empty: the model's ``_no_split_modules``."""

    def check(self) -> None:
        if not self.config:
            raise WorkloadError("model.config: missing (allowed: a path to a Hugging Face config.json)")
        self.read()

    def read(self) -> dict[str, Any]:
        """The parsed config.json; WorkloadError naming model.config if it does not parse."""
        import json

        try:
            out = json.loads(Path(self.config).read_text())
        except OSError as err:
            raise WorkloadError(f"model.config: cannot read {self.config}: {err.strerror} (allowed: a Hugging Face "
                                f"config.json, its path relative to the workload file)") from None
        except json.JSONDecodeError as err:
            raise WorkloadError(f"model.config: {self.config} is not valid JSON: {err}") from None
        if not isinstance(out, dict) or not isinstance(out.get("vocab_size"), int):
            raise WorkloadError(f"model.config: {self.config} is not a transformers model config "
                                f"(allowed: a JSON object with model_type and an int vocab_size)")
        return out

    @property
    def vocab(self) -> int:
        return self.read()["vocab_size"]


ModelConfig = Union[MLPConfig, GPTConfig, LlamaConfig, FactoryConfig, HFConfig]
MODEL_KINDS = {"mlp": MLPConfig, "gpt": GPTConfig, "llama": LlamaConfig, "hf": HFConfig, "factory": FactoryConfig}


@dataclass(frozen=True)
class DataConfig:
    """Synthetic batches, generated from ``seed`` as one global batch per step that
    each rank slices, so every world size trains on the same data."""

    batch_size: Size = 8
    """Samples per rank per step (>= 1); the global batch is batch_size * world_size."""
    warmup_steps: NonNegative = 2
    """Steps run before measuring (>= 0); excluded from timings."""
    steps: Count = 10
    """Measured steps (>= 1)."""
    seed: Seed = 0
    """Seed of the synthetic batches."""


#: optimizer.implementation's values, as torch.optim's flags name them (OptimizerConfig)
IMPLEMENTATIONS = ("default", "foreach", "fused", "for-loop")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer every engine builds (as torch.optim classes name their arguments)."""

    kind: Literal["adam", "adamw", "sgd"] = "adam"
    lr: PositiveFloat = 1e-3
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[Annotated[float, Range(0, 1, high_open=True)], ...] = (0.9, 0.999)
    """adam/adamw only: two floats in [0, 1)."""
    eps: NonNegativeFloat = 1e-8
    """adam/adamw only."""
    momentum: NonNegativeFloat = 0.0
    """sgd only."""
    no_decay: Literal["none", "norms_and_biases"] = "none"
    """``norms_and_biases``: two parameter groups, weight decay off for the parameters of
    norm modules and for biases. Needs the original parameters: FSDP1 engines
    (torch-fsdp1, impl-fsdp) with ``use_orig_params = true``, ddp, torch-fsdp2."""
    max_grad_norm: NonNegativeFloat = 0.0
    """Clip the gradients to this global 2-norm before each step, with each engine's own
    API (docs/workloads.md, "Gradient clipping"); 0 (the default): no clipping, as
    DeepSpeed's ``gradient_clipping`` says it."""
    implementation: Literal["default", "foreach", "fused", "for-loop"] = "default"
    """The torch.optim implementation: ``foreach`` (``foreach=True``: a few multi-tensor
    kernels per step), ``fused`` (``fused=True``: one fused kernel per parameter group
    and dtype), ``for-loop`` (``foreach=False``: the kernels of one parameter at a time),
    or ``default`` (no flag: torch.optim's own choice, foreach where the parameters'
    device has foreach kernels, a GPU or the virtual GPU, and the for-loop on a CPU)."""

    def check(self) -> None:
        if self.no_decay not in ("none", "norms_and_biases"):
            raise WorkloadError(not_allowed("optimizer.no_decay", self.no_decay, ("none", "norms_and_biases")))
        if self.implementation not in IMPLEMENTATIONS:
            raise WorkloadError(not_allowed("optimizer.implementation", self.implementation, IMPLEMENTATIONS))
        if len(self.betas) != 2:
            raise WorkloadError(f"optimizer.betas: {list(self.betas)} is not allowed (allowed: two floats in [0, 1))")

    def hyper(self) -> dict[str, Any]:
        """Keyword arguments of the torch.optim class, without ``lr``."""
        if self.kind == "sgd":
            return {"momentum": self.momentum, "weight_decay": self.weight_decay}
        return {"betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


@dataclass(frozen=True)
class RunConfig:
    """How each cell is run and measured."""

    timeout_s: PositiveFloat = 600.0
    """Wall-clock limit per cell; a cell past it is killed and recorded as failed."""
    threads_per_rank: Count = 1
    """torch intra-op threads per rank on CPU (one per rank keeps ranks from contending)."""
    memory_pass: bool = True
    """Run a separate pass under the tensor-storage tracker (peak memory, its
    composition, communication bytes). Separate because the tracker slows steps 1.5-2x."""
    memory_warmup_steps: NonNegative = 2
    """Steps of the memory pass before the measured one: the first creates optimizer
    state, and DDP rebuilds its gradient buckets in the second iteration's forward (with
    one warm-up step those buckets would be counted as activations)."""
    reference: bool = True
    """Compute single-process reference losses on the global batch and record each
    cell's deviation from them (loss_max_abs_diff_ref)."""
    profile_steps: Count = 3
    """Steps traced by the profiled pass (``zerobench run --profile``)."""

    def check(self) -> None:
        """Nothing beyond each field's type and range ([Note: a field's range])."""


@dataclass(frozen=True)
class Workload:
    name: str
    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    run: RunConfig
    matrix: dict[str, list]
    """Axis name -> values. ``engine``, ``world_size`` and ``dtype`` apply to every
    engine (defaults: ``["ddp"]``, ``[2]``, ``["fp32"]``); other axes only to the engines
    that declare them (see ``zerobench engines``)."""
    description: str = ""
    seed: Seed = 0
    """Seed of the model's initial weights."""
    source: str = ""
    """The file this workload was loaded from."""
    overrides: tuple[str, ...] = ()
    """The ``--set KEY=VALUE`` overrides applied to the file, as given ([Note: overrides])."""
    dropped_axes: tuple[str, ...] = ()
    """Inherited matrix axes that no engine left in matrix.engine takes, dropped as the
    file was loaded ([Note: narrowing the engines])."""
    no_matrix: bool = False
    """Whether the workload has no [matrix] table, so runs the default one (one ddp cell)."""

    @property
    def label(self) -> str:
        """Where the workload came from, for error messages: its file, and the overrides."""
        return (self.source or "<dict>") + "".join(f" --set {o}" for o in self.overrides)

    def to_dict(self) -> dict[str, Any]:
        """The resolved workload as plain TOML-able data (what the run folder keeps; the
        overrides are applied in it, and meta.json lists them)."""
        out = dataclasses.asdict(self)
        out.pop("source")
        out.pop("overrides")
        out.pop("dropped_axes")
        out.pop("no_matrix")
        if isinstance(self.model, FactoryConfig):
            out["model"] = self.model.table()
        opt = self.optimizer
        out["optimizer"] = {"kind": opt.kind, "lr": opt.lr,
                            **{k: list(v) if isinstance(v, tuple) else v for k, v in opt.hyper().items()}}
        # The step's keys only where set, so that a workload.json of before they existed reads the same.
        out["optimizer"].update({k: v for k, v in (("max_grad_norm", opt.max_grad_norm),
                                                  ("implementation", opt.implementation))
                                 if v != getattr(OptimizerConfig, k)})
        return out


# --------------------------------------------------------------------------------------
# Loading


#: The workloads that ship with zerobench (workloads/ of the checkout it runs from).
SHIPPED_WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"


def find_workload(text: str | Path) -> Path:
    """The workload file ``text`` names: a path, or the name of a shipped workload
    (``quickstart``, ``gpt-small.toml``), looked up in ./workloads/ first, then in the
    shipped folder. WorkloadError listing the shipped names when there is none."""
    path = Path(text)
    if path.is_file() or str(text) == "":
        return path
    if path.is_dir():
        raise WorkloadError(f"{text}: a folder, not a workload file (allowed: a TOML file, or the name of a shipped "
                            f"workload)")
    if path.parent == Path(".") and not path.name.startswith("."):
        stem = path.name.removesuffix(".toml")
        for folder in (Path("workloads"), SHIPPED_WORKLOADS):
            if (folder / f"{stem}.toml").is_file():
                return folder / f"{stem}.toml"
    names = sorted({p.stem for folder in (Path("workloads"), SHIPPED_WORKLOADS) for p in folder.glob("*.toml")})
    found = did_you_mean(Path(str(text)).name.removesuffix(".toml"), names, show=str)
    raise WorkloadError(f"{text}: no such workload file{found} (allowed: a path to a TOML file, or the name of one "
                        f"in ./workloads/ or {SHIPPED_WORKLOADS}/: {', '.join(names) or 'none found'})")


def load_workload(path: str | Path, overrides: Sequence[str] = ()) -> Workload:
    """Load, resolve ``extends`` and validate a workload file (a path, or the name of a
    shipped workload: :func:`find_workload`), with ``overrides`` (``"data.steps=20"``,
    [Note: overrides]) applied on top. A file that sets no table at all (empty, or only a
    name) is refused rather than run with every default."""
    path = find_workload(path)
    layers: list[dict] = []
    raw = _load_with_parents(path, seen=(), layers=layers)
    label = str(path) + "".join(f" --set {o}" for o in overrides)
    for text in overrides:
        key, value = parse_override(text)
        layers.append(_nested(key, value).get("matrix", {}))
        raw = _merge(raw, _nested(key, value))
    dropped = _narrowed_axes(raw.get("matrix", {}), layers)
    if dropped:
        raw = {**raw, "matrix": {k: v for k, v in raw["matrix"].items() if k not in dropped}}
    workload = parse_workload(raw, source=str(path), default_name=path.stem, overrides=tuple(overrides))
    workload = dataclasses.replace(workload, dropped_axes=dropped)
    if not set(raw) - {"name", "description", "seed"}:
        raise WorkloadError(f"{label}: the file sets nothing to run (allowed: a [model] and a [matrix] table, or "
                            f"extends = \"quickstart.toml\" and the fields that differ; workloads/ has examples)")
    return workload


# [Note: overrides]
# ``zerobench run WORKLOAD --set data.steps=20 --set matrix.engine=ddp,impl-fsdp`` changes
# fields of the file without editing it (so do estimate, predict and cells). Each override
# is a dotted key and a value, merged into the file's tables as a workload that ``extends``
# it would be (``matrix.AXIS=[]`` removes an axis; another ``model.kind`` replaces the
# model table), then validated with everything else: a misspelt key gets the "did you mean"
# of the file's keys, a bad value the field's allowed values, and every message names the
# file and the overrides. The value is read as TOML (``20``, ``1e-3``, ``true``,
# ``"a, b"``, ``[2, 4]``); what is not TOML is text, and commas make a list of such values
# (``ddp,impl-fsdp``, ``2,4``; ``Block,`` is a list of one). The run folder keeps the
# result: workload.json holds the fields as overridden, meta.json the overrides as given.

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*")


def parse_override(text: str) -> tuple[str, Any]:
    """"data.steps=20" -> ("data.steps", 20) ([Note: overrides]); WorkloadError naming
    the override when it is not KEY=VALUE."""
    key, sep, value = str(text).partition("=")
    key = key.strip()
    if not sep or not _KEY.fullmatch(key):
        raise WorkloadError(f"--set {text}: expected KEY=VALUE with a dotted KEY (allowed: e.g. data.steps=20, "
                            f"matrix.engine=ddp,impl-fsdp)")
    if key == "extends":
        raise WorkloadError(f"--set {text}: extends is not allowed (it is resolved as the file is read; allowed: the "
                            f"fields of the workload)")
    return key, _override_value(value.strip())


def _override_value(text: str) -> Any:
    def toml(part: str) -> Any:
        try:
            return tomllib.loads(f"v = {part}")["v"]
        except tomllib.TOMLDecodeError:
            return part  # not TOML: text

    if text == "":
        return ""
    whole = toml(text)
    if whole is not text or "," not in text:
        return whole
    parts = text.split(",")
    if parts[-1].strip() == "":  # "Block,": a list of one
        parts = parts[:-1]
    return [toml(p.strip()) for p in parts]


def _nested(key: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def parse_workload(raw: dict[str, Any], source: str = "<dict>", default_name: str = "workload",
                   overrides: tuple[str, ...] = ()) -> Workload:
    """Validate a workload given as a dict (as read from TOML, ``extends`` resolved);
    ``overrides``: what was applied to it ([Note: overrides]), named in its errors."""
    raw = dict(raw)
    raw.pop("extends", None)
    try:
        _no_unknown_keys("", raw, {"name", "description", "seed", "model", "data", "optimizer", "run", "matrix"})
        model = _parse_model(dict(_table("model", raw.get("model", {}))), source)
        data = _build("data", DataConfig, _table("data", raw.get("data", {})))
        optimizer = _build("optimizer", OptimizerConfig, _table("optimizer", raw.get("optimizer", {})))
        optimizer.check()
        _check_optimizer_keys(optimizer.kind, raw.get("optimizer", {}))
        run = _build("run", RunConfig, _table("run", raw.get("run", {})))
        run.check()
        matrix = _parse_matrix(_table("matrix", raw.get("matrix", {})))
        name = raw.get("name", default_name)
        if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
            # the name becomes part of the run folder's name: one plain folder under --results
            raise WorkloadError(f"name: {name!r} is not allowed (allowed: 1 to 100 letters, digits, '.', '_', '+' "
                                "or '-', starting with a letter or digit, no '..')")
        seed = _coerce("seed", raw.get("seed", 0), Seed)
        description = raw.get("description", "")
        _check_type("description", description, str)
    except WorkloadError as err:
        label = source + "".join(f" --set {o}" for o in overrides)
        raise WorkloadError(f"{label}: {err}") from None
    return Workload(name=name, model=model, data=data, optimizer=optimizer, run=run,
                    matrix=matrix, description=description, seed=seed, source=source, overrides=overrides,
                    no_matrix="matrix" not in raw)


def _parse_model(raw: dict[str, Any], source: str) -> ModelConfig:
    if "factory" in raw:
        raw.setdefault("kind", "factory")
    kind = raw.get("kind", "mlp")
    if kind not in MODEL_KINDS:
        raise WorkloadError(not_allowed("model.kind", kind, MODEL_KINDS))
    if kind == "factory":
        extra = {k: v for k, v in raw.items() if k not in (*FACTORY_RESERVED, "kind")}
        raw = {k: v for k, v in raw.items() if k in (*FACTORY_RESERVED, "kind")}
        raw["kwargs"] = tuple(sorted(extra.items()))
    elif kind == "llama" and raw.get("preset", "") != "":
        preset = raw["preset"]
        if preset not in LLAMA_PRESETS:
            raise WorkloadError(not_allowed("model.preset", preset, LLAMA_PRESETS))
        raw = {**LLAMA_PRESETS[preset], **raw}
    elif kind == "hf" and isinstance(raw.get("config"), str) and raw["config"]:
        # relative to the workload file, as ``extends`` is; absolute afterwards so every rank finds it
        base = Path(source).parent if Path(source).suffix == ".toml" else Path(".")
        raw["config"] = str((base / raw["config"]).resolve())
    model = _build("model", MODEL_KINDS[kind], {k: v for k, v in raw.items() if k != "kwargs"})
    if kind == "factory":
        model = dataclasses.replace(model, kwargs=raw["kwargs"])
    model.check()
    return model


def _check_entry_point(name: str, value: str) -> None:
    module, _, attr = value.partition(":")
    if not module or not attr or not all(part.isidentifier() for part in [*module.split("."), attr]):
        raise WorkloadError(f"{name}: {value!r} is not allowed (allowed: \"package.module:function\")")


# [Note: narrowing the engines]
# A workload that extends another often narrows matrix.engine (``engine = ["ddp",
# "impl-fsdp"]`` under quickstart, or ``--set matrix.engine=ddp,impl-fsdp``) and keeps the
# parent's axes of the engines it left out (``reshard_after_forward``, torch-fsdp2's).
# Such an axis, set before matrix.engine was last set and taken by no engine left, is
# dropped as the workload is loaded, with a one-line note (matrix_notes in
# zerobench/spec/matrix.py): it would multiply nothing, and the run folder keeps the
# workload without it. An axis written beside the engine list that no engine of it takes
# (``sharding_strategy`` with ddp alone) is refused when the matrix is expanded, naming
# the engines that take it; one that no engine at all has is refused as a typo.


def _narrowed_axes(matrix: dict[str, Any], layers: list[dict]) -> tuple[str, ...]:
    """The matrix axes to drop ([Note: narrowing the engines]); ``layers``: the [matrix]
    table of each file, parents first, then of each override."""
    from zerobench.spec.axes import declared_axes, owners

    last = {key: i for i, layer in enumerate(layers) if isinstance(layer, dict) for key in layer}
    engines = matrix.get("engine", ["ddp"])
    taken = [declared_axes(e) for e in (engines if isinstance(engines, list) else [engines]) if isinstance(e, str)]
    if "engine" not in last or not taken or None in taken:
        return ()  # the engines were never narrowed, or one is unknown (refused, by name, when expanded)
    return tuple(axis for axis in matrix if axis not in _COMMON_AXES and last.get(axis, -1) < last["engine"]
                 and not any(axis in t for t in taken) and owners(axis))


def _load_with_parents(path: Path, seen: tuple[Path, ...], layers: list[dict]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise WorkloadError(f"{path}: extends: circular chain {chain}")
    if not path.is_file():
        raise WorkloadError(f"{path}: no such workload file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise WorkloadError(f"{path}: not UTF-8 text (TOML must be): byte 0x{err.object[err.start]:02x} "
                            f"at offset {err.start}") from None
    except tomllib.TOMLDecodeError as err:
        raise WorkloadError(f"{path}: not valid TOML: {err}") from None
    parent = raw.get("extends")
    if parent is None:
        layers.append(raw.get("matrix", {}))
        return raw
    if not isinstance(parent, str):
        raise WorkloadError(f"{path}: extends: {parent!r} is not allowed (allowed: a path to another workload file)")
    if not (path.parent / parent).is_file():
        raise WorkloadError(f"{path}: extends: {parent}: no such workload file (allowed: a TOML file, its path "
                            f"relative to {path.parent}/)")
    base = _load_with_parents(path.parent / parent, (*seen, resolved), layers)
    layers.append(raw.get("matrix", {}))
    base.pop("name", None)  # a variant is its own workload: it never inherits the name,
    base.pop("description", None)  # nor a description of a model it may have changed
    return _merge(base, raw)


def _merge(base: dict[str, Any], override: dict[str, Any], path: str = "") -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if key == "extends":
            continue
        if path == "matrix" and value == [] and key not in _COMMON_AXES:
            out.pop(key, None)  # a variant removes an inherited axis with `axis = []`
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            replace_whole = key == "model" and value.get("kind", out[key].get("kind")) != out[key].get("kind", "mlp")
            out[key] = dict(value) if replace_whole else _merge(out[key], value, key)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------------------
# Validation helpers

_COMMON_AXES = {"engine": str, "world_size": Count, "dtype": str}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
DTYPES = ("fp32", "bf16")


def _parse_matrix(raw: dict[str, Any]) -> dict[str, list]:
    matrix: dict[str, list] = {}
    for axis, values in raw.items():
        if not isinstance(values, list):
            values = [values]
        if not values and axis in _COMMON_AXES:
            raise WorkloadError(f"matrix.{axis}: empty list (allowed: one or more values; "
                                f"{axis} is an axis of every engine and cannot be removed)")
        if not values:
            raise WorkloadError(f"matrix.{axis}: empty list (allowed: one or more values; "
                                f"in a workload that extends another, `{axis} = []` removes the inherited axis)")
        if len(set(map(repr, values))) != len(values):
            raise WorkloadError(f"matrix.{axis}: repeated values {values} (allowed: each value once)")
        matrix[axis] = values
    matrix.setdefault("engine", ["ddp"])
    matrix.setdefault("world_size", [2])
    matrix.setdefault("dtype", ["fp32"])
    for axis, typ in _COMMON_AXES.items():
        for v in matrix[axis]:
            _coerce(f"matrix.{axis}", v, typ)
    for dt in matrix["dtype"]:
        if dt not in DTYPES:
            raise WorkloadError(not_allowed("matrix.dtype", dt, DTYPES))
    # Engine names and engine-specific axes are checked against the engine registry
    # when the matrix is expanded (zerobench.spec.matrix), which knows every engine's axes.
    return matrix


def _table(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WorkloadError(f"{name}: expected a table, got {type(value).__name__}")
    return value


def _build(prefix: str, cls, raw: dict[str, Any]):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _no_unknown_keys(prefix, raw, set(fields))
    hints = typing.get_type_hints(cls, include_extras=True)
    values = {}
    for key, value in raw.items():
        values[key] = _coerce(f"{prefix}.{key}", value, hints[key])
    return cls(**values)


def _coerce(name: str, value: Any, hint) -> Any:
    """``value`` as a field of type ``hint`` takes it: its type checked, then its range
    ([Note: a field's range]); WorkloadError naming ``name`` otherwise."""
    origin = typing.get_origin(hint)
    if origin is Annotated:
        base, *extras = typing.get_args(hint)
        value = _coerce(name, value, base)
        for extra in extras:
            if isinstance(extra, Range) and not extra.allows(value):
                raise WorkloadError(f"{name}: {value!r} is not allowed (allowed: {extra.describe(base)})")
        return value
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise WorkloadError(not_allowed(name, value, allowed))
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise WorkloadError(f"{name}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_coerce(name, v, typing.get_args(hint)[0]) for v in value)
    _check_type(name, value, hint)
    return float(value) if hint is float else value


def _check_type(name: str, value: Any, typ) -> None:
    ok = isinstance(value, typ) and not (isinstance(value, bool) and typ is not bool)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise WorkloadError(f"{name}: expected {typ.__name__}, got {type(value).__name__} {value!r}")


def _no_unknown_keys(prefix: str, raw: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise WorkloadError(unknown_key(f"{where}{unknown[0]}", allowed, prefix or "the top level"))


def _check_optimizer_keys(kind: str, raw: dict[str, Any]) -> None:
    only = {"betas": ("adam", "adamw"), "eps": ("adam", "adamw"), "momentum": ("sgd",)}
    for key, kinds in only.items():
        if key in raw and kind not in kinds:
            raise WorkloadError(f"optimizer.{key}: not an argument of {kind!r} (it applies to: {', '.join(kinds)})")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0][:8]
