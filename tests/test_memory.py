"""The storage tracker on known allocations: exact bytes, views, frees, resizes, roles."""

import gc
import threading

import torch

from zerobench.instruments.memory import StorageTracker, measure_exact_step


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


# -- [Note: frees on other threads] ----------------------------------------------------


def _free_on_another_thread(holder: list) -> None:
    """Drop the last reference in ``holder`` on a thread of its own, as gloo's worker
    thread does with a finished collective's tensors."""
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()


def test_a_late_free_of_a_storage_live_at_the_peak_makes_the_peak_inexact():
    tracker = StorageTracker("cpu")
    with tracker:
        tracker.reset_peak()
        held = [torch.empty(1000)]                       # 4000 B, held by "the collective" alone
        late = torch.empty(500)                          # 2000 B: the peak, with the held one counted
        del late
        _free_on_another_thread(held)
        assert tracker.current_bytes == 0 and tracker.peak_bytes == 6000
        assert not tracker.peak_exact
        tracker.reset_peak()                             # a new interval starts exact
        assert tracker.peak_exact


def test_a_late_free_of_a_storage_used_at_the_peak_leaves_it_exact():
    tracker = StorageTracker("cpu")
    with tracker:
        tracker.reset_peak()
        held = [torch.empty(1000)]                       # 4000 B
        out = held[0] + 1                                # 4000 B: the peak, made by an op that uses it
        del out
        _free_on_another_thread(held)
    assert tracker.peak_bytes == 8000 and tracker.peak_exact


def test_a_late_free_that_the_peak_did_not_include_leaves_it_exact():
    tracker = StorageTracker("cpu")
    with tracker:
        tracker.reset_peak()
        held = [torch.empty(100)]                        # 400 B
        _free_on_another_thread(held)
        big = torch.empty(1000)                          # 4000 B: the peak, without the late one
        del big
    assert tracker.peak_bytes == 4000 and tracker.peak_exact


def test_measure_exact_step_repeats_until_every_rank_agrees_and_tracks_nothing_of_its_own():
    tracker = StorageTracker("cpu")
    verdicts, kept = [], []

    def step(attempt):
        tracker.reset_peak()
        held = [torch.empty(1000)]                       # 4000 B
        if attempt == 0:                                 # freed late, after a 40 B allocation: peak 4040, inexact
            small = torch.empty(10)
            _free_on_another_thread(held)
        else:                                            # freed in program order: peak 4000
            held.clear()
            small = torch.empty(10)
        del small
        return torch.empty(250)                          # 1000 B, kept by the caller: not into the next attempt

    def all_exact(flag):
        verdicts.append(flag)
        kept.append(torch.ones(1).sum())                 # outside the mode: not tracked
        return flag and len(verdicts) > 2                # "another rank" is inexact on attempt 2

    with tracker:
        last, steps = measure_exact_step(tracker, step, all_exact)
    assert steps == 3 and verdicts == [False, True, True] and last.numel() == 250
    assert tracker.peak_bytes == 4000 and tracker.peak_exact
    assert tracker.current_bytes == 1000                 # the last result; all_exact's tensors were never tracked
    assert gc.isenabled()


def test_measure_exact_step_gives_up_after_its_attempts():
    tracker = StorageTracker("cpu")

    def step(attempt):
        tracker.reset_peak()
        held = [torch.empty(1000)]
        small = torch.empty(10)
        _free_on_another_thread(held)
        del small

    with tracker:
        _, steps = measure_exact_step(tracker, step, attempts=3)
    assert steps == 4 and not tracker.peak_exact


def test_phases_are_timed_from_the_measured_steps_start_and_other_is_split_by_when_it_was_allocated():
    """[Note: what other holds]: a buffer kept from before the step, one allocated in
    backward and one in the optimizer step, none of them parameters, gradients or state."""
    tracker = StorageTracker("cpu")
    with tracker:
        kept = torch.empty(100)                          # 400 B, live as the step begins
        tracker.set_phase("after")  # an earlier step's phases are forgotten at reset_peak
        tracker.reset_peak()
        tracker.set_phase("forward")
        act = torch.empty(10)                            # 40 B, "activations"
        tracker.set_phase("backward")
        bucket = torch.empty(50)                         # 200 B
        tracker.set_phase("optimizer")
        tmp = torch.empty(25)                            # 100 B
        tracker.set_phase("after")
    assert [name for _, name in tracker.phases()] == ["forward", "backward", "optimizer", "after"]
    times = [t for t, _ in tracker.phases()]
    assert times == sorted(times) and times[0] >= 0
    assert tracker.peak_breakdown()["other"] == 700
    assert tracker.peak_other_breakdown() == {"kept": 400, "backward": 200, "optimizer": 100}
    del kept, act, bucket, tmp
