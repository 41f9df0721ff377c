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

import dataclasses
import os
import time
from pathlib import Path

from zerobench.whatif.estimate import depth
from zerobench.engines.stages import engine_model_state_bytes, engine_stage, paper_bytes_from_counts

#: model states above this (bytes, fp32 + Adam, unsharded) switch --fake-tensors on by default
FAKE_TENSORS_ABOVE = 4 * 2**30
DEFAULT_WORLD_SIZES = (8, 64, 1024)


def parse_world_sizes(text: str) -> list[int]:
    """"8,64,1024" -> [8, 64, 1024]; ValueError naming the bad value otherwise."""
    out = []
    for part in str(text).split(","):
        try:
            ws = int(part)
        except ValueError:
            raise ValueError(f"--world-sizes: {part!r} is not allowed (allowed: comma-separated ints >= 1)") from None
        if ws < 1:
            raise ValueError(f"--world-sizes: {ws} is not allowed (allowed: ints >= 1)")
        out.append(ws)
    return out


def configurations(workload, world_sizes=(2,)):
    """The distinct engine configurations of the workload's matrix (world size left out):
    those valid at one or more of ``world_sizes`` (a configuration such as HYBRID_SHARD
    can be valid at 8 ranks and not at 2), as cells at the first world size they are
    valid at. Which world sizes each one runs at is ``why_not``'s to say."""
    from zerobench.spec.matrix import expand

    seen, out = set(), []
    for ws in world_sizes:
        matrix = dict(workload.matrix)
        matrix["world_size"] = [ws]
        for cell in expand(dataclasses.replace(workload, matrix=matrix)):
            key = (cell.engine, cell.dtype, cell.options)
            if cell.skip_reason is None and key not in seen:
                seen.add(key)
                out.append(cell)
    return out


def config_id(cell) -> str:
    return cell.id.replace(f"-ws{cell.world_size}", "")


def select_configurations(w, only=None, world_sizes=(2,)) -> list:
    """The workload's configurations valid at one or more of ``world_sizes``, or those
    whose id is in ``only`` (``--config``); an id that names none is an error listing
    the ids there are."""
    cells = configurations(w, world_sizes)
    if not only:
        return cells
    ids = [config_id(c) for c in cells]
    unknown = [i for i in only if i not in ids]
    if unknown:
        raise ValueError(f"--config: {', '.join(map(repr, unknown))} is not a configuration of workload {w.name!r} "
                         f"(allowed: {', '.join(ids)})")
    return [c for c, i in zip(cells, ids) if i in only]


def why_not(cell, world_size: int, hybrid_shard_size: int | None) -> str | None:
    """Why this configuration cannot be estimated at ``world_size`` (None if it can)."""
    from zerobench.engines import get_engine

    if world_size < 1:
        return f"world size {world_size} is not allowed (allowed: >= 1)"
    why = get_engine(cell.engine).unsupported(cell.opts, cell.dtype, world_size, "cpu")
    if why:
        return why
    if cell.opts.get("sharding_strategy") == "HYBRID_SHARD":
        if hybrid_shard_size and world_size % hybrid_shard_size:
            return (f"HYBRID_SHARD: world size {world_size} is not a multiple of the shard group size "
                    f"{hybrid_shard_size} (--hybrid-shard-size)")
    return None


def _psi(workload) -> int:
    import torch

    from zerobench.spec.models import construct

    with torch.device("meta"):
        model = construct(workload.model)
    return sum(p.numel() for p in model.parameters())


