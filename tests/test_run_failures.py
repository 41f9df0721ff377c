"""A failed cell never stops the matrix, blames the right rank, and shows in the exit code.

Real runs of the harness in a subprocess (as a user runs it): one rank SIGKILLed in the
middle of a cell, and Ctrl-C in the middle of a run. Plus the pieces on their own:
errors full of brackets printed as plain text, and the order of blame.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from zerobench.analysis.summary import print_summary
from zerobench.harness.launch import describe_failure
from zerobench.harness.runner import _one_line
from zerobench.runs.folder import RunFolder
from zerobench.runs.tables import write_tables

GLOO_ERROR = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
              "Connection closed by peer [127.0.0.1]:29500 [bold] [/] [/red]")

# Long enough that the tests' signals land inside the first cell on a fast, quiet machine
# (500 steps took 1 s there); a signal ends it in seconds.
LONG = textwrap.dedent("""
    name = "long"
    [model]
    kind = "mlp"
    depth = 2
    width = 64
    [data]
    batch_size = 4
    warmup_steps = 1
    steps = 2000
    [run]
    timeout_s = 240
    reference = false
    [matrix]
    engine = ["ddp", "torch-zero1"]
    world_size = [2]
""")


def test_errors_with_brackets_print_as_plain_text(tmp_path):
    console = Console(record=True, width=200)
    record = {"cell_id": "ddp-ws2-fp32", "status": "failed", "error": f"rank 0 exited with code 1 first:\n{GLOO_ERROR}"}
    console.print(_one_line(record))
    assert "pair.cc:553] Connection closed by peer [127.0.0.1]:29500 [bold] [/] [/red]" in console.export_text()
    # the summary table of a run folder whose cell failed with that error
    run = tmp_path / "run"
    (run / "cells").mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"workload": "w", "cells": ["ddp-ws2-fp32"]}))
    config = {"engine": "ddp", "world_size": 2, "dtype": "fp32"}
    (run / "cells" / "ddp-ws2-fp32.json").write_text(json.dumps({**record, "config": config, "ranks": []}))
    write_tables(run)
    print_summary(run, console)
    assert "RuntimeError: [/__w/pytorch" in console.export_text()


def test_blame_goes_to_the_first_rank_to_die(tmp_path):
    folder = RunFolder(tmp_path)
    folder.logs_dir.mkdir()
    folder.log_path("c", 0).write_text("step 3\n")
    folder.log_path("c", 1).write_text(f"Traceback ...\n{GLOO_ERROR}\n")
    # rank 0 was SIGKILLed first; rank 1 then failed in a collective
    text = describe_failure(folder, "c", [-9, 1], deaths=[0, 1])
    assert text.startswith("rank 0 was killed by signal 9 (SIGKILL) first:")
    assert "then rank 1 exited with code 1: " + GLOO_ERROR in text
    # no order seen: a rank that raised goes before one killed by a signal (ours, after the grace)
    assert describe_failure(folder, "c", [-9, 1]).startswith("rank 1 exited with code 1 first:")


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "long.toml").write_text(LONG)
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    # Ctrl-C as a terminal delivers it: SIGINT's default disposition in the run, whatever
    # this process inherited (a background job of a non-interactive shell, as a CI script
    # may start pytest, has SIGINT ignored, and Python then never raises KeyboardInterrupt).
    proc = subprocess.Popen([sys.executable, "-m", "zerobench.cli", "run", str(tmp_path / "long.toml"),
                             "--results", str(tmp_path / "results"), "--no-plots"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, tmp_path / "results"


def _rank_pid(results: Path, rank: int, deadline_s: float = 60) -> int:
    """The pid of a running rank of this run, found by its torchrun environment."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"zerobench.worker" in cmd and str(results).encode() in cmd and f"RANK={rank}".encode() in env:
                time.sleep(2)  # into the cell (a kill at any point blames this rank all the same)
                return int(pid)
        time.sleep(0.2)
    raise AssertionError("rank never started")


def _no_ranks_left(results: Path) -> bool:
    left = subprocess.run(["pgrep", "-f", f"zerobench.worker --run-dir {results}"], capture_output=True, text=True)
    return left.stdout.strip() == ""


@pytest.mark.slow
def test_killed_rank_is_blamed_and_the_matrix_goes_on(tmp_path):
    """Rank 1, not rank 0: the harness once polled ranks in order and stopped at the first
    still running, so rank 1's death went unseen while rank 0 waited for it."""
    proc, results = _start(tmp_path)
    os.kill(_rank_pid(results, 1), signal.SIGKILL)
    out, _ = proc.communicate(timeout=280)
    assert proc.returncode == 1, out  # a cell failed: non-zero exit
    assert "Traceback" not in out and "MarkupError" not in out
    (run,) = results.iterdir()
    record = json.loads((run / "cells" / "ddp-ws2-fp32.json").read_text())
    assert record["status"] == "failed"
    assert record["error"].startswith("rank 1 was killed by signal 9 (SIGKILL) first:"), record["error"]
    assert json.loads((run / "cells" / "torch-zero1-ws2-fp32.json").read_text())["status"] == "ok"
    assert "cells: 1 ok, 1 failed, 0 skipped" in out
    assert _no_ranks_left(results)


@pytest.mark.slow
def test_ctrl_c_stops_the_ranks_and_leaves_a_resumable_run(tmp_path):
    proc, results = _start(tmp_path)
    _rank_pid(results, 1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=180)  # a hang detector: it exits in seconds on a quiet machine
    assert proc.returncode == 130, out
    assert "Traceback" not in out
    (run,) = results.iterdir()
    assert f"zerobench run --resume {run}" in out.replace("\n", "")
    assert not (run / "cells" / "ddp-ws2-fp32.json").exists()  # the cell in flight reruns on --resume
    assert _no_ranks_left(results)
