"""Every shell block of the README and of docs/ci.md (and of the pages the README moved its
details to) is run here or checked here, so that none can drift from the code.

[Note: checked shell blocks]
Each fenced ``bash`` block is split into commands (comments dropped, ``\\`` continuations
joined, ``&&`` and ``|`` split). A ``zerobench`` command is parsed by the command line's own
parser, with placeholders (``RUN``, ``$RUN``, ``results/<run-id>``, ``WORKLOAD``) standing
for real folders, and the workload it names must exist; the cheap read-only ones (``cells``,
``engines``, ``list``, ``latest``, ``show``, ``plot``, ``--help``) are run for real, in a
scratch folder holding the shipped workloads, the ``toml`` blocks of the same page (a block
with ``name = "X"`` is saved as ``workloads/<name>.toml``) and a copy of a curated run. ``pip``
lines must name extras that pyproject.toml has and the torch that .ci/run installs;
``pytest`` lines, paths and markers that exist; ``torchrun ... -m zerobench.worker``, options
the worker takes; a script, one that exists; ``python`` a module or script that exists
and answers ``--help``. Any other command fails the test until it is
given a check here. Running what takes minutes (``run``, ``estimate``, ``predict``) is
left to the tests of those commands and to .ci/run.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from zerobench.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/ci.md", "docs/running.md", "docs/results.md", "docs/workloads.md"]
RUN_FOR_REAL = {"cells", "engines", "list", "latest", "show", "plot"}
#: commands of plain shell whose arguments are not zerobench's to check
SHELL = {"ls", "sort", "tail", "cat", "cp", "rm", "git", "cd", "mkdir", "echo", "export", "python3", ".", "source",
         "pytest-benchmark"}
CURATED = "20261121-165230-quickstart"
PLACEHOLDERS = [  # (pattern, replacement): what a documented placeholder stands for here
    (r'"?\$RUN"?', f"results/{CURATED}"), (r"\bresults/<run-id>", f"results/{CURATED}"),
    (r"(?<![\w/.-])RUN(?![\w/.=-])", f"results/{CURATED}"), (r"\bBASELINE\b", "results/baselines/cpu-quickstart"),
    (r"\bWORKLOAD\b", "quickstart"), (r"\$HEAD", "localhost"), (r'"?\$GITHUB_STEP_SUMMARY"?', "summary.md"),
]


def blocks(page: str, language: str) -> list[str]:
    text = (ROOT / page).read_text()
    return [m.group(1) for m in re.finditer(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)]


def commands(block: str) -> list[list[str]]:
    """The commands of a shell block, each as argv (see [Note: checked shell blocks])."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        for pattern, value in PLACEHOLDERS:
            line = re.sub(pattern, value, line)
        line = re.sub(r"\s>>?\s*\S+", "", line)  # a redirection's target is not a command
        for part in re.split(r"\s&&\s|\s\|\s", line):
            if part.strip():
                argv = shlex.split(part)
                if re.fullmatch(r"[A-Z_]+=\$\(.*", argv[0]):  # RUN=$(ls -d ... | sort | tail -1)
                    argv[0] = argv[0].split("$(", 1)[1]
                    argv = [a.rstrip(")") for a in argv if a.rstrip(")")]
                out.append(argv)
    return out


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder like a user's checkout after a first run: the shipped workloads, the pages'
    own workloads, a run under results/."""
    root = tmp_path_factory.mktemp("docs")
    shutil.copytree(ROOT / "workloads", root / "workloads")
    for page in PAGES:
        for block in blocks(page, "toml"):
            name = tomllib.loads(block).get("name")
            if name:
                (root / "workloads" / f"{name}.toml").write_text(block)
    shutil.copytree(ROOT / "results" / "curated" / CURATED, root / "results" / CURATED)
    shutil.copytree(ROOT / "results" / "baselines", root / "results" / "baselines")
    return root


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _ci_torch() -> str:
    return re.search(r"torch==([\w.+]+)", (ROOT / ".ci" / "run").read_text()).group(1)


def check_zerobench(argv: list[str], cwd: Path) -> None:
    args = argv[1:]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            parsed = build_parser().parse_args(args)
        except SystemExit as stop:
            assert stop.code == 0 and "--help" in args, f"{' '.join(argv)}: {err.getvalue()}"
            return
    workload = getattr(parsed, "workload", None)
    if workload is not None and parsed.command in ("run", "estimate", "predict", "cells"):
        from zerobench.spec.workload import WorkloadError, find_workload

        with contextlib.chdir(cwd):
            try:
                find_workload(workload)
            except WorkloadError as err:
                raise AssertionError(f"{' '.join(argv)}: no workload {workload} ({err})") from None
    if parsed.command in RUN_FOR_REAL:
        with contextlib.chdir(cwd), contextlib.redirect_stdout(io.StringIO()) as out, \
                contextlib.redirect_stderr(io.StringIO()) as err:
            code = main(args)
        assert code == 0, f"{' '.join(argv)} exited {code}: {err.getvalue()}{out.getvalue()[-2000:]}"


def check_pip(argv: list[str]) -> None:
    extras = set(_pyproject()["project"]["optional-dependencies"])
    for arg in argv[2:]:
        if arg.startswith(".[") or arg.startswith("-e"):
            continue
        m = re.fullmatch(r"torch==([\w.+]+)", arg)
        if m:
            assert m.group(1) == _ci_torch(), f"{' '.join(argv)}: .ci/run installs torch=={_ci_torch()}"
    for spec in re.findall(r"\.\[([\w,]+)\]", " ".join(argv)):
        assert set(spec.split(",")) <= extras, f"{' '.join(argv)}: pyproject.toml's extras are {sorted(extras)}"


def check_pytest(argv: list[str]) -> None:
    markers = {m.split(":")[0] for m in _pyproject()["tool"]["pytest"]["ini_options"]["markers"]}
    args = argv[1:]
    for i, arg in enumerate(args):
        if arg == "-m":
            used = set(re.findall(r"\w+", args[i + 1])) - {"not", "and", "or"}
            assert used <= markers, f"{' '.join(argv)}: markers are {sorted(markers)}"
        elif not arg.startswith("-") and (i == 0 or args[i - 1] != "-m"):
            assert (ROOT / arg.split("::")[0]).exists(), f"{' '.join(argv)}: no {arg}"


def check_torchrun(argv: list[str]) -> None:
    assert "-m" in argv and argv[argv.index("-m") + 1] == "zerobench.worker", argv
    worker = argv[argv.index("-m") + 2:]
    known = set(re.findall(r'add_argument\("(--[\w-]+)"', (ROOT / "zerobench" / "rank" / "passes.py").read_text()))
    given = {a.split("=")[0] for a in worker if a.startswith("--")}
    assert given <= known, f"{' '.join(argv)}: the worker takes {sorted(known)}"


def check_srun(argv: list[str], cwd: Path) -> None:
    """``srun [--options] COMMAND ...``: the command after srun's own options is checked as itself."""
    rest = argv[1:]
    while rest and rest[0].startswith("-"):
        rest = rest[1:]
    assert rest, f"{' '.join(argv)}: srun runs no command"
    check(rest, cwd)


