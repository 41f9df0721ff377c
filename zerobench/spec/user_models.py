"""Models zerobench does not define: a user's ``factory`` and Hugging Face transformers configs.

The contract (docs/models.md):

* ``[model] factory = "package.module:function"`` is imported from the harness's
  ``sys.path`` (the current folder first, then PYTHONPATH: the same in every rank, which
  ``zerobench run`` starts in the current folder) and called with the other keys of
  ``[model]`` except ``factory``, ``wrap``, ``batch`` and ``loss``; it returns an ``nn.Module``.
* ``wrap = ["ClassName", ...]``: the instances of those classes are the sharding units,
  as PyTorch's ``ModuleWrapPolicy`` picks them.
* ``batch = "package.module:function"``, called as ``function(batch_size, generator)``,
  returns ``(inputs, targets)``; without it the model takes token ids.
* ``loss = "cross_entropy" | "mse" | "package.module:function"`` on ``(model(inputs), targets)``.
* ``kind = "hf"`` with ``config = "config.json"`` builds ``AutoModelForCausalLM.from_config``
  (optional extra ``transformers``; no weights, nothing downloaded).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import torch.nn as nn

from zerobench.choices import not_allowed
from zerobench.spec.workload import FactoryConfig, HFConfig, WorkloadError


def import_entry_point(key: str, value: str):
    """The object ``"package.module:name"`` names; WorkloadError naming ``key`` otherwise."""
    module_name, _, attr = value.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script's sys.path lacks the current folder
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or an error raised while the module runs
        raise WorkloadError(f"{key}: cannot import {module_name!r} for {value!r}: {type(err).__name__}: {err} "
                            f"(it must be importable from the current folder or PYTHONPATH)") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise WorkloadError(f"{key}: module {module_name!r} has no {attr!r} ({value!r})") from None


def import_callable(key: str, value: str):
    """:func:`import_entry_point`, and WorkloadError naming ``key`` unless it is callable."""
    fn = import_entry_point(key, value)
    if not callable(fn):
        raise WorkloadError(f"{key}: {value!r} is a {type(fn).__name__}, not a function "
                            f"(allowed: \"package.module:function\" naming something callable)")
    return fn


def call_user(key: str, value: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` for the user's function that ``key = value`` named; what it
    raises becomes a WorkloadError naming both, with the exception's own type and message
    (an unexpected keyword argument included)."""
    try:
        return fn(*args, **kwargs)
    except WorkloadError:
        raise
    except Exception as err:
        raise WorkloadError(f"{key}: {value} raised {type(err).__name__}: {err}") from err


def build_factory_model(cfg: FactoryConfig) -> nn.Module:
    fn = import_callable("model.factory", cfg.factory)
    model = call_user("model.factory", cfg.factory, fn, **dict(cfg.kwargs))
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"model.factory: {cfg.factory} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def checked_batch(key: str, value: str, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The user's ``batch`` function's result, if it is ``(inputs, targets)`` tensors."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        got = (f"a {type(batch).__name__} of {', '.join(type(t).__name__ for t in batch)}"
               if isinstance(batch, (tuple, list)) else f"a {type(batch).__name__}")
        raise WorkloadError(f"{key}: {value} returned {got} (allowed: a tuple (inputs, targets) of two tensors)")
    return batch[0], batch[1]


def checked_loss(key: str, value: str, fn):
    """The user's loss function, checked at every call: its exceptions name ``key``, and
    what it returns must be a one-element tensor (what backward starts from)."""

    def loss(output, target):
        value_ = call_user(key, value, fn, output, target)
        if not (isinstance(value_, torch.Tensor) and value_.numel() == 1):
            got = f"a tensor of shape {tuple(value_.shape)}" if isinstance(value_, torch.Tensor) else \
                f"a {type(value_).__name__}"
            raise WorkloadError(f"{key}: {value} returned {got} (allowed: a tensor with one element, the loss)")
        return value_

    return loss


def units_by_class(model: nn.Module, class_names: tuple[str, ...], key: str = "model.wrap") -> list[nn.Module]:
    """Instances of the named classes, outermost first in module order (a unit inside a
    unit is the inner one's parent's business, as ModuleWrapPolicy nests them)."""
    units = [m for m in model.modules() if type(m).__name__ in class_names and m is not model]
    present = {type(m).__name__ for m in units}
    missing = [name for name in class_names if name not in present]
    if missing:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise WorkloadError(not_allowed(key, missing[0], classes, what="is the class of no module of the model"))
    return units


class HFCausalLM(nn.Module):
    """A transformers causal LM whose forward takes token ids and returns the logits (the
    harness's loss takes a tensor, not a ModelOutput)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        return self.inner(input_ids=idx, use_cache=False).logits


def build_hf_model(cfg: HFConfig) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise WorkloadError("model.kind: 'hf' needs the optional extra transformers "
                            "(pip install -e '.[hf]')") from None
    raw = cfg.read()
    model_type = raw.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except (ValueError, KeyError, TypeError) as err:
        raise WorkloadError(f"model.config: {cfg.config} is not a config transformers can build: {err}") from None
    config._attn_implementation = "sdpa"  # the fused kernel, as our own models use
    inner = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return HFCausalLM(inner)


def hf_unit_classes(model: nn.Module, cfg: HFConfig) -> tuple[str, ...]:
    """The configured ``wrap`` classes, else the model's ``_no_split_modules`` (its decoder layers)."""
    if cfg.wrap:
        return tuple(cfg.wrap)
    inner = model.inner if isinstance(model, HFCausalLM) else model
    return tuple(getattr(inner, "_no_split_modules", None) or ())
