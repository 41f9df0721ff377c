"""Starting the ranks of one cell on this machine, the way torchrun does.

Each rank is a fresh ``python -m zerobench.worker`` process with the torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
so what runs here is exactly what runs under torchrun on a cluster.

[Note: why subprocesses]
Measured on the 2-core CI machine (torch 2.13, November 2026): spawn costs 3.3-4.2 s per
world-2 cell, forkserver 1.5-2.1 s, fork 0.06 s but hangs when children run
multi-threaded OpenMP after the parent did. A plain subprocess costs about what spawn
does, but it is the torchrun protocol itself (no launcher of our own), it isolates
each cell completely (a crash, a hang, an OOM kill or leaked memory cannot touch the
next cell), and each rank sits in its own process group so that a timeout kills
everything it started. Results come back through files, never pipes or queues.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

FAILURE_GRACE_S = 5.0  # how long peers of a failed rank get to exit on their own


@dataclass
class LaunchResult:
    ok: bool
    error: str | None
    wall_s: float
    exit_codes: list[int | None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cell(run_dir: Path, cell_id: str, world_size: int, timeout_s: float, *, threads: int = 1,
                profile: bool = False, device: str = "auto") -> LaunchResult:
    """Run one cell's ranks to completion, a failure, or the timeout. Never leaves a
    rank process behind. Each rank's output goes to ``logs/<cell>.rank<r>.log``."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "zerobench.worker", "--run-dir", str(run_dir), "--cell", cell_id, "--device", device]
    if profile:
        cmd.append("--profile")
    procs, files = [], []
    start = time.monotonic()
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        log = open(logs / f"{cell_id}.rank{rank}.log", "w")
        files.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True))
    error = None
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now - start > timeout_s:
                error = f"timed out after {timeout_s:.0f} s (run.timeout_s)"
                break
            if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
        for f in files:
            f.close()
    codes = [p.returncode for p in procs]
    if error is None and any(c != 0 for c in codes):
        error = _describe_failure(logs, cell_id, codes)
    return LaunchResult(error is None, error, time.monotonic() - start, codes)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _describe_failure(logs: Path, cell_id: str, codes: list[int | None]) -> str:
    """The first failing rank, how it ended, and the end of what it printed."""
    # A rank that raised exits 1; its peers are then killed by us (-9) or fail in a
    # collective. Report a rank that failed on its own if there is one.
    order = sorted(range(len(codes)), key=lambda r: (codes[r] in (0, -signal.SIGKILL), r))
    rank = order[0]
    code = codes[rank]
    if code is not None and code < 0:
        how = f"killed by signal {-code}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    else:
        how = f"exited with code {code}"
    text = (logs / f"{cell_id}.rank{rank}.log").read_text(errors="replace").strip().splitlines()
    tail = [line for line in text if line.strip()][-12:]
    return f"rank {rank} {how}:\n" + "\n".join(tail)
