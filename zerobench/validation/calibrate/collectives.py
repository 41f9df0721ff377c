"""Collectives' bus bandwidth over the GPUs present: all-gather, reduce-scatter and
all-reduce from 1 MiB up, one process per GPU over NCCL (gloo on a CPU, for the code
path), reported in nccl-tests' convention (the size is an all-gather's output, a
reduce-scatter's input, an all-reduce's buffer; bus bandwidth = size / time x the
collective's bus factor, zerobench/instruments/link.py). With one GPU there is nothing to
measure, and the section says so.

These are recorded in the measurements file beside the kernels, and make a link file
(:func:`link_file`, [Note: measured links] in zerobench/instruments/link.py) that
``predict --link FILE`` prices collectives with, in place of a published curve.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
#: Message sizes (bytes, nccl-tests' convention) by run: calibrate's ("full"; "tiny" on a
#: CPU, for the code path) and scripts/gpu-check's few ("check").
SIZES = {"full": [1 << 20, 16 << 20, 256 << 20, 1 << 30], "tiny": [1 << 12, 1 << 16],
         "check": [1 << 20, 16 << 20, 256 << 20]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, device_type: str, sizes: list[int], deadline: float, out: str,
          kinds: tuple = KINDS) -> None:
    import torch.distributed as dist

    from zerobench.instruments.link import bus_factor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    rows = []
    try:
        for nbytes in sizes:
            for kind in kinds:
                if time.time() > deadline:
                    break
                dtype = torch.bfloat16 if cuda else torch.float32
                numel = nbytes // dtype.itemsize // world * world  # the size asked for, whatever the dtype
                full = torch.zeros(numel, dtype=dtype, device=device)
                shard = torch.zeros(numel // world, dtype=full.dtype, device=device)

                def once():
                    if kind == "all_gather":
                        dist.all_gather_into_tensor(full, shard)
                    elif kind == "reduce_scatter":
                        dist.reduce_scatter_tensor(shard, full)
                    else:
                        dist.all_reduce(full)

                for _ in range(2):
                    once()
                times = []
                for _ in range(5):
                    if cuda:
                        torch.cuda.synchronize(device)
                    dist.barrier()
                    started = time.perf_counter()
                    once()
                    if cuda:
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - started)
                seconds = sorted(times)[len(times) // 2]
                size = full.numel() * full.element_size()
                rows.append({"kind": kind, "nbytes": size, "world_size": world, "seconds": seconds,
                             "busbw_gbps": bus_factor(kind, world) * size / seconds / 1e9})
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def measure(device: torch.device, size: str, budget_s: float, log, ranks: int | None = None,
            kinds: tuple = KINDS) -> dict:
    """Bus bandwidth by collective (``kinds``) and size over ``ranks`` processes (the GPUs
    present on CUDA); ``{"skipped": why}`` with fewer than two."""
    world = torch.cuda.device_count() if device.type == "cuda" else (ranks or 1)
    if world < 2:
        why = "one GPU: no collective to measure" if device.type == "cuda" else "one rank (--ranks): nothing to measure"
        log(f"  skipped: {why}")
        return {"skipped": why}
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "collectives.json")
        mp.spawn(_rank, args=(world, _free_port(), device.type, SIZES[size], time.time() + budget_s, out, kinds),
                 nprocs=world, join=True)
        rows = json.loads(Path(out).read_text())
    for row in rows:
        log(f"  {row['kind']} {row['nbytes'] / 2**20:.0f} MiB over {world}: {row['busbw_gbps']:.1f} GB/s bus")
    return {"world_size": world, "rows": rows}


def link_file(measured: dict) -> dict | None:
    """The link file of calibrate's measurements (``measured``: calibrate's whole output),
    or None where its collectives section measured nothing (one GPU, not run)."""
    from zerobench.instruments.link import link_file_contents

    rows = (measured.get("collectives") or {}).get("rows") or []
    if not rows:
        return None
    env = measured.get("env", {})
    world = rows[0]["world_size"]
    name = f"measured-{world}x-{str(env.get('name') or env.get('device') or 'device').replace(' ', '-')}"
    return link_file_contents(rows, name, f"zerobench calibrate, collectives over {world} ranks ({env.get('device')})")
