"""The DeepSpeed engines on real gloo ranks: losses against single-process training,
where each of DeepSpeed's tensors lands in the memory categories, how its knobs change
communication, and that the harness's interception of collectives sees DeepSpeed's.

Skipped without the optional extra (``pip install -e '.[deepspeed]'``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zerobench.engines import get_engine
from zerobench.engines.base import OptimizerSpec, RankContext
from zerobench.engines.deepspeed import deepspeed_unavailable
from zerobench.harness.testing import run_ranks
from zerobench.instruments.memory import StorageTracker

if deepspeed_unavailable():
    pytest.skip(deepspeed_unavailable(), allow_module_level=True)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402,F401  (imported once here: the forked ranks inherit it)

SPEC = OptimizerSpec("adam", lr=1e-2, hyper={})
STAGES = ("deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")
GLOBAL_BATCH = 16
STEPS = 3
#: small buckets and no persistent parameters, so that buckets and partitions show on this model
SMALL = {"reduce_bucket_size": 4000, "stage3_param_persistence_threshold": 0}


class Net(nn.Module):
    """Three layers of uneven sizes: partitions split parameters at rank boundaries."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 96), nn.Linear(96, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


NUMEL = sum(p.numel() for p in Net().parameters())  # 9896
LARGEST = max(p.numel() for p in Net().parameters())


def overlapping_numel(rank: int, world_size: int) -> int:
    """Elements of the parameters that overlap ``rank``'s partition of the flat parameters
    (DeepSpeed 0.19.8 stages 1-2 size their gradient buffer ``grads_in_partition`` to
    these whole parameters, not to the partition)."""
    partition = -(-NUMEL // (2 * world_size)) * 2  # the flat group padded to 2 * world_size
    lo, hi = rank * partition, (rank + 1) * partition
    out, start = 0, 0
    for p in Net().parameters():
        if start < hi and start + p.numel() > lo:
            out += p.numel()
        start += p.numel()
    return out


def batch(step: int):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 32, generator=gen), torch.randn(GLOBAL_BATCH, 8, generator=gen)


def reference_losses() -> list[float]:
    torch.manual_seed(0)
    model = Net()
    opt = SPEC.build(model.parameters())
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def build(name: str, options: dict, rank: int, world_size: int, dtype: str = "fp32"):
    cls = get_engine(name)
    opts = {k: axis.default for k, axis in cls.options.items()}
    opts.update({k: v for k, v in options.items() if k in cls.options})
    torch.manual_seed(0)
    model = Net()
    engine = cls(opts, RankContext(rank, world_size, rank, torch.device("cpu"), "gloo"), dtype)
    engine.wrap(model, [model.a, model.b, model.c])
    engine.build_optimizer(SPEC)
    return engine


def step(engine, s: int, rank: int, world_size: int) -> float:
    x, y = batch(s)
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    return float(engine.train_step(x[rows], y[rows], F.mse_loss))


def measured(name: str, options: dict, rank: int, world_size: int) -> dict:
    """Two steps, then one under the storage tracker as the memory pass runs it: the
    largest bytes of each category over that step, the bytes of each after it, and the
    communication the tracker counted."""
    tracker = StorageTracker("cpu")
    with tracker:
        engine = build(name, options, rank, world_size)
        for s in range(2):
            step(engine, s, rank, world_size)

        def on_phase(phase):
            tracker.set_phase(phase)
            if phase == "optimizer":
                tracker.note_roles("grads", engine.gradient_tensors())

        engine.on_phase = on_phase
        tracker.reset_peak()
        step(engine, 2, rank, world_size)
        tracker.set_phase("after")
        tracker.classify(params=engine.parameter_tensors(), optim=engine.optimizer_state_tensors())
    timeline = tracker.timeline()
    categories = ["params", "grads", "optim", "unsharded", "activations", "other"]
    return {"max": {c: int(timeline[c].max()) for c in categories},
            "after": {c: int(timeline[c].iloc[-1]) for c in categories},
            "bytes": dict(tracker.comm.bytes), "calls": dict(tracker.comm.calls)}


# -- losses and memory categories ----------------------------------------------------------


