"""ZeRO stage 1 (impl.zero.ZeroRedundancyOptimizer) on real gloo ranks.

Each test runs one world and loops over its configurations inside it (a world per
configuration would cost more than the configurations themselves).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.autograd.profiler import profile
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

# torch's constructor imports its TorchScript functional optimizers (seconds, and
# deprecation warnings): import them once here, before the ranks fork.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim.utils import functional_optim_map  # noqa: F401

from impl.zero import ZeroRedundancyOptimizer
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
    reference_train,
    state_max_abs_diff,
)
from zerobench.harness.testing import run_ranks

TOL = 1e-5


def sharded_step(model, opt, x, y, rank, world_size):
    opt.zero_grad()
    loss_fn(model, rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
    average_grads(model, world_size)
    opt.step()


def _parity_world(rank, world_size):
    """SGD and Adam, with and without bucket views: parameters and consolidated state
    equal single-process training on the global batch, and each rank holds only its
    partition's state. An LR change on the public groups mid-run reaches the shards."""
    for kind in OPTIMIZERS:
        cls, kwargs = OPTIMIZERS[kind]
        for bucket_view in (False, True):
            data = batches(4)
            ref_model = make_model()
            ref_opt = cls(param_groups(ref_model, kind), **kwargs)
            reference_train(kind, data[:2], ref_model, ref_opt)
            ref_opt.param_groups[1]["lr"] *= 0.5
            reference_train(kind, data[2:], ref_model, ref_opt)

            model = make_model()
            opt = ZeroRedundancyOptimizer(param_groups(model, kind), cls, parameters_as_bucket_view=bucket_view, **kwargs)
            for step, (x, y) in enumerate(data):
                if step == 2:
                    opt.param_groups[1]["lr"] *= 0.5  # as an LR scheduler would
                if step == 3:
                    with profile() as prof:
                        sharded_step(model, opt, x, y, rank, world_size)
                    names = [e.name for e in prof.function_events]
                    expected = world_size if bucket_view else sum(len(g["params"]) for r in opt._partition_parameters() for g in r)
                    assert names.count("impl::broadcast") == expected, (names.count("impl::broadcast"), expected)
                else:
                    sharded_step(model, opt, x, y, rank, world_size)
            diff = max_abs_diff(params_of(model), params_of(ref_model))
            assert diff < TOL, f"{kind} bucket_view={bucket_view}: parameters differ by {diff}"
            assert opt.param_groups[1]["lr"] == ref_opt.param_groups[1]["lr"]

            # Optimizer state lives only with the owner.
            owned = {p for g in opt._partition_parameters()[rank] for p in g["params"] if p.requires_grad}
            assert set(opt.optim.state.keys()) == owned
            if kind == "adam":
                state_numel = sum(v.numel() for s in opt.optim.state.values() for v in s.values() if v.dim() > 0)
                assert state_numel == 2 * sum(p.numel() for p in owned)

            # Consolidates on any rank; elsewhere state_dict() refuses.
            to = world_size - 1
            opt.consolidate_state_dict(to=to)
            if rank == to:
                sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
                assert state_max_abs_diff(sd, ref_sd) < TOL
                assert sd["param_groups"] == ref_sd["param_groups"]
            else:
                with pytest.raises(RuntimeError, match="has not been consolidated on this rank"):
                    opt.state_dict()
    return True


@pytest.mark.world_size(2, 4)
def test_parity_with_single_process(world_size):
    run_ranks(_parity_world, world_size)


def _index_partition(opt, model):
    index = {p: i for i, p in enumerate(model.parameters())}
    return [[[index[p] for p in g["params"]] for g in groups] for groups in opt._partition_parameters()]


