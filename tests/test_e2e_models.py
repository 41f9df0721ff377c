"""End to end with the models users train: a tiny Llama under activation checkpointing,
a user's factory model and a Hugging Face Llama config, each through `zerobench run`
on real gloo ranks, trained to the single-process reference's losses."""

import json
import shutil
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from zerobench.cli import main

pytestmark = pytest.mark.slow

MODELS = Path(__file__).parent / "data" / "models"
FP32_LOSS_TOLERANCE = 1e-5
COMMON = textwrap.dedent("""
    [data]
    batch_size = 2
    warmup_steps = 1
    steps = 2
    [optimizer]
    kind = "adamw"
    lr = 0.01
    [run]
    timeout_s = 180
    memory_warmup_steps = 2
""")


def _run(tmp_path, toml: str, cells: list[str]) -> pd.DataFrame:
    (tmp_path / "w.toml").write_text(toml + COMMON)
    argv = ["run", str(tmp_path / "w.toml"), "--results", str(tmp_path / "results"), "--no-plots"]
    for cell in cells:
        argv += ["--cell", cell]
    assert main(argv) == 0
    (run_dir,) = (tmp_path / "results").iterdir()
    results = pd.read_csv(run_dir / "results.csv")
    assert (results["status"] == "ok").all(), results[["cell_id", "error"]]
    assert (results["loss_max_abs_diff_ref"] < FP32_LOSS_TOLERANCE).all(), results[["cell_id", "loss_max_abs_diff_ref"]]
    results.attrs["run_dir"] = run_dir
    return results


def test_tiny_llama_with_checkpointing_matches_single_process_training(tmp_path):
    toml = textwrap.dedent("""
        [model]
        kind = "llama"
        layers = 4
        d_model = 64
        heads = 4
        kv_heads = 2
        ffn_hidden = 128
        vocab = 128
        seq_len = 64
        [matrix]
        engine = ["torch-fsdp2", "impl-zero2"]
        world_size = [2]
        activation_checkpointing = ["none", "full", "ops"]
    """)
    cells = ["torch-fsdp2-ws2-fp32", "torch-fsdp2-ws2-fp32-activation_checkpointing=full",
             "impl-zero2-ws2-fp32-activation_checkpointing=ops"]
    results = _run(tmp_path, toml, cells)
    activations = results.groupby("cell_id")["peak_mem_activations_bytes"].max()
    assert activations[cells[1]] < activations[cells[0]]
    # The estimate of the checkpointed cell agrees with its memory pass (gloo's buffers modelled).
    out = tmp_path / "estimates"
    assert main(["estimate", str(tmp_path / "w.toml"), "--world-sizes", "2", "--backend", "gloo", "--results",
                 str(out), "--config", "torch-fsdp2-fp32-activation_checkpointing=full"]) == 0
    (est_dir,) = out.iterdir()
    estimated = pd.read_csv(est_dir / "estimate.csv").iloc[0]["peak_mem_bytes"]
    real = results[(results["cell_id"] == cells[1]) & (results["rank"] == 0)].iloc[0]["peak_mem_bytes"]
    assert estimated == pytest.approx(real, rel=0.03)


def test_factory_model_runs_from_the_current_folder(tmp_path, monkeypatch):
    shutil.copy(MODELS / "toy_factory.py", tmp_path / "toy_factory.py")
    monkeypatch.chdir(tmp_path)  # the ranks import toy_factory from the folder `zerobench run` starts in
    toml = textwrap.dedent("""
        [model]
        factory = "toy_factory:build"
        wrap = ["ToyBlock"]
        vocab = 64
        seq_len = 16
        width = 32
        depth = 2
        [matrix]
        engine = ["impl-fsdp"]
        world_size = [2]
        activation_checkpointing = ["full"]
    """)
    results = _run(tmp_path, toml, [])
    assert set(results["cell_id"]) == {"impl-fsdp-ws2-fp32-activation_checkpointing=full"}
    assert (results["comm_all_gather_bytes"] > 0).all()
    workload = json.loads((results.attrs["run_dir"] / "workload.json").read_text())
    assert workload["model"]["factory"] == "toy_factory:build" and workload["model"]["width"] == 32


def test_hugging_face_llama_config_runs(tmp_path):
    pytest.importorskip("transformers", reason="the optional extra: pip install -e '.[hf]'")
    shutil.copy(MODELS / "hf-llama-tiny.json", tmp_path / "config.json")
    toml = textwrap.dedent("""
        [model]
        kind = "hf"
        config = "config.json"
        seq_len = 16
        [matrix]
        engine = ["torch-fsdp2"]
        world_size = [2]
    """)
    results = _run(tmp_path, toml, [])
    assert (results["comm_reduce_scatter_bytes"] > 0).all()
