"""A user model for the ``[model] factory`` route (tests/test_models.py, tests/test_e2e_models.py):
zerobench knows nothing of these classes; the workload names them."""

import torch
import torch.nn as nn


class ToyBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ToyLM(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(ToyBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build(vocab: int, seq_len: int, width: int = 32, depth: int = 2) -> nn.Module:
    """Token ids of ``vocab`` in, logits out (seq_len is the harness's; the model needs none)."""
    return ToyLM(vocab, width, depth)


class Regressor(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.Sequential(ToyBlock(width), ToyBlock(width))

    def forward(self, x):
        return self.layers(x)


def build_regressor(width: int = 16) -> nn.Module:
    return Regressor(width)


def regression_batch(batch_size: int, generator: torch.Generator):
    inputs = torch.randn(batch_size, 16, generator=generator)
    return inputs, inputs.flip(-1)


def l1_loss(output, target):
    return (output - target).abs().mean()


def not_a_module(**kwargs):
    return {"width": 3}
