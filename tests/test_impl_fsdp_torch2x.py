"""impl.fsdp against PyTorch 2.x's FSDP1, side by side on the same ranks (issue 29).

Each scenario runs with ``torch.distributed.fsdp.FullyShardedDataParallel`` and with
``impl.fsdp.FullyShardedDataParallel`` built the same way, and compares what each does:
``use_orig_params=True`` training (losses against each other and against DDP), a
module registered under two names, a change of forward order after the first
iteration, SHARDED state dicts on a one-rank group, FULL state dicts under a plain
(non-FSDP) root, LOCAL keys, the errors for bad ``ignored_modules``, and FULL state
dicts that alias ignored tensors.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import impl.fsdp as ifsdp
from tests.helpers.fsdp import warm_up_imports
from zerobench.harness.testing import run_ranks

warm_up_imports()

LOSS_TOL = 1e-5
"""fp32 losses of FSDP (either library) and DDP on the same data: only the order of
summation differs (observed ~1e-7)."""


def libraries() -> dict[str, SimpleNamespace]:
    """{name: the library's public FSDP names this file uses}, each imported the way
    user code imports it."""
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp.wrap as twrap

    return {
        "torch": SimpleNamespace(name="torch", FullyShardedDataParallel=tfsdp.FullyShardedDataParallel,
                                 StateDictType=tfsdp.StateDictType, ModuleWrapPolicy=twrap.ModuleWrapPolicy,
                                 ShardingStrategy=tfsdp.ShardingStrategy),
        "impl": SimpleNamespace(name="impl", FullyShardedDataParallel=ifsdp.FullyShardedDataParallel,
                                StateDictType=ifsdp.StateDictType, ModuleWrapPolicy=ifsdp.ModuleWrapPolicy,
                                ShardingStrategy=ifsdp.ShardingStrategy),
    }


def build(lib, module, **kwargs):
    """``lib.FullyShardedDataParallel(module, **kwargs)``; torch's needs ``device_id=cpu``
    on a machine without an accelerator."""
    if lib.name == "torch":
        kwargs.setdefault("device_id", torch.device("cpu"))
    return lib.FullyShardedDataParallel(module, **kwargs)


# -- use_orig_params=True: per-parameter groups, names, losses ------------------------


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, width: int = 12, depth: int = 3):
        super().__init__()
        self.embed = nn.Linear(5, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices only, not on norms and biases: the pattern that needs
    use_orig_params. Chosen by name, since with use_orig_params a parameter's local
    shape is its slice of the shard."""
    decay = [p for n, p in model.named_parameters() if _is_matrix(n)]
    no_decay = [p for n, p in model.named_parameters() if not _is_matrix(n)]
    assert decay and no_decay
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _is_matrix(name: str) -> bool:
    return name.endswith("weight") and "norm" not in name


def orig_params_body(rank, world_size, steps=4):
    torch.manual_seed(0)
    data = [(torch.randn(8, 5), torch.randn(8, 3)) for _ in range(steps)]
    per_rank = 8 // world_size
    out = {}
    for name, lib in {**libraries(), "ddp": None}.items():
        torch.manual_seed(1)
        raw = Net()
        if lib is None:
            model = DDP(raw)
            groups = param_groups(raw)
        else:
            model = build(lib, raw, use_orig_params=True, auto_wrap_policy=lib.ModuleWrapPolicy({Block}))
            out[f"{name}_names"] = [n for n, _ in model.named_parameters()]
            groups = param_groups(model)
            out[f"{name}_types"] = {type(p).__name__ for p in model.parameters()}
        optim = torch.optim.AdamW(groups, lr=1e-2)
        losses = []
        for x, y in data:
            xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            loss = F.mse_loss(model(xs), ys)
            loss.backward()
            if lib is not None:
                # Every original parameter with a part of this rank's shard has a gradient of that part's shape.
                for p in model.parameters():
                    assert p.grad is None or p.grad.shape == p.shape, (name, p.shape, p.grad.shape)
                out[f"{name}_grads_set"] = sum(p.grad is not None for p in model.parameters())
            optim.step()
            optim.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world_size)
        out[name] = losses
    return out


