"""Atomic writes leave whole files or nothing; --resume skips finished cells."""

import json
import os

import pytest

from zerobench.runs.files import write_atomic, write_json_atomic


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "out.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert os.listdir(tmp_path) == ["out.json"]  # no temporary file left behind


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")

    def explode(f):
        f.write("half of the new con")
        raise KeyboardInterrupt  # as when a run is killed mid-write

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, explode)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]


def test_atomic_write_follows_the_umask(tmp_path):
    """A results file is as readable as any other file the user makes (mkstemp alone makes 0600)."""
    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "a.json", {"a": 1})
        os.umask(0o077)
        write_json_atomic(tmp_path / "b.json", {"b": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600