def _torch_comparison_world(rank, world_size):
    """Ours and torch's on the same inputs: same partition, same parameters, same
    consolidated state dict — through add_param_group, a trainability change with
    bucket views, and an LR change. Returns rank 0's state dicts."""
    out = {}
    for kind in OPTIMIZERS:
        cls, kwargs = OPTIMIZERS[kind]
        for bucket_view in (False, True):
            models, opts = [], []
            for impl_cls in (ZeroRedundancyOptimizer, TorchZero):
                model = make_model()
                groups = param_groups(model, kind)
                opt = impl_cls(groups[:1], cls, parameters_as_bucket_view=bucket_view, **kwargs)
                models.append((model, groups))
                opts.append(opt)
            data = batches(4, seed=7)
            for step, (x, y) in enumerate(data):
                for (model, groups), opt in zip(models, opts):
                    if step == 1:
                        opt.add_param_group(groups[1])
                    if step == 2:
                        # Trainability changes at run time. (A parameter of the constructor's
                        # groups: torch only tracks those, see docs/zero.md.)
                        model.mid.weight.requires_grad_(False)
                        opt.param_groups[0]["lr"] *= 0.1
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        sharded_step(model, opt, x, y, rank, world_size)
                assert _index_partition(opts[0], models[0][0]) == _index_partition(opts[1], models[1][0])
                for a, b in zip(models[0][0].parameters(), models[1][0].parameters()):
                    assert torch.equal(a, b), f"{kind} bucket_view={bucket_view} step {step}"
            for opt in opts:
                opt.consolidate_state_dict(to=0)
            if rank == 0:
                mine, theirs = opts[0].state_dict(), opts[1].state_dict()
                assert mine["param_groups"] == theirs["param_groups"]
                assert state_max_abs_diff(mine, theirs) == 0.0
                out[(kind, bucket_view)] = mine
    return out


@pytest.mark.world_size(2, 4)
def test_matches_torch_zero_redundancy_optimizer(world_size):
    results = run_ranks(_torch_comparison_world, world_size)
    assert len(results[0]) == 4


def _api_world(rank, world_size):
    """Public surface: the partition sizes, join properties, trainability warning,
    manual partition refused after construction."""
    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    assert opt.join_device == torch.device("cpu")
    assert opt.join_process_group is dist.group.WORLD
    assert opt.join_hook() is not None
    assert sum(opt.rank_numels()) == sum(p.numel() for p in model.parameters())
    with pytest.raises(AssertionError, match="should only be done when the parameters have not been partitioned"):
        opt._partition_parameters([[] for _ in range(world_size)])
    model.frozen.requires_grad_(True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.warns(UserWarning, match="trainable parameters changed"):
        opt.step()

    # step(closure) returns the closure's loss, as torch.optim does.
    (x, y), = batches(1)

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        return loss

    assert torch.is_tensor(opt.step(closure))
    # A state dict whose groups do not fit is refused before anything is loaded.
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        bad = opt.state_dict()
        bad["param_groups"] = bad["param_groups"] * 2
        with pytest.raises(ValueError, match="different number of parameter groups"):
            opt.load_state_dict(bad)
    return True


@pytest.mark.world_size(2)
def test_public_api(world_size):
    run_ranks(_api_world, world_size)


def _join_world(rank, world_size):
    """Uneven inputs under torch's Join (with DDP first, as torch documents): a rank
    that runs out keeps stepping through the join hook, so its parameters still reach
    the others. Ours and torch's agree."""
    finals = []
    for impl_cls in (ZeroRedundancyOptimizer, TorchZero):
        model = make_model()
        ddp = DDP(model)
        opt = impl_cls(model.parameters(), torch.optim.SGD, lr=0.05)
        with Join([ddp, opt]):
            for x, y in batches(2 + rank, seed=3):  # rank r runs 2 + r steps
                opt.zero_grad()
                loss_fn(ddp, rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
                opt.step()
        finals.append(params_of(model))
    assert max_abs_diff(*finals) == 0.0
    return True


@pytest.mark.world_size(2)
def test_join_uneven_inputs(world_size):
    run_ranks(_join_world, world_size, timeout=60)


def _all_params_world(rank, world_size):
    """``_all_params`` is a plain list, as in torch: code written against torch's class
    iterates it (join hooks do). Same parameters in the same order as torch's; groups
    added later join it, and the trainable mask follows them."""
    model = make_model()
    groups = param_groups(model, "adam")
    ours = ZeroRedundancyOptimizer(groups, torch.optim.SGD, lr=0.1)
    theirs = TorchZero(param_groups(model, "adam"), torch.optim.SGD, lr=0.1)
    assert isinstance(ours._all_params, list)
    assert [id(p) for p in ours._all_params] == [id(p) for p in theirs._all_params]
    assert sum(p.numel() for p in ours._all_params) == sum(p.numel() for p in model.parameters())
    extra = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    ours.add_param_group({"params": [extra], "lr": 0.01})
    assert ours._all_params[-1] is extra
    assert ours._trainable_mask()[-1] is False
    return True


@pytest.mark.world_size(2)
def test_all_params_is_a_list(world_size):
    run_ranks(_all_params_world, world_size)
