"""Moving optimizer state between devices and ranks, for checkpointing.

Optimizer state dicts are nested Python objects, not flat tensors, so they travel
as bytes: the length as an int64 tensor, then the ``torch.save`` bytes as a uint8
tensor, both broadcast through :mod:`impl.comm` (so they show up in traces as
``impl::broadcast``). Broadcast rather than gather because that is what every backend
implements for tensors on the default device (PyTorch's ZeroRedundancyOptimizer makes
the same choice for NCCL, docs/behaviour.md §Z1.6).
"""

from __future__ import annotations

import collections.abc
import io
from typing import Any

import torch
from torch.autograd.profiler import record_function

from impl import comm


def copy_to_device(value: Any, device: torch.device) -> Any:
    """A copy of ``value`` with every tensor in it copied to ``device``.

    Recurses into lists, tuples and mappings; other values are returned as they are.
    Tensors are always copied, even when already on ``device``: a loaded state must
    not alias the caller's dict, which the optimizer would then update in place.
    """
    if torch.is_tensor(value):
        return value.detach().to(device, copy=True)
    if isinstance(value, (list, tuple)):
        items = [copy_to_device(v, device) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, collections.abc.Mapping):
        return {k: copy_to_device(v, device) for k, v in value.items()}
    return value


def broadcast_object(obj: Any, src: int, is_src: bool, group, device: torch.device) -> Any:
    """Send ``obj`` from global rank ``src`` to every rank of ``group``; return it everywhere.

    Non-source ranks pass ``obj=None``. The result is loaded on CPU: callers of this
    module keep consolidated state off the accelerator.
    """
    with record_function("impl::broadcast_object"):
        if is_src:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)
            length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=device)
        comm.broadcast(length, src=src, group=group, async_op=False)
        if not is_src:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        comm.broadcast(payload, src=src, group=group, async_op=False)
        if is_src:
            return obj
        return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=False)
