"""Optimizer state dicts of impl.fsdp (docs/behaviour.md §F12): the unflattened state
equals single-process Adam's under the same names, and every way back (shard the full
dict, scatter it from rank 0, flatten the sharded one) resumes training exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from impl.fsdp import FullyShardedDataParallel as FSDP
from impl.fsdp import OptimStateKeyType, ShardingStrategy
from tests.helpers.fsdp import (
    TOL,
    batches,
    full_params,
    loss_fn,
    make_model,
    rank_slice,
    torch_fsdp1,
    train,
    unit_policy,
    warm_up_imports,
)
from zerobench.harness.testing import run_ranks

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


# -- against PyTorch's own FSDP1, on the same scenarios -----------------------------------


def both_libraries():
    """(name, FSDP class, a freshly wrapped MLP) for PyTorch's FSDP1 and for impl."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    return [("torch", TorchFSDP, torch_fsdp1(make_model("mlp"))), ("impl", FSDP, wrapped("mlp", ShardingStrategy.FULL_SHARD))]


def outcome(call):
    """What a call did, comparable across libraries: its exception, or what it returned."""
    try:
        result = call()
    except (RuntimeError, ValueError) as e:
        return (type(e).__name__, str(e))
    if not result:
        return ("returned", result)
    return ("returned", sorted(map(str, result["state"])), "param_groups" in result)


def stepped_on_some_ranks_body(rank, world_size):
    """One rank steps its optimizer, the other does not, then full_optim_state_dict."""
    out = {}
    for stepper in (0, 1):
        for lib, cls, model in both_libraries():
            opt = adam(model.parameters())
            x, y = batches("mlp", 1)[0]
            loss_fn("mlp", model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
            if rank == stepper:
                opt.step()
            opt.zero_grad()
            for rank0_only in (True, False):
                call = lambda: cls.full_optim_state_dict(model, opt, rank0_only=rank0_only)  # noqa: E731
                out[(lib, stepper, rank0_only)] = outcome(call)
            # Every rank is still in step: a collective gives the expected sum, and training goes on.
            check = torch.tensor([rank + 1.0])
            dist.all_reduce(check)
            assert check.item() == 3.0, f"{lib}: collectives out of step after full_optim_state_dict"
            train(model, "mlp", rank, world_size, steps=1, opt=opt)
    return out


@pytest.mark.world_size(2)
def test_full_optim_state_dict_when_only_some_ranks_stepped(world_size):
    """Issue 20 item 8: every rank takes part in the same collectives, then raises or
    returns exactly as PyTorch 2.13's FSDP1 does. Before the fix the unstepped rank
    skipped the all-gathers and the other rank hung."""
    results = run_ranks(stepped_on_some_ranks_body, world_size, timeout=120)
    for rank, out in enumerate(results):
        for (lib, stepper, rank0_only), got in out.items():
            if lib == "impl":
                assert got == out[("torch", stepper, rank0_only)], (rank, stepper, rank0_only, got)
        # Rank 0 stepped, rank 1 did not: every rank raises, naming rank 1's missing parameters.
        for rank0_only in (True, False):
            kind, message = out[("impl", 0, rank0_only)]
            assert kind == "RuntimeError" and "Rank 1 is missing states for the parameters" in message
            assert "('blocks.0.0.weight', 'blocks.0.0.bias')" in message
        # Rank 0 did not step: rank 0's view (no state) wins everywhere, nothing raises.
        assert out[("impl", 1, True)] == (("returned", [], True) if rank == 0 else ("returned", {}))
        assert out[("impl", 1, False)] == ("returned", [], True)


def mutate(case: str, state: dict) -> None:
    """Edit an unflattened optimizer state dict (Adam, one step) into one of the cases."""
    bias = state["blocks.0.0.bias"]  # shares its unit's flat parameter with blocks.0.0.weight
    if case == "exp_avg a float":
        bias["exp_avg"] = 0.0
    elif case == "exp_avg zero-dimensional":
        bias["exp_avg"] = torch.tensor(0.0)
    elif case == "step a float":
        bias["step"] = float(bias["step"])
    elif case == "step an int":
        bias["step"] = int(bias["step"])
    elif case == "user-defined state":
        state["my_counter"] = {"count": 3, "history": torch.arange(3.0)}
        state["my_tensor"] = torch.ones(2)
    elif case == "a parameter without state":
        del state["blocks.0.0.bias"]
    else:
        raise ValueError(f"unknown case {case!r}")


STATE_CASES = (
    "exp_avg a float",
    "exp_avg zero-dimensional",
    "step a float",
    "step an int",
    "user-defined state",
    "a parameter without state",
)


def load_checks_body(rank, world_size):
    out = {}
    for lib, cls, model in both_libraries():
        opt = adam(model.parameters())
        train(model, "mlp", rank, world_size, steps=1, opt=opt)
        full = cls.full_optim_state_dict(model, opt, rank0_only=False)
        for case in STATE_CASES:
            edited = copy.deepcopy(full)
            mutate(case, edited["state"])
            calls = {"shard": lambda: cls.shard_full_optim_state_dict(edited, model, optim=opt)}
            if lib == "impl":  # PyTorch's scatter breaks on some of these (KeyError, AttributeError)
                calls["scatter"] = lambda: cls.scatter_full_optim_state_dict(edited if rank == 0 else None, model, optim=opt)
            for how, call in calls.items():
                got = outcome(call)
                if got[0] == "returned" and case == "user-defined state":
                    # Kept as they are, and the optimizer keeps them through load_state_dict.
                    loaded = adam(model.parameters())
                    loaded.load_state_dict(call())
                    kept = loaded.state["my_counter"]
                    assert kept["count"] == 3 and torch.equal(kept["history"], torch.arange(3.0)), (lib, how)
                    assert torch.equal(loaded.state["my_tensor"], torch.ones(2)), (lib, how)
                out[(lib, case, how)] = got
        dist.barrier()
    return out


def first_words(got):
    """An exception as its type and the first four words of its message (the details differ)."""
    return (got[0], " ".join(got[1].split()[:4])) if got[0] != "returned" else got


@pytest.mark.world_size(2)
def test_shard_and_scatter_check_state_types_as_pytorch(world_size):
    """Issue 20 item 9: differing state types within a unit raise PyTorch's ValueError
    "Differing optimizer state types" (before: AttributeError, or a float step accepted
    silently); user-defined state is kept (before: dropped)."""
    out = run_ranks(load_checks_body, world_size)[0]
    for case in STATE_CASES:
        torch_got = first_words(out[("torch", case, "shard")])
        for how in ("shard", "scatter"):
            assert first_words(out[("impl", case, how)]) == torch_got, (case, how, out[("impl", case, how)], torch_got)
    for case in ("exp_avg a float", "exp_avg zero-dimensional", "step a float", "step an int"):
        assert out[("impl", case, "shard")][0] == "ValueError"
        assert out[("impl", case, "shard")][1].startswith("Differing optimizer state types")
    assert out[("impl", "a parameter without state", "shard")][1].startswith("All unflattened parameters")
    assert {"my_counter", "my_tensor"} <= set(out[("impl", "user-defined state", "scatter")][1])
