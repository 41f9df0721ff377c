"""All-gathers in flight over time: issued and not yet complete.

This is what a rate limiter bounds (FSDP's ``limit_all_gathers``; impl's
``impl::rate_limiter_wait``): how many unsharded parameter groups can be alive at
once because their all-gathers were issued ahead of use.

* impl engines: each ``impl::all_gather`` span *issues* one, each
  ``impl::wait_all_gather`` span *completes* one when it ends. Counting issues minus
  completed waits needs no pairing, so it stays right when handles are waited out of
  order.
* torch engines (no impl labels): each all-gather is in flight from its ``c10d::``
  issue op on the main thread to the end of its run (gloo worker event or NCCL
  kernel); see :func:`zerobench.analysis.profiling.collective_table.collectives` for the pairing.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from . import intervals as iv
from .collective_table import collectives
from .trace import Trace


def all_gathers_in_flight(trace: Trace) -> pd.DataFrame:
    """Step function: from ``time_s`` on, ``in_flight`` all-gathers are in flight
    (until the next row). Columns: rank, time_s, in_flight, source ("impl" or "c10d")."""
    issued = trace.named("impl::all_gather", main_only=True)
    issued = issued[issued["name"] == "impl::all_gather"]
    if len(issued):
        waits = trace.named("impl::wait_all_gather", main_only=True)
        times, counts = iv.counting(issued["ts"].to_numpy(), waits["end"].to_numpy())
        times = times * 1e-6
        source = "impl"
    else:
        coll = collectives(trace)
        coll = coll[coll["kind"] == "all_gather"]
        starts = coll["issue_s"].fillna(coll["start_s"]).to_numpy()
        times, counts = iv.concurrency(np.column_stack([starts, coll["end_s"].to_numpy()]))
        source = "c10d"
    # A handle waited twice would count twice; never report fewer than none.
    counts = np.maximum(counts, 0)
    return pd.DataFrame({"rank": trace.rank, "time_s": times, "in_flight": counts, "source": source})


def max_all_gathers_in_flight(trace: Trace) -> int:
    """The most all-gathers in flight at once on this rank (0 when there are none)."""
    df = all_gathers_in_flight(trace)
    return int(df["in_flight"].max()) if len(df) else 0
