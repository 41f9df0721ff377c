"""Run and predict folders made in this process, for tests that patch what they run.

``zerobench run`` and ``zerobench predict`` start processes of their own, which a
``monkeypatch`` applied in a test does not reach. These make the same folders from here:

* :func:`run_folder`: every cell of a workload on real gloo ranks forked from this
  process (tests' ``run_ranks``), each rank running the worker's own timing and memory
  passes (zerobench/rank/passes.py: ``timing_pass``, ``memory_pass``), rank 0 writing the cell record the
  worker writes; ``zerobench compare`` reads the folder as any run's.
* :func:`predict_folder`: ``zerobench.whatif.predict.predict`` itself, with its child
  process replaced by the same ``run_job`` for each job here.

A patch applied before either call is in force in what they run (forked ranks inherit
it), and what they write is what the CLI writes.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from zerobench.harness.runner import prepare_run
from zerobench.harness.testing import run_ranks
from zerobench.runs.folder import RunFolder
from zerobench.spec.matrix import expand
from zerobench.spec.workload import load_workload


def _cell_records(rank: int, world_size: int, workload, cell_ids: list[str]) -> dict | None:
    from zerobench.rank.passes import memory_pass, timing_pass
    from zerobench.rank.session import Session
    from zerobench.rank.worlds import JoinedWorld

    records = {}
    world = JoinedWorld()
    for cell in (c for c in expand(workload) if c.id in cell_ids):
        session = Session(workload, cell, world)
        engine = session.build()
        record = timing_pass(session, engine)
        record.pop("loss_dtype")  # the worker's note reads it; a rank record does not keep it
        del engine
        gc.collect()
        record["metrics"].update(memory_pass(session)["metrics"])
        record["rank"] = rank
        gathered = world.gather_object(record)
        if rank == 0:
            records[cell.id] = {"cell_id": cell.id, "status": "ok", "error": None, "config": cell.config(),
                                "backend": world.backend, "device": world.device.type, "ranks": gathered}
    return records if rank == 0 else None


def run_folder(root: Path, workload_path: str | Path, name: str, only: tuple[str, ...] = ()) -> Path:
    """A run folder of every cell of the workload (or of the cells ``only`` names), as
    ``zerobench run`` (``--cell``) lays it out."""
    w = load_workload(workload_path)
    cells = [c for c in expand(w) if not c.skip_reason and (not only or c.id in only)]
    run_dir = Path(root) / name
    prepare_run(w, run_dir, cells, "cpu")
    for size in sorted({c.world_size for c in cells}):
        ids = [c.id for c in cells if c.world_size == size]
        records = run_ranks(_cell_records, size, args=(w, ids), timeout=600)[0]
        for record in records.values():
            RunFolder(run_dir).write_cell(record)
    return run_dir


def _predict_here(w, jobs, gpu_file, host, links, node_size, traces, memory, log, progress) -> list[dict]:
    """``zerobench.whatif.predict._run_jobs`` in this process: each job as the predicting
    child runs it (zerobench.whatif.predict.job.run_job)."""
    from zerobench.instruments.vgpu.presets import load_preset_file
    from zerobench.whatif.predict.job import run_job

    preset = load_preset_file(gpu_file)
    return [run_job(w, job, preset, host, links["link"], links["inter_link"], node_size, None,
                    memory["alloc_conf"], memory["record_streams"], memory["sdpa_backend"]) for job in jobs]


def predict_folder(root: Path, workload_path: str | Path, world_sizes: list[int], link: str,
                   gpu: str = "h100-sxm", only: tuple[str, ...] = ()) -> Path:
    """The folder ``zerobench predict WORKLOAD --world-sizes ... --link LINK [--config ...]``
    writes."""
    import zerobench.whatif.predict as predict
    from zerobench.whatif.predict.request import PredictRequest

    request = PredictRequest(workload_path, tuple(world_sizes), gpu=gpu, link=link, results_root=Path(root),
                             only=tuple(only) or None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(predict, "_run_jobs", _predict_here)
        return predict.predict(request, log=lambda *_: None)
