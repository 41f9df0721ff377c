"""Many cells in one process (zerobench/whatif/jobs.py): rows in order, a line per job and
the one progress bar advanced as each ends, and a job that kills its process reported
failed while the others run."""

from __future__ import annotations

import os

from zerobench.spec.workload import load_workload
from zerobench.whatif.jobs import Job, run_jobs


def test_every_job_gets_its_row_and_a_crash_takes_only_its_own(tmp_path):
    w = load_workload("workloads/quickstart.toml")
    jobs = [Job("ddp", "fp32", (), 2, label="a"), Job("ddp", "fp32", (), 4, label="crash"),
            Job("ddp", "fp32", (), 8, label="b")]
    lines: list[str] = []
    rows = run_jobs("tests.helpers.jobs_child", w, jobs, [], dict(os.environ), lines.append, what="test process")
    assert rows[0] == {"status": "ok", "seen": "a@2"} and rows[2] == {"status": "ok", "seen": "b@8"}
    assert rows[1]["status"] == "skipped"
    assert "test process failed (exit code 3): boom: the engine crashed" in rows[1]["reason"]
    # one line per job, numbered among all of them, the crashed one included; the command
    # prints the one wall time, not run_jobs
    assert lines[0].startswith("[1/3] a ws2: ok in ") and lines[0].endswith(" s")
    assert lines[1] == "[2/3] crash ws4: skipped (test process failed)"
    assert lines[2].startswith("[3/3] b ws8: ok in ")  # the second child took the job after the crash
    assert len(lines) == 3


def test_each_ended_job_advances_the_one_progress_bar(tmp_path):
    class Bar:  # what zerobench.commands.progress.Progress offers run_jobs
        def __init__(self):
            self.total, self.advanced = None, []

        def set_total(self, total):
            self.total = total

        def advance(self, description=None, steps=1):
            self.advanced.append(description)

    w = load_workload("workloads/quickstart.toml")
    jobs = [Job("ddp", "fp32", (), 2, label="a"), Job("ddp", "fp32", (), 4, layers=2, label="crash"),
            Job("ddp", "fp32", (), 8, label="b")]
    bar = Bar()
    run_jobs("tests.helpers.jobs_child", w, jobs, [], dict(os.environ), lambda line: None, progress=bar)
    assert bar.total == 3
    assert bar.advanced == ["a ws2", "crash ws4 depth 2", "b ws8"]
