"""The caching-allocator model's capacity and settings (zerobench/instruments/vgpu/allocator.py,
alloc_conf.py): memory held outside it, ``expandable_segments`` and ``max_split_size_mb``,
and what an out-of-memory report says."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerobench.instruments.vgpu import GpuPreset, HostPreset, VirtualGpu
from zerobench.instruments.vgpu.alloc_conf import AllocatorConfig

MiB = 2**20
HOST = HostPreset("toy", dispatch_s=1e-6, launch_s=1e-6)


def gpu(memory_mib: int, context_mib: int = 0, nccl_mib: int = 0, alloc_conf: str | None = None) -> VirtualGpu:
    preset = GpuPreset("toy", memory_bytes=memory_mib * MiB, peak_flops={torch.float32: 1e12},
                       hbm_bytes_per_s=1e12, context_bytes=context_mib * MiB, nccl_bytes_per_group=nccl_mib * MiB)
    return VirtualGpu(gpu=preset, host=HOST, alloc_conf=alloc_conf)


def empty(mib: int) -> torch.Tensor:
    return torch.empty(mib * MiB, dtype=torch.uint8)


def test_alloc_conf_reads_pytorch_syntax_and_refuses_what_is_not_modelled():
    conf = AllocatorConfig.parse("expandable_segments:True,max_split_size_mb:512")
    assert conf.expandable_segments and conf.max_split_size == 512 * MiB
    assert conf.describe() == "expandable_segments:True,max_split_size_mb:512"
    assert AllocatorConfig.parse("") == AllocatorConfig() == AllocatorConfig.parse(None)
    with pytest.raises(ValueError, match=r"'garbage_collection_threshold' is not modelled .*"
                                         r"allowed: expandable_segments, max_split_size_mb"):
        AllocatorConfig.parse("garbage_collection_threshold:0.6")
    with pytest.raises(ValueError, match=r"expandable_segments:yes is not allowed \(allowed: True, False\)"):
        AllocatorConfig.parse("expandable_segments:yes")
    with pytest.raises(ValueError, match=r"max_split_size_mb:8 is not allowed \(allowed: an int > 20"):
        AllocatorConfig.parse("max_split_size_mb:8")


def test_the_cuda_context_is_not_reservable():
    """100 MiB card, 30 MiB context: 60 MiB fits, a second 60 MiB does not, and the report
    gives what the allocator may hold and the figure it needed."""
    g = gpu(100, context_mib=30)
    with g:
        keep = empty(60)
        with pytest.raises(torch.OutOfMemoryError, match=r"0.07 GiB the allocator may reserve.*it needed 0.12 GiB"):
            empty(60)
        del keep
    assert g.allocator.failed_request_bytes == 60 * MiB


def test_each_communicator_takes_its_nccl_buffers_from_the_card(fake_world):
    g = gpu(200, context_mib=10, nccl_mib=40)
    with g:
        assert g.allocator.capacity == 190 * MiB
        x, out = torch.empty(1024), torch.empty(4096)
        dist.all_gather_into_tensor(out, x)
        dist.all_gather_into_tensor(out, x)  # the same group: its communicator exists
        assert g.allocator.capacity == 150 * MiB and g.allocator.outside_bytes == 40 * MiB
        pair = dist.new_group([0, 1])
        dist.all_reduce(x, group=pair)
        assert g.allocator.capacity == 110 * MiB


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield 4
    dist.destroy_process_group()


def fragment() -> list:
    """A 100 MiB segment cut into three 30 MiB blocks (and 10 MiB left), the first and
    the third freed: 70 MiB free in it, in holes of 30 and 40 MiB, and one live block
    keeping the segment from being released."""
    whole = empty(100)
    del whole  # cached: the next requests split it
    blocks = [empty(30) for _ in range(3)]
    return [blocks[1]]


def test_fragmentation_runs_out_where_expandable_segments_do_not():
    """On a 130 MiB card a 50 MiB request fits no hole. The plain allocator needs a new
    50 MiB segment: 100 + 50 reserved is too much, and releasing whole free segments
    frees nothing, so it runs out of memory. With expandable segments the free block at
    the segment's end grows by the 10 MiB it lacks."""
    plain = gpu(130)
    with plain:
        keep = fragment()
        with pytest.raises(torch.OutOfMemoryError):
            empty(50)
        del keep
    assert plain.memory_stats()["num_alloc_retries"] == 1

    grown = gpu(130, alloc_conf="expandable_segments:True")
    with grown:
        keep = fragment()
        empty(50)
        stats = grown.memory_stats()
        del keep
    assert stats["num_alloc_retries"] == 0 and stats["num_ooms"] == 0
    assert stats["segment.all.current"] == 1 and stats["reserved_bytes.all.current"] == 110 * MiB


