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
        cells({"engine": ["ddp"], "sharding_strategy": ["FULL_SHARD"], "sharding_stratgy": ["FULL_SHARD"]})


def test_narrowing_the_engines_drops_their_axes_with_a_note():
    """quickstart extended with fewer engines keeps the others' axes: dropped, not refused."""
    from zerobench.spec.matrix import matrix_notes

    workload = parse_workload({"matrix": {"engine": ["ddp", "impl-fsdp"], "sharding_strategy": ["FULL_SHARD"],
                                          "reshard_after_forward": [True, False]}})
    assert [c.id for c in expand(workload)] == ["ddp-ws2-fp32", "impl-fsdp-ws2-fp32"]
    assert matrix_notes(workload) == ["matrix.reshard_after_forward dropped: no engine of matrix.engine "
                                      "(ddp, impl-fsdp) has it (it is torch-fsdp2's)"]
    assert matrix_notes(parse_workload({"matrix": {"engine": ["torch-fsdp2"],
                                                   "reshard_after_forward": [True]}})) == []


def test_unknown_engine_is_an_error():
    with pytest.raises(WorkloadError, match=r"matrix.engine: 'deepspeed' is not allowed; did you mean "
                                            r"'deepspeed-zero\d'\? \(allowed: 'ddp'"):
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
