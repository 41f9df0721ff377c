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
from typing import Any, Literal, Union

__all__ = ["WorkloadError", "Workload", "load_workload", "parse_workload"]


class WorkloadError(ValueError):
    """A workload file is invalid; the message names the field and the allowed values."""


@dataclass(frozen=True)
class MLPConfig:
    """A stack of ``depth`` blocks Linear(width, width) + ReLU, trained to regress
    random targets with MSE. Each block is one sharding unit."""

    kind: Literal["mlp"] = "mlp"
    depth: int = 4
    """Number of blocks (>= 1)."""
    width: int = 256
    """Hidden size (>= 1)."""

    def check(self) -> None:
        _dimension("model.depth", self.depth)
        _dimension("model.width", self.width)


@dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer (pre-LayerNorm, causal self-attention, GELU MLP),
    trained on next-token prediction over random tokens. Each block is one sharding unit."""

    kind: Literal["gpt"] = "gpt"
    layers: int = 2
    """Number of transformer blocks (>= 1)."""
    d_model: int = 128
    """Embedding width; must be divisible by ``heads``."""
    heads: int = 4
    seq_len: int = 64
    """Tokens per sample (>= 2)."""
    vocab: int = 512
    mlp_ratio: int = 4
    """Hidden width of each block's MLP as a multiple of d_model."""
    loss_dtype: Literal["model", "fp32"] = "model"
    """dtype of the cross-entropy: ``"model"``, the logits' own (bf16 under bf16 compute);
    ``"fp32"``, the logits upcast first, as torchtitan's ``cross_entropy_loss`` does."""

    def check(self) -> None:
        _check_decoder(self, ("layers", "d_model", "heads", "vocab", "mlp_ratio", "seq_len"))
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
    layers: int = 2
    d_model: int = 128
    """Embedding width; must be divisible by ``heads``."""
    heads: int = 4
    """Query heads."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``heads``. ``heads`` is plain multi-head."""
    ffn_hidden: int = 352
    """Hidden width of the SwiGLU feed-forward (its gate and up projections)."""
    vocab: int = 512
    seq_len: int = 64
    """Tokens per sample (>= 2)."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding's frequencies."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    tie_embeddings: bool = False
    """Share the token embedding's weight with the output head."""
    loss_dtype: Literal["model", "fp32"] = "model"
    """dtype of the cross-entropy: ``"model"``, the logits' own (bf16 under bf16 compute);
    ``"fp32"``, the logits upcast first, as torchtitan's ``cross_entropy_loss`` does."""

    def check(self) -> None:
        _check_decoder(self, ("layers", "d_model", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len"))
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise WorkloadError(
                f"model.heads: {self.heads} does not divide model.d_model={self.d_model} into heads of even width "
                f"(allowed: a divisor of d_model leaving an even head width, e.g. {_divisors(self.d_model)})"
            )
        if self.heads % self.kv_heads:
            raise WorkloadError(f"model.kv_heads: {self.kv_heads} does not divide model.heads={self.heads} "
                                f"(allowed: a divisor of heads, e.g. {_divisors(self.heads)})")
        if not self.rope_theta > 0:
            raise WorkloadError(f"model.rope_theta: {self.rope_theta} is not allowed (allowed: float > 0)")
        if not self.norm_eps > 0:
            raise WorkloadError(f"model.norm_eps: {self.norm_eps} is not allowed (allowed: float > 0)")


LOSS_DTYPES = ("model", "fp32")


def _check_loss_dtype(value) -> None:
    if value not in LOSS_DTYPES:
        raise WorkloadError(f"model.loss_dtype: {value!r} is not allowed (allowed: {', '.join(map(repr, LOSS_DTYPES))})")


def _check_decoder(model, dimensions: tuple[str, ...]) -> None:
    """What every decoder's ``[model]`` is checked for: its loss dtype, a ``seq_len`` of at
    least two tokens (one to predict the next from), and each of ``dimensions`` >= 1."""
    _check_loss_dtype(model.loss_dtype)
    if model.seq_len < 2:
        raise WorkloadError(f"model.seq_len: {model.seq_len} is not allowed (allowed: int >= 2)")
    for name in dimensions:
        _dimension(f"model.{name}", getattr(model, name))


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
    seq_len: int = 64
    """Tokens per sample (>= 2); the vocabulary is the config's ``vocab_size``."""
    wrap: tuple[str, ...] = ()
    """Class names of the sharding units; empty: the model's ``_no_split_modules``."""

    def check(self) -> None:
        if not self.config:
            raise WorkloadError("model.config: missing (allowed: a path to a Hugging Face config.json)")
        if self.seq_len < 2:
            raise WorkloadError(f"model.seq_len: {self.seq_len} is not allowed (allowed: int >= 2)")
        self.read()

    def read(self) -> dict[str, Any]:
        """The parsed config.json; WorkloadError naming model.config if it does not parse."""
        import json

        try:
            out = json.loads(Path(self.config).read_text())
        except OSError as err:
            raise WorkloadError(f"model.config: cannot read {self.config}: {err.strerror}") from None
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

    batch_size: int = 8
    """Samples per rank per step (>= 1); the global batch is batch_size * world_size."""
    warmup_steps: int = 2
    """Steps run before measuring (>= 0); excluded from timings."""
    steps: int = 10
    """Measured steps (>= 1)."""
    seed: int = 0


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer every engine builds (as torch.optim classes name their arguments)."""

    kind: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    """adam/adamw only."""
    eps: float = 1e-8
    """adam/adamw only."""
    momentum: float = 0.0
    """sgd only."""
    no_decay: Literal["none", "norms_and_biases"] = "none"
    """``norms_and_biases``: two parameter groups, weight decay off for the parameters of
    norm modules and for biases. Needs the original parameters: FSDP1 engines
    (torch-fsdp1, impl-fsdp) with ``use_orig_params = true``, ddp, torch-fsdp2."""

    def check(self) -> None:
        if self.no_decay not in ("none", "norms_and_biases"):
            raise WorkloadError(f"optimizer.no_decay: {self.no_decay!r} is not allowed "
                                "(allowed: \"none\", \"norms_and_biases\")")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise WorkloadError(f"optimizer.lr: {self.lr} is not allowed (allowed: a finite float > 0)")
        for name in ("weight_decay", "eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise WorkloadError(f"optimizer.{name}: {value} is not allowed (allowed: a finite float >= 0)")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise WorkloadError(f"optimizer.betas: {list(self.betas)} is not allowed (allowed: two floats in [0, 1))")
        if self.momentum < 0:
            raise WorkloadError(f"optimizer.momentum: {self.momentum} is not allowed (allowed: float >= 0)")

    def hyper(self) -> dict[str, Any]:
        """Keyword arguments of the torch.optim class, without ``lr``."""
        if self.kind == "sgd":
            return {"momentum": self.momentum, "weight_decay": self.weight_decay}
        return {"betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


@dataclass(frozen=True)
class RunConfig:
    """How each cell is run and measured."""

    timeout_s: float = 600.0
    """Wall-clock limit per cell; a cell past it is killed and recorded as failed."""
    threads_per_rank: int = 1
    """torch intra-op threads per rank on CPU (one per rank keeps ranks from contending)."""
    memory_pass: bool = True
    """Run a separate pass under the tensor-storage tracker (peak memory, its
    composition, communication bytes). Separate because the tracker slows steps 1.5-2x."""
    memory_warmup_steps: int = 2
    """Steps of the memory pass before the measured one: the first creates optimizer
    state, and DDP rebuilds its gradient buckets in the second iteration's forward (with
    one warm-up step those buckets would be counted as activations)."""
    reference: bool = True
    """Compute single-process reference losses on the global batch and record each
    cell's deviation from them (loss_max_abs_diff_ref)."""
    profile_steps: int = 3
    """Steps traced by the profiled pass (``zerobench run --profile``)."""

    def check(self) -> None:
        if not self.timeout_s > 0:
            raise WorkloadError(f"run.timeout_s: {self.timeout_s} is not allowed (allowed: float > 0)")
        _positive("run.threads_per_rank", self.threads_per_rank)
        if self.memory_warmup_steps < 0:
            raise WorkloadError(f"run.memory_warmup_steps: {self.memory_warmup_steps} is not allowed (allowed: int >= 0)")
        _positive("run.profile_steps", self.profile_steps)


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
    seed: int = 0
    """Seed of the model's initial weights."""
    source: str = ""
    """The file this workload was loaded from."""

    def to_dict(self) -> dict[str, Any]:
        """The resolved workload as plain TOML-able data (what the run folder keeps)."""
        out = dataclasses.asdict(self)
        out.pop("source")
        if isinstance(self.model, FactoryConfig):
            out["model"] = self.model.table()
        opt = self.optimizer
        out["optimizer"] = {"kind": opt.kind, "lr": opt.lr,
                            **{k: list(v) if isinstance(v, tuple) else v for k, v in opt.hyper().items()}}
        return out


# --------------------------------------------------------------------------------------
# Loading


#: The workloads that ship with zerobench (workloads/ of the checkout it runs from).
SHIPPED_WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"


def shipped_workloads() -> list[str]:
    """Names of the shipped workloads (``zerobench run NAME`` finds them)."""
    return sorted(p.stem for p in SHIPPED_WORKLOADS.glob("*.toml"))


def find_workload(text: str | Path) -> Path:
    """The workload file ``text`` names: a path, or the name of a shipped workload
    (``quickstart``, ``gpt-small.toml``), looked up in ./workloads/ first, then in the
    shipped folder. WorkloadError listing the shipped names when there is none."""
    path = Path(text)
    if path.is_file() or str(text) == "":
        return path
    if path.parent == Path(".") and not path.name.startswith("."):
        stem = path.name.removesuffix(".toml")
        for folder in (Path("workloads"), SHIPPED_WORKLOADS):
            if (folder / f"{stem}.toml").is_file():
                return folder / f"{stem}.toml"
    raise WorkloadError(f"{text}: no such workload file (allowed: a TOML file, or a shipped workload: "
                        f"{', '.join(shipped_workloads()) or 'none found'})")


def load_workload(path: str | Path) -> Workload:
    """Load, resolve ``extends`` and validate a workload file (a path, or the name of a
    shipped workload: :func:`find_workload`). A file that sets no table at all (empty,
    or only a name) is refused rather than run with every default."""
    path = find_workload(path)
    raw = _load_with_parents(path, seen=())
    workload = parse_workload(raw, source=str(path), default_name=path.stem)
    if not set(raw) - {"name", "description", "seed"}:
        raise WorkloadError(f"{path}: the file sets nothing to run (allowed: a [model] and a [matrix] table, or "
                            f"extends = \"quickstart.toml\" and the fields that differ; workloads/ has examples)")
    return workload


def parse_workload(raw: dict[str, Any], source: str = "<dict>", default_name: str = "workload") -> Workload:
    """Validate a workload given as a dict (as read from TOML, ``extends`` resolved)."""
    raw = dict(raw)
    raw.pop("extends", None)
    _no_unknown_keys("", raw, {"name", "description", "seed", "model", "data", "optimizer", "run", "matrix"})
    try:
        model = _parse_model(dict(_table("model", raw.get("model", {}))), source)
        data = _build("data", DataConfig, _table("data", raw.get("data", {})))
        _dimension("data.batch_size", data.batch_size)
        _positive("data.steps", data.steps)
        if data.warmup_steps < 0:
            raise WorkloadError(f"data.warmup_steps: {data.warmup_steps} is not allowed (allowed: int >= 0)")
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
        seed = raw.get("seed", 0)
        _check_type("seed", seed, int)
        description = raw.get("description", "")
        _check_type("description", description, str)
    except WorkloadError as err:
        raise WorkloadError(f"{source}: {err}") from None
    return Workload(name=name, model=model, data=data, optimizer=optimizer, run=run,
                    matrix=matrix, description=description, seed=seed, source=source)


def _parse_model(raw: dict[str, Any], source: str) -> ModelConfig:
    if "factory" in raw:
        raw.setdefault("kind", "factory")
    kind = raw.get("kind", "mlp")
    if kind not in MODEL_KINDS:
        raise WorkloadError(f"model.kind: {kind!r} is not allowed (allowed: {', '.join(map(repr, MODEL_KINDS))})")
    if kind == "factory":
        extra = {k: v for k, v in raw.items() if k not in (*FACTORY_RESERVED, "kind")}
        raw = {k: v for k, v in raw.items() if k in (*FACTORY_RESERVED, "kind")}
        raw["kwargs"] = tuple(sorted(extra.items()))
    elif kind == "llama" and raw.get("preset", "") != "":
        preset = raw["preset"]
        if preset not in LLAMA_PRESETS:
            raise WorkloadError(f"model.preset: {preset!r} is not allowed "
                                f"(allowed: {', '.join(map(repr, LLAMA_PRESETS))})")
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


def _load_with_parents(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
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
        return raw
    if not isinstance(parent, str):
        raise WorkloadError(f"{path}: extends: {parent!r} is not allowed (allowed: a path to another workload file)")
    base = _load_with_parents(path.parent / parent, (*seen, resolved))
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

_COMMON_AXES = {"engine": str, "world_size": int, "dtype": str}
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
            _check_type(f"matrix.{axis}", v, typ)
    for ws in matrix["world_size"]:
        if ws < 1:
            raise WorkloadError(f"matrix.world_size: {ws} is not allowed (allowed: int >= 1)")
    for dt in matrix["dtype"]:
        if dt not in DTYPES:
            raise WorkloadError(f"matrix.dtype: {dt!r} is not allowed (allowed: {', '.join(map(repr, DTYPES))})")
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
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        values[key] = _coerce(f"{prefix}.{key}", value, hints[key])
    return cls(**values)


def _coerce(name: str, value: Any, hint) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise WorkloadError(f"{name}: {value!r} is not allowed (allowed: {', '.join(map(repr, allowed))})")
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
        raise WorkloadError(
            f"unknown key {where}{unknown[0]} (allowed in {prefix or 'the top level'}: {', '.join(sorted(allowed))})"
        )


def _check_optimizer_keys(kind: str, raw: dict[str, Any]) -> None:
    only = {"betas": ("adam", "adamw"), "eps": ("adam", "adamw"), "momentum": ("sgd",)}
    for key, kinds in only.items():
        if key in raw and kind not in kinds:
            raise WorkloadError(f"optimizer.{key}: not an argument of {kind!r} (it applies to: {', '.join(kinds)})")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise WorkloadError(f"{name}: {value} is not allowed (allowed: int >= 1)")


#: Largest size accepted: torch holds sizes as int64, and a larger one fails inside its C++
#: code. Sizes below it that no machine can hold are the preflight's to refuse, naming the
#: bytes (zerobench/harness/preflight.py).
MAX_DIMENSION = 2**63 - 1


def _dimension(name: str, value: int) -> None:
    if not 1 <= value <= MAX_DIMENSION:
        raise WorkloadError(f"{name}: {value} is not allowed (allowed: int from 1 to 2**63 - 1)")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0][:8]
