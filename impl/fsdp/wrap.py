"""Auto-wrap policies, with PyTorch 2.x's signature, and the recursive wrapping they drive.

A policy is called as ``policy(module=..., recurse=..., nonwrapped_numel=...)``:

* ``recurse=True`` asks whether to look inside ``module`` for children to wrap;
* ``recurse=False`` asks whether to wrap ``module`` itself, given the number of its
  parameters not already taken by wrapped descendants.

PyTorch 1.13 named that number ``unwrapped_params``; a policy whose signature uses that
name (and not ``nonwrapped_numel``) is called with it, so policies written for either
version work (``call_policy``).

Bind a policy's own arguments with ``functools.partial``, e.g.
``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``, or use
PyTorch 2.x's policy objects, ``ModuleWrapPolicy({Block})`` and ``CustomPolicy(fn)``;
a ``CustomPolicy`` function may return a dict of constructor arguments for that
module's instance instead of ``True``.
Wrapping applies to children only; the constructor wraps the root itself, which takes
whatever the children left.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map_only


def always_wrap_policy(*args, **kwargs) -> bool:
    """Wrap every submodule (each becomes its own unit)."""
    return True


FORCE_LEAF_MODULES = {nn.MultiheadAttention}
"""Modules whose insides size_based_auto_wrap_policy never wraps separately."""
EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}
"""Containers that are never units themselves (they have no forward)."""


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type] | None = None,
    exclude_wrap_modules: set[type] | None = None,
) -> bool:
    """Wrap a module once at least ``min_num_params`` of its parameters are left unwrapped."""
    leaf = tuple(FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules)
    exclude = tuple(EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules)
    if recurse:
        return not isinstance(module, leaf)
    return nonwrapped_numel >= min_num_params and not isinstance(module, exclude)


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, transformer_layer_cls: Iterable[type]
) -> bool:
    """Wrap every instance of the given classes (transformer blocks); the root takes the rest."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
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


# -- modules exempt from mixed precision -------------------------------------------------

# [Note: modules exempt from mixed precision]
# Some modules misbehave in low precision (BatchNorm's running statistics, SyncBatchNorm's
# all-reduce of counts). As PyTorch 2.x's FSDP1 does when it auto-wraps under mixed
# precision, the modules of ``MixedPrecision._module_classes_to_ignore`` (BatchNorm by
# default) become instances of their own with mixed precision disabled, a warning says
# so, and hooks on each such module cast its floating-point inputs to float32 and its
# outputs back to the dtype its inputs had, so that the modules around it keep their
# precision. Without an auto-wrap policy nothing is wrapped apart (as in PyTorch).


def exempt_from_mixed_precision(root: nn.Module, classes, ignored: set[nn.Module]) -> set[type]:
    """Hook the casts onto the modules of ``classes`` under ``root`` (not ignored ones) and
    return the classes found. See [Note: modules exempt from mixed precision]."""
    classes = tuple(classes)
    found: set[type] = set()
    if not classes:
        return found
    for module in root.modules():
        if isinstance(module, classes) and module not in ignored and not hasattr(module, "_impl_fsdp_exempt"):
            found.add(type(module))
            module._impl_fsdp_exempt = True  # hooks once, if the module is wrapped again
            module.register_forward_pre_hook(_to_float32)
            module.register_forward_hook(_back_to_input_dtype)
    return found


def _floats(obj):
    return [t for t in tree_leaves(obj) if torch.is_tensor(t) and t.is_floating_point()]


def _to_float32(module: nn.Module, args):
    floats = _floats(args)
    module._impl_fsdp_input_dtype = floats[0].dtype if floats else None  # for the outputs
    return tree_map_only(torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, args)


def _back_to_input_dtype(module: nn.Module, args, output):
    dtype = getattr(module, "_impl_fsdp_input_dtype", None)
    if dtype is None or dtype == torch.float32:
        return output
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, output)


def or_classes_policy(policy: Callable[..., bool], classes) -> Callable[..., bool]:
    """``policy``, also wrapping every module of ``classes`` on its own."""
    classes = tuple(classes)

    def either(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return call_policy(policy, module, recurse, nonwrapped_numel) or recurse or isinstance(module, classes)

    return either


def call_policy(policy: Callable[..., bool], module: nn.Module, recurse: bool, numel: int) -> bool:
    """Ask ``policy`` about ``module``, naming the unwrapped parameter count as its
    signature does: ``unwrapped_params`` (PyTorch 1.13) or ``nonwrapped_numel`` (2.x)."""
    try:
        names = inspect.signature(policy).parameters
    except (TypeError, ValueError):  # a builtin or C callable: assume 2.x
        names = {}
    keyword = "unwrapped_params" if "unwrapped_params" in names and "nonwrapped_numel" not in names else "nonwrapped_numel"
    return policy(module=module, recurse=recurse, **{keyword: numel})


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
    if not call_policy(policy, module, True, num_params):
        return module, 0
    wrapped = 0
    for name, child in module.named_children():
        new_child, n = recursive_wrap(child, policy, wrap_fn, ignored_modules, ignored_params, only_wrap_children=False)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped += n
    remainder = num_params - wrapped
    if not only_wrap_children and remainder > 0 and call_policy(policy, module, False, remainder):
        return wrap_fn(module), num_params
    return module, wrapped


# -- manual wrapping: enable_wrap / wrap ------------------------------------------------

# The wrapper class and its arguments while inside ``enable_wrap``; None outside.
_wrap_context: dict | None = None


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., nn.Module], **wrapper_kwargs):
    """Inside, ``wrap(module)`` returns ``wrapper_cls(module, **wrapper_kwargs)``
    (PyTorch's ``enable_wrap``); contexts do not nest (NotImplementedError, as PyTorch)."""
    global _wrap_context
    if _wrap_context is not None:
        raise NotImplementedError(
            "You are already within an autowrap context and we currently do not supported nested autowrap."
        )
    _wrap_context = {"wrapper_cls": wrapper_cls, "kwargs": wrapper_kwargs}
    try:
        yield
    finally:
        _wrap_context = None


def wrap(module: nn.Module, **wrap_overrides) -> nn.Module:
    """Wrap ``module`` with the class and arguments of the enclosing ``enable_wrap``
    (``wrap_overrides`` taking precedence); outside one, return ``module`` unchanged."""
    if _wrap_context is None:
        return module
    return _wrap_context["wrapper_cls"](module, **{**_wrap_context["kwargs"], **wrap_overrides})
