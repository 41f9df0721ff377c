"""The storage tracker on known allocations: exact bytes, views, frees, resizes, roles."""

import torch

from zerobench.instruments.memory import StorageTracker


def test_exact_bytes_of_allocations_views_and_frees():
    tracker = StorageTracker("cpu")
    with tracker:
        a = torch.empty(1000, dtype=torch.float32)       # 4000 B
        b = torch.empty(10, 10, dtype=torch.float64)     # 800 B
        view = a[:500]                                   # no new storage
        assert tracker.current_bytes == 4800
        del view, a
        assert tracker.current_bytes == 800
        c = torch.empty(256, dtype=torch.bfloat16)       # 512 B
        assert tracker.current_bytes == 1312
    assert tracker.peak_bytes == 4800
    del b, c


def test_peak_restarts_at_reset_and_breakdown_sums_to_peak():
    tracker = StorageTracker("cpu")
    with tracker:
        param = torch.zeros(100)                         # 400 B, "params"
        tracker.reset_peak()
        tracker.set_phase("forward")
        act = torch.ones(50) * 2                         # ones: 200 B freed at once; result 200 B, "activations"
        tracker.set_phase("backward")
        grad = torch.zeros(100)                          # 400 B
        tracker.set_phase("optimizer")
        tracker.note_roles("grads", [grad])
        tmp = torch.empty(25)                            # 100 B, "other"
        del tmp
        tracker.classify(params=[param])
    assert tracker.peak_bytes == 400 + 200 + 400 + 100
    assert tracker.peak_breakdown() == {"params": 400, "grads": 400, "optim": 0, "unsharded": 0,
                                        "activations": 200, "other": 100}
    del act


def test_storage_resize_is_followed():
    # FSDP frees unsharded parameters by resizing their storage to 0 and back.
    tracker = StorageTracker("cpu")
    with tracker:
        t = torch.empty(1000)                            # 4000 B
        t.untyped_storage().resize_(0)
        assert tracker.current_bytes == 0
        t.untyped_storage().resize_(2000)
        assert tracker.current_bytes == 2000
    assert tracker.peak_bytes == 4000


def test_tensors_allocated_before_tracking_can_be_registered():
    before = torch.empty(300)                            # 1200 B
    tracker = StorageTracker("cpu")
    with tracker:
        tracker.track_tensors([before, before[:10]])
        assert tracker.current_bytes == 1200
        _ = before + 1                                   # 1200 B more
    assert tracker.peak_bytes == 2400


def test_timeline_follows_the_measured_interval():
    tracker = StorageTracker("cpu")
    with tracker:
        keep = torch.empty(10)
        tracker.reset_peak()
        tracker.set_phase("forward")
        x = torch.empty(20)
        del x
    tl = tracker.timeline()
    assert list(tl["total_bytes"]) == [40, 120, 40]
    assert tl["activations"].max() == 80
    del keep
