"""Which storages hold a tensor's bytes, decided once ([Note: a tensor's storages] in
zerobench/instruments/storages.py) and read the same way by every instrument: the storage
tracker, the virtual GPU's cost model, and the rank session's model-state counts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zerobench.instruments.memory import StorageTracker
from zerobench.instruments.storages import distinct_nbytes, local_tensor, storages_of, tensors_in
from zerobench.instruments.vgpu import costs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def dtensor():
    """A DTensor sharded over a fake world of two ranks: 8 x 4 fp32 globally, 4 x 4 here."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from zerobench.rank.worlds import FakeWorld

    with FakeWorld(2, 0):
        mesh = DeviceMesh("cpu", [0, 1])
        yield DTensor.from_local(torch.ones(4, 4), mesh, [Shard(0)], run_check=False)


def test_a_dtensor_holds_its_local_shard(dtensor):
    local = dtensor.to_local()
    assert dtensor.shape == (8, 4) and local_tensor(dtensor).shape == (4, 4)
    assert [s is local.untyped_storage() for s in storages_of([dtensor])] == [True]
    assert [s.nbytes() for s in storages_of([dtensor])] == [64]
    assert distinct_nbytes([dtensor]) == (64, 16)
    assert costs.tensor_bytes(dtensor) == 64  # the cost model reads the same bytes


def test_meta_tensors_hold_nothing_and_fake_tensors_hold_their_meta_storage():
    meta = torch.empty(1000, device="meta")
    assert list(storages_of([meta])) == [] and distinct_nbytes([meta]) == (0, 0)
    with FakeTensorMode():
        fake = torch.empty(1000)  # a fake CPU tensor: its storage is on the meta device
    (storage,) = storages_of(fake)
    assert storage.device.type == "meta" and storage.nbytes() == 4000
    assert distinct_nbytes([fake]) == (4000, 1000)


def test_views_share_their_base_storage_and_scalars_are_no_model_state():
    base = torch.zeros(10)
    view = base[2:]
    assert [s is base.untyped_storage() for s in storages_of({"a": [base, (view,)]})] == [True, True]
    # bytes once per storage, elements per tensor; a 0-d optimizer step counter is left out
    assert distinct_nbytes([base, view, torch.tensor(3.0), None, "not a tensor"]) == (40, 18)


def test_the_walk_finds_tensors_in_lists_tuples_and_kwargs_in_order():
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    assert [t.numel() for t in tensors_in(((a, [b]), {"out": c, "n": 4}))] == [1, 2, 3]


def test_the_tracker_counts_a_dtensor_by_the_same_rule(dtensor):
    tracker = StorageTracker("cpu", timeline=False)
    with tracker:
        tracker.track_tensors([dtensor, torch.empty(8, device="meta")])
        assert tracker.current_bytes == distinct_nbytes([dtensor])[0] == 64


def test_no_other_module_decides_which_storages_a_tensor_holds():
    """A DTensor's local shard is looked up in storages.py only: a second rule drifts."""
    readers = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "zerobench").rglob("*.py")
                     if re.search(r"_local_tensor\b", p.read_text()))
    assert readers == ["zerobench/instruments/storages.py"]
