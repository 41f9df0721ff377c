"""Model FLOPs per token and MFU by torchtitan's formula (zerobench/spec/flops.py)."""

from __future__ import annotations

import pytest

from zerobench.spec.flops import mfu_metrics, model_flops_per_token
from zerobench.spec.workload import parse_workload


def model(**table):
    return parse_workload({"model": table}).model


def test_llama3_8b_reproduces_the_published_mfu_of_pr_129721():
    """6 x (8.03B - the 0.525B-element embedding) + 12 x 32 layers x 32 heads x 128 x 8192;
    6,130 tokens/s per H100 is then the published 35.9 % of 989 TFLOP/s."""
    flops = model_flops_per_token(model(kind="llama", preset="llama3-8b"))
    assert flops == 6 * (8_030_261_248 - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
    out = mfu_metrics(6130, flops, 989e12)
    assert out["mfu"] == pytest.approx(0.359, abs=0.0005)
    assert out["tflops_per_gpu"] == pytest.approx(6130 * flops / 1e12)


def test_a_tied_head_counts_and_models_without_tokens_have_none():
    untied = model_flops_per_token(model(kind="llama", layers=2, d_model=64, heads=4, kv_heads=2, vocab=1000))
    tied = model_flops_per_token(model(kind="llama", layers=2, d_model=64, heads=4, kv_heads=2, vocab=1000,
                                       tie_embeddings=True))
    assert tied == untied  # the head's matmul is counted once either way
    assert model_flops_per_token(model(kind="mlp")) is None
    assert mfu_metrics(100.0, None, 1e12) == {"tflops_per_gpu": None, "mfu": None}
    gpt = model(kind="gpt", layers=2, d_model=64, heads=4, seq_len=32, vocab=100)
    blocks = 2 * (4 * 64 * 64 + 4 * 64 + 2 * 4 * 64 * 64 + 4 * 64 + 64 + 4 * 64)  # attn, mlp, biases, norms
    assert model_flops_per_token(gpt) == 6 * (blocks + 2 * 64 + 100 * 64) + 12 * 2 * 4 * 16 * 32
