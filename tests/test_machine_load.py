"""Noise made visible ([Note: machine load], [Note: ratio spread]): what the machine did
during a run is recorded, a loaded run says so, and a step-time ratio carries its spread."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers.runs import TINY
from zerobench.analysis.summary import folder_notes, with_reference_ratios
from zerobench.cli import main
from zerobench.harness import active
from zerobench.instruments import load
from zerobench.runs.tables import summary

ROOT = Path(__file__).resolve().parents[1]


def _sample(wall, busy, own, cpus=2, loadavg=(1.0, 1.0, 1.0)):
    return load.LoadSample(wall_s=wall, loadavg=loadavg, busy_s=busy, own_s=own, cpus=cpus)


def test_other_processes_cpu_is_the_machines_busy_time_less_the_runs_own():
    # 10 s of wall time: the CPUs were busy 17 s, 12 of them the run's (harness and ranks)
    out = load.between(_sample(100.0, 500.0, 40.0), _sample(110.0, 517.0, 52.0, loadavg=(2.5, 1.5, 1.0)))
    assert out == {"wall_s": 10.0, "load_start": (1.0, 1.0, 1.0), "load_end": (2.5, 1.5, 1.0),
                   "other_cpu_cores": 0.5, "cpus": 2}
    assert load.between(_sample(0.0, None, 0.0), _sample(1.0, None, 1.0))["other_cpu_cores"] is None  # no /proc/stat


def test_busy_time_counts_only_the_cpus_this_process_may_use(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 300 5000 10 0 0 0 0 0\n"
                    "cpu0 100 0 50 2000 5 0 0 0 0 0\n"
                    "cpu1 200 0 50 2000 5 0 0 7 0 0\n"
                    "cpu2 600 0 200 1000 0 0 0 0 0 0\n"
                    "intr 12345\n")
    monkeypatch.setattr(load.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(load.os, "sysconf", lambda name: 100)
    assert load._busy_seconds(stat) == pytest.approx((150 + 250) / 100)  # cpu2 is another cgroup's; steal left out


@pytest.mark.parametrize("cells, loaded", [
    ([{"other_cpu_cores": 0.1, "wall_s": 5.0}, {"other_cpu_cores": 0.3, "wall_s": 5.0}], False),  # 0.2 <= 0.5
    ([{"other_cpu_cores": 0.2, "wall_s": 5.0}, {"other_cpu_cores": 1.6, "wall_s": 5.0}], True),  # 0.9 > 0.5
    ([{"other_cpu_cores": None, "wall_s": 5.0}], False),  # nothing measured: nothing claimed
])
def test_a_run_is_loaded_when_others_keep_a_quarter_of_the_cores_busy(cells, loaded):
    start, end = _sample(0.0, 0.0, 0.0), _sample(10.0, 0.0, 0.0, loadavg=(3.0, 2.0, 1.0))
    summary = load.summarize(cells, start, end)
    assert summary["loaded"] is loaded and summary["loaded_above_cores"] == 0.5
    line = load.verdict(summary)
    assert (line is not None) is loaded
    if loaded:
        assert line.startswith("warning: a loaded machine: other processes kept 0.90 of its 2 cores busy on average")
        assert "1.60 at the worst cell; loaded above 0.5, 25% of the cores" in line


def test_show_says_a_run_was_measured_on_a_loaded_machine(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(ROOT / "results" / "baselines" / "cpu-quickstart", run)
    meta = json.loads((run / "meta.json").read_text())
    meta.pop("machine_load", None)  # a run that recorded no load (or a quiet one): no warning
    (run / "meta.json").write_text(json.dumps(meta))
    assert not any("loaded machine" in n for n in folder_notes(run))
    meta["machine_load"] = load.summarize([{"other_cpu_cores": 1.2, "wall_s": 3.0, "cpus": 2}],
                                          _sample(0.0, 0.0, 0.0), _sample(3.0, 0.0, 0.0))
    (run / "meta.json").write_text(json.dumps(meta))
    assert main(["show", str(run)]) == 0
    assert "warning: a loaded machine: other processes kept 1.20 of its 2 cores" in capsys.readouterr().out


def test_the_step_time_ratio_carries_the_spread_of_every_pair_of_steps():
    results = pd.DataFrame({"cell_id": ["ddp-ws2-fp32"] * 2 + ["x-ws2-fp32"] * 2, "rank": [0, 1, 0, 1],
                            "world_size": 2, "dtype": "fp32", "engine": ["ddp", "ddp", "x", "x"], "status": "ok",
                            "error": None, "step_time_s": [1.0, 1.0, 2.0, 2.0], "peak_mem_bytes": [1, 1, 1, 1]})
    # a step's time is the median over its ranks: ddp's steps 1, 1, 2; x's 2, 2, 2.5
    steps = pd.DataFrame({"cell_id": ["ddp-ws2-fp32"] * 6 + ["x-ws2-fp32"] * 6, "rank": [0, 0, 0, 1, 1, 1] * 2,
                          "step": [0, 1, 2] * 4,
                          "step_time_s": [1, 1, 2, 1, 1, 2, 2, 2, 2, 2, 2, 3]})
    cells = with_reference_ratios(summary(results), results, steps).set_index("cell_id")
    # x's steps 2, 2, 2.5 against ddp's 1, 1, 2: nine ratios 2, 2, 1, 2, 2, 1, 2.5, 2.5, 1.25
    ratios = pd.Series([2, 2, 1, 2, 2, 1, 2.5, 2.5, 1.25])
    assert cells.loc["x-ws2-fp32", "step_time_x_ref"] == 2.0
    assert cells.loc["x-ws2-fp32", "step_time_x_ref_p10"] == pytest.approx(ratios.quantile(0.1))
    assert cells.loc["x-ws2-fp32", "step_time_x_ref_p90"] == pytest.approx(ratios.quantile(0.9))
    assert cells.loc["ddp-ws2-fp32", "step_time_x_ref_p10"] < 1 < cells.loc["ddp-ws2-fp32", "step_time_x_ref_p90"]
    no_steps = with_reference_ratios(summary(results), results)
    assert no_steps["step_time_x_ref_p10"].isna().all()


def test_a_real_run_records_the_machine_load_in_its_cells_and_meta(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(active.ACTIVE_DIR_ENV, str(tmp_path / "active"))
    (tmp_path / "w.toml").write_text(TINY.replace("[matrix]", "reference = false\n[matrix]"))
    assert main(["run", str(tmp_path / "w.toml"), "--results", str(tmp_path / "r"), "--no-plots"]) == 0
    (run,) = (tmp_path / "r").iterdir()
    cell = json.loads((run / "cells" / "ddp-ws1-fp32.json").read_text())["machine_load"]
    meta = json.loads((run / "meta.json").read_text())["machine_load"]
    assert cell["cpus"] == meta["cpus"] == load.cpus() and cell["wall_s"] > 0
    assert len(cell["load_start"]) == len(meta["load_end"]) == 3
    if Path("/proc/stat").exists():
        assert 0 <= cell["other_cpu_cores"] <= cell["cpus"] and meta["cells_sampled"] == 1
        assert meta["other_cpu_cores"] == pytest.approx(cell["other_cpu_cores"], abs=1e-3)
    assert meta["loaded"] == (meta["other_cpu_cores"] is not None and meta["other_cpu_cores"] > meta["cpus"] / 4)
    out = capsys.readouterr().out
    assert ("loaded machine" in out) == meta["loaded"]  # said at the end of the run, or not
