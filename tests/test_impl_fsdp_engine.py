"""The impl-fsdp engine adapter: options, unsupported combinations, wrapping, metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.fsdp import MLP, warm_up_imports
from zerobench.engines.base import OptimizerSpec, RankContext
from zerobench.engines.impl_fsdp import FSDPEngine
from zerobench.harness.testing import run_ranks

warm_up_imports()

METRICS = {"limiter_stall_s", "limiter_stalls", "limiter_overruns", "max_inflight_all_gathers", "all_gathers"}


def test_options_and_unsupported():
    for name, axis in FSDPEngine.options.items():
        axis.check(name, axis.default)
    with pytest.raises(ValueError, match="limiter_depth"):
        FSDPEngine.options["limiter_depth"].check("limiter_depth", 0)
    hybrid = {"sharding_strategy": "HYBRID_SHARD"}
    assert "HYBRID_SHARD needs at least 2 groups" in FSDPEngine.unsupported(hybrid, "fp32", 2, "cpu")
    assert FSDPEngine.unsupported(hybrid, "fp32", 4, "cpu") is None
    assert FSDPEngine.unsupported({"sharding_strategy": "FULL_SHARD"}, "bf16", 2, "cpu") is None


def engine_body(rank, world_size, options, dtype):
    torch.manual_seed(0)
    model = MLP(width=16, depth=3, out=16)
    numel = sum(p.numel() for p in model.parameters())
    opts = {k: a.default for k, a in FSDPEngine.options.items()} | options
    engine = FSDPEngine(opts, RankContext(rank, world_size, rank, torch.device("cpu"), "gloo"), dtype)
    module = engine.wrap(model, list(model.blocks))
    engine.build_optimizer(OptimizerSpec("adam", 1e-3, {}))
    engine.extra_metrics()
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    losses = [engine.train_step(x, y, F.mse_loss).item() for _ in range(3)]
    metrics = engine.extra_metrics()
    params = engine.parameter_tensors()
    # The optimizer's parameters are the sharded flat parameters: 1/world of the model (+ padding).
    sharded_numel = sum(p.numel() for p in params)
    module(x).float().sum().backward()
    grads = engine.gradient_tensors()
    return losses, metrics, sharded_numel, numel, len(params), len(grads)


@pytest.mark.parametrize("options,dtype", [
    ({"backward_prefetch": "pre", "forward_prefetch": True, "limit_all_gathers": True, "limiter_depth": 1}, "fp32"),
    ({"sharding_strategy": "SHARD_GRAD_OP", "cpu_offload": True}, "bf16"),
], ids=["FULL_SHARD-pre-limit1-fp32", "SHARD_GRAD_OP-offload-bf16"])
@pytest.mark.world_size(2)
def test_engine_trains_and_reports(options, dtype, world_size):
    for losses, metrics, sharded, numel, n_params, n_grads in run_ranks(engine_body, world_size, args=(options, dtype)):
        assert all(math.isfinite(loss) for loss in losses)
        assert set(metrics) == METRICS
        assert metrics["all_gathers"] > 0
        if options.get("limit_all_gathers"):
            assert metrics["max_inflight_all_gathers"] <= options["limiter_depth"]
        assert numel / 2 <= sharded < numel / 2 + 4 * 2  # at most world-1 padding elements per unit
        assert n_params == n_grads == 4  # three blocks and the root
