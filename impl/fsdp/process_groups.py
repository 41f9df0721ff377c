"""Process groups for the sharding strategies: one group, or HYBRID_SHARD's pair."""

from __future__ import annotations

import os

import torch.distributed as dist

# Groups built automatically for HYBRID_SHARD, by (world size, shard size, default group). new_group is
# a collective over the whole world, so building them once per process also keeps every
# rank's calls in step when many FSDP instances are created (tests build dozens).
_hybrid_cache: dict[tuple, tuple] = {}


def default_shard_size(world_size: int) -> int:
    """HYBRID_SHARD's shard group size when no groups are given: the ranks of one node
    (``LOCAL_WORLD_SIZE``, as torchrun sets it) when that leaves at least two replicas,
    else the largest divisor of the world size that is at most half of it (4 -> 2x2,
    8 -> 4x2, 2 -> 1x2)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if 0 < local < world_size and world_size % local == 0:
        return local
    for d in range(world_size // 2, 0, -1):
        if world_size % d == 0:
            return d
    return 1


def hybrid_groups(process_group) -> tuple:
    """(shard_group, replicate_group) from a given pair, or built over the default group."""
    if process_group is not None:
        if not (isinstance(process_group, tuple) and len(process_group) == 2):
            raise ValueError(  # PyTorch 2.x's words, then ours
                "Expected process_group to be passed in as either None or Tuple[dist.ProcessGroup, "
                f"dist.ProcessGroup] but got {type(process_group)}: HYBRID_SHARD expects process_group to be None "
                "or a (shard_group, replicate_group) tuple"
            )
        shard, replicate = process_group
        if dist.get_world_size(shard) * dist.get_world_size(replicate) != dist.get_world_size():
            raise ValueError(
                "HYBRID_SHARD: shard group size x replicate group size must equal the world size, got "
                f"{dist.get_world_size(shard)} x {dist.get_world_size(replicate)} != {dist.get_world_size()}"
            )
        return shard, replicate
    world, rank = dist.get_world_size(), dist.get_rank()
    size = default_shard_size(world)
    key = (world, size, id(dist.distributed_c10d._get_default_group()))
    if key not in _hybrid_cache:
        shard_groups = [dist.new_group(list(range(r * size, (r + 1) * size))) for r in range(world // size)]
        replicate_groups = [dist.new_group(list(range(i, world, size))) for i in range(size)]
        _hybrid_cache[key] = (shard_groups, replicate_groups, size)
    shard_groups, replicate_groups, size = _hybrid_cache[key]
    return shard_groups[rank // size], replicate_groups[rank % size]


def groups_of_mesh(mesh, hybrid: bool):
    """The process group(s) of a ``device_mesh`` argument, as PyTorch 2.x reads it: a 1-D
    mesh's group, or for HYBRID_SHARD a 2-D mesh's ``(shard, replicate)`` pair (dim 1
    shards, dim 0 replicates)."""
    if hybrid:
        if mesh.ndim != 2:
            raise ValueError(f"Expected device_mesh to have ndim=2 but got {mesh.ndim}")
        return mesh.get_group(mesh_dim=1), mesh.get_group(mesh_dim=0)
    if mesh.ndim != 1:
        raise ValueError(f"device_mesh must be 1-D for a strategy other than HYBRID_SHARD, got ndim={mesh.ndim}")
    return mesh.get_group(mesh_dim=0)


def forget_cached_groups() -> None:
    """Drop the cached HYBRID_SHARD groups (call before destroying the default group)."""
    _hybrid_cache.clear()
