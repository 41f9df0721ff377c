"""[Note: say what ran] (zerobench/engines/base.py): an engine that runs something other
than what its cell asked says so, in the cell record's ``ran`` and its note, which the
results table shows in the cell's row. Issue 33 item 4: torch's FSDP1 runs NO_SHARD when
its shard group has one rank, with only a warning in the rank's log."""

from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from zerobench.engines import get_engine
from zerobench.engines.base import RankContext, ran_note


@pytest.fixture
def fake_world(request):
    """A fake process group of ``request.param`` ranks, this process rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


def _wrapped(name: str, world_size: int, **options):
    cls = get_engine(name)
    opts = {axis: spec.default for axis, spec in cls.options.items()} | options
    engine = cls(opts, RankContext(0, world_size, 0, torch.device("cpu"), "gloo"), "fp32")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's own warning about the switch
        engine.wrap(model, list(model))
    return engine


@pytest.mark.parametrize("fake_world", [1], indirect=True)
@pytest.mark.parametrize("engine,strategy", [("torch-fsdp1", "FULL_SHARD"), ("torch-fsdp1", "SHARD_GRAD_OP"),
                                             ("impl-fsdp", "FULL_SHARD"), ("impl-fsdp", "SHARD_GRAD_OP")])
def test_a_one_rank_shard_group_runs_no_shard_and_says_so(fake_world, engine, strategy):
    ran = _wrapped(engine, fake_world, sharding_strategy=strategy).ran()
    assert set(ran) == {"sharding_strategy"}
    value, why = ran["sharding_strategy"]
    assert value == "NO_SHARD" and "world size 1" in why


@pytest.mark.parametrize("fake_world", [1], indirect=True)
@pytest.mark.parametrize("engine", ["torch-fsdp1", "impl-fsdp"])
def test_no_shard_asked_is_what_ran(fake_world, engine):
    assert _wrapped(engine, fake_world, sharding_strategy="NO_SHARD").ran() == {}


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("engine", ["torch-fsdp1", "impl-fsdp", "torch-fsdp2", "ddp"])
def test_two_ranks_run_what_was_asked(fake_world, engine):
    assert _wrapped(engine, fake_world).ran() == {}


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_fsdp1_hybrid_over_one_rank_shard_groups_is_no_shard_without_averaging(fake_world):
    """HYBRID_SHARD at two ranks shards over groups of one (impl's FSDP refuses the cell):
    FSDP1 runs NO_SHARD inside each, so the replicas' gradients are never averaged (a run
    of it departs from the reference by 1e-2 where the others agree to 1e-7)."""
    ran = _wrapped("torch-fsdp1", fake_world, sharding_strategy="HYBRID_SHARD").ran()
    value, why = ran["sharding_strategy"]
    assert value == "NO_SHARD" and "not averaged" in why


def test_the_note_names_each_setting_that_ran_otherwise():
    assert ran_note({}) is None
    note = ran_note({"sharding_strategy": {"value": "NO_SHARD", "why": "one rank"}})
    assert note == "ran sharding_strategy=NO_SHARD: one rank"


def _fsdp_at_one_rank(path):
    """A workload of FSDP1 and fully_shard at world size 1, a small MLP, a short run."""
    path.write_text("""
