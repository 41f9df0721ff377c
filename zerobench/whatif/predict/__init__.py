"""``zerobench predict``: what each engine cell would do on GPUs, at any world size.

For each engine configuration of a workload and each world size, one rank runs a
warm-up and one measured step on the virtual GPU (zerobench/vgpu) against a fake
process group, with fake tensors: any model size, in one process per configuration
(zerobench/whatif/predict/rank.py). Out come ``predict.csv`` (one row per cell and world size,
[Note: predicted columns]), a Chrome trace per cell under ``traces/`` and
``plots/pareto.png`` and ``plots/predict.png``, in ``results/<date>-<workload>-predict/``.

Which tool answers what:
* ``zerobench estimate``: peak memory per rank at any world size (tensor bytes; no time);
* ``zerobench simulate``: a *measured* run re-timed on another interconnect;
* ``zerobench predict``: step time, overlap, the host's lead and the caching allocator's
  peaks (allocated, active, reserved) on a GPU preset and links, from nothing measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from zerobench.whatif.estimate import (config_id, parse_world_sizes, run_rank_process, select_configurations,
                                      versions, why_not)

#: --matrix: the knobs swept for the engines that have them.
MATRIX = {
    "impl-fsdp": {"backward_prefetch": ["pre", "post", "none"], "limit_all_gathers": [True, False],
                  "sharding_strategy": ["FULL_SHARD", "SHARD_GRAD_OP"]},
    "torch-fsdp1": {"backward_prefetch": ["pre", "post", "none"], "limit_all_gathers": [True, False],
                    "sharding_strategy": ["FULL_SHARD", "SHARD_GRAD_OP"]},
    "torch-fsdp2": {"reshard_after_forward": [True, False]},
}
COLUMNS = ("step_time_s", "compute_s", "exposed_comm_s", "overlap_ratio", "peak_allocated_bytes",
           "peak_active_bytes", "peak_reserved_bytes", "max_unsharded_units", "host_lead_max_s")


def _with_matrix(workload):
    matrix = dict(workload.matrix)
    for axes in MATRIX.values():
        for axis, values in axes.items():
            matrix[axis] = values
    return dataclasses.replace(workload, matrix=matrix)


def predict(workload_path, world_sizes, gpu: str = "h100-sxm", host: str = "fast", link: str = "nvlink4-8gpu",
            inter_link: str | None = None, node_size: int = 8, results_root: Path = Path("results"),
            matrix: bool = False, only=None, log=print, progress=None) -> Path:
    """Predict every configuration of the workload at ``world_sizes``; returns the folder.
    Every argument is checked before the folder is made. ``progress``: told each
    configuration as it finishes (zerobench.commands.progress.Progress)."""
    import pandas as pd

    from zerobench.instruments.link import resolve_link
    from zerobench.runs.files import new_stamped_dir, write_csv_atomic, write_json_atomic
    from zerobench.whatif.predict.rank import EMULATION_OPTIONS
    from zerobench.instruments.vgpu.presets import gpu_preset, host_preset
    from zerobench.spec.workload import load_workload

    for option, check in (("--gpu", lambda: gpu_preset(gpu)), ("--host", lambda: host_preset(host)),
                          ("--link", lambda: resolve_link(link)),
                          ("--inter-link", lambda: resolve_link(inter_link) if inter_link else None)):
        try:
            check()  # a bad name fails here, naming the option and the allowed ones
        except ValueError as err:
            raise ValueError(f"{option}: {err}") from None
    links = {"link": resolve_link(link), "inter_link": resolve_link(inter_link) if inter_link else None}
    if node_size < 1:
        raise ValueError(f"--node-size: {node_size} is not allowed (allowed: ints >= 1)")
    w = load_workload(workload_path)
    from zerobench.spec.user_check import check_user_model

    check_user_model(w.model, w.data.batch_size, w.data.seed)  # the user's code fails here, not in a rank
    world_sizes = parse_world_sizes(",".join(map(str, world_sizes)))
    if matrix:
        w = _with_matrix(w)
    cells = select_configurations(w, only)
    if not cells:
        raise ValueError(f"{workload_path}: no configuration of workload {w.name!r} can be predicted: every cell of "
                         f"its matrix is skipped (`zerobench cells {workload_path}` says why)")
    if progress is not None:
        progress.set_total(len(cells))
    out_dir = new_stamped_dir(results_root, f"{w.name}-predict")
    write_json_atomic(out_dir / "workload.json", w.to_dict())
    rows = []
    for i, cell in enumerate(cells, 1):
        todo, results = [], {}
        for ws in world_sizes:
            why = why_not(cell, ws, None)
            if why:
                results[ws] = {"status": "skipped", "reason": why}
            else:
                todo.append(ws)
        if todo:
            started = time.perf_counter()
            results.update(_run_child(w, cell, todo, gpu, host, links, node_size, out_dir / "traces"))
            log(f"[{i}/{len(cells)}] {config_id(cell)}: world sizes {','.join(map(str, todo))} in "
                f"{time.perf_counter() - started:.1f} s")
        if progress is not None:
            progress.advance(config_id(cell))
        for ws in world_sizes:
            res = results.get(ws) or {"status": "skipped", "reason": "no result from the predicting process"}
            rows.append({"config": config_id(cell), "engine": cell.engine, "dtype": cell.dtype, "world_size": ws,
                         "gpu": gpu, "host": host, "link": links["link"].name or "custom",
                         "inter_link": (links["inter_link"].name if links["inter_link"] else ""),
                         "node_size": node_size, **versions(),
                         **{k: v for k, v in cell.opts.items() if k not in EMULATION_OPTIONS}, **res})
        write_csv_atomic(out_dir / "predict.csv", pd.DataFrame(rows))
    frame = pd.DataFrame(rows)
    write_csv_atomic(out_dir / "predict.csv", frame)
    from zerobench.whatif.predict.plots import plot_predict_all

    plot_predict_all(frame, out_dir, w.name)
    return out_dir


def _link_json(link) -> str:
    return json.dumps({"bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us, "name": link.name})


def _run_child(w, cell, world_sizes, gpu, host, links, node_size, traces: Path) -> dict:
    from zerobench.whatif.predict.rank import EMULATION_OPTIONS

    options = [kv for kv in cell.options if kv[0] not in EMULATION_OPTIONS]
    args = ["--gpu", gpu, "--host", host, "--node-size", str(node_size), "--traces", str(traces),
            "--link", _link_json(links["link"])]
    if links["inter_link"] is not None:
        args += ["--inter-link", _link_json(links["inter_link"])]
    rows, failure = run_rank_process("zerobench.whatif.predict.rank", w, cell, options, world_sizes, args, dict(os.environ))
    out = {row.pop("world_size"): row for row in rows}
    if failure is not None:
        for ws in world_sizes:
            out.setdefault(ws, {"status": "skipped", "reason": f"predicting process failed: {failure}"})
    return out


def format_table(frame) -> str:
    lines = [f"{'config':<44}{'ws':>6}{'step ms':>10}{'exposed ms':>12}{'overlap':>9}{'active GiB':>12}"
             f"{'reserved GiB':>14}{'units':>7}{'lead ms':>9}"]
    for _, r in frame.iterrows():
        if r["status"] != "ok":
            lines.append(f"{r['config']:<44}{r['world_size']:>6}  {r['status']}: {r['reason']}")
            continue
        lines.append(f"{r['config']:<44}{r['world_size']:>6}{r['step_time_s'] * 1e3:>10.2f}"
                     f"{r['exposed_comm_s'] * 1e3:>12.2f}{r['overlap_ratio']:>9.2f}"
                     f"{r['peak_active_bytes'] / 2**30:>12.2f}{r['peak_reserved_bytes'] / 2**30:>14.2f}"
                     f"{r['max_unsharded_units']:>7.1f}{r['host_lead_max_s'] * 1e3:>9.2f}")
    return "\n".join(lines)