def test_expandable_segments_unmap_free_blocks_when_memory_runs_short():
    g = gpu(130, alloc_conf="expandable_segments:True")
    with g:
        blocks = [empty(30) for _ in range(4)]  # one segment, 120 MiB mapped
        del blocks[0], blocks[1]  # the first and the third: holes of 30 MiB
        empty(50)  # appended: 170 MiB would be mapped, so the holes are unmapped first
        stats = g.memory_stats()
        del blocks
    assert stats["num_alloc_retries"] == 1 and stats["reserved_bytes.all.current"] == 110 * MiB


def test_expandable_segments_grow_the_free_block_at_their_end():
    g = gpu(1000, alloc_conf="expandable_segments:True")
    with g:
        a = empty(100)
        b = empty(100)
        del b  # the end of the segment is free
        c = empty(150)  # grows that free block by 50 MiB instead of mapping 150 more
        stats = g.memory_stats()
        assert stats["reserved_bytes.all.current"] == 250 * MiB
        del a, c
        g.empty_cache()
        assert g.memory_stats()["reserved_bytes.all.current"] == 0


def test_max_split_size_keeps_small_requests_out_of_oversize_blocks():
    """A freed 100 MiB block is oversize under max_split_size_mb:64: a 30 MiB request
    takes a new segment instead of splitting it; without the setting it splits it."""
    plain = gpu(1000)
    with plain:
        big = empty(100)
        del big
        small = empty(30)
        assert plain.memory_stats()["reserved_bytes.all.current"] == 100 * MiB
        del small
    limited = gpu(1000, alloc_conf="max_split_size_mb:64")
    with limited:
        big = empty(100)
        del big
        small = empty(30)
        assert limited.memory_stats()["reserved_bytes.all.current"] == 130 * MiB
        del small


def test_max_split_size_frees_cached_oversize_blocks_before_retrying():
    """Out of room for a new segment: the cached oversize block goes first, without the
    retry (and device synchronisation) that frees the whole cache."""
    g = gpu(200, alloc_conf="max_split_size_mb:64")
    with g:
        big = empty(100)
        del big  # cached, oversize
        keep = empty(40)
        more = empty(120)  # 100 cached + 40 + 120 > 200: the cached 100 MiB is released
        stats = g.memory_stats()
        del keep, more
    assert stats["num_alloc_retries"] == 0 and stats["reserved_bytes.all.current"] == 160 * MiB


@pytest.mark.parametrize("deferred", [False, True])
def test_a_model_built_as_users_do_holds_only_its_shards(fake_world, deferred):
    """[Note: build as users do]: built and wrapped with fully_shard under ``deferred()``
    (torchtitan's meta-device build, then ``to_empty``), a rank's device never held the
    unsharded parameters: reserved memory is its shards (a quarter of 8 units at 4 ranks),
    not the whole model built and then left cached."""
    import contextlib

    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    units, width = 8, 1024
    unit = width * width * 4
    mesh = init_device_mesh("cpu", (fake_world,))
    g = gpu(1000)
    with g:
        with g.deferred() if deferred else contextlib.nullcontext():
            model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(units)])
            for block in model:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        materialized = g.materialize()
        reserved = g.memory_stats()["reserved_bytes.all.peak"]
    if deferred:
        assert materialized == units * unit // fake_world
        assert reserved <= units * unit // fake_world + 20 * MiB
    else:
        assert materialized == 0 and reserved >= units * unit
