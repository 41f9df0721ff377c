"""Checkpoints across world sizes and engines: a global state dict saved by stage 1 or 2
at world size 2 loads at world size 4 (into either stage) and into a plain
``torch.optim`` optimizer, and training then continues as if never interrupted."""

from __future__ import annotations

import copy

import torch

from impl.zero import ZeroRedundancyOptimizer, ZeroStage2Optimizer
from tests.helpers.zero import (
    OPTIMIZERS,
    average_grads,
    batches,
    loss_fn,
    make_model,
    max_abs_diff,
    param_groups,
    params_of,
    rank_slice,
)
from zerobench.harness.testing import run_ranks

TOL = 1e-5
DATA = batches(5, seed=11)
SAVE_AFTER = 3
STAGES = {1: ZeroRedundancyOptimizer, 2: ZeroStage2Optimizer}


def _build(stage, kind, model):
    cls, kwargs = OPTIMIZERS[kind]
    extra = {"bucket_cap_mb": 0.004} if stage == 2 else {}
    return STAGES[stage](param_groups(model, kind), cls, **extra, **kwargs)


def _train(stage, model, opt, data, rank, world_size):
    for x, y in data:
        opt.zero_grad()
        loss_fn(model, rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
        if stage == 1:
            average_grads(model, world_size)
        opt.step()


def _slow_lr(opt):
    opt.param_groups[1]["lr"] *= 0.5  # a scheduler's change must survive the checkpoint


def _save_world(rank, world_size):
    """Train SAVE_AFTER steps with each stage and optimizer; rank 0 returns the global state dicts."""
    saved = {}
    for stage in STAGES:
        for kind in OPTIMIZERS:
            model = make_model()
            opt = _build(stage, kind, model)
            _train(stage, model, opt, DATA[:1], rank, world_size)
            _slow_lr(opt)
            _train(stage, model, opt, DATA[1:SAVE_AFTER], rank, world_size)
            opt.consolidate_state_dict(to=0)
            saved[(stage, kind)] = (opt.state_dict() if rank == 0 else None, params_of(model))
            if stage == 2:
                opt.remove_hooks()
    return saved


def _resume_world(rank, world_size, saved):
    """Load every saved state into both stages and finish training; return final parameters."""
    finals = {}
    for (saved_stage, kind), (state_dict, params) in saved.items():
        for stage in STAGES:
            model = make_model()
            with torch.no_grad():
                for p, value in zip(model.parameters(), params):
                    p.copy_(value)
            opt = _build(stage, kind, model)
            untouched = copy.deepcopy(state_dict)
            opt.load_state_dict(state_dict)
            assert max_abs_diff(*[[t for s in sd["state"].values() for t in s.values()] for sd in (state_dict, untouched)]) == 0
            assert opt.param_groups[1]["lr"] == state_dict["param_groups"][1]["lr"]
            _train(stage, model, opt, DATA[SAVE_AFTER:], rank, world_size)
            finals[(saved_stage, kind, stage)] = params_of(model)
            if stage == 2:
                opt.remove_hooks()
    return finals


def test_save_at_2_resume_at_4_and_in_plain_torch_optim():
    saved = run_ranks(_save_world, 2)[0]
    finals = run_ranks(_resume_world, 4, args=(saved,))[0]

    for kind in OPTIMIZERS:
        cls, kwargs = OPTIMIZERS[kind]
        reference = make_model()
        ref_opt = cls(param_groups(reference, kind), **kwargs)
        for step, (x, y) in enumerate(DATA):
            if step == 1:
                _slow_lr(ref_opt)
            ref_opt.zero_grad()
            loss_fn(reference, x, y).backward()
            ref_opt.step()
        expected = params_of(reference)

        for saved_stage in STAGES:
            state_dict, params = saved[(saved_stage, kind)]
            for stage in STAGES:
                diff = max_abs_diff(finals[(saved_stage, kind, stage)], expected)
                assert diff < TOL, f"{kind}: saved by stage {saved_stage} at ws 2, resumed by stage {stage} at ws 4: {diff}"

            # The same checkpoint in a plain, single-process torch.optim optimizer.
            model = make_model()
            with torch.no_grad():
                for p, value in zip(model.parameters(), params):
                    p.copy_(value)
            plain = cls(param_groups(model, kind), **kwargs)
            plain.load_state_dict(state_dict)
            for x, y in DATA[SAVE_AFTER:]:
                plain.zero_grad()
                loss_fn(model, x, y).backward()
                plain.step()
            diff = max_abs_diff(params_of(model), expected)
            assert diff < TOL, f"{kind}: saved by stage {saved_stage}, resumed in torch.optim: {diff}"
