"""Synthetic batches: one global batch per step, generated from a seed, sliced by rank.

Because the global batch for step ``s`` depends only on the seed and ``s``, every world
size, every engine and the single-process reference train on exactly the same data,
and their losses can be compared step by step.
"""

from __future__ import annotations

import torch

from zerobench.spec.workload import ModelConfig


def global_batch(cfg: ModelConfig, global_batch_size: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for the whole world at ``step``, on CPU."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if getattr(cfg, "batch", ""):  # a user model's own batches (zerobench/spec/user_models.py)
        from zerobench.spec.user_models import call_user, checked_batch, import_callable

        fn = import_callable("model.batch", cfg.batch)
        return checked_batch("model.batch", cfg.batch, call_user("model.batch", cfg.batch, fn, global_batch_size, gen))
    if cfg.kind == "mlp":
        inputs = torch.randn(global_batch_size, cfg.width, generator=gen)
        targets = torch.randn(global_batch_size, cfg.width, generator=gen)
        return inputs, targets
    tokens = torch.randint(0, cfg.vocab, (global_batch_size, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def rank_batch(cfg: ModelConfig, batch_size: int, world_size: int, rank: int, seed: int, step: int,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice (``batch_size`` samples) of the global batch at ``step``."""
    inputs, targets = global_batch(cfg, batch_size * world_size, seed, step)
    rows = slice(rank * batch_size, (rank + 1) * batch_size)
    return inputs[rows].to(device), targets[rows].to(device)
