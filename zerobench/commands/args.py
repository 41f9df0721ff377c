"""Arguments several subcommands share: a workload given by path or by name, a results
folder given by path or as ``latest``, and an output folder. Standard library only
(see [Note: one subcommand, one module] in zerobench/commands/__init__.py).

[Note: latest]
``latest`` means one thing in every command that takes a results folder: the newest
results folder of any kind (a run, an estimate or a prediction: zerobench.runs.kinds)
directly under ``results/``. ``latest:run``, ``latest:estimate`` and ``latest:predict``
name the newest of one kind, and ``DIR/latest`` or ``DIR/latest:KIND`` the newest under
``DIR`` (unless a folder of that name exists). A command that reads one kind only
(``analyze``, ``reference``, ``simulate``, ``run --resume``) refuses a ``latest`` that
names another kind, saying which ``latest:KIND`` to use. Folders are named
``<date>-<time>-<name>`` (zerobench.runs.files.new_stamped_dir), so the newest is the
greatest name; the modification time breaks ties between names of other shapes.
``zerobench latest`` prints the folder ``latest`` names (``--kind`` for ``latest:KIND``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerobench.choices import did_you_mean
from zerobench.runs.kinds import FOLDER_KINDS, folder_kind

LATEST = "latest"
DEFAULT_RESULTS = Path("results")
ALL_KINDS = tuple(FOLDER_KINDS)


class ArgumentError(ValueError):
    """A command-line value that cannot be used; the message names the option and what is allowed."""


def add_overrides(p) -> None:
    """``--set KEY=VALUE``, repeatable: a field of the workload changed without editing its
    file ([Note: overrides] in zerobench/spec/workload.py)."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="change a field of the workload, validated as the file is, e.g. --set data.steps=20 "
                        "--set matrix.engine=ddp,impl-fsdp (repeatable; commas make a list)")


def newest_folder(root: Path, kinds=ALL_KINDS) -> Path | None:
    """The newest folder directly under ``root`` of one of ``kinds`` ([Note: latest])."""
    try:
        found = [p for p in Path(root).iterdir() if p.is_dir() and folder_kind(p) in kinds]
    except OSError:
        return None
    return max(found, key=lambda p: (p.name, p.stat().st_mtime)) if found else None


def latest_kind(name: str) -> str | None | bool:
    """For the last part of a path: False when it is no ``latest``, None for ``latest``
    (any kind), the kind for ``latest:KIND``; ArgumentError for an unknown kind."""
    if name == LATEST:
        return None
    if not name.startswith(LATEST + ":"):
        return False
    kind = name.split(":", 1)[1]
    if kind not in FOLDER_KINDS:
        raise ArgumentError(f"{name}: {kind!r} is not a kind of results folder (allowed: {_latest_forms()})")
    return kind


def _latest_forms(kinds=ALL_KINDS) -> str:
    """The ``latest`` forms that name a folder of one of ``kinds``, whatever else is newer."""
    return ", ".join(([LATEST] if set(kinds) >= set(ALL_KINDS) else []) + [f"{LATEST}:{k}" for k in kinds])


def _kinds_text(kinds) -> str:
    """"a run folder", "a run, estimate or predict folder"."""
    kinds = list(kinds)
    names = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " or " + kinds[-1]
    return f"{_a(kinds[0])} {names} folder"


