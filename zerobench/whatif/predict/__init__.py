"""``zerobench predict``: what each engine cell would do on GPUs, at any world size.

For each engine configuration of a workload and each world size, one rank runs a
warm-up and one measured step on the virtual GPU (zerobench/instruments/vgpu) against a fake
process group, with fake tensors: any model size, every cell in turn in one child
process (zerobench/whatif/predict/job.py; [Note: one process for many cells] in
zerobench/whatif/jobs.py). Out come ``predict.csv`` (one row per cell and world size,
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
from pathlib import Path

from zerobench.engines.options import matrix_sweeps
from zerobench.whatif.cells import (
    configurations_to_run,
    new_results_folder,
    versions,
    why_not,
)
from zerobench.whatif.predict.request import PredictRequest

#: --matrix: the knobs swept for the engines that have them (each option's ``sweep``,
#: zerobench/engines/options.py).
MATRIX = matrix_sweeps()


def _with_matrix(workload):
    matrix = dict(workload.matrix)
    for engine, axes in MATRIX.items():
        if engine in matrix["engine"]:  # another engine's axes would be refused ([Note: narrowing the engines])
            matrix.update(axes)
    return dataclasses.replace(workload, matrix=matrix)


def resolve_devices(gpu, host, link, inter_link, alloc_conf, context_mib, nccl_mib, sdpa_backend="auto") -> dict:
    """Every device option resolved once, into what the predicting process is given: the
    GPU preset (a name or a file, with the user's memory settings), the host preset (the
    GPU preset's own host when ``host`` is None, else the measured one: host.py's ``host_for``), the
    links and the allocator settings. A bad value is a ValueError naming its option and
    the allowed values."""
    from zerobench.instruments.link import resolve_link
    from zerobench.instruments.vgpu import sdpa
    from zerobench.instruments.vgpu.alloc_conf import AllocatorConfig
    from zerobench.instruments.vgpu.host import host_for
    from zerobench.instruments.vgpu.presets import gpu_preset

    def named(option, check):
        try:
            return check()
        except ValueError as err:  # a bad name fails here, naming the option and the allowed ones
            raise ValueError(err if str(err).startswith(option) else f"{option}: {err}") from None

    for name, value in (("--context-mib", context_mib), ("--nccl-mib", nccl_mib)):
        if value is not None and value < 0:
            raise ValueError(f"{name}: {value} is not allowed (allowed: ints >= 0)")
    preset = named("--gpu", lambda: gpu_preset(gpu).with_memory(
        context_bytes=None if context_mib is None else context_mib * 2**20,
        nccl_bytes_per_group=None if nccl_mib is None else nccl_mib * 2**20))
    host_resolved = named("--host" if host is not None else "--gpu", lambda: host_for(preset, host))
    return {"gpu": preset, "host": host_resolved,
            "link": named("--link", lambda: resolve_link(link)),
            "inter_link": named("--inter-link", lambda: resolve_link(inter_link)) if inter_link else None,
            "alloc_conf": named("--alloc-conf", lambda: AllocatorConfig.parse(alloc_conf) and (alloc_conf or "")),
            "sdpa_backend": sdpa.check(sdpa_backend)}


def predict(request: PredictRequest, *, log=print, progress=None) -> Path:
    """Predict every configuration of the request's workload at its world sizes (every
    option: :class:`PredictRequest`); returns the folder. Every option is checked before
    the folder is made. ``log``: each line to say; ``progress``: told each cell as it
    finishes (zerobench.commands.progress.Progress)."""
    import pandas as pd

    from zerobench.runs.files import write_json_atomic
    from zerobench.runs.whatif import PredictFolder
    from zerobench.spec.axes import EMULATION_AXES
    from zerobench.spec.workload import load_workload

    r = request
    devices = resolve_devices(r.gpu, r.host, r.link, r.inter_link, r.alloc_conf, r.context_mib, r.nccl_mib,
                              r.sdpa_backend)
    memory = {"alloc_conf": devices["alloc_conf"], "record_streams": r.record_streams,
              "sdpa_backend": devices["sdpa_backend"]}
    links = {"link": devices["link"], "inter_link": devices["inter_link"]}
    world_sizes, node_size = list(r.world_sizes), r.node_size
    w = load_workload(r.workload, r.overrides)
    from zerobench.spec.user_check import check_user_model

    # the user's code fails here, not in a rank
    check_user_model(w.model, w.data.batch_size, w.data.seed, label=w.label)
    if r.matrix:
        w = _with_matrix(w)
    cells = configurations_to_run(w, r.workload, r.only, world_sizes, "predict", log)
    out_dir = new_results_folder(r.results_root, w, "predict")
    # What the cells run on, as the predicting process reads it back: the GPU preset with
    # every figure and its source, and the host preset.
    folder = PredictFolder(out_dir)
    write_json_atomic(folder.gpu_path, devices["gpu"].to_file())
    host_preset = devices["host"]
    from zerobench.whatif.jobs import Job

    # Every cell to run, in one process ([Note: one process for many cells]).
    results: dict = {}
    jobs = []
    for cell in cells:
        # without the harness's link emulation: the virtual GPU times collectives itself
        options = tuple(kv for kv in cell.options if kv[0] not in EMULATION_AXES)
        for ws in world_sizes:
            why = why_not(cell, ws, None)
            if why:
                results[(cell.config_id, ws)] = {"status": "skipped", "reason": why}
            else:
                jobs.append(Job(cell.engine, cell.dtype, options, ws, label=cell.config_id))
    for job, row in zip(jobs, _run_jobs(w, jobs, folder.gpu_path, host_preset, links, node_size,
                                        folder.traces_dir, memory, log, progress)):
        results[(job.label, job.world_size)] = row
    rows = []
    for cell in cells:
        for ws in world_sizes:
            res = results.get((cell.config_id, ws)) or {"status": "skipped",
                                                          "reason": "no result from the predicting process"}
            rows.append({"config": cell.config_id, "engine": cell.engine, "dtype": cell.dtype, "world_size": ws,
                         "gpu": devices["gpu"].name, "host": host_preset.name,
                         "link": links["link"].name or "custom",
                         "inter_link": (links["inter_link"].name if links["inter_link"] else ""),
                         "node_size": node_size, "alloc_conf": memory["alloc_conf"], **versions(),
                         **{k: v for k, v in cell.opts.items() if k not in EMULATION_AXES}, **res})
    frame = pd.DataFrame(rows)
    folder.write_table(frame)
    from zerobench.whatif.predict.plots import plot_predict_all

    plot_predict_all(frame, out_dir, w.name)
    return out_dir


def _link_json(link) -> str:
    return json.dumps(link.to_json())


def _run_jobs(w, jobs, gpu_file: Path, host, links, node_size, traces: Path, memory: dict, log,
              progress) -> list[dict]:
    from zerobench.whatif.jobs import run_jobs

    args = ["--gpu-file", str(gpu_file), "--host", json.dumps(dataclasses.asdict(host)), "--node-size",
            str(node_size), "--traces", str(traces), "--link", _link_json(links["link"]),
            "--alloc-conf", memory["alloc_conf"], "--sdpa-backend", memory["sdpa_backend"]]
    if memory["record_streams"]:
        args.append("--record-streams")
    if links["inter_link"] is not None:
        args += ["--inter-link", _link_json(links["inter_link"])]
    # HYBRID_SHARD's shard groups are one node's ranks (LOCAL_WORLD_SIZE, as torchrun sets it).
    env = dict(os.environ, LOCAL_WORLD_SIZE=str(node_size))
    return run_jobs("zerobench.whatif.predict.job", w, jobs, args, env, log, what="predicting process",
                    progress=progress)

