"""Behaviours that PyTorch's own FSDP1 test suites exercise, impl.fsdp beside PyTorch's FSDP1.

Each scenario here comes from a test of ``test/distributed/fsdp/`` (state_dict,
mixed_precision, optim_state) that PyTorch's FSDP1 passed and impl did not
(scripts/torch_fsdp_suite.py, docs/fsdp.md "PyTorch's own FSDP1 tests"); both libraries
run it on the same ranks and what each does is compared: ``state_dict(prefix=...)``
beside ignored modules, ``enable_wrap``/``wrap``, a 2.x policy function
(``nonwrapped_numel``), module attributes before the first forward, activation
checkpointing applied around FSDP units, BatchNorm kept out of mixed precision under
auto-wrap, units indexed per root when ranks build different numbers of FSDP modules,
and optimizer state dicts of a plain root with rank-local parameters.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from tests.test_impl_fsdp_torch2x import build, libraries
from zerobench.harness.testing import run_ranks


def _wrap_api(name: str):
    """(enable_wrap, wrap) of a library, imported the way user code imports them."""
    if name == "torch":
        from torch.distributed.fsdp.wrap import enable_wrap, wrap
    else:
        from impl.fsdp.wrap import enable_wrap, wrap
    return enable_wrap, wrap


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")


# -- state_dict(prefix=...), enable_wrap/wrap, 2.x policies, attributes ---------------


class WithIgnored(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)
        self.outer.register_buffer("scale", torch.ones(5))

    def forward(self, x):
        return self.outer(self.inner(x)) * self.outer.scale


def api_body(rank, world_size):
    out = {}
    for name, lib in libraries().items():
        fsdp_cls = lib.FullyShardedDataParallel
        r = out[name] = {}
        # state_dict(prefix=...) keeps the prefix on every key; ignored tensors are not copied.
        torch.manual_seed(0)
        model = WithIgnored()
        ignored_weight = model.outer.weight
        fsdp = build(lib, model, ignored_modules=[model.outer])
        sd = fsdp.state_dict(prefix="foo.")
        r["prefixed_keys"] = sorted(sd)
        r["ignored_aliased"] = sd["foo.outer.weight"].data_ptr() == ignored_weight.data_ptr()
        # enable_wrap / wrap.
        enable_wrap, wrap = _wrap_api(name)
        kwargs = {"device_id": torch.device("cpu")} if name == "torch" else {}
        with enable_wrap(wrapper_cls=fsdp_cls, **kwargs):
            wrapped = wrap(nn.Linear(4, 4))
            try:
                with enable_wrap(wrapper_cls=fsdp_cls):
                    pass
                r["nested"] = "no error"
            except NotImplementedError:
                r["nested"] = "NotImplementedError"
        r["wrap_inside"] = isinstance(wrapped, fsdp_cls)
        r["wrap_outside"] = type(wrap(nn.Linear(4, 4))).__name__
        # A policy function written for PyTorch 2.x names the count nonwrapped_numel.
        def policy(module, recurse, nonwrapped_numel):
            return recurse or (isinstance(module, nn.Linear) and nonwrapped_numel >= 20)

        torch.manual_seed(0)
        seq = build(lib, nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), auto_wrap_policy=policy)
        r["units"] = sorted(_clean(n) for n, m in seq.named_modules() if isinstance(m, fsdp_cls))
        # The inner modules' attributes exist before the first forward (repr reads them).
        r["repr_ok"] = "Linear(in_features=4, out_features=4, bias=True)" in repr(seq)
        r["has_weight"] = hasattr(seq.module[0], "weight") if hasattr(seq, "module") else None
        # Activation checkpointing applied after wrapping puts a wrapper around a unit's
        # module: summon_full_params still shows exactly the original parameters.
        nested = build(lib, nn.Sequential(build(lib, nn.Linear(4, 4, bias=False)), nn.Linear(4, 4, bias=False)))
        apply_activation_checkpointing(nested, check_fn=lambda m: isinstance(m, nn.Linear))
        with fsdp_cls.summon_full_params(nested):
            r["summoned_after_ac"] = [_clean(n) for n, _ in nested.named_parameters()]
    return out


@pytest.mark.world_size(2)
def test_prefix_wrap_api_policies_and_attributes_match_torch(world_size):
    result = run_ranks(api_body, world_size)[0]
    impl, torch_ = result["impl"], result["torch"]
    assert impl["prefixed_keys"] == torch_["prefixed_keys"]
    assert all(k.startswith("foo.") for k in impl["prefixed_keys"]) and "foo.outer.scale" in impl["prefixed_keys"]
    assert impl["ignored_aliased"] and torch_["ignored_aliased"]
    assert impl["wrap_inside"] and torch_["wrap_inside"]
    assert impl["wrap_outside"] == torch_["wrap_outside"] == "Linear"
    assert impl["nested"] == torch_["nested"] == "NotImplementedError"
    assert impl["units"] == torch_["units"] == ["", "0"]  # the 4x4 linear (20 parameters) and the root
    assert impl["repr_ok"] and torch_["repr_ok"]
    assert impl["has_weight"] is torch_["has_weight"] is True
    assert impl["summoned_after_ac"] == torch_["summoned_after_ac"] == [
        "0._checkpoint_wrapped_module.weight", "1._checkpoint_wrapped_module.weight"]


# -- activation checkpointing applied around FSDP units -----------------------------


class Stack(nn.Module):
    """A plain root: ``front`` a unit of its own, ``body`` a Sequential of two units
    (checkpointed as a whole, so their forward runs again inside backward)."""

    def __init__(self):
        super().__init__()
        self.front = nn.Linear(6, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, x):
        return self.body(torch.relu(self.front(x)))


def checkpoint_body(rank, world_size):
    torch.manual_seed(0)
    data = [torch.randn(4, 6) + rank for _ in range(3)]
    out = {}
    for name, lib in libraries().items():
        for impl_kind in (None, CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT):
            torch.manual_seed(1)
            model = Stack()
            model.front = build(lib, model.front)
            model.body[0] = build(lib, model.body[0])
            model.body[2] = build(lib, model.body[2])
            if impl_kind is not None:
                apply_activation_checkpointing(
                    model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl_kind),
                    check_fn=lambda m: isinstance(m, nn.Sequential),
                )
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for x in data:
                loss = model(x).pow(2).sum()
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.item())
            out[f"{name}_{impl_kind.name if impl_kind else 'none'}"] = losses
    return out


@pytest.mark.world_size(2)
def test_checkpointing_around_units_matches_torch(world_size):
    for result in run_ranks(checkpoint_body, world_size):
        reference = result["torch_none"]
        assert reference[-1] < reference[0]  # it trains
        for key, losses in result.items():
            assert losses == pytest.approx(reference, abs=1e-5), key


# -- BatchNorm kept out of mixed precision under auto-wrap ---------------------------


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4)
        self.fc2 = nn.Linear(40, 4, bias=False)

    def forward(self, x):
        x = torch.reshape(self.fc1(x), (-1, 4, 10))
        x = torch.reshape(self.bn(x), (-1, 40))
        return self.fc2(x)


def batchnorm_body(rank, world_size):
    import torch.distributed.fsdp as tfsdp

    import impl.fsdp as ifsdp

    out = {}
    for name, lib in libraries().items():
        api = {"torch": tfsdp, "impl": ifsdp}[name]
        mp = api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = build(lib, BatchNormNet(), mixed_precision=mp, auto_wrap_policy=lambda *a, **k: False)
        r = out[name] = {}
        r["warned"] = any("wrapped as separate FSDP" in str(w.message) for w in caught)
        r["bn_is_unit"] = isinstance(model.bn, lib.FullyShardedDataParallel)
        r["bn_mp_is_default"] = model.bn.mixed_precision == api.MixedPrecision()
        r["fc_is_unit"] = isinstance(model.fc1, lib.FullyShardedDataParallel)
        torch.manual_seed(rank)
        y = model(torch.randn(3, 2))
        y.float().sum().backward()
        r["out_dtype"] = y.dtype
        with lib.FullyShardedDataParallel.summon_full_params(model):
            r["bn_running_mean_dtype"] = model.bn.module.running_mean.dtype
    return out


@pytest.mark.world_size(2)
def test_batchnorm_is_exempt_from_mixed_precision_like_torch(world_size):
    result = run_ranks(batchnorm_body, world_size)[0]
    impl, torch_ = result["impl"], result["torch"]
    assert impl == torch_
    assert impl["warned"] and impl["bn_is_unit"] and impl["bn_mp_is_default"] and not impl["fc_is_unit"]
    assert impl["out_dtype"] == torch.bfloat16 and impl["bn_running_mean_dtype"] == torch.float32


# -- units indexed per root ----------------------------------------------------------


def per_root_index_body(rank, world_size):
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    out = {}
    for name, lib in libraries().items():
        if rank == 0:  # a model only rank 0 builds (and runs), on its own group
            extra = build(lib, nn.Sequential(build(lib, nn.Linear(3, 3), process_group=groups[0]), nn.Linear(3, 3)),
                          process_group=groups[0])
            extra(torch.randn(2, 3)).sum().backward()
        torch.manual_seed(0)
        model = build(lib, nn.Sequential(build(lib, nn.Linear(4, 4)), nn.ReLU(), build(lib, nn.Linear(4, 2))))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            loss = model(torch.full((2, 4), float(rank + step))).pow(2).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        out[name] = losses
    return out


@pytest.mark.world_size(2)
def test_ranks_with_different_numbers_of_fsdp_modules_train_like_torch(world_size):
    for result in run_ranks(per_root_index_body, world_size):
        assert result["impl"] == pytest.approx(result["torch"], abs=1e-6)


# -- optimizer state dicts of a plain root with rank-local parameters ------------------


class Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(8, 16)
        self.net2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x)))


class RankLocal(nn.Module):
    """As model-parallel code does: a dense FSDP part, and a part only this rank has."""

    def __init__(self, lib, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.dense = build(lib, Dense(), use_orig_params=True)
        setattr(self, f"sparse{rank}", nn.Linear(8, 8))
        self.rank = rank

    def forward(self, x):
        sparse = getattr(self, f"sparse{self.rank}")(x)
        dist.all_reduce(sparse)
        return self.dense(sparse)


def rank_local_body(rank, world_size):
    from torch.distributed.optim import _NamedOptimizer

    torch.manual_seed(0)
    batch = torch.rand(5, 8)
    out = {}
    for name, lib in libraries().items():
        model = RankLocal(lib, rank)
        named = _NamedOptimizer(model.named_parameters(), torch.optim.Adam, [{"params": model.parameters()}],
                                model, lr=1e-2)
        model(batch).sum().backward()
        named.step()
        osd = lib.FullyShardedDataParallel.optim_state_dict(model, named)
        r = out[name] = {"keys": sorted(osd["state"])}
        r["sparse_exp_avg"] = osd["state"][f"sparse{rank}.weight"]["exp_avg"].clone()
        before = copy.deepcopy(named.state_dict())
        model(batch).sum().backward()
        named.step()  # a different state, then load the saved one back
        named.load_state_dict(lib.FullyShardedDataParallel.optim_state_dict_to_load(model, named, osd,
                                                                                     is_named_optimizer=True))
        after = named.state_dict()
        r["restored"] = all(
            torch.equal(torch.as_tensor(before["state"][k][s]), torch.as_tensor(after["state"][k][s]))
            for k in before["state"] for s in before["state"][k]
        )
    return out


@pytest.mark.world_size(2)
def test_plain_root_with_rank_local_parameters_and_named_optimizer_like_torch(world_size):
    for rank, result in enumerate(run_ranks(rank_local_body, world_size)):
        impl, torch_ = result["impl"], result["torch"]
        assert impl["keys"] == torch_["keys"]
        assert f"sparse{rank}.weight" in impl["keys"] and f"sparse{1 - rank}.weight" not in impl["keys"]
        assert "dense.net1.weight" in impl["keys"]
        assert torch.allclose(impl["sparse_exp_avg"], torch_["sparse_exp_avg"], atol=1e-7)
        # torch 2.13's FULL optimizer state of use_orig_params units is wrong on CPU (exp_avg holds
        # exp_avg_sq; tests/test_impl_fsdp_orig_optim_state.py), so only impl's round trip is exact.
        assert impl["restored"]


# -- FSDP_USE_FULL_PREC_IN_EVAL -------------------------------------------------------


class SeesDtypes(nn.Module):
    """Records the dtypes its forward sees: input, parameter, buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.register_buffer("scale", torch.ones(5, dtype=torch.float64))

    def forward(self, x):
        self.seen = (x.dtype, self.lin.weight.dtype, self.scale.dtype)
        return self.lin(x)


