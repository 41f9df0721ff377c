"""Prefetched all-gathers really are in flight while a unit computes.

Relative, never absolute: on an emulated slow interconnect (each collective
takes at least its latency, slept in wait) and with "compute" that sleeps (so the two
cores are not what is measured), a step with forward prefetch and BACKWARD_PRE must be
clearly faster than one without prefetch, and the limiter at depth 1 must give some of
that back.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn as nn

from impl.fsdp import BackwardPrefetch
from impl.fsdp import FullyShardedDataParallel as FSDP
from tests.helpers.fsdp import DEFAULTS_1_13, warm_up_imports
from zerobench.harness.testing import run_ranks
from zerobench.instruments import emulation
from zerobench.instruments.link import Link

warm_up_imports()

COMPUTE_S = 0.01  # per block, forward and backward each
LATENCY_US = 10_000  # per collective


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(COMPUTE_S)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(COMPUTE_S)
        return grad


class SleepyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return _Sleep.apply(self.lin(x))


def step_time(rank, world_size, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(*[SleepyBlock() for _ in range(4)], nn.Linear(8, 1))
    fsdp = FSDP(model, auto_wrap_policy=lambda module, recurse, unwrapped_params: recurse or isinstance(module, SleepyBlock), **{**DEFAULTS_1_13, **kwargs})
    x = torch.randn(4, 8)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        fsdp(x).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first iteration records the order


def overlap_body(rank, world_size):
    emulation.install(Link(10.0, LATENCY_US))
    try:
        prefetch = dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True)
        return {
            "none": step_time(rank, world_size),
            "prefetch": step_time(rank, world_size, **prefetch),
            "prefetch_depth1": step_time(rank, world_size, limit_all_gathers=True, limiter_depth=1, **prefetch),
        }
    finally:
        emulation.uninstall()


@pytest.mark.world_size(2)
def test_prefetch_overlaps_all_gathers_with_compute(world_size):
    t = run_ranks(overlap_body, world_size)[0]
    # Without prefetch every all-gather is exposed: 1 + 4 in forward and 4 in backward,
    # each a full latency (10 ms) before its block computes for 10 ms: ~0.2 s. With
    # prefetch only the first block's in each direction is (nothing computes before it
    # that could hide it): ~0.14 s, measured 0.14 against 0.20. Asserted with margin.
    assert t["prefetch"] < 0.85 * t["none"], t
    # Depth 1 issues each prefetch only once the current unit frees: the gather is exposed again.
    assert t["prefetch_depth1"] > t["prefetch"], t
