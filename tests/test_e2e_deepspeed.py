"""End to end: `zerobench run` runs the DeepSpeed engines through the same worker, torchrun
protocol and measurements as every other engine. Skipped without the optional extra."""

import json
import textwrap

import pandas as pd
import pytest

from zerobench.cli import main
from zerobench.engines.deepspeed import deepspeed_unavailable

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(deepspeed_unavailable() is not None, reason=str(deepspeed_unavailable()))]

TINY = textwrap.dedent("""
    name = "tiny-deepspeed"
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
    steps = 3
    [optimizer]
    kind = "adam"
    lr = 0.01
    [run]
    timeout_s = 300
    [matrix]
    engine = ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]
    world_size = [2]
    dtype = ["fp32", "bf16"]
    activation_checkpointing = ["none", "full"]
    reduce_bucket_size = [20000]
    stage3_param_persistence_threshold = [0]
""")
FP32 = ["deepspeed-zero1-ws2-fp32-reduce_bucket_size=20000", "deepspeed-zero2-ws2-fp32-reduce_bucket_size=20000",
        "deepspeed-zero3-ws2-fp32-reduce_bucket_size=20000-stage3_param_persistence_threshold=0"]
BF16_CHECKPOINTED = ("deepspeed-zero3-ws2-bf16-reduce_bucket_size=20000-stage3_param_persistence_threshold=0"
                     "-activation_checkpointing=full")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-deepspeed")
    (root / "tiny.toml").write_text(TINY)
    cells = [arg for cell in [*FP32, BF16_CHECKPOINTED] for arg in ("--cell", cell)]
    assert main(["run", str(root / "tiny.toml"), "--results", str(root / "results"), "--no-plots", *cells]) == 0
    (out,) = (root / "results").iterdir()
    return out


def test_deepspeed_cells_run_measure_and_match_the_reference(run_dir):
    results = pd.read_csv(run_dir / "results.csv").set_index(["cell_id", "rank"])
    assert (results["status"] == "ok").all(), results["error"]
    for cell in FP32:
        rows = results.loc[cell]
        assert (rows["loss_max_abs_diff_ref"] < 1e-5).all(), cell  # fp32: single-process training's losses
        assert (rows["step_time_s"] > 0).all() and (rows["peak_mem_optim_bytes"] > 0).all()
        assert (rows["comm_all_gather_bytes"] > 0).all(), cell
    assert (results.loc[FP32[0], "comm_all_reduce_bytes"] > 0).all()  # stages 1-2 all-reduce gradient buckets
    assert (results.loc[FP32[2], "comm_reduce_scatter_bytes"] > 0).all()  # stage 3 reduce-scatters them
    # bf16 (DeepSpeed's bf16 section) with activation checkpointing trains, off the fp32 reference by
    # bf16 rounding only; its parameter partitions are bf16, half the fp32 cell's
    rows = results.loc[BF16_CHECKPOINTED]
    assert (rows["loss_max_abs_diff_ref"] < 0.1).all()
    assert (rows["peak_mem_params_bytes"] * 2 == results.loc[FP32[2], "peak_mem_params_bytes"]).all()


def test_a_setting_deepspeed_ignores_here_is_noted_in_the_record_and_the_table(run_dir):
    record = json.loads((run_dir / "cells" / f"{BF16_CHECKPOINTED}.json").read_text())
    assert record["note"].startswith("overlap_comm: no side stream on CPU")
    results = pd.read_csv(run_dir / "results.csv")
    ignored = results[results["note"].fillna("").str.contains("overlap_comm: no side stream")]
    assert set(ignored["engine"]) == {"deepspeed-zero3"}  # overlap_comm is on by default for stage 3 only
    # every DeepSpeed cell says its bucket is allocated whole ([Note: say what surprises]); DDP nothing
    deepspeed = results[results["engine"].str.startswith("deepspeed")]
    assert deepspeed["note"].fillna("").str.contains("allocates the gradient bucket whole").all()
    zero1 = json.loads((run_dir / "cells" / f"{FP32[0]}.json").read_text())
    assert "overlap_comm" not in zero1["note"] and "reduce_bucket_size 20,000:" in zero1["note"]
