"""Matrix expansion: engine-specific axes multiply only their engines, no duplicates."""

import pytest

from zerobench.spec.axes import engine_axes
from zerobench.spec.matrix import expand
from zerobench.spec.workload import WorkloadError, parse_workload


def cells(matrix):
    return expand(parse_workload({"matrix": matrix}))


def test_engine_axes_apply_only_to_their_engines():
    out = cells({"engine": ["ddp", "torch-fsdp1", "torch-fsdp2"], "world_size": [2, 4], "dtype": ["fp32", "bf16"],
                 "sharding_strategy": ["FULL_SHARD", "SHARD_GRAD_OP"], "reshard_after_forward": [True, False]})
    by_engine = {}
    for c in out:
        by_engine.setdefault(c.engine, []).append(c)
    assert len(by_engine["ddp"]) == 2 * 2          # world sizes x dtypes, not x strategies
    assert len(by_engine["torch-fsdp1"]) == 2 * 2 * 2
    assert len(by_engine["torch-fsdp2"]) == 2 * 2 * 2
    assert len({c.id for c in out}) == len(out)  # ids are unique
    assert "sharding_strategy" not in dict(by_engine["ddp"][0].options)


def test_ids_name_only_non_default_axes():
    out = cells({"engine": ["torch-fsdp1"], "sharding_strategy": ["FULL_SHARD", "NO_SHARD"]})
    assert [c.id for c in out] == ["torch-fsdp1-ws2-fp32", "torch-fsdp1-ws2-fp32-sharding_strategy=NO_SHARD"]


def test_value_one_engine_allows_and_another_does_not_is_a_skipped_cell(monkeypatch):
    import sys
    import types

    from zerobench.engines import ENGINES
    from zerobench.engines.base import Axis, Engine

    class Narrow(Engine):
        name = "narrow"
        options = {"sharding_strategy": Axis("FULL_SHARD", choices=("FULL_SHARD",))}
        supports_emulation = False

    monkeypatch.setitem(sys.modules, "zb_test_narrow", types.SimpleNamespace(Narrow=Narrow))
    monkeypatch.setitem(ENGINES, "narrow", "zb_test_narrow:Narrow")
    out = cells({"engine": ["torch-fsdp1", "narrow"], "sharding_strategy": ["FULL_SHARD", "NO_SHARD"]})
    skipped = [c for c in out if c.skip_reason]
    assert [c.id for c in skipped] == ["narrow-ws2-fp32-sharding_strategy=NO_SHARD"]
    assert "sharding_strategy: 'NO_SHARD' is not allowed (allowed: 'FULL_SHARD')" in skipped[0].skip_reason
    # a rank finds its runnable cell even though another engine's value is in the matrix
    from zerobench.spec.matrix import find_cell

    workload = parse_workload({"matrix": {"engine": ["torch-fsdp1", "narrow"],
                                          "sharding_strategy": ["FULL_SHARD", "NO_SHARD"]}})
    found = find_cell(workload, "narrow-ws2-fp32")
    assert (found.engine, found.world_size, found.dtype, found.skip_reason) == ("narrow", 2, "fp32", None)
    assert dict(found.options)["sharding_strategy"] == "FULL_SHARD"  # plus every engine's own axes at their defaults


def test_value_no_engine_allows_is_an_error():
    with pytest.raises(WorkloadError, match=r"sharding_strategy: 'FULL' is not allowed; did you mean 'FULL_SHARD'\? "
                                            r"\(allowed: 'FULL_SHARD'"):
        cells({"engine": ["torch-fsdp1"], "sharding_strategy": ["FULL"]})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_float_axis_must_be_finite(value):
    with pytest.raises(WorkloadError, match=r"matrix.emulate_gbps: (nan|inf) is not allowed \(allowed: a finite float >= 0"):
        cells({"engine": ["ddp"], "emulate_gbps": [value]})


def test_axis_of_no_engine_is_an_error():
    with pytest.raises(WorkloadError, match=r"unknown key matrix.sharding_stratgy; did you mean "
                                            r"matrix.sharding_strategy\? \(allowed in matrix: .*dtype, .*engine, .*"
                                            r"sharding_strategy, .*world_size; `zerobench engines` lists"):
        cells({"engine": ["torch-fsdp1"], "sharding_strategy": ["FULL_SHARD"], "sharding_stratgy": ["FULL_SHARD"]})


PARENT = """
[model]
kind = "mlp"
[matrix]
engine = ["ddp", "impl-fsdp", "torch-fsdp2"]
sharding_strategy = ["FULL_SHARD"]
reshard_after_forward = [true, false]
"""


def test_narrowing_the_engines_drops_their_axes_with_a_note(tmp_path):
    """A workload extended with fewer engines (or narrowed with --set) keeps the others'
    axes: dropped as it is loaded, with a note, and left out of what the run folder keeps."""
    from zerobench.spec.matrix import matrix_notes
    from zerobench.spec.workload import load_workload

    (tmp_path / "parent.toml").write_text(PARENT)
    (tmp_path / "child.toml").write_text('extends = "parent.toml"\n[matrix]\nengine = ["ddp", "impl-fsdp"]\n')
    note = ("matrix.reshard_after_forward dropped: no engine of matrix.engine (ddp, impl-fsdp) has it "
            "(it is torch-fsdp2's)")
    for workload in (load_workload(tmp_path / "child.toml"),
                     load_workload(tmp_path / "parent.toml", ["matrix.engine=ddp,impl-fsdp"])):
        assert [c.id for c in expand(workload)] == ["ddp-ws2-fp32", "impl-fsdp-ws2-fp32"]
        assert matrix_notes(workload) == [note]
        assert "reshard_after_forward" not in workload.to_dict()["matrix"]
    assert matrix_notes(load_workload(tmp_path / "parent.toml")) == []


