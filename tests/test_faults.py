"""Faults of the harness itself: the right rank blamed, ranks that never outlive the
harness, run folders that never collide, work bounded outside the cell timeout, damaged
run folders, and ranks that run the harness's own code.

The ranks here are small stand-in scripts (``launch.rank_command`` replaced) or a
one-cell world-size-1 run, so that each test takes seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.runs import TINY, another_run_registered
from zerobench.cli import main
from zerobench.harness import active, launch, preflight
from zerobench.harness.reference import ReferenceFailed, reference_losses
from zerobench.harness.runner import finished, new_run_dir, run_metadata
from zerobench.runs.folder import RunFolder
from zerobench.spec.cell import Cell
from zerobench.spec.workload import parse_workload

ROOT = Path(__file__).resolve().parents[1]
#: every cell skipped before any rank starts (HYBRID_SHARD needs two ranks)
SKIPPED = textwrap.dedent("""
    name = "skipped"
    [matrix]
    engine = ["torch-fsdp1"]
    world_size = [1]
    dtype = ["fp32", "bf16"]
    sharding_strategy = ["HYBRID_SHARD"]
""")


@pytest.fixture(autouse=True)
def own_registry(tmp_path, monkeypatch):
    """Keep these tests' runs out of the machine's registry of active runs, and theirs out of ours."""
    monkeypatch.setenv(active.ACTIVE_DIR_ENV, str(tmp_path / "active"))


def _fake_ranks(monkeypatch, script: str) -> None:
    """Ranks that run ``script`` (RANK is in their environment) instead of the worker."""
    monkeypatch.setattr(launch, "rank_command", lambda *a, **k: [sys.executable, "-c", textwrap.dedent(script)])


# -- 1. blame -------------------------------------------------------------------------


def test_a_rank_other_than_0_dying_is_blamed(tmp_path, monkeypatch):
    """Rank 1 dies while rank 0 runs on: rank 1 is the cause (rank 0 was once blamed, or a timeout)."""
    monkeypatch.setattr(launch, "FAILURE_GRACE_S", 1.0)
    _fake_ranks(monkeypatch, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            time.sleep(0.5)
            print("rank 1 gives up"); sys.exit(7)
        time.sleep(60)
    """)
    result = launch.launch_cell(tmp_path, "c", 2, timeout_s=30)
    assert not result.ok and result.exit_codes == [-9, 7]
    assert result.error.startswith("rank 1 exited with code 7 first:\nrank 1 gives up"), result.error
    assert "then rank 0 was stopped by the harness (SIGKILL) after rank 1 failed" in result.error


