"""Optimizer state dicts of impl.fsdp (docs/behaviour.md §F12): the unflattened state
equals single-process Adam's under the same names, and every way back (shard the full
dict, scatter it from rank 0, flatten the sharded one) resumes training exactly."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from tests.helpers.fsdp import (
    TOL,
    batches,
    full_params,
    loss_fn,
    make_model,
    rank_slice,
    train,
    unit_policy,
    warm_up_imports,
)
from zerobench.testing import run_ranks

from impl.fsdp import OptimStateKeyType, ShardingStrategy
from impl.fsdp import FullyShardedDataParallel as FSDP

warm_up_imports()


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def wrapped(kind, strategy, seed=0):
    raw = make_model(kind, seed=seed)
    return FSDP(raw, auto_wrap_policy=unit_policy(raw), sharding_strategy=strategy)


def one_step(model, opt, kind, rank, world_size, batch):
    x, y = batch
    loss_fn(kind, model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
    opt.step()
    opt.zero_grad()


def optim_body(rank, world_size):
    failures = []
    for kind in ("mlp", "ordered"):
        ref = make_model(kind)
        ref_opt = adam(ref.parameters())
        for x, y in batches(kind, 2):
            loss_fn(kind, ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        ref_state = {n: ref_opt.state[p] for n, p in ref.named_parameters()}
        extra = batches(kind, 3)[2]
        for strategy in ShardingStrategy:
            label = f"{kind} {strategy.name}"
            model = wrapped(kind, strategy)
            opt = adam(model.parameters())
            train(model, kind, rank, world_size, steps=2, opt=opt)

            full = FSDP.full_optim_state_dict(model, opt)
            if rank == 0:
                if sorted(full["state"]) != sorted(ref_state):
                    failures.append(f"{label}: keys {sorted(full['state'])}")
                for name, st in ref_state.items():
                    for k, v in st.items():
                        if (full["state"][name][k].float() - v.float()).abs().max().item() > TOL:
                            failures.append(f"{label}: {name}.{k} differs from single-process Adam")
                if sorted(full["param_groups"][0]["params"]) != sorted(ref_state):
                    failures.append(f"{label}: param_groups {full['param_groups']}")
            else:
                assert full == {}
            everywhere = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
            sharded = FSDP.sharded_optim_state_dict(model, opt)
            model_sd = model.state_dict()
            one_step(model, opt, kind, rank, world_size, extra)
            expected = full_params(model, ref_state)

            loaders = {
                "shard_full": lambda m, o: FSDP.shard_full_optim_state_dict(everywhere, m, optim=o),
                "scatter_full": lambda m, o: FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, m, optim=o),
                "flatten_sharded": lambda m, o: FSDP.flatten_sharded_optim_state_dict(sharded, m, optim=o),
            }
            for how, load in loaders.items():
                fresh = wrapped(kind, strategy, seed=3)
                fresh.load_state_dict(model_sd)
                fresh_opt = adam(fresh.parameters())
                fresh_opt.load_state_dict(load(fresh, fresh_opt))
                one_step(fresh, fresh_opt, kind, rank, world_size, extra)
                got = full_params(fresh, ref_state)
                if max((got[n] - expected[n]).abs().max().item() for n in expected) > TOL:
                    failures.append(f"{label}: resuming from {how} differs")

            by_id = FSDP.rekey_optim_state_dict(everywhere, OptimStateKeyType.PARAM_ID, model, optim=opt)
            if not all(isinstance(k, int) for k in by_id["state"]):
                failures.append(f"{label}: rekey to IDs")
            back = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model, optim=opt)
            if sorted(back["state"]) != sorted(everywhere["state"]):
                failures.append(f"{label}: rekey round trip")

    model = wrapped("mlp", ShardingStrategy.FULL_SHARD)
    if rank == 0:
        with pytest.raises(ValueError, match="Rank 0 must pass in the full optimizer state dict"):
            FSDP.scatter_full_optim_state_dict(None, model)
    with pytest.raises(ValueError, match="Invalid parameter keys"):
        FSDP.rekey_optim_state_dict({"state": {"a": {}, 0: {}}, "param_groups": []}, OptimStateKeyType.PARAM_ID, model)
    dist.barrier()
    return failures


@pytest.mark.world_size(2)
def test_optimizer_state_dicts(world_size):
    failures = run_ranks(optim_body, world_size)[0]
    assert not failures, "\n".join(failures)
