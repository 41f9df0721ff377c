"""Regenerate the small real gloo traces that tests/test_profiling_real.py analyses.

    .venv/bin/python tests/data/make_traces.py

Two gloo ranks (``zerobench.harness.testing.run_ranks``, forked, one compute thread each) on
this repository's CPU machine, torch 2.13.0+cpu. Each traced run does one warm-up
step outside the profiler, then ``STEPS`` steps under
``torch.profiler.profile(activities=[CPU], record_shapes=True)``, each step labelled
``zerobench::step`` with ``zerobench::forward / backward / optimizer`` phases as the
harness labels them, and writes ``<name>.rank<r>.json.gz``:

* ``fsdp2``  -- torch FSDP2 (``fully_shard`` on each of ``BLOCKS`` blocks, then the
  root): per step, one all-gather per block in forward and again in backward, one
  reduce-scatter per block.
* ``ddp``    -- DistributedDataParallel over the same model: one gradient bucket,
  so one all-reduce per step.
* ``impl``   -- a hand-rolled ZeRO-3 layer loop written with ``impl.comm`` (labelled
  ``impl::all_gather`` / ``impl::wait_all_gather`` / ``impl::reduce_scatter`` ...):
  all-gathers prefetched ``PREFETCH`` layers ahead, so at most ``PREFETCH`` are in
  flight, and compute runs while they do.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from impl import comm  # noqa: E402
from zerobench.harness.testing import run_ranks  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCKS = 3
DIM = 64
BATCH = 8
STEPS = 2
PREFETCH = 2
IMPL_LAYERS = 4
IMPL_DIM = 192
IMPL_ROWS = 2048


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.l1, self.l2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(x)))


def _torch_engine(rank, world_size, kind, out_dir):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(DIM) for _ in range(BLOCKS)])
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(BATCH, DIM)

    def step():
        with record_function("zerobench::step"):
            with record_function("zerobench::forward"):
                loss = model(x).square().mean()
            with record_function("zerobench::backward"):
                loss.backward()
            with record_function("zerobench::optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

    _profiled(step, kind, rank, out_dir)


def _impl_engine(rank, world_size, out_dir):
    """ZeRO-3 by hand: each layer's weight is a 1-D shard; forward all-gathers it
    PREFETCH layers ahead; backward (by autograd, on the gathered weights) is followed
    by one async reduce-scatter per layer, all waited before the optimizer."""
    torch.manual_seed(0)
    numel = IMPL_DIM * IMPL_DIM
    shards = [torch.randn(numel // world_size) * 0.05 for _ in range(IMPL_LAYERS)]
    x = torch.randn(IMPL_ROWS, IMPL_DIM)

    def issue(i):
        out = torch.empty(numel)
        with record_function("impl::rate_limiter_wait"):
            pass  # the limit is PREFETCH by construction; the label marks where a limiter would block
        return out, comm.all_gather(out, shards[i])

    def step():
        with record_function("zerobench::step"):
            with record_function("zerobench::forward"):
                pending = {i: issue(i) for i in range(min(PREFETCH, IMPL_LAYERS))}
                weights, h = [], x
                for i in range(IMPL_LAYERS):
                    full, handle = pending.pop(i)
                    handle.wait()
                    if i + PREFETCH < IMPL_LAYERS:
                        pending[i + PREFETCH] = issue(i + PREFETCH)
                    w = full.view(IMPL_DIM, IMPL_DIM).requires_grad_()
                    weights.append(w)
                    h = torch.tanh(F.linear(h, w))
                loss = h.square().mean()
            with record_function("zerobench::backward"):
                loss.backward()
                grads, handles = [], []
                for w in reversed(weights):
                    g = torch.empty(numel // world_size)
                    handles.append(comm.reduce_scatter(g, w.grad.reshape(-1)))
                    grads.append(g)
                for h_ in handles:
                    h_.wait()
            with record_function("zerobench::optimizer"):
                for s, g in zip(shards, reversed(grads)):
                    s.add_(g, alpha=-0.01)

    _profiled(step, "impl", rank, out_dir)


def _profiled(step, name, rank, out_dir):
    step()  # warm-up, unprofiled: the first collectives also wait for the slower rank to start
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            step()
    path = os.path.join(out_dir, f"{name}.rank{rank}.json")
    prof.export_chrome_trace(path)
    import gzip
    import shutil

    with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)


def fsdp2(rank, world_size, out_dir):
    _torch_engine(rank, world_size, "fsdp2", out_dir)


def ddp(rank, world_size, out_dir):
    _torch_engine(rank, world_size, "ddp", out_dir)


def impl(rank, world_size, out_dir):
    _impl_engine(rank, world_size, out_dir)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else HERE
    for fn in (fsdp2, ddp, impl):
        run_ranks(fn, world_size=2, args=(out,))
    for f in sorted(os.listdir(out)):
        if f.endswith(".json.gz"):
            print(f, os.path.getsize(os.path.join(out, f)))
