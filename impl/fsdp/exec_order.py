"""The recorded execution order of units: what to prefetch, and the order check.

As in PyTorch 1.13 (docs/behaviour.md §F4): the pre-forward order is recorded on the
first iteration and drives forward prefetch; the post-forward order is recorded every
iteration and, reversed, drives backward prefetch. Both prefetch one unit ahead.

On the first iteration each unit's pre-forward also checks that every rank is about to
all-gather the same unit: a rank that all-gathers in another order would otherwise
pair its collectives with the wrong ones on the other ranks and hang or corrupt data.
"""

from __future__ import annotations

import torch

from impl import comm


class ExecutionOrder:
    """Shared by every FSDP instance under one root. The instances are recorded and
    returned as their ``FSDPState`` (state.py); this class only compares identities."""

    def __init__(self):
        # First iteration's pre-forward order of the instances with a flat parameter.
        self.forward_order: list = []
        self._forward_index: dict[int, int] = {}  # id(instance) -> position in forward_order
        # True until the first iteration ends: record and check.
        self.is_first_iteration = True
        # This iteration's post-forward order; backward runs (roughly) in its reverse.
        self._post_forward: list = []
        self._post_forward_index: dict[int, int] = {}

    # -- forward -------------------------------------------------------------------

    def record_pre_forward(self, instance, unit, check: bool) -> None:
        """Record ``instance`` on the first iteration; with ``check`` (the module is in
        training mode), first check that every rank is at the same unit."""
        if not self.is_first_iteration or id(instance) in self._forward_index:
            return
        if unit.sharded and unit.handle.shard_world > 1 and check:
            self._check_same_across_ranks(unit, len(self.forward_order))
        self._forward_index[id(instance)] = len(self.forward_order)
        self.forward_order.append(instance)

    def next_forward(self, instance):
        """The instance whose forward came after ``instance``'s in the first iteration."""
        if self.is_first_iteration:
            return None
        i = self._forward_index.get(id(instance))
        if i is None or i + 1 >= len(self.forward_order):
            return None
        return self.forward_order[i + 1]

    @property
    def forward_pending_backward(self) -> bool:
        """Whether a forward ran since the last end of iteration."""
        return bool(self._post_forward)

    def record_post_forward(self, instance) -> None:
        self._post_forward_index[id(instance)] = len(self._post_forward)
        self._post_forward.append(instance)

    # -- backward ------------------------------------------------------------------

    def next_backward(self, instance):
        """The instance whose backward is expected after ``instance``'s: the one whose
        forward finished just before it did."""
        i = self._post_forward_index.get(id(instance))
        if not i:  # None, or the first to finish forward: nothing comes after it in backward
            return None
        return self._post_forward[i - 1]

    def end_iteration(self) -> None:
        if self.forward_order:
            self.is_first_iteration = False
        self._post_forward.clear()
        self._post_forward_index.clear()

    # -- the first-iteration check ---------------------------------------------------

    @staticmethod
    def _check_same_across_ranks(unit, position: int) -> None:
        group = unit.shard_group
        n = unit.handle.shard_world
        device = unit.handle.device  # NCCL only gathers device tensors
        mine = torch.tensor([position, unit.index, len(unit.handle.infos)], dtype=torch.int64, device=device)
        everyone = torch.empty(n * 3, dtype=torch.int64, device=device)
        comm.all_gather(everyone, mine, group=group, async_op=False)
        rows = everyone.view(n, 3).tolist()
        ranks = torch.distributed.get_process_group_ranks(group) if group is not None else list(range(n))
        first_rank, (_, first_index, first_count) = ranks[0], rows[0]
        for rank, (_, index, count) in zip(ranks[1:], rows[1:]):
            if count != first_count:
                raise RuntimeError(
                    f"Forward order differs across ranks: rank {first_rank} is all-gathering {first_count} "
                    f"parameters while rank {rank} is all-gathering {count} parameters (all-gather #{position})"
                )
            if index != first_index:
                raise RuntimeError(
                    f"Forward order differs across ranks: rank {first_rank} is all-gathering the unit with "
                    f"index {first_index} while rank {rank} is all-gathering the unit with index {index} "
                    f"(all-gather #{position})"
                )
