"""Documented times come from a measurement: every duration the README and docs quote
between ``<!-- time: NAME -->`` marks is what scripts/measure-times wrote to
results/times/times.json (with the machine's load), and its commands are the documented
ones. Nothing here measures: the script does, and takes minutes."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zerobench.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "measure-times"


@pytest.fixture(scope="module")
def script():
    loader = importlib.machinery.SourceFileLoader("measure_times", str(SCRIPT))
    spec = importlib.util.spec_from_loader("measure_times", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["measure_times"] = module  # its dataclass looks its module up
    loader.exec_module(module)
    yield module
    del sys.modules["measure_times"]


def test_the_docs_quote_the_measured_times():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_every_quote_names_a_measured_entry_with_its_load(script):
    quotes = script.quoted()
    names = {name for _, name, _ in quotes}
    assert {"quickstart", "ci-run", "predict-gate"} <= names  # README's and docs/ci.md's run times
    times = script.load_times()
    for page, name, text in quotes:
        record = times[name]
        assert record["exit_code"] == 0 and record["wall_s"] > 0
        assert f"at load {record['load_mean']:.1f}" in text and f"{record['wall_s']:.0f} s" in text, (page, text)


def test_a_figure_edited_by_hand_is_caught(script, tmp_path):
    for page in script.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    times = {"quickstart": {"wall_s": 231.4, "cores": 2, "load_mean": 1.92, "exit_code": 0}}
    readme = tmp_path / "README.md"
    readme.write_text(re.sub(r"<!-- time: quickstart -->.*?<!-- /time -->",
                             "<!-- time: quickstart -->about 2 minutes<!-- /time -->", readme.read_text(), flags=re.S))
    bad = script.mismatches(times, tmp_path)
    assert any("README.md: quickstart reads 'about 2 minutes'" in b for b in bad), bad
    assert any("ci-run was never measured" in b for b in bad), bad
    assert "README.md" in script.rewrite_pages(times, tmp_path)
    assert "about 4 minutes (231 s on 2 cores at load 1.9, `scripts/measure-times quickstart`)" in readme.read_text()


def test_the_measured_commands_are_the_documented_ones(script):
    """Each entry's zerobench commands parse as the command line parses them, and the
    gate entries are .ci/gate's commands."""
    gate = (ROOT / ".ci" / "gate").read_text()
    for name, entry in script.ENTRIES.items():
        for command in entry.commands:
            argv = shlex.split(command.replace("{tmp}", "/tmp/x"))
            if argv[0] == "zerobench":
                build_parser().parse_args(argv[1:])
    assert "zerobench predict workloads/ci-predict.toml --world-sizes 8 --gpu h100-sxm --link pcie4" in gate
    assert script.ENTRIES["predict-gate"].commands[0].startswith(
        "zerobench predict workloads/ci-predict.toml --world-sizes 8 --gpu h100-sxm --link pcie4")
    assert "zerobench run workloads/quickstart.toml --results results/ci/run --no-plots" in gate
    assert script.ENTRIES["ci-run"].commands[0] == "zerobench run workloads/quickstart.toml --results {tmp} --no-plots"


def test_quotes_round_to_what_a_reader_needs(script):
    assert script.about(12.4) == "about 12 s"
    assert script.about(174) == "about 3 minutes" and script.about(316) == "about 5 minutes"
    assert script.about(95) == "about 95 s" and script.about(60 * 1.4) == "about 84 s"
    record = json.loads(json.dumps({"wall_s": 62.0, "cores": 2, "load_mean": 3.04}))
    assert script.quote("x", record) == "62 s (on 2 cores at load 3.0, `scripts/measure-times x`)"
    record["wall_s"] = 435.8
    assert script.quote("x", record) == "about 7 minutes (436 s on 2 cores at load 3.0, `scripts/measure-times x`)"


def test_an_unknown_entry_is_refused(script, capsys):
    assert script.main(["quikstart"]) == 2
    assert "ENTRY: quikstart is not an entry (allowed: quickstart, ci-run" in capsys.readouterr().err
