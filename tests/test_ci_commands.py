"""The CI gates have one source, .ci/gate: the docs and the example workflows show
exactly its commands, each command parses, and the comparisons run.

A block of .ci/gate is the lines between ``# begin: NAME`` and ``# end: NAME``; a
document shows it as the ```bash block right after a ``<!-- ci-gate: NAME -->`` line; a
workflow runs it as consecutive lines of one GitHub step's ``run`` or one GitLab job's
``script``. Commands are compared after joining continuation lines and collapsing
whitespace, nothing else. ``.ci/run`` runs the whole file after the tests, on a fresh run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from zerobench.cli import build_parser

ROOT = Path(__file__).parents[1]
GATE = ROOT / ".ci" / "gate"
DOCS = (ROOT / "README.md", ROOT / "docs" / "ci.md")
GITHUB = ROOT / "examples" / "ci" / "github-actions.yml"
GITLAB = ROOT / "examples" / "ci" / "gitlab-ci.yml"
REGENERATE_PREDICT = ROOT / "scripts" / "regenerate-predict-baseline"
GATES = ("cpu-run-gate", "predict-gate")


def commands(text: str) -> list[str]:
    """Shell commands of a script: continuation lines joined, blank and comment lines
    dropped, runs of whitespace collapsed."""
    out, pending = [], ""
    for line in text.splitlines():
        line = line.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line and not line.startswith("#"):
            out.append(" ".join(line.split()))
    return out


def gate_blocks() -> dict[str, list[str]]:
    text = GATE.read_text()
    found = re.findall(r"^# begin: (\S+)\n(.*?)^# end: \1$", text, flags=re.M | re.S)
    return {name: commands(body) for name, body in found}


def doc_blocks(path: Path) -> dict[str, list[str]]:
    found = re.findall(r"^<!-- ci-gate: (\S+) -->\n```bash\n(.*?)^```$", path.read_text(), flags=re.M | re.S)
    return {name: commands(body) for name, body in found}


def _contains_run(haystack: list[str], needle: list[str]) -> bool:
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def test_the_gate_file_has_its_blocks_and_ci_runs_it():
    blocks = gate_blocks()
    assert set(blocks) == set(GATES)
    assert all(blocks.values())
    assert GATE.stat().st_mode & 0o111, ".ci/gate must be executable"
    assert ".ci/gate" in commands((ROOT / ".ci" / "run").read_text())


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_show_exactly_the_gates_commands(doc):
    shown = doc_blocks(doc)
    for name, block in gate_blocks().items():
        assert name in shown, f"{doc.name} does not show the {name} block of .ci/gate (<!-- ci-gate: {name} -->)"
        assert shown[name] == block, f"{doc.name} shows other commands than .ci/gate's {name} block"


def test_every_zerobench_command_of_the_gate_parses():
    parser = build_parser()
    seen = 0
    for block in gate_blocks().values():
        for command in block:
            argv = shlex.split(re.sub(r'"\$\w+"', "results/ci/x", command))
            if argv[0] != "zerobench":
                continue
            parser.parse_args(argv[1:])  # SystemExit (exit 2) on an unknown option
            seen += 1
    assert seen >= 2


def _compare_command(block: list[str]) -> list[str]:
    (command,) = [c for c in block if c.startswith("zerobench compare ")]
    return shlex.split(command)


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("name", GATES)
def test_the_gates_comparison_runs_as_written(name, tmp_path):
    """The block's compare command, run by bash in a scratch folder that has the
    repository's baselines, with its folder variable set to the baseline itself: it must
    pass and write its reports where the workflows look for them."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "baselines").symlink_to(ROOT / "results" / "baselines")
    argv = _compare_command(gate_blocks()[name])
    baseline = argv[2]
    (command,) = [c for c in gate_blocks()[name] if c.startswith("zerobench compare ")]
    (variable,) = re.findall(r'"\$(\w+)"', command)
    proc = subprocess.run(["bash", "-c", f'{variable}={shlex.quote(baseline)}; {command}'], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASS")
    junit = ET.parse(tmp_path / _option(argv, "--junit-xml")).getroot()
    assert junit.get("failures") == "0" and junit.get("errors") == "0" and int(junit.get("tests")) > 0
    assert (tmp_path / _option(argv, "--markdown")).read_text().startswith("## zerobench compare: PASS")


def _github_steps() -> list[dict]:
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load(GITHUB.read_text())
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def _gitlab_jobs() -> dict[str, dict]:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(GITLAB.read_text())
    return {name: job for name, job in config.items() if isinstance(job, dict) and "script" in job}


@pytest.mark.parametrize("name", GATES)
def test_the_github_workflow_runs_the_gate_and_publishes_its_reports(name):
    block = gate_blocks()[name]
    argv = _compare_command(block)
    steps = _github_steps()
    assert any(_contains_run(commands(step.get("run", "")), block) for step in steps), \
        f"no step of {GITHUB.name} runs the {name} block of .ci/gate"
    summary = [s for s in steps if "GITHUB_STEP_SUMMARY" in s.get("run", "")]
    assert any(_option(argv, "--markdown") in s["run"] and s.get("if") for s in summary)
    junit = [s for s in steps if "junit" in s.get("uses", "")]
    assert any(s["with"]["report_paths"] == _option(argv, "--junit-xml") and s.get("if") for s in junit)


@pytest.mark.parametrize("name", GATES)
def test_the_gitlab_job_runs_the_gate_and_publishes_its_reports(name):
    block = gate_blocks()[name]
    argv = _compare_command(block)
    jobs = _gitlab_jobs()
    assert name in jobs, f"{GITLAB.name} has no job {name}"
    job = jobs[name]
    assert commands("\n".join(job["script"])) == block
    assert job["artifacts"]["reports"]["junit"] == _option(argv, "--junit-xml")
    assert job["artifacts"]["when"] == "always"
    assert _option(argv, "--markdown") in job["artifacts"]["paths"]
    assert any(_option(argv, "--markdown") in line for line in job["after_script"])


def test_the_predict_baseline_is_regenerated_with_the_gates_own_prediction():
    (predict,) = [c for c in gate_blocks()["predict-gate"] if c.startswith("zerobench predict ")]
    regenerate = [c for c in commands(REGENERATE_PREDICT.read_text()) if c.startswith("zerobench predict ")]
    assert len(regenerate) == 1
    def same(command: str) -> str:  # where it writes differs
        return re.sub(r"--results \S+", "--results R", command)

    assert same(regenerate[0]) == same(predict)
    argv = _compare_command(gate_blocks()["predict-gate"])
    assert f"results/baselines/{Path(argv[2]).name}/" in REGENERATE_PREDICT.read_text()
    assert REGENERATE_PREDICT.stat().st_mode & 0o111
