"""The command line's shape: every subcommand declared in one module of
zerobench/commands/, parsing without importing torch, shipped workloads found by name,
``latest`` naming the newest results folder, and bad paths refused before any work."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerobench import commands
from zerobench.cli import build_parser, main
from zerobench.commands.args import ALL_KINDS, ArgumentError, newest_folder, resolve_folder

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "pandas", "matplotlib", "numpy", "rich")


def test_help_of_every_subcommand_imports_no_torch():
    """What `zerobench --help` and `zerobench NAME --help` import, in a fresh interpreter
    ([Note: one subcommand, one module]). A test of what is imported, not of time: the
    time is measured with `python -X importtime -m zerobench --help`."""
    probe = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from zerobench.cli import main
        seen = {{}}
        for argv in [["--help"]] + [[name, "--help"] for name in {list(commands.COMMANDS)!r}]:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    main(argv)
                except SystemExit as stop:
                    assert stop.code == 0, (argv, stop.code)
            assert "usage: zerobench" in out.getvalue(), argv
            seen[" ".join(argv)] = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print(json.dumps(seen))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    imported = json.loads(out.stdout)
    assert len(imported) == 1 + len(commands.COMMANDS)
    assert {argv: mods for argv, mods in imported.items() if mods} == {}


def test_every_subcommand_is_declared_by_one_module():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == list(commands.COMMANDS)
    for name, module_name in commands.COMMANDS.items():
        module = sys.modules[module_name]
        assert module.HELP and module.__doc__, name  # the line in --help and the description
        assert sub.choices[name].get_default("func") is module.main


def _folder(root: Path, name: str, marker: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / marker).write_text("{}")
    return path


def test_latest_means_the_newest_folder_of_any_kind_and_latest_kind_of_one(tmp_path):
    """[Note: latest]: one meaning in every command; a command that reads one kind refuses
    a `latest` of another, naming the `latest:KIND` that would do."""
    old = _folder(tmp_path, "20261120-101010-quickstart", "meta.json")
    new = _folder(tmp_path, "20261121-090000-gpt-small", "meta.json")
    estimate = _folder(tmp_path, "20261122-090000-gpt-small-estimate", "estimate.csv")
    (tmp_path / "notes").mkdir()  # not a results folder
    (tmp_path / "zzz.txt").write_text("")
    assert newest_folder(tmp_path, ("run",)) == new
    assert newest_folder(tmp_path) == estimate
    assert resolve_folder("latest", "FOLDER", kinds=ALL_KINDS, results=tmp_path) == estimate  # any kind
    assert resolve_folder(str(tmp_path / "latest"), "FOLDER", kinds=ALL_KINDS) == estimate  # DIR/latest
    assert resolve_folder("latest:run", "RUN", results=tmp_path) == new
    assert resolve_folder(str(tmp_path / "latest:run"), "RUN") == new
    assert resolve_folder("latest:estimate", "FOLDER", kinds=ALL_KINDS, results=tmp_path) == estimate
    assert resolve_folder(str(old), "RUN") == old  # a path is a path
    with pytest.raises(ArgumentError, match=r"RUN: latest names .*-estimate, an estimate folder \(allowed: a run "
                                            r"folder; latest:run names the newest one\)"):
        resolve_folder("latest", "RUN", results=tmp_path)
    with pytest.raises(ArgumentError, match=r"RUN: .*-estimate is an estimate folder \(allowed: a run folder, or "
                                            r"latest:run\)"):
        resolve_folder(str(estimate), "RUN")
    with pytest.raises(ArgumentError, match=r"RUN: latest:runs: 'runs' is not a kind of results folder \(allowed: "
                                            r"latest, latest:run, latest:estimate, latest:predict\)"):
        resolve_folder("latest:runs", "RUN", results=tmp_path)
    with pytest.raises(ArgumentError, match=r"RUN: no predict folder under .*/ to be the latest:predict"):
        resolve_folder("latest:predict", "RUN", kinds=("predict",), results=tmp_path)
    with pytest.raises(ArgumentError, match=r"RUN: no results folder under .*empty/ to be the latest"):
        resolve_folder("latest", "RUN", results=tmp_path / "empty")


def test_latest_subcommand_prints_what_latest_names(tmp_path, capsys):
    _folder(tmp_path, "20261120-101010-quickstart", "cells")
    run = _folder(tmp_path, "20261121-101010-quickstart", "cells")
    prediction = _folder(tmp_path, "20261122-101010-quickstart-predict", "predict.csv")
    assert main(["latest", "--results", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(prediction)  # as `latest`: any kind
    assert main(["latest", "--results", str(tmp_path), "--kind", "run"]) == 0
    assert capsys.readouterr().out.strip() == str(run)  # as `latest:run`


def test_a_shipped_workload_is_found_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # not the checkout: the shipped folder is found all the same
    assert main(["cells", "quickstart"]) == 0
    assert "impl-fsdp-ws2-fp32" in capsys.readouterr().out
    assert main(["cells", "fsdp-knobs.toml"]) == 0
    assert main(["cells", "quickstar"]) == 2
    err = capsys.readouterr().err
    assert "quickstar: no such workload file; did you mean quickstart? (allowed: a path to a TOML file, or the " \
           "name of one in ./workloads/ or " in err
    assert "quickstart" in err and "gpt-small" in err


@pytest.mark.parametrize("argv, message", [
    (["run", "--results", ""], "--results: an empty path is not allowed"),
    (["list", "--results", " "], "--results: an empty path is not allowed"),
    (["compare", "a", "b", "--csv", ""], "--csv: an empty path is not allowed"),
])
def test_an_empty_output_path_is_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_with_a_workload_is_refused(tmp_path, capsys):
    run = _folder(tmp_path, "20261120-101010-quickstart", "workload.json")
    assert main(["run", "workloads/fsdp-knobs.toml", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "leave out WORKLOAD (workloads/fsdp-knobs.toml)" in err
    assert sorted(p.name for p in run.iterdir()) == ["workload.json"]  # nothing written


def test_compare_refuses_outputs_it_cannot_write_before_reading_anything(tmp_path, capsys):
    baseline = str(ROOT / "results" / "baselines" / "cpu-quickstart")
    (tmp_path / "a-file").write_text("")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        for option, path, why in (("--csv", tmp_path, "is a folder"),
                                  ("--markdown", tmp_path / "a-file" / "x.md", "is not a folder"),
                                  ("--plot", read_only / "c.png", "is not writable")):
            if why == "is not writable" and os.access(read_only, os.W_OK):
                continue  # root ignores the mode
            assert main(["compare", baseline, baseline, option, str(path)]) == 2
            assert f"{option}: " in (err := capsys.readouterr().err) and why in err, err
    finally:
        read_only.chmod(0o755)


def test_progress_shows_an_eta_on_a_terminal_only_after_a_while():
    import io
    import time

    from rich.console import Console

    from zerobench.commands.progress import Progress

    screen = io.StringIO()
    with Progress(4, "estimate", after_s=0.05, console=Console(file=screen, force_terminal=True, width=100)) as p:
        time.sleep(0.3)  # the timer shows the bar
        p.advance("ddp-fp32")
        time.sleep(0.2)
    assert "estimate: ddp-fp32" in screen.getvalue() and "ETA" in screen.getvalue()
    quiet = io.StringIO()
    with Progress(4, "estimate", after_s=0.05, console=Console(file=quiet, force_terminal=False)) as p:
        time.sleep(0.2)
        p.advance("ddp-fp32")
    assert quiet.getvalue() == ""  # a log, not a terminal
    fast = io.StringIO()
    with Progress(4, "estimate", after_s=5, console=Console(file=fast, force_terminal=True)) as p:
        p.advance("ddp-fp32")
    assert fast.getvalue() == ""  # done before a bar was worth showing


def test_list_shows_runs_baselines_estimates_and_predictions_with_their_status(tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setenv("COLUMNS", "160")  # every folder name whole in its column

    shutil.copytree(ROOT / "results" / "baselines" / "cpu-quickstart", tmp_path / "baselines" / "cpu-quickstart")
    estimate = _folder(tmp_path, "20261124-101010-w-estimate", "workload.json")
    (estimate / "workload.json").write_text('{"name": "w"}')
    (estimate / "estimate.csv").write_text("config,world_size,status\na,8,ok\na,64,ok\nb,8,skipped\n")
    predict = _folder(tmp_path, "20261124-111111-w-predict", "workload.json")
    (predict / "predict.csv").write_text("config,world_size,status\na,8,ok\nb,8,failed\n")
    assert main(["list", "--results", str(tmp_path)]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():  # the renderer's columns: two spaces or more apart
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) > 3 and cells[1] in ("run", "estimate", "predict"):
            rows[cells[0]] = cells[1:]
    assert rows["baselines/cpu-quickstart"][:1] + rows["baselines/cpu-quickstart"][3:7] == ["run", "20", "20", "0", "0"]
    assert rows["20261124-101010-w-estimate"][:2] + rows["20261124-101010-w-estimate"][3:7] == \
        ["estimate", "w", "3", "2", "0", "1"]
    assert rows["20261124-111111-w-predict"][:1] + rows["20261124-111111-w-predict"][3:7] == \
        ["predict", "2", "1", "1", "0"]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _help_texts() -> list[tuple[str, str]]:
    """(where, text) of everything `zerobench --help` and `zerobench NAME --help` print."""
    parser = build_parser()
    texts = [("zerobench", parser.description or "")]
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        texts.append((name, p.description or ""))
        texts += [(f"{name} {'/'.join(a.option_strings) or a.dest}", a.help or "") for a in p._actions]
    texts += [(f"{a.dest} (in zerobench --help)", a.help or "") for a in sub._choices_actions]
    return texts


def test_help_points_only_to_documents_and_sections_that_exist():
    """[Note: pointers in help]: a file named in a help text exists, and so does the section
    its #anchor names; a note a help text cites is defined in the code."""
    from tests.test_docs_references import notes

    checked = 0
    defined = {name for path in ROOT.glob("zerobench/**/*.py") for name in notes(path.read_text())[0]}
    for where, text in _help_texts():
        for path, anchor in re.findall(r"((?:README|docs/[\w-]+)\.md)(#[\w-]+)?", text):
            assert (ROOT / path).is_file(), f"{where}: {path} does not exist"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), flags=re.M)
                assert anchor[1:] in {_anchor(h) for h in headings}, f"{where}: {path} has no section {anchor}"
            checked += 1
        for note in notes(text)[1]:
            assert note in defined, f"{where}: the note {note!r} is defined nowhere"
    assert checked >= 5  # the check saw the pointers it is about


