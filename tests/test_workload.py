"""Workload files: every kind of bad input is an error naming the field and what it allows."""

import textwrap
from pathlib import Path

import pytest

from zerobench.spec.workload import WorkloadError, load_workload, parse_workload

ROOT = Path(__file__).resolve().parents[1]

GOOD = {
    "model": {"kind": "gpt", "layers": 2, "d_model": 64, "heads": 4, "seq_len": 16, "vocab": 128},
    "data": {"batch_size": 2, "warmup_steps": 1, "steps": 3},
    "optimizer": {"kind": "adamw", "lr": 1e-3, "betas": [0.9, 0.95]},
    "matrix": {"engine": ["ddp", "torch-fsdp2"], "world_size": [2, 4], "dtype": ["fp32"]},
}


def with_(section, **changes):
    raw = {k: dict(v) for k, v in GOOD.items()}
    raw[section].update(changes)
    return raw


def test_good_workload_parses():
    w = parse_workload(GOOD)
    assert w.model.heads == 4 and w.optimizer.betas == (0.9, 0.95)
    assert w.matrix["world_size"] == [2, 4]


@pytest.mark.parametrize("raw, match", [
    (with_("model", heads=5), r"model.heads: 5 does not divide model.d_model=64 \(allowed: a divisor"),
    (with_("model", kind="cnn"), r"model.kind: 'cnn' is not allowed \(allowed: 'mlp', 'gpt', 'llama', 'hf', 'factory'\)"),
    (with_("model", depth=3), r"unknown key model.depth \(allowed in model: .*d_model.*heads"),
    (with_("model", layers=0), r"model.layers: 0 is not allowed \(allowed: int from 1 to 2\*\*63 - 1\)"),
    (with_("model", d_model=2**70), r"model.d_model: 1180591620717411303424 is not allowed \(allowed: int from 1 to"),
    (with_("data", batch_size=2**63), r"data.batch_size: 9223372036854775808 is not allowed \(allowed: int from 1 to"),
    (with_("model", seq_len=1), r"model.seq_len: 1 is not allowed \(allowed: int from 2 to 2\*\*63 - 1\)"),
    (with_("model", d_model="64"), r"model.d_model: expected int, got str '64'"),
    (with_("data", steps=-1), r"data.steps: -1 is not allowed \(allowed: int >= 1\)"),
    (with_("data", warmup_steps=-2), r"data.warmup_steps: -2 is not allowed \(allowed: int >= 0\)"),
    (with_("data", batch_size=1.5), r"data.batch_size: expected int, got float"),
    (with_("data", batch=4), r"unknown key data.batch; did you mean data.batch_size\? \(allowed in data: batch_size, seed, steps, "
                                        r"warmup_steps\)"),
    (with_("optimizer", kind="lion"), r"optimizer.kind: 'lion' is not allowed \(allowed: 'adam', 'adamw', 'sgd'\)"),
    (with_("optimizer", lr=0), r"optimizer.lr: 0.0 is not allowed \(allowed: a finite float > 0\)"),
    (with_("optimizer", betas=[0.9, 1.5]), r"optimizer.betas: 1.5 is not allowed \(allowed: a finite float in \[0, 1\)\)"),
    (with_("optimizer", kind="sgd", momentum=0.9), r"optimizer.betas: not an argument of 'sgd'"),
    (with_("optimizer", momentum=0.9), r"optimizer.momentum: not an argument of 'adamw' \(it applies to: sgd\)"),
    (with_("matrix", world_size=[0]), r"matrix.world_size: 0 is not allowed \(allowed: int >= 1\)"),
    (with_("matrix", world_size=[True]), r"matrix.world_size: expected int, got bool"),
    (with_("matrix", dtype=["fp16"]), r"matrix.dtype: 'fp16' is not allowed; did you mean 'bf16'\? \(allowed: 'fp32', 'bf16'\)"),
    (with_("matrix", engine=[]), r"matrix.engine: empty list"),
    (with_("matrix", world_size=[2, 2]), r"matrix.world_size: repeated values"),
    ({**GOOD, "modle": {}}, r"unknown key modle; did you mean model\? \(allowed in the top level: "),
    ({**GOOD, "run": {"timeout_s": 0}}, r"run.timeout_s: 0.0 is not allowed \(allowed: a finite float > 0\)"),
    ({**GOOD, "run": {"memory_pass": "yes"}}, r"run.memory_pass: expected bool, got str"),
    (with_("optimizer", lr=float("inf")), r"optimizer.lr: inf is not allowed \(allowed: a finite float > 0\)"),
    (with_("optimizer", weight_decay=float("nan")), r"optimizer.weight_decay: nan is not allowed \(allowed: a finite"),
    (with_("optimizer", weight_decay=-0.1), r"optimizer.weight_decay: -0.1 is not allowed \(allowed: a finite float >= 0"),
    (with_("optimizer", eps=float("nan")), r"optimizer.eps: nan is not allowed \(allowed: a finite float >= 0\)"),
    (with_("optimizer", eps=-1e-8), r"optimizer.eps: -1e-08 is not allowed \(allowed: a finite float >= 0\)"),
    ({**GOOD, "name": "../escape"}, r"name: '../escape' is not allowed \(allowed: 1 to 100 letters, digits"),
    ({**GOOD, "name": "two\nlines"}, r"name: 'two\\nlines' is not allowed"),
    ({**GOOD, "name": ".hidden"}, r"name: '.hidden' is not allowed"),
    ({**GOOD, "name": "x" * 101}, r"name: 'x+' is not allowed"),
    ({**GOOD, "name": "a/b"}, r"name: 'a/b' is not allowed"),
    ({**GOOD, "name": ".."}, r"name: '..' is not allowed"),
])
def test_bad_input_names_field_and_allowed_values(raw, match):
    with pytest.raises(WorkloadError, match=match):
        parse_workload(raw)