@pytest.mark.world_size(2, 4)
def test_use_orig_params_matches_torch_fsdp1_and_ddp(world_size):
    """Two AdamW groups (decay on matrices only) over the original parameters: the
    losses of impl, torch's FSDP1 (both use_orig_params=True) and DDP agree."""
    result = run_ranks(orig_params_body, world_size)[0]
    assert result["impl_names"] == result["torch_names"]
    assert result["impl_types"] == result["torch_types"] == {"Parameter"}
    assert result["impl_grads_set"] > 0
    for step, (a, b, c) in enumerate(zip(result["impl"], result["torch"], result["ddp"])):
        assert abs(a - b) <= LOSS_TOL and abs(a - c) <= LOSS_TOL, (step, a, b, c)
    assert result["impl"][-1] < result["impl"][0]  # it trains


# -- a module registered under two names (gap 2) -----------------------------------


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(4, 4)
        self.net2 = nn.Linear(4, 4)
        self.net3 = self.net2  # the same module under a second name

    def forward(self, x):
        return self.net3(torch.relu(self.net2(self.net1(x))))


def shared_module_body(rank, world_size):
    out = {}
    for name, lib in libraries().items():
        torch.manual_seed(0)
        model = build(lib, Shared())
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            x = torch.full((2, 4), float(rank + step))
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        state = model.state_dict()
        out[name] = (losses, {k: v.clone() for k, v in state.items()})
    return out


@pytest.mark.world_size(2)
def test_shared_submodule_wraps_and_state_dict_is_deduplicated(world_size):
    result = run_ranks(shared_module_body, world_size)[0]
    (torch_losses, torch_sd), (impl_losses, impl_sd) = result["torch"], result["impl"]
    assert impl_losses == pytest.approx(torch_losses, abs=1e-6)
    assert sorted(impl_sd) == sorted(torch_sd), (sorted(impl_sd), sorted(torch_sd))
    for key in torch_sd:
        assert torch.allclose(impl_sd[key], torch_sd[key], atol=1e-6), key


# -- forward order changes after the first iteration (gap 3) -----------------------


class TwoPaths(nn.Module):
    """``a`` then ``b`` or ``a`` then ``c``; ``b`` and ``c`` have the same numel (36) or not."""

    def __init__(self, same_size: bool):
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 6, bias=False)
        self.c = nn.Sequential(nn.Linear(6, 3, bias=False), nn.Linear(3, 6, bias=not same_size))
        self.alt = False

    def forward(self, x):
        x = torch.relu(self.a(x))
        return self.c(x) if self.alt else self.b(x)


def order_change_body(rank, world_size, lib_name, same_size):
    lib = libraries()[lib_name]
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # torch checks the order only then
    torch.manual_seed(0)
    model = TwoPaths(same_size)
    model.b, model.c = build(lib, model.b), build(lib, model.c)
    model = build(lib, model)
    for _ in range(2):
        model(torch.randn(4, 5)).sum().backward()
    model.module.alt = rank == 1  # rank 1 takes the other path from now on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(2):
                model(torch.randn(4, 5)).sum().backward()
            outcome = "completed"
        except RuntimeError as e:
            outcome = f"RuntimeError: {e}"
    warned = [str(w.message) for w in caught if "Forward order differs from that of the first iteration" in str(w.message)]
    return outcome, warned


@pytest.mark.world_size(2)
@pytest.mark.parametrize("lib_name", ["torch", "impl"])
def test_order_change_after_first_iteration_warns_like_torch(world_size, lib_name):
    """Units of equal size on the two paths: both libraries warn on the rank that
    changed its order (in the same words) and carry on."""
    results = run_ranks(order_change_body, world_size, args=(lib_name, True), timeout=120)
    assert [r[0] for r in results] == ["completed", "completed"]
    assert not results[0][1]
    assert len(results[1][1]) == 1
    assert results[1][1][0].startswith(
        "Forward order differs from that of the first iteration on rank 1. Collectives are unchecked"
    )


