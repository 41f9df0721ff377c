"""Realistic performance regressions of impl's FSDP and ZeRO engines, as monkeypatches.

Each :class:`Mutant` changes how fast (or how big) an engine is, never what it computes:
training stays correct (tests/test_mutants.py checks the losses), which is why no
correctness test can see them. Each is applied with pytest's ``monkeypatch`` to impl's
classes and module functions, never by editing a source file, and undone when the test
ends. tests/test_mutants.py runs each through both gates: the predict gate (the virtual
GPU) and the CPU run gate (real gloo ranks); docs/ci.md tabulates which catches which.

To add one: write ``def apply(monkeypatch)`` that patches impl the way the bug would,
give it a line saying what a developer would have done, and name the engines it touches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import impl.fsdp.runtime as fsdp_runtime
import impl.zero.stage2 as zero_stage2
from impl.fsdp.flat_param import FlatParamHandle
from impl.fsdp.rate_limiter import RateLimiter
from impl.fsdp.unit import FlatParamUnit
from impl.zero.bucketer import ReduceScatterBucketer


@dataclass(frozen=True)
class Mutant:
    name: str
    story: str
    """what a developer would have done to get it"""
    engine: str
    """the engine it regresses (the gates run that engine's configurations)"""
    apply: Callable


def _wrap(monkeypatch, owner, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)``."""
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, functools.wraps(original)(make(original)))


# -- impl-fsdp ---------------------------------------------------------------------------


def _no_backward_prefetch(monkeypatch) -> None:
    monkeypatch.setattr(fsdp_runtime, "_prefetch_backward", lambda shared, state: None)


def _host_sync_before_wait(monkeypatch) -> None:
    def make(original):
        def _wait_all_gather(self):
            if self.streams.cuda:
                self.streams.module.synchronize()  # the debugging torch.cuda.synchronize()
            return original(self)
        return _wait_all_gather
    _wrap(monkeypatch, FlatParamUnit, "_wait_all_gather", make)


def _no_reshard_after_forward(monkeypatch) -> None:
    monkeypatch.setattr(fsdp_runtime, "frees_after_forward", lambda state: False)


def _all_gather_waits_for_compute(monkeypatch) -> None:
    def make(original):
        def _issue_all_gather(self):
            self.streams.params_ready = None  # so the gather waits for everything queued on compute
            return original(self)
        return _issue_all_gather
    _wrap(monkeypatch, FlatParamUnit, "_issue_all_gather", make)


def _limiter_off(monkeypatch) -> None:
    def make(original):
        def __init__(self, enabled, depth, use_events=False, clock=None):
            original(self, False, depth, use_events, clock)
        return __init__
    _wrap(monkeypatch, RateLimiter, "__init__", make)


def _reduce_scatter_waited_at_once(monkeypatch) -> None:
    def make(original):
        def reduce_grad(self, unsharded_grad):
            pending = original(self, unsharded_grad)
            pending.advance(self.streams)  # on the compute stream: backward waits for it
            return pending
        return reduce_grad
    _wrap(monkeypatch, FlatParamUnit, "reduce_grad", make)


def _gradients_kept_until_end(monkeypatch) -> None:
    monkeypatch.setattr(FlatParamUnit, "advance_reduction", lambda self, pending: None)


def _shard_cast_twice(monkeypatch) -> None:
    def make(original):
        def device_shard(self, dtype):
            original(self, dtype)  # a cast hoisted into a helper whose caller still casts
            return original(self, dtype)
        return device_shard
    _wrap(monkeypatch, FlatParamHandle, "device_shard", make)


# -- impl-zero2 --------------------------------------------------------------------------


def _bucket_per_parameter(monkeypatch) -> None:
    def make(original):
        def __init__(self, bucket_cap_mb=25.0, max_in_flight=2):
            original(self, 0.0, max_in_flight)
        return __init__
    _wrap(monkeypatch, ReduceScatterBucketer, "__init__", make)


def _extra_all_reduce(monkeypatch) -> None:
    def make(original):
        def step(self, closure=None, **kwargs):
            norm = torch.zeros(1, device=self.gradient_shards()[0].device)
            for g in self.gradient_shards():
                norm += g.float().pow(2).sum()
            dist.all_reduce(norm, group=self.process_group)  # a global gradient norm, for a log line
            return original(self, closure, **kwargs)
        return step
    _wrap(monkeypatch, zero_stage2.ZeroStage2Optimizer, "step", make)


def _all_gather_per_parameter(monkeypatch) -> None:
    def make(original):
        def plan_gather_buckets(shards, bucket_cap_mb):
            return original(shards, 0.0)  # the cap no longer passed through
        return plan_gather_buckets
    _wrap(monkeypatch, zero_stage2, "plan_gather_buckets", make)


def _zero2_reduce_scatter_waited_at_once(monkeypatch) -> None:
    def make(original):
        def _issue(self, reduce_scatter_input, output, results, group):
            original(self, reduce_scatter_input, output, results, group)
            self.wait_issued()  # the bucket's reduction made synchronous
        return _issue
    _wrap(monkeypatch, ReduceScatterBucketer, "_issue", make)


MUTANTS: tuple[Mutant, ...] = (
    Mutant("backward-prefetch-lost", "a refactor of the pre-backward hook drops its BACKWARD_PRE prefetch",
           "impl-fsdp", _no_backward_prefetch),
    Mutant("host-sync-before-wait", "a debugging device synchronize left before each unit's all-gather wait",
           "impl-fsdp", _host_sync_before_wait),
    Mutant("no-reshard-after-forward", "FULL_SHARD units no longer freed after forward (an inverted check)",
           "impl-fsdp", _no_reshard_after_forward),
    Mutant("all-gather-waits-for-compute", "the all-gather waits for all queued compute instead of the "
           "parameters-ready event", "impl-fsdp", _all_gather_waits_for_compute),
    Mutant("limiter-off", "limit_all_gathers silently ignored", "impl-fsdp", _limiter_off),
    Mutant("reduce-scatter-waited-at-once", "each unit's reduce-scatter waited for on the compute stream right "
           "after it is issued", "impl-fsdp", _reduce_scatter_waited_at_once),
    Mutant("gradients-kept-until-end", "older reductions no longer advanced: every unit's unsharded gradient "
           "lives until the end of backward", "impl-fsdp", _gradients_kept_until_end),
    Mutant("shard-cast-twice", "the mixed-precision cast of the shard done twice before each all-gather",
           "impl-fsdp", _shard_cast_twice),
    Mutant("bucket-per-parameter", "the reduce-scatter bucket flushed per parameter (its cap lost)",
           "impl-zero2", _bucket_per_parameter),
    Mutant("extra-all-reduce", "a gradient-norm all-reduce added to every step for a log line",
           "impl-zero2", _extra_all_reduce),
    Mutant("all-gather-per-parameter", "the parameters all-gathered one by one after the step (bucket cap "
           "not passed to the planner)", "impl-zero2", _all_gather_per_parameter),
    Mutant("zero2-reduce-scatter-waited-at-once", "each bucket's reduce-scatter waited for right after it is "
           "issued", "impl-zero2", _zero2_reduce_scatter_waited_at_once),
)

BY_NAME = {m.name: m for m in MUTANTS}
