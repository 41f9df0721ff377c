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
        _positive("model.depth", self.depth)
        _positive("model.width", self.width)


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

    def check(self) -> None:
        for name in ("layers", "d_model", "heads", "vocab", "mlp_ratio"):
            _positive(f"model.{name}", getattr(self, name))
        if self.seq_len < 2:
            raise WorkloadError(f"model.seq_len: {self.seq_len} is not allowed (allowed: int >= 2)")
        if self.d_model % self.heads:
            raise WorkloadError(
                f"model.heads: {self.heads} does not divide model.d_model={self.d_model} "
                f"(allowed: a divisor of d_model, e.g. {_divisors(self.d_model)})"
            )


ModelConfig = Union[MLPConfig, GPTConfig]
MODEL_KINDS = {"mlp": MLPConfig, "gpt": GPTConfig}


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

    def check(self) -> None:
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
    engine; other axes only to the engines that declare them (see ``zerobench engines``)."""
    description: str = ""
    seed: int = 0
    """Seed of the model's initial weights."""
    source: str = ""
    """The file this workload was loaded from."""

    def to_dict(self) -> dict[str, Any]:
        """The resolved workload as plain TOML-able data (what the run folder keeps)."""
        out = dataclasses.asdict(self)
        out.pop("source")
        opt = self.optimizer
        out["optimizer"] = {"kind": opt.kind, "lr": opt.lr,
                            **{k: list(v) if isinstance(v, tuple) else v for k, v in opt.hyper().items()}}
        return out


# --------------------------------------------------------------------------------------
# Loading


def load_workload(path: str | Path) -> Workload:
    """Load, resolve ``extends`` and validate a workload file."""
    path = Path(path)
    raw = _load_with_parents(path, seen=())
    return parse_workload(raw, source=str(path), default_name=path.stem)


def parse_workload(raw: dict[str, Any], source: str = "<dict>", default_name: str = "workload") -> Workload:
    """Validate a workload given as a dict (as read from TOML, ``extends`` resolved)."""
    raw = dict(raw)
    raw.pop("extends", None)
    _no_unknown_keys("", raw, {"name", "description", "seed", "model", "data", "optimizer", "run", "matrix"})
    try:
        model_raw = dict(_table("model", raw.get("model", {})))
        kind = model_raw.get("kind", "mlp")
        if kind not in MODEL_KINDS:
            raise WorkloadError(f"model.kind: {kind!r} is not allowed (allowed: {', '.join(map(repr, MODEL_KINDS))})")
        model = _build("model", MODEL_KINDS[kind], model_raw)
        model.check()
        data = _build("data", DataConfig, _table("data", raw.get("data", {})))
        _positive("data.batch_size", data.batch_size)
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
        if not isinstance(name, str) or not name or any(bad in name for bad in ("/", "\\", "..", "\0")):
            # the name becomes part of the run folder's name: it must stay one folder under --results
            raise WorkloadError(f"name: {name!r} is not allowed (allowed: a non-empty string with no '/', "
                                "'\\' or '..')")
        seed = raw.get("seed", 0)
        _check_type("seed", seed, int)
        description = raw.get("description", "")
        _check_type("description", description, str)
    except WorkloadError as err:
        raise WorkloadError(f"{source}: {err}") from None
    return Workload(name=name, model=model, data=data, optimizer=optimizer, run=run,
                    matrix=matrix, description=description, seed=seed, source=source)


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
    # when the matrix is expanded (zerobench.matrix), which knows every engine's axes.
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0][:8]
