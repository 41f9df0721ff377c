"""A cell id is built and parsed in one place (zerobench/spec/cell.py): every id a shipped
workload's matrix gives reads back as itself, its configuration id drops only the world
size, and what is not an id is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerobench.spec.cell import Cell, CellId
from zerobench.spec.matrix import expand, find_cell
from zerobench.spec.workload import load_workload

WORKLOADS = sorted(Path("workloads").glob("*.toml"))


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.stem)
def test_every_shipped_cell_id_reads_back_as_itself(path):
    cells = expand(load_workload(path))
    assert cells
    for cell in cells:
        cid = CellId.parse(cell.id)
        assert (cid.engine, cid.world_size, cid.dtype) == (cell.engine, cell.world_size, cell.dtype)
        assert str(cid) == cell.id
        assert cid.config == cell.config_id == cell.id.replace(f"-ws{cell.world_size}-", "-", 1)
        assert CellId.parse(cid.config) == cid.at(None)  # a configuration id parses too
        assert str(CellId.parse(cid.config).at(cell.world_size)) == cell.id


def test_options_are_the_axes_off_their_defaults_with_digits_in_names():
    cell = Cell("deepspeed-zero3", 8, "bf16", (("overlap_comm", True), ("stage3_prefetch_bucket_size", 0),
                                                ("reduce_bucket_size", 500_000_000)))
    assert cell.id == "deepspeed-zero3-ws8-bf16-stage3_prefetch_bucket_size=0"
    assert CellId.parse(cell.id).options == (("stage3_prefetch_bucket_size", "0"),)
    two = CellId.parse("impl-fsdp-ws2-fp32-sharding_strategy=HYBRID_SHARD-emulate_link=ib-400g-emulate_gbps=12.5")
    assert two.options == (("sharding_strategy", "HYBRID_SHARD"), ("emulate_link", "ib-400g"), ("emulate_gbps", "12.5"))


def test_the_short_form_is_the_plot_label():
    assert CellId.parse("impl-fsdp-ws2-bf16-sharding_strategy=SHARD_GRAD_OP-backward_prefetch=post").short == \
        "impl-fsdp SHARD_GRAD_OP, bwd post"
    assert CellId.parse("ddp-fp32-emulate_gbps=25-emulate_latency_us=5").short == "ddp 25 GB/s, 5 µs"


def test_reference_cells_are_the_engine_at_its_defaults():
    import pandas as pd

    from zerobench.runs.tables import default_cells, reference_cells

    ids = pd.Series(["ddp-ws2-fp32", "ddp-ws4-bf16-gradient_as_bucket_view=on", "torch-fsdp2-ws2-fp32", None,
                     "ddp-fp32"])
    assert reference_cells(ids).tolist() == [True, False, False, False, False]  # a configuration id is no cell
    assert default_cells(ids, "torch-fsdp2").tolist() == [False, False, True, False, False]


@pytest.mark.parametrize("text", ["ddp", "ddp-ws2", "ddp-ws2-fp64", "", "-ws2-fp32"])
def test_what_is_not_an_id_is_refused_by_name(text):
    with pytest.raises(ValueError, match=rf"cell id {text!r} is not one \(allowed: ENGINE-wsN-DTYPE"):
        CellId.parse(text)
    assert CellId.try_parse(text) is None


def test_find_cell_reads_the_engine_from_the_id():
    """``torch-fsdp1`` and ``torch-fsdp2`` share a prefix; the id names one."""
    from zerobench.spec.workload import parse_workload

    w = parse_workload({"matrix": {"engine": ["torch-fsdp1", "torch-fsdp2"], "world_size": [2]}})
    assert find_cell(w, "torch-fsdp2-ws2-fp32").engine == "torch-fsdp2"
    assert find_cell(w, "torch-fsdp1-ws2-fp32").engine == "torch-fsdp1"
    assert find_cell(w, "ddp-ws2-fp32") is None  # not an engine of this matrix
    assert find_cell(w, "torch-fsdp2-fp32") is None  # a configuration id names no cell
