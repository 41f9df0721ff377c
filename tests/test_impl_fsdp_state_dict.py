"""Model state dicts of impl.fsdp (docs/behaviour.md §F11): FULL, LOCAL and SHARDED save
what single-process training would hold, under the unwrapped model's names, and load
back into a freshly wrapped model."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.helpers.fsdp import (
    TOL,
    full_params,
    make_model,
    reference_train,
    train,
    unit_policy,
    warm_up_imports,
)
from zerobench.testing import run_ranks

from impl.fsdp import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from impl.fsdp import FullyShardedDataParallel as FSDP

warm_up_imports()


def wrapped(kind, strategy, seed=0):
    raw = make_model(kind, seed=seed)
    return FSDP(raw, auto_wrap_policy=unit_policy(raw), sharding_strategy=strategy)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def state_dict_body(rank, world_size):
    failures = []
    for kind in ("mlp", "ordered"):
        _, ref_params, _ = reference_train(kind)
        names = list(make_model(kind).state_dict().keys())  # tied weights appear under both names
        for strategy in ShardingStrategy:
            model = wrapped(kind, strategy)
            train(model, kind, rank, world_size)
            label = f"{kind} {strategy.name}"

            # FULL: the unwrapped model's keys and single-process values; loads into a fresh model.
            full = model.state_dict()
            if sorted(full) != sorted(names):
                failures.append(f"{label} FULL keys {sorted(full)} != {sorted(names)}")
            if max_diff(full, ref_params) > TOL:
                failures.append(f"{label} FULL values differ from single-process training")
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True, offload_to_cpu=True)):
                rank0 = model.state_dict()
            if (rank == 0) != bool(rank0):
                failures.append(f"{label} rank0_only: rank {rank} got {len(rank0)} entries")
            fresh = wrapped(kind, strategy, seed=7)
            fresh.load_state_dict(full)
            if max_diff(full_params(fresh, ref_params), ref_params) > TOL:
                failures.append(f"{label} FULL load")

            if strategy is ShardingStrategy.NO_SHARD:
                for kind_ in (StateDictType.LOCAL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
                    with FSDP.state_dict_type(model, kind_):
                        with pytest.raises(RuntimeError, match="can only be called when parameters are flatten and sharded"):
                            model.state_dict()
                continue

            # LOCAL: one padded flat shard per unit.
            with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
                local = model.state_dict()
            flat_keys = [k for k in local if k.endswith("flat_param")]
            if len(flat_keys) != len([i for i in model.fsdp_instances() if i._unit is not None]):
                failures.append(f"{label} LOCAL keys {sorted(local)}")
            fresh = wrapped(kind, strategy, seed=7)
            with FSDP.state_dict_type(fresh, StateDictType.LOCAL_STATE_DICT):
                fresh.load_state_dict(local)
            if max_diff(full_params(fresh, ref_params), ref_params) > TOL:
                failures.append(f"{label} LOCAL load")

            # SHARDED: each parameter a DTensor sharded on dim 0.
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                sharded = model.state_dict()
            gathered = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sharded.items()}
            if not any(isinstance(v, DTensor) for v in sharded.values()) or max_diff(gathered, ref_params) > TOL:
                failures.append(f"{label} SHARDED values")
            fresh = wrapped(kind, strategy, seed=7)
            with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
                fresh.load_state_dict(sharded)
            if max_diff(full_params(fresh, ref_params), ref_params) > TOL:
                failures.append(f"{label} SHARDED load")

    model = wrapped("mlp", ShardingStrategy.FULL_SHARD)
    with pytest.raises(RuntimeError, match="Expected state_dict_config of type FullStateDictConfig"):
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, LocalStateDictConfig()):
            pass
    with pytest.raises(ValueError, match="Unknown StateDictType"):
        with FSDP.state_dict_type(model, "FULL"):
            pass
    dist.barrier()
    return failures


@pytest.mark.world_size(2)
def test_model_state_dicts_round_trip(world_size):
    failures = run_ranks(state_dict_body, world_size)[0]
    assert not failures, "\n".join(failures)
