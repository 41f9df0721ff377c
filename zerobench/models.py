"""The models workloads train, built deterministically from a seed.

Each model exposes ``blocks``: the modules an engine shards as separate units (FSDP
wraps each one; the root takes what is left, such as embeddings and the head).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerobench.workload import GPTConfig, MLPConfig, ModelConfig


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

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (batch, seq, vocab) logits


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The workload's model with weights drawn from ``seed`` (identical on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(cfg) if cfg.kind == "mlp" else GPT(cfg)
    return model.to(device)


def loss_fn(cfg: ModelConfig):
    """The training loss for the model kind, as ``fn(output, target) -> scalar``."""
    if cfg.kind == "mlp":
        return F.mse_loss

    def next_token(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return next_token


def samples_to_tokens(cfg: ModelConfig) -> int:
    """Tokens per sample, for tokens/s (0 for models without tokens)."""
    return cfg.seq_len if cfg.kind == "gpt" else 0
