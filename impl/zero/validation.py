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


def check_optimizer_class(optimizer_class: type) -> None:
    """Functional optimizers (``torch.distributed.optim.functional_*``) only make sense
    with ``overlap_with_ddp=True``, which this implementation does not provide.
    Recognised by module, so that the (TorchScript) functional classes are never imported."""
    if getattr(optimizer_class, "__module__", "").startswith("torch.distributed.optim.functional_"):
        raise ValueError(f"Passing in a functional optimizer {optimizer_class} when `overlap_with_ddp=False`")
