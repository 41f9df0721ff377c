"""The columns ``zerobench analyze`` adds to results.csv, as :class:`zerobench.schema.Metric`.

Kept here so the schema can take them in one line (``METRICS += ANALYSIS_METRICS``)
once the harness does. All come from one profiled pass of a few steps, under the
profiler's overhead: compare them between cells of one run, not with the timing pass.
Per-kind bandwidth columns (``<kind>_calls_trace``, ``<kind>_bytes_trace``,
``<kind>_algbw_median_gbps``, ``<kind>_busbw_median_gbps`` for kind in
``zerobench.schema.COLLECTIVE_KINDS``) are listed by :func:`bandwidth_metrics`.
"""

from __future__ import annotations

from zerobench.schema import COLLECTIVE_KINDS, Metric

ANALYSIS_METRICS: tuple[Metric, ...] = (
    Metric("overlap_ratio", "", "traced steps: time computing while communicating / time communicating (HTA)", "time", "higher"),
    Metric("exposed_comm_s", "s", "per traced step: communication time not covered by compute", "time"),
    Metric("comm_s", "s", "per traced step: communication time (union of comm intervals)", "time"),
    Metric("compute_s", "s", "per traced step: compute time (union of compute intervals)", "time"),
    Metric("idle_s", "s", "per traced step: step - compute - exposed comm (framework overhead, gaps)", "time"),
    Metric("step_trace_s", "s", "mean traced step time (under the profiler)", "context", "none"),
    Metric("trace_steps", "", "steps in the trace", "context", "none"),
    Metric("max_inflight_all_gathers_trace", "", "most all-gathers issued and not yet complete at once", "deterministic", "none"),
    Metric("limiter_wait_s", "s", "per traced step: main thread in impl::rate_limiter_wait (impl engines)", "time"),
    Metric("collective_wait_s", "s", "per traced step: main thread in impl::wait_* (impl engines)", "time"),
    # emulated cells only (zerobench/profiling/best.py, [Note: best achievable exposed comm])
    Metric("exposed_all_gather_s", "s", "per traced step: main thread waiting on all-gathers (emulated cells)", "time"),
    Metric("best_exposed_all_gather_s", "s", "per traced step: all-gather time no one-ahead prefetch could hide", "time"),
    Metric("exposed_vs_best", "", "exposed_all_gather_s / best_exposed_all_gather_s (1: the best the schedule allows)", "time"),
)


def bandwidth_metrics() -> tuple[Metric, ...]:
    out = []
    for kind in COLLECTIVE_KINDS:
        out += [
            Metric(f"{kind}_calls_trace", "", f"{kind} calls per traced step", "deterministic", "none"),
            Metric(f"{kind}_bytes_trace", "B", f"{kind} bytes per traced step (nccl-tests size)", "deterministic", "none"),
            Metric(f"{kind}_algbw_median_gbps", "GB/s", f"median {kind} algorithm bandwidth (bytes / duration)", "time", "higher"),
            Metric(f"{kind}_busbw_median_gbps", "GB/s", f"median {kind} bus bandwidth (nccl-tests factor)", "time", "higher"),
        ]
    return tuple(out)


GPU_TELEMETRY_METRICS: tuple[Metric, ...] = (
    Metric("gpu_util_mean_pct", "%", "NVML utilization, mean over the timed pass", "context", "none"),
    Metric("gpu_util_max_pct", "%", "NVML utilization, max over the timed pass", "context", "none"),
    Metric("gpu_mem_used_max_bytes", "B", "NVML memory used (whole device), max over the timed pass", "context", "none"),
    Metric("gpu_power_mean_w", "W", "NVML board power, mean over the timed pass", "context", "none"),
    Metric("gpu_power_max_w", "W", "NVML board power, max over the timed pass", "context", "none"),
    Metric("gpu_telemetry_samples", "", "NVML samples taken", "context", "none"),
)