def _stages_world(rank, world_size):
    out = {}
    for name in STAGES:
        engine = build(name, SMALL, rank, world_size)
        losses = [step(engine, s, rank, world_size) for s in range(STEPS)]
        out[name] = {"losses": losses, "memory": measured(name, SMALL, rank, world_size)}
    return out


@pytest.mark.slow
@pytest.mark.world_size(2, 4)
def test_each_stage_matches_single_process_training_and_shards_as_its_stage_says(world_size):
    ranks = run_ranks(_stages_world, world_size, timeout=600)
    reference = reference_losses()
    fp32, partition = 4 * NUMEL, 4 * NUMEL / world_size
    slack = 4 * 64 * world_size  # DeepSpeed pads each partition for alignment
    for name in STAGES:
        means = [sum(r[name]["losses"][s] for r in ranks) / world_size for s in range(STEPS)]
        assert max(abs(m - ref) for m, ref in zip(means, reference)) < 1e-5, (name, means, reference)
        for rank, r in enumerate(ranks):
            mem = r[name]["memory"]
            # the fp32 master partition and Adam's two moments: optimizer state, 3x the partition
            assert 3 * partition <= mem["after"]["optim"] <= 3 * (partition + slack), (name, mem)
            # the reduced gradients as the optimizer phase starts: stage 3 keeps its partition;
            # stages 1 and 2 (the same code on 0.19.8) a buffer of the whole parameters that
            # overlap the partition, up to one parameter more at either end
            grads = mem["max"]["grads"]
            if name == "deepspeed-zero3":
                assert partition <= grads <= partition + slack, (name, mem)
            else:
                assert partition <= grads <= 4 * overlapping_numel(rank, world_size) < fp32, (name, rank, mem)
            # the gradient bucket is a communication buffer: "other", allocated whole
            assert mem["max"]["other"] >= 4 * SMALL["reduce_bucket_size"], (name, mem)
            if name == "deepspeed-zero3":
                assert partition <= mem["after"]["params"] <= partition + slack, (name, mem)
                # gathered parameters (the all-gather buffer and the copies made from it) are
                # unsharded, none of them activations (a batch of 8 x 96 fp32 at most here)
                assert mem["max"]["unsharded"] >= fp32, (name, mem)
                assert mem["max"]["activations"] < 0.2 * fp32, (name, mem)
            else:
                assert mem["after"]["params"] == fp32, (name, mem)  # stages 1-2 keep every parameter
                assert mem["max"]["unsharded"] == 0, (name, mem)


# -- knobs and communication ---------------------------------------------------------------

KNOB_CASES = {
    "z2-big": ("deepspeed-zero2", {"reduce_bucket_size": 100_000}),
    "z2-small": ("deepspeed-zero2", {"reduce_bucket_size": 2_000}),
    "z2-overlap": ("deepspeed-zero2", {"reduce_bucket_size": 100_000, "overlap_comm": True}),
    "z2-not-contiguous": ("deepspeed-zero2", {"reduce_bucket_size": 100_000, "contiguous_gradients": False}),
    "z3": ("deepspeed-zero3", {**SMALL, "reduce_bucket_size": 100_000}),
    "z3-small": ("deepspeed-zero3", {**SMALL, "reduce_bucket_size": 2_000}),
    "z3-no-prefetch": ("deepspeed-zero3", {**SMALL, "reduce_bucket_size": 100_000, "stage3_prefetch_bucket_size": 0}),
    "z3-release": ("deepspeed-zero3", {**SMALL, "reduce_bucket_size": 100_000, "stage3_max_live_parameters": 0,
                                       "stage3_max_reuse_distance": 0}),
    "z3-persistent": ("deepspeed-zero3", {**SMALL, "reduce_bucket_size": 100_000,
                                          "stage3_param_persistence_threshold": LARGEST}),
}


