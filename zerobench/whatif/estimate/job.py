"""One rank of engine cells at any world size, in this process, against a fake process group.

``python -m zerobench.whatif.estimate.job --workload W.json --jobs J.json --out O.json``
runs, for each cell of ``J.json`` in turn (zerobench/whatif/jobs.py), the rank session
(zerobench/rank/session.py) of the cell in a fake world of its own
(zerobench/rank/worlds.py, [Note: two worlds]): a warm-up (the workload's
``run.memory_warmup_steps``) and one measured step of the real engine under the storage
tracker, exactly as the worker's memory pass does, against a process group whose
collectives return at once with garbage contents, so memory is right and numerics are
not. The parent (``zerobench.whatif.estimate``) starts one such process for all the
cells ([Note: one process for many cells]).

With ``--fake-tensors`` the model, batches and everything the engine allocates are
FakeTensors (no data), so a 7.5B-parameter model fits on a laptop; the tracker then
follows their meta storages. DDP's C++ reducer runs there too, with its small integer
bookkeeping kept real (``worlds.fake_tensor_mode``). Engines whose code needs real data
(``.item()`` in an optimizer) fail there; the cell is reported skipped with the error.

``--backend`` names whose buffers the estimate counts besides the engine's own tensors:
``nccl`` (the default) none, as the fake group allocates nothing; ``gloo`` also the
full-input-size buffer gloo's reduce-scatter holds (``GlooReduceScatterBuffers`` in
zerobench/instruments/gloo.py), to compare with the harness's CPU memory pass like for like.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback
from pathlib import Path

import torch

from zerobench.engines.base import ran_record, row_note
from zerobench.rank.session import Session
from zerobench.rank.worlds import BACKENDS, FakeWorld
from zerobench.schema.columns import peak_columns
from zerobench.spec.cell import Cell
from zerobench.spec.workload import Workload, parse_workload


def estimate_one(w: Workload, cell: Cell, rank: int, fake: bool, backend: str = "nccl") -> dict:
    """Peak and composition of ``rank`` for ``cell`` (its world size) on a fake process group,
    with ``backend``'s own buffers (see the module docstring)."""
    started = time.perf_counter()
    with FakeWorld(cell.world_size, rank, fake_tensors=fake, buffers_of=backend) as world:
        session = Session(w, cell, world)
        with session.tracker(timeline=False) as tracker:
            engine = session.build()
            ran = ran_record(engine)  # [Note: say what ran] (zerobench/engines/base.py)
            session.warm_up(engine, w.run.memory_warmup_steps)
            step = session.measured_step(engine, w.run.memory_warmup_steps, tracker)
    return {
        "status": "ok", "reason": None, "note": row_note(cell.note, ran),
        **peak_columns(tracker.peak_bytes, tracker.peak_breakdown()),
        **step.state,
        "estimate_wall_s": time.perf_counter() - started,
    }


def main(argv=None) -> None:
    from zerobench.whatif.jobs import child_loop

    parser = argparse.ArgumentParser(prog="python -m zerobench.whatif.estimate.job")
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--jobs", type=Path, required=True, help="JSON: the cells to estimate (zerobench/whatif/jobs.py)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--fake-tensors", action="store_true")
    parser.add_argument("--backend", choices=BACKENDS, default="nccl")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    w = parse_workload(json.loads(args.workload.read_text()), source=str(args.workload))

    def run_one(job) -> dict:
        at_depth = w if job.layers is None else dataclasses.replace(
            w, model=dataclasses.replace(w.model, layers=job.layers))
        try:
            return estimate_one(at_depth, job.cell(), min(args.rank, job.world_size - 1), args.fake_tensors,
                                args.backend)
        except Exception as err:  # one cell never stops the others
            traceback.print_exc()
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            return {"status": "skipped",
                    "reason": f"cannot run under {'fake tensors' if args.fake_tensors else 'the fake process group'}: "
                              f"{type(err).__name__}: {first[:200]}"}

    child_loop(args.jobs, args.out, run_one)


if __name__ == "__main__":
    main()