def test_an_axis_written_beside_engines_that_do_not_take_it_is_refused(tmp_path):
    """Once dropped without a word: sharding_strategy with ddp alone."""
    from zerobench.spec.workload import load_workload

    message = (r"matrix.sharding_strategy: no engine of matrix.engine \(ddp\) takes it \(allowed: the axes of ddp; "
               r"sharding_strategy is torch-fsdp1, impl-fsdp's")
    with pytest.raises(WorkloadError, match=message):
        cells({"engine": ["ddp"], "sharding_strategy": ["FULL_SHARD"]})
    (tmp_path / "w.toml").write_text('[model]\nkind = "mlp"\n[matrix]\nengine = ["ddp"]\n'
                                     'sharding_strategy = ["SHARD_GRAD_OP"]\n')
    with pytest.raises(WorkloadError, match=rf"w.toml: {message}"):
        expand(load_workload(tmp_path / "w.toml"))
    # an axis the parent had, then set again beside the narrowed engines, is the child's own
    (tmp_path / "parent.toml").write_text(PARENT)
    (tmp_path / "child.toml").write_text('extends = "parent.toml"\n[matrix]\nengine = ["ddp"]\n'
                                         'reshard_after_forward = [false]\n')
    with pytest.raises(WorkloadError, match=r"matrix.reshard_after_forward: no engine of matrix.engine \(ddp\)"):
        expand(load_workload(tmp_path / "child.toml"))


def test_a_workload_with_no_matrix_says_what_it_runs(tmp_path):
    from zerobench.spec.matrix import matrix_notes
    from zerobench.spec.workload import load_workload

    (tmp_path / "w.toml").write_text('[model]\nkind = "mlp"\n')
    workload = load_workload(tmp_path / "w.toml")
    assert [c.id for c in expand(workload)] == ["ddp-ws2-fp32"]
    assert matrix_notes(workload) == ["no [matrix] table: runs the default matrix, engine ddp at world size 2 in "
                                      "fp32 (add a [matrix] table to choose engines and axes: `zerobench engines` "
                                      "lists them)"]
    assert matrix_notes(parse_workload(workload.to_dict())) == []  # the run folder's copy has its matrix


def test_unknown_engine_is_an_error():
    with pytest.raises(WorkloadError, match=r"matrix.engine: 'deepspeed' is not allowed; did you mean "
                                            r"one of 'deepspeed-zero1', 'deepspeed-zero2', 'deepspeed-zero3'\? \(allowed: 'ddp'"):
        cells({"engine": ["deepspeed"]})


def test_engine_refusing_a_combination_is_skipped():
    out = cells({"engine": ["torch-fsdp1"], "world_size": [1], "sharding_strategy": ["HYBRID_SHARD"]})
    assert out[0].skip_reason == "HYBRID_SHARD needs world_size >= 2"


def test_limiter_depth_multiplies_only_limited_cells():
    out = cells({"engine": ["impl-fsdp"], "limit_all_gathers": [False, True], "limiter_depth": [1, 2, 4]})
    assert len(out) == 1 + 3
    assert len({c.id for c in out}) == 4


def test_axis_that_depends_on_another_makes_no_duplicate_cells():
    from zerobench.engines.base import Axis

    axes = {"limit": Axis(False, choices=(False, True)),
            "depth": Axis(2, type=int, minimum=1, applies_when=("limit", True))}
    from zerobench.spec.matrix import _pin_inapplicable

    assert _pin_inapplicable(axes, [("limit", False), ("depth", 4)]) == [("limit", False), ("depth", 2)]
    assert _pin_inapplicable(axes, [("limit", True), ("depth", 4)]) == [("limit", True), ("depth", 4)]


def test_find_cell_expands_only_its_engine_and_agrees_with_the_full_matrix():
    from zerobench.spec.matrix import find_cell
    from zerobench.spec.workload import load_workload

    w = load_workload("workloads/fsdp-knobs.toml")
    full = expand(w)
    for cell in full:
        assert find_cell(w, cell.id) == cell
    assert find_cell(w, "impl-fsdp-ws2-fp32-nonsense=1") is None
    assert find_cell(w, "deepspeed-ws2-fp32") is None


def test_impl_fsdp_defaults_are_torch_fsdp1s():
    """A workload that leaves the knobs out compares the same schedule on both FSDPs."""
    impl, torch1 = engine_axes("impl-fsdp"), engine_axes("torch-fsdp1")
    shared = set(impl) & set(torch1)
    assert {"sharding_strategy", "backward_prefetch", "forward_prefetch", "limit_all_gathers"} <= shared
    assert {name: impl[name].default for name in shared} == {name: torch1[name].default for name in shared}
