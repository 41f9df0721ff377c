"""Bad input and faults as a reliability engineer tries them (issue 27): each is a clear
error -- exit 2, naming the field or file and what is allowed -- before anything is
written, and a user's own exception keeps its message and the key that named it.

(A workload's fields: tests/test_workload.py; command-line paths and `--resume` with a
workload: tests/test_cli.py; the rank the harness stopped: tests/test_faults.py.)
"""

from __future__ import annotations

import errno
import json
import shutil
import textwrap
from pathlib import Path

import pytest

from zerobench.cli import main
from zerobench.harness import active, runner

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "data" / "models"
TINY = textwrap.dedent("""
    name = "tiny"
    [model]
    kind = "mlp"
    depth = 1
    width = 8
    [data]
    batch_size = 2
    warmup_steps = 1
    steps = 2
    [run]
    timeout_s = 120
    memory_pass = false
    [matrix]
    engine = ["ddp", "impl-fsdp"]
    world_size = [1]
""")


@pytest.fixture(autouse=True)
def own_registry(tmp_path, monkeypatch):
    monkeypatch.setenv(active.ACTIVE_DIR_ENV, str(tmp_path / "active"))


def _nothing_written(results: Path) -> bool:
    return not results.exists() or not any(results.iterdir())


# -- the user's code, run once before anything is written ---------------------------------

FAULTY = textwrap.dedent('''
    import torch
    from toy_factory import build_regressor, regression_batch

    def raises(**kwargs):
        raise RuntimeError("the weights file is gone")

    NOT_CALLABLE = 3

    def bad_batch(batch_size, generator):
        return [1, 2, 3]

    def vector_loss(output, target):
        return (output - target).abs()  # not reduced: no scalar to start backward from
''')


@pytest.mark.parametrize("model, message", [
    ('factory = "faulty:raises"\nwrap = ["ToyBlock"]\nbatch = "toy_factory:regression_batch"',
     "model.factory: faulty:raises raised RuntimeError: the weights file is gone"),
    ('factory = "faulty:NOT_CALLABLE"\nwrap = ["ToyBlock"]\nbatch = "toy_factory:regression_batch"',
     "model.factory: 'faulty:NOT_CALLABLE' is a int, not a function"),
    ('factory = "toy_factory:build_regressor"\nwidth = 16\ncolour = "red"\nwrap = ["ToyBlock"]\n'
     'batch = "toy_factory:regression_batch"',
     "model.factory: toy_factory:build_regressor raised TypeError: build_regressor() got an unexpected keyword "
     "argument 'colour'"),
    ('factory = "toy_factory:build_regressor"\nwrap = ["ToyBlock"]\nbatch = "faulty:bad_batch"',
     "model.batch: faulty:bad_batch returned a list of int, int, int (allowed: a tuple (inputs, targets)"),
    ('factory = "toy_factory:build_regressor"\nwrap = ["ToyBlock"]\nbatch = "toy_factory:regression_batch"\n'
     'loss = "faulty:vector_loss"',
     "model.loss: faulty:vector_loss returned a tensor of shape (2, 16) (allowed: a tensor with one element"),
])
def test_a_faulty_user_model_is_refused_before_the_run_folder(tmp_path, monkeypatch, capsys, model, message):
    shutil.copy(MODELS / "toy_factory.py", tmp_path / "toy_factory.py")
    (tmp_path / "faulty.py").write_text(FAULTY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "w.toml").write_text(TINY.replace('kind = "mlp"\ndepth = 1\nwidth = 8', model))
    assert main(["run", "w.toml", "--results", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "too large to count" not in err and "Traceback" not in err
    assert _nothing_written(tmp_path / "r")


# -- the run's own files ------------------------------------------------------------------


def test_a_full_disk_ends_with_the_file_and_the_resume_command(tmp_path, monkeypatch, capsys):
    (tmp_path / "w.toml").write_text(TINY)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "r" / "x" / "cells" / "a.json"))

    monkeypatch.setattr(runner, "_run_cells", full)
    assert main(["run", str(tmp_path / "w.toml"), "--results", str(tmp_path / "r")]) == 2
    out = capsys.readouterr().out
    (run,) = (tmp_path / "r").iterdir()
    assert "cannot write " in out and "cells/a.json: No space left on device" in out
    assert f"zerobench run --resume {run}" in out.replace("\n", "")  # the console may fold a long line
    assert "Traceback" not in out


