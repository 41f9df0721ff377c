"""The recorded execution order of units: what to prefetch, and the order check.

As in PyTorch 1.13 (docs/behaviour.md §F4): the pre-forward order is recorded on the
first iteration and drives forward prefetch; the post-forward order is recorded every
iteration and, reversed, drives backward prefetch. Both prefetch one unit ahead.

On the first iteration each unit's pre-forward also checks that every rank is about to
all-gather the same unit: a rank that all-gathers in another order would otherwise
pair its collectives with the wrong ones on the other ranks and hang or corrupt data.

[Note: order check after the first iteration]
PyTorch's FSDP1 compares later iterations with the first only under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, and only locally: it warns "Forward order differs
from that of the first iteration on rank R. Collectives are unchecked and may give
incorrect results or hang" and carries on. Ranks that took different paths then pair
their collectives silently when the sizes happen to agree (its own test relies on
that), and hang until the backend's timeout when they do not.
Here every training-mode pre-forward of a sharded unit warns as FSDP1 does (once,
always, not only under DETAIL) when this rank's order departs from the first
iteration's, and all-reduces the shard size it is about to all-gather over the unit's
group, before that all-gather (max and max of the negation: equal when every rank agrees).
Ranks at different units whose all-gathers have the same size carry on, as FSDP1
does; ranks whose all-gathers would not match all raise the same RuntimeError instead
of hanging. The price is one 16-byte all-reduce per unit and forward.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

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
        # Later iterations: pre-forwards so far this iteration, and whether the
        # departure from the first iteration's order was already reported.
        # See [Note: order check after the first iteration].
        self._position = 0
        self._warned = False
        # This iteration's post-forward order; backward runs (roughly) in its reverse.
        self._post_forward: list = []
        self._post_forward_index: dict[int, int] = {}

    # -- forward -------------------------------------------------------------------

    def record_pre_forward(self, instance, unit, check: bool) -> None:
        """Record ``instance`` on the first iteration; with ``check`` (the module is in
        training mode), first check that every rank is at the same unit, on every
        iteration (See [Note: order check after the first iteration])."""
        checked = check and unit.sharded and unit.handle.shard_world > 1
        if self.is_first_iteration:
            if id(instance) in self._forward_index:
                return
            if checked:
                self._check_same_across_ranks(unit, len(self.forward_order))
            self._forward_index[id(instance)] = len(self.forward_order)
            self.forward_order.append(instance)
            return
        position, self._position = self._position, self._position + 1
        if not checked:
            return
        expected = self.forward_order[position] if position < len(self.forward_order) else None
        if expected is not instance and not self._warned:
            self._warned = True
            what = (f"Expected to all-gather the unit with index {expected.unit.index} but trying to all-gather "
                    f"the unit with index {unit.index}") if expected is not None else (
                    f"Expected to not all-gather any more parameters in the forward but trying to all-gather the "
                    f"unit with index {unit.index}")
            warnings.warn(
                f"Forward order differs from that of the first iteration on rank {dist.get_rank()}. Collectives "
                f"are unchecked and may give incorrect results or hang.\n{what}\n(impl.fsdp checks that the "
                "all-gathers of every rank have the same size, and raises instead of hanging when they do not.)",
                stacklevel=2,
            )
        self._check_sizes_across_ranks(unit, position)

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
        self._position = 0
        self._post_forward.clear()
        self._post_forward_index.clear()

    # -- the checks ---------------------------------------------------------------

    @staticmethod
    def _check_sizes_across_ranks(unit, position: int) -> None:
        """Later iterations: raise on every rank if the all-gathers about to be issued
        differ in size (they would hang). See [Note: order check after the first iteration]."""
        group = unit.shard_group
        numel = unit.handle.shard_numel
        agree = torch.tensor([numel, -numel], dtype=torch.int64, device=unit.handle.device)
        comm.all_reduce(agree, op=dist.ReduceOp.MAX, group=group, async_op=False)
        if agree[0] != -agree[1]:
            raise RuntimeError(
                f"Forward order differs across ranks: at all-gather #{position} of this iteration the ranks are "
                f"about to all-gather shards of different sizes (between {int(-agree[1])} and {int(agree[0])} "
                f"elements; this rank: the unit with index {unit.index}, {numel}). The collectives would hang; "
                "every rank must run the FSDP units in the same order."
            )

    @staticmethod
    def _check_same_across_ranks(unit, position: int) -> None:
        group = unit.shard_group
        n = unit.handle.shard_world
        device = unit.handle.device  # NCCL only reduces device tensors
        # One small all-reduce says whether all ranks agree (max == -max(-x)); only
        # then, to name the ranks, an all-gather.
        index, count = unit.index, len(unit.handle.infos)
        agree = torch.tensor([index, -index, count, -count], dtype=torch.int64, device=device)
        comm.all_reduce(agree, op=dist.ReduceOp.MAX, group=group, async_op=False)
        if agree[0] == -agree[1] and agree[2] == -agree[3]:
            return
        mine = torch.tensor([position, index, count], dtype=torch.int64, device=device)
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
