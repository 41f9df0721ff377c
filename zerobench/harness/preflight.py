"""Before a cell starts: can this machine hold its ranks, and will its model states and
its batch fit? Refuse the ones that cannot.

A workload with ``model.width = 100000000000`` validates (it is a positive integer) and
would only fail once every rank tries to allocate it. The preflight counts the model's
parameters on the meta device (no memory), takes the per-rank bytes of parameters,
gradients and optimizer state from the ZeRO paper's formulas for the cell's engine and
world size (:mod:`zerobench.engines.stages`), and compares them with what the ranks
of one machine can have: the device's memory on CUDA, the host's memory divided among
the local ranks on CPU. Activations, buffers and the allocator's slack come on top, so a
cell that passes may still run out of memory; one that fails cannot fit. For a better
figure, `zerobench estimate` runs one rank of the real engine on fake tensors.

The same holds for what comes on top, counted as lower bounds: every rank is a process
holding Python and torch before any model (RANK_BASE_BYTES) and a few threads; one step
holds its batch's inputs, targets and one activation per block; the single-process loss
reference trains the unsharded model on the global batch in the harness itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from zerobench.engines.stages import engine_model_state_bytes
from zerobench.spec.cell import Cell
from zerobench.spec.models import construct
from zerobench.spec.workload import Workload

GiB = 2**30

#: analytic optimizer names by the workload's optimizer kind
_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd-momentum"}


@dataclass(frozen=True)
class Need:
    """Per-rank model-state bytes of a cell, and the memory one rank may use."""

    params: int
    need_bytes: float
    available_bytes: float
    where: str

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.available_bytes


def parameter_count(workload: Workload) -> int:
    """Parameters of the workload's model, counted on the meta device (nothing allocated);
    by formula for a model too large even for meta tensors' size arithmetic."""
    try:
        with torch.device("meta"):
            model = construct(workload.model)
        return sum(p.numel() for p in model.parameters())
    except RuntimeError:  # "Storage size calculation overflowed": more than 2^63 bytes
        if workload.model.kind not in ("mlp", "gpt", "llama"):
            raise  # a user's model: its own error, never "too large" (a factory's becomes a WorkloadError)
        return _count_by_formula(workload.model)


def _count_by_formula(cfg) -> int:
    """The parameter count of zerobench.spec.models' MLP, GPT and Llama, written out."""
    if cfg.kind == "mlp":
        return (cfg.depth + 1) * (cfg.width * cfg.width + cfg.width)
    if cfg.kind == "llama":
        d, kv = cfg.d_model, cfg.kv_heads * (cfg.d_model // cfg.heads)
        block = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * cfg.ffn_hidden
        return cfg.vocab * d + cfg.layers * block + d + (0 if cfg.tie_embeddings else d * cfg.vocab)
    if cfg.kind != "gpt":
        raise ValueError(f"model.kind {cfg.kind!r}: too large to count on the meta device")
    d, hidden = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * hidden + hidden) + (hidden * d + d)
    return cfg.vocab * d + cfg.seq_len * d + cfg.layers * block + 2 * d + d * cfg.vocab


#: Resident memory of a rank before its model: Python and torch (rss_max_bytes of the
#: smallest cells is about 220 MiB on torch 2.13 CPU).
RANK_BASE_BYTES = 200 * 2**20
#: Threads of a CPU rank at the least (main, gloo's, the profiler's): what process limits count.
RANK_THREADS = 4


def host_memory_bytes() -> float:
    """Memory this machine's processes may use: physical memory, or the cgroup's limit when lower."""
    try:
        physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        physical = float("inf")
    return min(physical, _cgroup_limit("memory.max"))


