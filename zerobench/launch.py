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
    deaths: list[int] = []  # ranks in the order we saw them end with a failure: the first is to blame
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            deaths += [r for r, p in enumerate(procs) if p.returncode not in (None, 0) and r not in deaths]
            if failed_at is None and deaths:
                failed_at = now
            if now - start > timeout_s:
                running = [r for r, p in enumerate(procs) if p.poll() is None]
                error = (f"timed out after {timeout_s:.0f} s (run.timeout_s) with rank(s) "
                         f"{', '.join(map(str, running))} still running")
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
        error = describe_failure(logs, cell_id, codes, deaths)
    return LaunchResult(error is None, error, time.monotonic() - start, codes)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def describe_failure(logs: Path, cell_id: str, codes: list[int | None], deaths: list[int] = ()) -> str:
    """The rank that failed first, how it ended and the end of its log; then the others.

    ``deaths`` lists failed ranks in the order they were seen to end. The first of them
    is the cause: its peers fail *because* it went away (gloo: "Connection closed by
    peer") or are killed by us after FAILURE_GRACE_S (signal 9 from the launcher), so
    they come second. Without an order (all ended between two polls), a rank that
    exited with an error of its own goes before one killed by a signal.
    """
    failed = [r for r, c in enumerate(codes) if c != 0]
    seen = [r for r in deaths if r in failed]
    rest = sorted((r for r in failed if r not in seen), key=lambda r: (codes[r] is None or codes[r] < 0, r))
    order = seen + rest
    first, *others = order
    lines = [f"rank {first} {_how(codes[first])} first:", *_log_tail(logs, cell_id, first, 12)]
    for rank in others:
        tail = _log_tail(logs, cell_id, rank, 1)
        lines.append(f"then rank {rank} {_how(codes[rank])}" + (f": {tail[0]}" if tail else ""))
    return "\n".join(lines)


def _how(code: int | None) -> str:
    if code is None:
        return "was still running"
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})" if -code in signal.valid_signals() \
            else f"was killed by signal {-code}"
    return f"exited with code {code}"


def _log_tail(logs: Path, cell_id: str, rank: int, n: int) -> list[str]:
    try:
        text = (logs / f"{cell_id}.rank{rank}.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in text if line.strip()][-n:]
