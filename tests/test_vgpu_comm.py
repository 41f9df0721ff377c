"""Communication as NCCL delivers it (zerobench/instruments/vgpu/comm.py): published bus
bandwidth by message size, and compute kernels slowed beside a running NCCL kernel."""

from __future__ import annotations

import pytest
import torch

from zerobench.instruments.link import PRESETS, Link
from zerobench.instruments.vgpu import GpuPreset, HostPreset, VirtualGpu, comm

GiB, MiB = 2**30, 2**20


def test_the_published_curves_come_back_at_their_points_and_between_them():
    curve = comm.A100_NVLINK3
    assert curve.busbw(16 * GiB) == pytest.approx(234.89)
    assert curve.busbw(32 * GiB) == pytest.approx(234.89)  # saturated beyond the last point
    assert curve.busbw(64 * MiB) == pytest.approx(171.54)
    between = curve.busbw(96 * MiB)
    assert 171.54 < between < 176.92
    # below the smallest point a collective is latency-bound: it takes the smallest one's time
    seconds_small = comm.collective_seconds("all_reduce", 4 * 1024, 8, PRESETS["nvlink3-8gpu"])
    seconds_32k = comm.collective_seconds("all_reduce", 32 * 1024, 8, PRESETS["nvlink3-8gpu"])
    assert seconds_small == pytest.approx(seconds_32k)


def test_a_large_all_reduce_takes_its_published_time_on_a100():
    """nccl-tests' 16 GiB all-reduce on 8 A100s: 127,997 us (busbw 234.89 GB/s)."""
    seconds = comm.collective_seconds("all_reduce", 16 * GiB, 8, PRESETS["nvlink3-8gpu"])
    assert seconds == pytest.approx(127_997e-6, rel=0.01)


def test_nvlink4_rings_are_capped_and_only_a_wide_all_reduce_uses_nvls():
    link = PRESETS["nvlink4-8gpu"]
    size = 4 * GiB
    gather = comm.collective_seconds("all_gather", size, 8, link)
    assert comm.bus_bytes_per_s("all_gather", size, 8, gather) == pytest.approx(361.4e9)
    reduce8 = comm.collective_seconds("all_reduce", size, 8, link)
    assert comm.bus_bytes_per_s("all_reduce", size, 8, reduce8) == pytest.approx(473.10e9)
    reduce4 = comm.collective_seconds("all_reduce", size, 4, link)
    assert comm.bus_bytes_per_s("all_reduce", size, 4, reduce4) == pytest.approx(367.61e9)
    # below the ring's rate the curve itself: latency-bound small messages
    small = comm.collective_seconds("all_gather", 1 * MiB, 8, link)
    assert comm.bus_bytes_per_s("all_gather", 1 * MiB, 8, small) == pytest.approx(39.93e9)


def test_a_link_without_a_curve_reaches_eighty_percent_of_its_peak():
    link = PRESETS["ib-400g"]  # 50 GB/s, 20 us
    seconds = comm.collective_seconds("reduce_scatter", 1 * GiB, 16, link)
    assert seconds == pytest.approx(20e-6 + (15 / 16) * GiB / (50e9 * 0.8))
    assert comm.collective_seconds("all_gather", 1 * GiB, 1, link) == 0.0  # one rank: nothing on the wire
    custom = Link(10.0, 0.0)
    assert comm.collective_seconds("broadcast", 10**9, 2, custom) == pytest.approx(1 / 0.8 / 10)


def test_nccl_slows_the_kernels_beside_it_by_the_measured_factors():
    """NVIDIA/nccl#1428 on A100s: GEMM x1.76, attention x1.83, elementwise x2.5 beside an
    all-gather at NVLink 3's rate; half that traffic, half the excess."""
    assert comm.contention("compute", 234.89e9) == pytest.approx(2.08 / 1.18)
    assert comm.contention("attention", 500e9) == pytest.approx(0.33 / 0.18)  # no more than measured
    assert comm.contention("memory", 234.89e9 / 2) == pytest.approx(1 + (2.5 - 1) / 2)
    assert comm.contention("compute", 0.0) == 1.0


def test_compute_beside_a_running_collective_is_slowed_for_the_overlap_only():
    """A 1 ms compute-bound kernel issued at t=0 beside a collective at the measurement's
    bus rate that runs until 0.5 ms: it reaches 0.5 ms having done 0.5 / 1.76 of its work,
    and the rest runs at full speed."""
    preset = GpuPreset("toy", memory_bytes=1 << 30, peak_flops={torch.float32: 1e12}, hbm_bytes_per_s=1e12,
                       kernel_floor_s=0.0, context_bytes=0)
    gpu = VirtualGpu(gpu=preset, host=HostPreset("zero", 0.0, 0.0))
    factor = 2.08 / 1.18
    gpu.record_collective(0.0, 0.5e-3, 234.89e9)
    assert gpu.beside_collectives(gpu.default, 1e-3, 0.0, 0.0) == pytest.approx(0.5e-3 + (1 - 0.5 / factor) * 1e-3)
    high = gpu.Stream(priority=-1)  # FSDP2's all-gather and reduce-scatter streams
    assert gpu.beside_collectives(high, 1e-3, 0.0, 0.0) == pytest.approx(1e-3)
    gpu.host.advance(1e-3)  # the collective is over for anything issued from now on
    gpu.record_collective(2e-3, 3e-3, 234.89e9)
    assert len(gpu._collectives_running) == 1
    assert gpu.beside_collectives(gpu.default, 0.5e-3, 0.0, 0.0) == pytest.approx(0.5e-3)  # ends before it


def test_a_collective_across_nodes_moves_only_the_hops_between_them_over_the_network():
    """[Note: across nodes]: 64 ranks on 8 nodes, one 50 GB/s NIC per GPU: each NIC carries
    7/63 of the all-gather's bus bytes, at 80 % of its rate; the NVLink part inside the
    node is shorter here, so the network part is the collective's time."""
    ib, nvlink = PRESETS["ib-400g"], PRESETS["nvlink4-8gpu"]
    size = 4 * GiB
    seconds = comm.collective_seconds("all_gather", size, 64, ib, nodes=8, intra_link=nvlink)
    network = 20e-6 + (63 / 64) * size * 7 / 63 / (50e9 * 0.8)
    assert seconds == pytest.approx(network)
    assert seconds > comm.collective_seconds("all_gather", size, 64, nvlink)
    # a flat ring at the NIC's rate would have been 9 times longer
    assert comm.collective_seconds("all_gather", size, 64, ib) == pytest.approx(
        20e-6 + (63 / 64) * size / (50e9 * 0.8))
