"""The models workloads train, built deterministically from a seed.

One front door for ``zerobench run``, ``estimate`` and ``predict``: :func:`build_for_cell`
is a plain function of the resolved workload's model table, the seed, the device and
the cell's ``activation_checkpointing``; it returns the model and its sharding units
(FSDP wraps each one; the root takes what is left, such as embeddings and the head).
Our own models (MLP, GPT here, Llama in zerobench/spec/llama.py) expose their units as
``blocks``; a user's model names their classes (``wrap``, zerobench/spec/user_models.py).
Every model builds on the meta device and under FakeTensorMode.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerobench.spec.checkpointing import apply_activation_checkpointing
from zerobench.spec.workload import GPTConfig, MLPConfig, ModelConfig


class MLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return F.relu(self.linear(x))


class MLP(nn.Module):
    """``depth`` Linear+ReLU blocks and a linear head; inputs and outputs are ``width`` wide."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(cfg.width) for _ in range(cfg.depth))
        self.head = nn.Linear(cfg.width, cfg.width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, d/heads)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer with learned positions and an untied head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.loss_dtype = cfg.loss_dtype

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (batch, seq, vocab)
        return logits.float() if self.loss_dtype == "fp32" else logits  # as in llama.py


def construct(cfg: ModelConfig) -> nn.Module:
    """The workload's model, initialised from the current RNG state on the current
    default device (``with torch.device("meta")``: shapes only)."""
    if cfg.kind == "mlp":
        return MLP(cfg)
    if cfg.kind == "gpt":
        return GPT(cfg)
    if cfg.kind == "llama":
        from zerobench.spec.llama import Llama

        return Llama(cfg)
    from zerobench.spec import user_models

    if cfg.kind == "hf":
        return user_models.build_hf_model(cfg)
    return user_models.build_factory_model(cfg)


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str | None = "cpu") -> nn.Module:
    """The workload's model with weights drawn from ``seed`` (identical on every rank),
    moved to ``device`` (None: left where it was built, as under FakeTensorMode)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = construct(cfg)
    return model if device is None else model.to(device)


def sharding_units(model: nn.Module, cfg: ModelConfig) -> list[nn.Module]:
    """The modules an engine shards as separate units, in forward order."""
    if cfg.kind in ("mlp", "gpt", "llama"):
        return list(model.blocks)
    from zerobench.spec import user_models

    if cfg.kind == "hf":
        return user_models.units_by_class(model, user_models.hf_unit_classes(model, cfg))
    return user_models.units_by_class(model, tuple(cfg.wrap))


def build_for_cell(cfg: ModelConfig, seed: int, device: torch.device | str | None = "cpu",
                   activation_checkpointing: str = "none") -> tuple[nn.Module, list[nn.Module]]:
    """(model, sharding units) for one cell: the seeded model with its units wrapped for
    activation checkpointing (zerobench/spec/checkpointing.py), ready for ``Engine.wrap``."""
    model = build_model(cfg, seed, device)
    units = apply_activation_checkpointing(model, sharding_units(model, cfg), activation_checkpointing)
    return model, units


def loss_fn(cfg: ModelConfig):
    """The training loss for the model kind, as ``fn(output, target) -> scalar``."""
    name = getattr(cfg, "loss", "mse" if cfg.kind == "mlp" else "cross_entropy")
    if name == "mse":
        return F.mse_loss
    if name != "cross_entropy":
        from zerobench.spec.user_models import checked_loss, import_callable

        return checked_loss("model.loss", name, import_callable("model.loss", name))

    if getattr(cfg, "loss_dtype", "model") == "fp32":
        def next_token_fp32(logits, targets):  # the model upcast them already (llama.py); a no-op then
            return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

        return next_token_fp32

    def next_token(logits, targets):
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())

    return next_token


def samples_to_tokens(cfg: ModelConfig) -> int:
    """Tokens per sample, for tokens/s (0 for models without tokens)."""
    if cfg.kind == "mlp" or getattr(cfg, "batch", ""):
        return 0
    return cfg.seq_len
