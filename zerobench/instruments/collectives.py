"""Recognising collectives among dispatched operators, and their sizes.

Every torch.distributed collective, whether issued from Python (FSDP, ZeRO, impl) or
from C++ (DDP's reducer), is dispatched as an operator of the ``c10d`` namespace, so a
``TorchDispatchMode`` sees them all (see zerobench.instruments.memory.StorageTracker).

Sizes follow the nccl-tests convention: an all-gather counts its gathered output, a
reduce-scatter its full input, an all-reduce or a broadcast its buffer. For the list
forms (``allgather_(outputs: list[list[Tensor]], inputs, ...)``) that is the larger of
the two first arguments.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

_KINDS = {
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "alltoall_": "other",
    "alltoall_base_": "other",
    "send": "other",
    "recv_": "other",
    "gather_": "other",
    "scatter_": "other",
    "reduce_": "other",
}


def collective_kind(func) -> str | None:
    """"all_gather" | "reduce_scatter" | "all_reduce" | "broadcast" | "other", or None
    when ``func`` is not a data-moving collective (barriers are not counted)."""
    if getattr(func, "namespace", None) != "c10d":
        return None
    return _KINDS.get(func._schema.name.split("::")[-1])


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def collective_bytes(kind: str, args) -> int:
    if kind in ("all_gather", "reduce_scatter", "other"):
        return max(_nbytes(args[0]), _nbytes(args[1]) if len(args) > 1 else 0)
    return _nbytes(args[0])