@pytest.mark.world_size(2)
def test_order_change_with_mismatched_all_gathers_raises_instead_of_hanging(world_size):
    """Units of different sizes on the two paths: torch's FSDP1 would pair all-gathers
    of different sizes and hang until gloo's timeout (not run here); impl raises on
    every rank."""
    results = run_ranks(order_change_body, world_size, args=("impl", False), timeout=60)
    for outcome, _ in results:
        assert outcome.startswith("RuntimeError: Forward order differs across ranks"), outcome
        assert "would hang" in outcome


# -- SHARDED_STATE_DICT on a one-rank group (gap 4) --------------------------------


def one_rank_sharded_body(rank, world_size):
    from torch.distributed.tensor import DTensor

    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    out = {}
    for name, lib in libraries().items():
        torch.manual_seed(rank)
        model = build(lib, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), process_group=singles[rank])
        with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType.SHARDED_STATE_DICT):
            sd = model.state_dict()
            saved = {k: (v.full_tensor() if isinstance(v, DTensor) else _full_sharded(v)).clone() for k, v in sd.items()}
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            model.load_state_dict(sd)
        with lib.FullyShardedDataParallel.summon_full_params(model):
            reloaded = {k: v.detach().clone() for k, v in model.named_parameters()}
        out[name] = (sorted(saved), all(torch.equal(saved[k], reloaded[k]) for k in saved))
    return out


def _full_sharded(value):
    from impl.fsdp.state_dict import full_tensor

    return full_tensor(value)


@pytest.mark.world_size(2)
def test_sharded_state_dict_on_a_one_rank_group(world_size):
    result = run_ranks(one_rank_sharded_body, world_size)[0]
    assert result["impl"][0] == result["torch"][0]
    assert result["torch"][1] and result["impl"][1]


# -- FULL state dicts under a plain root (gap 5), LOCAL keys (gap 7) ----------------


def plain_root_body(rank, world_size):
    out = {}
    for name, lib in libraries().items():
        torch.manual_seed(0)
        root = nn.Sequential(build(lib, nn.Linear(3, 4)), nn.ReLU(), build(lib, nn.Linear(4, 2)))
        root(torch.randn(2, 3)).sum().backward()  # lazy init, as in training
        with lib.FullyShardedDataParallel.state_dict_type(root, lib.StateDictType.FULL_STATE_DICT):
            full = {k: v.clone() for k, v in root.state_dict().items()}
        torch.manual_seed(5)
        fresh = nn.Sequential(build(lib, nn.Linear(3, 4)), nn.ReLU(), build(lib, nn.Linear(4, 2)))
        with lib.FullyShardedDataParallel.state_dict_type(fresh, lib.StateDictType.FULL_STATE_DICT):
            missing, unexpected = fresh.load_state_dict(full)
            back = fresh.state_dict()
        with lib.FullyShardedDataParallel.state_dict_type(root, lib.StateDictType.LOCAL_STATE_DICT):
            local_keys = sorted(root.state_dict())
        out[name] = (sorted(full), list(missing), list(unexpected),
                     all(torch.equal(full[k], back[k]) for k in full), local_keys)
    return out


@pytest.mark.world_size(2)
def test_full_state_dict_reloads_under_a_plain_root_and_local_keys_match(world_size):
    result = run_ranks(plain_root_body, world_size)[0]
    t, i = result["torch"], result["impl"]
    assert i[0] == t[0] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert i[1] == i[2] == [] and t[1] == t[2] == []
    assert t[3] and i[3]
    assert i[4] == t[4] == ["0._flat_param", "2._flat_param"]


# -- errors (gap 8) and aliasing of ignored tensors (gap 9) -------------------------


