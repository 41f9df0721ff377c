"""The results table: its columns, what each means, and how each should be compared.
(Where a run folder keeps its files is zerobench/runs/folder.py's ``RunFolder``.)

This module is the single place that names the columns, for every tool: a run's
``results.csv``, ``estimate.csv``, ``predict.csv`` and simulate's tables. One quantity has
one name wherever it appears (``step_time_s``, ``peak_active_bytes``, ``exposed_comm_s``,
``overlap_ratio``...); the harness writes them, ``compare`` gates on them, plots draw
them. Folders written before a rename read back under the new names
(:data:`COLUMN_ALIASES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Columns that identify a cell and its configuration. Engine-specific axes
# (sharding_strategy, backward_prefetch, ...) are added as further columns, empty for
# engines that do not have them.
ID_COLUMNS = ("run_id", "cell_id", "status", "error", "note", "engine", "world_size", "dtype", "rank")

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
    Metric("step_time_s", "s", "the step time: a run's median over its measured steps; predict's and simulate's "
           "modelled step", "time"),
    Metric("step_time_p10_s", "s", "10th percentile step time", "time"),
    Metric("step_time_p90_s", "s", "90th percentile step time", "time"),
    Metric("step_time_mad_s", "s", "median absolute deviation of the step times", "context", "none"),
    Metric("throughput_samples_s", "samples/s", "global samples per second (world batch / median step)", "time", "higher"),
    Metric("throughput_tokens_s", "tokens/s", "global tokens per second (gpt only)", "time", "higher"),
    Metric("tflops_per_gpu", "TFLOP/s", "model TFLOP/s per GPU by torchtitan's formula (gpt and llama, runs on a "
           "GPU; [Note: model FLOPs] in zerobench/spec/flops.py)", "time", "higher"),
    Metric("mfu", "", "model FLOPs utilisation: tflops_per_gpu over the card's dense peak for the cell's dtype",
           "time", "higher"),
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
    *(Metric(f"peak_mem_other_{part}_bytes", "B", f"storages of no role live at the peak, {what} (part of other; "
             "[Note: what other holds] in zerobench/instruments/memory.py)", "deterministic")
      for part, what in (("kept", "live when the measured step began"), ("backward", "allocated in backward"),
                         ("optimizer", "allocated in the optimizer step"))),
    Metric("steady_mem_bytes", "B", "live tensor bytes between steps (after zero_grad)", "deterministic"),
    Metric("memory_steps", "", "steps the memory pass measured until every rank's peak was exact (more than "
           "MEMORY_PASS_ATTEMPTS: none was, the peak is an upper bound; [Note: frees on other threads] in "
           "zerobench/instruments/memory.py)", "context", "none"),
    # -- memory (the caching allocator: a run's timing pass on a GPU, empty on CPU; predict's
    #    allocator model). See [Note: allocator peaks] --
    Metric("peak_allocated_bytes", "B", "caching allocator's peak allocated bytes (torch.cuda.max_memory_allocated) "
           "over the measured steps: a block stops counting at free()", "deterministic"),
    Metric("peak_active_bytes", "B", "caching allocator's peak active bytes (active_bytes.all.peak) over the "
           "measured steps: a freed block counts until the streams that used it pass the free; what "
           "limit_all_gathers bounds", "deterministic"),
    Metric("peak_reserved_bytes", "B", "torch.cuda.max_memory_reserved over the measured steps (blocks cached "
           "from cudaMalloc, used or not)", "context"),
    Metric("num_alloc_retries", "", "cudaMalloc retries: the cache freed and retried (memory_stats num_alloc_retries)",
           "deterministic"),
    Metric("num_ooms", "", "out-of-memory events (memory_stats num_ooms)", "deterministic"),
    Metric("rss_max_bytes", "B", "process max RSS (context only: carries ~220 MiB of torch itself)", "context", "none"),
    # -- communication (memory pass, per measured step and rank) --
    Metric("comm_all_gather_bytes", "B", "all-gather bytes per step (size of the gathered output)", "deterministic"),
    Metric("comm_reduce_scatter_bytes", "B", "reduce-scatter bytes per step (size of the full input)", "deterministic"),
    Metric("comm_all_reduce_bytes", "B", "all-reduce bytes per step", "deterministic"),
    Metric("comm_broadcast_bytes", "B", "broadcast bytes per step", "deterministic"),
    Metric("comm_other_bytes", "B", "bytes of other collectives per step (all_to_all, send/recv, ...)", "deterministic"),
    Metric("comm_total_bytes", "B", "sum of the comm_*_bytes columns", "deterministic"),
    Metric("comm_calls", "", "collective calls per step", "deterministic"),
    Metric("comm_all_gather_calls", "", "all-gather calls per step (bytes / calls: their mean size)", "deterministic"),
    Metric("comm_reduce_scatter_calls", "", "reduce-scatter calls per step", "deterministic"),
    Metric("comm_all_reduce_calls", "", "all-reduce calls per step", "deterministic"),
    Metric("comm_broadcast_calls", "", "broadcast calls per step", "deterministic"),
    Metric("comm_other_calls", "", "calls of other collectives per step", "deterministic"),
    # -- set-up --
    Metric("cell_wall_s", "s", "wall time of the whole cell, process start to exit", "context", "none"),
)

# [Note: allocator peaks]
# The CUDA caching allocator keeps three peaks (torch.cuda.memory_stats), recorded as
# peak_allocated_bytes, peak_active_bytes and peak_reserved_bytes (a run on a GPU;
# predict, from the virtual GPU's allocator model). peak_mem_bytes is another instrument:
# the storage tracker's peak of live tensor bytes (the memory pass, estimate), which on a
# device with streams also counts freed-but-in-use storages ([Note: freed but still in
# use] in zerobench/instruments/memory.py), so it is the active peak without the
# allocator's rounding:
#
# * allocated drops when Python frees a tensor (free()), at host time.
# * active also counts a freed block that another stream still uses: a block with a
#   pending record_stream use (an all-gather output freed on the host while compute
#   has not reached the free yet) stays active until an event recorded at the free
#   completes on those streams, and only then goes back to the cache.
# * reserved is what the allocator holds from cudaMalloc, active or cached.
#
# On a GPU the host runs ahead of the device: it frees unit after unit's unsharded
# parameters long before compute has used them, so allocated stays low while the
# memory those units occupy is not reusable. limit_all_gathers bounds exactly that
# figure -- unsharded buffers freed but not yet passed by compute -- so its effect
# shows in active, not in allocated (scripts/gpu-check's limiter step reads active too).

#: Result column -> the caching allocator's statistic (``torch.cuda.memory_stats`` names),
#: for a GPU's ``torch.cuda`` and the virtual GPU alike ([Note: allocator peaks]).
ALLOCATOR_COLUMNS = {
    "peak_allocated_bytes": "allocated_bytes.all.peak",
    "peak_active_bytes": "active_bytes.all.peak",
    "peak_reserved_bytes": "reserved_bytes.all.peak",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
}


def allocator_columns(stats: dict) -> dict:
    """The caching allocator's figures, as result columns, from its ``memory_stats()``."""
    return {column: stats.get(name, 0) for column, name in ALLOCATOR_COLUMNS.items()}