def _knobs_world(rank, world_size):
    return {case: measured(name, options, rank, world_size) for case, (name, options) in KNOB_CASES.items()}


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_knobs_change_communication_and_memory_as_deepspeed_documents(world_size):
    m = run_ranks(_knobs_world, world_size, timeout=600)[0]
    fp32 = 4 * NUMEL
    # reduce_bucket_size: gradients are reduced a bucket at a time, so smaller buckets make
    # more calls for the same bytes. Stages 1-2 all-reduce each bucket (and each rank keeps
    # its part); stage 3 reduce-scatters it.
    assert m["z2-small"]["calls"]["all_reduce"] > m["z2-big"]["calls"]["all_reduce"]
    assert m["z2-small"]["bytes"]["all_reduce"] == m["z2-big"]["bytes"]["all_reduce"] >= fp32
    assert "reduce_scatter" not in m["z2-big"]["bytes"]
    assert m["z3-small"]["calls"]["reduce_scatter"] > m["z3"]["calls"]["reduce_scatter"]
    assert m["z3-small"]["bytes"]["reduce_scatter"] == m["z3"]["bytes"]["reduce_scatter"] >= fp32
    # overlap_comm (stages 1-2) double-buffers the bucket, even where no side stream is made
    extra = m["z2-overlap"]["max"]["other"] - m["z2-big"]["max"]["other"]
    assert extra >= 4 * 100_000, (m["z2-overlap"]["max"], m["z2-big"]["max"])
    # contiguous_gradients: without it there is no bucket buffer to copy gradients into
    assert m["z2-not-contiguous"]["max"]["other"] < 4 * 100_000 <= m["z2-big"]["max"]["other"]
    # stage3_prefetch_bucket_size: prefetching coalesces the next modules' parameters into
    # one all-gather; without it each module's parameters are gathered on their own
    assert m["z3-no-prefetch"]["calls"]["all_gather"] > m["z3"]["calls"]["all_gather"]
    assert m["z3-no-prefetch"]["bytes"]["all_gather"] == m["z3"]["bytes"]["all_gather"]
    # stage3_max_live_parameters and stage3_max_reuse_distance at 0: parameters are released
    # after forward and gathered again for backward (twice the bytes), and fewer are live at once
    assert m["z3-release"]["bytes"]["all_gather"] >= 2 * m["z3"]["bytes"]["all_gather"] - 4 * 64
    assert m["z3-release"]["max"]["unsharded"] < m["z3"]["max"]["unsharded"]
    # stage3_param_persistence_threshold: parameters up to it are never sharded: every rank
    # holds them whole (beside the partition the optimizer steps), and forward gathers nothing
    assert m["z3-persistent"]["after"]["params"] >= fp32 > m["z3"]["after"]["params"]


# -- the harness's interception --------------------------------------------------------------


class C10dCalls(TorchDispatchMode):
    """Counts the c10d collectives dispatched (whoever issued them, however): what the
    interception must see all of."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) == "c10d" and "barrier" not in func.__name__:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _intercepted_world(rank, world_size):
    from zerobench.instruments.collectives import CommCounter, intercepted

    out = {}
    for name in STAGES:
        engine = build(name, SMALL, rank, world_size)
        step(engine, 0, rank, world_size)
        # installed after DeepSpeed started: it must still see every collective
        dispatched = C10dCalls()
        with intercepted(CommCounter()) as counter, dispatched:
            step(engine, 1, rank, world_size)
        out[name] = {"bytes": dict(counter.bytes), "calls": sum(counter.calls.values()), "c10d": dispatched.calls}
    return out


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_the_interception_sees_deepspeeds_collectives(world_size):
    out = run_ranks(_intercepted_world, world_size, timeout=600)[0]
    fp32, slack = 4 * NUMEL, 4 * 64 * world_size
    expected = {  # the bytes of one step, per kind (nccl-tests sizes: all-gather output, reduce-scatter input)
        "deepspeed-zero1": {"all_reduce": fp32, "all_gather": fp32},
        "deepspeed-zero2": {"all_reduce": fp32, "all_gather": fp32},
        "deepspeed-zero3": {"all_gather": fp32, "reduce_scatter": fp32},
    }
    for name, kinds in expected.items():
        seen = out[name]["bytes"]
        for kind, nbytes in kinds.items():
            # (+ 16: a gradient norm's all-reduce, an overflow flag)
            assert nbytes <= seen.get(kind, 0) <= nbytes + slack + 16, (name, kind, seen)
        # nothing reached c10d past the interception
        assert out[name]["calls"] == out[name]["c10d"] > 0, (name, out[name])