def errors_and_alias_body(rank, world_size):
    out = {}
    for name, lib in libraries().items():
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        errors = []
        try:
            build(lib, model, ignored_modules=[model[0].weight])
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            errors.append((type(e).__name__, str(e)))
        try:
            build(lib, model, ignored_modules=[model[0]], ignored_states=[model[1].weight])
        except Exception as e:  # noqa: BLE001
            errors.append((type(e).__name__, str(e)))
        for strategy in (lib.ShardingStrategy.HYBRID_SHARD, lib.ShardingStrategy._HYBRID_SHARD_ZERO2):
            try:  # manual wrapping without groups
                build(lib, nn.Linear(2, 2), sharding_strategy=strategy)
            except Exception as e:  # noqa: BLE001
                errors.append((type(e).__name__, str(e).replace(lib.name, "")))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build(lib, nn.Sequential(nn.Linear(2, 2)), ignored_modules=None)
            top = nn.Linear(2, 2)
            build(lib, top, ignored_modules=[top])
        root_warning = [str(w.message) for w in caught if "top-level module" in str(w.message)]

        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 3))
        wrapped = build(lib, inner, ignored_modules=[inner[0]])
        with lib.FullyShardedDataParallel.state_dict_type(wrapped, lib.StateDictType.FULL_STATE_DICT):
            sd = wrapped.state_dict()
        aliased = {
            "ignored weight": sd["0.weight"].data_ptr() == inner[0].weight.data_ptr(),
            "buffer": sd["1.running_mean"].data_ptr() == inner[1].running_mean.data_ptr(),
        }
        out[name] = (errors, root_warning[:1], aliased)
    return out


@pytest.mark.world_size(2)
def test_errors_warnings_and_ignored_tensor_aliasing_match_torch(world_size):
    result = run_ranks(errors_and_alias_body, world_size)[0]
    (t_errors, t_warn, t_alias), (i_errors, i_warn, i_alias) = result["torch"], result["impl"]
    assert [e[0] for e in i_errors] == [e[0] for e in t_errors] == ["ValueError"] * 4
    assert [e[1] for e in i_errors] == [e[1] for e in t_errors]
    prefix = "Trying to ignore the top-level module passed into the FSDP constructor itself"
    assert t_warn[0].startswith(prefix) and i_warn[0].startswith(prefix)
    assert t_alias == {"ignored weight": True, "buffer": True}
    assert i_alias == t_alias


# -- device_mesh ----------------------------------------------------------------------


def device_mesh_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for name, lib in libraries().items():
        for strategy, shape in (("FULL_SHARD", (world_size,)), ("HYBRID_SHARD", (1, world_size)),
                                ("_HYBRID_SHARD_ZERO2", (1, world_size))):
            torch.manual_seed(0)
            mesh = init_device_mesh("cpu", shape)
            model = build(lib, Net(), device_mesh=mesh, sharding_strategy=lib.ShardingStrategy[strategy],
                          auto_wrap_policy=lib.ModuleWrapPolicy({Block}))
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(1 + rank)
            losses = []
            for _ in range(2):
                loss = model(torch.randn(4, 5)).pow(2).mean()
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.item())
            inter = getattr(model, "_inter_node_pg", None)
            out[(name, strategy)] = (losses, dist.get_world_size(model.process_group),
                                     None if inter is None else dist.get_world_size(inter))
    return out


@pytest.mark.world_size(2)
def test_device_mesh_groups_and_losses_match_torch(world_size):
    """A 1-D mesh for FULL_SHARD, a 2-D (replicate, shard) mesh for the hybrid strategies:
    the same process-group sizes and the same losses in both libraries."""
    result = run_ranks(device_mesh_body, world_size)[0]
    for strategy in ("FULL_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        t, i = result[("torch", strategy)], result[("impl", strategy)]
        assert i[1] == t[1] == world_size, strategy
        if strategy != "FULL_SHARD":
            assert i[2] == t[2] == 1, strategy
        assert i[0] == pytest.approx(t[0], abs=LOSS_TOL), strategy