def estimate(workload_path, world_sizes, rank: int = 0, results_root: Path = Path("results"),
             fake_tensors: bool | None = None, hybrid_shard_size: int | None = None, only=None,
             log=print, backend: str = "nccl", full_depth: bool = False) -> Path:
    """Estimate every configuration of the workload at ``world_sizes``; returns the folder.
    ``backend``: whose own communication buffers to count (zerobench/whatif/estimate/rank.py).
    ``full_depth``: run every block even where the estimate would extrapolate from two
    shallow copies of the model (zerobench/whatif/estimate/depth.py)."""
    import pandas as pd

    from zerobench.runs.files import new_stamped_dir, write_csv_atomic, write_json_atomic
    from zerobench.spec.workload import load_workload

    w = load_workload(workload_path)
    world_sizes = parse_world_sizes(",".join(map(str, world_sizes)))
    if rank < 0:
        raise ValueError(f"--rank: {rank} is not allowed (allowed: 0 <= rank < world size)")
    for ws in world_sizes:
        if rank >= ws:
            raise ValueError(f"--rank: {rank} is not allowed at world size {ws} (allowed: 0..{ws - 1})")
    if hybrid_shard_size is not None and hybrid_shard_size < 1:
        raise ValueError(f"--hybrid-shard-size: {hybrid_shard_size} is not allowed (allowed: int >= 1)")
    from zerobench.rank.worlds import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"--backend: {backend!r} is not allowed (allowed: {', '.join(BACKENDS)})")
    psi = _psi(w)
    if fake_tensors is None:
        fake_tensors = psi * 16 > FAKE_TENSORS_ABOVE
    cells = select_configurations(w, only, world_sizes)
    out_dir = new_stamped_dir(results_root, f"{w.name}-estimate")
    write_json_atomic(out_dir / "workload.json", w.to_dict())
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
                plans[(config_id(cell), ws)] = {"status": "skipped", "reason": why}
                continue
            for layers in (shallow or (None,)):
                jobs.append(Job(cell.engine, cell.dtype, cell.options, ws, layers, label=config_id(cell)))
        plans[config_id(cell)] = shallow
    found = {}
    if jobs:
        started = time.perf_counter()
        for job, row in zip(jobs, _run_jobs(w, jobs, rank, fake_tensors, hybrid_shard_size, backend, log)):
            found[(job.label, job.world_size, job.layers)] = row
        log(f"{len(jobs)} cells in {time.perf_counter() - started:.1f} s")
    for cell in cells:
        cid, shallow = config_id(cell), plans[config_id(cell)]
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
            opts = dict(cell.opts)
            if cell.opts.get("sharding_strategy") == "HYBRID_SHARD":
                from impl.fsdp.process_groups import default_shard_size

                opts["_shard_size"] = hybrid_shard_size or default_shard_size(ws)
            stage, shard = engine_stage(cell.engine, opts, ws)
            kind = opt if opt in ("adam", "adamw", "sgd", "sgd-momentum") else "adam"
            analytic = engine_model_state_bytes(cell.engine, opts, ws, psi, kind)
            paper = engine_model_state_bytes(cell.engine, opts, ws, psi, kind, precision="mixed")
            if res.get("status") == "ok":
                res = {**res, "paper_model_states_bytes": paper_bytes_from_counts(
                    res["state_params_numel"], res["state_grads_numel"], res["state_optim_numel"], kind)}
            rows.append({
                "config": config_id(cell), "engine": cell.engine, "dtype": cell.dtype, "world_size": ws,
                "rank": rank, "fake_tensors": fake_tensors, "backend": backend, "params_total": psi,
                "zero_stage": stage, "shard_ranks": shard,
                "analytic_params_bytes": analytic["params"], "analytic_grads_bytes": analytic["grads"],
                "analytic_optim_bytes": analytic["optim"], "analytic_model_states_bytes": analytic["total"],
                "paper_analytic_model_states_bytes": paper["total"],
                **{k: v for k, v in cell.opts.items()}, **res,
            })
    frame = pd.DataFrame(rows)
    write_csv_atomic(out_dir / "estimate.csv", frame)
    from zerobench.whatif.estimate.plots import plot_estimate

    plot_estimate(frame, out_dir / "plots" / "estimate_peak.png")
    return out_dir


def _extrapolated(w, cell, ws, rank, shallow, a: dict | None, b: dict | None) -> dict:
    """The row at the workload's depth from the rows at depths ``shallow`` ([Note: depth extrapolation])."""
    low, high = shallow
    if not (a and b and a.get("status") == "ok" and b.get("status") == "ok"):
        bad = next((r for r in (a, b) if r and r.get("status") != "ok"), None)
        return bad or {"status": "skipped", "reason": "no result from the estimating process"}
    row = depth.extrapolate(a, b, low, high, w.model.layers)
    return depth.zero1_optimizer_correction(w, cell.engine, ws, min(rank, ws - 1), row)


def _run_jobs(w, jobs, rank, fake_tensors, hybrid_shard_size, backend, log) -> list[dict]:
    from zerobench.whatif.jobs import run_jobs

    args = ["--rank", str(rank), "--backend", backend]
    if fake_tensors:
        args.append("--fake-tensors")
    env = dict(os.environ)
    env.pop("LOCAL_WORLD_SIZE", None)
    if hybrid_shard_size:
        env["LOCAL_WORLD_SIZE"] = str(hybrid_shard_size)
    return run_jobs("zerobench.whatif.estimate.rank", w, jobs, args, env, log, what="estimating process")


def format_table(frame) -> str:
    """Peak MiB per configuration (rows) and world size (columns); skipped cells say so."""
    lines = []
    sizes = sorted(frame["world_size"].unique())
    width = max(len(c) for c in frame["config"]) + 2
    lines.append("config".ljust(width) + "".join(f"{'ws' + str(s):>12}" for s in sizes))
    for config, group in frame.groupby("config", sort=False):
        cells = []
        for s in sizes:
            row = group[group["world_size"] == s].iloc[0]
            cells.append(f"{row['peak_mem_bytes'] / 2**20:>12.2f}" if row["status"] == "ok" else f"{'skipped':>12}")
        lines.append(config.ljust(width) + "".join(cells))
    reasons = frame[frame["status"] != "ok"][["config", "world_size", "reason"]]
    for _, r in reasons.iterrows():
        lines.append(f"  skipped {r['config']} ws{r['world_size']}: {r['reason']}")
    return "\n".join(lines)


