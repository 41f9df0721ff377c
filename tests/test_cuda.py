"""Checks that need a CUDA GPU (``pytest -m cuda``; scripts/gpu-check runs them). Each
runs in a fresh process, so a process group or a CUDA context never leaks into the
other tests. Skipped without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parent.parent


def _python(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _check(name: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{name}.json"
    proc = _python(["-m", "zerobench.validation.gpu_check", name, str(out)])
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert proc.returncode == 0, json.dumps(result, indent=1)
    return result


def test_prefetch_hides_delayed_all_gathers(tmp_path):
    """[Note: GPU checks]: prefetch hides the delayed gathers and no prefetch does not."""
    result = _check("overlap", tmp_path)
    assert result["hidden_fraction"] >= result["hidden_min"]
    assert result["exposed_fraction_without_prefetch"] >= result["exposed_min"]


def test_limiter_bounds_peak_memory(tmp_path):
    """[Note: GPU checks]: the unit buffers a forward holds, above a baseline with no
    freed block pending, stay within depth + 1 units with the limiter and not without."""
    result = _check("limiter", tmp_path)
    on, off = result["with_limiter"], result["without_limiter"]
    assert on["pending_at_base_units"] == off["pending_at_base_units"] == 0
    assert on["peak_active_above_base_units"] <= result["bound_units"] + 0.25
    assert off["peak_active_above_base_units"] > result["bound_units"] + 0.25
    assert on["limiter_stalls"] > 0


def test_gloo_probe_answers_every_collective(tmp_path):
    out = tmp_path / "probe.json"
    proc = _python(["-m", "zerobench.validation.gpu_check", "probe-gloo", str(out)])
    result = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(result["collectives"]) == {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                                          "broadcast", "all_gather", "reduce_scatter", "barrier"}


def test_impl_fsdp_uses_side_streams_and_matches_unwrapped(tmp_path):
    code = textwrap.dedent("""
        import copy, torch, torch.distributed as dist, torch.nn as nn
        from zerobench.validation.gpu_check import _init_single
        from impl.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, CPUOffload
        _init_single()
        for offload in (False, True):
            torch.manual_seed(0)
            ref = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
            raw = copy.deepcopy(ref)
            pair = (dist.group.WORLD, dist.new_group([0]))
            kw = dict(process_group=pair, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                      device_id=torch.device("cuda", 0), cpu_offload=CPUOffload(offload_params=offload))
            raw[0], raw[2] = FSDP(raw[0], **kw), FSDP(raw[2], **kw)
            model = FSDP(raw, **kw)
            x = torch.randn(8, 32, device="cuda")
            model(x).sum().backward()
            s = model._root_state.streams
            assert s.cuda and s.unshard != torch.cuda.current_stream() and s.post_backward != s.unshard
            ref(x).sum().backward()
            grads = [m.flat_param.grad for m in model.fsdp_instances() if m._unit is not None]
            want = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in (ref[0], ref[2])]
            for g, w in zip(grads, want):
                assert (g.device.type == "cpu") == offload, g.device
                torch.testing.assert_close(g[: w.numel()].to(w.device), w)
        print("ok")
    """)
    proc = _python(["-c", code])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_device_mismatch_is_an_error_not_a_fallback():
    from zerobench.rank import devices

    n = torch.cuda.device_count()
    with pytest.raises(devices.DeviceError, match=f"{n + 1} ranks per node but {n} GPU"):
        devices.choose("cuda", 0, n + 1, env={})


def test_emulated_async_collective_overlaps_compute_and_sync_one_waits(tmp_path):
    """On NCCL at world size 1, an emulated all-reduce of ~40 ms: compute enqueued between
    issue and wait runs beside the modelled time; a synchronous call, or a wait right
    after issue, holds the stream until the modelled time has passed. Relative only."""
    code = textwrap.dedent("""
        import json, torch, torch.distributed as dist
        from zerobench.instruments import emulation
        from zerobench.validation.gpu_check import _init_single, cycles_per_ms
        from zerobench.instruments.link import Link
        _init_single()
        cpm = cycles_per_ms()
        x = torch.ones(1024, device="cuda")

        def timed(body):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            body()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        def overlapped():
            work = dist.all_reduce(x, async_op=True)
            torch.cuda._sleep(int(40 * cpm))  # compute on the current stream
            work.wait()

        def serial():
            dist.all_reduce(x)
            torch.cuda._sleep(int(40 * cpm))

        with emulation.emulated(Link(1000.0, 40_000.0)):  # 40 ms of latency per collective
            for body in (overlapped, serial):
                timed(body)  # warm-up (and calibration)
            out = {"overlapped_ms": min(timed(overlapped) for _ in range(3)),
                   "serial_ms": min(timed(serial) for _ in range(3))}
        print(json.dumps(out))
    """)
    proc = _python(["-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["overlapped_ms"] < 0.8 * out["serial_ms"], out
