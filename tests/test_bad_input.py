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

from tests.helpers.runs import TINY as TINY_DDP
from zerobench.cli import main
from zerobench.harness import active, runner

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "data" / "models"
#: the tiny workload with an impl cell beside DDP
TINY = TINY_DDP.replace('engine = ["ddp"]', 'engine = ["ddp", "impl-fsdp"]')


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
     "zerobench predict: error: --gpu: gpu: h1000 is neither a shipped preset nor a preset file"),
    (["predict", "quickstart", "--link", "nvlink9", "--results", "{tmp}/r"], "zerobench predict: error: --link: "),
])
def test_reading_and_predicting_name_the_option_before_any_work(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(ROOT)
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert message in capsys.readouterr().err
    assert _nothing_written(tmp_path / "r")


# -- typos: "did you mean", with the file, and nothing printed before the error ------------

QUICKSTART = ROOT / "workloads" / "quickstart.toml"


@pytest.mark.parametrize("body, message", [
    ('[matrix]\nengine = ["impl-fdsp"]',
     "matrix.engine: 'impl-fdsp' is not allowed; did you mean 'impl-fsdp'? (allowed: 'ddp', "),
    ('[matrix]\nsharding_stratgy = ["FULL_SHARD"]',
     "unknown key matrix.sharding_stratgy; did you mean matrix.sharding_strategy? (allowed in matrix: "),
    ('[matrix]\nsharding_strategy = ["FULL_SHRAD"]',
     "matrix.sharding_strategy: 'FULL_SHRAD' is not allowed; did you mean 'FULL_SHARD'? (allowed: "),
    ('[matrix]\nengine = ["impl-fsdp"]\nsharding_strategy = ["full_shard"]',
     "matrix.sharding_strategy: 'full_shard' is not allowed; did you mean 'FULL_SHARD'? (allowed: "),
    ('[matrix]\nactivation_checkpointing = ["ful"]',
     "matrix.activation_checkpointing: 'ful' is not allowed; did you mean 'full'? (allowed: "),
    ('[data]\nstep = 3', "unknown key data.step; did you mean data.steps? (allowed in data: "),
    ('[optimizer]\nkind = "adamW"', "optimizer.kind: 'adamW' is not allowed; did you mean 'adamw'? (allowed: "),
    ('[modle]\nwidth = 8', "unknown key modle; did you mean model? (allowed in the top level: "),
])
def test_a_typo_names_the_file_and_what_was_meant_before_anything_is_printed(tmp_path, capsys, body, message):
    """A variant of the quickstart (whose matrix has axes a narrowed engine list drops,
    each with a note) with one typo: the error alone, naming the file."""
    path = tmp_path / "typo.toml"
    path.write_text(f'extends = "{QUICKSTART}"\n{body}\n')
    for command in ("run", "cells", "estimate", "predict"):
        assert main([command, str(path), "--results", str(tmp_path / "r")] if command != "cells"
                    else [command, str(path)]) == 2
        out, err = capsys.readouterr()
        assert err.startswith(f"zerobench {command}: error: {path}: {message}"), err
        assert out == ""  # no note about dropped axes, no progress line
    assert _nothing_written(tmp_path / "r")


def test_a_typo_in_a_workload_name_or_a_cell_id_is_answered(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "quikstart", "--results", str(tmp_path / "r")]) == 2
    assert "quikstart: no such workload file; did you mean quickstart? (allowed: a path to a TOML file" \
        in capsys.readouterr().err
    assert main(["run", "quickstart", "--cell", "impl-fsdp-ws2-fp3", "--results", str(tmp_path / "r")]) == 2
    assert "--cell: impl-fsdp-ws2-fp3 is not a cell of quickstart; did you mean impl-fsdp-ws2-fp32? (allowed: " \
        in capsys.readouterr().err
    # a cell id names its configuration ([Note: one way to pick cells]); a misspelt one is refused
    assert main(["estimate", "quickstart", "--config", "impl-fsdp-ws2-fp3", "--results", str(tmp_path / "r")]) == 2
    assert "--config: impl-fsdp-ws2-fp3 is not a configuration of workload 'quickstart'; did you mean " \
           "impl-fsdp-fp32? (allowed: " in capsys.readouterr().err
    assert _nothing_written(tmp_path / "r")


