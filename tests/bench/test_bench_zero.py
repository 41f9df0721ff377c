"""impl.zero hot paths: the stage-1 partition and the stage-2 shard math."""

from __future__ import annotations

import torch

from impl.zero.partition import rank_numels, sorted_greedy_partition
from impl.zero.sharded_param import ShardedParam
from impl.zero.stage2 import plan_gather_buckets


def _meta_params(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` parameters of GPT-like shapes on the meta device: sizes only, no memory."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(1024, 1024), (4096, 1024), (1024, 4096), (1024,), (4096,), (50304, 1024)]
    picks = torch.randint(len(shapes), (n,), generator=g).tolist()
    return [torch.empty(shapes[i], device="meta") for i in picks]


def test_sorted_greedy_partition(benchmark):
    groups = [{"params": _meta_params(600, seed=0), "lr": 1e-3}, {"params": _meta_params(200, seed=1), "lr": 0.0}]
    partition = benchmark(sorted_greedy_partition, groups, 8)
    numels = rank_numels(partition)
    assert sum(numels) == sum(p.numel() for g in groups for p in g["params"])
    assert max(numels) / (sum(numels) / 8) < 1.1


def test_stage2_shard_setup_and_buckets(benchmark):
    params = [torch.empty(s) for s in [(257, 129)] * 40 + [(4097,)] * 40]

    def setup_shards():
        shards = [ShardedParam(p, rank=1, world_size=4) for p in params]
        return shards, plan_gather_buckets(shards, bucket_cap_mb=1.0)

    shards, buckets = benchmark(setup_shards)
    assert sum(len(b) for b in buckets) == len(shards)


def test_stage2_reduce_scatter_inputs(benchmark):
    param = torch.empty(250_003)  # not divisible by world_size: exercises the padding
    shard = ShardedParam(param, rank=3, world_size=4)
    grad = torch.randn(250_003)
    chunks = benchmark(shard.reduce_scatter_inputs, grad)
    assert len(chunks) == 4 and chunks[3].numel() == shard.chunk_numel
