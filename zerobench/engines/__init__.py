"""The engine registry: name -> adapter class, imported on first use. Each engine's
options are declared in options.py (torch-free: readers import it); the interface every
adapter implements is base.py's ``Engine``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from zerobench.choices import not_allowed
from zerobench.engines.options import OPTIONS, Axis

if TYPE_CHECKING:
    from zerobench.engines.base import Engine

__all__ = ["ENGINES", "OPTIONS", "get_engine", "Axis"]

#: engine name -> "module:Class"
ENGINES: dict[str, str] = {
    "ddp": "zerobench.engines.ddp:DDPEngine",
    "torch-zero1": "zerobench.engines.torch_zero1:TorchZero1Engine",
    "torch-fsdp1": "zerobench.engines.torch_fsdp1:TorchFSDP1Engine",
    "torch-fsdp2": "zerobench.engines.torch_fsdp2:TorchFSDP2Engine",
    "impl-zero1": "zerobench.engines.impl_zero:Zero1Engine",
    "impl-zero2": "zerobench.engines.impl_zero:Zero2Engine",
    "impl-fsdp": "zerobench.engines.impl_fsdp:FSDPEngine",
    # the optional extra `deepspeed`: importable without it, then unavailable (engines/deepspeed.py)
    "deepspeed-zero1": "zerobench.engines.deepspeed:DeepSpeedZero1Engine",
    "deepspeed-zero2": "zerobench.engines.deepspeed:DeepSpeedZero2Engine",
    "deepspeed-zero3": "zerobench.engines.deepspeed:DeepSpeedZero3Engine",
}


def get_engine(name: str) -> type[Engine]:
    """The adapter class of engine ``name``; ValueError naming the known engines otherwise."""
    if name not in ENGINES:
        raise ValueError(not_allowed("engine", name, ENGINES))
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)
