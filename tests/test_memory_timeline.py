"""memory_timeline.png and peak_memory.png of a real run (the curated folders keep no cell
records): the phases of the step marked, FSDP's configurations told apart, "other" split
([Note: what other holds] in zerobench/instruments/memory.py). A ddp and two impl-fsdp
cells at world size 1, the memory pass on."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from tests.test_plots import _unexplained, figures  # noqa: F401 (a fixture)
from zerobench.cli import main
from zerobench.harness import active


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("timeline")
    (root / "w.toml").write_text(textwrap.dedent("""
        name = "timeline"
        [model]
        depth = 2
        width = 64
        [data]
        batch_size = 4
        warmup_steps = 1
        steps = 2
        [run]
        timeout_s = 120
        reference = false
        [matrix]
        engine = ["ddp", "impl-fsdp"]
        world_size = [1]
        sharding_strategy = ["FULL_SHARD", "SHARD_GRAD_OP"]
    """))
    mp = pytest.MonkeyPatch()
    mp.setenv(active.ACTIVE_DIR_ENV, str(root / "active"))
    try:
        assert main(["run", str(root / "w.toml"), "--results", str(root / "r"), "--no-plots"]) == 0
    finally:
        mp.undo()
    (folder,) = (root / "r").iterdir()
    return folder


def test_each_cell_records_when_its_phases_began(run):
    for record in (json.loads(p.read_text()) for p in (run / "cells").glob("*.json")):
        phases = record["ranks"][0]["phases"]
        assert [name for _, name in phases] == ["forward", "backward", "optimizer", "after"], record["cell_id"]
        times = [t for t, _ in phases]
        assert times == sorted(times) and times[-1] <= max(record["ranks"][0]["timeline"]["t_s"]) + 1.0


def test_other_is_split_into_parts_that_sum_to_it(run):
    results = pd.read_csv(run / "results.csv")
    named = results[[f"peak_mem_{k}_bytes" for k in ("params", "grads", "optim", "unsharded", "activations")]]
    parts = results[[f"peak_mem_other_{k}_bytes" for k in ("kept", "backward", "optimizer")]]
    assert (parts.sum(axis=1) == results["peak_mem_bytes"] - named.sum(axis=1)).all()
    ddp = results[results["cell_id"] == "ddp-ws1-fp32"].iloc[0]
    assert ddp["peak_mem_other_kept_bytes"] > 0  # DDP's gradient buckets, kept from the warm-up step


def test_the_timeline_marks_the_phases_and_tells_fsdp_configurations_apart(run, figures):  # noqa: F811
    from zerobench.analysis.plots import plot_run

    plot_run(run)
    fig = figures["memory_timeline.png"]
    panels = {ax.get_ylabel().split("\n")[0]: ax for ax in fig.axes}
    assert set(panels) == {"ddp", "impl-fsdp"}
    fsdp = {line.get_gid(): line for line in panels["impl-fsdp"].lines if line.get_gid()}
    assert set(fsdp) == {"impl-fsdp-ws1-fp32", "impl-fsdp-ws1-fp32-sharding_strategy=SHARD_GRAD_OP"}
    full, kept = fsdp["impl-fsdp-ws1-fp32"], fsdp["impl-fsdp-ws1-fp32-sharding_strategy=SHARD_GRAD_OP"]
    assert full.get_color() == kept.get_color() and full.get_linestyle() != kept.get_linestyle()
    for ax in panels.values():
        spans = [p for p in ax.patches if (p.get_gid() or "").startswith("phase:")]
        assert [p.get_gid() for p in spans] == ["phase:forward", "phase:backward", "phase:optimizer"]
        starts = [p.get_x() for p in spans]
        assert starts == sorted(starts) and 0 <= starts[0] and starts[-1] < 1
    assert not _unexplained(fig)
    assert not _unexplained(figures["peak_memory.png"])
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"forward phase", "backward phase", "optimizer phase"} <= set(labels)
