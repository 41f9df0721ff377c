"""Translating optimizer state between local (per-rank) and global indexing.

A ``torch.optim`` state dict names parameters by their position in "group, then
parameter" order. A ZeRO rank's local optimizer only holds its own shard, so its
indices are local. The global state dict — the one a plain ``torch.optim``
optimizer of the whole model would produce, and the one saved to disk — is rebuilt
by mapping each rank's local positions back to global ones through the partition
(docs/behaviour.md §Z1.6). Since the partition is not stored in the checkpoint, a
state dict saved at one world size loads at any other.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch


def sync_hyperparams(src_groups: list[dict[str, Any]], dst_groups: list[dict[str, Any]]) -> None:
    """Copy every non-``params`` key (lr, betas, ...) from ``src_groups`` to ``dst_groups``.

    Keeps the public groups (which LR schedulers edit) and the local optimizer's
    groups (which the step reads) in agreement. Both lists must be index-aligned.
    """
    if len(src_groups) != len(dst_groups):
        raise AssertionError(f"param group count mismatch: {len(src_groups)} vs {len(dst_groups)}")
    for src, dst in zip(src_groups, dst_groups):
        for key, value in src.items():
            if key != "params":
                dst[key] = value


def global_index(param_groups: list[dict[str, Any]]) -> dict[torch.Tensor, int]:
    """Each parameter's position in "group, then parameter" order (``Optimizer.state_dict``)."""
    return {p: i for i, p in enumerate(chain.from_iterable(g["params"] for g in param_groups))}


def index_to_param(param_groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    return list(chain.from_iterable(g["params"] for g in param_groups))


def local_to_global_state(
    local_state_dicts: list[dict[str, Any]],
    partition: list[list[dict[str, Any]]],
    to_global: dict[torch.Tensor, int],
) -> dict[int, Any]:
    """Merge every rank's local ``state`` into one dict keyed by global index.

    ``local_state_dicts[rank]`` is that rank's ``optim.state_dict()``;
    ``partition[rank]`` its param groups holding the actual tensors, aligned with the
    local dict's groups. Parameters without state (never stepped) are absent.
    """
    merged: dict[int, Any] = {}
    for rank, local in enumerate(local_state_dicts):
        groups = partition[rank]
        if len(local["param_groups"]) != len(groups):
            raise AssertionError(f"rank {rank}: local and global param group counts differ")
        for local_group, group in zip(local["param_groups"], groups):
            if len(local_group["params"]) != len(group["params"]):
                raise AssertionError(f"rank {rank}: local and global parameter counts differ")
            for local_index, param in zip(local_group["params"], group["params"]):
                if local_index in local["state"]:
                    merged[to_global[param]] = local["state"][local_index]
    return merged


def check_param_groups_match(saved_groups: list[dict[str, Any]], param_groups: list[dict[str, Any]]) -> None:
    """Raise ValueError unless a saved state dict's groups fit ``param_groups`` (as torch.optim)."""
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for saved, group in zip(saved_groups, param_groups):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