def test_a_rank_killed_from_outside_is_told_from_one_the_harness_stopped(tmp_path, monkeypatch):
    """kill -9 of rank 1: rank 1 was killed by signal 9; rank 0, still waiting, was stopped by
    the harness (it once read "killed by signal 9" as well, as if both had been)."""
    monkeypatch.setattr(launch, "FAILURE_GRACE_S", 1.0)
    _fake_ranks(monkeypatch, """
        import os, signal, time
        if os.environ["RANK"] == "1":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    result = launch.launch_cell(tmp_path, "c", 2, timeout_s=30)
    assert result.exit_codes == [-9, -9]
    first, then = result.error.splitlines()
    assert first == "rank 1 was killed by signal 9 (SIGKILL) first:"
    assert then == "then rank 0 was stopped by the harness (SIGKILL) after rank 1 failed"


def test_a_stopped_rank_is_named_at_the_timeout(tmp_path, monkeypatch):
    _fake_ranks(monkeypatch, """
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
    """)
    result = launch.launch_cell(tmp_path, "c", 3, timeout_s=2)
    assert not result.ok
    assert result.error == ("timed out after 2 s (run.timeout_s): rank(s) 1 stopped (SIGSTOP or a debugger) and "
                            "made no progress; rank(s) 0, 2 still running")


def test_a_rank_that_cannot_start_leaves_no_rank_behind(tmp_path, monkeypatch):
    """Out of processes (BlockingIOError) at rank 1: rank 0 is stopped, the cell fails, nothing raises."""
    _fake_ranks(monkeypatch, "import time; time.sleep(60)")
    started = []
    real = subprocess.Popen

    def popen(*args, **kwargs):
        if started:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        started.append(real(*args, **kwargs))
        return started[0]

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    result = launch.launch_cell(tmp_path, "c", 2, timeout_s=30)
    assert not result.ok and result.error.startswith("could not start rank 1 of 2: Resource temporarily unavailable")
    assert started[0].poll() == -signal.SIGKILL


# -- 2. ranks die with the harness ------------------------------------------------------


def test_resume_reruns_a_record_its_harness_never_accepted():
    ranks = [{"rank": 0, "losses": [1.0]}]
    assert finished({"status": "ok", "ranks": ranks})  # torchrun: no harness
    assert finished({"status": "ok", "ranks": ranks, "harness_pid": 12, "cell_wall_s": 3.0})
    assert not finished({"status": "ok", "ranks": ranks, "harness_pid": 12})  # written by an orphan
    assert not finished({"status": "failed", "ranks": []}) and not finished(None)


def _ranks_of(results: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"zerobench.worker --run-dir {results}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.slow
def test_sigkill_of_the_harness_takes_its_ranks_along(tmp_path):
    (tmp_path / "long.toml").write_text(TINY.replace("steps = 2", "steps = 100000").replace("[1]", "[2]")
                                        .replace("memory_pass = false", "memory_pass = false\nreference = false"))
    results = tmp_path / "results"
    harness = subprocess.Popen([sys.executable, "-m", "zerobench.cli", "run", str(tmp_path / "long.toml"),
                                "--results", str(results), "--no-plots"], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while len(_ranks_of(results)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_ranks_of(results)) == 2, "the ranks never started"
    time.sleep(1)
    harness.kill()
    harness.wait()
    deadline = time.monotonic() + 30  # the kernel kills them at once; a loaded machine reaps them slowly
    while _ranks_of(results) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ranks_of(results) == [], "ranks outlived their harness"
    (run,) = results.iterdir()
    assert not list((run / "cells").glob("*.json"))  # and no record for --resume to accept


# -- 3. run folders and concurrent runs ---------------------------------------------------


def test_two_runs_in_the_same_second_get_two_folders(tmp_path, monkeypatch):
    import datetime as dt

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 11, 23, 12, 0, 0)

    monkeypatch.setattr("zerobench.harness.runner._dt.datetime", Frozen)
    workload = parse_workload({"name": "w"})
    first, second = new_run_dir(tmp_path, workload), new_run_dir(tmp_path, workload)
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name == "20261123-120000-w-2"


def test_another_active_run_is_seen_and_recorded(tmp_path):
    with another_run_registered(tmp_path / "other-run") as holder:
        seen = active.others()
        assert [(r["pid"], r["run_dir"]) for r in seen] == [(holder.pid, str(tmp_path / "other-run"))]
        workload = parse_workload({"name": "w"})
        assert run_metadata(workload, [Cell("ddp", 2, "fp32")], "cpu")["concurrent_runs"] == seen
    assert active.others() == []  # a SIGKILLed run holds no lock: it is gone from the registry
    assert list((tmp_path / "active").iterdir()) == []


# -- 4. bounded work outside the cell ---------------------------------------------------------


def test_world_size_the_machine_cannot_hold_is_refused_naming_both_numbers(monkeypatch):
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 8.0 * 2**30)
    workload = parse_workload({"name": "w"})
    cell = Cell("ddp", 1000, "fp32")
    assert preflight.refusal(workload, cell, "cpu") == (
        "preflight: world size 1000 needs 1000 rank processes of at least 200 MiB each (Python and torch, before "
        "any model): 195.3 GiB, more than this machine's 8.0 GiB; not started")
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 1e15)
    monkeypatch.setattr(preflight, "process_limit", lambda: 512.0)
    assert "needs at least 4,000 processes and threads (4 per rank, run.threads_per_rank = 1), more than this " \
           "user's limit of 512" in preflight.refusal(workload, cell, "cpu")
    many = dataclasses.replace(workload, run=dataclasses.replace(workload.run, threads_per_rank=8))
    assert "needs at least 11,000 processes and threads (11 per rank, run.threads_per_rank = 8)" in \
        preflight.refusal(many, cell, "cpu")  # each rank's compute threads count too


def test_the_reference_is_bounded_by_the_cell_timeout():
    workload = parse_workload({"name": "w", "model": {"width": 8, "depth": 1}, "data": {"steps": 10**12}})
    started = time.monotonic()
    with pytest.raises(ReferenceFailed, match=r"did not finish within 1 s \(run.timeout_s\): \d+ of 1000000000002"):
        reference_losses(workload, 2, timeout_s=1.0)
    assert time.monotonic() - started < 60  # not a timing assertion: it returned at all


def test_a_run_too_big_for_the_harness_fails_its_cells_and_ends(tmp_path, capsys):
    """Once: batch_size = 1e11 crashed the harness with a traceback in its reference."""
    (tmp_path / "big.toml").write_text('name = "big"\n[model]\nwidth = 8\ndepth = 1\n[data]\n'
                                       'batch_size = 100000000000\n[matrix]\nworld_size = [1]\n')
    assert main(["run", str(tmp_path / "big.toml"), "--results", str(tmp_path / "r"), "--no-plots"]) == 1
    (run,) = (tmp_path / "r").iterdir()
    record = RunFolder(run).read_cell("ddp-ws1-fp32")
    assert record["status"] == "failed" and record["error"].startswith("preflight: ddp-ws1-fp32 needs at least ")
    assert "for one step over its batch of 100,000,000,000 samples" in record["error"]
    assert "Traceback" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_reference_past_the_timeout_is_given_up_and_the_cell_still_runs(tmp_path):
    """Once: steps = 1e12 hung the harness in its reference, past every timeout."""
    (tmp_path / "long.toml").write_text(TINY.replace("steps = 2", "steps = 1000000000000")
                                        .replace("timeout_s = 120", "timeout_s = 3"))
    assert main(["run", str(tmp_path / "long.toml"), "--results", str(tmp_path / "r"), "--no-plots"]) == 1
    (run,) = (tmp_path / "r").iterdir()
    record = RunFolder(run).read_cell("ddp-ws1-fp32")
    assert record["reference_error"].startswith("the single-process loss reference at world size 1 did not "
                                                "finish within 3 s (run.timeout_s)"), record
    assert record["status"] == "failed" and record["error"].startswith("timed out after 3 s"), record["error"]


# -- 5 and 6. damaged folders and bad commands --------------------------------------------------


def _skipped_run(tmp_path) -> Path:
    (tmp_path / "s.toml").write_text(SKIPPED)
    assert main(["run", str(tmp_path / "s.toml"), "--results", str(tmp_path / "r"), "--no-plots"]) == 0
    (run,) = (tmp_path / "r").iterdir()
    return run


def test_resume_with_a_damaged_cell_keeps_meta_and_its_cells(tmp_path):
    run = _skipped_run(tmp_path)
    meta = json.loads((run / "meta.json").read_text())
    first, second = meta["cells"]
    (run / "cells" / f"{first}.json").write_text('{"cell_id": "torch-fsdp1-ws1-fp32", "sta')  # truncated
    assert main(["run", "--resume", str(run), "--cell", first, "--no-plots"]) == 0
    after = json.loads((run / "meta.json").read_text())
    assert after["cells"] == [first, second]  # --cell never shrinks the run's list
    assert after["date"] == meta["date"] and after["command"] == meta["command"]  # the run's own, kept
    assert len(after["resumes"]) == 1 and after["resumes"][0]["date"] >= meta["date"]
    assert RunFolder(run).read_cell(first)["status"] == "skipped"


def test_a_failed_resume_leaves_the_folder_as_it_was(tmp_path, capsys):
    run = _skipped_run(tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["run", "--resume", str(run), "--device", "cuda", "--no-plots"]) == 2
    assert "--device cuda: no GPU is visible" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_bad_folders_for_run_are_errors_not_tracebacks(tmp_path, capsys):
    (tmp_path / "t.toml").write_text(TINY)
    (tmp_path / "file").write_text("")
    assert main(["run", str(tmp_path / "t.toml"), "--results", str(tmp_path / "file" / "r")]) == 2
    assert f"--results: {tmp_path / 'file'} is not a folder, so {tmp_path / 'file' / 'r'} cannot be made" in \
        capsys.readouterr().err
    assert main(["run", str(tmp_path / "t.toml"), "--results", str(tmp_path / "r"), "--device", "cuda"]) == 2
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_one_damaged_cell_record_does_not_break_the_others(tmp_path, capsys):
    run = _skipped_run(tmp_path)
    first, second = json.loads((run / "meta.json").read_text())["cells"]
    bad = run / "cells" / f"{first}.json"
    bad.write_bytes(b"\xff\xfe not json")
    assert main(["show", str(run)]) == 0
    assert main(["list", "--results", str(tmp_path / "r")]) == 0
    assert main(["compare", str(run), str(run)]) in (0, 1)  # compared, the damaged cell failed in both
    capsys.readouterr()
    rows = RunFolder(run).results()
    damaged = rows[rows["cell_id"] == first]
    assert list(damaged["status"]) == ["failed"] and str(bad) in damaged["error"].iloc[0]
    assert list(rows.loc[rows["cell_id"] == second, "status"]) == ["skipped"]
    (run / "meta.json").write_text("{")
    assert main(["compare", str(run), str(run)]) == 2
    assert f"{run / 'meta.json'}: damaged" in capsys.readouterr().out


def test_a_truncated_results_csv_is_rebuilt_from_cells(tmp_path):
    run = _skipped_run(tmp_path)
    whole = (run / "results.csv").read_text()
    (run / "results.csv").write_text(whole[: len(whole) - 25])  # cut inside the last row
    os.utime(run / "results.csv")  # newer than every cell record: only its contents give it away
    rows = RunFolder(run).results()  # read from cells/, in memory: a reader writes nothing
    assert sorted(rows["cell_id"]) == sorted(json.loads((run / "meta.json").read_text())["cells"])
    assert (run / "results.csv").read_text() == whole[: len(whole) - 25]
    assert main(["reference", str(run)]) == 0  # the explicit repair rewrites it
    assert (run / "results.csv").read_text() == whole


# -- 6 and 7. the ranks run the harness's code; losses that diverge ----------------------------


@pytest.mark.slow
def test_ranks_run_the_harness_code_and_a_diverging_cell_is_not_ok(tmp_path, monkeypatch):
    """Another checkout in the current folder once stood in for the harness's code in the ranks."""
    fake = tmp_path / "cwd" / "zerobench"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "worker.py").write_text("raise SystemExit('the zerobench of the current folder ran')\n")
    (tmp_path / "w.toml").write_text(TINY.replace("[optimizer]", "").replace("[run]", "[optimizer]\nlr = 1e30\n[run]"))
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["run", str(tmp_path / "w.toml"), "--results", str(tmp_path / "r"), "--no-plots"]) == 1
    (run,) = (tmp_path / "r").iterdir()
    record = RunFolder(run).read_cell("ddp-ws1-fp32")
    assert record["code_root"] == str(ROOT) == json.loads((run / "meta.json").read_text())["code_root"]
    assert record["status"] == "failed" and record["error"].startswith("diverged: rank 0's loss is "), record["error"]
    assert record["ranks"] and record["cell_wall_s"] > 0  # measured all the same
