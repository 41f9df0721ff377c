"""The step users train (issue 41): gradient clipping as each engine does it
(optimizer.max_grad_norm), the optimizer's implementation (optimizer.implementation) and
CPU offload on fully_shard, each checked against single-process training."""

import json
import textwrap

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from impl.zero.clip import clip_grad_norm_
from zerobench.cli import main
from zerobench.engines.base import OptimizerSpec
from zerobench.engines.deepspeed import deepspeed_unavailable
from zerobench.engines.torch_fsdp2 import TorchFSDP2Engine, fused_on_dtensor
from zerobench.harness.reference import reference_losses
from zerobench.harness.testing import run_ranks
from zerobench.spec.matrix import expand
from zerobench.spec.workload import WorkloadError, parse_workload

BASE = {"name": "step", "model": {"kind": "mlp", "depth": 2, "width": 16},
        "data": {"batch_size": 2, "warmup_steps": 1, "steps": 2},
        "matrix": {"engine": ["ddp"], "world_size": [2]}}


def workload(optimizer=None, matrix=None):
    return parse_workload({**BASE, "optimizer": optimizer or {}, "matrix": matrix or BASE["matrix"]})


# -- the workload's keys ---------------------------------------------------------------------


def test_implementation_refuses_a_bad_value_naming_the_field_and_the_allowed_values():
    with pytest.raises(WorkloadError) as err:
        workload({"implementation": "fast"})
    assert "optimizer.implementation" in str(err.value)
    assert all(v in str(err.value) for v in ("'default'", "'foreach'", "'fused'", "'for-loop'"))


def test_max_grad_norm_refuses_a_negative_norm_naming_the_field():
    with pytest.raises(WorkloadError, match=r"optimizer\.max_grad_norm"):
        workload({"max_grad_norm": -1.0})


def test_the_keys_reach_workload_json_only_when_set():
    default = workload().to_dict()["optimizer"]
    assert "max_grad_norm" not in default and "implementation" not in default
    chosen = workload({"max_grad_norm": 1.0, "implementation": "fused"})
    out = chosen.to_dict()["optimizer"]
    assert out["max_grad_norm"] == 1.0 and out["implementation"] == "fused"
    again = parse_workload({**BASE, "optimizer": out})  # what a rank reads back from workload.json
    assert (again.optimizer.max_grad_norm, again.optimizer.implementation) == (1.0, "fused")


@pytest.mark.parametrize("implementation, flags", [("default", {"foreach": None, "fused": None}),
                                                   ("foreach", {"foreach": True, "fused": None}),
                                                   ("fused", {"fused": True}),
                                                   ("for-loop", {"foreach": False, "fused": None})])
def test_each_implementation_is_the_torch_optim_flag(implementation, flags):
    spec = OptimizerSpec.of(workload({"kind": "adamw", "implementation": implementation}).optimizer)
    optimizer = spec.build([torch.nn.Parameter(torch.ones(3))])
    assert {k: optimizer.defaults[k] for k in flags} == flags


def test_fully_shard_says_when_it_cannot_run_the_fused_kernel():
    # torch 2.13's DTensor shards _fused_adam_ but not _fused_sgd_ (what fused_on_dtensor reads)
    assert fused_on_dtensor("adam") and not fused_on_dtensor("sgd")
    sgd = workload({"kind": "sgd", "implementation": "fused"}).optimizer
    note = TorchFSDP2Engine.notes({}, "fp32", 2, "cpu", sgd)
    assert "optimizer.implementation" in note and "_fused_sgd_" in note
    adam = workload({"kind": "adam", "implementation": "fused"}).optimizer
    assert TorchFSDP2Engine.notes({}, "fp32", 2, "cuda", adam) is None


def test_cpu_offload_is_an_axis_of_fully_shard():
    w = workload(matrix={"engine": ["torch-fsdp2"], "world_size": [2], "cpu_offload": [False, True]})
    cells = expand(w)
    assert sorted(c.opts["cpu_offload"] for c in cells) == [False, True]
    (offloaded,) = [c for c in cells if c.opts["cpu_offload"]]
    assert "CPUOffloadPolicy" in offloaded.note