def full_precision_in_eval_body(rank, world_size):
    import os

    import torch.distributed.fsdp as tfsdp

    import impl.fsdp as ifsdp

    out = {}
    for env in ("0", "1"):
        os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = env  # read when the model is built
        for name, lib in libraries().items():
            api = {"torch": tfsdp, "impl": ifsdp}[name]
            mp = api.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
            torch.manual_seed(0)
            inner = SeesDtypes()
            model = build(lib, nn.Sequential(build(lib, inner, mixed_precision=mp)), mixed_precision=mp)
            steps = []
            for mode in ("train", "eval", "train"):
                getattr(model, mode)()
                torch.manual_seed(rank)
                y = model(torch.randn(3, 5))
                y.float().sum().backward()
                steps.append((mode, inner.seen, y.dtype, next(iter(model.parameters())).grad.dtype, y.detach().float()))
            out[(env, name)] = steps
    os.environ.pop("FSDP_USE_FULL_PREC_IN_EVAL")
    return out


@pytest.mark.world_size(2)
def test_full_precision_in_eval_matches_torch(world_size):
    result = run_ranks(full_precision_in_eval_body, world_size)[0]
    for env in ("0", "1"):
        impl, torch_ = result[(env, "impl")], result[(env, "torch")]
        for (mode, seen, out_dtype, grad_dtype, y), (_, t_seen, t_out_dtype, t_grad_dtype, t_y) in zip(impl, torch_):
            assert (seen, out_dtype, grad_dtype) == (t_seen, t_out_dtype, t_grad_dtype), (env, mode)
            assert torch.allclose(y, t_y, atol=1e-3), (env, mode)
    # Evaluation under FSDP_USE_FULL_PREC_IN_EVAL=1: input, parameters, buffer in full precision.
    assert result[("1", "impl")][1][1] == (torch.float32, torch.float32, torch.float64)
    assert result[("0", "impl")][1][1] == (torch.float16, torch.float16, torch.float16)


# -- parameters frozen after wrapping, seen inside summon_full_params -------------------


def frozen_after_wrap_body(rank, world_size):
    out = {}
    for name, lib in libraries().items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model[0] = build(lib, model[0])
        model = build(lib, model)
        for p in model.module[0].parameters():  # the child unit's parameters: frozen after wrapping
            p.requires_grad = False
        optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model(torch.randn(3, 4) + rank).sum().backward()
        optim.step()
        with lib.FullyShardedDataParallel.summon_full_params(model):
            out[name] = [(_clean(n), p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()]
    return out


@pytest.mark.world_size(2)
def test_parameters_frozen_after_wrapping_stay_frozen_in_summon_like_torch(world_size):
    result = run_ranks(frozen_after_wrap_body, world_size)[0]
    impl, torch_ = result["impl"], result["torch"]
    assert [(n, r) for n, r, _ in impl] == [(n, r) for n, r, _ in torch_]
    assert [r for _, r, _ in impl] == [False, False, True, True]
    for (_, _, a), (_, _, b) in zip(impl, torch_):
        assert torch.allclose(a, b, atol=1e-6)
