"""What else the machine did while a run measured: its load averages, and how many of its
cores other processes kept busy.

[Note: machine load]
On a shared machine a step time measures the machine as much as the engine: the same
quickstart cell was 1.51x DDP in one run and 3.37x ten minutes later on the same 2-core VM.
So each cell records what the machine did around it (``machine_load`` in its cells/ record)
and the run sums it up in meta.json (``machine_load``):

* ``load_start``, ``load_end``: the 1, 5 and 15 minute load averages (``os.getloadavg``),
  which count this run's own ranks too;
* ``other_cpu_cores``: the CPU time that processes other than the run (the harness and the
  rank processes it waited for) used on the CPUs this process may run on, divided by the
  wall time: how many cores others kept busy on average. It is the machine's busy time from
  /proc/stat (user, nice, system, irq and softirq of those CPUs) less the run's own
  (``getrusage`` of the harness and of its children); None where /proc/stat is absent.

A run is *loaded* when others kept more than LOADED_FRACTION of the cores busy, on average
over its measured cells: on 2 cores, more than half a core. ``zerobench run`` and
``zerobench show`` then say so, and its step times (and their ratios to DDP, which carry
their p10-p90 spread: [Note: ratio spread] in zerobench/analysis/summary.py) are to be
read as contended. Memory, bytes and losses do not depend on the load.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

#: Share of the machine's cores that other processes may keep busy, on average, before a run
#: counts as loaded ([Note: machine load]).
LOADED_FRACTION = 0.25


@dataclass(frozen=True)
class LoadSample:
    """The machine at one moment ([Note: machine load])."""

    wall_s: float
    """time.monotonic()"""
    loadavg: tuple[float, float, float] | None
    busy_s: float | None
    """CPU seconds the CPUs of this process's affinity have been busy since boot, every process's."""
    own_s: float
    """CPU seconds of this process and of its children that have ended."""
    cpus: int


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def sample() -> LoadSample:
    """The machine now."""
    try:
        loadavg = tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        loadavg = None
    own = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for field in ("ru_utime", "ru_stime"))
    return LoadSample(time.monotonic(), loadavg, _busy_seconds(), own, cpus())


def _busy_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """Busy CPU seconds of the CPUs this process may run on (user, nice, system, irq,
    softirq; not idle, iowait or steal), from /proc/stat; None without it."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        lines = stat.read_text().splitlines()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (allowed is not None and int(name[3:]) not in allowed):
            continue
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
        busy += user + nice + system + irq + softirq
    return busy / ticks


def between(start: LoadSample, end: LoadSample) -> dict:
    """What the machine did from ``start`` to ``end``: the figures of [Note: machine load]."""
    wall = max(end.wall_s - start.wall_s, 1e-9)
    others = None
    if start.busy_s is not None and end.busy_s is not None:
        others = round(max((end.busy_s - start.busy_s) - (end.own_s - start.own_s), 0.0) / wall, 3)
    return {"wall_s": round(wall, 3), "load_start": start.loadavg, "load_end": end.loadavg,
            "other_cpu_cores": others, "cpus": end.cpus}


def summarize(per_cell: list[dict], start: LoadSample | None = None, end: LoadSample | None = None) -> dict:
    """The run's ``machine_load`` (meta.json) from its cells': others' CPU time over the
    cells' wall time, the worst cell, and whether that makes the run loaded."""
    cells = [c for c in per_cell if c and c.get("other_cpu_cores") is not None and c.get("wall_s")]
    n = (end or start).cpus if (end or start) else max([c.get("cpus") or 0 for c in per_cell] + [cpus()])
    wall = sum(c["wall_s"] for c in cells)
    mean = round(sum(c["other_cpu_cores"] * c["wall_s"] for c in cells) / wall, 3) if wall else None
    threshold = LOADED_FRACTION * n
    return {"load_start": start.loadavg if start else None, "load_end": end.loadavg if end else None,
            "other_cpu_cores": mean, "other_cpu_cores_max": max((c["other_cpu_cores"] for c in cells), default=None),
            "cells_sampled": len(cells), "cpus": n, "loaded_above_cores": threshold,
            "loaded": bool(mean is not None and mean > threshold)}


def verdict(machine_load: dict | None) -> str | None:
    """One line saying the run was measured on a loaded machine, or None ([Note: machine load])."""
    if not machine_load or not machine_load.get("loaded"):
        return None
    n, mean = machine_load.get("cpus"), machine_load.get("other_cpu_cores")
    worst = machine_load.get("other_cpu_cores_max")
    threshold = machine_load.get("loaded_above_cores", LOADED_FRACTION * (n or 1))
    return (f"warning: a loaded machine: other processes kept {mean:.2f} of its {n} cores busy on average during the "
            f"cells ({worst:.2f} at the worst cell; loaded above {threshold:g}, {LOADED_FRACTION:.0%} of the cores). "
            f"Step times and their ratios to DDP are contended: read the ratios with their p10-p90 spread; memory, "
            f"bytes and losses are not affected")
