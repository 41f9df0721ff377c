"""Depth extrapolation (zerobench/whatif/estimate/depth.py): a deep model's estimate from two
shallow copies equals the full-depth estimate, and ZeRO-1's optimizer state is the
full-depth partition's."""

import pytest

from zerobench.spec.matrix import expand
from zerobench.spec.workload import parse_workload
from zerobench.whatif.estimate import depth
from zerobench.whatif.estimate.job import estimate_one

LAYERS = 5
WORKLOAD = parse_workload({
    "model": {"kind": "llama", "layers": LAYERS, "d_model": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 64,
              "vocab": 256, "seq_len": 16},
    "data": {"batch_size": 2},
    "run": {"memory_warmup_steps": 1},
    "optimizer": {"kind": "adamw"},
    "matrix": {"engine": ["torch-fsdp2", "torch-zero1"], "world_size": [4], "dtype": ["bf16"],
               "activation_checkpointing": ["full"]},
})


@pytest.mark.slow
def test_extrapolated_estimate_equals_the_full_depth_one():
    engine = "torch-fsdp2"
    (cell,) = [c for c in expand(WORKLOAD) if c.engine == engine]
    low, high = depth.depths(WORKLOAD, cell.opts)
    assert (low, high) == (3, 4)
    full = estimate_one(WORKLOAD, cell, 0, fake=True)
    rows = [estimate_one(depth.at_depth(WORKLOAD, n), cell, 0, fake=True) for n in (low, high)]
    guess = depth.zero1_optimizer_correction(WORKLOAD, engine, 4, 0, depth.extrapolate(*rows, low, high, LAYERS))
    for key in ("peak_mem_bytes", "state_params_numel", "state_grads_numel", "state_optim_numel"):
        assert guess[key] == pytest.approx(full[key], rel=0.005), key
    assert guess["depth_from"] == "3,4"


def test_zero1_partition_is_not_linear_in_depth_and_is_corrected():
    """Rank 0 of ZeRO-1 owns whole parameters: with the embedding and head (256 x 32 each)
    much larger than a block's tensors, straight extrapolation misplaces its share. (Its
    peak is not checked here: in this tiny model it falls in the optimizer step, whose
    temporaries follow which parameters rank 0 owns; docs/models.md.)"""
    (cell,) = [c for c in expand(WORKLOAD) if c.engine == "torch-zero1"]
    rows = [estimate_one(depth.at_depth(WORKLOAD, n), cell, 0, fake=True) for n in (3, 4)]
    straight = depth.extrapolate(*rows, 3, 4, LAYERS)
    corrected = depth.zero1_optimizer_correction(WORKLOAD, "torch-zero1", 4, 0, straight)
    full = estimate_one(WORKLOAD, cell, 0, fake=True)
    assert straight["state_optim_numel"] != full["state_optim_numel"]
    assert corrected["state_optim_numel"] == full["state_optim_numel"]


def test_only_deep_llama_and_gpt_are_extrapolated():
    every3 = {"activation_checkpointing": "every:3"}
    assert depth.depths(WORKLOAD, every3) is None  # 5 blocks: not deeper than 4 periods of 3
    assert depth.depths(depth.at_depth(WORKLOAD, 13), every3) == (9, 12)
    assert depth.depths(depth.at_depth(WORKLOAD, 4), {}) is None
    assert depth.depths(parse_workload({"model": {"kind": "mlp", "depth": 32}}), {}) is None