def process_limit() -> float:
    """How many processes and threads this user may run (RLIMIT_NPROC, the cgroup's pids.max)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        nproc = float("inf") if soft == resource.RLIM_INFINITY or os.geteuid() == 0 else float(soft)
    except (ImportError, ValueError, OSError, AttributeError):
        nproc = float("inf")
    return min(nproc, _cgroup_limit("pids.max"))


def _cgroup_limit(name: str) -> float:
    try:
        text = open(f"/sys/fs/cgroup/{name}").read().strip()
    except OSError:
        return float("inf")
    return float("inf") if text == "max" else float(text)


def batch_bytes(model, samples: int) -> float:
    """A lower bound on what one training step over ``samples`` samples holds besides the
    model states: its inputs and targets and one fp32 activation per block (and, for
    the GPT and Llama, the logits). A model given by a factory or a Hugging Face config has
    no shape keys here: its bound is its token ids and targets, or nothing."""
    if model.kind == "mlp":
        return float(samples) * model.width * 4 * (2 + model.depth)
    shape = [getattr(model, key, None) for key in ("seq_len", "d_model", "layers", "vocab")]
    if None in shape:
        seq_len = shape[0] or dict(getattr(model, "kwargs", ())).get("seq_len") or 0
        return float(samples) * seq_len * 2 * 8
    seq_len, d_model, layers, vocab = shape
    return float(samples) * seq_len * (2 * 8 + 4 * d_model * layers + 4 * vocab)


def cell_need(workload: Workload, cell: Cell, device_type: str, params: int | None = None) -> Need:
    params = parameter_count(workload) if params is None else params
    optimizer = _OPTIMIZERS.get(workload.optimizer.kind, "adam")
    if workload.optimizer.kind == "sgd" and not float(workload.optimizer.hyper().get("momentum", 0) or 0):
        optimizer = "sgd"
    precision = "fp32" if cell.dtype == "fp32" else "mixed"
    need = engine_model_state_bytes(cell.engine, cell.opts, cell.world_size, params, optimizer, precision,
                                    shard_group_size=cell.shard_group_size)["total"]
    if device_type == "cuda" and torch.cuda.is_available():
        available = float(torch.cuda.get_device_properties(0).total_memory)
        where = f"the GPU's {available / GiB:.1f} GiB"
    else:
        local_ranks = cell.world_size  # every rank of a cell started here runs on this machine
        available = host_memory_bytes() / local_ranks
        where = f"{available / GiB:.1f} GiB per rank ({host_memory_bytes() / GiB:.1f} GiB of host memory " \
                f"for {local_ranks} ranks)"
    return Need(params, need, available, where)


#: Bytes per parameter of the model as every rank builds it: fp32, on the host (build_model).
BUILD_BYTES_PER_PARAM = 4


def build_refusal(cell: Cell, params: int) -> str | None:
    """Why this machine's host memory cannot hold the cell's ranks while they build the
    model, naming both numbers; None when it can.

    Every rank builds the whole model, in fp32, on the host (zerobench/spec/models.py's
    ``build_model``) before moving it to its device and sharding it, once per pass (the
    passes one after the other), whatever the engine shards later. All ranks of a cell
    run on this machine, so they build at once: Llama 3 70B at 8 ranks needs about 2.2 TB
    of host memory, and a node short of it kills a rank with signal 9 mid-build."""
    n = cell.world_size  # every rank of a cell started here runs on this machine
    per_rank = RANK_BASE_BYTES + params * BUILD_BYTES_PER_PARAM
    memory = host_memory_bytes()
    if n * per_rank <= memory:
        return None
    return (f"preflight: {cell.id} builds its whole model ({params:,} parameters) in fp32 on the host in each of "
            f"its {n} rank(s) before sharding it: {n * per_rank / GiB:,.1f} GiB of host memory at once "
            f"({per_rank / GiB:,.1f} GiB per rank), more than this machine's {memory / GiB:,.1f} GiB; not started "
            f"(fewer ranks per machine, or `zerobench estimate`, which builds on fake tensors)")


def refusal(workload: Workload, cell: Cell, device_type: str, params: int | None = None) -> str | None:
    """Why the cell cannot run here, naming both numbers; None when it may."""
    ranks = ranks_refusal(cell, workload.run.threads_per_rank)
    if ranks is not None:
        return ranks
    params = parameter_count(workload) if params is None else params
    need = cell_need(workload, cell, device_type, params)
    if not need.fits:
        return (f"preflight: {cell.id} needs {need.need_bytes / GiB:,.1f} GiB per rank for parameters, gradients "
                f"and optimizer state alone ({need.params:,} parameters, {cell.engine} at world size "
                f"{cell.world_size}, {cell.dtype}), more than {need.where}; not started")
    batch = batch_bytes(workload.model, workload.data.batch_size)
    if need.need_bytes + batch > need.available_bytes:
        return (f"preflight: {cell.id} needs at least {(need.need_bytes + batch) / GiB:,.1f} GiB per rank: "
                f"{batch / GiB:,.1f} GiB for one step over its batch of {workload.data.batch_size:,} samples "
                f"(inputs, targets, one activation per block) besides {need.need_bytes / GiB:,.1f} GiB of model "
                f"states, more than {need.where}; not started")
    return build_refusal(cell, params)


def ranks_refusal(cell: Cell, threads_per_rank: int = 1) -> str | None:
    """Why this machine cannot hold the cell's rank processes at all, naming both numbers;
    each rank runs ``threads_per_rank`` compute threads (run.threads_per_rank) besides its
    own RANK_THREADS."""
    n = cell.world_size
    per_rank = RANK_THREADS + threads_per_rank - 1  # the main thread is one of RANK_THREADS
    memory = host_memory_bytes()
    if n * RANK_BASE_BYTES > memory:
        return (f"preflight: world size {n} needs {n} rank processes of at least {RANK_BASE_BYTES / 2**20:.0f} MiB "
                f"each (Python and torch, before any model): {n * RANK_BASE_BYTES / GiB:,.1f} GiB, more than this "
                f"machine's {memory / GiB:,.1f} GiB; not started")
    limit = process_limit()
    if n * per_rank > limit:
        return (f"preflight: world size {n} needs at least {n * per_rank:,} processes and threads "
                f"({per_rank} per rank, run.threads_per_rank = {threads_per_rank}), more than this user's limit of "
                f"{limit:,.0f} (ulimit -u, pids.max); not started")
    return None


def reference_refusal(workload: Workload, world_size: int, params: int | None = None) -> str | None:
    """Why the single-process loss reference at ``world_size`` cannot fit in the harness."""
    params = parameter_count(workload) if params is None else params
    optimizer = _OPTIMIZERS.get(workload.optimizer.kind, "adam")
    states = engine_model_state_bytes("ddp", {}, 1, params, optimizer, "fp32")["total"]
    samples = workload.data.batch_size * world_size
    need = states + batch_bytes(workload.model, samples)
    memory = host_memory_bytes()
    if need <= memory:
        return None
    return (f"preflight: the single-process loss reference at world size {world_size} (one process, the global "
            f"batch of {samples:,} samples) needs at least {need / GiB:,.1f} GiB, more than this machine's "
            f"{memory / GiB:,.1f} GiB; not computed (run.reference = false skips it)")
