"""Many cells of one rank in one process, for ``estimate`` and ``predict``.

[Note: one process for many cells]
Each cell of ``estimate`` and ``predict`` is one rank of a fake world, run by the rank
session (zerobench/rank/session.py). A process of its own per configuration paid the
imports (torch, the engines, FSDP: seconds) again for each one, which was most of a
small workload's time: quickstart's 20 configurations took 72 s on a quiet machine. So
the parent hands every cell (a *job*: a configuration at one world size, and for the
estimate's depth extrapolation one depth) to one child process, which runs them in
turn: each in a fresh fake world (its process group made and destroyed around it, as
before), imports paid once. The child writes its rows as it goes and reports progress
with an estimate of the time left on its stderr, which the parent passes on (the
command prints the one total wall time at its end). A job that kills the child (a
crash, not an exception: those become its row) is reported failed with the child's last
words, and a new child takes the jobs after it.

The parent stays light (no engine is imported there), and the child is the one launcher's
(zerobench/harness/launch.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

PROGRESS = "progress: "


@dataclass(frozen=True)
class Job:
    """One cell to run: a configuration at one world size (and depth)."""

    engine: str
    dtype: str
    options: tuple
    world_size: int
    layers: int | None = None
    """run the model at this depth instead of its own (estimate's depth extrapolation)"""
    label: str = ""

    def to_json(self) -> dict:
        out = asdict(self)
        out["options"] = [list(kv) for kv in self.options]
        return out

    @classmethod
    def from_json(cls, raw: dict) -> "Job":
        return cls(raw["engine"], raw["dtype"], tuple(tuple(kv) for kv in raw["options"]), int(raw["world_size"]),
                   raw.get("layers"), raw.get("label", ""))

    def cell(self):
        from zerobench.spec.matrix import Cell

        return Cell(self.engine, self.world_size, self.dtype, self.options)


def run_jobs(module: str, workload, jobs: list[Job], args: list[str], env: dict,
             log: Callable[[str], None] = print, what: str = "process") -> list[dict]:
    """Run ``jobs`` in child processes of ``python -m module`` (as few as they allow);
    one row per job, in order. See [Note: one process for many cells]."""
    from zerobench.harness.launch import start_module

    rows: list[dict | None] = [None] * len(jobs)
    first = 0
    with tempfile.TemporaryDirectory(prefix="zerobench-jobs-") as tmp:
        tmp = Path(tmp)
        (tmp / "workload.json").write_text(json.dumps(workload.to_dict()))
        while first < len(jobs):
            todo = list(range(first, len(jobs)))
            (tmp / "jobs.json").write_text(json.dumps([jobs[i].to_json() for i in todo]))
            out = tmp / f"out-{first}.json"
            proc = start_module(module, ["--workload", str(tmp / "workload.json"), "--jobs", str(tmp / "jobs.json"),
                                         "--out", str(out), *args],
                                env=dict(env, OMP_NUM_THREADS="1"), stderr=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, text=True)
            tail: list[str] = []
            for line in proc.stderr:
                line = line.rstrip("\n")
                if line.startswith(PROGRESS):
                    log(line[len(PROGRESS):])
                elif line.strip():
                    tail = (tail + [line])[-20:]
            proc.wait()
            done = json.loads(out.read_text()) if out.exists() else []
            for k, row in enumerate(done):
                rows[todo[k]] = row
            first = todo[len(done)] if len(done) < len(todo) else len(jobs)
            if first < len(jobs):  # the child died running job ``first``
                last = (tail or ["(no output)"])[-1][:200]
                rows[first] = {"status": "skipped",
                               "reason": f"{what} failed (exit code {proc.returncode}): {last}"}
                first += 1
    return rows  # type: ignore[return-value]


def child_loop(argv_jobs: Path, out: Path, run_one: Callable[[Job], dict]) -> None:
    """The child's side: run every job of ``argv_jobs`` in turn, writing the rows to
    ``out`` after each, with a progress line and the time left on stderr."""
    from zerobench.runs.files import write_json_atomic

    jobs = [Job.from_json(raw) for raw in json.loads(Path(argv_jobs).read_text())]
    rows: list[dict] = []
    started = time.perf_counter()
    for i, job in enumerate(jobs, 1):
        t0 = time.perf_counter()
        rows.append(run_one(job))
        write_json_atomic(out, rows)
        now = time.perf_counter()
        left = (now - started) / i * (len(jobs) - i)
        status = rows[-1].get("status", "ok")
        print(f"{PROGRESS}[{i}/{len(jobs)}] {job.label or job.engine} ws{job.world_size}"
              f"{'' if job.layers is None else f' depth {job.layers}'}: {status} in {now - t0:.1f} s "
              f"(about {left:.0f} s left)", file=sys.stderr, flush=True)