def format_model_states(frame) -> str:
    """Per configuration and world size: the model states from the element counts the
    engine holds (measured) beside the paper's formula for its stage (analytic)."""
    ok = frame[frame["status"] == "ok"]
    width = max([len(c) for c in ok["config"]] + [6]) + 2
    lines = ["config".ljust(width) + f"{'ws':>6}{'stage':>7}{'measured':>12}{'analytic':>12}{'diff':>9}"]
    for _, r in ok.iterrows():
        measured, analytic = r["paper_model_states_bytes"], r["paper_analytic_model_states_bytes"]
        lines.append(r["config"].ljust(width) + f"{r['world_size']:>6}{r['zero_stage']:>7}{measured / 1e9:>12.4g}"
                     f"{analytic / 1e9:>12.4g}{100 * (measured - analytic) / analytic:>+8.2f}%")
    return "\n".join(lines)


def cmd_estimate(args) -> int:
    import pandas as pd

    started = time.perf_counter()
    out_dir = estimate(args.workload, parse_world_sizes(args.world_sizes), rank=args.rank, results_root=args.results,
                       fake_tensors=args.fake_tensors, hybrid_shard_size=args.hybrid_shard_size, only=args.config,
                       backend=args.backend, full_depth=args.full_depth)
    frame = pd.read_csv(out_dir / "estimate.csv")
    print("per-rank peak MiB (estimated on a fake process group):")
    print(format_table(frame))
    print("model states per rank, GB, in the ZeRO paper's mixed-precision convention (2 + 2 + K bytes per element):")
    print(format_model_states(frame))
    print(f"estimate: {out_dir / 'estimate.csv'} ({time.perf_counter() - started:.1f} s)")
    print(f"plot: {out_dir / 'plots' / 'estimate_peak.png'}")
    if args.against:
        both = against_run(frame, pd.read_csv(Path(args.against) / "results.csv"))
        print(f"estimated vs real peak ({args.against}):")
        print(both.to_string(index=False))
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("estimate", help="per-rank peak memory of each engine at any world size, on a fake process group")
    p.add_argument("workload", help="workload TOML file")
    p.add_argument("--world-sizes", default=",".join(map(str, DEFAULT_WORLD_SIZES)),
                   help="comma-separated world sizes (default: 8,64,1024)")
    p.add_argument("--rank", type=int, default=0, help="the rank to run (default 0)")
    p.add_argument("--results", type=Path, default=Path("results"), help="folder of result folders")
    p.add_argument("--fake-tensors", action=argparse_bool(), default=None,
                   help="build the model on FakeTensors (default: on when model states exceed 4 GiB)")
    p.add_argument("--hybrid-shard-size", type=int, default=None,
                   help="HYBRID_SHARD shard group size (must divide every world size)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="whose communication buffers to count besides the engine's tensors: nccl (default) none; "
                        "gloo also its reduce-scatter's full-input-size buffer, as the CPU memory pass sees it")
    p.add_argument("--full-depth", action="store_true",
                   help="run every block of a deep llama/gpt on fake tensors instead of extrapolating from 3 and 4 "
                        "blocks (slower; docs/models.md, depth extrapolation)")
    p.add_argument("--config", action="append", metavar="ID", help="only this configuration (repeatable)")
    p.add_argument("--against", type=Path, metavar="RUN",
                   help="a run folder (with the memory pass) to compare the estimates with, per rank")
    p.set_defaults(func=cmd_estimate)


def argparse_bool():
    import argparse

    return argparse.BooleanOptionalAction


def against_run(estimates, results):
    """Estimated vs real per-rank peak, per configuration, world size and rank: the rows of
    ``estimates`` (estimate.csv) that a run's ``results`` (results.csv, memory pass) also
    has, with ``diff_pct`` = 100 * (estimated - real) / real."""
    import pandas as pd

    real = results[results["status"] == "ok"].copy()
    real["config"] = [cid.replace(f"-ws{ws}", "") for cid, ws in zip(real["cell_id"], real["world_size"])]
    real = real[["config", "world_size", "rank", "peak_mem_bytes"]].rename(columns={"peak_mem_bytes": "real_peak_bytes"})
    est = estimates[estimates["status"] == "ok"][["config", "world_size", "rank", "peak_mem_bytes"]]
    both = pd.merge(est, real, on=["config", "world_size", "rank"])
    both["diff_pct"] = 100.0 * (both["peak_mem_bytes"] - both["real_peak_bytes"]) / both["real_peak_bytes"]
    return both
