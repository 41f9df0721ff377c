"""The harness adapters impl-zero1 and impl-zero2: the Engine lifecycle on real ranks,
parity with single-process training, and what the memory pass will see."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.zero import (
    batches,
    make_model,
    max_abs_diff,
    params_of,
    rank_slice,
)
from zerobench.engines.base import OptimizerSpec, RankContext
from zerobench.engines.impl_zero import Zero1Engine, Zero2Engine
from zerobench.harness.testing import run_ranks

SPEC = OptimizerSpec("adam", lr=1e-2, hyper={})


def _numel(tensors):
    return sum(t.numel() for t in tensors)


def _gradient_counter(engine, seen):
    """on_phase hook: record the gradient elements the memory pass would see."""

    def on_phase(phase):
        if phase == "optimizer":
            seen.append(_numel(engine.gradient_tensors()))

    return on_phase


def _engines_world(rank, world_size):
    ctx = RankContext(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    data = batches(3)
    ref = make_model()
    ref_opt = SPEC.build(ref.parameters())
    for x, y in data:
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()

    report = {}
    zero1 = {"parameters_as_bucket_view": False, "overlap_with_ddp": False, "overlap_hook": "step"}
    configs = [(Zero1Engine, {**zero1, "parameters_as_bucket_view": v}) for v in (False, True)]
    # overlap_with_ddp: the step runs in DDP's hook; the engine runs the no-update warm-up
    # iterations itself, so parameters follow the reference from the first step on.
    configs += [(Zero1Engine, {**zero1, "overlap_with_ddp": True, "overlap_hook": h}) for h in ("step", "interleaved")]
    configs += [(Zero2Engine, {"bucket_cap_mb": cap, "max_in_flight": 2}) for cap in (0.0, 25.0)]
    for engine_cls, options in configs:
        for name, axis in engine_cls.options.items():
            axis.check(name, options[name])
        torch.manual_seed(100 + rank)  # ranks start different: wrap() must make them agree
        model = make_model(seed=100 + rank) if engine_cls is Zero2Engine else make_model()
        engine = engine_cls(options, ctx, "fp32")
        engine.wrap(model, blocks=[model.big, model.mid])
        engine.build_optimizer(SPEC)
        grads_seen = []
        for x, y in data:
            engine.on_phase = _gradient_counter(engine, grads_seen)
            engine.train_step(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size), nn.functional.mse_loss)
        params = params_of(model)
        if engine_cls is Zero2Engine:
            # Rank 0's initial parameters were broadcast, so the run matches a reference started from them.
            ref2 = make_model(seed=100)
            opt2 = SPEC.build(ref2.parameters())
            for x, y in data:
                opt2.zero_grad()
                nn.functional.mse_loss(ref2(x), y).backward()
                opt2.step()
            expected = params_of(ref2)
        else:
            expected = params_of(ref)
        assert max_abs_diff(params, expected) < 1e-5, (engine_cls.name, options)
        report[(engine_cls.name, tuple(options.values()))] = {
            "state": _numel(engine.optimizer_state_tensors()) - sum(1 for _ in engine.optimizer.optim.state),  # minus the scalar steps
            "grads": grads_seen[-1],
            "params": _numel(engine.parameter_tensors()),
            "metrics": engine.extra_metrics(),
        }
    # bf16 is autocast over fp32 parameters: gradients, shards and state stay fp32.
    for engine_cls, options in configs[::2]:  # includes overlap_with_ddp (step)
        model = make_model()
        engine = engine_cls(options, ctx, "bf16")
        engine.wrap(model, blocks=[])
        engine.build_optimizer(SPEC)
        for x, y in data:
            loss = engine.train_step(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size), nn.functional.mse_loss)
            assert torch.isfinite(loss), engine_cls.name
        assert all(t.dtype == torch.float32 for t in engine.optimizer_state_tensors() if t.dim() > 0)
    return report


@pytest.mark.world_size(2)
def test_engines_train_and_shard(world_size):
    reports = run_ranks(_engines_world, world_size)
    model = make_model()
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for key in reports[0]:
        per_rank = [r[key] for r in reports]
        # Adam: two state tensors per element, summed over ranks = one full copy, never duplicated.
        assert sum(r["state"] for r in per_rank) == 2 * trainable, key
        assert sum(r["metrics"]["zero_rank_numel_count"] for r in per_rank) in (total, trainable), key
        assert all(r["params"] == total for r in per_rank), key
        if key[0] == "impl-zero2":
            # Stage 2: each rank holds ~1/world_size of the gradients (chunk padding only).
            assert all(r["grads"] <= trainable / world_size + 9 for r in per_rank), (key, per_rank)
            assert all(r["metrics"]["zero_partition_imbalance_pct"] < 1.0 for r in per_rank)
        else:
            assert all(r["grads"] == trainable for r in per_rank), key  # DDP: full gradients
            assert all(r["metrics"]["zero_partition_imbalance_pct"] >= 0.0 for r in per_rank)


def test_engine_axes():
    assert Zero1Engine.name == "impl-zero1" and Zero2Engine.name == "impl-zero2"
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        Zero2Engine.options["bucket_cap_mb"].check("bucket_cap_mb", -1.0)
    with pytest.raises(ValueError, match="parameters_as_bucket_view"):
        Zero1Engine.options["parameters_as_bucket_view"].check("parameters_as_bucket_view", "yes")
    with pytest.raises(ValueError, match="overlap_with_ddp"):
        Zero1Engine.options["overlap_with_ddp"].check("overlap_with_ddp", "yes")
    assert Zero1Engine.options["overlap_with_ddp"].default is False
    assert not Zero1Engine.options["overlap_hook"].applies({"overlap_with_ddp": False})
