"""Many cells in one process (zerobench/whatif/jobs.py): rows in order, progress with the
time left, and a job that kills its process reported failed while the others run."""

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
    assert lines[0].startswith("[1/3] a ws2: ok in ") and "s left)" in lines[0]
    assert lines[-1].startswith("[1/1] b ws8: ok")  # the second child took the job after the crash