name = "ran"
[model]
kind = "mlp"
depth = 2
width = 32
[data]
batch_size = 4
warmup_steps = 1
steps = 2
[run]
memory_pass = false
[matrix]
engine = ["torch-fsdp1", "torch-fsdp2"]
world_size = [1]
dtype = ["fp32"]
""")


@pytest.mark.slow
def test_a_run_says_what_ran_in_the_record_and_the_row(tmp_path):
    from zerobench.cli import main

    _fsdp_at_one_rank(tmp_path / "w.toml")
    assert main(["run", str(tmp_path / "w.toml"), "--results", str(tmp_path / "r"), "--no-plots"]) == 0
    (run,) = (tmp_path / "r").iterdir()
    record = json.loads((run / "cells" / "torch-fsdp1-ws1-fp32.json").read_text())
    assert record["config"]["sharding_strategy"] == "FULL_SHARD"  # the cell is what the matrix asked
    assert record["ran"]["sharding_strategy"]["value"] == "NO_SHARD"
    assert record["note"].startswith("ran sharding_strategy=NO_SHARD: torch's FSDP1 runs NO_SHARD")
    rows = pd.read_csv(run / "results.csv").set_index("cell_id")
    assert "NO_SHARD" in rows.loc["torch-fsdp1-ws1-fp32", "note"]
    assert pd.isna(rows.loc["torch-fsdp2-ws1-fp32", "note"])  # fully_shard ran what it was asked
    assert "ran" not in json.loads((run / "cells" / "torch-fsdp2-ws1-fp32.json").read_text())


@pytest.mark.parametrize("command", ["predict", "estimate"])
def test_a_prediction_and_an_estimate_say_what_ran_in_the_row_and_under_the_table(tmp_path, command, capsys):
    """The virtual GPU and the estimator run the same engines: their rows carry the note,
    and their tables say it under the rows."""
    from zerobench.cli import main

    _fsdp_at_one_rank(tmp_path / "w.toml")
    assert main([command, str(tmp_path / "w.toml"), "--world-sizes", "1,2", "--results", str(tmp_path / "r")]) == 0
    (folder,) = (tmp_path / "r").iterdir()
    rows = pd.read_csv(folder / f"{command}.csv").set_index(["config", "world_size"])
    assert rows.loc[("torch-fsdp1-fp32", 1), "note"].startswith("ran sharding_strategy=NO_SHARD")
    assert pd.isna(rows.loc[("torch-fsdp1-fp32", 2), "note"])  # two ranks shard
    assert pd.isna(rows.loc[("torch-fsdp2-fp32", 1), "note"])
    out = capsys.readouterr().out
    assert "torch-fsdp1-fp32 at ws1: ran sharding_strategy=NO_SHARD" in out


@pytest.mark.slow
def test_a_bf16_loss_is_said_where_it_happened_and_not_elsewhere(tmp_path):
    """[Note: say what surprises]: fully_shard's bf16 forward leaves a GPT's loss bf16, and
    its row says so with the setting that closes the gap; DDP autocasts (an fp32 loss, no
    note), and with model.loss_dtype = "fp32" fully_shard's loss is fp32 and unnoted too."""
    from zerobench.cli import main
    from zerobench.engines.base import BF16_LOSS_NOTE

    (tmp_path / "w.toml").write_text(
        'name = "bf16"\n[model]\nkind = "gpt"\nlayers = 1\nd_model = 32\nheads = 2\nseq_len = 16\nvocab = 64\n'
        '[data]\nbatch_size = 2\nsteps = 2\nwarmup_steps = 1\n[run]\nmemory_pass = false\nreference = false\n'
        '[matrix]\nengine = ["ddp", "torch-fsdp2"]\nworld_size = [1]\ndtype = ["bf16"]\n')
    for loss_dtype, results in (("model", tmp_path / "a"), ("fp32", tmp_path / "b")):
        argv = ["run", str(tmp_path / "w.toml"), "--results", str(results), "--no-plots",
                "--set", f'model.loss_dtype="{loss_dtype}"']
        assert main(argv) == 0
        (run,) = results.iterdir()
        notes = {c: json.loads((run / "cells" / f"{c}.json").read_text()).get("note") or ""
                 for c in ("ddp-ws1-bf16", "torch-fsdp2-ws1-bf16")}
        assert BF16_LOSS_NOTE not in notes["ddp-ws1-bf16"]
        assert (BF16_LOSS_NOTE in notes["torch-fsdp2-ws1-bf16"]) == (loss_dtype == "model"), notes
