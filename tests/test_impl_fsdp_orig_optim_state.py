"""Optimizer state dicts of ``use_orig_params=True`` models, impl.fsdp beside PyTorch's FSDP1.

Both libraries train the same model with the same optimizer. impl's unflattened
optimizer state dicts (FULL, SHARDED, FULL saved on rank 0 only) must hold the names,
groups and values PyTorch's FSDP1 gives for the same model; each form must load back
into a freshly built model and resume training exactly; and a FULL dict must cross
between the libraries in both directions ([Note: optimizer state under use_orig_params]).

The reference values are PyTorch's SHARDED form: torch 2.13's FULL form with
``use_orig_params=True`` returns each parameter's ``exp_avg_sq`` as its ``exp_avg`` too
on CPU/gloo (docs/fsdp.md), so it is not compared. PyTorch's FULL dict of the same model
built with ``use_orig_params=False`` (correct) is what crosses into impl.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._state_dict_utils import _gather_state_dict

from tests.test_impl_fsdp_torch2x import Block, Net, build, libraries, param_groups
from zerobench.harness.testing import run_ranks

STEPS = 2


def _batches(rank: int, world_size: int, steps: int):
    torch.manual_seed(0)
    data = [(torch.randn(8, 5), torch.randn(8, 3)) for _ in range(steps)]
    per_rank = 8 // world_size
    return [(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]) for x, y in data]


def _model_and_optim(lib, seed: int):
    torch.manual_seed(seed)
    model = build(lib, Net(), use_orig_params=True, auto_wrap_policy=lib.ModuleWrapPolicy({Block}))
    return model, torch.optim.AdamW(param_groups(model), lr=1e-2)


def _train(model, optim, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _plain(osd: dict) -> dict:
    """An unflattened optimizer state dict with every sharded value gathered, on the CPU."""
    return {
        "state": {name: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                         for k, v in _gather_state_dict(st).items()} for name, st in osd["state"].items()},
        "param_groups": [dict(g) for g in osd["param_groups"]],
    }


def _model_and_optim_flat(lib, seed: int):
    """The same model and optimizer groups with ``use_orig_params=False`` (one flat shard
    per unit, so one parameter group): only for torch's reference FULL values."""
    torch.manual_seed(seed)
    model = build(lib, Net(), auto_wrap_policy=lib.ModuleWrapPolicy({Block}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)


def body(rank, world_size):
    import torch.distributed.fsdp as tfsdp

    import impl.fsdp as ifsdp

    batches = _batches(rank, world_size, 2 * STEPS)
    train, more = batches[:STEPS], batches[STEPS:]
    libs = libraries()
    out = {}
    for name, lib in libs.items():
        api = {"torch": tfsdp, "impl": ifsdp}[name]
        fsdp = lib.FullyShardedDataParallel
        model, optim = _model_and_optim(lib, seed=1)
        _train(model, optim, train)
        full = fsdp.optim_state_dict(model, optim)  # FULL on every rank (2.x's default config)
        with fsdp.state_dict_type(model, lib.StateDictType.SHARDED_STATE_DICT):
            sharded = fsdp.optim_state_dict(model, optim)
            model_sd = model.state_dict()
        model_full = model.state_dict()  # FULL: plain tensors, which either library loads
        rank0_config = (lib.StateDictType.FULL_STATE_DICT, api.FullStateDictConfig(),
                        api.FullOptimStateDictConfig(rank0_only=True))
        with fsdp.state_dict_type(model, *rank0_config):
            rank0 = fsdp.optim_state_dict(model, optim)
        out[name] = {"full": _plain(full), "sharded": _plain(sharded), "rank0_empty": rank0 == {},
                     "continued": _train(model, optim, more)}
        # Resume from each form in a model built from another seed: the same next losses.
        for form, osd, settings in (("full", full, (lib.StateDictType.FULL_STATE_DICT,)),
                                    ("sharded", sharded, (lib.StateDictType.SHARDED_STATE_DICT,)),
                                    ("rank0", rank0, rank0_config)):
            model2, optim2 = _model_and_optim(lib, seed=7)
            with fsdp.state_dict_type(model2, lib.StateDictType.SHARDED_STATE_DICT):
                model2.load_state_dict(model_sd)
            with fsdp.state_dict_type(model2, *settings):
                optim2.load_state_dict(fsdp.optim_state_dict_to_load(model2, optim2, osd))
            out[name][f"resumed_{form}"] = _train(model2, optim2, more)
        if name == "impl":  # impl's FULL dict resumes torch's model too
            model3, optim3 = _model_and_optim(libs["torch"], seed=7)
            model3.load_state_dict(model_full)
            optim3.load_state_dict(libs["torch"].FullyShardedDataParallel.optim_state_dict_to_load(model3, optim3, full))
            out["impl_into_torch"] = _train(model3, optim3, more)

    # torch's FULL dict of a use_orig_params=False model, loaded into impl's use_orig_params
    # model, reads back the same.
    lib = libs["torch"]
    model, optim = _model_and_optim_flat(lib, seed=1)
    _train(model, optim, train)
    reference = lib.FullyShardedDataParallel.optim_state_dict(model, optim)
    out["torch_flat_full"] = _plain(reference)
    model4 = build(libs["impl"], Net(), use_orig_params=True, auto_wrap_policy=libs["impl"].ModuleWrapPolicy({Block}))
    optim4 = torch.optim.AdamW(model4.parameters(), lr=1e-2, weight_decay=0.0)
    optim4.load_state_dict(libs["impl"].FullyShardedDataParallel.optim_state_dict_to_load(model4, optim4, reference))
    out["torch_into_impl"] = _plain(libs["impl"].FullyShardedDataParallel.optim_state_dict(model4, optim4))
    dist.barrier()
    return out


def _assert_same(a: dict, b: dict, what: str) -> None:
    _assert_same_states(a, b, what)
    assert [sorted(g["params"]) for g in a["param_groups"]] == [sorted(g["params"]) for g in b["param_groups"]], what
    assert [g["weight_decay"] for g in a["param_groups"]] == [g["weight_decay"] for g in b["param_groups"]], what


def _assert_same_states(a: dict, b: dict, what: str) -> None:
    assert sorted(a["state"]) == sorted(b["state"]), what
    for name in a["state"]:
        sa, sb = a["state"][name], b["state"][name]
        assert sorted(sa) == sorted(sb), (what, name)
        for key in sa:
            assert torch.allclose(torch.as_tensor(sa[key]).float(), torch.as_tensor(sb[key]).float(),
                                  atol=1e-6), (what, name, key)


@pytest.mark.world_size(2)
def test_orig_params_optimizer_state_dicts_match_torch_and_resume(world_size):
    for rank, result in enumerate(run_ranks(body, world_size)):
        impl, torch_ = result["impl"], result["torch"]
        # Keyed by the unwrapped model's names, with whole (unsharded) states.
        assert impl["full"]["state"]["blocks.0.fc.weight"]["exp_avg"].shape == (12, 12)
        _assert_same(impl["full"], torch_["sharded"], f"impl FULL vs torch SHARDED, rank {rank}")
        _assert_same(impl["sharded"], torch_["sharded"], f"SHARDED, rank {rank}")
        assert impl["rank0_empty"] == torch_["rank0_empty"] == (rank != 0)
        for form in ("full", "sharded", "rank0"):
            assert impl[f"resumed_{form}"] == pytest.approx(impl["continued"], abs=1e-6), form
        assert torch_["resumed_sharded"] == pytest.approx(torch_["continued"], abs=1e-6)  # its FULL: see above
        assert impl["continued"] == pytest.approx(torch_["continued"], abs=1e-5)
        assert result["impl_into_torch"] == pytest.approx(impl["continued"], abs=1e-6)
        _assert_same_states(result["torch_into_impl"], result["torch_flat_full"], f"torch's dict into impl, rank {rank}")
