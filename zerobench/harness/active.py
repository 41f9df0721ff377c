"""Which zerobench runs are active on this machine right now.

Two runs on one machine contend for its cores and memory bandwidth, so the timings of
both are off. Each ``zerobench run`` registers itself here for as long as it runs, and
looks for the others before the run and before each cell: it warns, and records what it
saw in meta.json and in the cell records (``concurrent_runs``).

The registry is a folder of one small file per running harness, ``<pid>.json``, which
its owner holds an exclusive ``flock`` on. A file nobody holds a lock on belongs to a
harness that died (even by SIGKILL: the kernel drops the lock), and is removed by the
next reader. The folder is shared by every user of the machine (mode 1777, like /tmp);
``ZEROBENCH_ACTIVE_DIR`` moves it (tests use that to stay apart from real runs).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # not POSIX: no registry, no warning
    fcntl = None

ACTIVE_DIR_ENV = "ZEROBENCH_ACTIVE_DIR"


def registry() -> Path:
    return Path(os.environ.get(ACTIVE_DIR_ENV) or Path(tempfile.gettempdir()) / "zerobench-active")


@contextlib.contextmanager
def register(run_dir: Path) -> Iterator[None]:
    """Mark this process as running ``run_dir`` until the block ends."""
    if fcntl is None:
        yield
        return
    folder = registry()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o1777)  # every user's runs contend with every other's
        path = folder / f"{os.getpid()}.json"
        pending = folder / f".{os.getpid()}.pending"  # locked before it is visible: see others()
        f = open(pending, "w")
    except OSError:  # a registry we cannot write: run anyway, unseen by others
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        json.dump({"pid": os.getpid(), "run_dir": str(Path(run_dir).absolute()),
                   "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}, f)
        f.flush()
        os.chmod(pending, 0o644)
        os.replace(pending, path)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        f.close()


def others() -> list[dict]:
    """The other runs active on this machine: pid, run_dir and start time of each."""
    folder = registry()
    if fcntl is None or not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("*.json")):
        if path.stem == str(os.getpid()):
            continue
        try:
            with open(path) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # held: its harness is running
                    found.append(json.loads(f.read() or "{}") or {"pid": int(path.stem)})
                    continue
                if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:  # not replaced by a new run meanwhile
                    path.unlink()  # nobody holds it: its harness is gone
        except (OSError, ValueError):
            continue
    return found


def describe(runs: list[dict]) -> str:
    """A warning line about ``runs`` (from :func:`others`)."""
    where = "; ".join(f"pid {r.get('pid')}: {r.get('run_dir', '?')}" for r in runs)
    return (f"another zerobench run is active on this machine ({where}): both runs' timings are contended "
            "(recorded as concurrent_runs)")
