"""One rank of one engine cell at any world size, in this process, against a fake process group.

``python -m zerobench.whatif.estimate.rank --workload W.json --cell-config C.json --world-sizes 2,4 --out O.json``
runs, for each world size in turn, the rank session (zerobench/rank/session.py) of the
cell in a fake world (zerobench/rank/worlds.py, [Note: two worlds]): a warm-up (the
workload's ``run.memory_warmup_steps``) and one measured step of the real engine under
the storage tracker, exactly as the worker's memory pass does, against a process group
whose collectives return at once with garbage contents, so memory is right and numerics
are not. The parent (``zerobench.whatif.estimate``) starts one such process per
configuration, so process-group state never leaks between engines.

With ``--fake-tensors`` the model, batches and everything the engine allocates are
FakeTensors (no data), so a 7.5B-parameter model fits on a laptop; the tracker then
follows their meta storages. DDP's C++ reducer runs there too, with its small integer
bookkeeping kept real (``worlds.fake_tensor_mode``). Engines whose code needs real data
(``.item()`` in an optimizer) fail there; the cell is reported skipped with the error.

``--backend`` names whose buffers the estimate counts besides the engine's own tensors:
``nccl`` (the default) none, as the fake group allocates nothing; ``gloo`` also the
full-input-size buffer gloo's reduce-scatter holds (``worlds.GlooReduceScatterBuffers``),
to compare with the harness's CPU memory pass like for like.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback
from pathlib import Path

import torch

from zerobench.rank.session import Session
from zerobench.rank.worlds import BACKENDS, FakeWorld
from zerobench.runs.files import write_json_atomic
from zerobench.spec.matrix import Cell
from zerobench.spec.workload import Workload, parse_workload


def estimate_one(w: Workload, cell: Cell, rank: int, fake: bool, backend: str = "nccl") -> dict:
    """Peak and composition of ``rank`` for ``cell`` (its world size) on a fake process group,
    with ``backend``'s own buffers (see the module docstring)."""
    started = time.perf_counter()
    with FakeWorld(cell.world_size, rank, fake_tensors=fake, backend=backend) as world:
        session = Session(w, cell, world)
        with session.tracker(timeline=False) as tracker:
            engine = session.build()
            session.warm_up(engine, w.run.memory_warmup_steps)
            step = session.measured_step(engine, w.run.memory_warmup_steps, tracker)
    return {
        "status": "ok", "reason": None,
        "peak_mem_bytes": tracker.peak_bytes,
        **{f"peak_mem_{k}_bytes": v for k, v in tracker.peak_breakdown().items()},
        **step.state,
        "estimate_wall_s": time.perf_counter() - started,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zerobench.whatif.estimate.rank")
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--cell-config", type=Path, required=True, help="JSON: engine, dtype, options")
    parser.add_argument("--world-sizes", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--fake-tensors", action="store_true")
    parser.add_argument("--backend", choices=BACKENDS, default="nccl")
    parser.add_argument("--layers", default="",
                        help="comma-separated depths to run the model at instead of its own (see zerobench.whatif.estimate.depth)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    w = parse_workload(json.loads(args.workload.read_text()), source=str(args.workload))
    conf = json.loads(args.cell_config.read_text())
    rows = []
    depths = [int(x) for x in args.layers.split(",")] if args.layers else [None]
    for ws, layers in [(int(x), d) for x in args.world_sizes.split(",") for d in depths]:
        cell = Cell(conf["engine"], ws, conf["dtype"], tuple(tuple(kv) for kv in conf["options"]))
        at_depth = w if layers is None else dataclasses.replace(w, model=dataclasses.replace(w.model, layers=layers))
        try:
            row = estimate_one(at_depth, cell, min(args.rank, ws - 1), args.fake_tensors, args.backend)
        except Exception as err:  # one cell never stops the others
            traceback.print_exc()
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            row = {"status": "skipped",
                   "reason": f"cannot run under {'fake tensors' if args.fake_tensors else 'the fake process group'}: "
                             f"{type(err).__name__}: {first[:200]}"}
        rows.append({"world_size": ws, **({} if layers is None else {"layers": layers}), **row})
        write_json_atomic(args.out, rows)


if __name__ == "__main__":
    main()