def test_did_you_mean_suggests_only_what_is_close():
    from zerobench.choices import closest, did_you_mean, not_allowed

    assert closest("impl-fdsp", ["ddp", "impl-fsdp", "impl-zero1"]) == ["impl-fsdp"]
    assert closest("full_shard", ["FULL_SHARD", "NO_SHARD"]) == ["FULL_SHARD"]  # case
    assert closest("FULL", ["FULL_SHARD", "NO_SHARD"]) == ["FULL_SHARD"]  # the start of one
    assert closest("zero", ["FULL_SHARD", "NO_SHARD"]) == []  # near neither
    assert closest("lion", ["adam", "adamw", "sgd"]) == []
    assert closest("ddp", ["ddp", "impl-fsdp"]) == []  # allowed: nothing to suggest
    assert closest("true", [True, False]) == [True]
    assert did_you_mean("x", []) == ""
    assert not_allowed("a.b", "nope", []) == "a.b: 'nope' is not allowed (allowed: none)"
    parts = ["h200", "h100-sxm", "h100-nvl", "h100-pcie"]
    assert did_you_mean("h100", parts, show=str) == "; did you mean one of h100-sxm, h100-nvl, h100-pcie?"
    assert did_you_mean("h10", ["h100-sxm", "h100"], show=str) == "; did you mean h100?"  # one character short
    assert did_you_mean("wo", [f"wo{i}x" for i in range(6)], show=str).endswith("wo3x, ...?")


# -- every field of a workload: a value of the wrong type, one out of its range, a misspelt key
#    ([Note: a field's range] in zerobench/spec/workload.py): generated from the dataclasses and
#    the engines' axes, so a field added without a range fails here --------------------------

from zerobench.spec import workload as spec  # noqa: E402

#: a small valid model of each kind, which each case changes one key of
BASE_MODELS = {
    "mlp": {"kind": "mlp", "depth": 1, "width": 8},
    "gpt": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 32},
    "llama": {"kind": "llama", "layers": 1, "d_model": 16, "heads": 2, "kv_heads": 1, "ffn_hidden": 32, "vocab": 32,
              "seq_len": 8},
    "factory": {"kind": "factory", "factory": "toy_factory:build_regressor", "wrap": ["ToyBlock"],
                "batch": "toy_factory:regression_batch"},
    "hf": {"kind": "hf", "config": str(MODELS / "hf-llama-tiny.json"), "seq_len": 8},
}
BASE = {"model": BASE_MODELS["mlp"], "data": {"batch_size": 2, "warmup_steps": 1, "steps": 2},
        "run": {"timeout_s": 120, "memory_pass": False}, "matrix": {"engine": ["ddp"], "world_size": [1]}}
#: dataclass fields that are no TOML key
#: (dropped_axes and no_matrix say how the file was read: they are no keys of it)
NOT_KEYS = {"model", "data", "optimizer", "run", "matrix", "source", "overrides", "kwargs", "dropped_axes", "no_matrix"}
#: values out of range of fields whose range is a shape, not a Range or a Literal
SHAPED = {"name": "../up", "model.preset": "llama9", "model.factory": "nocolon", "model.batch": "nocolon",
          "model.loss": "nocolon", "model.config": "missing.json", "model.wrap": ["NoSuchBlock"]}
