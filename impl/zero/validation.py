"""Constructor checks shared by both stages, with the errors of docs/behaviour.md §Z1.1.

The messages match PyTorch's ``ZeroRedundancyOptimizer`` fragment for fragment, so code
(and tests) written against torch's errors keep working.
"""

from __future__ import annotations

from typing import Any

import torch


def materialize_params(params: Any, owner: str) -> list:
    """``params`` as a list of tensors or of group dicts, validated (docs/behaviour.md §Z1.1)."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}")
    try:
        items = list(params)
    except TypeError as e:
        raise TypeError(f"`params` argument should be an iterable of Tensors or dicts, but got {torch.typename(params)}") from e
    if not items:
        raise ValueError(f"{owner} got an empty parameter list")
    if not (all(isinstance(x, torch.Tensor) for x in items) or all(isinstance(x, dict) for x in items)):
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    for item in items:
        if isinstance(item, dict) and "params" not in item:
            raise ValueError("Each parameter group passed-in via `params` must have a 'params' key mapping to the parameters in the group")
    return items


def check_same_dense_type(params: list[torch.Tensor], owner: str) -> None:
    """Only the first parameter is checked for sparsity; all must share its tensor type.

    ``torch.typename`` includes the device type, so CPU and CUDA parameters may not be
    mixed (they could not share a bucket or a broadcast), while several CUDA devices may.
    """
    first = torch.typename(params[0])
    if params[0].is_sparse:
        raise ValueError(f"{owner} only supports using the same dense type for all parameters but got {first}")
    for param in params[1:]:
        other = torch.typename(param)
        if other != first:
            raise ValueError(f"{owner} only supports using the same dense type for all parameters but got both {first} and {other}")


def _is_functional(optimizer_class: Any) -> bool:
    # Recognised by module, so that the (TorchScript) functional classes are only imported
    # when overlap_with_ddp needs them.
    return getattr(optimizer_class, "__module__", "").startswith("torch.distributed.optim.functional_")


def check_optimizer_class(optimizer_class: type) -> None:
    """Functional optimizers (``torch.distributed.optim.functional_*``) only make sense
    with ``overlap_with_ddp=True``."""
    if _is_functional(optimizer_class):
        raise ValueError(f"Passing in a functional optimizer {optimizer_class} when `overlap_with_ddp=False`")


def optimizer_constructor(optimizer_class: Any, overlap_with_ddp: bool) -> Any:
    """The local optimizer's class (docs/behaviour.md §Z1.1): as given without overlap (a
    functional one is refused); with overlap a functional optimizer, as given or
    translated from its ``torch.optim`` class (``Adam`` -> ``_FunctionalAdam``, ...)."""
    if not overlap_with_ddp:
        check_optimizer_class(optimizer_class)
        return optimizer_class
    if _is_functional(optimizer_class):
        return optimizer_class
    # Only overlap_with_ddp needs the (TorchScript) functional optimizers: about 2 s to import.
    from torch.distributed.optim.utils import functional_optim_map

    if optimizer_class in functional_optim_map:
        return functional_optim_map[optimizer_class]
    raise ValueError(
        "Using `ddp_with_overlap=True` requires using a functional optimizer, but there is no supported "
        f"functional optimizer equivalent for {optimizer_class}"
    )
