"""The communication-free parts of impl.zero: the sorted-greedy partition, the manual
partition's and the constructors' validation (docs/behaviour.md §Z1.1, §Z1.2), and the
stage-2 shard layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from impl.zero.partition import (
    imbalance,
    manual_partition,
    rank_numels,
    sorted_greedy_partition,
)

# -- partition (no communication) ------------------------------------------------------------


def _group(*numels):
    return {"params": [torch.zeros(n) for n in numels], "lr": 0.1}


def _numels(partition):
    return [[[p.numel() for p in g["params"]] for g in groups] for groups in partition]


def test_sorted_greedy_largest_first_ties_to_lowest_rank():
    partition = sorted_greedy_partition([_group(1, 5, 3, 3, 2)], world_size=2)
    # 5 -> r0 (5, 0); 3 -> r1 (5, 3); 3 -> r1 (5, 6); 2 -> r0 (7, 6); 1 -> r1 (7, 7)
    assert _numels(partition) == [[[5, 2]], [[3, 3, 1]]]


def test_running_sizes_shared_across_groups():
    partition = sorted_greedy_partition([_group(10), _group(4, 4)], world_size=2)
    # The second group avoids rank 0, which took the big parameter of the first.
    assert _numels(partition) == [[[10], []], [[], [4, 4]]]
    assert all(g["lr"] == 0.1 for groups in partition for g in groups)  # shallow copies keep hyperparameters


def test_parameters_never_split_and_every_rank_gets_every_group():
    partition = sorted_greedy_partition([_group(100, 1), _group(1)], world_size=4)
    assert [len(groups) for groups in partition] == [2, 2, 2, 2]
    assert sorted(n for groups in _numels(partition) for g in groups for n in g) == [1, 1, 100]
    assert rank_numels(partition) == [100, 1, 1, 0]
    assert imbalance(rank_numels(partition)) == pytest.approx(100 / (102 / 4))


def test_manual_partition_validation():
    group = _group(3, 2)
    a, b = group["params"]
    assert _numels(manual_partition([group], [[a], []], 2)) == [[[3]], [[]]]  # a subset is allowed
    with pytest.raises(RuntimeError, match="only supports a single parameter group"):
        manual_partition([group, _group(1)], [[a], [b]], 2)
    with pytest.raises(ValueError, match="must have length equal to the world size"):
        manual_partition([group], [[a, b]], 2)
    with pytest.raises(ValueError, match="Passing a new parameter"):
        manual_partition([group], [[a], [torch.zeros(2)]], 2)


# -- constructor validation (raises before any communication) ----------------------------------


def _constructors():
    from impl.zero import ZeroRedundancyOptimizer, ZeroStage2Optimizer

    return [ZeroRedundancyOptimizer, ZeroStage2Optimizer]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing the TorchScript functional optimizers
@pytest.mark.parametrize("cls", _constructors(), ids=lambda c: c.__name__)
def test_constructor_validation(cls):
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="should be an iterable of Tensors, but got"):
        cls(p, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="iterable of Tensors or dicts, but got"):
        cls(42, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        cls([p, {"params": [p]}], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="got an empty parameter list"):
        cls([], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="must have a 'params' key"):
        cls([{"lr": 0.1}], torch.optim.SGD, lr=0.1)
    sparse = torch.zeros(2, 2).to_sparse()
    with pytest.raises(ValueError, match="same dense type for all parameters but got"):
        cls([sparse, p], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="same dense type for all parameters but got both"):
        cls([p, nn.Parameter(torch.zeros(2, dtype=torch.float64))], torch.optim.SGD, lr=0.1)
    from torch.distributed.optim.functional_adam import _FunctionalAdam

    with pytest.raises(ValueError, match="Passing in a functional optimizer"):
        cls([p], _FunctionalAdam, lr=0.1)


# -- stage-2 shard math (no communication) -------------------------------------------------------


def test_sharded_param_chunks_cover_the_parameter_once():
    from impl.zero.sharded_param import ShardedParam

    for numel, world_size in [(10, 4), (3, 4), (8, 2), (1, 2)]:
        param = nn.Parameter(torch.arange(float(numel)))
        shards = [ShardedParam(param, rank, world_size) for rank in range(world_size)]
        assert all(s.chunk_numel == -(-numel // world_size) for s in shards)
        assert torch.equal(torch.cat([s.sharded for s in shards]), param.detach())  # each element once, in order
        shards[0].sharded.add_(100.0)  # the shard is a view: the parameter sees the update
        assert param[0].item() == 100.0
        chunks = shards[0].reduce_scatter_inputs(torch.ones(numel) * world_size)
        assert len(chunks) == world_size and all(c.numel() == shards[0].chunk_numel for c in chunks)
        assert torch.cat(chunks).sum().item() == numel  # divided by world_size; the padding is zeros


def test_sharded_param_needs_a_contiguous_parameter():
    from impl.zero.sharded_param import ShardedParam

    with pytest.raises(ValueError, match="contiguous"):
        ShardedParam(torch.zeros(4, 3).t(), rank=0, world_size=2)
