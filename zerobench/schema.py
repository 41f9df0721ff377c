"""The results table: its columns, what each means, and how each should be compared.

One run is one folder ``results/<run-id>/``::

    meta.json        workload, git commit, torch version, backend, machine, date, command line
    workload.toml    the fully resolved workload the run used
    cells/<cell>.json   one file per cell: status, config, per-rank metrics, per-step series
    results.csv      the tidy table: one row per cell x rank (built from cells/)
    steps.csv        one row per cell x rank x measured step: step time and loss
    plots/*.png

Every file is written atomically (temporary file + rename), so a killed run leaves
only whole files behind and ``--resume`` can trust what it finds.

This module is the single place that names the columns; the harness writes them,
``compare`` gates on them, plots draw them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Columns that identify a cell and its configuration. Engine-specific axes
# (sharding_strategy, backward_prefetch, ...) are added as further columns, empty for
# engines that do not have them.
ID_COLUMNS = ("run_id", "cell_id", "status", "error", "engine", "world_size", "dtype", "rank")

#: Fixed configuration columns that come from the workload, not the matrix.
CONTEXT_COLUMNS = ("workload", "model", "backend", "device", "batch_size", "steps", "emulation")


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    doc: str
    kind: Literal["time", "deterministic", "context"]
    """time: noisy, gate on medians with a spread-aware rule; deterministic: the same
    on every run on the same machine and software (tracker memory, bytes, losses on
    CPU), gate exactly or within a tight tolerance; context: recorded, never gated."""
    better: Literal["lower", "higher", "none"] = "lower"


#: What every cell of every run has (CUDA columns empty on CPU).
CORE_METRICS: tuple[Metric, ...] = (
    # -- time (timing pass; warm-up excluded) --
    Metric("step_time_median_s", "s", "median step time over the measured steps", "time"),
    Metric("step_time_p10_s", "s", "10th percentile step time", "time"),
    Metric("step_time_p90_s", "s", "90th percentile step time", "time"),
    Metric("step_time_mad_s", "s", "median absolute deviation of the step times", "context", "none"),
    Metric("throughput_samples_s", "samples/s", "global samples per second (world batch / median step)", "time", "higher"),
    Metric("throughput_tokens_s", "tokens/s", "global tokens per second (gpt only)", "time", "higher"),
    # -- losses (timing pass) --
    Metric("loss_first", "", "loss of the first measured step on this rank", "deterministic", "none"),
    Metric("loss_last", "", "loss of the last measured step on this rank", "deterministic", "none"),
    Metric("loss_max_abs_diff_ref", "", "max |mean-over-ranks loss - single-process reference loss| over all steps", "deterministic"),
    # -- memory (memory pass: tensor-storage tracker, all devices) --
    Metric("peak_mem_bytes", "B", "peak live tensor bytes during the measured step(s)", "deterministic"),
    Metric("peak_mem_params_bytes", "B", "parameter bytes live at the peak (sharded where the engine shards)", "deterministic"),
    Metric("peak_mem_grads_bytes", "B", "gradient bytes live at the peak", "deterministic"),
    Metric("peak_mem_optim_bytes", "B", "optimizer-state bytes live at the peak", "deterministic"),
    Metric("peak_mem_other_bytes", "B", "everything else live at the peak: activations, unsharded parameters, comm buffers", "deterministic"),
    Metric("peak_mem_unsharded_bytes", "B", "all-gather outputs (unsharded parameters) live at the peak (part of other)", "deterministic"),
    Metric("peak_mem_activations_bytes", "B", "storages allocated in forward and live at the peak (part of other)", "deterministic"),
    Metric("steady_mem_bytes", "B", "live tensor bytes between steps (after zero_grad)", "deterministic"),
    # -- memory (CUDA allocator, timing pass; empty on CPU) --
    Metric("cuda_peak_allocated_bytes", "B", "torch.cuda.max_memory_allocated over the measured steps", "deterministic"),
    Metric("cuda_peak_reserved_bytes", "B", "torch.cuda.max_memory_reserved over the measured steps", "context"),
    Metric("cuda_alloc_retries", "", "cudaMalloc retries (num_alloc_retries)", "deterministic"),
    Metric("cuda_ooms", "", "out-of-memory events (num_ooms)", "deterministic"),
    Metric("rss_max_bytes", "B", "process max RSS (context only: carries ~220 MiB of torch itself)", "context", "none"),
    # -- communication (memory pass, per measured step and rank) --
    Metric("comm_all_gather_bytes", "B", "all-gather bytes per step (size of the gathered output)", "deterministic"),
    Metric("comm_reduce_scatter_bytes", "B", "reduce-scatter bytes per step (size of the full input)", "deterministic"),
    Metric("comm_all_reduce_bytes", "B", "all-reduce bytes per step", "deterministic"),
    Metric("comm_broadcast_bytes", "B", "broadcast bytes per step", "deterministic"),
    Metric("comm_other_bytes", "B", "bytes of other collectives per step (all_to_all, send/recv, ...)", "deterministic"),
    Metric("comm_total_bytes", "B", "sum of the comm_*_bytes columns", "deterministic"),
    Metric("comm_calls", "", "collective calls per step", "deterministic"),
    # -- set-up --
    Metric("cell_wall_s", "s", "wall time of the whole cell, process start to exit", "context", "none"),
)

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "other")


def _with_analysis_metrics() -> tuple[Metric, ...]:
    # The profiling layer defines its own columns next to the code that computes them.
    from zerobench.profiling.columns import ANALYSIS_METRICS, GPU_TELEMETRY_METRICS, bandwidth_metrics

    return CORE_METRICS + ANALYSIS_METRICS + bandwidth_metrics() + GPU_TELEMETRY_METRICS


#: Every column the suite may write: the core ones, those `zerobench analyze` adds after a
#: profiled run, and GPU telemetry where NVML is present.
METRICS = _with_analysis_metrics()
METRIC_BY_NAME = {m.name: m for m in METRICS}
