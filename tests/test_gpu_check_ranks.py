"""gpu-check on every GPU of a node ([Note: checks on every GPU] in
zerobench/validation/gpu_check.py), without a GPU: the overlap and limiter checks with one
rank per GPU run here on CPU ranks over gloo, a virtual GPU each (their all-gathers move
real data between the ranks); each rank's device on a faked 8-GPU node
(tests/helpers/topology.py); and the script's plan for 8 GPUs."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.helpers.topology import Topology, environment, gpus
from tests.test_cuda_without_gpu import _fake_gpu_python, _gpu_check, _steps


def test_the_limiter_check_on_two_ranks_shards_across_them_and_bounds_the_pile(tmp_path):
    from zerobench.validation.gpu_check import on_ranks

    out = on_ranks("limiter", 2, tmp_path / "limiter.json", virtual=True, timeout_s=240, units=8, unit_mb=1)
    assert out["pass"] and out["exit_codes"] == [0, 0], out
    assert [r["sharding"] for r in out["ranks"]] == ["FULL_SHARD over 2 ranks"] * 2
    on, off = out["with_limiter"], out["without_limiter"]
    assert on["peak_active_above_base_units"] == pytest.approx(out["depth"], abs=0.1)
    assert off["peak_active_above_base_units"] >= 7.5  # all 8 units' gathered buffers at once
    assert on["limiter_stalls"] > 0 and off["limiter_stalls"] == 0
    assert not list(tmp_path.iterdir())  # the ranks' own files are gone; the caller writes the result
    # torch's FSDP1 beside impl's (issue 39 item 6): on this check, the same pile-up and the same bound
    fsdp1 = out["torch_fsdp1"]
    assert fsdp1["with_limiter"]["peak_active_above_base_units"] == pytest.approx(2, abs=0.1)
    assert fsdp1["without_limiter"]["peak_active_above_base_units"] == pytest.approx(
        off["peak_active_above_base_units"], abs=0.1)


def test_the_overlap_check_on_two_ranks_tells_prefetch_from_none(tmp_path):
    from zerobench.validation.gpu_check import on_ranks

    units = 6
    out = on_ranks("overlap", 2, tmp_path / "overlap.json", virtual=True, timeout_s=240, units=units, steps=1)
    assert out["exit_codes"] == [0, 0], out
    assert out["prefetch"]["gathers_per_step"] == 2 * units
    # only the first gather of forward and of backward has nothing to hide behind
    assert out["hidden_fraction"] == pytest.approx(1 - 2 / (2 * units), abs=0.03)
    assert out["exposed_fraction_without_prefetch"] >= 0.8


def test_a_rank_that_fails_fails_the_check_naming_it(tmp_path):
    from zerobench.validation.gpu_check import on_ranks

    out = on_ranks("limiter", 2, tmp_path / "x.json", virtual=True, timeout_s=120, units="many")
    assert not out["pass"] and out["error"] == "rank(s) 0, 1 wrote no result"
    with pytest.raises(ValueError, match="check 'probe' is not allowed"):
        on_ranks("probe", 2, tmp_path / "x.json")
    with pytest.raises(ValueError, match="ranks must be at least 2, got 1"):
        on_ranks("limiter", 1, tmp_path / "x.json")


def test_each_rank_of_the_check_is_on_its_own_gpu_of_an_8_gpu_node(monkeypatch):
    from zerobench.validation.gpu_check import Target, rank_environ

    node = Topology(gpus(8)).install(monkeypatch)
    for rank in range(8):
        node.calls.clear()
        with environment(rank_environ(rank, 8, 29512)):
            with Target(world="env") as target:
                assert target.device == target.device_id == torch.device("cuda", rank)
                assert target.size == 8
        assert node.calls[:2] == [("set_device", rank), ("init_process_group", "nccl", torch.device("cuda", rank))]


def test_bus_bandwidth_of_all_gather_and_reduce_scatter_over_ranks():
    from zerobench.validation.gpu_check import busbw

    out = busbw(budget_s=60, ranks=2, device_type="cpu", size="tiny")
    assert out["pass"] and out["world_size"] == 2
    assert {(r["kind"], r["nbytes"]) for r in out["rows"]} == {
        (kind, size) for kind in ("all_gather", "reduce_scatter") for size in (1 << 12, 1 << 16)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the GPU machine's answers")
def test_gpu_check_on_8_gpus_runs_every_check_on_all_of_them_within_8_minutes(tmp_path):
    """Issue 39 item 4: the plan on 8 GPUs, its budgets within 8 minutes, and each step's command."""
    python, calls = _fake_gpu_python(tmp_path, gpus=8)
    out = tmp_path / "out"
    proc = _gpu_check([str(out)], os.environ["PATH"], tmp_path, env_python=str(python))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = _steps(out)
    names = [s["name"] for s in steps]
    assert names == ["overlap", "limiter", "busbw", "pytest", "world1-run", "world1", "quickstart-run", "quickstart",
                     "predict", "predicted-vs-measured", "gloo-probe", "shared-run", "shared"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["deadline_s"] == 480
    required = [s for s in steps if names.index(s["name"]) < 8]
    assert sum(s["budget_s"] for s in required) <= 480 - 10
    logged = calls.read_text().splitlines()
    for check in ("overlap", "limiter"):
        assert f"-m zerobench.validation.gpu_check --ranks 8 {check} {out}/{check}.json" in logged
    assert f"-m zerobench.validation.gpu_check busbw {out}/busbw.json" in logged
    run = next(c for c in logged if "workloads/quickstart.toml" in c)
    assert "--set matrix.world_size=[8]" in run and "--device cuda" in run
    assert "gpu-check: 8 GPU(s), at most 480 s" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the GPU machine's answers")
def test_gpu_check_on_one_gpu_stays_as_it_was(tmp_path):
    python, calls = _fake_gpu_python(tmp_path, gpus=1)
    proc = _gpu_check([str(tmp_path / "out")], os.environ["PATH"], tmp_path, env_python=str(python))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--ranks" not in calls.read_text() and "busbw" not in calls.read_text()
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["deadline_s"] == 360


def test_the_one_rank_limiter_check_says_why_fsdp1_is_not_beside_it():
    from zerobench.validation.gpu_check import Target, limiter_check

    out = limiter_check(Target(virtual=True), units=4, unit_mb=1)
    assert out["torch_fsdp1"].startswith("not run: torch's FSDP1 runs NO_SHARD with a shard group of one rank")


def _canned(check: str, ranks: int) -> dict:
    """What a check on ``ranks`` GPUs writes (the fields the summary reads)."""
    peak = {"peak_active_above_base_units": 2.0, "peak_allocated_above_base_units": 1.0, "peak_reserved_bytes": 2e9,
            "cpu_enqueue_ms": 200.0, "limiter_stalls": 10}
    every = {"world_size": ranks, "ranks": [{"pass": True, "device": f"cuda:{r}"} for r in range(ranks)], "pass": True}
    if check == "limiter":
        off = {**peak, "peak_active_above_base_units": 12.0, "limiter_stalls": 0}
        return {**every, "depth": 2, "bound_units": 3, "unit_mb": 64, "with_limiter": peak, "without_limiter": off,
                "torch_fsdp1": {"with_limiter": peak, "without_limiter": off}}
    if check == "overlap":
        side = {"exposed_ms": 4.0, "exposed_fraction": 0.05}
        return {**every, "hidden_fraction": 0.95, "prefetch": side, "no_prefetch": {**side, "exposed_fraction": 0.99}}
    return {"world_size": ranks, "pass": True, "rows": [{"kind": "all_gather", "nbytes": 1 << 28, "busbw_gbps": 361.0}]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the GPU machine's answers")
def test_gpu_check_on_8_gpus_summarises_what_every_gpu_did(tmp_path):
    python = tmp_path / "python-gpu"
    canned = {check: json.dumps(_canned(check, 8)) for check in ("overlap", "limiter", "busbw")}
    models = json.dumps({"device_type": "cuda", "gpu_models": ["NVIDIA H200"] * 8})
    cases = "\n".join(f"    *\" {check} \"*) echo '{text}' > \"$last\" ;;" for check, text in canned.items())
    python.write_text(f"""#!/bin/bash
if [ "$1" = - ] && [ "$3" = gpu ]; then cat > /dev/null; echo '{models}' > "$2"; exit 0; fi
if [ "$1" = -m ]; then
    last="${{@: -1}}"
    case " $* " in
{cases}
    esac
    exit 0
fi
exec "{sys.executable}" "$@"
""")
    python.chmod(0o755)
    out = tmp_path / "out"
    proc = _gpu_check([str(out)], os.environ["PATH"], tmp_path, env_python=str(python))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.md").read_text()
    assert "overlap (FULL_SHARD over 8 GPUs, every rank: pass, pass, pass, pass, pass, pass, pass, pass)" in summary
    assert "limiter (FULL_SHARD over 8 GPUs, depth 2, bound 3 units of 64 MB)" in summary
    assert "torch's FSDP1 beside it (depth 2): peak active above base 2.00 units with, 12.00 without" in summary
    assert "bus bandwidth over 8 GPUs: all_gather 256 MiB 361.0 GB/s" in summary
    assert not (out / "summary.log").exists() or not (out / "summary.log").read_text().strip()
