"""``overlap_with_ddp=True``: what ZeroRedundancyOptimizer knows about DDP's buckets.

With overlap the optimizer step does not run in ``step()``: it runs inside DDP's
communication hook (``impl/zero/ddp_hooks.py``), bucket by bucket, as soon as a bucket's
gradients are all-reduced (PyTorch 1.13's contract, docs/behaviour.md §Z1.8). The partition
therefore follows DDP's gradient buckets instead of the sorted-greedy one: each bucket
(or, with ``shard_buckets``, each contiguous run of a bucket) is assigned to one rank,
that rank's functional optimizer steps it, and it broadcasts the updated parameters.

DDP only fixes its buckets when it rebuilds them, at the start of the second forward
(third with ``static_graph=True``), so the optimizer goes through three states
(``OverlapStatus``): the hook does nothing while DDP has not rebuilt; in the first
iteration after the rebuild it records every bucket's parameters; at bucket 0 of the
next iteration it builds the assignment, the flat per-assignment tensors and the
local functional optimizer, and from then on steps. The first two iterations (three
with a static graph) therefore update nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


class OverlapStatus(enum.IntEnum):
    """Where the deferred initialization is (docs/behaviour.md §Z1.8)."""

    UNINITIALIZED = 0
    """DDP has not rebuilt its buckets yet: the hook only reduces."""
    DDP_HAS_REBUILT_BUCKETS = 1
    """DDP's buckets are final: this iteration records each bucket's parameters."""
    INITIALIZED = 2
    """Assignment, flat tensors and local optimizer exist: the hook steps."""


@dataclass
class BucketAssignment:
    """The parameters of one DDP bucket (or of a contiguous run of it) owned by one rank.

    ``offset``: index of the first of ``parameters`` in the bucket's parameter list (and
    so in its gradient list). ``tensor``: after initialization, one flat tensor whose
    views the parameters' ``.data`` become; the owner broadcasts it after stepping.
    """

    bucket_index: int
    parameters: list[torch.Tensor]
    offset: int
    tensor: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.parameters) == 0:
            raise ValueError("Empty bucket assignment")

    @property
    def device(self) -> torch.device:
        return self.parameters[0].device  # DDP keeps a bucket on one device


@dataclass
class OverlapInfo:
    """The overlap state of one ZeroRedundancyOptimizer (torch's ``_overlap_info``).

    Set once per bucket rebuild: ``params_per_bucket``, ``params_per_rank`` (the
    partition, grouped by increasing bucket index), ``offsets`` (bucket index -> index
    of that bucket's first parameter in this rank's list), ``assigned_ranks_per_bucket``,
    ``num_bucket_assignments``, ``total_size`` (with ``shard_buckets``). Per iteration:
    ``broadcast_handles``, ``bucket_indices_seen``, ``bucket_index_to_future``,
    ``bucket_index_to_bucket``.
    """

    world_size: int
    status: OverlapStatus = OverlapStatus.UNINITIALIZED
    shard_buckets: bool = False
    params_per_bucket: list[list[torch.Tensor]] = field(default_factory=list)
    params_per_rank: list[list[torch.Tensor]] = field(default_factory=list)
    offsets: dict[int, int] = field(default_factory=dict)
    assigned_ranks_per_bucket: list[set[int]] = field(default_factory=list)
    num_bucket_assignments: int = 0
    total_size: int | None = None
    broadcast_handles: list[Any] = field(default_factory=list)
    bucket_indices_seen: list[int] = field(default_factory=list)
    bucket_index_to_future: dict[int, Any] = field(default_factory=dict)
    bucket_index_to_bucket: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.params_per_rank:
            self.params_per_rank = [[] for _ in range(self.world_size)]

    def wait_for_broadcasts(self) -> None:
        """Wait for this iteration's broadcasts (one per bucket assignment) and clear them."""
        if len(self.broadcast_handles) != self.num_bucket_assignments:
            raise AssertionError(
                f"Missing at least one broadcast handle: {len(self.broadcast_handles)} of "
                f"{self.num_bucket_assignments}"
            )
        for handle in self.broadcast_handles:
            handle.wait()
        self.broadcast_handles.clear()

    def clear_per_iter_info(self) -> None:
        self.bucket_indices_seen.clear()
        self.bucket_index_to_future.clear()
        self.bucket_index_to_bucket.clear()


def assign_buckets(info: OverlapInfo, rank: int) -> list[dict[int, BucketAssignment]]:
    """``assignments[r][bucket_index]``: what rank ``r`` steps; fills ``info``'s
    partition fields (``rank`` is this process's group rank, for ``offsets``).

    Without ``shard_buckets`` bucket *i* goes wholly to rank *i* mod world size. With it,
    the threshold is total numel / world size; buckets are visited smallest first and cut
    into contiguous runs just before the parameter that would reach the threshold (a run
    is never empty), each run going to the least-loaded rank not already holding part of
    that bucket.
    """
    world = info.world_size
    assignments: list[dict[int, BucketAssignment]] = [{} for _ in range(world)]
    info.params_per_rank = [[] for _ in range(world)]
    info.offsets = {}
    info.num_bucket_assignments = 0
    info.assigned_ranks_per_bucket = [set() for _ in info.params_per_bucket]

    def assign(bucket_index: int, params: list[torch.Tensor], offset: int, owner: int) -> None:
        assignments[owner][bucket_index] = BucketAssignment(bucket_index, params, offset)
        if owner == rank:
            info.offsets[bucket_index] = len(info.params_per_rank[owner])
        info.params_per_rank[owner].extend(params)
        info.assigned_ranks_per_bucket[bucket_index].add(owner)
        info.num_bucket_assignments += 1

    if not info.shard_buckets:
        for bucket_index, params in enumerate(info.params_per_bucket):
            if not params:
                raise AssertionError("Empty bucket")
            assign(bucket_index, params, 0, bucket_index % world)
        return assignments

    if info.total_size is None:
        raise AssertionError("`total_size` was not computed")
    threshold = info.total_size / world
    size_per_rank = [0] * world

    def least_loaded(disallowed: set[int]) -> int:
        candidates = [r for r in range(world) if r not in disallowed]
        if not candidates:
            raise AssertionError("All indices are disallowed")
        return min(candidates, key=lambda r: (size_per_rank[r], r))

    by_size = sorted(enumerate(info.params_per_bucket), key=lambda item: sum(p.numel() for p in item[1]))
    for bucket_index, params in by_size:
        if not params:
            raise AssertionError("Empty bucket")
        start, size = 0, 0
        for i, param in enumerate(params):
            if size + param.numel() >= threshold and i > start:
                owner = least_loaded(info.assigned_ranks_per_bucket[bucket_index])
                assign(bucket_index, params[start:i], start, owner)
                size_per_rank[owner] += size
                start, size = i, 0
            size += param.numel()
        owner = least_loaded(info.assigned_ranks_per_bucket[bucket_index])
        assign(bucket_index, params[start:], start, owner)
        size_per_rank[owner] += size
    return assignments


@torch.no_grad()
def build_assignment_tensors(assignments: list[dict[int, BucketAssignment]]) -> None:
    """Give every assignment (on every rank: all of them take part in its broadcast) one
    flat tensor and make its parameters' ``.data`` views of it."""
    for per_rank in assignments:
        for assignment in per_rank.values():
            for param in assignment.parameters:
                if not param.requires_grad:
                    raise AssertionError(
                        "Model parameter corresponding to a gradient in a DDP bucket should require a gradient"
                    )
            numel = sum(p.numel() for p in assignment.parameters)
            if numel <= 0:
                raise AssertionError("Empty bucket")
            tensor = torch.empty(numel, dtype=assignment.parameters[0].dtype, device=assignment.device)
            offset = 0
            for param in assignment.parameters:
                view = tensor[offset : offset + param.numel()]
                view.copy_(param.data.reshape(-1))
                param.data = view.view_as(param.data)
                offset += param.numel()
            assignment.tensor = tensor