#: fields whose type is all they allow: any text describes a workload
ANY_OF_ITS_TYPE = {"description"}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if value != value else ("inf" if value == float("inf") else repr(value))
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def _toml(raw: dict) -> str:
    lines = [f"{k} = {_toml_value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for table, values in ((k, v) for k, v in raw.items() if isinstance(v, dict)):
        lines += [f"[{table}]", *(f"{k} = {_toml_value(v)}" for k, v in values.items())]
    return "\n".join(lines) + "\n"


def _bad_values(hint, dotted: str) -> tuple[list, list]:
    """(values of the wrong type, values out of range) for a field of type ``hint``."""
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        base, ranges = args[0], [a for a in args[1:] if isinstance(a, spec.Range)]
        wrong = ["x"]
        out = []
        for r in ranges:
            if r.low is not None:
                out.append(r.low if r.low_open else r.low - 1)
            if r.high is not None:
                out.append(r.high if r.high_open else r.high + 1)
            if base is float:
                out += [float("inf"), float("nan")]
        return wrong, [base(v) if base is float and v == v and abs(v) != float("inf") else v for v in out]
    if origin is typing.Literal:
        return [3], ["not-a-choice"]
    if origin is tuple:
        element_wrong, element_out = _bad_values(args[0], dotted)
        return [3, [element_wrong[0]]], [[v, v] for v in element_out] + ([SHAPED[dotted]] if dotted in SHAPED else [])
    if hint is bool:
        return ["yes", 1], []  # a bool has no range beyond its two values
    if hint is str:
        return [3], [SHAPED[dotted]] if dotted in SHAPED else []
    raise AssertionError(f"{dotted}: no bad values for type {hint!r}")


def _field_cases() -> list:
    import dataclasses
    import typing

    tables = [("", spec.Workload, None), ("data", spec.DataConfig, None), ("optimizer", spec.OptimizerConfig, None),
              ("run", spec.RunConfig, None), *(("model", cls, kind) for kind, cls in spec.MODEL_KINDS.items())]
    cases, missing = [], []
    for table, cls, kind in tables:
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            if f.name in NOT_KEYS or (f.name == "kind" and kind != "mlp"):
                continue
            dotted = f"{table}.{f.name}" if table else f.name
            wrong, out = _bad_values(hints[f.name], dotted)
            if not out and hints[f.name] is not bool and dotted not in ANY_OF_ITS_TYPE:
                missing.append(dotted)
            cases += [(table, kind, f.name, v, "type") for v in wrong] + [(table, kind, f.name, v, "range") for v in out]
        if kind != "factory":  # a factory's other keys are its keyword arguments: its own error names one
            first = next(f.name for f in dataclasses.fields(cls) if f.name not in NOT_KEYS | {"kind"})
            cases.append((table, kind, first + "x", 1, "unknown"))
    assert not missing, f"fields with no declared range (a Range, a Literal or SHAPED): {missing}"
    return cases


def _axis_cases() -> list:
    """Every axis of the matrix: the common ones and each engine's."""
    from zerobench.engines import ENGINES
    from zerobench.spec.axes import engine_axes

    cases = [("matrix", None, "engine", 3, "type"), ("matrix", None, "engine", "not-an-engine", "range"),
             ("matrix", None, "world_size", "x", "type"), ("matrix", None, "world_size", 0, "range"),
             ("matrix", None, "dtype", 3, "type"), ("matrix", None, "dtype", "fp8", "range"),
             ("matrix", None, "world_sizes", 2, "unknown")]
    axes = {}
    for engine in ENGINES:
        for name, axis in engine_axes(engine).items():
            axes.setdefault(name, axis)
    for name, axis in sorted(axes.items()):
        if axis.choices is not None:
            strings = all(isinstance(c, str) for c in axis.choices)
            cases.append(("matrix", None, name, 3 if strings else "yes", "type"))
            if strings:
                cases.append(("matrix", None, name, "not-a-choice", "range"))
        elif axis.type is not None:
            cases.append(("matrix", None, name, "x", "type"))
            low = axis.minimum if axis.minimum is not None else 0
            cases += [("matrix", None, name, axis.type(low - 1), "range")]
            if axis.type is float:
                cases += [("matrix", None, name, v, "range") for v in (float("inf"), float("nan"))]
        else:  # its own check (activation_checkpointing)
            cases += [("matrix", None, name, 3, "type"), ("matrix", None, name, "every:0", "range")]
    return cases


FIELD_CASES = _field_cases() + _axis_cases()


def _case_id(case) -> str:
    table, kind, key, value, what = case
    return f"{table or 'top'}{'[' + kind + ']' if kind else ''}.{key}={value!r}:{what}"


@pytest.mark.parametrize("case", FIELD_CASES, ids=[_case_id(c) for c in FIELD_CASES])
def test_every_field_refuses_a_wrong_type_a_value_out_of_range_and_a_misspelt_key(tmp_path, capsys, case):
    table, kind, key, value, what = case
    raw = {k: dict(v) for k, v in BASE.items()}
    if kind:
        raw["model"] = dict(BASE_MODELS[kind])
    if table == "matrix" and key not in ("engine", "world_size", "dtype", "world_sizes"):
        from zerobench.engines import ENGINES
        from zerobench.spec.axes import engine_axes

        raw["matrix"]["engine"] = [e for e in ENGINES if key in engine_axes(e)]
    if table == "optimizer":
        raw["optimizer"] = {"kind": "sgd" if key == "momentum" else "adam"}  # momentum is sgd's alone
    (raw[table] if table else raw)[key] = [value] if table == "matrix" and what != "unknown" else value
    path = tmp_path / "w.toml"
    path.write_text(_toml(raw))
    assert main(["run", str(path), "--results", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    dotted = f"{table}.{key}" if table else key
    assert err.startswith(f"zerobench run: error: {path}: "), err
    if what == "unknown":
        assert f"unknown key {dotted}; did you mean {dotted[:-1]}? (allowed in " in err, err
    else:
        assert f"{dotted}: " in err and ("allowed" in err or "expected" in err), err
    assert "Traceback" not in err and _nothing_written(tmp_path / "r")


# -- every option of run, estimate, predict, simulate, compare, show and plot: a bad value,
#    and paths that do not exist or are files where folders belong ----------------------------

#: (command, option's dest) -> [(arguments after the command, what the error says)]. {w} is a
#: small workload, {file} a plain file, {dir} a folder that is no results folder, {prof} a
#: profiled run, {base} the CPU baseline, {r} the results folder that must stay empty.
OPTION_CASES = {
    ("run", "workload"): [(["{dir}/nope.toml"], "nope.toml: no such workload file"),
                          (["{dir}"], "a folder, not a workload file (allowed: a TOML file")],
    ("run", "overrides"): [(["{w}", "--set", "data.steps=0"], "--set data.steps=0: data.steps: 0 is not allowed (allowed: "
                                                              "int >= 1)"),
                           (["{w}", "--set", "data.steps"], "--set data.steps: expected KEY=VALUE"),
                           (["{w}", "--set", "data.stepz=3"], "unknown key data.stepz; did you mean data.steps?")],
    ("run", "results"): [(["{w}", "--results", "{file}"], "--results: {file} is not a folder (allowed: a folder")],
    ("run", "resume"): [(["--resume", "{dir}/nope"], "--resume: {dir}/nope: no such folder"),
                        (["--resume", "{file}"], "--resume: {file}: not a folder"),
                        (["--resume", "{dir}"], "--resume {dir}: not a zerobench run folder (no workload.json)")],
    ("run", "cell"): [(["{w}", "--cell", "nope"], "--cell: nope is not a cell of tiny (allowed: ddp-ws1-fp32")],
    ("run", "device"): [(["{w}", "--device", "tpu"], "argument --device: invalid choice: 'tpu'")],
    ("estimate", "workload"): [(["{dir}/nope.toml"], "nope.toml: no such workload file")],
    ("estimate", "overrides"): [(["{w}", "--set", "matrix.engine=impl-fdsp"],
                                 "--set matrix.engine=impl-fdsp: matrix.engine: 'impl-fdsp' is not allowed; did you mean")],
    ("estimate", "world_sizes"): [(["{w}", "--world-sizes", "x"], "--world-sizes: 'x' is not allowed"),
                                  (["{w}", "--world-sizes", "2,2"], "--world-sizes: 2 is repeated")],
    ("estimate", "rank"): [(["{w}", "--rank", "-1"], "--rank: -1 is not allowed")],
    ("estimate", "results"): [(["{w}", "--results", "{file}"], "--results: {file} is not a folder")],
    ("estimate", "hybrid_shard_size"): [(["{w}", "--hybrid-shard-size", "0"], "--hybrid-shard-size: 0 is not allowed")],
    ("estimate", "backend"): [(["{w}", "--backend", "mpi"], "argument --backend: invalid choice: 'mpi'")],
    ("estimate", "gpu"): [(["{w}", "--gpu", "h1000"], "--gpu: gpu: h1000 is neither a shipped preset nor a preset file"),
                          (["{w}", "--gpu", "{dir}/nope.json"], "--gpu: gpu preset file {dir}/nope.json does not exist")],
    ("estimate", "config"): [(["{w}", "--config", "dpp-fp32"], "--config: dpp-fp32 is not a configuration of workload "
                                                                "'tiny'; did you mean ddp-fp32?")],
    ("estimate", "against"): [(["{w}", "--against", "{dir}/nope"], "--against: {dir}/nope: no such folder"),
                              (["{w}", "--against", "{file}"], "--against: {file}: not a folder")],
    ("predict", "workload"): [(["{dir}"], "a folder, not a workload file")],
    ("predict", "overrides"): [(["{w}", "--set", "extends=x.toml"], "--set extends=x.toml: extends is not allowed")],
    ("predict", "world_sizes"): [(["{w}", "--world-sizes", "0"], "--world-sizes: 0 is not allowed")],
    ("predict", "gpu"): [(["{w}", "--gpu", "h1000"], "--gpu: ")],
    ("predict", "host"): [(["{w}", "--host", "medium"], "--host: ")],
    ("predict", "sdpa_backend"): [(["{w}", "--sdpa-backend", "fash"], "--sdpa-backend: 'fash' is not allowed")],
    ("predict", "against"): [(["{w}", "--against", "{dir}/nope"], "--against: {dir}/nope: no such folder"),
                             (["{w}", "--against", "{file}"], "--against: {file}: not a folder"),
                             (["{w}", "--against", "{dir}"], "has no traces of rank 0")],
    ("predict", "link"): [(["{w}", "--link", "nvlink9"], "--link: ")],
    ("predict", "inter_link"): [(["{w}", "--inter-link", "nvlink9"], "--inter-link: ")],
    ("predict", "node_size"): [(["{w}", "--node-size", "0"], "--node-size: 0 is not allowed")],
    ("predict", "results"): [(["{w}", "--results", "{file}"], "--results: {file} is not a folder")],
    ("predict", "config"): [(["{w}", "--config", "nope"], "--config: nope is not a configuration")],
    ("predict", "alloc_conf"): [(["{w}", "--alloc-conf", "nope:1"], "--alloc-conf: 'nope' is not modelled")],
    ("predict", "context_mib"): [(["{w}", "--context-mib", "-1"], "--context-mib: -1 is not allowed")],
    ("predict", "nccl_mib"): [(["{w}", "--nccl-mib", "-1"], "--nccl-mib: -1 is not allowed")],
    ("simulate", "run"): [(["{dir}/nope"], "RUN: {dir}/nope: no such folder"), (["{file}"], "RUN: {file}: not a folder"),
                          (["{base}"], "no profiled cells to simulate")],
    ("simulate", "cell"): [(["{prof}", "--cell", "impl-fsdp-ws2-fp3"], "--cell: impl-fsdp-ws2-fp3 is not a profiled cell "
                                                                       "of {prof}; did you mean impl-fsdp-ws2-fp32?")],
    ("simulate", "link"): [(["{prof}", "--link", "nvlink9"], "argument --link: invalid choice: 'nvlink9'")],
    ("simulate", "gbps"): [(["{prof}", "--gbps", "-1"], "--gbps: -1.0 is not allowed (allowed: a finite number > 0)"),
                           (["{prof}", "--gbps", "nan"], "--gbps: nan is not allowed")],
    ("simulate", "latency_us"): [(["{prof}", "--gbps", "1", "--latency-us", "-1"], "--latency-us: -1.0 is not allowed"),
                                 (["{prof}", "--latency-us", "5"], "--latency-us 5.0: a latency needs a link")],
    ("simulate", "inter_link"): [(["{prof}", "--inter-link", "nvlink9"], "argument --inter-link: invalid choice")],
    ("simulate", "world_sizes"): [(["{prof}", "--world-sizes", "0"], "--world-sizes: 0 is not allowed")],
    ("simulate", "compute_scale"): [(["{prof}", "--compute-scale", "inf"], "--compute-scale: inf is not allowed")],
    ("compare", "baseline"): [(["{dir}/nope", "{base}"], "BASELINE: {dir}/nope: no such folder"),
                              (["{file}", "{base}"], "BASELINE: {file}: not a folder")],
    ("compare", "run"): [(["{base}", "{dir}/nope"], "RUN: {dir}/nope: no such folder"),
                         (["{base}", "{dir}"], "{dir}: no results.csv")],
    ("compare", "fail_on"): [(["{base}", "{base}", "--fail-on", "step_tme:+1%"],
                              "unknown metric 'step_tme'; did you mean step_time_s?"),
                             (["{base}", "{base}", "--fail-on", "peak_mem"], "rule 'peak_mem': expected NAME:+TOL")],
    ("compare", "gate"): [(["{base}", "{base}", "--gate", "sometimes"], "argument --gate: invalid choice")],
    ("compare", "report_only"): [(["{base}", "{base}", "--report-only", "nope"], "unknown metric 'nope'")],
    ("compare", "cells"): [(["{base}", "{base}", "--cells", "ddp-ws2-fp3"], "--cells: 'ddp-ws2-fp3' matches no cell of "
                                                                            "{base}; did you mean ddp-ws2-fp32?")],
    **{("compare", option): [(["{base}", "{base}", f"--{option.replace('_', '-')}", "{dir}"],
                              f"--{option.replace('_', '-')}: {{dir}} is a folder (allowed: a file path)"),
                             (["{base}", "{base}", f"--{option.replace('_', '-')}", "{file}/x"],
                              f"--{option.replace('_', '-')}: {{file}} is not a folder")]
       for option in ("markdown", "json", "junit_xml", "plot", "csv")},
    ("show", "folder"): [(["{dir}/nope"], "FOLDER: {dir}/nope: no such folder"),
                         (["{file}"], "FOLDER: {file}: not a folder"), (["{dir}"], "is not a results folder")],
    ("plot", "run"): [(["{dir}/nope"], "FOLDER: {dir}/nope: no such folder"), (["{file}"], "FOLDER: {file}: not a folder"),
                      (["{dir}"], "no results.csv and no cells/")],
}
#: commands that make a results folder, and take --results
MAKE_FOLDERS = {"run", "estimate", "predict"}


def _options(command: str) -> set[str]:
    """The dests of the command's options and arguments that take a value."""
    from zerobench.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.dest for a in sub.choices[command]._actions if a.dest != "help" and a.nargs != 0}


@pytest.mark.parametrize("command", ["run", "estimate", "predict", "simulate", "compare", "show", "plot"])
def test_every_option_that_takes_a_value_has_a_bad_value_here(command):
    assert _options(command) <= {dest for c, dest in OPTION_CASES if c == command}, \
        sorted(_options(command) - {dest for c, dest in OPTION_CASES if c == command})


OPTION_PARAMS = [(c, dest, argv, message) for (c, dest), cases in OPTION_CASES.items() for argv, message in cases]


@pytest.mark.parametrize("command, dest, argv, message", OPTION_PARAMS,
                         ids=[f"{c}-{d}-{'_'.join(a)}" for c, d, a, _ in OPTION_PARAMS])
def test_a_bad_option_value_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch, command, dest, argv,
                                                                  message):
    folders = {"w": tmp_path / "w.toml", "file": tmp_path / "afile", "dir": tmp_path / "empty", "r": tmp_path / "r",
               "prof": tmp_path / "prof", "base": tmp_path / "base"}
    folders["w"].write_text(TINY)
    folders["file"].write_text("not a folder")
    folders["dir"].mkdir()
    shutil.copytree(ROOT / "results" / "curated" / "20261123-145730-gpt-small-profiled", folders["prof"])
    shutil.copytree(ROOT / "results" / "baselines" / "cpu-quickstart", folders["base"])
    before = sorted(p for p in tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    args = [a.format(**folders) for a in argv]
    if command in MAKE_FOLDERS and "--results" not in args and "--resume" not in args:
        args += ["--results", str(folders["r"])]
    try:
        code = main([command, *args])
    except SystemExit as exit:  # argparse's own refusal of a choice
        code = exit.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert message.format(**folders) in out + err, out + err
    assert "Traceback" not in out + err
    assert sorted(p for p in tmp_path.rglob("*")) == before  # no folder, no report, no plot
