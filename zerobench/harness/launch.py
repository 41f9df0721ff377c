"""Starting rank processes: the ranks of one cell the way torchrun does, and the
one-rank processes of ``estimate``, ``predict`` and the GPU check.

Every rank process is started here (:func:`module_command`, :func:`code_env`): as
``python -P -m <module>`` with the harness's own code first on ``PYTHONPATH``, so a
rank always runs the ``zerobench`` and ``impl`` the harness runs, never a checkout in
the current folder. A cell's ranks are ``python -m zerobench.worker`` processes with
the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; zerobench/rank/protocol.py), so what runs here is exactly what runs under
torchrun on a cluster.

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
from typing import TYPE_CHECKING

from zerobench.rank.protocol import HARNESS_ENV, code_root

if TYPE_CHECKING:  # imported where used: start_module's callers stay light (no pandas)
    from zerobench.runs.folder import RunFolder

FAILURE_GRACE_S = 5.0  # how long peers of a failed rank get to exit on their own
POLL_S = 0.05


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


def module_command(module: str, args: list[str] = ()) -> list[str]:
    """``python -P -m module args``: ``-P`` keeps the current folder off ``sys.path``, so a
    checkout there cannot stand in for the harness's own code (see :func:`code_env`)."""
    return [sys.executable, "-P", "-m", module, *args]