#: The storage tracker's roles at the peak (zerobench/instruments/memory.py, [Note: telling
#: storages apart]) -> the column of their bytes. ``peak_mem_other_bytes`` is everything
#: but the model states: the unsharded parameters, the activations and the rest.
PEAK_ROLE_COLUMNS = {
    "params": "peak_mem_params_bytes",
    "grads": "peak_mem_grads_bytes",
    "optim": "peak_mem_optim_bytes",
    "unsharded": "peak_mem_unsharded_bytes",
    "activations": "peak_mem_activations_bytes",
}


def peak_columns(peak_bytes: int, breakdown: dict[str, int]) -> dict[str, int]:
    """``peak_mem_bytes`` and its composition, as result columns, from the storage tracker's
    peak and its bytes by role (``StorageTracker.peak_breakdown``): the same columns for a
    run's memory pass and an estimate."""
    states = ("params", "grads", "optim")
    return {"peak_mem_bytes": peak_bytes,
            **{PEAK_ROLE_COLUMNS[role]: breakdown[role] for role in states},
            "peak_mem_other_bytes": sum(n for role, n in breakdown.items() if role not in states),
            **{column: breakdown[role] for role, column in PEAK_ROLE_COLUMNS.items() if role not in states}}


#: The model states an engine holds, counted by the rank session at the measured step.
STATE_ROLES = ("params", "grads", "optim")