def check_python(argv: list[str]) -> None:
    """``python -m package.module ...`` or ``python scripts/<script>.py ...``: the module or script
    exists and answers ``--help``."""
    if argv[1] == "-m":
        target = [sys.executable, "-m", argv[2]]
        path = ROOT / Path(*argv[2].split("."))
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), f"{' '.join(argv)}: no module"
    else:
        assert (ROOT / argv[1]).is_file(), f"{' '.join(argv)}: no such script"
        target = [sys.executable, argv[1]]
    if argv[1] == "-m" and argv[2].startswith("tests."):
        return  # a test helper run as a command: importing it is its check (tests/test_mutants.py)
    done = subprocess.run([*target, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(argv)} --help: {done.stderr[-2000:]}"


def check(argv: list[str], cwd: Path) -> None:
    tool = argv[0]
    if tool == "zerobench":
        check_zerobench(argv, cwd)
    elif tool == "pip":
        check_pip(argv)
    elif tool == "pytest":
        check_pytest(argv)
    elif tool == "torchrun":
        check_torchrun(argv)
    elif tool.startswith(("scripts/", ".ci/")):
        assert (ROOT / tool).is_file() and (ROOT / tool).stat().st_mode & 0o111, f"{tool}: no such script"
    elif tool == "python":
        check_python(argv)
    elif tool == "srun":
        check_srun(argv, cwd)
    elif tool == "git" and argv[1:2] == ["add"]:
        assert all((ROOT / p).exists() for p in argv[2:]), argv
    else:
        assert tool in SHELL, f"{' '.join(argv)}: no check for {tool!r} (tests/test_docs_commands.py)"


CASES = [(page, i, argv) for page in PAGES for i, block in enumerate(blocks(page, "bash")) for argv in commands(block)]


def test_the_pages_have_shell_blocks_and_no_unchecked_kind():
    assert len(CASES) > 20
    for page in PAGES:
        text = (ROOT / page).read_text()
        assert not re.search(r"^```(sh|shell|console|zsh)\n", text, flags=re.M), f"{page}: use ```bash (checked here)"


@pytest.mark.parametrize("page, block, argv", CASES, ids=[f"{p}:{b}:{' '.join(a)[:60]}" for p, b, a in CASES])
def test_every_command_of_the_docs_is_run_or_checked(page, block, argv, scratch):
    check(argv, scratch)


def test_the_checker_catches_a_drifted_command(scratch):
    with pytest.raises(AssertionError, match="--no-such-option"):
        check(["zerobench", "run", "quickstart", "--no-such-option"], scratch)
    with pytest.raises(AssertionError, match="no workload"):
        check(["zerobench", "cells", "workloads/gone.toml"], scratch)
    with pytest.raises(AssertionError, match="extras are"):
        check(["pip", "install", "-e", ".[nonexistent]"], scratch)
    with pytest.raises(AssertionError, match="installs torch=="):
        check(["pip", "install", "torch==1.0.0"], scratch)
    with pytest.raises(AssertionError, match="no check for 'make'"):
        check(["make", "all"], scratch)
    with pytest.raises(AssertionError, match="the worker takes"):
        check(["torchrun", "-m", "zerobench.worker", "--rundir", "x"], scratch)


def test_zerobench_help_lists_every_command_it_has(scratch):
    out = subprocess.run([sys.executable, "-m", "zerobench", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0
    from zerobench import commands

    listed = re.findall(r"^    ([a-z]+)\b", out.stdout, flags=re.M)
    assert listed == list(commands.COMMANDS)