def test_an_empty_workload_file_is_refused(tmp_path):
    """A file that sets nothing is refused, not run with every default; a variant that
    changes one field inherits the rest."""
    for text in ("", 'name = "only-a-name"\n'):
        (tmp_path / "empty.toml").write_text(text)
        with pytest.raises(WorkloadError, match=r"empty.toml: the file sets nothing to run \(allowed: a \[model\]"):
            load_workload(tmp_path / "empty.toml")
    (tmp_path / "v.toml").write_text('extends = "%s"\n[data]\nsteps = 3\n' % (ROOT / "workloads" / "quickstart.toml"))
    assert "impl-fsdp" in load_workload(tmp_path / "v.toml").matrix["engine"]


def test_error_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[data]\nsteps = 0\n")
    with pytest.raises(WorkloadError, match=r"bad.toml: data.steps: 0 is not allowed"):
        load_workload(path)


def test_invalid_toml_is_reported(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[data\n")
    with pytest.raises(WorkloadError, match=r"broken.toml: not valid TOML"):
        load_workload(path)


def test_extends_overrides_fields_and_merges_tables(tmp_path):
    (tmp_path / "base.toml").write_text(textwrap.dedent("""
        name = "base"
        [model]
        kind = "mlp"
        depth = 3
        width = 32
        [data]
        steps = 7
        batch_size = 4
        [matrix]
        engine = ["ddp", "torch-fsdp1"]
        sharding_strategy = ["FULL_SHARD", "NO_SHARD"]
    """))
    (tmp_path / "variant.toml").write_text(textwrap.dedent("""
        extends = "base.toml"
        [model]
        width = 64
        [matrix]
        sharding_strategy = ["SHARD_GRAD_OP"]
    """))
    w = load_workload(tmp_path / "variant.toml")
    assert w.name == "variant"  # a variant never inherits its parent's name
    assert (w.model.depth, w.model.width) == (3, 64)
    assert (w.data.steps, w.data.batch_size) == (7, 4)
    assert w.matrix["engine"] == ["ddp", "torch-fsdp1"]
    assert w.matrix["sharding_strategy"] == ["SHARD_GRAD_OP"]


def test_extends_to_another_model_kind_replaces_the_model_table(tmp_path):
    (tmp_path / "base.toml").write_text('[model]\nkind = "mlp"\ndepth = 3\n')
    (tmp_path / "gpt.toml").write_text('extends = "base.toml"\n[model]\nkind = "gpt"\nlayers = 1\n')
    w = load_workload(tmp_path / "gpt.toml")
    assert w.model.kind == "gpt" and w.model.layers == 1


def test_circular_extends_is_an_error(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(WorkloadError, match="circular"):
        load_workload(tmp_path / "a.toml")


def test_every_shipped_workload_loads():
    from pathlib import Path

    from zerobench.spec.matrix import expand

    files = sorted((Path(__file__).parent.parent / "workloads").glob("*.toml"))
    assert files
    for path in files:
        assert expand(load_workload(path)), path


def test_variant_removes_an_inherited_axis_with_an_empty_list(tmp_path):
    (tmp_path / "base.toml").write_text('[matrix]\nengine = ["torch-fsdp1"]\nsharding_strategy = ["NO_SHARD"]\n')
    (tmp_path / "v.toml").write_text('extends = "base.toml"\n[matrix]\nengine = ["ddp"]\nsharding_strategy = []\n')
    assert "sharding_strategy" not in load_workload(tmp_path / "v.toml").matrix
    (tmp_path / "own.toml").write_text('[matrix]\nsharding_strategy = []\n')
    with pytest.raises(WorkloadError, match=r"matrix.sharding_strategy: empty list .*removes the inherited axis"):
        load_workload(tmp_path / "own.toml")


def test_a_workload_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('description = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(WorkloadError, match=r"latin1.toml: not UTF-8 text .*byte 0xe9"):
        load_workload(path)


def test_a_variant_cannot_empty_a_common_axis(tmp_path):
    """`engine = []` in a variant would remove the axis and fall back to the default engine."""
    (tmp_path / "base.toml").write_text('[matrix]\nengine = ["torch-fsdp1"]\n')
    for axis in ("engine", "world_size", "dtype"):
        (tmp_path / "v.toml").write_text(f'extends = "base.toml"\n[matrix]\n{axis} = []\n')
        with pytest.raises(WorkloadError, match=rf"v.toml: matrix.{axis}: empty list .*cannot be removed"):
            load_workload(tmp_path / "v.toml")


def test_a_variant_does_not_inherit_the_description(tmp_path):
    (tmp_path / "base.toml").write_text('description = "width 512, 1.3M params"\n[model]\nwidth = 512\n')
    (tmp_path / "v.toml").write_text('extends = "base.toml"\n[model]\nwidth = 8\n')
    assert load_workload(tmp_path / "v.toml").description == ""
    (tmp_path / "own.toml").write_text('extends = "base.toml"\ndescription = "tiny"\n')
    assert load_workload(tmp_path / "own.toml").description == "tiny"


# -- --set KEY=VALUE ([Note: overrides]) ------------------------------------------------------


@pytest.mark.parametrize("text, key, value", [
    ("data.steps=20", "data.steps", 20),
    ("optimizer.lr=1e-3", "optimizer.lr", 1e-3),
    ("run.memory_pass=false", "run.memory_pass", False),
    ("matrix.engine=ddp,impl-fsdp", "matrix.engine", ["ddp", "impl-fsdp"]),
    ("matrix.world_size=2,4", "matrix.world_size", [2, 4]),
    ("matrix.world_size=[2, 4]", "matrix.world_size", [2, 4]),
    ("matrix.sharding_strategy=FULL_SHARD", "matrix.sharding_strategy", "FULL_SHARD"),
    ("model.wrap=Block,", "model.wrap", ["Block"]),
    ('description="a, b"', "description", "a, b"),
    ("matrix.activation_checkpointing=every:2", "matrix.activation_checkpointing", "every:2"),
    ("matrix.reshard_after_forward=[]", "matrix.reshard_after_forward", []),
])
def test_an_override_is_a_dotted_key_and_a_toml_value(text, key, value):
    from zerobench.spec.workload import parse_override

    assert parse_override(text) == (key, value)


def test_overrides_change_the_workload_as_a_variant_would():
    w = load_workload("quickstart", ["data.steps=20", "matrix.engine=ddp,impl-fsdp", "matrix.reshard_after_forward=[]",
                                     "model.width=64"])
    assert (w.data.steps, w.data.batch_size, w.model.width, w.model.depth) == (20, 16, 64, 4)
    assert w.matrix["engine"] == ["ddp", "impl-fsdp"] and "reshard_after_forward" not in w.matrix
    assert w.overrides == ("data.steps=20", "matrix.engine=ddp,impl-fsdp", "matrix.reshard_after_forward=[]",
                           "model.width=64")
    assert "overrides" not in w.to_dict() and w.to_dict()["data"]["steps"] == 20
    assert load_workload("quickstart", ["model.kind=gpt"]).model.kind == "gpt"  # another kind: its defaults
    with pytest.raises(WorkloadError, match=r"quickstart.toml --set data.stepz=2: unknown key data.stepz; did you "
                                            r"mean data.steps\?"):
        load_workload("quickstart", ["data.stepz=2"])
    with pytest.raises(WorkloadError, match=r"quickstart.toml --set optimizer.kind=lion: optimizer.kind: 'lion' is "
                                            r"not allowed \(allowed: 'adam', 'adamw', 'sgd'\)"):
        load_workload("quickstart", ["optimizer.kind=lion"])


def test_a_run_folder_records_the_overrides(tmp_path, capsys):
    import json

    from zerobench.cli import main

    assert main(["run", "quickstart", "--set", "data.steps=20", "--set", "matrix.engine=ddp,impl-fsdp",
                 "--results", str(tmp_path), "--prepare-only"]) == 0
    (run,) = tmp_path.iterdir()
    workload, meta = (json.loads((run / f"{name}.json").read_text()) for name in ("workload", "meta"))
    assert workload["data"]["steps"] == 20 and workload["matrix"]["engine"] == ["ddp", "impl-fsdp"]
    assert meta["overrides"] == ["data.steps=20", "matrix.engine=ddp,impl-fsdp"]
    assert "--cell impl-fsdp-ws2-fp32" in capsys.readouterr().out
    assert main(["run", "--resume", str(run), "--set", "data.steps=3"]) == 2  # the run's workload is its own
    assert "leave out --set data.steps=3" in capsys.readouterr().err
