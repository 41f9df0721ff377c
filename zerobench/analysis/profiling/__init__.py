"""Trace analysis for zerobench: parsed torch.profiler traces in, pandas DataFrames out.

Built like Holistic Trace Analysis: parsing in one place (:mod:`.trace`), each
analysis a function of a parsed :class:`Trace`, plotting opt-in (:mod:`.plots`,
imported on demand). From a notebook::

    from zerobench.analysis import profiling as zp
    t = zp.load_trace("results/<run>/traces/<cell>/rank0.json.gz")
    zp.step_breakdown(t)             # compute / exposed comm / idle per step
    zp.comm_comp_overlap(t)          # HTA's overlap ratio
    zp.collectives(t)                # bytes, duration, algbw, busbw per collective
    zp.all_gathers_in_flight(t)      # step function over time

Definitions and caveats: docs/profiling.md.
"""

from zerobench.instruments.telemetry import GpuTelemetry

from .collective_table import algbw_gbps, bandwidth_summary, bus_factor, busbw_gbps, collectives
from .inflight import all_gathers_in_flight, max_all_gathers_in_flight
from .overlap import (
    comm_comp_overlap,
    comm_intervals,
    compute_intervals,
    overlap_summary,
    step_breakdown,
    step_windows,
)
from .trace import Trace, load_trace

__all__ = [
    "Trace", "load_trace",
    "comm_intervals", "compute_intervals", "step_windows", "step_breakdown", "comm_comp_overlap", "overlap_summary",
    "collectives", "bandwidth_summary", "algbw_gbps", "busbw_gbps", "bus_factor",
    "all_gathers_in_flight", "max_all_gathers_in_flight",
    "GpuTelemetry",
]
