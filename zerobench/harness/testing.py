"""Run a Python function on N real torch.distributed ranks, for tests.

The pattern of DeepSpeed's ``DistributedTest``: one world per call, a file store
(no port races between tests), a per-call timeout, and failures reported with the
rank that raised them. Results come back through files, never through
multiprocessing queues (measured with torch 2.13: tensors through queues fail once
the child exits, large pickles deadlock against join).

Children are forked by default: 0.06 s per world instead of 3-4 s with spawn. Fork is
safe here because every child pins itself to one compute thread before touching
torch ops (a fork after the parent used OpenMP hangs only when children go
multi-threaded). Set ``ZEROBENCH_TEST_START=spawn`` to use spawn instead.

Example::

    def body(rank, world_size, scale):
        t = torch.full((2,), float(rank)) * scale
        dist.all_reduce(t)
        return t

    outs = run_ranks(body, world_size=2, args=(3.0,))   # [tensor, tensor], one per rank
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch

# The first torch.optim optimizer built in a process imports torch._dynamo (1-6 s on the
# 2-core machine). Import it once here, so that every forked rank inherits it.
import torch._dynamo  # noqa: E402,F401
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """One or more ranks raised, or the world timed out."""


def _child(fn, rank, world_size, args, kwargs, store_path, out_dir, backend):
    torch.set_num_threads(1)
    import torch.distributed as dist

    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size
        )
        try:
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "value": value}, result_path)
    except BaseException:  # report everything, including assertion failures, with the rank
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        os._exit(1)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout: float = 180.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

    Returns the per-rank return values (which must be picklable by ``torch.save``).
    Raises :class:`RankFailure` naming each failing rank and its traceback, or the
    ranks still alive at the timeout (which are killed).
    """
    method = os.environ.get("ZEROBENCH_TEST_START", "fork")
    ctx = mp.get_context(method)
    with tempfile.TemporaryDirectory(prefix="zb-ranks-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, rank, world_size, tuple(args), kwargs or {}, store_path, tmp, backend),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        # Poll rather than join in order: once one rank has failed, its peers are
        # usually blocked in a collective that will never complete, so stop them
        # after a short grace period instead of waiting for the whole timeout.
        start = time.monotonic()
        failed_at = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if now - start > timeout or (failed_at is not None and now - failed_at > 5.0):
                break
            time.sleep(0.02)
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()

        results, failures = [], []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if not os.path.exists(path):
                why = "timed out" if rank in hung else f"exited with code {procs[rank].exitcode}"
                failures.append(f"rank {rank}: {why} without a result")
                results.append(None)
                continue
            record = torch.load(path, weights_only=False)
            if record["ok"]:
                results.append(record["value"])
            else:
                failures.append(f"rank {rank} raised:\n{record['error']}")
                results.append(None)
        if failures:
            raise RankFailure(f"{fn.__name__} at world size {world_size}:\n" + "\n".join(failures))
        return results
