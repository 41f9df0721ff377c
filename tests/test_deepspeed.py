"""The DeepSpeed engines without ranks: availability, the config each cell hands
DeepSpeed, the notes a cell carries, the skipped cells. Nothing here imports DeepSpeed,
so these run whether or not the extra is installed."""

from __future__ import annotations

import importlib.metadata

import pytest

from zerobench import cli
from zerobench.engines import deepspeed as ds
from zerobench.engines import get_engine
from zerobench.spec.matrix import expand
from zerobench.spec.workload import parse_workload

STAGES = ("deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")


def _workload(**matrix):
    return parse_workload({"model": {"kind": "mlp", "depth": 2, "width": 16},
                           "matrix": {"engine": list(STAGES), "world_size": [2], **matrix}})


def _installed(monkeypatch, version: str | None):
    real = importlib.metadata.version

    def fake(name):
        if name != "deepspeed":
            return real(name)
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(importlib.metadata, "version", fake)


def test_without_the_extra_the_engines_are_unavailable_and_their_cells_skipped(monkeypatch, capsys):
    _installed(monkeypatch, None)
    why = ds.deepspeed_unavailable()
    assert "not installed" in why and "pip install -e '.[deepspeed]'" in why and "g++" in why
    cells = expand(_workload())
    assert len(cells) == 3
    for cell in cells:
        assert cell.skip_reason == f"{cell.engine} is unavailable: {why}"
    cli.main(["engines"])
    listed = capsys.readouterr().out.splitlines()
    for name in STAGES:
        assert f"{name}   (unavailable: {why})" in listed
    assert "ddp" in listed  # the others are listed plainly


@pytest.mark.parametrize("version, ok", [("0.19.8", True), ("0.19.12", True), ("0.19.7", False),
                                         ("0.20.0", False), ("0.18.9", False)])
def test_only_the_tested_versions_are_available(monkeypatch, version, ok):
    _installed(monkeypatch, version)
    why = get_engine("deepspeed-zero2").unavailable()
    if ok:
        assert why is None
    else:
        assert f"DeepSpeed {version} is installed" in why and ">=0.19.8,<0.20" in why


def test_config_carries_the_stage_the_knobs_and_the_dtype():
    opts = {"overlap_comm": True, "reduce_bucket_size": 1000, "allgather_bucket_size": 2000,
            "contiguous_gradients": False, "activation_checkpointing": "full", "emulate_link": ""}
    config = ds.ds_config(2, opts, "fp32")
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 1000,
                                           "allgather_bucket_size": 2000, "contiguous_gradients": False}
    assert "bf16" not in config and config["gradient_accumulation_steps"] == 1
    assert ds.ds_config(3, {"stage3_max_live_parameters": 5}, "bf16")["bf16"] == {"enabled": True}
    assert ds.ds_config(3, {"stage3_max_live_parameters": 5}, "bf16")["zero_optimization"] == {
        "stage": 3, "stage3_max_live_parameters": 5}


def test_each_stage_declares_the_knobs_it_reads_with_deepspeeds_defaults():
    z1, z2, z3 = (get_engine(n).options for n in STAGES)
    assert set(z1) == set(z2) == {"overlap_comm", "contiguous_gradients", "reduce_bucket_size",
                                  "allgather_bucket_size"}
    assert set(z3) == {"overlap_comm", "contiguous_gradients", "reduce_bucket_size", "stage3_prefetch_bucket_size",
                       "stage3_max_live_parameters", "stage3_max_reuse_distance",
                       "stage3_param_persistence_threshold"}
    # DeepSpeed 0.19.8 (deepspeed/runtime/zero/config.py): overlap_comm is on by default for stage 3 only
    assert (z1["overlap_comm"].default, z3["overlap_comm"].default) == (False, True)
    assert z3["reduce_bucket_size"].default == 500_000_000 and z3["stage3_param_persistence_threshold"].default == 100_000
    with pytest.raises(ValueError, match=r"reduce_bucket_size: 0 is not allowed \(allowed: int >= 1\)"):
        z2["reduce_bucket_size"].check("reduce_bucket_size", 0)


def test_a_knob_of_one_stage_only_multiplies_that_stages_cells():
    cells = expand(_workload(stage3_prefetch_bucket_size=[0, 50_000_000], allgather_bucket_size=[500_000_000]))
    assert [c.id for c in cells] == ["deepspeed-zero1-ws2-fp32", "deepspeed-zero2-ws2-fp32",
                                     "deepspeed-zero3-ws2-fp32-stage3_prefetch_bucket_size=0",
                                     "deepspeed-zero3-ws2-fp32"]


def test_notes_say_what_deepspeed_ignores_here(monkeypatch):
    _installed(monkeypatch, "0.19.8")
    z2, z3 = get_engine("deepspeed-zero2"), get_engine("deepspeed-zero3")
    bucket = ("reduce_bucket_size 500,000,000: DeepSpeed allocates the gradient bucket whole (1.86 GiB in fp32) "
              "whatever the model's size")  # [Note: say what surprises]: every cell says it
    assert z2.notes({"overlap_comm": False}, "fp32", 2, "cpu").startswith(bucket)
    assert "(0.93 GiB in bf16)" in z2.notes({"overlap_comm": False}, "bf16", 2, "cpu")
    assert "reduce_bucket_size 1,000:" in z2.notes({"reduce_bucket_size": 1000}, "fp32", 2, "cpu")
    note = z2.notes({"overlap_comm": True}, "fp32", 2, "cpu")
    assert note.startswith("overlap_comm: no side stream on CPU") and "second bucket is still allocated" in note
    assert "second bucket" not in z3.notes({"overlap_comm": True}, "fp32", 2, "cpu")
    assert z3.notes({"overlap_comm": True}, "fp32", 2, "cuda").startswith(bucket)  # a side stream on a GPU
    assert "allgather_bucket_size: unused" in z2.notes({"allgather_bucket_size": 1000}, "fp32", 2, "cuda")
    cells = {c.engine: c for c in expand(_workload(overlap_comm=[True]))}
    assert cells["deepspeed-zero3"].note == z3.notes({"overlap_comm": True}, "fp32", 2, "cpu")
    assert "second bucket" in cells["deepspeed-zero1"].note


def test_an_odd_allgather_bucket_size_is_a_skipped_cell():
    why = get_engine("deepspeed-zero1").unsupported({"allgather_bucket_size": 1001}, "fp32", 2, "cpu")
    assert why == "deepspeed-zero1: allgather_bucket_size 1001 is not allowed (allowed: an even int >= 2)"


def test_the_papers_convention_counts_deepspeeds_master_copy_as_optimizer_state():
    """`zerobench estimate`'s model states in the ZeRO paper's convention: DeepSpeed's
    optimizer state includes the fp32 master partition, which the paper's K = 12 counts."""
    from zerobench.engines.stages import keeps_master_copy, model_state_bytes, paper_bytes_from_counts

    psi, n = 8000, 8
    master_m_v = 3 * psi // n  # a stage-3 rank's optimizer-state elements with AdamW
    counted = paper_bytes_from_counts(psi // n, psi // n, master_m_v, "adamw",
                                      master_copy=keeps_master_copy("deepspeed-zero3"))
    assert counted == model_state_bytes(psi, n, 3, "mixed", "adamw")["total"]
    assert not keeps_master_copy("torch-fsdp2") and not keeps_master_copy("impl-zero2")
