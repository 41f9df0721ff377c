"""`zerobench predict`: one rank of each engine cell on the virtual GPU, at any world
size, with fake tensors; its memory agrees with `zerobench estimate`'s."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from zerobench.instruments.link import resolve_link
from zerobench.spec.cell import Cell
from zerobench.spec.workload import load_workload
from zerobench.whatif.cells import configurations
from zerobench.whatif.predict.job import timeline_metrics


def test_exposed_communication_is_what_compute_does_not_cover():
    spans = [("compute", "mm", 0.0, 4.0, None), ("compute", "mm", 6.0, 8.0, None),
             ("comm0", "all_gather", 3.0, 7.0, None), ("comm1", "reduce_scatter", 9.0, 10.0, None),
             ("stream1", "copy", 0.0, 10.0, None)]  # other streams are neither
    m = timeline_metrics(spans, 0.0, 10.0)
    assert m["compute_s"] == 6.0 and m["comm_s"] == 5.0
    assert m["exposed_comm_s"] == pytest.approx(3.0)  # 4-6 and 9-10
    assert m["overlap_ratio"] == pytest.approx(1 - 3 / 5)
    window = timeline_metrics(spans, 3.5, 6.5)  # clipped to the step's window
    assert window["compute_s"] == pytest.approx(1.0) and window["exposed_comm_s"] == pytest.approx(2.0)
    quiet = timeline_metrics([("compute", "mm", 0.0, 4.0, None)], 0.0, 4.0)
    assert quiet["comm_s"] == 0.0 and quiet["overlap_ratio"] != quiet["overlap_ratio"]  # NaN: nothing to hide


@pytest.fixture(scope="module")
def quickstart():
    return load_workload("workloads/quickstart.toml")


def _cell(w, cell_id: str, world_size: int) -> Cell:
    c = next(c for c in configurations(w) if c.id == cell_id)
    return Cell(c.engine, world_size, c.dtype, c.options)


@pytest.mark.parametrize("cell_id,world_size", [
    ("impl-fsdp-ws2-fp32", 2), ("impl-fsdp-ws2-fp32", 1024), ("torch-fsdp1-ws2-bf16", 8),
    pytest.param("torch-fsdp1-ws2-bf16", 1024, marks=pytest.mark.slow), ("impl-zero2-ws2-fp32", 8)])
def test_predict_and_estimate_agree_on_memory(quickstart, cell_id, world_size):
    """The caching-allocator model's allocated peak is the estimator's tensor-byte peak,
    rounded to 512-byte blocks, with cuBLAS's two workspaces on top (the forward's handle
    and the backward thread's, 32 MiB each on sm90: [Note: cuBLAS workspaces]): within 1 %
    (and never below it)."""
    from zerobench.instruments.vgpu.device import cublas_workspace_bytes
    from zerobench.whatif.estimate.job import estimate_one
    from zerobench.whatif.predict.job import predict_one

    cell = _cell(quickstart, cell_id, world_size)
    estimated = estimate_one(quickstart, cell, 0, True)
    predicted = predict_one(quickstart, cell, "h100-sxm", "fast", resolve_link("nvlink4-8gpu"), None, 8)
    assert predicted["status"] == "ok"
    workspaces = 2 * cublas_workspace_bytes("9.0")
    ratio = (predicted["peak_allocated_bytes"] - workspaces) / estimated["peak_mem_bytes"]
    assert 1.0 <= ratio < 1.01, (predicted["peak_allocated_bytes"], estimated["peak_mem_bytes"])
    assert predicted["peak_reserved_bytes"] >= predicted["peak_active_bytes"] >= predicted["peak_allocated_bytes"]
    assert predicted["step_time_s"] >= predicted["compute_s"] > 0
    assert 0.0 <= predicted["overlap_ratio"] <= 1.0


def test_zerobench_predict_writes_its_folder(tmp_path, quickstart):
    from zerobench.whatif.predict import predict
    from zerobench.whatif.predict.request import PredictRequest

    out = predict(PredictRequest("workloads/quickstart.toml", [8], link="ib-400g", results_root=tmp_path,
                  only=["impl-fsdp-fp32"]), log=lambda *_: None)
    frame = pd.read_csv(out / "predict.csv")
    assert list(frame["config"]) == ["impl-fsdp-fp32"] and frame["status"].tolist() == ["ok"]
    for column in ("step_time_s", "compute_s", "exposed_comm_s", "overlap_ratio", "peak_allocated_bytes",
                   "peak_active_bytes", "peak_reserved_bytes", "max_unsharded_units", "host_lead_max_s"):
        assert column in frame.columns and frame[column].notna().all()
    assert frame["link"].tolist() == ["ib-400g"]
    assert (out / "traces" / "impl-fsdp-ws8-fp32.trace.json.gz").exists()
    assert (out / "plots" / "predict.png").exists()


def test_predict_takes_a_preset_file_and_keeps_what_it_ran_on(tmp_path):
    """``--gpu FILE`` (as calibrate writes one): the row names the preset, the folder keeps
    it as gpu.json with every source, and its measured host is the host unless --host is
    given. The predicting process reads the resolved preset back, not the name."""
    import json

    from zerobench.instruments.vgpu.presets import GPU_DIR, gpu_preset, load_preset_file
    from zerobench.whatif.predict import predict
    from zerobench.whatif.predict.request import PredictRequest

    mine = json.loads((GPU_DIR / "h200.json").read_text())
    mine["name"] = "my-h200"
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(mine))
    out = predict(PredictRequest("workloads/quickstart.toml", [2], gpu=str(path), results_root=tmp_path / "a",
                  only=["impl-fsdp-fp32"]), log=lambda *_: None)
    frame = pd.read_csv(out / "predict.csv")
    assert frame["gpu"].tolist() == ["my-h200"] and frame["host"].tolist() == ["my-h200-host"]
    assert frame["status"].tolist() == ["ok"]
    kept = load_preset_file(out / "gpu.json")
    assert kept == load_preset_file(path) and kept.sources["matmul_efficiency"].startswith("results/gpu/h200")
    from zerobench.whatif.predict import resolve_devices

    given = resolve_devices(str(path), "fast", "nvlink4-8gpu", None, "", None, None)
    assert given["host"].name == "fast" and given["gpu"] == gpu_preset(str(path))
    # a preset without a measured host runs on the one measured host ([Note: host cost])
    assert resolve_devices("h100-sxm", None, "nvlink4-8gpu", None, "", None, None)["host"].name == "h200-host"


def test_predict_names_bad_presets_and_configurations(tmp_path):
    from zerobench.whatif.predict import predict
    from zerobench.whatif.predict.request import PredictRequest

    with pytest.raises(ValueError, match="--gpu: gpu: h800 is neither a shipped preset nor a preset file .*allowed: a100-40gb, .*h200"):
        predict(PredictRequest("workloads/quickstart.toml", [8], gpu="h800", results_root=tmp_path))
    with pytest.raises(ValueError, match=r"--alloc-conf: 'roundup_power2_divisions' is not modelled"):
        predict(PredictRequest("workloads/quickstart.toml", [8], alloc_conf="roundup_power2_divisions:4", results_root=tmp_path))
    with pytest.raises(ValueError, match=r"--context-mib: -1 is not allowed \(allowed: ints >= 0\)"):
        predict(PredictRequest("workloads/quickstart.toml", [8], context_mib=-1, results_root=tmp_path))
    with pytest.raises(ValueError, match="unknown preset 'nvlink9'"):
        predict(PredictRequest("workloads/quickstart.toml", [8], link="nvlink9", results_root=tmp_path))
    with pytest.raises(ValueError, match=r"--sdpa-backend: 'fa3' is not allowed \(allowed: 'auto', 'cudnn', 'flash'"):
        predict(PredictRequest("workloads/quickstart.toml", [8], sdpa_backend="fa3", results_root=tmp_path))
    with pytest.raises(ValueError, match="--gpu: gpu preset file missing.json does not exist"):
        predict(PredictRequest("workloads/quickstart.toml", [8], gpu="missing.json", results_root=tmp_path))
    # a --config that names no configuration (here a cell id, with its world size)
    with pytest.raises(ValueError, match=r"--config: impl-fsdp-ws2-fp32 is not a configuration .*allowed: ddp-fp32"):
        predict(PredictRequest("workloads/quickstart.toml", [8], only=["impl-fsdp-ws2-fp32"], results_root=tmp_path))
    assert not any(tmp_path.iterdir())  # and no empty results folder is left behind


def test_predicted_beside_measured(tmp_path):
    """What gpu-check prints on a GPU: each measured cell beside its prediction."""
    from zerobench.whatif.predict.measured import gpu_preset_for, side_by_side, to_markdown

    run, pred = tmp_path / "run", tmp_path / "pred"
    run.mkdir(), pred.mkdir()
    pd.DataFrame([{"cell_id": "impl-fsdp-ws1-fp32", "world_size": 1, "rank": 0, "step_time_s": 0.010,
                   "peak_allocated_bytes": 2**20, "peak_active_bytes": 2 * 2**20,
                   "peak_reserved_bytes": 4 * 2**20},
                  {"cell_id": "ddp-ws1-fp32", "world_size": 1, "rank": 0, "step_time_s": 0.01}]
                 ).to_csv(run / "results.csv", index=False)
    pd.DataFrame([{"config": "impl-fsdp-fp32", "world_size": 1, "status": "ok", "step_time_s": 0.012,
                   "peak_allocated_bytes": 2**20, "peak_active_bytes": 3 * 2**20, "peak_reserved_bytes": 4 * 2**20}]
                 ).to_csv(pred / "predict.csv", index=False)
    frame = side_by_side(run, pred)
    assert frame["cell"].tolist() == ["impl-fsdp-ws1-fp32"]  # ddp has no prediction
    row = frame.iloc[0]
    assert row["step error"] == pytest.approx(0.2) and row["peak active error"] == pytest.approx(0.5)
    assert "+20.0%" in to_markdown(frame)
    assert gpu_preset_for("NVIDIA H100 80GB HBM3") == "h100-sxm" and gpu_preset_for("NVIDIA H200") == "h200"
    assert gpu_preset_for("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert gpu_preset_for("NVIDIA A100-SXM4-40GB") == "a100-40gb" and gpu_preset_for("NVIDIA H100 NVL") == "h100-nvl"
    assert gpu_preset_for("NVIDIA H100 PCIe") == "h100-pcie" and gpu_preset_for("NVIDIA GH200 480GB") == "gh200-96gb"


@pytest.mark.slow
def test_a_cell_that_runs_out_of_memory_says_what_it_needed(tmp_path):
    """With all but 16 MiB of the card held by the CUDA context, the quickstart MLP's cell
    runs out of memory: the row says so and gives what the allocator would have had to
    reserve, which is more than it could."""
    from zerobench.whatif.predict import predict
    from zerobench.whatif.predict.request import PredictRequest

    out = predict(PredictRequest("workloads/quickstart.toml", [8], results_root=tmp_path, only=["impl-fsdp-fp32"],
                  context_mib=81_559 - 16, nccl_mib=0), log=lambda *_: None)
    row = pd.read_csv(out / "predict.csv").iloc[0]
    assert row["status"] == "oom" and "out of memory" in row["reason"]
    assert row["capacity_bytes"] == 16 * 2**20 and row["oom_needed_bytes"] > 16 * 2**20


@pytest.mark.slow
def test_hybrid_shard_configurations_run_at_the_world_sizes_asked(tmp_path):
    """impl-fsdp's HYBRID_SHARD is invalid at 2 ranks (one group of one): checked at a
    placeholder world size of 2, it vanished from predict.csv. torch-fsdp1's runs on the
    fake process group with its shard groups given as a mesh of one node's ranks, so its
    collectives go over two process groups: NVLink within the node, InfiniBand across."""
    import dataclasses

    from zerobench.spec.workload import load_workload
    from zerobench.whatif.cells import configurations
    from zerobench.whatif.predict import predict
    from zerobench.whatif.predict.request import PredictRequest

    w = load_workload("workloads/quickstart.toml")
    w = dataclasses.replace(w, matrix={**w.matrix, "sharding_strategy": ["HYBRID_SHARD"]})
    assert "impl-fsdp-fp32-sharding_strategy=HYBRID_SHARD" not in [c.id.replace("-ws2", "") for c in configurations(w)]
    ids = [c.id.replace("-ws16", "") for c in configurations(w, [16])]
    assert "impl-fsdp-fp32-sharding_strategy=HYBRID_SHARD" in ids
    assert "torch-fsdp1-fp32-sharding_strategy=HYBRID_SHARD" in ids

    (tmp_path / "hsdp.toml").write_text(
        f'extends = "{Path("workloads/quickstart.toml").resolve()}"\n'
        '[matrix]\nengine = ["torch-fsdp1"]\ndtype = ["fp32"]\nsharding_strategy = ["HYBRID_SHARD"]\n'
        'reshard_after_forward = []\n')
    out = predict(PredictRequest(tmp_path / "hsdp.toml", [16], results_root=tmp_path, inter_link="ib-400g"), log=lambda *_: None)
    row = pd.read_csv(out / "predict.csv").iloc[0]
    assert row["status"] == "ok", row["reason"]
    import gzip
    import json

    trace = json.load(gzip.open(next((out / "traces").glob("*.trace.json.gz")), "rt"))
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert len([lane for lane in lanes if lane.startswith("stream comm")]) == 2


def test_predict_and_estimate_take_one_request_checked_as_it_is_made(tmp_path):
    from zerobench.whatif.estimate.request import EstimateRequest
    from zerobench.whatif.predict.request import PredictRequest

    request = PredictRequest("quickstart", [8, "64"], only=["ddp-fp32"], overrides=["data.steps=2"])
    assert request.world_sizes == (8, 64) and request.only == ("ddp-fp32",) and request.node_size == 8
    with pytest.raises(ValueError, match=r"--node-size: 0 is not allowed \(allowed: ints >= 1\)"):
        PredictRequest("quickstart", [8], node_size=0)
    with pytest.raises(ValueError, match=r"--world-sizes: 8 is repeated"):
        PredictRequest("quickstart", [8, 8])
    with pytest.raises(ValueError, match=r"--rank: 2 is not allowed at world size 2 \(allowed: 0..1\)"):
        EstimateRequest("quickstart", [2, 8], rank=2)
    with pytest.raises(ValueError, match=r"--hybrid-shard-size: 3 does not divide world size 8"):
        EstimateRequest("quickstart", [8], hybrid_shard_size=3)
    assert not any(tmp_path.iterdir())  # refused before anything is made


def test_a_step_whose_host_is_busier_than_its_device_is_called_host_bound():
    """predict's table names a host-bound step and the largest share of its host's time
    (predict.csv's host_*_s); a step whose device is busier, or a folder made before these
    columns, gets no mark."""
    from zerobench.whatif.predict.report import host_bound

    row = {"host_busy_s": 0.2, "device_busy_s": 0.15, "host_operators_s": 0.05, "host_python_s": 0.12,
           "host_streams_s": 0.01, "host_collectives_s": 0.0, "host_cpu_s": 0.02}
    assert host_bound(row) == "host-bound (python 60%)"
    assert host_bound({**row, "host_cpu_s": 0.13}) == "host-bound (host memory 65%)"
    assert host_bound({**row, "device_busy_s": 0.25}) == ""
    assert host_bound({"step_time_s": 0.2}) == ""
