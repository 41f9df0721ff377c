"""impl.fsdp hot paths: flattening a unit into its shard, and the unshard / views / reshard
cycle every forward and backward goes through (no communication: the all-gather output
is filled locally)."""

from __future__ import annotations

import torch
import torch.nn as nn

from impl.fsdp.flat_param import FlatParamHandle


def _unit(width: int = 256, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width + 1, width) if i % 2 else nn.Linear(width, width + 1) for i in range(depth)])


def _params(module: nn.Module) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    return [(f"{mname}.{pname}" if mname else pname, sub, pname, p)
            for mname, sub in module.named_modules() for pname, p in sub.named_parameters(recurse=False)]


def _handle(module: nn.Module, rank: int = 1, world: int = 4) -> FlatParamHandle:
    return FlatParamHandle(_params(module), shard_rank=rank, shard_world=world, compute_dtype=None,
                           keep_unsharded_alias=False)


def test_flatten_and_shard(benchmark):
    numel = sum(p.numel() for p in _unit().parameters())
    handle = benchmark.pedantic(lambda module: _handle(module), setup=lambda: ((_unit(),), {}), rounds=20)
    assert handle.numel == numel and handle.padded_numel % 4 == 0
    assert handle.sharded_flat.numel() == handle.shard_numel == -(-numel // 4)


def test_unshard_views_reshard_cycle(benchmark):
    module = _unit()
    expected = [p.detach().clone() for p in module.parameters()]
    handle = _handle(module)
    full = torch.cat([e.reshape(-1) for e in expected] + [torch.zeros(handle.padded_numel - handle.numel)])

    def cycle():
        handle.alloc_unsharded().copy_(full)  # stands in for the all-gather
        handle.use_unsharded_params()
        out = module(torch.ones(2, 256))
        handle.free_unsharded()
        return out

    out = benchmark(cycle)
    assert out.shape == (2, 256) and not handle.unsharded_allocated
    assert torch.equal(handle.shard_slice(full), handle.sharded_flat.detach())
