"""Before a cell starts: will its model states fit? Refuse the ones that cannot.

A workload with ``model.width = 100000000000`` validates (it is a positive integer) and
would only fail once every rank tries to allocate it. The preflight counts the model's
parameters on the meta device (no memory), takes the per-rank bytes of parameters,
gradients and optimizer state from the ZeRO paper's formulas for the cell's engine and
world size (:mod:`zerobench.estimate.analytic`), and compares them with what the ranks
of one machine can have: the device's memory on CUDA, the host's memory divided among
the local ranks on CPU. Activations, buffers and the allocator's slack come on top, so a
cell that passes may still run out of memory; one that fails cannot fit. For a better
figure, `zerobench estimate` runs one rank of the real engine on fake tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from zerobench.estimate.analytic import engine_model_state_bytes
from zerobench.matrix import Cell
from zerobench.models import construct
from zerobench.workload import Workload

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
        return _count_by_formula(workload.model)


def _count_by_formula(cfg) -> int:
    """The parameter count of zerobench.models' MLP, GPT and Llama, written out."""
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


def host_memory_bytes() -> float:
    """Physical memory of this machine."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float("inf")


def cell_need(workload: Workload, cell: Cell, device_type: str, params: int | None = None) -> Need:
    params = parameter_count(workload) if params is None else params
    optimizer = _OPTIMIZERS.get(workload.optimizer.kind, "adam")
    if workload.optimizer.kind == "sgd" and not float(workload.optimizer.hyper().get("momentum", 0) or 0):
        optimizer = "sgd"
    precision = "fp32" if cell.dtype == "fp32" else "mixed"
    need = engine_model_state_bytes(cell.engine, cell.opts, cell.world_size, params, optimizer, precision)["total"]
    if device_type == "cuda" and torch.cuda.is_available():
        available = float(torch.cuda.get_device_properties(0).total_memory)
        where = f"the GPU's {available / GiB:.1f} GiB"
    else:
        local_ranks = cell.world_size  # every rank of a cell started here runs on this machine
        available = host_memory_bytes() / local_ranks
        where = f"{available / GiB:.1f} GiB per rank ({host_memory_bytes() / GiB:.1f} GiB of host memory " \
                f"for {local_ranks} ranks)"
    return Need(params, need, available, where)


def refusal(workload: Workload, cell: Cell, device_type: str, params: int | None = None) -> str | None:
    """Why the cell cannot fit, naming both numbers; None when it may."""
    need = cell_need(workload, cell, device_type, params)
    if need.fits:
        return None
    return (f"preflight: {cell.id} needs {need.need_bytes / GiB:,.1f} GiB per rank for parameters, gradients "
            f"and optimizer state alone ({need.params:,} parameters, {cell.engine} at world size "
            f"{cell.world_size}, {cell.dtype}), more than {need.where}; not started")
