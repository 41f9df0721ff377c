"""``zerobench estimate``: per-rank peak memory of every engine cell at any world size.

For each engine configuration of a workload (its matrix without the world_size axis)
and each requested world size, one rank of the real engine runs a warm-up and one
measured step in one process against a fake process group of that world size, under
the same storage tracker as the harness's memory pass (zerobench/instruments/memory.py). Results
go to a folder like a run's: ``estimate.csv`` (one row per cell and world size, with
the peak, its composition, the measured model states and the analytic model states
beside them), ``workload.json`` and ``plots/estimate_peak.png``. See docs/estimate.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from zerobench.whatif.cells import (
    configurations_to_run,
    new_results_folder,
    versions,
    why_not,
)
from zerobench.whatif.estimate.request import EstimateRequest

#: model states above this (bytes, fp32 + Adam, unsharded) switch --fake-tensors on by default
FAKE_TENSORS_ABOVE = 4 * 2**30
DEFAULT_WORLD_SIZES = (8, 64, 1024)


def check_against(run):
    """The results table of the run ``--against`` names, read before any estimating;
    ValueError naming the option when it is not a run folder with the memory pass."""
    from zerobench.runs.tables import load

    run = Path(run)
    if not run.is_dir():
        raise ValueError(f"--against: {run} is not a folder (allowed: a run folder, results/<run-id>)")
    try:
        results = load(run)
    except FileNotFoundError as err:
        raise ValueError(f"--against: {err}") from None
    if "peak_mem_bytes" not in results.columns or results["peak_mem_bytes"].isna().all():
        raise ValueError(f"--against: {run} has no peak_mem_bytes (allowed: a run with the memory pass, "
                         f"run.memory_pass = true)")
    return results


def _psi(workload) -> int:
    import torch

    from zerobench.spec.models import construct

    with torch.device("meta"):
        model = construct(workload.model)
    return sum(p.numel() for p in model.parameters())


def estimate(request: EstimateRequest, *, log=print, progress=None) -> Path:
    """Estimate every configuration of the request's workload at its world sizes (every
    option: :class:`EstimateRequest`); returns the folder. Every option is checked before
    the folder is made. ``log``: each line to say; ``progress``: told each configuration
    as it finishes (zerobench.commands.progress.Progress)."""
    import pandas as pd

    from zerobench.runs.whatif import EstimateFolder
    from zerobench.whatif.estimate.plots import estimate_setting, plot_estimate

    r = request
    w, preset = _load(r)
    psi = _psi(w)
    fake_tensors = psi * 16 > FAKE_TENSORS_ABOVE if r.fake_tensors is None else r.fake_tensors
    cells = configurations_to_run(w, r.workload, r.only, list(r.world_sizes), "estimate", log)
    folder = EstimateFolder(new_results_folder(r.results_root, w, "estimate"))
    plans, jobs = _plan(w, cells, r, fake_tensors)
    ran = _run_jobs(w, jobs, r.rank, fake_tensors, r.hybrid_shard_size, r.backend, log, progress)
    found = {(job.label, job.world_size, job.layers): row for job, row in zip(jobs, ran)}
    rows = [row for cell in cells
            for row in _rows(w, cell, _results(w, cell, r, plans, found), r, psi, fake_tensors, preset)]
    frame = pd.DataFrame(rows)
    folder.write_table(frame)
    plot_estimate(frame, folder.plots_dir / "estimate_peak.png", estimate_setting(frame, w.name))
    return folder.root


def _load(r: EstimateRequest):
    """(the workload, its user code run once; the GPU preset or None), the backend and
    the preset checked by name."""
    from zerobench.rank.worlds import BACKENDS
    from zerobench.spec.user_check import check_user_model
    from zerobench.spec.workload import load_workload

    w = load_workload(r.workload, r.overrides)
    # the user's code fails here, not in a rank
    check_user_model(w.model, w.data.batch_size, w.data.seed, label=w.label)
    if r.backend not in BACKENDS:
        raise ValueError(f"--backend: {r.backend!r} is not allowed (allowed: {', '.join(BACKENDS)})")
    if r.gpu is None:
        return w, None
    from zerobench.instruments.vgpu.presets import gpu_preset

    try:
        return w, gpu_preset(r.gpu)
    except ValueError as err:
        raise ValueError(f"--gpu: {err}") from None


def _plan(w, cells, r: EstimateRequest, fake_tensors: bool) -> tuple[dict, list]:
    """(plans, jobs): every cell (and depth) to run, in one process ([Note: one process
    for many cells]). ``plans`` holds each configuration's shallow depths (None: its own
    depth) and each (configuration, world size) that cannot run, with why."""
    from zerobench.whatif.estimate import depth
    from zerobench.whatif.jobs import Job

    plans, jobs = {}, []
    for cell in cells:
        shallow = None if (r.full_depth or not fake_tensors) else depth.depths(w, cell.opts)
        for ws in r.world_sizes:
            why = why_not(cell, ws, r.hybrid_shard_size)
            if why:
                plans[(cell.config_id, ws)] = {"status": "skipped", "reason": why}
                continue
            for layers in (shallow or (None,)):
                jobs.append(Job(cell.engine, cell.dtype, cell.options, ws, layers, label=cell.config_id))
        plans[cell.config_id] = shallow
    return plans, jobs


def _results(w, cell, r: EstimateRequest, plans: dict, found: dict) -> dict:
    """world size -> the estimating process's row for one configuration: its own, or
    extrapolated from two shallow depths, or why there is none."""
    cid, shallow = cell.config_id, plans[cell.config_id]
    results = {}
    for ws in r.world_sizes:
        if (cid, ws) in plans:
            results[ws] = plans[(cid, ws)]
        elif shallow is None:
            results[ws] = found.get((cid, ws, None))
        else:
            results[ws] = _extrapolated(w, cell, ws, r.rank, shallow, found.get((cid, ws, shallow[0])),
                                        found.get((cid, ws, shallow[1])))
    return results


def _rows(w, cell, results: dict, r: EstimateRequest, psi: float, fake_tensors: bool, preset) -> list[dict]:
    """estimate.csv's rows of one configuration: each world size's result beside the ZeRO
    paper's model states of it (analytic, and in the paper's mixed precision)."""
    from dataclasses import replace

    from zerobench.engines.stages import (
        engine_model_state_bytes,
        engine_stage,
        keeps_master_copy,
        paper_bytes_from_counts,
    )

    opt = w.optimizer.kind
    if opt == "sgd" and w.optimizer.hyper().get("momentum"):
        opt = "sgd-momentum"
    kind = opt if opt in ("adam", "adamw", "sgd", "sgd-momentum") else "adam"
    rows = []
    for ws in r.world_sizes:
        res = results.get(ws) or {"status": "skipped", "reason": "no result from the estimating process"}
        opts, group = cell.opts, r.hybrid_shard_size or replace(cell, world_size=ws).shard_group_size
        stage, shard = engine_stage(cell.engine, opts, ws, group)
        analytic = engine_model_state_bytes(cell.engine, opts, ws, psi, kind, shard_group_size=group)
        paper = engine_model_state_bytes(cell.engine, opts, ws, psi, kind, precision="mixed", shard_group_size=group)
        if res.get("status") == "ok":
            res = {**res, "paper_model_states_bytes": paper_bytes_from_counts(
                res["state_params_numel"], res["state_grads_numel"], res["state_optim_numel"], kind,
                master_copy=keeps_master_copy(cell.engine))}
        rows.append({
            "config": cell.config_id, "engine": cell.engine, "dtype": cell.dtype, "world_size": ws,
            "rank": r.rank, "fake_tensors": fake_tensors, "backend": r.backend, "params_total": psi, **versions(),
            "zero_stage": stage, "shard_ranks": shard,
            "analytic_params_bytes": analytic["params"], "analytic_grads_bytes": analytic["grads"],
            "analytic_optim_bytes": analytic["optim"], "analytic_model_states_bytes": analytic["total"],
            "paper_analytic_model_states_bytes": paper["total"],
            **{k: v for k, v in cell.opts.items()}, **res, **_capacity(preset, ws),
        })
    return rows


def _capacity(preset, world_size: int) -> dict:
    """What the caching allocator may reserve on ``preset`` at this world size: the card
    less the CUDA context and, with other ranks, one NCCL communicator (allocator.py)."""
    if preset is None:
        return {}
    outside = preset.context_bytes + (preset.nccl_bytes_per_group if world_size > 1 else 0)
    return {"gpu": preset.name, "capacity_bytes": preset.memory_bytes - outside}


def _extrapolated(w, cell, ws, rank, shallow, a: dict | None, b: dict | None) -> dict:
    """The row at the workload's depth from the rows at depths ``shallow`` ([Note: depth extrapolation])."""
    from zerobench.whatif.estimate import depth

    low, high = shallow
    if not (a and b and a.get("status") == "ok" and b.get("status") == "ok"):
        bad = next((r for r in (a, b) if r and r.get("status") != "ok"), None)
        return bad or {"status": "skipped", "reason": "no result from the estimating process"}
    row = depth.extrapolate(a, b, low, high, w.model.layers)
    return depth.zero1_optimizer_correction(w, cell.engine, ws, min(rank, ws - 1), row)