def test_resume_prepare_only_lists_only_the_cells_left(tmp_path, capsys):
    (tmp_path / "w.toml").write_text(TINY)
    assert main(["run", str(tmp_path / "w.toml"), "--results", str(tmp_path / "r"), "--prepare-only"]) == 0
    (run,) = (tmp_path / "r").iterdir()
    done = {"cell_id": "ddp-ws1-fp32", "status": "ok", "config": {"engine": "ddp", "world_size": 1, "dtype": "fp32"},
            "ranks": [], "cell_wall_s": 1.0}
    (run / "cells").mkdir()
    (run / "cells" / "ddp-ws1-fp32.json").write_text(json.dumps(done))
    capsys.readouterr()
    assert main(["run", "--resume", str(run), "--prepare-only"]) == 0
    out = capsys.readouterr().out
    assert "--cell impl-fsdp-ws1-fp32" in out and "--cell ddp-ws1-fp32" not in out
    assert "1 already finished are kept and not listed" in out


def test_show_refuses_a_results_csv_it_cannot_check(tmp_path, capsys):
    """cells/ deleted, then results.csv no longer holds what meta.json lists: not trusted."""
    run = tmp_path / "run"
    shutil.copytree(ROOT / "results" / "baselines" / "cpu-quickstart", run)
    assert main(["show", str(run)]) == 0  # a curated folder: no cells/, tables as saved
    meta = json.loads((run / "meta.json").read_text())
    meta["cells"].append("ddp-ws4-fp32")  # a cell ran after the tables were saved
    (run / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["show", str(run)]) == 2
    err = capsys.readouterr().err
    assert "results.csv: does not hold the cells meta.json lists (missing: ddp-ws4-fp32)" in err
    assert "cells is gone" in err


def test_a_folder_where_results_csv_should_be_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(ROOT / "results" / "baselines" / "cpu-quickstart", run)
    (run / "results.csv").unlink()
    (run / "results.csv").mkdir()
    for argv in (["show", str(run)], ["plot", str(run)]):
        assert main(argv) == 2
        assert f"{run / 'results.csv'}: not a file" in capsys.readouterr().err
    assert main(["compare", str(ROOT / "results" / "baselines" / "cpu-quickstart"), str(run)]) == 2
    assert "results.csv" in capsys.readouterr().out


def test_results_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "w.toml").write_text(TINY)
    (tmp_path / "afile").write_text("")
    assert main(["run", str(tmp_path / "w.toml"), "--results", str(tmp_path / "afile")]) == 2
    assert "--results" in capsys.readouterr().err


# -- estimate ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--world-sizes", "4", "--hybrid-shard-size", "3"],
     "--hybrid-shard-size: 3 does not divide world size 4 (allowed: a divisor of every --world-sizes value: 1, 2, 4)"),
    (["--world-sizes", "8", "--against", "nope"], "--against: nope: no such folder"),
])
def test_estimate_refuses_bad_options_before_any_work(tmp_path, capsys, argv, message):
    (tmp_path / "w.toml").write_text(TINY)
    assert main(["estimate", str(tmp_path / "w.toml"), "--results", str(tmp_path / "r"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert _nothing_written(tmp_path / "r")


def test_estimate_against_a_run_without_the_memory_pass_is_refused(tmp_path, capsys):
    (tmp_path / "w.toml").write_text(TINY)
    run = ROOT / "results" / "curated" / "20261123-144741-simulate-validation"  # memory_pass = false
    assert main(["estimate", str(tmp_path / "w.toml"), "--results", str(tmp_path / "r"), "--against", str(run)]) == 2
    assert "has no peak_mem_bytes (allowed: a run with the memory pass" in capsys.readouterr().err
    assert _nothing_written(tmp_path / "r")


@pytest.mark.parametrize("argv, message", [
    (["show", "no-such-run"], "zerobench show: error: FOLDER: no-such-run: no such folder"),
    (["plot", "README.md"], "zerobench plot: error: FOLDER: README.md: not a folder"),
    (["list", "--results", "README.md"], "zerobench list: error: --results: README.md is not a folder"),
    (["latest", "--results", "no-such-folder"], "zerobench latest: error: --results: no results folder under no-such-folder/"),
    (["predict", "quickstart", "--gpu", "h1000", "--results", "{tmp}/r"],
     "zerobench predict: error: --gpu: gpu must be one of h100-sxm"),
    (["predict", "quickstart", "--link", "nvlink9", "--results", "{tmp}/r"], "zerobench predict: error: --link: "),
])
def test_reading_and_predicting_name_the_option_before_any_work(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(ROOT)
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert message in capsys.readouterr().err
    assert _nothing_written(tmp_path / "r")
