"""Auto-wrap policies, with PyTorch 1.13's signature, and the recursive wrapping they drive.

A policy is called as ``policy(module=..., recurse=..., unwrapped_params=...)``:

* ``recurse=True`` asks whether to look inside ``module`` for children to wrap;
* ``recurse=False`` asks whether to wrap ``module`` itself, given the number of its
  parameters not already taken by wrapped descendants.

Bind a policy's own arguments with ``functools.partial``, e.g.
``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``, or use
PyTorch 2.x's policy objects, ``ModuleWrapPolicy({Block})`` and ``CustomPolicy(fn)``;
a ``CustomPolicy`` function may return a dict of constructor arguments for that
module's instance instead of ``True``.
Wrapping applies to children only; the constructor wraps the root itself, which takes
whatever the children left.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch.nn as nn


def always_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int = 0, **kwargs) -> bool:
    """Wrap every submodule (each becomes its own unit)."""
    return True


FORCE_LEAF_MODULES = {nn.MultiheadAttention}
"""Modules whose insides size_based_auto_wrap_policy never wraps separately."""
EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}
"""Containers that are never units themselves (they have no forward)."""


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type] | None = None,
    exclude_wrap_modules: set[type] | None = None,
) -> bool:
    """Wrap a module once at least ``min_num_params`` of its parameters are left unwrapped."""
    leaf = tuple(FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules)
    exclude = tuple(EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules)
    if recurse:
        return not isinstance(module, leaf)
    return unwrapped_params >= min_num_params and not isinstance(module, exclude)


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, transformer_layer_cls: Iterable[type]
) -> bool:
    """Wrap every instance of the given classes (transformer blocks); the root takes the rest."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true."""
    if recurse:
        return True
    return lambda_fn(module)


class ModuleWrapPolicy:
    """Wrap every module whose class is one of ``module_classes`` (PyTorch 2.x), as
    ``transformer_auto_wrap_policy`` does; callable with the 1.13 policy signature."""

    def __init__(self, module_classes: Iterable[type]):
        self._module_classes = tuple(set(module_classes))

    def __call__(self, module: nn.Module, recurse: bool, *args, **kwargs) -> bool:
        return True if recurse else isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({', '.join(c.__name__ for c in self._module_classes)})"


class CustomPolicy:
    """Wrap the modules for which ``lambda_fn(module)`` is truthy (PyTorch 2.x). A dict
    return value wraps the module with those constructor arguments overriding the
    root's (for example ``{"sharding_strategy": ShardingStrategy.NO_SHARD}``)."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict]):
        self._lambda_fn = lambda_fn

    def __call__(self, module: nn.Module, recurse: bool, *args, **kwargs) -> bool:
        return True if recurse else bool(self._lambda_fn(module))

    def wrap_kwargs(self, module: nn.Module) -> dict:
        """The constructor arguments this module's instance overrides."""
        out = self._lambda_fn(module)
        return dict(out) if isinstance(out, dict) else {}


def recursive_wrap(
    module: nn.Module,
    policy: Callable[..., bool],
    wrap_fn: Callable[[nn.Module], nn.Module],
    ignored_modules: set[nn.Module],
    ignored_params: set[int],
    only_wrap_children: bool = True,
) -> tuple[nn.Module, int]:
    """Wrap ``module``'s descendants bottom-up as ``policy`` says.

    Returns the (possibly wrapped) module and how many parameters are now inside units.
    """
    if module in ignored_modules:
        return module, 0
    num_params = sum(p.numel() for p in module.parameters() if id(p) not in ignored_params)
    if not policy(module=module, recurse=True, unwrapped_params=num_params):
        return module, 0
    wrapped = 0
    for name, child in module.named_children():
        new_child, n = recursive_wrap(child, policy, wrap_fn, ignored_modules, ignored_params, only_wrap_children=False)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped += n
    remainder = num_params - wrapped
    if not only_wrap_children and remainder > 0 and policy(module=module, recurse=False, unwrapped_params=remainder):
        return wrap_fn(module), num_params
    return module, wrapped
