"""Each engine declares its options once (zerobench/engines/options.py): a frozen class
with defaults, from which its matrix axes, the values it is built with, the knob lists
of plots, simulate and predict --matrix, and HYBRID_SHARD's shard group all come."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerobench.engines import ENGINES, get_engine
from zerobench.engines.options import (
    OPTIONS,
    FSDP1Options,
    ImplFSDPOptions,
    TorchFSDP1Options,
    axes_with_role,
    matrix_sweeps,
)
from zerobench.spec.cell import Cell

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_an_engine_takes_its_axes_and_defaults_from_its_options_class(engine):
    cls = get_engine(engine)
    assert cls.Options is OPTIONS[engine]
    assert cls.options == OPTIONS[engine].axes()
    defaults = OPTIONS[engine]()
    for f in dataclasses.fields(defaults):
        assert f.metadata["axis"].default == getattr(defaults, f.name), f.name
        assert f.metadata["axis"].doc, f"{engine}.{f.name} has no doc"


def test_options_are_frozen_and_checked_where_they_are_made():
    s = ImplFSDPOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.limit_all_gathers = False
    with pytest.raises(ValueError, match=r"backward_prefetch: 'later' is not allowed \(allowed: 'none', 'pre', 'post'\)"):
        ImplFSDPOptions(backward_prefetch="later")
    with pytest.raises(ValueError, match=r"limiter_depth: 0 is not allowed \(allowed: int >= 1\)"):
        ImplFSDPOptions.from_options({"limiter_depth": 0, "activation_checkpointing": "none"})


def test_the_fsdp1_knobs_are_declared_once_for_both_fsdp1_engines():
    shared = [f.name for f in dataclasses.fields(FSDP1Options)]
    for cls in (TorchFSDP1Options, ImplFSDPOptions):
        assert issubclass(cls, FSDP1Options)
        assert [n for n in cls.axes() if n in shared] == shared
        assert all(cls.axes()[n] is FSDP1Options.axes()[n] for n in shared)


def test_impl_fsdp_is_built_with_the_declared_defaults(monkeypatch):
    """Where a cell leaves an option out, wrap() passes the declared default: once
    limit_all_gathers fell back to False and backward_prefetch to "none" there."""
    import torch

    from impl.fsdp import BackwardPrefetch
    from zerobench.engines import impl_fsdp
    from zerobench.engines.base import RankContext

    seen = {}
    monkeypatch.setattr(impl_fsdp, "FSDP", lambda model, **kwargs: seen.update(kwargs) or model)
    ctx = RankContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    impl_fsdp.FSDPEngine({}, ctx, "fp32").wrap(torch.nn.Linear(2, 2), [])
    assert seen["limit_all_gathers"] is True and seen["backward_prefetch"] is BackwardPrefetch.BACKWARD_PRE
    assert seen["limiter_depth"] == 2 and seen["forward_prefetch"] is False and seen["use_orig_params"] is False


def test_knob_lists_come_from_the_options():
    from zerobench.analysis.plots import KNOB_AXES
    from zerobench.whatif.predict import MATRIX
    from zerobench.whatif.simulate.extract import _KNOB_AXES

    assert KNOB_AXES == ("backward_prefetch", "forward_prefetch", "limit_all_gathers", "limiter_depth")
    assert set(_KNOB_AXES) == set(KNOB_AXES) | {"sharding_strategy", "reshard_after_forward"}
    assert MATRIX == matrix_sweeps()
    assert set(MATRIX) == {"torch-fsdp1", "impl-fsdp", "torch-fsdp2"}
    for engine, sweeps in MATRIX.items():
        for axis, values in sweeps.items():
            for v in values:
                OPTIONS[engine].axes()[axis].check(axis, v)
    assert set(axes_with_role("sharding")) == {"sharding_strategy", "reshard_after_forward"}
    from zerobench.analysis.pareto import STYLE_OPTIONS

    assert STYLE_OPTIONS == (*axes_with_role("sharding"), "activation_checkpointing")


def test_hybrid_shard_group_is_a_property_of_the_cell(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    hybrid = (("sharding_strategy", "HYBRID_SHARD"),)
    assert Cell("impl-fsdp", 8, "fp32", hybrid).shard_group_size == 4
    assert Cell("torch-fsdp1", 6, "fp32", hybrid).shard_group_size == 3
    assert Cell("impl-fsdp", 8, "fp32", (("sharding_strategy", "FULL_SHARD"),)).shard_group_size is None
    assert Cell("ddp", 8, "fp32").shard_group_size is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one node's ranks, as torchrun sets it
    assert Cell("impl-fsdp", 8, "fp32", hybrid).shard_group_size == 2


def test_the_options_import_no_torch():
    code = "import sys, zerobench.engines.options, zerobench.spec.cell; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
