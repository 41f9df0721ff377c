"""Which rank owns which parameter: the sorted-greedy partition of ZeRO stage 1.

As in PyTorch's ``ZeroRedundancyOptimizer`` (docs/behaviour.md §Z1.2): parameters are
never split; within each param group they are visited largest first and each goes to
the rank with the fewest elements so far. See [Note: shared running sizes].

[Note: shared running sizes]
One running-size array (one slot per rank) is carried across all param groups and
never reset. A group of small parameters that follows a group with one huge parameter
therefore lands on the ranks that did *not* get the huge one, which keeps the total
per rank balanced even though each group alone would not be. It also means a rank may
own nothing of some group: every rank still gets a (possibly empty) copy of every
group, so local and public groups stay index-aligned (the optimizer and the state
dict translation rely on that).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

ParamGroups = list[dict[str, Any]]


def _least_loaded(sizes: Sequence[int]) -> int:
    """The rank with the smallest running size; ties go to the lowest rank."""
    return min(range(len(sizes)), key=lambda rank: (sizes[rank], rank))


def _split_group(group: dict[str, Any], params_per_rank: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
    """One shallow copy of ``group`` per rank, each holding that rank's parameters."""
    per_rank = []
    for params in params_per_rank:
        local_group = copy.copy(group)  # hyperparameters are shared values, not copied deeply
        local_group["params"] = params
        per_rank.append(local_group)
    return per_rank


def sorted_greedy_partition(param_groups: ParamGroups, world_size: int) -> list[ParamGroups]:
    """Partition ``param_groups`` over ``world_size`` ranks.

    Returns ``partition[rank]``: that rank's param groups, one per input group, in the
    input order, each a shallow copy of the input group with its own ``params`` list
    (largest first; possibly empty). See [Note: shared running sizes].
    """
    sizes = [0] * world_size  # running numel per rank, shared across groups
    partition: list[ParamGroups] = [[] for _ in range(world_size)]
    for group in param_groups:
        params_per_rank: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        # sorted() is stable: equal sizes keep their order in the group.
        for param in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
            rank = _least_loaded(sizes)
            params_per_rank[rank].append(param)
            sizes[rank] += param.numel()
        for rank, local_group in enumerate(_split_group(group, params_per_rank)):
            partition[rank].append(local_group)
    return partition


def manual_partition(
    param_groups: ParamGroups, params_per_rank: list[list[torch.Tensor]], world_size: int
) -> list[ParamGroups]:
    """The partition a user gives by hand (one group only), validated.

    Errors as in docs/behaviour.md §Z1.2: more than one group is a RuntimeError; a list
    of the wrong length or naming a parameter the optimizer does not hold, a ValueError.
    A subset of the parameters is allowed (the rest are simply never stepped).
    """
    if len(param_groups) != 1:
        raise RuntimeError("Specifying `params_per_rank` only supports a single parameter group")
    if len(params_per_rank) != world_size:
        raise ValueError("`params_per_rank` must have length equal to the world size")
    known = {id(p) for p in param_groups[0]["params"]}
    for params in params_per_rank:
        for param in params:
            if id(param) not in known:
                raise ValueError("Passing a new parameter in `params_per_rank` that was not passed into the ZeroRedundancyOptimizer constructor")
    per_rank = _split_group(param_groups[0], [list(params) for params in params_per_rank])
    return [[group] for group in per_rank]


def rank_numels(partition: list[ParamGroups]) -> list[int]:
    """Elements owned by each rank."""
    return [sum(p.numel() for group in groups for p in group["params"]) for groups in partition]


def imbalance(numels: Sequence[int]) -> float:
    """max / mean of the per-rank element counts: 1.0 is a perfect balance."""
    mean = sum(numels) / len(numels)
    return max(numels) / mean if mean > 0 else 1.0
