"""impl.fsdp as a drop-in for PyTorch 1.13's FSDP: what code written against PyTorch's
class sees inside ``summon_full_params`` (the original parameters under clean names,
editable, written back) and ``FSDP.apply`` (an init function reaches the full
parameters, every rank keeps a consistent shard)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from impl.fsdp import FullyShardedDataParallel as FSDP
from impl.fsdp import ShardingStrategy, TrainingState, traversal
from impl.fsdp.state import FSDPState
from tests.helpers.fsdp import make_model, train, unit_policy, warm_up_imports
from zerobench.harness.testing import run_ranks

warm_up_imports()

STRATEGIES = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
    ShardingStrategy.HYBRID_SHARD,  # world 4: 2 shard ranks x 2 replicas
)


def wrap(kind: str, strategy: ShardingStrategy) -> nn.Module:
    raw = make_model(kind)  # ordered: tied weights and three nesting levels
    return FSDP(raw, auto_wrap_policy=unit_policy(raw), sharding_strategy=strategy)


def named(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone().cpu()) for n, p in model.named_parameters()]


def check_like_unwrapped(got: list, want: list, where: str) -> None:
    assert [n for n, _ in got] == [n for n, _ in want], f"{where}: names {[n for n, _ in got]}"
    for (name, p), (_, q) in zip(got, want):
        assert p.shape == q.shape, f"{where}: {name} has shape {tuple(p.shape)}, want {tuple(q.shape)}"
        assert torch.equal(p, q), f"{where}: {name} differs by {(p - q).abs().max().item()}"


def summon_names_body(rank, world_size):
    for kind in ("mlp", "ordered"):
        ref = make_model(kind)
        want = named(ref)
        for strategy in STRATEGIES:
            where = f"{kind} {strategy.name}"
            model = wrap(kind, strategy)
            outside = [n for n, _ in model.named_parameters()]
            assert all(n.endswith("flat_param") for n in outside), outside

            # Names, shapes and values of the unwrapped model; nn.Parameters; parameters() agrees.
            with FSDP.summon_full_params(model, writeback=False):
                check_like_unwrapped(named(model), want, where)
                params = list(model.parameters())
                assert len(params) == len(want) and all(isinstance(p, nn.Parameter) for p in params)
                assert all(p.requires_grad for p in params)
                assert [n for n, _ in model.named_buffers()] == [n for n, _ in ref.named_buffers()]

            # Edit every parameter (in place, and one by replacing .data); writeback keeps it.
            with FSDP.summon_full_params(model):
                with torch.no_grad():
                    for i, (name, p) in enumerate(model.named_parameters()):
                        if i == 0:
                            p.data = torch.full_like(p, 0.5)
                        else:
                            p.add_(float(i))
            edited = [(n, torch.full_like(q, 0.5) if i == 0 else q + float(i)) for i, (n, q) in enumerate(want)]
            with FSDP.summon_full_params(model, writeback=False):
                check_like_unwrapped(named(model), edited, f"{where} after writeback")
                with torch.no_grad():
                    for _, p in model.named_parameters():
                        p.mul_(-3.0)  # discarded, except under NO_SHARD (the full parameter is the shard)
            with FSDP.summon_full_params(model, writeback=False):
                if strategy is ShardingStrategy.NO_SHARD:
                    discarded = [(n, q * -3.0) for n, q in edited]
                    check_like_unwrapped(named(model), discarded, f"{where} NO_SHARD persists")
                else:
                    check_like_unwrapped(named(model), edited, f"{where} writeback=False")

            # rank0_only: rank 0 gets the full parameters (on CPU with offload_to_cpu), the
            # others keep the flat shards; offload_to_cpu alone warns as PyTorch does.
            for offload in (False, True):
                with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=offload):
                    names = [n for n, _ in model.named_parameters()]
                    if rank == 0:
                        assert names == [n for n, _ in want], names
                        assert all(p.device.type == "cpu" for p in model.parameters())
                    else:
                        assert names and all(n.endswith("flat_param") for n in names), names
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with FSDP.summon_full_params(model, writeback=False, offload_to_cpu=True):
                    got = named(model)
            assert any("offload_to_cpu" in str(w.message) for w in caught)
            assert [n for n, _ in got] == [n for n, _ in want]
            with pytest.raises(NotImplementedError, match="writeback=True and rank0_only=True is not supported"):
                with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
                    pass

            # recurse=False on the root: its own parameters only; nested units stay flat.
            with FSDP.summon_full_params(model, recurse=False, writeback=False):
                names = [n for n, _ in model.named_parameters()]
                own = {"mlp": "head.weight", "ordered": "embed.weight"}[kind]
                assert own in names and any(n.endswith("flat_param") for n in names), names

            # Afterwards the model is flat again and still trains.
            assert [n for n, _ in model.named_parameters()] == outside
            train(model, kind, rank, world_size, steps=1)
    return True


def test_summon_full_params_exposes_the_original_parameters():
    run_ranks(summon_names_body, 4, timeout=300)


def init_fn(m: nn.Module) -> None:
    """An init function as users write them: by module type, through nn.init, with the RNG."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.constant_(m.bias, 0.1)
    elif isinstance(m, nn.LayerNorm):
        nn.init.constant_(m.weight, 2.0)
    elif isinstance(m, nn.Embedding):
        nn.init.uniform_(m.weight, -0.5, 0.5)


