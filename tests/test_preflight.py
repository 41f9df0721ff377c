"""Preflight: cells whose model states cannot fit are refused before anything is allocated."""

from __future__ import annotations

import textwrap

import pytest

from zerobench.harness import preflight
from zerobench.spec.matrix import expand
from zerobench.spec.workload import load_workload

WORKLOAD = textwrap.dedent("""
    name = "pf"
    [model]
    kind = "{kind}"
    {sizes}
    [matrix]
    engine = ["ddp", "impl-fsdp"]
    world_size = [2]
""")


def _workload(tmp_path, kind: str, sizes: str):
    path = tmp_path / "w.toml"
    path.write_text(WORKLOAD.format(kind=kind, sizes=sizes))
    return load_workload(path)


@pytest.mark.parametrize("kind, sizes", [
    ("mlp", "depth = 3\nwidth = 48"),
    ("gpt", "layers = 2\nd_model = 32\nheads = 2\nseq_len = 8\nvocab = 64"),
])
def test_formula_counts_what_the_model_builds(tmp_path, kind, sizes):
    w = _workload(tmp_path, kind, sizes)
    assert preflight._count_by_formula(w.model) == preflight.parameter_count(w)


def test_a_model_too_large_for_any_machine_is_refused_naming_both_numbers(tmp_path):
    w = _workload(tmp_path, "mlp", "depth = 2\nwidth = 100000000000")
    assert preflight.parameter_count(w) == 3 * (10**22 + 10**11)  # counted, never built
    for cell in expand(w, "cpu"):
        reason = preflight.refusal(w, cell, "cpu")
        assert reason is not None and reason.startswith(f"preflight: {cell.id} needs ")
        assert "GiB per rank" in reason and "GiB of host memory for 2 ranks" in reason
    # FULL_SHARD at world size 2 holds half of what DDP holds per rank (16 bytes per parameter)
    ddp, fsdp = (preflight.cell_need(w, c, "cpu").need_bytes for c in expand(w, "cpu"))
    assert fsdp == pytest.approx(ddp / 2)


def test_a_small_model_passes(tmp_path):
    w = _workload(tmp_path, "mlp", "depth = 2\nwidth = 64")
    assert all(preflight.refusal(w, c, "cpu") is None for c in expand(w, "cpu"))
