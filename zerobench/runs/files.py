"""Atomic writes: a file is either whole or absent, even if the run is killed mid-write.

Each writer writes a temporary file in the same folder, flushes it to disk and
renames it over the destination (``os.replace`` is atomic on POSIX filesystems).
The file gets the mode any new file gets under the process's umask (``mkstemp``
alone would make every results file 0600).
"""

from __future__ import annotations

import datetime as _dt
import itertools
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable


def new_stamped_dir(root: str | Path, name: str) -> Path:
    """Create and return a new folder ``<root>/<date-time>-<name>``. It is made by
    ``mkdir``, which fails when it exists, so two started in the same second never share
    one: the second gets ``-2`` (and so on). Raises ``OSError`` where it cannot be made."""
    root = Path(root)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    for suffix in itertools.count(1):
        folder = root / (f"{stamp}-{name}" + (f"-{suffix}" if suffix > 1 else ""))
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def write_atomic(path: str | Path, write: Callable[[Any], None], mode: str = "w") -> None:
    """Call ``write(fileobj)`` on a temporary file, then move it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_UMASK_LOCK = threading.Lock()  # os.umask can only be read by setting it


def _umask() -> int:
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_atomic(path, lambda f: json.dump(obj, f, indent=1, default=_default))


def write_csv_atomic(path: str | Path, frame) -> None:
    write_atomic(path, lambda f: frame.to_csv(f, index=False))


def _default(value):
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def print_and_write(text: str, out: str | Path | None = None) -> None:
    """A report printed, and written atomically to ``out`` as well when one is given (a
    command's ``--out``)."""
    import sys

    sys.stdout.write(text)
    if out:
        write_atomic(out, lambda f: f.write(text))
