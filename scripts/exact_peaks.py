"""Whether the memory pass's peaks are exact: each cell's measured step, several times per
rank, with the storage tracker's verdict on each (docs/ci.md, "Memory and gloo's worker
threads"; [Note: frees on other threads] in zerobench/instruments/memory.py).

    python scripts/exact_peaks.py workloads/quickstart.toml --steps 6 --cells 'torch-fsdp*' 'impl-fsdp*'

For every cell and rank it prints the distinct (peak, activations, grads) of the steps the
tracker called exact and of those it called inexact, and ends with ``exact steps agree``
when, for every cell, all exact steps of all ranks gave one and the same figures (exit 0),
else ``exact steps DISAGREE`` (exit 1). The steps run without the memory pass's retry,
so that the inexact ones show what they would have reported. Loading the machine (other
work beside it) makes late frees, and inexact steps, more frequent.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import sys

import torch.distributed as dist


def _measure(rank: int, world_size: int, workload_path: str, cell_ids: list[str], steps: int) -> dict:
    from zerobench.rank.session import Session
    from zerobench.rank.worlds import JoinedWorld
    from zerobench.spec.matrix import expand
    from zerobench.spec.workload import load_workload

    w = load_workload(workload_path)
    out = {}
    for cell in (c for c in expand(w) if c.id in cell_ids):
        session = Session(w, cell, JoinedWorld())  # the process group run_ranks made
        rows = []
        with session.tracker() as tracker:
            engine = session.build()
            session.warm_up(engine, w.run.memory_warmup_steps)
            for i in range(steps):
                dist.barrier()
                gc.collect()
                gc.disable()
                try:
                    session.measured_step(engine, w.run.memory_warmup_steps + i, tracker)
                finally:
                    gc.enable()
                parts = tracker.peak_breakdown()
                rows.append((tracker.peak_exact, tracker.peak_bytes, parts["activations"], parts["grads"]))
        out[cell.id] = rows
        del engine
        gc.collect()
    return out


def main(argv=None) -> int:
    from zerobench.harness.testing import run_ranks
    from zerobench.spec.matrix import expand
    from zerobench.spec.workload import load_workload

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per cell and rank (default 6)")
    parser.add_argument("--cells", nargs="*", default=["*"], help="cell ids or globs (default: every cell)")
    args = parser.parse_args(argv)
    w = load_workload(args.workload)
    cells = [c for c in expand(w) if not c.skip_reason and any(fnmatch.fnmatch(c.id, p) for p in args.cells)]
    if not cells:
        parser.error(f"--cells: no cell of {args.workload} matches {args.cells}")
    agree = True
    for size in sorted({c.world_size for c in cells}):
        ids = [c.id for c in cells if c.world_size == size]
        per_rank = run_ranks(_measure, size, args=(args.workload, ids, args.steps), timeout=3600)
        for cell_id in ids:
            exact_all = set()
            for rank, result in enumerate(per_rank):
                rows = result[cell_id]
                exact = sorted({r[1:] for r in rows if r[0]})
                inexact = [r[1:] for r in rows if not r[0]]
                exact_all.update(exact)
                print(f"{cell_id} rank {rank}: exact {len(rows) - len(inexact)}/{len(rows)} {exact}; "
                      f"inexact {inexact}")
            agree &= len(exact_all) <= 1
    print("exact steps agree" if agree else "exact steps DISAGREE")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
