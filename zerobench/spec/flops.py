"""Model FLOPs per token, MFU and TFLOP/s per GPU, by torchtitan's formula.

[Note: model FLOPs]
torchtitan (``get_num_flop_per_token``) counts a token's training FLOPs as

    6 * N + 12 * layers * heads * head_dim * seq_len

where N is the parameter count without the embeddings (a lookup, not a matmul): 2 FLOPs
per parameter forward and 4 backward, plus attention's two matmuls (score and value),
2 FLOPs each per multiply-add, forward and twice that backward, over the whole sequence
(causal masking not discounted, recomputation not counted). MFU is the model FLOPs done
per second per GPU over the card's dense peak for the compute dtype (bf16 tensor cores
for bf16 cells, fp32 otherwise). These are the numbers torchtitan and PyTorch's FSDP2
PRs publish (35.9 % for Llama 3 8B on H100 in PR #129721), so a prediction and a GPU run
can be put beside them.

Defined for models with tokens and attention (gpt, llama); None for the others.
"""

from __future__ import annotations

import torch


def model_flops_per_token(cfg) -> int | None:
    """Training FLOPs per token of the workload's model (see the Note), or None."""
    if cfg.kind not in ("gpt", "llama"):
        return None
    from zerobench.spec.models import construct

    with torch.device("meta"):
        model = construct(cfg)
    embeddings = {id(p) for name, p in model.named_parameters() if name.startswith(("tok_emb.", "pos_emb."))}
    if getattr(cfg, "tie_embeddings", False):
        embeddings.discard(id(model.head.weight))  # the tied head is a matmul too
    params = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    head_dim = cfg.d_model // cfg.heads
    return 6 * params + 12 * cfg.layers * cfg.heads * head_dim * cfg.seq_len


def mfu_metrics(tokens_per_s_per_gpu: float | None, flops_per_token: int | None, peak_flops: float | None) -> dict:
    """``tflops_per_gpu`` and ``mfu`` (a fraction) from a rate of tokens per GPU; None where
    the model has no token FLOPs or the device no known peak."""
    if not tokens_per_s_per_gpu or not flops_per_token:
        return {"tflops_per_gpu": None, "mfu": None}
    flops = tokens_per_s_per_gpu * flops_per_token
    return {"tflops_per_gpu": flops / 1e12, "mfu": flops / peak_flops if peak_flops else None}
