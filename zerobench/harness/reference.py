"""The single-process reference a data-parallel cell's losses are checked against, and
``zerobench reference RUN``: the explicit step that computes it for cells run under
torchrun ([Note: readers have no side effects] in zerobench/runs/folder.py)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from zerobench.engines.base import OptimizerSpec
from zerobench.spec import data as data_mod
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
    spec = OptimizerSpec.of(o)
    opt = spec.build_for(model)
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
        if spec.max_grad_norm:  # as every engine clips ([Note: clipping as each engine does])
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
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


def complete_run(run_dir: str | Path, log=print) -> list[str]:
    """Compute the single-process loss reference of every ok cell of a run folder that
    lacks one (cells run under torchrun), record each cell's deviation from it, and
    write the tables. This trains the workload's model, importing any factory its
    ``workload.json`` names: run it on folders you trust. Returns the cells updated."""
    from zerobench.harness.preflight import reference_refusal
    from zerobench.runs.folder import RunFolder

    folder = RunFolder(run_dir)
    records = [r for r in folder.cell_records() if r["cell_id"] in set(folder.missing_references())]
    workload = folder.workload() if records else None
    if workload is not None and workload.run.reference:
        references, failures = folder.references(), {}
        for world_size in sorted({r["config"]["world_size"] for r in records} - set(references)):
            log(f"reference: world size {world_size} ...")
            try:
                refused = reference_refusal(workload, world_size)
                if refused:
                    raise ReferenceFailed(refused)
                references[world_size] = reference_losses(workload, world_size, workload.run.timeout_s)
            except ReferenceFailed as err:  # the cells stand; their deviation stays unknown, saying why
                failures[world_size] = str(err)
                continue
            folder.write_references(references)
        for rec in records:
            world_size = rec["config"]["world_size"]
            rec["loss_max_abs_diff_ref"] = loss_deviation(rec, references.get(world_size, []),
                                                          workload.data.warmup_steps)
            if world_size in failures:
                rec["reference_error"] = failures[world_size]
            folder.write_cell(rec)
    else:
        records = []
    if folder.has_cells():
        folder.write_tables()
    return [r["cell_id"] for r in records]