def test_the_help_pointer_check_catches_a_missing_section():
    assert _anchor("Depth extrapolation in `zerobench estimate`") == "depth-extrapolation-in-zerobench-estimate"
    headings = re.findall(r"^#+ (.+)$", (ROOT / "README.md").read_text(), flags=re.M)
    assert "quick-start" in {_anchor(h) for h in headings}
    assert "the-first-hour" not in {_anchor(h) for h in headings}  # what --help once pointed to


def test_every_help_fits_80_columns_and_every_option_says_what_it_does(monkeypatch):
    """`NAME --help` under COLUMNS=80: no line past 80 columns (descriptions are refilled,
    choices shown by a metavar), and no option without a help text."""
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        text = command.format_help()
        assert [line for line in text.splitlines() if len(line) > 80] == [], name
        silent = [a.option_strings for a in command._actions if a.option_strings and not a.help]
        assert silent == [], name


@pytest.mark.parametrize("argv, hint", [
    (["rnu"], "did you mean 'run'?"),
    (["run", "quickstart", "--reuslts", "x"], "did you mean --results?"),
    (["run", "quickstart", "--wrold-sizes", "4"], "did you mean --set matrix.world_size=4?"),
    (["run", "quickstart", "--steps=3"], "did you mean --set data.steps=3?"),
    (["predict", "quickstart", "--wrold-sizes", "4"], "did you mean --world-sizes?"),
    (["predict", "quickstart", "--gpu", "h100"], "did you mean one of h100-nvl, h100-sxm, h100-pcie, h100-96gb-500w?"),
    (["show", "lastest"], "did you mean latest?"),
])
def test_a_misspelt_command_option_or_folder_gets_a_suggestion(argv, hint, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert hint in err, err
    assert f"zerobench {argv[0]}: error:" in err or argv == ["rnu"], err  # the command's own parser refuses


def test_a_misspelt_folder_beside_real_ones_is_suggested(tmp_path, capsys):
    (tmp_path / "20261121-165230-quickstart").mkdir()
    with pytest.raises(ArgumentError, match=r"did you mean .*20261121-165230-quickstart\?"):
        resolve_folder(tmp_path / "20261121-165230-quickstrat", "FOLDER", kinds=ALL_KINDS)


def test_engines_lists_shared_axes_once_and_fits_the_terminal(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["engines"]) == 0
    out = capsys.readouterr().out
    assert out.count("activation_checkpointing =") == 1
    assert max(len(line) for line in out.splitlines()) <= 80


def test_engines_into_a_closed_pipe_ends_quietly():
    proc = subprocess.run(f"{sys.executable} -m zerobench engines | head -1", shell=True, capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.stdout.strip() == "every engine"
    assert "Broken pipe" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_list_shows_calibrate_folders_and_says_what_an_undated_folder_is(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    cal = tmp_path / "20261128-063000-calibrate-cuda"
    cal.mkdir()
    (cal / "measurements.json").write_text(json.dumps({
        "env": {"name": "NVIDIA H200"}, "kernels": [{"kernel": "gemm"}, {"kernel": "copy"}], "host": {},
        "failed": [{"section": "collectives"}]}))
    base = tmp_path / "baselines" / "predict-ci"
    base.mkdir(parents=True)
    (base / "predict.csv").write_text("config,world_size,status\nddp-bf16,8,ok\n")
    assert main(["list", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "NVIDIA H200" in line)
    assert " calibrate " in line and "2026-11-28 06:30" in line
    assert re.search(r"06:30\s+4\s+3\s+1\b", line), line  # gemm, memory, host measured; collectives failed
    assert "date -: the folder records none" in out


def test_every_command_picks_cells_with_cell_and_its_spellings():
    """[Note: one way to pick cells]: --cell and --cells everywhere; estimate and predict also
    --config, and read a cell id as its configuration."""
    parser = build_parser()
    for argv in (["run", "quickstart"], ["simulate", "RUN"]):
        assert parser.parse_args([*argv, "--cell", "a", "--cells", "b"]).cell == ["a", "b"]
    assert parser.parse_args(["compare", "B", "N", "--cell", "a", "--cells", "b"]).cells == ["a", "b"]
    for command in ("predict", "estimate"):
        args = parser.parse_args([command, "quickstart", "--cell", "impl-fsdp-ws8-bf16-limit_all_gathers=off",
                                  "--config", "ddp-fp32", "--cells", "torch-fsdp2-fp32"])
        assert args.config == ["impl-fsdp-bf16-limit_all_gathers=off", "ddp-fp32", "torch-fsdp2-fp32"]
