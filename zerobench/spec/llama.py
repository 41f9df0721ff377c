"""A Llama-family decoder written with torch.nn: what most people who pick a sharding
strategy train (Llama 2, arXiv 2307.09288; Llama 3, arXiv 2407.21783).

Pre-normalised blocks ``x + attn(rms(x))`` then ``x + ffn(rms(x))`` with RMSNorm,
rotary position embeddings (RoPE), grouped-query attention (``kv_heads`` key/value heads
shared by ``heads / kv_heads`` query heads each) through causal
``scaled_dot_product_attention``, and a SwiGLU feed-forward ``w2(silu(w1 x) * w3 x)``.
No projection has a bias. The head is untied unless ``tie_embeddings``.

Every op is shape-driven (no Python branch on a tensor's values), so the model builds
and runs on the meta device and under FakeTensorMode, which ``zerobench estimate`` and
the coming ``predict`` use. See [Note: attention memory] for what SDPA holds.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerobench.spec.workload import LlamaConfig


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (``F.rms_norm``, which reduces in fp32 for bf16 input)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (seq_len, head_dim), computed in fp32: the
    angles of frequency i fill columns i and i + head_dim / 2."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs).repeat(1, 2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (b, heads, t, head_dim) by the angles, pairing element i with element
    i + head_dim / 2 (the "rotate half" layout of GPT-NeoX and Hugging Face's Llama: the
    same rotation as Meta's interleaved pairs, up to a fixed permutation of wq and wk)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with ``kv_heads`` key/value heads (GQA; MHA when equal to heads)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.d_model // cfg.heads
        self.wq = nn.Linear(cfg.d_model, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # [Note: attention memory]
        # Each key/value head serves heads / kv_heads query heads: repeated here (as Meta's
        # reference does) so that every backend's fused kernel takes them, CPU's flash
        # kernel included. SDPA then dispatches to a fused kernel (flash or memory-efficient
        # on a GPU, _scaled_dot_product_flash_attention_for_cpu on a CPU, in fp32 and bf16):
        # it returns the output and a logsumexp of (b, heads, t) and saves those for
        # backward, never a t x t matrix. The tracker and fake tensors see exactly that
        # (docs/models.md, "Attention memory").
        group = self.heads // self.kv_heads
        if group > 1:
            k = k[:, :, None].expand(b, self.kv_heads, group, t, self.head_dim).reshape(b, self.heads, t, -1)
            v = v[:, :, None].expand(b, self.kv_heads, group, t, self.head_dim).reshape(b, self.heads, t, -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, head_dim)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer, arXiv 2002.05202)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """One decoder layer: x + attn(norm(x)), then x + ffn(norm(x)). A sharding unit."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = GroupedQueryAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token embedding, ``layers`` LlamaBlocks (``blocks``, the sharding units), RMSNorm, head."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Normal(0, 0.02) everywhere, the output projections of each block scaled by
        1/sqrt(2 * layers) (GPT-2's residual scaling); norms at one."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = 0.02 / (2 * self.cfg.layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
            nn.init.normal_(p, std=std)

    def forward(self, idx):
        t = idx.shape[1]
        # Computed each step (cheap) rather than kept as buffers: nothing for an engine to
        # shard, broadcast or cast, and the same on every device, meta and fake included.
        x = self.tok_emb(idx)
        cos, sin = rope_tables(self.cfg.d_model // self.cfg.heads, t, self.cfg.rope_theta)
        cos, sin = cos.to(idx.device, x.dtype), sin.to(idx.device, x.dtype)  # rotated in x's dtype, as HF does
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))  # (batch, seq, vocab)
        # loss_dtype "fp32": upcast here, as torchtitan's model does, so that the bf16 logits
        # are freed at once rather than held beside their fp32 copy through the loss.
        return logits.float() if self.cfg.loss_dtype == "fp32" else logits
