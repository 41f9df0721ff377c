"""impl.fsdp beyond parity: the rate limiter, what each strategy keeps unsharded, the
first-iteration order check, no_sync, clip_grad_norm_, summon_full_params, frozen and
ignored modules, and the errors docs/behaviour.md §F lists."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from impl.fsdp import BackwardPrefetch, ShardedState, ShardingStrategy
from impl.fsdp import FullyShardedDataParallel as FSDP
from tests.helpers.fsdp import (
    DEFAULTS_1_13,
    MLP,
    TOL,
    Block,
    batches,
    get_by_name,
    loss_fn,
    make_model,
    make_optimizer,
    max_param_diff,
    rank_slice,
    reference_train,
    train,
    unit_policy,
    warm_up_imports,
)
from zerobench.harness.testing import run_ranks
from zerobench.instruments import emulation
from zerobench.instruments.link import Link

warm_up_imports()

FULL, GRAD_OP, NO_SHARD, HYBRID = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
    ShardingStrategy.HYBRID_SHARD,
)


def wrapped_mlp(**kwargs):
    raw = make_model("mlp")
    return FSDP(raw, auto_wrap_policy=unit_policy(raw), **{**DEFAULTS_1_13, **kwargs})


def states(model):
    return [inst._unit.state for inst in model.fsdp_instances() if inst._unit is not None]


# -- the rate limiter and the strategies' unsharded lifetimes -----------------------------


def limiter_body(rank, world_size):
    out = {}
    prefetch = dict(sharding_strategy=FULL, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True)
    # A slow emulated interconnect, so that waiting on a held-back all-gather takes time.
    emulation.install(Link(0.05, 1000))
    try:
        for label, kwargs in {
            "off": dict(limit_all_gathers=False),
            "depth1": dict(limit_all_gathers=True, limiter_depth=1),
            "depth2": dict(limit_all_gathers=True, limiter_depth=2),
        }.items():
            model = wrapped_mlp(**prefetch, **kwargs)
            train(model, "mlp", rank, world_size, steps=3)
            out[label] = model.limiter_metrics()
    finally:
        emulation.uninstall()

    # What stays unsharded between forward and backward, and after backward.
    for strategy in (FULL, GRAD_OP, NO_SHARD):
        model = wrapped_mlp(sharding_strategy=strategy)
        x, y = batches("mlp", 1)[0]
        model.limiter_metrics()
        loss = loss_fn("mlp", model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
        after_forward = states(model)
        loss.backward()
        out[strategy.name] = (after_forward, states(model), model.limiter_metrics()["all_gathers"])
    # NO_SHARD under mixed precision: the bf16 copies are freed after forward and after backward.
    from impl.fsdp import MixedPrecision

    model = wrapped_mlp(sharding_strategy=NO_SHARD, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    loss = loss_fn("mlp", model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
    held = lambda: [inst._unit.handle.unsharded_allocated for inst in model.fsdp_instances()]  # noqa: E731
    after_forward = (states(model), held())
    loss.backward()
    out["NO_SHARD_bf16"] = (after_forward, (states(model), held()), model.limiter_metrics()["all_gathers"])
    return out


@pytest.mark.world_size(2)
def test_limiter_bounds_units_in_flight_and_strategies_keep_what_they_should(world_size):
    out = run_ranks(limiter_body, world_size)[0]
    # Without a limit, a prefetch puts a second unit in flight beside the current one.
    assert out["off"]["max_inflight_all_gathers"] == 2
    assert out["off"]["limiter_stalls"] == 0
    # Depth 1: never more than one; the prefetches were held back, and waiting for them
    # (on a slow emulated interconnect) was recorded as stall time.
    assert out["depth1"]["max_inflight_all_gathers"] <= 1
    assert out["depth1"]["limiter_stalls"] > 0
    assert out["depth1"]["limiter_stall_s"] > 0
    assert out["depth1"]["limiter_overruns"] == 0
    # Depth 2 (PyTorch's) does not bind with one-ahead prefetch.
    assert out["depth2"]["max_inflight_all_gathers"] <= 2
    assert out["depth2"]["limiter_stalls"] == 0
    # Every configuration gathered the same number of times: held back is not skipped.
    assert out["off"]["all_gathers"] == out["depth1"]["all_gathers"] == out["depth2"]["all_gathers"]

    unsharded, sharded = ShardedState.UNSHARDED, ShardedState.SHARDED
    # FULL_SHARD: the root (first) stays unsharded after forward, the four blocks are freed;
    # everything is freed after backward. 1 + 2 x 4 all-gathers.
    after_forward, after_backward, gathers = out["FULL_SHARD"]
    assert after_forward == [unsharded] + [sharded] * 4
    assert after_backward == [sharded] * 5 and gathers == 9
    # SHARD_GRAD_OP keeps every unit unsharded from forward to backward: 5 all-gathers.
    after_forward, after_backward, gathers = out["SHARD_GRAD_OP"]
    assert after_forward == [unsharded] * 5
    assert after_backward == [sharded] * 5 and gathers == 5
    # NO_SHARD never shards and never all-gathers.
    after_forward, after_backward, gathers = out["NO_SHARD"]
    assert after_forward == after_backward == [unsharded] * 5 and gathers == 0
    # Under mixed precision it frees each unit's low-precision copy after forward, the
    # root's too, and after backward, as FSDP1 does ([Note: NO_SHARD's low-precision copy]).
    after_forward, after_backward, gathers = out["NO_SHARD_bf16"]
    assert after_forward == after_backward == ([sharded] * 5, [False] * 5) and gathers == 0


# -- the first-iteration order check ------------------------------------------------------


class RankDependentOrder(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        first, second = (self.a, self.b) if dist.get_rank() == 0 else (self.b, self.a)
        return second(first(x))


def order_body(rank, world_size):
    torch.manual_seed(0)
    raw = RankDependentOrder()
    model = FSDP(raw, auto_wrap_policy=lambda module, recurse, unwrapped_params: recurse or isinstance(module, nn.Linear))
    with pytest.raises(RuntimeError, match="Forward order differs across ranks") as info:
        model(torch.randn(2, 4))
    return str(info.value)


@pytest.mark.world_size(2)
def test_first_iteration_order_check_raises_on_every_rank(world_size):
    messages = run_ranks(order_body, world_size)
    assert all("rank 0 is all-gathering the unit with index" in m for m in messages)


# -- no_sync, clip_grad_norm_, summon_full_params ----------------------------------------


def no_sync_body(rank, world_size):
    failures = []
    steps = 2
    micro = batches("mlp", 2 * steps, seed=5)
    # Reference: each step's gradient is the sum of two global micro-batches' gradients.
    ref = make_model("mlp")
    ref_opt = make_optimizer(ref.parameters())
    for s in range(steps):
        for x, y in micro[2 * s : 2 * s + 2]:
            loss_fn("mlp", ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for strategy in (FULL, GRAD_OP, NO_SHARD, HYBRID):
        model = wrapped_mlp(sharding_strategy=strategy, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
        opt = make_optimizer(model.parameters())
        for s in range(steps):
            (x1, y1), (x2, y2) = micro[2 * s : 2 * s + 2]
            with model.no_sync():
                loss_fn("mlp", model(rank_slice(x1, rank, world_size)), rank_slice(y1, rank, world_size)).backward()
            assert all(p.grad is None for p in model.parameters()), "no_sync must not reduce"
            loss_fn("mlp", model(rank_slice(x2, rank, world_size)), rank_slice(y2, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()
        diff = max_param_diff(model, ref_params)
        if diff > TOL:
            failures.append(f"no_sync {strategy.name}: param diff {diff:.3g}")
    return failures


@pytest.mark.world_size(2)
def test_no_sync_accumulation_equals_the_big_batch(world_size):
    failures = run_ranks(no_sync_body, world_size)[0]
    assert not failures, "\n".join(failures)


def clip_body(rank, world_size):
    failures = []
    for strategy in (FULL, NO_SHARD, HYBRID):
        for norm_type in (2.0, math.inf):
            ref = make_model("mlp")
            ref_opt = make_optimizer(ref.parameters())
            model = wrapped_mlp(sharding_strategy=strategy)
            opt = make_optimizer(model.parameters())
            for x, y in batches("mlp", 2):
                loss_fn("mlp", ref(x), y).backward()
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
                ref_opt.step()
                ref_opt.zero_grad()
                loss_fn("mlp", model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
                norm = model.clip_grad_norm_(0.05, norm_type)
                opt.step()
                opt.zero_grad()
                if abs(norm.item() - ref_norm.item()) > TOL:
                    failures.append(f"clip {strategy.name} p={norm_type}: norm {norm.item()} vs {ref_norm.item()}")
            diff = max_param_diff(model, {n: p.detach() for n, p in ref.named_parameters()})
            if diff > TOL:
                failures.append(f"clip {strategy.name} p={norm_type}: param diff {diff:.3g}")
    return failures


@pytest.mark.world_size(2)
def test_clip_grad_norm_returns_the_single_process_total_norm(world_size):
    failures = run_ranks(clip_body, world_size)[0]
    assert not failures, "\n".join(failures)


def summon_body(rank, world_size):
    out = {}
    for strategy in (FULL, GRAD_OP, NO_SHARD):
        model = wrapped_mlp(sharding_strategy=strategy)
        train(model, "mlp", rank, world_size, steps=1)
        with FSDP.summon_full_params(model), torch.no_grad():  # nn.Parameters, as in PyTorch
            w = get_by_name(model, "blocks.1.0.weight")
            assert w.shape == (30, 30)
            w.fill_(0.5)
            get_by_name(model, "head.bias").fill_(-1.0)
        with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
            assert torch.all(get_by_name(model, "blocks.1.0.weight") == 0.5)
            assert torch.all(get_by_name(model, "head.bias") == -1.0)
            get_by_name(model, "head.bias").fill_(7.0)  # not written back
        with FSDP.summon_full_params(model, writeback=False):
            assert torch.all(get_by_name(model, "head.bias") == -1.0) or strategy is NO_SHARD
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
            pass
        with pytest.raises(NotImplementedError, match="writeback=True and rank0_only=True is not supported"):
            with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
                pass
        train(model, "mlp", rank, world_size, steps=1)  # still trains afterwards
        out[strategy.name] = True
    return out


@pytest.mark.world_size(2)
def test_summon_full_params_writeback(world_size):
    assert run_ranks(summon_body, world_size)[0] == {"FULL_SHARD": True, "SHARD_GRAD_OP": True, "NO_SHARD": True}


# -- frozen and ignored modules --------------------------------------------------------


def frozen_ignored_body(rank, world_size):
    failures = []
    # Frozen: block 1 is its own unit with requires_grad=False.
    ref = make_model("mlp")
    ref.blocks[1].requires_grad_(False)
    ref_opt = make_optimizer([p for p in ref.parameters() if p.requires_grad])
    for x, y in batches("mlp"):
        loss_fn("mlp", ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    for strategy in (FULL, GRAD_OP, NO_SHARD):
        raw = make_model("mlp")
        raw.blocks[1].requires_grad_(False)
        model = FSDP(raw, auto_wrap_policy=unit_policy(raw), sharding_strategy=strategy,
                     backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True, limit_all_gathers=True)
        train(model, "mlp", rank, world_size)
        diff = max_param_diff(model, ref_params)
        if diff > TOL:
            failures.append(f"frozen {strategy.name}: param diff {diff:.3g}")
        if states(model) != [ShardedState.SHARDED] * 5 and strategy is not NO_SHARD:
            failures.append(f"frozen {strategy.name}: units left unsharded after backward: {states(model)}")

    # Ignored: the head stays an ordinary parameter of every rank; the user averages it.
    ref_losses, ref_params, _ = reference_train("mlp")
    raw = make_model("mlp")
    model = FSDP(raw, auto_wrap_policy=unit_policy(raw), ignored_modules=[raw.head])
    assert isinstance(raw.head.weight, nn.Parameter) and raw.head.weight.shape == (5, 30)

    def average_head(step):
        for p in raw.head.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size

    losses = train(model, "mlp", rank, world_size, between=average_head)
    diff = max_param_diff(model, ref_params)
    if diff > TOL or max(abs(a - b) for a, b in zip(losses, ref_losses)) > TOL:
        failures.append(f"ignored head: param diff {diff:.3g}")
    return failures


@pytest.mark.world_size(2)
def test_frozen_and_ignored_modules(world_size):
    failures = run_ranks(frozen_ignored_body, world_size)[0]
    assert not failures, "\n".join(failures)


# -- errors ----------------------------------------------------------------------------


class SummonsInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.root = None

    def forward(self, x):
        with FSDP.summon_full_params(self.root):
            pass
        return self.lin(x)


def errors_body(rank, world_size):
    with pytest.raises(TypeError, match="`ignored_modules` should be an iterable of `torch.nn.Module`s"):
        FSDP(MLP(), ignored_modules=5)
    with pytest.raises(ValueError, match="ignored_modules expects nn.Module list elements"):  # as PyTorch 2.x
        FSDP(MLP(), ignored_modules=[5])
    inner = FSDP(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="should not include FSDP modules"):
        FSDP(nn.Sequential(inner, nn.Linear(3, 3)), ignored_modules=[inner])
    with pytest.raises(ValueError, match="to NOT be FullyShardedDataParallel"):
        FSDP(nn.Sequential(FSDP(nn.Linear(3, 3)), nn.Linear(3, 3)), auto_wrap_policy=unit_policy(MLP()))
    mixed = nn.Linear(3, 3)
    mixed.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="uniform requires_grad"):
        FSDP(mixed)
    with pytest.raises(ValueError, match="limiter_depth must be an int >= 1"):
        FSDP(nn.Linear(3, 3), limit_all_gathers=True, limiter_depth=0)
    with pytest.raises(ValueError, match="Expected param_init_fn to be a callable"):
        FSDP(nn.Linear(3, 3, device="meta"), param_init_fn=5)
    with pytest.raises(ValueError, match="only valid with HYBRID_SHARD"):
        FSDP(nn.Linear(3, 3), process_group=(dist.group.WORLD, dist.group.WORLD))
    with pytest.raises(ValueError, match="Expected process_group to be passed in as either None or Tuple"):
        FSDP(nn.Linear(3, 3), sharding_strategy=HYBRID, process_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="use_orig_params must be True or False"):
        FSDP(nn.Linear(3, 3), use_orig_params="yes")
    with pytest.raises(ValueError, match="device_mesh must be a torch.distributed.device_mesh.DeviceMesh"):
        FSDP(nn.Linear(3, 3), device_mesh=dist.group.WORLD)
    with pytest.raises(TypeError, match="ignored_states must be an iterable"):
        FSDP(nn.Linear(3, 3), ignored_states=5)
    halved = FSDP(nn.Linear(3, 3)).half()  # cast after wrapping: refused with the way out
    with pytest.raises(TypeError, match="cast the module before wrapping it, or use MixedPrecision"):
        halved(torch.randn(2, 3).half())
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="shared .tied. parameters must be wrapped in the same unit"):
        FSDP(tied, auto_wrap_policy=lambda module, recurse, unwrapped_params: recurse or module is tied[0])

    model = wrapped_mlp()
    train(model, "mlp", rank, world_size, steps=1)  # the first forward decides which instance is the root
    child = model.blocks[0]
    with pytest.raises(RuntimeError, match="root"):
        child.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="must be called on the root"):
        with child.no_sync():
            pass
    inner = SummonsInForward()
    root = FSDP(inner)
    inner.root = root
    with pytest.raises(AssertionError, match="Cannot manually unshard parameters during forward/backward"):  # 2.x
        root(torch.randn(2, 4))
    return True


@pytest.mark.world_size(2)
def test_documented_errors(world_size):
    assert run_ranks(errors_body, world_size) == [True, True]


def meta_body(rank, world_size):
    torch.manual_seed(rank)  # different initial values per rank: sync_module_states must fix them
    with torch.device("meta"):
        raw = MLP()
    model = FSDP(raw, auto_wrap_policy=unit_policy(raw), sync_module_states=True)
    assert not any(p.is_meta for p in model.parameters())
    with FSDP.summon_full_params(model, writeback=False):
        w = get_by_name(model, "blocks.0.0.weight").clone()
        # reset_parameters' values (|w| <= 1/sqrt(fan_in)) in every unit: the root's
        # materialization must not overwrite the shards nested units already hold
        bounded = all(get_by_name(model, f"blocks.{i}.0.weight").abs().max() <= 30**-0.5 for i in range(4))
    everyone = [torch.empty_like(w) for _ in range(world_size)]
    dist.all_gather(everyone, w)
    return bounded and all(torch.equal(everyone[0], e) for e in everyone)


@pytest.mark.world_size(2)
def test_meta_init_and_sync_module_states(world_size):
    assert run_ranks(meta_body, world_size) == [True, True]


# -- HYBRID_SHARD from an explicit pair of groups ----------------------------------------


def hybrid_pair_body(rank, world_size):
    # 2 x 2: shard within {0,1} and {2,3}, replicate across {0,2} and {1,3}.
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair = (shards[rank // 2], replicas[rank % 2])
    ref_losses, ref_params, _ = reference_train("mlp")
    raw = make_model("mlp")
    model = FSDP(raw, auto_wrap_policy=unit_policy(raw), sharding_strategy=HYBRID, process_group=pair,
                 backward_prefetch=BackwardPrefetch.BACKWARD_POST, forward_prefetch=True)
    losses = train(model, "mlp", rank, world_size)
    shard_numel = model.flat_param.numel()
    return max(abs(a - b) for a, b in zip(losses, ref_losses)), max_param_diff(model, ref_params), shard_numel


@pytest.mark.world_size(4)
def test_hybrid_shard_from_a_pair_of_groups(world_size):
    results = run_ranks(hybrid_pair_body, world_size)
    for loss_diff, param_diff, shard_numel in results:
        assert loss_diff <= TOL and param_diff <= TOL
        assert shard_numel == (30 * 5 + 5 + 1) // 2  # the head's 155 parameters over 2 ranks, padded


# -- mixed-precision buffers and keep_low_precision_grads --------------------------------


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x):
        return self.lin(x) * self.scale


def mp_buffers_body(rank, world_size):
    from impl.fsdp import MixedPrecision

    mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16, keep_low_precision_grads=True)
    torch.manual_seed(0)
    raw = WithBuffer()
    model = FSDP(raw, mixed_precision=mp)
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16 and raw.scale.dtype == torch.bfloat16
    out.float().sum().backward()
    grad = model.flat_param.grad
    # Stored in the parameter's dtype, with values representable in bf16.
    assert grad.dtype == torch.bfloat16  # PyTorch 2.x: the .grad itself is low precision
    sd = model.state_dict()
    assert sd["scale"].dtype == torch.float32 and sd["lin.weight"].dtype == torch.float32
    return True


@pytest.mark.world_size(2)
def test_mixed_precision_buffers_and_low_precision_grads(world_size):
    assert run_ranks(mp_buffers_body, world_size) == [True, True]


# -- profiler labels ----------------------------------------------------------------------


def labels_body(rank, world_size):
    from torch.profiler import ProfilerActivity, profile

    model = wrapped_mlp(backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True,
                        limit_all_gathers=True, limiter_depth=1)
    train(model, "mlp", rank, world_size, steps=1)
    emulation.install(Link(1.0, 500))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train(model, "mlp", rank, world_size, steps=1)
    finally:
        emulation.uninstall()
    return sorted({e.name for e in prof.events() if e.name.startswith("impl::")})


@pytest.mark.world_size(2)
def test_collectives_waits_and_stalls_are_labelled(world_size):
    names = run_ranks(labels_body, world_size)[0]
    for label in ("impl::all_gather", "impl::wait_all_gather", "impl::reduce_scatter", "impl::wait_reduce_scatter",
                  "impl::rate_limiter_wait", "impl::fsdp::pre_forward", "impl::fsdp::post_backward",
                  "impl::fsdp::end_of_backward"):
        assert label in names, (label, names)


# -- a unit with a parameter that gets no gradient -----------------------------------------


def unused_param_body(rank, world_size):
    def build():
        model = make_model("mlp")
        model.blocks[1].append(nn.Linear(30, 30))  # registered in block 1's unit, never called
        model.blocks[1].forward = lambda x, seq=model.blocks[1]: seq[1](seq[0](x))
        return model

    ref = build()
    ref_opt = make_optimizer(ref.parameters())
    for x, y in batches("mlp"):
        loss_fn("mlp", ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    raw = build()
    model = FSDP(raw, auto_wrap_policy=unit_policy(raw), backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    train(model, "mlp", rank, world_size)
    assert states(model) == [ShardedState.SHARDED] * 5  # the incomplete unit was reduced and freed too
    return max_param_diff(model, {n: p.detach() for n, p in ref.named_parameters()})


@pytest.mark.world_size(2)
def test_unit_with_a_parameter_that_gets_no_gradient(world_size):
    assert max(run_ranks(unused_param_body, world_size)) <= TOL


# -- the auto-wrap policies ------------------------------------------------------------------


def policies_body(rank, world_size):
    import functools

    from impl.fsdp import always_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

    ref_losses, ref_params, _ = reference_train("ordered")
    block_numel = sum(p.numel() for p in make_model("ordered").blocks[0].parameters())
    mlp_numel = sum(p.numel() for p in make_model("ordered").blocks[0].mlp.parameters())
    policies = {
        # one unit per Block, the root takes the embedding, norm and head
        "transformer": (functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}), 4),
        # a threshold of one Block: only whole Blocks reach it (their children are smaller)
        "size": (functools.partial(size_based_auto_wrap_policy, min_num_params=block_numel), 4),
        # half a Block: each Block's MLP reaches it, then the rest of its Block does not,
        # but the root's leftovers are wrapped by the constructor anyway
        "size_half": (functools.partial(size_based_auto_wrap_policy, min_num_params=mlp_numel), 4),
    }
    out = {}
    for name, (policy, expected_units) in policies.items():
        model = FSDP(make_model("ordered"), auto_wrap_policy=policy, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
        units = len([m for m in model.fsdp_instances() if m._unit is not None])
        losses = train(model, "ordered", rank, world_size)
        out[name] = (units, expected_units, max(abs(a - b) for a, b in zip(losses, ref_losses)),
                     max_param_diff(model, ref_params))
    # always: every module with parameters left over becomes a unit. On the MLP that is
    # each Linear (the Sequentials and the root are left with nothing).
    ref_losses, ref_params, _ = reference_train("mlp")
    model = FSDP(make_model("mlp"), auto_wrap_policy=always_wrap_policy)
    units = len([m for m in model.fsdp_instances() if m._unit is not None])
    losses = train(model, "mlp", rank, world_size)
    out["always"] = (units, 5, max(abs(a - b) for a, b in zip(losses, ref_losses)), max_param_diff(model, ref_params))
    # On the ordered model it would split the tied embedding and head: refused.
    with pytest.raises(ValueError, match="shared .tied. parameters must be wrapped in the same unit"):
        FSDP(make_model("ordered"), auto_wrap_policy=always_wrap_policy)
    return out


@pytest.mark.world_size(2)
def test_auto_wrap_policies(world_size):
    for name, (units, expected, loss_diff, param_diff) in run_ranks(policies_body, world_size)[0].items():
        assert expected is None or units == expected, (name, units)
        assert loss_diff <= TOL and param_diff <= TOL, name
