"""The CUDA code paths, checked without a GPU: the stream/event order the engines issue
(through the CPU streams, which log it), the event-based limiter's queue with fake
events, and device selection with torch.cuda faked (no silent CPU fall-back)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from impl.fsdp.rate_limiter import FreeEventQueue, RateLimiter
from impl.streams import Streams
from tests.helpers.fsdp import batches, loss_fn, make_model, rank_slice, unit_policy, warm_up_imports
from zerobench.harness.testing import run_ranks
from zerobench.rank import devices

warm_up_imports()


# -- stream and event order through the CPU path ----------------------------------------


def _check_order(log: list) -> dict:
    """Every wait is on an event recorded earlier on another stream; every collective is
    issued on its stream right after that stream waited for compute. Returns counts."""
    recorded_on = {}
    counts = {"all_gather": 0, "reduce_scatter": 0, "compute_waits_unshard": 0, "compute_waits_post_backward": 0}
    for i, (action, stream, ev) in enumerate(log):
        if action == "record":
            recorded_on[ev] = stream
        elif action == "wait":
            assert ev in recorded_on, f"entry {i}: {stream} waits on event {ev} before it was recorded"
            assert recorded_on[ev] != stream, f"entry {i}: {stream} waits on its own event"
            if stream == "compute":
                counts[f"compute_waits_{recorded_on[ev]}"] += 1
        elif action in ("all_gather", "reduce_scatter"):
            counts[action] += 1
            want = "unshard" if action == "all_gather" else "post_backward"
            prev = log[i - 1]
            assert prev[0] == "wait" and prev[1] == want, f"entry {i}: {action} not preceded by {want} waiting: {prev}"
            assert recorded_on[prev[2]] == "compute", f"entry {i}: {action} waits on a {recorded_on[prev[2]]} event"
    return counts


def _stream_order_body(rank, world_size, prefetch):
    from impl import comm
    from impl.fsdp import BackwardPrefetch
    from impl.fsdp import FullyShardedDataParallel as FSDP

    raw = make_model("mlp")
    model = FSDP(raw, auto_wrap_policy=unit_policy(raw),
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE if prefetch else None, forward_prefetch=prefetch)
    x, y = batches("mlp", 1)[0]
    model(rank_slice(x, rank, world_size))  # lazy init: the streams exist from here
    log = model._root_state.streams.log
    log.clear()
    real = {name: getattr(comm, name) for name in ("all_gather", "reduce_scatter")}

    def logged(name):
        def call(*args, **kwargs):
            log.append((name, None, None))
            return real[name](*args, **kwargs)
        return call

    for name in real:
        setattr(comm, name, logged(name))
    try:
        loss_fn("mlp", model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
    finally:
        for name, fn in real.items():
            setattr(comm, name, fn)
    return _check_order(list(log)), len(model.fsdp_instances())


@pytest.mark.parametrize("prefetch", [False, True])
def test_fsdp_stream_event_order_on_cpu(prefetch):
    for counts, units in run_ranks(_stream_order_body, world_size=2, args=(prefetch,)):
        assert counts["all_gather"] >= units  # forward and backward gathers (the root stays unsharded)
        # every gathered unit is used only after compute waited for the unshard stream
        assert counts["compute_waits_unshard"] == counts["all_gather"]
        assert counts["reduce_scatter"] == units
        assert counts["compute_waits_post_backward"] == units


def _zero2_order_body(rank, world_size):
    from impl import comm
    from impl.zero.stage2 import ZeroStage2Optimizer

    raw = make_model("mlp")
    opt = ZeroStage2Optimizer(raw.parameters(), torch.optim.SGD, bucket_cap_mb=0.0005, lr=0.1)
    x, y = batches("mlp", 1)[0]
    opt.bucketer.streams = Streams(torch.device("cpu"))
    log = opt.bucketer.streams.log
    real = comm.reduce_scatter

    def logged(*args, **kwargs):
        log.append(("reduce_scatter", None, None))
        return real(*args, **kwargs)

    comm.reduce_scatter = logged
    try:
        loss_fn("mlp", raw(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
    finally:
        comm.reduce_scatter = real
    return _check_order(list(log))


def test_zero2_bucketed_reduce_scatter_on_its_stream():
    for counts in run_ranks(_zero2_order_body, world_size=2):
        assert counts["reduce_scatter"] >= 2
        assert counts["compute_waits_post_backward"] == counts["reduce_scatter"]


# -- the event-based limiter (CUDA mode) with fake events ------------------------------------


class FakeEvent:
    def __init__(self, name, synced, done=False):
        self.name, self._synced, self._done = name, synced, done

    def query(self):
        return self._done

    def synchronize(self):
        self._synced.append(self.name)


def test_free_event_queue_dequeues_oldest_at_depth():
    q = FreeEventQueue(2)
    assert q.dequeue_if_needed() is None
    q.enqueue("a")
    assert q.dequeue_if_needed() is None
    q.enqueue("b")
    q.enqueue("c")
    assert q.dequeue_if_needed() == "a"
    assert q.dequeue_if_needed() == "b"
    assert q.dequeue_if_needed() is None and len(q) == 1


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_event_limiter_blocks_on_oldest_free(depth):
    synced = []
    limiter = RateLimiter(True, depth, use_events=True)
    unit = object()
    for i in range(5):
        limiter.before_all_gather()
        assert limiter.admit(unit, prefetch=True, ticketed=True)  # never deferred in event mode
        limiter.on_issue(unit, True)
        limiter.on_free(unit, FakeEvent(i, synced))
    # the CPU blocked before each gather once `depth` frees were queued, oldest first
    assert synced == list(range(5 - depth))
    m = limiter.take_metrics()
    assert m["limiter_stalls"] == 5 - depth and m["limiter_overruns"] == 0 and m["limiter_stall_s"] >= 0


def test_event_limiter_counts_no_stall_for_a_completed_free():
    """A free the device has already passed costs the host nothing: no block, no stall
    (it used to count one per dequeued event)."""
    synced = []
    limiter = RateLimiter(True, 1, use_events=True)
    for i in range(4):
        limiter.before_all_gather()
        limiter.on_free(object(), FakeEvent(i, synced, done=True))
    assert synced == [] and limiter.take_metrics()["limiter_stalls"] == 0


def test_event_limiter_off_or_cpu_never_blocks():
    synced = []
    for limiter in (RateLimiter(False, 1, use_events=True), RateLimiter(True, 1, use_events=False)):
        for i in range(3):
            limiter.before_all_gather()
            limiter.on_free(object(), FakeEvent(i, synced))
    assert synced == []


# -- device selection ---------------------------------------------------------------------------


@pytest.fixture
def gpus(monkeypatch):
    def set_count(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.delenv(devices.SHARED_ENV, raising=False)
    return set_count


@pytest.mark.parametrize("requested", ["cuda", "auto"])
def test_fewer_gpus_than_local_ranks_is_an_error_naming_both(gpus, requested):
    gpus(1)
    with pytest.raises(devices.DeviceError, match=r"4 ranks per node but 1 GPU is visible"):
        devices.choose(requested, 0, 4, env={})
    from zerobench.rank.passes import pick_device

    with pytest.raises(devices.DeviceError):
        pick_device(requested, 0, 4)


def test_gpus_present_means_cuda_and_nccl_unless_cpu_asked(gpus):
    gpus(2)
    c = devices.choose("auto", 1, 2, env={})
    assert (c.device, c.backend) == (torch.device("cuda", 1), "nccl")
    c = devices.choose("cpu", 1, 2, env={})
    assert (c.device, c.backend) == (torch.device("cpu"), "gloo")
    assert devices.device_type("auto") == "cuda" and devices.backend("auto", env={}) == "nccl"


def test_no_gpu(gpus):
    gpus(0)
    assert devices.choose("auto", 0, 2, env={}).backend == "gloo"
    with pytest.raises(devices.DeviceError, match="no GPU is visible"):
        devices.choose("cuda", 0, 1, env={})


def test_shared_gpu_is_opt_in_and_gloo_only(gpus):
    gpus(1)
    c = devices.choose("cuda", 1, 2, env={devices.SHARED_ENV: "gloo"})
    assert (c.device, c.backend, c.shared) == (torch.device("cuda", 0), "gloo", True)
    with pytest.raises(ValueError, match=devices.SHARED_ENV):
        devices.choose("cuda", 0, 2, env={devices.SHARED_ENV: "nccl"})
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        devices.choose("gpu", 0, 1, env={})


def test_meta_records_device_environment(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setattr(devices, "_driver_version", lambda: "555.1")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    info = devices.environment("auto")
    assert info["gpu_models"] == ["Fake GPU"] and info["nccl_version"] == "2.21.5"
    assert info["gpu_driver_version"] == "555.1" and info["backend"] == "nccl"
    assert info["env"]["NCCL_DEBUG"] == "INFO" and info["env"]["CUDA_VISIBLE_DEVICES"] == "3"
    assert "cuda_version" in info and "torch_threads" in info


# -- scripts/gpu-check pieces that run without a GPU ------------------------------------------


def test_gpu_check_cells_summary(tmp_path):
    from zerobench.validation.gpu_check import cells_check

    run = tmp_path / "runs" / "r1"
    (run / "cells").mkdir(parents=True)
    (run / "workload.json").write_text("{}")
    config = {"engine": "ddp", "world_size": 1, "dtype": "fp32"}
    for cid, status in (("a", "ok"), ("b", "skipped")):
        (run / "cells" / f"{cid}.json").write_text(json.dumps({"cell_id": cid, "status": status, "config": config}))
    assert cells_check(str(tmp_path / "runs"))["pass"]
    (run / "cells" / "c.json").write_text(json.dumps({"cell_id": "c", "status": "failed", "error": "boom",
                                                      "config": config}))
    result = cells_check(str(tmp_path / "runs"))
    assert not result["pass"] and result["failed"] == 1 and result["cells"]["c"]["error"] == "boom"
    (run / "cells" / "d.json").write_text("{not json")  # a damaged record is a failed cell naming it
    result = cells_check(str(tmp_path / "runs"))
    assert result["failed"] == 2 and "damaged cell record" in result["cells"]["d"]["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_gpu_check_script_says_no_gpu(tmp_path):
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([os.path.join(root, "scripts", "gpu-check"), str(tmp_path / "out")], cwd=root,
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stdout


# The event limiter on a device queue is exercised on the virtual GPU: tests/test_vgpu.py.
