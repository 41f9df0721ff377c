"""End to end: `zerobench run` starts real gloo ranks for every engine, and every engine
trains to the same losses as single-process training on the same global batch."""

import json
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

from zerobench.cli import main
from zerobench.schema.columns import CORE_METRICS

pytestmark = pytest.mark.slow

TINY = textwrap.dedent("""
    name = "tiny"
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
    kind = "adam"
    lr = 0.01
    [run]
    timeout_s = 120
    [matrix]
    engine = ["ddp", "torch-zero1", "torch-fsdp1", "torch-fsdp2"]
    world_size = [2]
    sharding_strategy = ["FULL_SHARD", "NO_SHARD"]
""")
FP32_LOSS_TOLERANCE = 1e-5  # fp32 reductions in another order: ~1e-7 observed


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    (root / "tiny.toml").write_text(TINY)
    assert main(["run", str(root / "tiny.toml"), "--results", str(root / "results")]) == 0
    (run_dir,) = (root / "results").iterdir()
    return run_dir


def test_every_engine_matches_single_process_training(tiny_run):
    results = pd.read_csv(tiny_run / "results.csv")
    assert set(results["engine"]) == {"ddp", "torch-zero1", "torch-fsdp1", "torch-fsdp2"}
    assert (results["status"] == "ok").all(), results[["cell_id", "error"]]
    reference = json.loads((tiny_run / "reference.json").read_text())["2"]
    steps = pd.read_csv(tiny_run / "steps.csv")
    mean_loss = steps.groupby(["cell_id", "step"])["loss"].mean()
    for (cell, step), loss in mean_loss.items():
        assert loss == pytest.approx(reference[1 + step], abs=FP32_LOSS_TOLERANCE), (cell, step)
    assert (results["loss_max_abs_diff_ref"] < FP32_LOSS_TOLERANCE).all()


def test_table_has_every_metric_filled(tiny_run):
    results = pd.read_csv(tiny_run / "results.csv")
    cpu_absent = {"peak_allocated_bytes", "peak_active_bytes", "peak_reserved_bytes", "num_alloc_retries",
                  "num_ooms", "tflops_per_gpu", "mfu"}  # a GPU's allocator; MFU of token models on a GPU
    for metric in CORE_METRICS:
        if metric.name in cpu_absent:
            continue
        assert metric.name in results.columns, metric.name
        assert results[metric.name].notna().all(), metric.name
    assert len(results) == 5 * 2  # cells x ranks
    # communication is what each engine is known to do
    by_engine = results.groupby("engine")
    assert (by_engine.get_group("ddp")["comm_all_reduce_bytes"] > 0).all()
    assert (by_engine.get_group("ddp")["comm_all_gather_bytes"] == 0).all()
    assert (by_engine.get_group("torch-zero1")["comm_broadcast_bytes"] > 0).all()
    fsdp2 = by_engine.get_group("torch-fsdp2")
    assert ((fsdp2["comm_all_gather_bytes"] > 0) & (fsdp2["comm_reduce_scatter_bytes"] > 0)).all()
    # sharding shows in memory: optimizer state per rank is smaller than DDP's
    ddp_optim = by_engine.get_group("ddp")["peak_mem_optim_bytes"].max()
    assert fsdp2["peak_mem_optim_bytes"].max() < 0.75 * ddp_optim
    meta = json.loads((tiny_run / "meta.json").read_text())
    for key in ("workload", "git_commit", "torch_version", "backend", "world_sizes", "cpu_model", "date", "command"):
        assert key in meta
    assert {p.name for p in (tiny_run / "plots").iterdir()} >= {"step_time.png", "peak_memory.png", "losses.png"}


def test_resume_runs_only_unfinished_cells(tiny_run, capsys):
    cells = tiny_run / "cells"
    kept = cells / "ddp-ws2-fp32.json"
    kept_mtime = kept.stat().st_mtime_ns
    (cells / "torch-fsdp2-ws2-fp32.json").unlink()  # as if the run had been killed there
    assert main(["run", "--resume", str(tiny_run), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "5 cells (4 already done)" in out
    assert kept.stat().st_mtime_ns == kept_mtime
    assert json.loads((cells / "torch-fsdp2-ws2-fp32.json").read_text())["status"] == "ok"
    assert len(pd.read_csv(tiny_run / "results.csv")) == 10


def test_hung_cell_is_killed_recorded_and_the_matrix_goes_on(tmp_path):
    workload = TINY.replace("timeout_s = 120", "timeout_s = 1.5").replace(
        'engine = ["ddp", "torch-zero1", "torch-fsdp1", "torch-fsdp2"]', 'engine = ["ddp"]')
    workload = workload.replace('sharding_strategy = ["FULL_SHARD", "NO_SHARD"]', "")
    (tmp_path / "slow.toml").write_text(workload)
    assert main(["run", str(tmp_path / "slow.toml"), "--results", str(tmp_path), "--no-plots"]) == 1  # a cell failed
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    record = json.loads((run_dir / "cells" / "ddp-ws2-fp32.json").read_text())
    assert record["status"] == "failed"
    assert "timed out after 2 s" in record["error"] or "timed out after 1 s" in record["error"]
    assert "still running" in record["error"]  # names the ranks it had to stop
    assert main(["run", "--resume", str(run_dir), "--no-plots", "--allow-failures"]) == 0
    # no rank process is left behind
    left = subprocess.run(["pgrep", "-f", f"zerobench.worker --run-dir {run_dir}"], capture_output=True, text=True)
    assert left.stdout.strip() == ""


def test_worker_runs_under_torchrun(tiny_run):
    """The per-rank entry point needs nothing but the torchrun environment."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cell = "torch-fsdp2-ws2-fp32"
    (tiny_run / "cells" / f"{cell}.json").unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "zerobench.worker", "--run-dir", str(tiny_run), "--cell", cell],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tiny_run / "cells" / f"{cell}.json").read_text())
    assert record["status"] == "ok" and len(record["ranks"]) == 2
