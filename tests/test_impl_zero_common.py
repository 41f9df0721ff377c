"""Shared fixtures of the impl.zero tests (a model, data, a single-process reference),
and the tests of the pure, communication-free parts: partitioning and validation.

The other test_impl_zero*.py files import the helpers from here.
"""

from __future__ import annotations

import pytest
import torch

# The first torch.optim optimizer a process builds imports torch._dynamo (3-6 s on this
# machine). Importing it here, in the parent, means the forked ranks inherit it instead
# of each paying for it in every world.
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from impl.zero.partition import (
    imbalance,
    manual_partition,
    rank_numels,
    sorted_greedy_partition,
)

GLOBAL_BATCH = 24  # divisible by world sizes 2 and 4, and by 2 micro-batches at each
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
}


class UnevenNet(nn.Module):
    """Parameters of very uneven sizes: ``big.weight`` (2048) is larger than all the
    others together; ``scale`` (3) is smaller than world size 4; ``frozen`` never trains."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(16, 128)
        self.mid = nn.Linear(128, 8)
        self.frozen = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(3))
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = F.relu(self.mid(F.relu(self.big(x))))
        return self.head(torch.tanh(self.frozen(h))) * self.scale.mean()


def make_model(seed: int = 0) -> UnevenNet:
    torch.manual_seed(seed)
    return UnevenNet()


def param_groups(model: UnevenNet, kind: str) -> list[dict]:
    """Two groups with different hyperparameters; the frozen layer sits in the second."""
    _, kwargs = OPTIMIZERS[kind]
    second = {"lr": kwargs["lr"] / 2}
    if kind == "adam":
        second["weight_decay"] = 1e-3
    return [
        {"params": [model.big.weight, model.big.bias, model.mid.weight]},
        {"params": [model.mid.bias, model.frozen.weight, model.frozen.bias, model.head.weight, model.head.bias, model.scale], **second},
    ]


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)) for _ in range(steps)]


def rank_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def reference_train(kind: str, data, model: UnevenNet | None = None, optimizer=None) -> tuple[UnevenNet, torch.optim.Optimizer]:
    """Single-process training on the global batches: what every engine must match."""
    model = model if model is not None else make_model()
    cls, kwargs = OPTIMIZERS[kind]
    optimizer = optimizer if optimizer is not None else cls(param_groups(model, kind), **kwargs)
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model, x, y).backward()
        optimizer.step()
    return model, optimizer


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def state_max_abs_diff(sd_a: dict, sd_b: dict) -> float:
    """Largest difference between two global optimizer states (same keys required)."""
    assert sd_a["state"].keys() == sd_b["state"].keys(), (sd_a["state"].keys(), sd_b["state"].keys())
    worst = 0.0
    for index, state in sd_a["state"].items():
        assert state.keys() == sd_b["state"][index].keys()
        for name, value in state.items():
            other = sd_b["state"][index][name]
            worst = max(worst, (torch.as_tensor(value, dtype=torch.float64) - torch.as_tensor(other, dtype=torch.float64)).abs().max().item())
    return worst


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
