"""Model state dicts of impl.fsdp (docs/behaviour.md §F11): FULL, LOCAL and SHARDED save
what single-process training would hold, under the unwrapped model's names, and load
back into a freshly wrapped model."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from impl.fsdp import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from impl.fsdp import FullyShardedDataParallel as FSDP
from impl.fsdp.state_dict import full_tensor
from tests.helpers.fsdp import (
    TOL,
    batches,
    full_params,
    make_model,
    reference_train,
    torch_fsdp1,
    train,
    unit_policy,
    warm_up_imports,
)
from zerobench.harness.testing import run_ranks

warm_up_imports()


def wrapped(kind, strategy, seed=0, mesh=False):
    """impl's FSDP around a fresh model; with ``mesh``, given a 1-D device mesh (its SHARDED
    state dicts are then DTensors, as PyTorch's)."""
    from torch.distributed.device_mesh import init_device_mesh

    raw = make_model(kind, seed=seed)
    extra = {"device_mesh": init_device_mesh("cpu", (dist.get_world_size(),))} if mesh else {}
    return FSDP(raw, auto_wrap_policy=unit_policy(raw), sharding_strategy=strategy, **extra)


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
                with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
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

            # SHARDED: each parameter a ShardedTensor sharded on dim 0 (PyTorch 2.x's form
            # without a device_mesh).
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                sharded = model.state_dict()
            gathered = {k: full_tensor(v) for k, v in sharded.items()}
            if not any(type(v).__name__ == "ShardedTensor" for v in sharded.values()) or max_diff(gathered, ref_params) > TOL:
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


# -- checkpoints across PyTorch's FSDP1 and impl (a user switching imports mid-training) ----


def library(name: str):
    """(FSDP class, its StateDictType, a function seed -> freshly wrapped MLP)."""
    if name.startswith("torch"):  # "torch-mesh": built with a device mesh, SHARDED as DTensors
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp import StateDictType as TorchStateDictType

        return TorchFSDP, TorchStateDictType, lambda seed: torch_fsdp1(make_model("mlp", seed=seed), mesh=name == "torch-mesh")
    if name == "impl-mesh":  # built with a device mesh: SHARDED as DTensors, as PyTorch's then
        return FSDP, StateDictType, lambda seed: wrapped("mlp", ShardingStrategy.FULL_SHARD, seed=seed, mesh=True)
    return FSDP, StateDictType, lambda seed: wrapped("mlp", ShardingStrategy.FULL_SHARD, seed=seed)


def init_optimizer_state(opt) -> None:
    """Give a fresh optimizer its state (a step with zero gradients and lr 0, as
    torch.distributed.checkpoint.state_dict does), so that its state dict can serve as
    the template torch.distributed.checkpoint loads into."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


# "direct": load_state_dict of the other library's SHARDED dicts (ShardedTensors; DTensors
# from an impl model and into a PyTorch model both built with a device mesh);
# "full": of its FULL ones.
CROSSINGS = (
    ("torch", "impl", "dcp"),
    ("torch", "impl", "direct"),
    ("torch", "impl", "full"),
    ("impl", "torch", "dcp"),
    ("impl", "torch", "direct"),
    ("impl", "torch", "full"),
    ("impl-mesh", "torch-mesh", "direct"),
)


def crossing_body(rank, world_size, folder):
    """Train two steps with one library, checkpoint, go on two steps; the other library
    loads the checkpoint into a differently initialized model and does the same two steps."""
    import torch.distributed.checkpoint as dcp

    data = batches("mlp", 4)
    losses = {}
    for src, dst, route in CROSSINGS:
        cls, kinds, build = library(src)
        model = build(0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train(model, "mlp", rank, world_size, steps=2, opt=opt)  # data[0:2]
        kind = "FULL_STATE_DICT" if route == "full" else "SHARDED_STATE_DICT"
        with cls.state_dict_type(model, kinds[kind]):
            saved = {"model": model.state_dict(), "optim": cls.optim_state_dict(model, opt)}
        if route == "dcp":
            checkpoint = os.path.join(folder, f"{src}-to-{dst}")
            dcp.save(saved, checkpoint_id=checkpoint)
        expected = go_on(model, opt, rank, world_size, data[2:])

        cls, kinds, build = library(dst)
        model = build(7)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with cls.state_dict_type(model, kinds[kind]):
            if route == "dcp":
                init_optimizer_state(opt)
                loaded = {"model": model.state_dict(), "optim": cls.optim_state_dict(model, opt)}
                dcp.load(loaded, checkpoint_id=checkpoint)
            else:
                loaded = saved
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(cls.optim_state_dict_to_load(model, opt, loaded["optim"]))
        losses[(src, dst, route)] = (expected, go_on(model, opt, rank, world_size, data[2:]))
    return losses


def go_on(model, opt, rank, world_size, data):
    from tests.helpers.fsdp import loss_fn, rank_slice

    out = []
    for x, y in data:
        loss = loss_fn("mlp", model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out.append(mean.item() / world_size)
    return out


@pytest.mark.world_size(2)
def test_checkpoints_cross_between_pytorch_fsdp1_and_impl(world_size, tmp_path):
    """Issue 20 item 10: a SHARDED_STATE_DICT checkpoint (model and Adam state) written by
    PyTorch's FSDP1 with torch.distributed.checkpoint loads into impl, and impl's into
    PyTorch's, the losses afterwards identical to going on with the writer; the same
    code serves both libraries (FSDP.optim_state_dict / optim_state_dict_to_load, which
    impl lacked). SHARDED dicts also load directly both ways (ShardedTensors; DTensors
    when both libraries' models were built with a device mesh), FULL dicts both ways."""
    losses = run_ranks(crossing_body, world_size, args=(str(tmp_path),), timeout=240)[0]
    assert set(losses) == set(CROSSINGS)
    for key, (expected, got) in losses.items():
        assert got == expected, f"{key}: {got} after loading, {expected} going on"


def refusals_body(rank, world_size):
    torch_cls, torch_kinds, torch_build = library("torch")
    source = torch_build(0)
    with torch_cls.state_dict_type(source, torch_kinds.LOCAL_STATE_DICT):
        torch_local = source.state_dict()
    target = wrapped("mlp", ShardingStrategy.FULL_SHARD, seed=7)
    with FSDP.state_dict_type(target, StateDictType.LOCAL_STATE_DICT):
        with pytest.raises(RuntimeError, match="does not load into impl.fsdp.*SHARDED_STATE_DICT through torch.distributed.checkpoint"):
            target.load_state_dict(torch_local)
    with FSDP.state_dict_type(target, StateDictType.LOCAL_STATE_DICT):
        with pytest.raises(NotImplementedError, match="FULL_STATE_DICT and SHARDED_STATE_DICT, not LOCAL_STATE_DICT"):
            FSDP.optim_state_dict(target, torch.optim.Adam(target.parameters()))
    return True


@pytest.mark.world_size(2)
def test_local_state_dicts_do_not_cross_and_say_so(world_size):
    """PyTorch FSDP1's LOCAL_STATE_DICT (ShardedTensor ``_flat_param``s, PyTorch's flat
    layout) is refused with the route that works, instead of a missing-keys error."""
    run_ranks(refusals_body, world_size)
