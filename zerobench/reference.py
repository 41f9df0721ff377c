"""The single-process reference a data-parallel cell's losses are checked against."""

from __future__ import annotations

from zerobench import data as data_mod
from zerobench.engines import OptimizerSpec
from zerobench.models import build_model, loss_fn
from zerobench.workload import Workload


def reference_losses(workload: Workload, world_size: int) -> list[float]:
    """Losses of plain single-process fp32 training on the global batch, every step
    (warm-up included): what a correct data-parallel engine must reproduce."""
    d = workload.data
    model = build_model(workload.model, workload.seed)
    o = workload.optimizer
    opt = OptimizerSpec(o.kind, o.lr, o.hyper()).build(model.parameters())
    loss_of = loss_fn(workload.model)
    losses = []
    for step in range(d.warmup_steps + d.steps):
        inputs, targets = data_mod.global_batch(workload.model, d.batch_size * world_size, d.seed, step)
        loss = loss_of(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def loss_deviation(record: dict, reference: list[float], warmup: int) -> float | None:
    """max over measured steps of |mean over ranks of the rank losses - reference|."""
    ranks = record.get("ranks") or []
    if not ranks or not reference:
        return None
    steps = len(ranks[0]["losses"])
    means = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(steps)]
    return max(abs(m - reference[warmup + i]) for i, m in enumerate(means))