def apply_body(rank, world_size):
    out = {}
    for kind in ("mlp", "ordered"):
        torch.manual_seed(123)
        ref = make_model(kind)
        torch.manual_seed(7)
        ref.apply(init_fn)
        want = named(ref)
        for strategy in STRATEGIES:
            model = wrap(kind, strategy)
            torch.manual_seed(7)  # every rank draws the same values, in the unwrapped model's order
            assert model.apply(init_fn) is model
            with FSDP.summon_full_params(model, writeback=False):
                check_like_unwrapped(named(model), want, f"apply {kind} {strategy.name}")
            # The shards themselves changed: gathered over the ranks they give the same values.
            shards = [inst._unit.handle.sharded_flat.detach().clone() for inst in model.fsdp_instances() if inst._unit]
            out[(kind, strategy.name)] = shards
            with pytest.raises(ValueError, match="expected to be in states"):
                with FSDP.summon_full_params(model):
                    model.apply(init_fn)
            train(model, kind, rank, world_size, steps=1)
    return out


def test_apply_summons_full_parameters():
    results = run_ranks(apply_body, 4, timeout=300)
    # Consistent on all ranks: replicas hold equal shards (NO_SHARD: all ranks; HYBRID: rank r and r+2).
    for key, shards in results[0].items():
        strategy = key[1]
        if strategy == "NO_SHARD":
            peers = [1, 2, 3]
        elif strategy == "HYBRID_SHARD":
            peers = [2]
        else:
            peers = []
        for r in peers:
            assert all(torch.equal(a, b) for a, b in zip(shards, results[r][key])), (key, r)


def public_api_body(rank, world_size):
    """PyTorch 1.13's remaining public methods, properties and attributes."""
    raw = make_model("mlp")
    model = FSDP(raw, auto_wrap_policy=unit_policy(raw), sharding_strategy=ShardingStrategy.FULL_SHARD)
    assert model.module is raw
    instances = FSDP.fsdp_modules(model)
    assert instances[0] is model and len(instances) == 5
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    assert model.check_is_root() and not instances[1].check_is_root()
    assert (model.rank, model.world_size) == (rank, world_size)
    assert model.params[0] is model.flat_param and model.limit_all_gathers is True  # 2.x default
    assert model.params_with_grad == []
    # The attributes read the instance's FSDPState, which is how traversal finds instances.
    assert traversal.fsdp_modules(model) == instances
    assert traversal.fsdp_states(model) == [traversal.state_of(i) for i in instances]
    assert model.sharding_strategy is ShardingStrategy.FULL_SHARD and model.training_state is TrainingState.IDLE
    assert model._unit is traversal.state_of(model).unit and model._root_state is traversal.state_of(model).root_state
    assert traversal.state_of(raw) is None and traversal.state_of(instances[1].module) is None
    model.forward_prefetch = True  # a plain attribute in 1.13: assignable, and what the runtime reads
    assert traversal.state_of(model).forward_prefetch is True
    model.forward_prefetch = False
    with pytest.raises(NotImplementedError, match="register_comm_hook"):
        model.register_comm_hook(None, lambda *a: None)
    train(model, "mlp", rank, world_size, steps=1)
    model(torch.zeros(2, 30)).sum().backward()
    assert len(model.params_with_grad) == 5
    return True


def test_public_api_of_pytorch_1_13():
    run_ranks(public_api_body, 2)


def test_traversal_recognises_instances_by_their_state_not_their_class():
    """What the hooks and utilities rely on to walk a tree without importing the class."""
    inner, plain = nn.Linear(2, 2), nn.Linear(2, 2)
    outer = nn.Sequential(inner, nn.Sequential(plain))
    assert traversal.fsdp_modules(outer) == [] and traversal.state_of(outer) is None
    inner_state = FSDPState(compute_device=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD)
    inner._fsdp_state = inner_state
    outer._fsdp_state = FSDPState(compute_device=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD)
    assert traversal.fsdp_modules(outer) == [outer, inner]
    assert traversal.fsdp_states(outer) == [outer._fsdp_state, inner_state]
    assert list(traversal.named_fsdp_states(outer)) == [("", outer._fsdp_state), ("0", inner_state)]
    assert list(traversal.managed_modules(outer, ignored=set())) == [outer, outer[1], plain]
    assert list(traversal.managed_modules(outer, ignored={outer[1]})) == [outer]
