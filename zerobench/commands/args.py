"""Arguments several subcommands share: a workload given by path or by name, a run
folder given by path or as ``latest``, and an output folder. Standard library only
(see [Note: one subcommand, one module] in zerobench/commands/__init__.py).

[Note: latest]
Wherever a command takes a results folder, ``latest`` names the newest folder directly
under ``results/`` that the command can read, and ``DIR/latest`` the newest under
``DIR`` (unless a folder of that name exists). Folders are named ``<date>-<time>-<name>``
(zerobench.runs.files.new_stamped_dir), so the newest is the greatest name; the
modification time breaks ties between names of other shapes. ``zerobench latest``
prints the folder it names.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerobench.runs.kinds import FOLDER_KINDS, folder_kind

LATEST = "latest"
DEFAULT_RESULTS = Path("results")


class ArgumentError(ValueError):
    """A command-line value that cannot be used; the message names the option and what is allowed."""


def add_overrides(p) -> None:
    """``--set KEY=VALUE``, repeatable: a field of the workload changed without editing its
    file ([Note: overrides] in zerobench/spec/workload.py)."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="change a field of the workload, validated as the file is, e.g. --set data.steps=20 "
                        "--set matrix.engine=ddp,impl-fsdp (repeatable; commas make a list)")


def newest_folder(root: Path, kinds=tuple(FOLDER_KINDS)) -> Path | None:
    """The newest folder directly under ``root`` of one of ``kinds`` ([Note: latest])."""
    try:
        found = [p for p in Path(root).iterdir() if p.is_dir() and folder_kind(p) in kinds]
    except OSError:
        return None
    return max(found, key=lambda p: (p.name, p.stat().st_mtime)) if found else None


def resolve_folder(text: str | Path, option: str, kinds=("run",), results: Path = DEFAULT_RESULTS) -> Path:
    """The folder a command-line value names: a path, or ``latest`` / ``DIR/latest``."""
    path = Path(text)
    if str(text) == "":
        raise ArgumentError(f"{option}: an empty path is not allowed (allowed: a folder, or {LATEST})")
    if path.name != LATEST or path.exists():
        if not path.exists():
            raise ArgumentError(f"{option}: {text}: no such folder")
        if not path.is_dir():
            raise ArgumentError(f"{option}: {text}: not a folder (allowed: a results folder, or {LATEST})")
        return path
    root = Path(results) if str(text) == LATEST else path.parent
    newest = newest_folder(root, kinds)
    if newest is None:
        what = " or ".join(f"{k} folder" for k in kinds)
        raise ArgumentError(f"{option}: no {what} under {root}/ to be the latest")
    return newest


def results_root(text: str) -> Path:
    """argparse type of ``--results``: a folder to make result folders in; never empty
    (an empty path would put them in the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path is not allowed (allowed: a folder, default results)")
    return Path(text)


def check_results_folder(path: Path, option: str = "--results") -> None:
    """ArgumentError naming ``option`` when result folders cannot be made under ``path``
    (a file there, or no write permission): checked before any work."""
    import os

    if path.exists() and not path.is_dir():
        raise ArgumentError(f"{option}: {path} is not a folder (allowed: a folder to make result folders in, "
                            f"default {DEFAULT_RESULTS})")
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the first existing ancestor: the folders below it will be made
    if not parent.is_dir():
        raise ArgumentError(f"{option}: {parent} is not a folder, so {path} cannot be made")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArgumentError(f"{option}: {parent} is not writable, so no result folder can be made in {path}")


def output_file(text: str) -> Path:
    """argparse type of an output file option (``--csv``, ``--plot``, ...): never empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path is not allowed (allowed: a file path)")
    return Path(text)


def check_writable(path: Path, option: str) -> None:
    """ArgumentError naming ``option`` when a file cannot be written at ``path``: checked
    before any work, so a long command does not fail at its end."""
    import os

    if path.is_dir():
        raise ArgumentError(f"{option}: {path} is a folder (allowed: a file path)")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the first existing ancestor: the folders below it will be made
    if not parent.is_dir():
        raise ArgumentError(f"{option}: {parent} is not a folder, so {path} cannot be written")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArgumentError(f"{option}: {parent} is not writable, so {path} cannot be written")
