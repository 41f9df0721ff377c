"""Many cells of one rank in one process, for ``estimate`` and ``predict``.

[Note: one process for many cells]
Each cell of ``estimate`` and ``predict`` is one rank of a fake world, run by the rank
session (zerobench/rank/session.py). A process of its own per configuration paid the
imports (torch, the engines, FSDP: seconds) again for each one, which was most of a
small workload's time: quickstart's 20 configurations took 72 s on a quiet machine. So
the parent hands every cell (a *job*: a configuration at one world size, and for the
estimate's depth extrapolation one depth) to one child process, which runs them in
turn: each in a fresh fake world (its process group made and destroyed around it, as
before), imports paid once. The child writes its rows as it goes and says on its stderr
which job ended, how, and in how long; the parent logs one line per job and advances
the command's one progress bar (zerobench/commands/progress.py, which shows the time
left). A job that kills the child (a crash, not an exception: those become its row) is
reported failed with the child's last words, and a new child takes the jobs after it.

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

#: How the child's stderr line that a job ended begins (JSON follows: job, status, seconds).
ENDED = "zerobench-job-ended: "


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
        from zerobench.spec.cell import Cell

        return Cell(self.engine, self.world_size, self.dtype, self.options)

    def describe(self) -> str:
        """How a progress line names the job: its label (or engine), world size and depth."""
        depth = "" if self.layers is None else f" depth {self.layers}"
        return f"{self.label or self.engine} ws{self.world_size}{depth}"


def run_jobs(module: str, workload, jobs: list[Job], args: list[str], env: dict,
             log: Callable[[str], None] = print, what: str = "process", progress=None) -> list[dict]:
    """Run ``jobs`` in child processes of ``python -m module`` (as few as they allow);
    one row per job, in order. Each job that ends is logged as one line and advances
    ``progress`` (zerobench.commands.progress.Progress, or None). See [Note: one process
    for many cells]."""
    from zerobench.harness.launch import start_module

    rows: list[dict | None] = [None] * len(jobs)
    if progress is not None:
        progress.set_total(len(jobs))
    if not jobs:
        return []

    def ended(index: int, status: str, how: str) -> None:
        log(f"[{index + 1}/{len(jobs)}] {jobs[index].describe()}: {status} {how}")
        if progress is not None:
            progress.advance(jobs[index].describe())

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
                if line.startswith(ENDED):
                    job = json.loads(line[len(ENDED):])
                    ended(todo[job["job"]], job["status"], f"in {job['seconds']:.1f} s")
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
                ended(first, "skipped", f"({what} failed)")
                first += 1
    return rows  # type: ignore[return-value]


def child_loop(argv_jobs: Path, out: Path, run_one: Callable[[Job], dict]) -> None:
    """The child's side: run every job of ``argv_jobs`` in turn, writing the rows to
    ``out`` after each and saying on stderr that it ended (for :func:`run_jobs`)."""
    from zerobench.runs.files import write_json_atomic

    jobs = [Job.from_json(raw) for raw in json.loads(Path(argv_jobs).read_text())]
    rows: list[dict] = []
    for i, job in enumerate(jobs):
        t0 = time.perf_counter()
        rows.append(run_one(job))
        write_json_atomic(out, rows)
        ended = {"job": i, "status": rows[-1].get("status", "ok"), "seconds": time.perf_counter() - t0}
        print(f"{ENDED}{json.dumps(ended)}", file=sys.stderr, flush=True)
