"""Models, data and the single-process reference for the impl.zero tests.

Every distributed test compares against single-process training on the same global
batch: each rank trains on its slice, and the averaged gradient equals the full batch's.
"""

from __future__ import annotations

import torch

# The first torch.optim optimizer a process builds imports torch._dynamo (3-6 s on this
# machine). Importing it here, in the parent, means the forked ranks inherit it instead
# of each paying for it in every world.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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


def average_grads(model: nn.Module, world_size: int) -> None:
    """What DDP does for stage 1: every rank ends backward with the mean gradient."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size
