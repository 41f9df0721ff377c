"""Analysis of the real gloo traces checked in under tests/data (made by
tests/data/make_traces.py: 2 ranks, 2 traced steps each)."""

import gzip
import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from zerobench.analysis import profiling as zp
from zerobench.analysis.profiling.analyze import analyze_run, analyze_trace
from zerobench.cli import main as cli_main

DATA = Path(__file__).parent / "data"
STEPS, BLOCKS, DIM, PREFETCH, IMPL_LAYERS, IMPL_DIM = 2, 3, 64, 2, 4, 192
BLOCK_BYTES = 2 * (DIM * DIM + DIM) * 4  # one FSDP unit (two Linear layers), fp32


def load(name, rank):
    return zp.load_trace(DATA / f"{name}.rank{rank}.json.gz")


@pytest.fixture(scope="module")
def fsdp2():
    return [load("fsdp2", r) for r in (0, 1)]


def test_trace_facts_recorded_in_docs(fsdp2):
    """What torch 2.13's CPU profiler writes in a gloo run (docs/profiling.md)."""
    t = fsdp2[0]
    assert (t.rank, t.world_size) == (0, 2)
    assert t.main_tid == t.events["pid"].iloc[0]  # the training loop runs on the main thread
    gloo = t.named("gloo:")
    assert len(gloo) and (gloo["tid"] != t.main_tid).all()  # gloo work runs on its own threads
    assert gloo["tid"].nunique() == 2                          # two worker threads per process group
    assert set(gloo["name"]) == {"gloo:all_gather", "gloo:all_reduce"}  # reduce-scatter runs as all_reduce
    assert not t.named("record_param_comms").shape[0]          # no record_param_comms on CPU/gloo
    assert len(t.named("c10d::_allgather_base_", main_only=True)) == 2 * BLOCKS * STEPS


def test_fsdp2_structure(fsdp2):
    for t in fsdp2:
        assert len(zp.comm_intervals(t)) > 0
        assert len(zp.step_windows(t)) == STEPS
        coll = zp.collectives(t)
        counts = coll["kind"].value_counts().to_dict()
        # One all-gather per FSDP unit in forward and again in backward; one reduce-scatter per unit.
        assert counts == {"all_gather": 2 * BLOCKS * STEPS, "reduce_scatter": BLOCKS * STEPS}
        assert (coll["bytes"] == BLOCK_BYTES).all()
        assert (coll["duration_s"] > 0).all() and (coll["start_s"] >= coll["issue_s"]).all()
        assert coll["busbw_gbps"].to_numpy() == pytest.approx(coll["algbw_gbps"].to_numpy() * 0.5)
        s = analyze_trace(t)
        assert 0.0 <= s["overlap_ratio"] <= 1.0
        assert s["exposed_comm_s"] <= s["comm_s"] + 1e-12
        assert s["compute_s"] > 0 and s["idle_s"] >= 0
        assert s["compute_s"] + s["exposed_comm_s"] + s["idle_s"] == pytest.approx(s["step_trace_s"])
        assert s["all_gather_calls_trace"] == 2 * BLOCKS and s["reduce_scatter_calls_trace"] == BLOCKS
        # torch 2.13's FSDP2 all-gathers with async_op=False (overlap comes from CUDA
        # streams, which CPU lacks): never more than one in flight.
        assert s["max_inflight_all_gathers_trace"] == 1
        assert math.isnan(s["collective_wait_s"])  # FSDP2 writes no impl wait labels


def test_ddp_one_bucket_all_reduce():
    for r in (0, 1):
        coll = zp.collectives(load("ddp", r))
        ar = coll[coll["kind"] == "all_reduce"]
        assert len(ar) == STEPS
        assert (ar["bytes"] == BLOCKS * BLOCK_BYTES).all()  # TensorList op: dtype from the gloo event
        assert ar["busbw_gbps"].to_numpy() == pytest.approx(ar["algbw_gbps"].to_numpy())  # 2(n-1)/n = 1 at n=2


def test_impl_prefetch():
    for r in (0, 1):
        t = load("impl", r)
        inflight = zp.all_gathers_in_flight(t)
        assert set(inflight["source"]) == {"impl"}
        assert zp.max_all_gathers_in_flight(t) == PREFETCH
        assert inflight["in_flight"].iloc[-1] == 0  # every all-gather waited
        s = analyze_trace(t)
        assert s["collective_wait_s"] > 0 and s["limiter_wait_s"] >= 0
        assert s["all_gather_calls_trace"] == IMPL_LAYERS
        assert s["all_gather_bytes_trace"] == IMPL_LAYERS * IMPL_DIM * IMPL_DIM * 4
        assert 0.0 <= s["overlap_ratio"] <= 1.0
    # Prefetched all-gathers run on gloo's threads while the main thread computes.
    assert max(analyze_trace(load("impl", r))["overlap_ratio"] for r in (0, 1)) > 0.05


def test_analyze_run_end_to_end(tmp_path):
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    (run / "traces" / "impl-cell").mkdir()
    for r in (0, 1):  # the per-cell layout, and the flat one of older runs
        shutil.copy(DATA / f"impl.rank{r}.json.gz", run / "traces" / "impl-cell" / f"rank{r}.json.gz")
        shutil.copy(DATA / f"fsdp2.rank{r}.json.gz", run / "traces" / f"fsdp2-cell.rank{r}.json.gz")
    (run / "cells").mkdir()
    (run / "cells" / "impl-cell.json").write_text(json.dumps({"config": {"emulate_gbps": 0.0}}))
    results = pd.DataFrame({"cell_id": ["fsdp2-cell"] * 2 + ["impl-cell"] * 2, "rank": [0, 1, 0, 1],
                            "overlap_ratio": [9.0] * 4, "step_time_s": [1.0] * 4})
    results.to_csv(run / "results.csv", index=False)

    assert cli_main(["analyze", str(run)]) == 0

    merged = pd.read_csv(run / "results.csv")
    assert len(merged) == 4 and list(merged.columns).count("overlap_ratio") == 1
    assert merged["overlap_ratio"].between(0, 1).all()  # old values replaced
    assert (merged["step_time_s"] == 1.0).all()
    assert list(merged["max_inflight_all_gathers_trace"]) == [1, 1, PREFETCH, PREFETCH]
    coll = pd.read_csv(run / "analysis" / "collectives.csv")
    assert {"cell_id", "rank", "kind", "bytes", "start_s", "duration_s", "algbw_gbps", "busbw_gbps"} <= set(coll.columns)
    assert len(coll) == 2 * (3 * BLOCKS * STEPS) + 2 * (2 * IMPL_LAYERS * STEPS)
    for png in ("overlap.png", "timeline_fsdp2-cell.png", "timeline_impl-cell.png"):
        assert (run / "plots" / png).stat().st_size > 10_000
    assert not list(run.glob("**/*.tmp"))


def test_analyze_run_without_traces(tmp_path):
    with pytest.raises(FileNotFoundError):
        analyze_run(tmp_path)


def test_plain_json_trace_loads(tmp_path):
    with gzip.open(DATA / "ddp.rank1.json.gz", "rt") as f:
        (tmp_path / "x.rank1.json").write_text(f.read())
    t = zp.load_trace(tmp_path / "x.rank1.json")
    assert t.rank == 1 and len(zp.collectives(t)) > 0
