"""``zerobench show`` reads every kind of results folder ``zerobench list`` lists -- a run,
an estimate, a prediction -- and an interrupted run shows what finished and how to
resume, without being counted as a failure. Synthetic run folders written here; the
committed ones under results/ (and every width) are tests/test_render.py's."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.runs import another_run_registered
from tests.helpers.tables import whole
from zerobench.cli import main
from zerobench.harness import active

ROOT = Path(__file__).resolve().parents[1]
CELLS = ["ddp-ws2-fp32", "torch-fsdp1-ws2-fp32-sharding_strategy=SHARD_GRAD_OP", "impl-fsdp-ws2-fp32"]


@pytest.fixture(autouse=True)
def own_registry(tmp_path, monkeypatch):
    """Our own registry of active runs: the machine's real runs stay out of these tests."""
    monkeypatch.setenv(active.ACTIVE_DIR_ENV, str(tmp_path / "active"))
    monkeypatch.setenv("COLUMNS", "100")


def _record(cell_id: str, step: float, peak: int) -> dict:
    engine = cell_id.split("-ws")[0]
    metrics = {"step_time_s": step, "peak_mem_bytes": peak, "comm_total_bytes": 5 * 2**20, "comm_calls": 4}
    return {"cell_id": cell_id, "status": "ok", "config": {"engine": engine, "world_size": 2, "dtype": "fp32"},
            "ranks": [{"rank": r, "metrics": metrics, "step_times": [step] * 3, "losses": [2.0] * 3} for r in (0, 1)],
            "loss_max_abs_diff_ref": 1.2e-7, "cell_wall_s": 3.0}


def interrupted_run(root: Path, finished: int) -> Path:
    """A run folder as Ctrl-C leaves it: meta.json lists every cell, cells/ holds the
    records of the first ``finished`` (none: no cells/ at all, as before the first cell)."""
    run = root / "20261126-120000-quickstart"
    run.mkdir(parents=True)
    (run / "workload.json").write_text(json.dumps({"name": "quickstart"}))
    (run / "meta.json").write_text(json.dumps({"workload": "quickstart", "cells": CELLS,
                                               "date": "2026-11-26T12:00:00+00:00"}))
    if finished:
        (run / "cells").mkdir()
        for k, cell in enumerate(CELLS[:finished]):
            (run / "cells" / f"{cell}.json").write_text(json.dumps(_record(cell, 0.02 * (k + 1), (30 - k) * 2**20)))
    return run


def _list_row(out: str, name: str) -> list[str]:
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == name:
            return cells
    raise AssertionError(f"{name} not listed:\n{out}")


def test_an_interrupted_run_shows_what_finished_and_how_to_resume(tmp_path, capsys):
    run = interrupted_run(tmp_path / "results", finished=1)
    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ddp-ws2-fp32\s+ok\s+20\s", out, flags=re.M)  # the finished cell, its step in ms
    assert "impl-fsdp-ws2-fp32" in out  # named among those not run
    assert "interrupted: 1 of 3 cell(s) finished, 2 not run" in " ".join(out.split())
    assert f"\n  zerobench run --resume {run}\n" in out  # on a line of its own, to copy
    assert main(["list", "--results", str(tmp_path / "results")]) == 0
    row = _list_row(capsys.readouterr().out, run.name)
    assert row[1] == "run" and row[4:9] == ["3", "1", "0", "0", "2"]  # cells, ok, failed, skipped, not run


def test_a_run_stopped_before_its_first_cell_is_not_a_failed_one(tmp_path, capsys):
    run = interrupted_run(tmp_path / "results", finished=0)
    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out
    assert "no cell has finished yet" in out and "0 of 3 cell(s) finished, 3 not run" in " ".join(out.split())
    assert f"zerobench run --resume {run}" in out
    assert main(["list", "--results", str(tmp_path / "results")]) == 0
    row = _list_row(capsys.readouterr().out, run.name)
    assert row[4:9] == ["3", "0", "0", "0", "3"]  # once listed as "1 failed"


def test_a_run_in_progress_says_so_instead_of_interrupted(tmp_path, capsys):
    run = interrupted_run(tmp_path / "results", finished=1)
    with another_run_registered(run) as holder:
        assert main(["show", str(run)]) == 0
        out = capsys.readouterr().out
    assert f"running: 2 of 3 cell(s) still to run (pid {holder.pid}" in " ".join(out.split())
    assert "interrupted" not in out


def test_a_finished_run_says_nothing_about_resuming(tmp_path, capsys):
    run = interrupted_run(tmp_path / "results", finished=3)
    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out
    assert "--resume" not in out and "interrupted" not in out
    for cell in CELLS:
        assert whole(out, cell)
    assert "cells is missing" not in out


def test_a_folder_without_cells_says_its_table_is_read_as_saved(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    from zerobench.runs.folder import RunFolder

    run = interrupted_run(tmp_path / "results", finished=3)
    RunFolder(run).write_tables()  # as the harness does; then cells/ goes, as in a baseline
    shutil.rmtree(run / "cells")
    assert main(["show", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"note: {run / 'cells'} is missing (as in curated runs and baselines), so this was read from " \
           "results.csv as saved: its cells cannot be rebuilt or resumed" in out


@pytest.mark.parametrize("folder, expect", [
    ("results/curated/20261124-085853-llama3-8b-zero-estimate", ["per-rank peak GiB", "model states per rank, GiB"]),
    ("results/curated/20261121-165230-quickstart", ["peak MiB", "comm MiB/step"]),
    ("results/curated/20261124-085132-llama3-8b-zero-predict", ["active GiB", "predicted on the virtual GPU"]),
    ("results/baselines/predict-ci", ["active MiB", "h100-sxm"]),
])
def test_show_reads_every_kind_of_folder_in_units_that_fit(folder, expect, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # headers on one line
    assert main(["show", str(ROOT / folder)]) == 0
    out = capsys.readouterr().out
    joined = " ".join(out.split())
    for words in expect:
        assert words in joined, words
    assert " GB" not in out  # one unit family: binary


def test_latest_in_show_is_the_newest_folder_of_any_kind(tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    run = interrupted_run(tmp_path / "results", finished=3)
    shutil.copytree(ROOT / "results" / "baselines" / "predict-ci", tmp_path / "results" / "20261127-000000-ci-predict")
    assert main(["show", "latest"]) == 0
    assert "predicted on the virtual GPU" in capsys.readouterr().out
    assert main(["show", "latest:run"]) == 0
    assert run.name in capsys.readouterr().out
    assert main(["analyze", "latest"]) == 2  # analyze reads runs: the newest folder is a prediction
    assert "latest:run names the newest one" in capsys.readouterr().err


def test_a_prediction_without_flop_counts_says_why_there_is_no_mfu(capsys):
    assert main(["show", str(ROOT / "results" / "baselines" / "predict-ci")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # predict-ci is a gpt: MFU shown; its units are counts or fractions, never "3.0"
    assert "MFU" in out
    import pandas as pd

    from zerobench.whatif.predict.report import mfu_notes

    frame = pd.read_csv(ROOT / "results" / "baselines" / "predict-ci" / "predict.csv")
    assert mfu_notes(frame.assign(mfu=float("nan"), tflops_per_gpu=float("nan")), "mlp") == [
        "MFU: not shown: the model (mlp) has no FLOP count per token (MFU is defined for gpt and llama models: "
        "[Note: model FLOPs] in zerobench/spec/flops.py)"]
    fp32 = frame.assign(dtype="fp32")
    assert mfu_notes(fp32)[0].startswith("MFU of fp32 cells is over h100-sxm's fp32 peak")