def state_columns(role: str) -> tuple[str, str]:
    """(bytes column, elements column) of a model state (``state_params_bytes``, ...)."""
    return f"state_{role}_bytes", f"state_{role}_numel"

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "other")


#: Numbers an engine adds per rank through ``Engine.extra_metrics`` (empty for the others).
ENGINE_METRICS: tuple[Metric, ...] = (
    # impl-fsdp's rate limiter (timing pass, summed over the measured steps)
    Metric("limiter_stall_s", "s", "impl-fsdp: time blocked on all-gathers the limiter held back", "context", "none"),
    Metric("limiter_stalls", "", "impl-fsdp: all-gathers the limiter held back", "context", "none"),
    Metric("limiter_overruns", "", "impl-fsdp: all-gathers issued beyond the limiter depth (should be 0)", "context", "none"),
    Metric("max_inflight_all_gathers", "", "impl-fsdp: most all-gathers issued and not yet consumed at once", "context", "none"),
    Metric("all_gathers", "", "impl-fsdp: all-gathers issued over the measured steps", "context", "none"),
    # impl-zero1 / impl-zero2 partitioning
    Metric("zero_partition_imbalance_pct", "%", "impl-zero: largest rank's share over the mean share, minus 1", "context", "none"),
    Metric("zero_rank_numel_count", "", "impl-zero: parameter elements this rank owns", "context", "none"),
)

# -- columns `zerobench analyze` adds after a profiled run. All come from one profiled pass
# of a few steps, under the profiler's overhead: compare them between cells of one run,
# not with the timing pass.
ANALYSIS_METRICS: tuple[Metric, ...] = (
    Metric("overlap_ratio", "", "time computing while communicating / time communicating (HTA); NaN when "
           "nothing was communicated (undefined, not 'all hidden')", "time", "higher"),
    Metric("exposed_comm_s", "s", "per traced step: communication time not covered by compute", "time"),
    Metric("comm_s", "s", "per traced step: communication time (union of comm intervals)", "time"),
    Metric("compute_s", "s", "per traced step: compute time (union of compute intervals)", "time"),
    Metric("idle_s", "s", "per traced step: step - compute - exposed comm (framework overhead, gaps)", "time"),
    Metric("step_trace_s", "s", "mean traced step time (under the profiler)", "context", "none"),
    Metric("trace_steps", "", "steps in the trace", "context", "none"),
    Metric("max_inflight_all_gathers_trace", "", "most all-gathers issued and not yet complete at once", "deterministic", "none"),
    Metric("limiter_wait_s", "s", "per traced step: main thread in impl::rate_limiter_wait (impl engines)", "time"),
    Metric("collective_wait_s", "s", "per traced step: main thread in impl::wait_* (impl engines)", "time"),
    # emulated cells only (zerobench/analysis/profiling/best.py, [Note: best achievable exposed comm])
    Metric("exposed_all_gather_s", "s", "per traced step: main thread waiting on all-gathers (emulated cells)", "time"),
    Metric("best_exposed_all_gather_s", "s", "per traced step: all-gather time no one-ahead prefetch could hide", "time"),
    Metric("exposed_vs_best", "", "exposed_all_gather_s / best_exposed_all_gather_s (1: the best the schedule allows)", "time"),
)


def bandwidth_metrics() -> tuple[Metric, ...]:
    """Per collective kind: ``<kind>_calls_trace``, ``<kind>_bytes_trace``,
    ``<kind>_algbw_median_gbps``, ``<kind>_busbw_median_gbps`` (from ``zerobench analyze``)."""
    out = []
    for kind in COLLECTIVE_KINDS:
        out += [
            Metric(f"{kind}_calls_trace", "", f"{kind} calls per traced step", "deterministic", "none"),
            Metric(f"{kind}_bytes_trace", "B", f"{kind} bytes per traced step (nccl-tests size)", "deterministic", "none"),
            Metric(f"{kind}_algbw_median_gbps", "GB/s", f"median {kind} algorithm bandwidth (bytes / duration)", "time", "higher"),
            Metric(f"{kind}_busbw_median_gbps", "GB/s", f"median {kind} bus bandwidth (nccl-tests factor)", "time", "higher"),
        ]
    return tuple(out)


