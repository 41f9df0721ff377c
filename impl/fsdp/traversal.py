"""Finding the FSDP instances of a module tree, and the modules one instance manages.

An FSDP instance is any module holding an ``FSDPState`` (state.py) under
``STATE_ATTR``. Recognising it by that attribute rather than by its class lets the
hooks and the utilities walk a tree without importing fully_sharded.py, which imports
them. Every "for each FSDP instance in this tree" of the package goes through
``fsdp_modules`` / ``fsdp_states`` / ``named_fsdp_states``, which all follow
``nn.Module.named_modules()`` order (the given module first, then depth first, each
module once).

A leaf of the package: it imports state.py only.
"""

from __future__ import annotations

from typing import Iterator

import torch.nn as nn

from impl.fsdp.state import FSDPState

STATE_ATTR = "_fsdp_state"
"""The attribute FullyShardedDataParallel keeps its FSDPState in."""


def state_of(module: nn.Module) -> FSDPState | None:
    """``module``'s FSDP state if it is an FSDP instance, else None."""
    # The instance's own __dict__: FSDP's __getattr__ falls back to the wrapped module.
    return module.__dict__.get(STATE_ATTR)


def is_fsdp(module: nn.Module) -> bool:
    return state_of(module) is not None


def named_fsdp_states(module: nn.Module) -> Iterator[tuple[str, FSDPState]]:
    """(name in ``module``, state) of every FSDP instance in ``module``, itself included."""
    for name, sub in module.named_modules():
        state = state_of(sub)
        if state is not None:
            yield name, state


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """Every FSDP instance in ``module`` (``module`` first if it is one)."""
    return [sub for sub in module.modules() if is_fsdp(sub)]


def fsdp_states(module: nn.Module) -> list[FSDPState]:
    """The states of ``fsdp_modules(module)``, in the same order."""
    return [state for _, state in named_fsdp_states(module)]


def managed_modules(module: nn.Module, ignored: set[nn.Module]) -> Iterator[nn.Module]:
    """``module`` and its descendants, stopping at nested instances and ignored modules:
    the modules whose parameters and buffers the instance wrapping ``module`` manages."""
    if module in ignored:
        return
    yield module
    for child in module._modules.values():
        if child is None or is_fsdp(child):
            continue
        yield from managed_modules(child, ignored)
