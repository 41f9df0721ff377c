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
    from dataclasses import replace

    import pandas as pd

    from zerobench.engines.stages import (
        engine_model_state_bytes,
        engine_stage,
        keeps_master_copy,
        paper_bytes_from_counts,
    )
    from zerobench.runs.whatif import EstimateFolder
    from zerobench.spec.workload import load_workload
    from zerobench.whatif.estimate import depth

    r = request  # its fields by the names the steps below use
    workload_path, world_sizes, rank, backend, gpu = r.workload, list(r.world_sizes), r.rank, r.backend, r.gpu
    fake_tensors, hybrid_shard_size, full_depth = r.fake_tensors, r.hybrid_shard_size, r.full_depth
    w = load_workload(workload_path, r.overrides)
    from zerobench.spec.user_check import check_user_model

    # the user's code fails here, not in a rank
    check_user_model(w.model, w.data.batch_size, w.data.seed, label=w.label)
    from zerobench.rank.worlds import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"--backend: {backend!r} is not allowed (allowed: {', '.join(BACKENDS)})")
    preset = None
    if gpu is not None:
        from zerobench.instruments.vgpu.presets import gpu_preset

        try:
            preset = gpu_preset(gpu)
        except ValueError as err:
            raise ValueError(f"--gpu: {err}") from None
    psi = _psi(w)
    if fake_tensors is None:
        fake_tensors = psi * 16 > FAKE_TENSORS_ABOVE
    cells = configurations_to_run(w, workload_path, r.only, world_sizes, "estimate", log)
    out_dir = new_results_folder(r.results_root, w, "estimate")
    rows = []
    opt = w.optimizer.kind
    if opt == "sgd" and w.optimizer.hyper().get("momentum"):
        opt = "sgd-momentum"
    # Every cell (and depth) to run, in one process ([Note: one process for many cells]).
    from zerobench.whatif.jobs import Job

    plans, jobs = {}, []
    for cell in cells:
        shallow = None if (full_depth or not fake_tensors) else depth.depths(w, cell.opts)
        for ws in world_sizes:
            why = why_not(cell, ws, hybrid_shard_size)
            if why:
                plans[(cell.config_id, ws)] = {"status": "skipped", "reason": why}
                continue
            for layers in (shallow or (None,)):
                jobs.append(Job(cell.engine, cell.dtype, cell.options, ws, layers, label=cell.config_id))
        plans[cell.config_id] = shallow
    found = {}
    for job, row in zip(jobs, _run_jobs(w, jobs, rank, fake_tensors, hybrid_shard_size, backend, log, progress)):
        found[(job.label, job.world_size, job.layers)] = row
    for cell in cells:
        cid, shallow = cell.config_id, plans[cell.config_id]
        results = {}
        for ws in world_sizes:
            if (cid, ws) in plans:
                results[ws] = plans[(cid, ws)]
            elif shallow is None:
                results[ws] = found.get((cid, ws, None))
            else:
                results[ws] = _extrapolated(w, cell, ws, rank, shallow, found.get((cid, ws, shallow[0])),
                                            found.get((cid, ws, shallow[1])))
        for ws in world_sizes:
            res = results.get(ws) or {"status": "skipped", "reason": "no result from the estimating process"}
            opts, group = cell.opts, hybrid_shard_size or replace(cell, world_size=ws).shard_group_size
            stage, shard = engine_stage(cell.engine, opts, ws, group)
            kind = opt if opt in ("adam", "adamw", "sgd", "sgd-momentum") else "adam"
            analytic = engine_model_state_bytes(cell.engine, opts, ws, psi, kind, shard_group_size=group)
            paper = engine_model_state_bytes(cell.engine, opts, ws, psi, kind, precision="mixed", shard_group_size=group)
            if res.get("status") == "ok":
                res = {**res, "paper_model_states_bytes": paper_bytes_from_counts(
                    res["state_params_numel"], res["state_grads_numel"], res["state_optim_numel"], kind,
                    master_copy=keeps_master_copy(cell.engine))}
            rows.append({
                "config": cell.config_id, "engine": cell.engine, "dtype": cell.dtype, "world_size": ws,
                "rank": rank, "fake_tensors": fake_tensors, "backend": backend, "params_total": psi, **versions(),
                "zero_stage": stage, "shard_ranks": shard,
                "analytic_params_bytes": analytic["params"], "analytic_grads_bytes": analytic["grads"],
                "analytic_optim_bytes": analytic["optim"], "analytic_model_states_bytes": analytic["total"],
                "paper_analytic_model_states_bytes": paper["total"],
                **{k: v for k, v in cell.opts.items()}, **res, **_capacity(preset, ws),
            })
    frame = pd.DataFrame(rows)
    EstimateFolder(out_dir).write_table(frame)
    from zerobench.whatif.estimate.plots import estimate_setting, plot_estimate

    plot_estimate(frame, out_dir / "plots" / "estimate_peak.png", estimate_setting(frame, w.name))
    return out_dir


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
