"""Per-rank memory of impl.fsdp against a budget computed by hand from the model.

As FSDP2's test_fully_shard_memory.py does: the measured peak (live tensor storages,
followed by zerobench.instruments.memory.StorageTracker, which also follows FSDP's storage
resizes) must stay within

    sharded states      16 P / W   (fp32 parameters + gradients + Adam's two moments)
  + unsharded units     4 (R + k U) (the root stays unsharded through forward, until its
                                    post-backward; k units in flight: 1 without
                                    prefetch or with limiter depth 1, 2 with)
  + gradient temps      4 * 4 U     (a unit's per-parameter gradients, their flat padded
                                    copy, the reduce-scatter input in flight, and gloo's
                                    copy of it: gloo reduce-scatters by all-reducing a copy)
  + activations + slack

with P all parameters, U one block's (the largest unit), R the root's, W the world size.
It also follows the unsharded bytes over the whole step (the tracker's timeline): they
never exceed the root plus the units the schedule allows in flight, prefetching adds
one unit, limit_all_gathers at depth 1 takes it back out, and SHARD_GRAD_OP holds every
unit unsharded from forward to backward.
"""

from __future__ import annotations

import torch

from impl.fsdp import BackwardPrefetch, ShardingStrategy
from impl.fsdp import FullyShardedDataParallel as FSDP
from tests.helpers.fsdp import DEFAULTS_1_13, MLP, unit_policy, warm_up_imports
from zerobench.harness.testing import run_ranks
from zerobench.instruments.memory import StorageTracker

warm_up_imports()

WIDTH, DEPTH, BATCH = 256, 4, 8
U = WIDTH * WIDTH + WIDTH  # one block; the root (the head) is the same size
R = U
P = (DEPTH + 1) * U
ACTIVATIONS = 4 * BATCH * WIDTH * 4 * (DEPTH + 1)  # a few fp32 (batch, width) tensors per layer
SLACK = 64 * 1024

PREFETCH = dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True)
CONFIGS = {
    "full_shard": (dict(), 1),
    "full_shard_prefetch": (PREFETCH, 2),
    "full_shard_prefetch_limit1": (dict(PREFETCH, limit_all_gathers=True, limiter_depth=1), 1),
    "shard_grad_op": (dict(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP), DEPTH),
}


def budget(world_size: int, units_in_flight: int) -> int:
    return 16 * P // world_size + 4 * (R + units_in_flight * U) + 4 * 4 * U + ACTIVATIONS + SLACK


def measured_step(model, opt, x, y):
    tracker = StorageTracker("cpu", timeline=True)
    with tracker:
        tracker.track_tensors(list(model.parameters()) + [v for s in opt.state.values() for v in s.values()])
        tracker.reset_peak()
        tracker.set_phase("forward")
        loss = ((model(x) - y) ** 2).mean()
        tracker.set_phase("backward")
        loss.backward()
        tracker.note_roles("grads", [p.grad for p in model.parameters()])
        tracker.set_phase("optimizer")
        opt.step()
        opt.zero_grad()
        tracker.classify(params=list(model.parameters()), optim=[v for s in opt.state.values() for v in s.values()])
    return tracker.peak_bytes, tracker.peak_breakdown(), int(tracker.timeline()["unsharded"].max())


def memory_body(rank, world_size):
    out = {}
    for name, (kwargs, _) in CONFIGS.items():
        torch.manual_seed(0)
        raw = MLP(width=WIDTH, depth=DEPTH, out=WIDTH)
        model = FSDP(raw, auto_wrap_policy=unit_policy(raw), **{**DEFAULTS_1_13, **kwargs})
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        for _ in range(2):  # the optimizer state exists and the execution order is recorded
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        out[name] = measured_step(model, opt, x, y)
    return out


def test_peak_within_hand_computed_budget_and_limiter_bounds_unsharded_units():
    world_size = 2
    report = run_ranks(memory_body, world_size)[0]
    for name, (_, in_flight) in CONFIGS.items():
        peak, breakdown, max_unsharded = report[name]
        assert peak <= budget(world_size, in_flight), (name, peak, budget(world_size, in_flight), breakdown)
        assert max_unsharded <= 4 * (R + in_flight * U), (name, max_unsharded)
    # Over the step: the root and one unit without prefetch; prefetching adds the next
    # unit; the limiter at depth 1 takes it back out.
    assert report["full_shard"][2] == 4 * (R + U)
    assert report["full_shard_prefetch"][2] == 4 * (R + 2 * U)
    assert report["full_shard_prefetch_limit1"][2] == 4 * (R + U)
    # SHARD_GRAD_OP holds every unit from forward to backward.
    assert report["shard_grad_op"][2] == 4 * P