#: Columns of the what-if tools' tables (estimate.csv, predict.csv, simulate's) that the
#: run's do not already name. A name a run column also has means the same quantity
#: (step_time_s, peak_*_bytes, compute_s, comm_s, exposed_comm_s, overlap_ratio). Every
#: figure of predict and estimate is deterministic (a pure function of the program and the
#: presets), whatever the kind its name has in a run.
WHATIF_METRICS: tuple[Metric, ...] = (
    Metric("max_unsharded_units", "", "predict, simulate: gathered units alive at once at most (peak active bytes of "
           "all-gather outputs over the largest one)", "deterministic"),
    Metric("host_lead_max_s", "s", "predict: how far the compute stream's queue ran ahead of the host at most",
           "deterministic", "higher"),
    Metric("host_blocked_s", "s", "predict: host time spent waiting for the device in the step", "deterministic"),
    Metric("host_busy_s", "s", "predict: host time the step's work cost (operators, stream and collective calls, "
           "Python, work on host memory; [Note: host cost])", "deterministic"),
    Metric("device_busy_s", "s", "predict: time the device was busy in the step (compute, and the communication "
           "nothing hides); a step whose host_busy_s is larger is host-bound", "deterministic"),
    Metric("host_operators_s", "s", "predict: the share of host_busy_s spent dispatching operators (launches, "
           "allocations, foreach lists)", "deterministic"),
    Metric("host_python_s", "s", "predict: the share of host_busy_s spent in Python (frames, lines, generators, "
           "builtins, torch C entries)", "deterministic"),
    Metric("host_streams_s", "s", "predict: the share of host_busy_s spent in stream and event calls",
           "deterministic"),
    Metric("host_collectives_s", "s", "predict: the share of host_busy_s spent issuing and waiting collectives",
           "deterministic"),
    Metric("host_cpu_s", "s", "predict: the share of host_busy_s the CPU spent computing on host memory "
           "(operators on host tensors, pageable copies staged; [Note: host memory])", "deterministic"),
    Metric("host_python_calls", "", "predict: Python function calls of the step the host was charged for (frames "
           "and generator entries)",
           "deterministic"),
    Metric("tokens_per_s", "tokens/s", "predict: tokens per second per GPU (the rank's micro-batch over the step)",
           "time", "higher"),
    Metric("outside_allocator_bytes", "B", "predict: device memory outside the caching allocator (the CUDA context "
           "and each NCCL communicator the engine made)", "deterministic"),
    Metric("capacity_bytes", "B", "predict, estimate --gpu: what the caching allocator may reserve: the card less "
           "outside_allocator_bytes", "deterministic", "higher"),
    *(Metric(column, unit, f"estimate: {role} the engine holds on the rank, distinct storages", "deterministic")
      for role in STATE_ROLES for column, unit in zip(state_columns(role), ("B", ""))),
    Metric("estimate_wall_s", "s", "estimate: wall time of the rank's session", "context", "none"),
    Metric("predict_wall_s", "s", "predict: wall time of the rank's session", "context", "none"),
)

#: Measured steps the memory pass tries for a peak that is exact on every rank; a
#: ``memory_steps`` above it says none was (zerobench/instruments/memory.py,
#: measure_exact_step), and compare does not gate that cell's peaks.
MEMORY_PASS_ATTEMPTS = 8

#: Old column names, read back under their new ones from folders written before a rename.
COLUMN_ALIASES: dict[str, str] = {
    "step_time_median_s": "step_time_s",
    "cuda_peak_allocated_bytes": "peak_allocated_bytes",
    "cuda_peak_active_bytes": "peak_active_bytes",
    "cuda_peak_reserved_bytes": "peak_reserved_bytes",
    "cuda_alloc_retries": "num_alloc_retries",
    "cuda_ooms": "num_ooms",
    "step_s": "step_time_s",
}