def _a(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def resolve_folder(text: str | Path, option: str, kinds=("run",), results: Path = DEFAULT_RESULTS) -> Path:
    """The folder a command-line value names: a path, or ``latest`` / ``latest:KIND`` /
    ``DIR/latest[:KIND]`` ([Note: latest]); ``kinds``: the kinds of folder the command
    reads. A folder of another kind is refused, naming the option and what is allowed."""
    path = Path(text)
    if str(text) == "":
        raise ArgumentError(f"{option}: an empty path is not allowed (allowed: a folder, or {_latest_forms(kinds)})")
    try:
        wanted = latest_kind(path.name)
    except ArgumentError as err:
        raise ArgumentError(f"{option}: {err}") from None
    if wanted is False or path.exists():
        if not path.exists():
            raise ArgumentError(f"{option}: {text}: no such folder{_near_names(path, kinds, results)}")
        if not path.is_dir():
            raise ArgumentError(f"{option}: {text}: not a folder (allowed: {_kinds_text(kinds)}, or "
                                f"{_latest_forms(kinds)})")
        kind = folder_kind(path)
        if kind is not None and kind not in kinds:
            raise ArgumentError(f"{option}: {text} is {_a(kind)} {kind} folder (allowed: {_kinds_text(kinds)}, or "
                                f"{_latest_forms(kinds)})")
        return path
    root = Path(results) if str(text) == path.name else path.parent
    newest = newest_folder(root, ALL_KINDS if wanted is None else (wanted,))
    if newest is None:
        what = "results folder" if wanted is None else f"{wanted} folder"
        raise ArgumentError(f"{option}: no {what} under {root}/ to be the {path.name}")
    kind = folder_kind(newest)
    if kind not in kinds:
        forms = " or ".join(f"{root}/{LATEST}:{k}" if str(text) != path.name else f"{LATEST}:{k}" for k in kinds)
        raise ArgumentError(f"{option}: {text} names {newest}, {_a(kind)} {kind} folder (allowed: "
                            f"{_kinds_text(kinds)}; {forms} names the newest one)")
    return newest


def _near_names(path: Path, kinds, results: Path) -> str:
    """"; did you mean latest?" for a misspelt ``latest`` form, or a folder close to the
    one named: beside it, or under ``results`` for a bare name; "" when none is close."""
    parent = path.parent if str(path) != path.name else Path(results)
    try:
        beside = {p.name: str(p) for p in sorted(parent.iterdir()) if p.is_dir()}
    except OSError:
        beside = {}
    shown = {form: form for form in _latest_forms(kinds).split(", ")} | beside
    return did_you_mean(path.name, list(shown), show=lambda name: shown.get(name, name))


def config_id(text: str) -> str:
    """argparse type of estimate's and predict's ``--config``: a configuration id as given,
    or a cell id's configuration (``impl-fsdp-ws8-bf16`` -> ``impl-fsdp-bf16``), so every
    command takes what ``zerobench cells`` and the tables print ([Note: one way to pick
    cells])."""
    from zerobench.spec.cell import CellId

    found = CellId.try_parse(text)
    return found.config if found is not None and found.world_size is not None else text


# [Note: one way to pick cells]
# Every command that works on some of a folder's or a workload's cells takes --cell ID
# (repeatable), with --cells as its other spelling; estimate and predict, which work on
# configurations (a cell without its world size) at the world sizes they are given, take
# --config too, and read a cell id as its configuration.


def results_root(text: str) -> Path:
    """argparse type of ``--results``: a folder to make result folders in; never empty
    (an empty path would put them in the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path is not allowed (allowed: a folder, default results)")
    return Path(text)


def check_results_folder(path: Path, option: str = "--results") -> None:
    """ArgumentError naming ``option`` when result folders cannot be made under ``path``
    (a file there, or no write permission): checked before any work."""

    if path.exists() and not path.is_dir():
        raise ArgumentError(f"{option}: {path} is not a folder (allowed: a folder to make result folders in, "
                            f"default {DEFAULT_RESULTS})")
    _check_ancestor(path, option, f"{path} cannot be made", f"no result folder can be made in {path}")


def output_file(text: str) -> Path:
    """argparse type of an output file option (``--csv``, ``--plot``, ...): never empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path is not allowed (allowed: a file path)")
    return Path(text)


def check_writable(path: Path, option: str) -> None:
    """ArgumentError naming ``option`` when a file cannot be written at ``path``: checked
    before any work, so a long command does not fail at its end."""

    if path.is_dir():
        raise ArgumentError(f"{option}: {path} is a folder (allowed: a file path)")
    _check_ancestor(path.parent, option, f"{path} cannot be written", f"{path} cannot be written")


def _check_ancestor(path: Path, option: str, not_a_folder: str, not_writable: str) -> None:
    """ArgumentError naming ``option`` unless the first existing ancestor of ``path`` (the
    folders below it will be made) is a writable folder; the messages end with what then
    cannot be done."""
    import os

    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ArgumentError(f"{option}: {parent} is not a folder, so {not_a_folder}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArgumentError(f"{option}: {parent} is not writable, so {not_writable}")