def code_env(env: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``env`` (this process's environment by default) with the harness's code first on
    ``PYTHONPATH`` and ``extra`` set."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(code_root()), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **extra}


def start_module(module: str, args: list[str] = (), env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """Start ``python -P -m module args`` with :func:`code_env`."""
    return subprocess.Popen(module_command(module, args), env=code_env(env), **popen)


def rank_command(run_dir: Path, cell_id: str, device: str, profile: bool) -> list[str]:
    """The command of every rank of a cell: the worker's torchrun entry point."""
    args = ["--run-dir", str(run_dir), "--cell", cell_id, "--device", device]
    return module_command("zerobench.worker", args + ["--profile"] if profile else args)


def rank_env(rank: int, world_size: int, port: int, threads: int) -> dict[str, str]:
    """The torchrun environment of one rank, the harness's code first on PYTHONPATH
    (ranks import the same ``zerobench``/``impl`` as the harness) and its pid."""
    return code_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                    LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                    **{HARNESS_ENV: str(os.getpid())})


def launch_cell(run_dir: Path, cell_id: str, world_size: int, timeout_s: float, *, threads: int = 1,
                profile: bool = False, device: str = "auto") -> LaunchResult:
    """Run one cell's ranks to completion, a failure, or the timeout. Never leaves a
    rank process behind. Each rank's output goes to ``logs/<cell>.rank<r>.log``.

    Ranks die with the harness (a SIGKILLed ``zerobench run`` takes them along), so call
    this from the thread that lives as long as the run: on Linux the rank's parent-death
    signal follows the thread that started it."""
    from zerobench.runs.folder import RunFolder

    folder = RunFolder(Path(run_dir).absolute())
    folder.logs_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = rank_command(folder.root, cell_id, device, profile)
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    error = None
    deaths: list[int] = []  # failed ranks in the order they were seen to end: the first is to blame
    try:
        for rank in range(world_size):
            with open(folder.log_path(cell_id, rank), "w") as log:  # the child keeps its own descriptor
                try:
                    procs.append(subprocess.Popen(cmd, env=rank_env(rank, world_size, port, threads), stdout=log,
                                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
                except OSError as err:  # e.g. BlockingIOError: out of processes
                    error = (f"could not start rank {rank} of {world_size}: {err.strerror or err} "
                             f"({type(err).__name__}); the {len(procs)} started were stopped")
                    break
        if error is None:
            error = _watch(procs, deaths, start, timeout_s)
    finally:
        stopped_by_harness = []  # ranks the harness killed itself: not a cause, whatever their signal says
        for rank, p in enumerate(procs):
            if p.poll() is None:
                stopped_by_harness.append(rank)
                _kill_group(p)
    codes = [p.returncode for p in procs]
    if error is None and any(c != 0 for c in codes):
        error = describe_failure(folder, cell_id, codes, deaths, stopped_by_harness)
    return LaunchResult(error is None, error, time.monotonic() - start, codes)


def _watch(procs: list[subprocess.Popen], deaths: list[int], start: float, timeout_s: float) -> str | None:
    """Poll every rank until all have ended, one failed FAILURE_GRACE_S ago, or the
    timeout; append failed ranks to ``deaths`` as they are seen. Returns the timeout's
    error, else None.

    Every rank is polled on every round, so a rank that dies while another still runs
    is seen when it dies. Ranks seen dead in the same round are put signal first: a
    signal (kill -9, the OOM killer, a segfault) comes from outside, while a peer of a
    dead rank ends with an error of its own ("Connection closed by peer")."""
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        new = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in deaths]
        deaths += sorted(new, key=lambda r: (codes[r] > 0, r))
        if all(c is not None for c in codes):
            return None
        if failed_at is None and deaths:
            failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            return None
        if now - start > timeout_s:
            running = [r for r, c in enumerate(codes) if c is None]
            stopped = [r for r in running if _is_stopped(procs[r].pid)]
            if stopped:  # a SIGSTOPped rank holds up its peers: it is the one that stopped making progress
                others = [r for r in running if r not in stopped]
                return (f"timed out after {timeout_s:.0f} s (run.timeout_s): rank(s) {', '.join(map(str, stopped))} "
                        f"stopped (SIGSTOP or a debugger) and made no progress"
                        + (f"; rank(s) {', '.join(map(str, others))} still running" if others else ""))
            return (f"timed out after {timeout_s:.0f} s (run.timeout_s) with rank(s) "
                    f"{', '.join(map(str, running))} still running")
        time.sleep(POLL_S)


def _is_stopped(pid: int) -> bool:
    """Whether a process is stopped by a signal or traced (Linux; False where unknown)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0] in ("T", "t")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def describe_failure(folder: RunFolder, cell_id: str, codes: list[int | None], deaths: list[int] = (),
                     stopped_by_harness=()) -> str:
    """The rank that failed first, how it ended and the end of its log (in ``folder``);
    then the others.

    ``deaths`` lists failed ranks in the order they were seen to end. The first of them
    is the cause: its peers fail *because* it went away (gloo: "Connection closed by
    peer") or are killed by us after FAILURE_GRACE_S (signal 9 from the launcher), so
    they come second. Without an order (all ended between two polls), a rank that
    exited with an error of its own goes before one killed by a signal. A rank in
    ``stopped_by_harness`` (still running when the harness ended the cell) is said to
    have been stopped by the harness, never "killed by signal 9" as if something else had.
    """
    failed = [r for r, c in enumerate(codes) if c != 0]
    seen = [r for r in deaths if r in failed and r not in stopped_by_harness]
    rest = sorted((r for r in failed if r not in seen),
                  key=lambda r: (r in stopped_by_harness, codes[r] is None or codes[r] < 0, r))
    order = seen + rest
    first, *others = order
    lines = [f"rank {first} {_how(codes[first], first in stopped_by_harness, first)} first:",
             *_log_tail(folder, cell_id, first, 12)]
    for rank in others:
        tail = [] if rank in stopped_by_harness else _log_tail(folder, cell_id, rank, 1)
        lines.append(f"then rank {rank} {_how(codes[rank], rank in stopped_by_harness, first)}"
                     + (f": {tail[0]}" if tail else ""))
    return "\n".join(lines)


def _how(code: int | None, by_harness: bool = False, cause: int | None = None) -> str:
    if by_harness:
        return f"was stopped by the harness (SIGKILL) after rank {cause} failed" if cause is not None and \
            code is not None else "was stopped by the harness (SIGKILL)"
    if code is None:
        return "was still running"
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})" if -code in signal.valid_signals() \
            else f"was killed by signal {-code}"
    return f"exited with code {code}"


def _log_tail(folder: RunFolder, cell_id: str, rank: int, n: int) -> list[str]:
    try:
        text = folder.log_path(cell_id, rank).read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in text if line.strip()][-n:]