#: NVML sampling during the timing pass (GPU only).
GPU_TELEMETRY_METRICS: tuple[Metric, ...] = (
    Metric("gpu_util_mean_pct", "%", "NVML utilization, mean over the timed pass", "context", "none"),
    Metric("gpu_util_max_pct", "%", "NVML utilization, max over the timed pass", "context", "none"),
    Metric("gpu_mem_used_max_bytes", "B", "NVML memory used (whole device), max over the timed pass", "context", "none"),
    Metric("gpu_power_mean_w", "W", "NVML board power, mean over the timed pass", "context", "none"),
    Metric("gpu_power_max_w", "W", "NVML board power, max over the timed pass", "context", "none"),
    Metric("gpu_telemetry_samples", "", "NVML samples taken", "context", "none"),
)

#: Every metric column the suite may write: the core ones, the engines' own, those
#: `zerobench analyze` adds after a profiled run, and GPU telemetry where NVML is present.
METRICS = (CORE_METRICS + ENGINE_METRICS + ANALYSIS_METRICS + bandwidth_metrics() + GPU_TELEMETRY_METRICS
           + WHATIF_METRICS)
METRIC_BY_NAME = {m.name: m for m in METRICS}

#: What each identifying and context column holds (engine axes are documented by the
#: engines' ``Axis.doc``: ``zerobench engines``).
COLUMN_DOCS: dict[str, str] = {
    "run_id": "the run folder's name",
    "cell_id": "engine, world size, dtype and the axes that differ from their defaults",
    "status": "ok, failed or skipped",
    "error": "why the cell failed or was skipped (empty when ok)",
    "note": "what the engine ignored of the cell's settings on this device (Engine.notes; only where any)",
    "engine": "engine name (`zerobench engines`)",
    "world_size": "ranks in the cell",
    "dtype": "fp32 or bf16",
    "rank": "the rank this row measures",
    "workload": "workload name",
    "model": "model kind and its size fields",
    "backend": "gloo or nccl",
    "device": "cpu or cuda",
    "batch_size": "samples per rank per step",
    "steps": "measured steps of the timing pass",
    "emulation": "interconnect emulation, when on",
}

# [Note: types in results.csv]
# results.csv is read with plain ``pandas.read_csv(path)`` and nothing else: what a user's
# notebook gets is what zerobench's own readers get (zerobench.runs.tables.load,
# RunFolder.results, a table built from cells/ in memory alike), on every pandas the
# project allows. The file's convention, for a column whose values can be missing (an axis
# another engine lacks, a metric a failed cell never measured):
#
# * a missing value is an empty field;
# * integers are written as integers; a column with no gap reads as int64, one with gaps
#   as float64 with NaN (pandas' own missing number);
# * booleans are written True / False; a column with no gap reads as bool, one with gaps
#   as object holding True, False and NaN (zerobench's readers hold every boolean column --
#   an engine's on/off axis -- to that, refusing other text: runs/folder.py,
#   booleans_as_read; so flag() need not guess at "true", "1" or "on");
# * strings read as pandas' string type of the version (object or str), NaN when empty.
#
# No reader turns them into pandas' nullable Int64 / boolean: their NA has no truth value
# (``if NA:`` raises), which once crashed the knobs plot on a DDP row's empty limiter
# column. Code that branches on a cell tests it NaN-safely
# (zerobench.analysis.figures.flag, numeric). COLUMN_DTYPES below says what each fixed
# column holds (its logical type), so that writers put 4, not 4.0, in an integer column
# with gaps (zerobench.runs.folder.integers_as_written).

_STRING_COLUMNS = ("run_id", "cell_id", "status", "error", "note", "engine", "dtype", "workload", "model", "backend", "device")
_INTEGER_COLUMNS = ("world_size", "rank", "batch_size", "steps", "memory_steps", "limiter_stalls", "limiter_overruns",
                    "max_inflight_all_gathers", "all_gathers", "comm_calls", "comm_all_gather_calls",
                    "comm_reduce_scatter_calls", "comm_all_reduce_calls", "comm_broadcast_calls", "comm_other_calls",
                    "num_alloc_retries", "num_ooms",
                    "trace_steps") + tuple(m.name for m in CORE_METRICS if m.unit == "B")
COLUMN_DTYPES: dict[str, str] = {**{c: "string" for c in _STRING_COLUMNS}, **{c: "Int64" for c in _INTEGER_COLUMNS}}