# -- the sharded norm, on real ranks -----------------------------------------------------------


def _sharded_clip(rank, world_size, max_norm):
    full = [torch.arange(1.0, 7.0).reshape(2, 3), torch.full((5,), -2.0), torch.tensor([0.5, 3.0])]
    mine = [g.clone() for i, g in enumerate(full) if i % world_size == rank]  # disjoint, together the whole
    norm = clip_grad_norm_(mine, max_norm, group=dist.group.WORLD)
    return norm, mine


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("max_norm", [1.0, 100.0])
def test_the_sharded_norm_clips_as_torch_clips_the_whole(world_size, max_norm):
    """At world size 4 one rank holds no gradient and still joins the all-reduce."""
    full = [torch.arange(1.0, 7.0).reshape(2, 3), torch.full((5,), -2.0), torch.tensor([0.5, 3.0])]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in full]
    for p, g in zip(params, full):
        p.grad = g.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    outs = run_ranks(_sharded_clip, world_size=world_size, args=(max_norm,))
    for rank, (norm, mine) in enumerate(outs):
        torch.testing.assert_close(norm, expected_norm)
        expected = [p.grad for i, p in enumerate(params) if i % world_size == rank]
        for got, want in zip(mine, expected):
            torch.testing.assert_close(got, want)
    clipped = max_norm < expected_norm.item()
    assert clipped == (max_norm == 1.0)  # one case clips, the other leaves the gradients alone


# -- every engine against the single-process reference, clipping on ------------------------------

ENGINES = ["ddp", "torch-zero1", "impl-zero1", "impl-zero2", "torch-fsdp1", "torch-fsdp2", "impl-fsdp"]
if deepspeed_unavailable() is None:
    ENGINES += ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]

CLIPPED = textwrap.dedent("""
    name = "clipped"
    seed = 3
    [model]
    kind = "gpt"
    layers = 2
    d_model = 32
    heads = 2
    seq_len = 8
    vocab = 64
    [data]
    batch_size = 2
    warmup_steps = 1
    steps = 4
    [optimizer]
    kind = "{kind}"
    lr = 0.1
    max_grad_norm = 0.2
    implementation = "{implementation}"
    [run]
    timeout_s = 120
    memory_pass = false
    [matrix]
    engine = {engines}
    world_size = [2]
    cpu_offload = [false, true]
""")
FP32_LOSS_TOLERANCE = 1e-5  # as tests/test_e2e.py: fp32 reductions in another order, ~1e-7 observed


@pytest.mark.slow
@pytest.mark.parametrize("kind, implementation", [("sgd", "foreach"), ("adamw", "fused"), ("sgd", "for-loop")])
def test_every_engine_clips_as_single_process_training(tmp_path, kind, implementation):
    text = CLIPPED.format(kind=kind, implementation=implementation, engines=json.dumps(ENGINES))
    (tmp_path / "clipped.toml").write_text(text)
    assert main(["run", str(tmp_path / "clipped.toml"), "--results", str(tmp_path / "results"), "--no-plots"]) == 0
    (run_dir,) = (tmp_path / "results").iterdir()
    results = pd.read_csv(run_dir / "results.csv")
    assert set(results["engine"]) == set(ENGINES)
    assert set(results.loc[results["engine"] == "torch-fsdp2", "cpu_offload"]) == {False, True}
    assert (results["status"] == "ok").all(), results[["cell_id", "error"]]
    assert (results["loss_max_abs_diff_ref"] <= FP32_LOSS_TOLERANCE).all(), results[["cell_id", "loss_max_abs_diff_ref"]]
    # The clipping is felt: the reference without it is far from the one with it, so an
    # engine that did not clip would be off by far more than the tolerance.
    from zerobench.spec.workload import load_workload

    clipped = reference_losses(load_workload(tmp_path / "clipped.toml"), 2)
    unclipped = reference_losses(load_workload(tmp_path / "clipped.toml", ["optimizer.max_grad_norm=0"]), 2)
    assert clipped == json.loads((run_dir / "reference.json").read_text())["2"]
    assert max(abs(a - b) for a, b in zip(clipped, unclipped)) > 100 * FP32_LOSS_TOLERANCE
