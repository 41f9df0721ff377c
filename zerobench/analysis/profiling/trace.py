"""Parsing: a torch.profiler Chrome trace (plain or gzipped JSON) into a tidy table.

The one place that reads trace files, as ``hta/common/trace_parser.py`` is for
Holistic Trace Analysis. Every analysis in this package is a function of the
:class:`Trace` returned by :func:`load_trace`, so a notebook can call them directly::

    from zerobench.analysis.profiling import load_trace, overlap_summary
    t = load_trace("results/<run>/traces/<cell>/rank0.json.gz")
    t.events.query("name.str.startswith('gloo:')")

Times stay in the trace's unit, microseconds, relative to the first event of the
trace (``ts``, ``dur``, ``end``); analyses report seconds.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass, field

import pandas as pd

# Labels the project puts on the main thread (see zerobench/engines/base.py and impl/comm.py).
STEP_LABEL = "zerobench::step"
PHASE_LABELS = ("zerobench::forward", "zerobench::backward", "zerobench::optimizer")


@dataclass
class Trace:
    """One rank's trace."""

    events: pd.DataFrame
    """Complete events (``ph == "X"``), sorted by ``ts``: name, cat, ts, dur, end, pid,
    tid, args (the event's ``args`` dict, ``{}`` when absent)."""
    main_tid: int | None
    """Thread that ran the training loop (see :func:`find_main_thread`)."""
    rank: int | None
    world_size: int | None
    thread_names: dict = field(default_factory=dict)
    """tid -> thread name, from the trace's metadata events."""
    path: str | None = None
    meta: dict = field(default_factory=dict)
    """The trace's top-level fields other than the events (distributedInfo, ...)."""
    base_ts: float = 0.0
    """The absolute ``ts`` (microseconds) that ``ts == 0`` stands for."""

    @property
    def main(self) -> pd.DataFrame:
        """Events on the main thread."""
        return self.events[self.events["tid"] == self.main_tid]

    def named(self, prefix: str, main_only: bool = False) -> pd.DataFrame:
        """Events whose name starts with ``prefix``."""
        ev = self.main if main_only else self.events
        return ev[ev["name"].str.startswith(prefix)]


def read_trace_json(path: str | os.PathLike) -> dict:
    """The trace file as a dict (``{"traceEvents": [...]}`` for a bare list)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        magic = f.read(2)
    opener = gzip.open if magic == b"\x1f\x8b" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return {"traceEvents": data} if isinstance(data, list) else data


def load_trace(source, rank: int | None = None) -> Trace:
    """Parse a trace file (path, ``.json`` or ``.json.gz``) or an already-read dict."""
    path = None
    if isinstance(source, dict):
        data = source
    else:
        path = os.fspath(source)
        data = read_trace_json(path)
    raw = data.get("traceEvents", [])

    thread_names = {}
    rows = []
    for e in raw:
        ph = e.get("ph")
        if ph == "M" and e.get("name") == "thread_name":
            # torch writes a name per tid; keep the most specific one (gloo's runloop).
            name = (e.get("args") or {}).get("name", "")
            if e.get("tid") not in thread_names or "python" in thread_names[e.get("tid")]:
                thread_names[e.get("tid")] = name
        if ph != "X" or not isinstance(e.get("ts"), (int, float)):
            continue
        rows.append(
            (e.get("name", ""), e.get("cat", ""), float(e["ts"]), float(e.get("dur", 0.0)),
             e.get("pid"), e.get("tid"), e.get("args") or {})
        )
    events = pd.DataFrame(rows, columns=["name", "cat", "ts", "dur", "pid", "tid", "args"])
    # Drop the profiler's own whole-trace span, which would cover everything.
    events = events[events["cat"] != "Trace"]
    base_ts = float(events["ts"].min()) if len(events) else 0.0
    events["ts"] = events["ts"] - base_ts
    events["end"] = events["ts"] + events["dur"]
    events = events.sort_values(["ts", "end"], ascending=[True, False], kind="stable").reset_index(drop=True)

    info = data.get("distributedInfo") or {}
    if rank is None:
        rank = info.get("rank")
    if rank is None and path is not None:
        m = re.search(r"rank(\d+)", os.path.basename(path))
        rank = int(m.group(1)) if m else None
    meta = {k: v for k, v in data.items() if k != "traceEvents"}
    return Trace(
        events=events,
        main_tid=find_main_thread(events),
        rank=rank,
        world_size=info.get("world_size"),
        thread_names=thread_names,
        path=path,
        meta=meta,
        base_ts=base_ts,
    )


def find_main_thread(events: pd.DataFrame):
    """The thread that ran the training loop: the one with ``zerobench::step`` spans,
    else with the phase labels, else the one with the most ``cpu_op`` events (the
    autograd engine runs CPU backward on the calling thread, so this is also the
    thread that runs backward)."""
    if len(events) == 0:
        return None
    for labels in ((STEP_LABEL,), PHASE_LABELS):
        tids = events.loc[events["name"].isin(labels), "tid"]
        if len(tids):
            return tids.mode().iloc[0]
    ops = events.loc[events["cat"] == "cpu_op", "tid"]
    return (ops if len(ops) else events["tid"]).mode().iloc[0]
