"""The single-process reference a data-parallel cell's losses are checked against."""

from __future__ import annotations

import time

from zerobench.spec import data as data_mod
from zerobench.engines import OptimizerSpec
from zerobench.spec.models import build_model, loss_fn
from zerobench.spec.workload import Workload


class ReferenceFailed(RuntimeError):
    """The reference could not be computed (too slow for run.timeout_s, or it failed)."""


def reference_losses(workload: Workload, world_size: int, timeout_s: float | None = None) -> list[float]:
    """Losses of plain single-process fp32 training on the global batch, every step
    (warm-up included): what a correct data-parallel engine must reproduce.

    It runs in the harness's own process, so it is bounded like a cell: past
    ``timeout_s`` (checked between steps) it raises ReferenceFailed, as it does for any
    failure of the training itself."""
    try:
        return _train(workload, world_size, None if timeout_s is None else time.monotonic() + timeout_s, timeout_s)
    except ReferenceFailed:
        raise
    except (RuntimeError, MemoryError, ValueError) as err:  # e.g. "can't allocate memory"
        raise ReferenceFailed(f"the single-process loss reference at world size {world_size} failed: "
                             f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err


def _train(workload: Workload, world_size: int, deadline: float | None, timeout_s: float | None) -> list[float]:
    d = workload.data
    model = build_model(workload.model, workload.seed)
    o = workload.optimizer
    opt = OptimizerSpec(o.kind, o.lr, o.hyper(), o.no_decay).build_for(model)
    loss_of = loss_fn(workload.model)
    losses = []
    for step in range(d.warmup_steps + d.steps):
        if deadline is not None and time.monotonic() > deadline:
            raise ReferenceFailed(f"the single-process loss reference at world size {world_size} did not finish "
                                 f"within {timeout_s:.0f} s (run.timeout_s): {step} of {d.warmup_steps + d.steps} "
                                 "steps done")
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