def _run_jobs(w, jobs, rank, fake_tensors, hybrid_shard_size, backend, log, progress) -> list[dict]:
    from zerobench.whatif.jobs import run_jobs

    args = ["--rank", str(rank), "--backend", backend]
    if fake_tensors:
        args.append("--fake-tensors")
    env = dict(os.environ)
    env.pop("LOCAL_WORLD_SIZE", None)
    if hybrid_shard_size:
        env["LOCAL_WORLD_SIZE"] = str(hybrid_shard_size)
    return run_jobs("zerobench.whatif.estimate.job", w, jobs, args, env, log, what="estimating process",
                    progress=progress)


def against_run(estimates, results):
    """Estimated vs real per-rank peak, per configuration, world size and rank: the rows of
    ``estimates`` (estimate.csv) that a run's ``results`` (results.csv, memory pass) also
    has, with ``diff_pct`` = 100 * (estimated - real) / real."""
    import pandas as pd

    from zerobench.spec.cell import CellId

    real = results[results["status"] == "ok"].copy()
    real["config"] = [CellId.parse(cid).config for cid in real["cell_id"]]
    real = real[["config", "world_size", "rank", "peak_mem_bytes"]].rename(columns={"peak_mem_bytes": "real_peak_bytes"})
    est = estimates[estimates["status"] == "ok"][["config", "world_size", "rank", "peak_mem_bytes"]]
    both = pd.merge(est, real, on=["config", "world_size", "rank"])
    both["diff_pct"] = 100.0 * (both["peak_mem_bytes"] - both["real_peak_bytes"]) / both["real_peak_bytes"]
    return both
