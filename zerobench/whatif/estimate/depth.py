"""Estimating a deep model from two shallow copies of it.

[Note: depth extrapolation]
Under fake tensors every operator still costs a fraction of a millisecond of Python
dispatch, and one step of Llama 3 8B is about 45,000 of them: some 40 s of CPU per
engine and world size, several minutes for a table. But the blocks of our transformers
are identical, and every quantity the estimate reports for one rank (the peak, each part
of it, the parameters, gradients and optimizer state it holds) grows by the same amount
with each block added, once the model has a few blocks: ``v(L) = v(L1) + (L - L1) *
(v(L2) - v(L1)) / (L2 - L1)``. So for a deep llama or gpt on fake tensors the estimate
runs the model at L1 = 3 and L2 = 4 blocks (``every:K`` checkpointing: 3K and 4K, so
that both hold whole periods of K blocks) and extrapolates every byte and element count
to the workload's depth. Not fewer: with two blocks both are next to the embedding or
the head, and the moment of the peak can differ from a deep model's (seen on a small
Llama under torch-fsdp2: 2 -> 3 blocks adds 48,484 bytes to the peak, every block after
the third 37,156). Checked against full-depth estimates in docs/models.md
("Depth extrapolation") and tests/test_estimate_depth.py.

One thing is not linear in depth: ZeRO stage 1 never splits a parameter, so how many
elements rank r owns depends on how the greedy partition falls at full depth. For
torch-zero1 and impl-zero1 the estimate recomputes that partition for the full model
(on the meta device: sizes only, PyTorch's algorithm, impl/zero/partition.py) and
corrects the optimizer state, which lives through the whole step, by the difference.
"""

from __future__ import annotations

import dataclasses

from zerobench.spec.checkpointing import parse_mode

#: Models whose blocks are identical, so that their estimate is affine in ``layers``.
DEEP_KINDS = ("llama", "gpt")
#: Depth from which a fake-tensor estimate is extrapolated rather than run in full.
EXTRAPOLATE_ABOVE = 4
#: Columns of an estimate row that are extrapolated (bytes and element counts).
_LINEAR_PREFIXES = ("peak_mem_", "state_")


def depths(workload, options: dict) -> tuple[int, int] | None:
    """(L1, L2) to run instead of the workload's depth, or None to run it in full."""
    model = workload.model
    if model.kind not in DEEP_KINDS:
        return None
    kind, k = parse_mode(options.get("activation_checkpointing", "none"))
    period = k if kind == "every" else 1
    low, high = 3 * period, 4 * period
    return (low, high) if model.layers > max(EXTRAPOLATE_ABOVE, high) else None


def extrapolate(low_row: dict, high_row: dict, low: int, high: int, layers: int) -> dict:
    """The row at ``layers`` from the rows at depths ``low`` and ``high`` (both ok)."""
    out = dict(high_row)
    for key, high_value in high_row.items():
        if key.startswith(_LINEAR_PREFIXES) and key.endswith(("_bytes", "_numel")) and high_value is not None:
            low_value = low_row[key]
            out[key] = int(round(low_value + (layers - low) * (high_value - low_value) / (high - low)))
    out["estimate_wall_s"] = low_row.get("estimate_wall_s", 0.0) + high_row.get("estimate_wall_s", 0.0)
    out["depth_from"] = f"{low},{high}"
    return out


def zero1_optimizer_correction(workload, engine: str, world_size: int, rank: int, row: dict) -> dict:
    """``row`` with rank ``rank``'s ZeRO-1 optimizer state set to what the full model's
    partition gives it (see [Note: depth extrapolation]); other engines unchanged."""
    if engine not in ("torch-zero1", "impl-zero1") or not row.get("state_optim_numel"):
        return row
    import torch

    from impl.zero.partition import sorted_greedy_partition
    from zerobench.spec.models import construct

    with torch.device("meta"):
        params = list(construct(workload.model).parameters())
    mine = sorted_greedy_partition([{"params": params}], world_size)[rank][0]["params"]
    # elements of optimizer state per parameter element: Adam's two moments, SGD's momentum
    opt = workload.optimizer
    per_element = 2 if opt.kind in ("adam", "adamw") else (1 if opt.hyper().get("momentum") else 0)
    exact = per_element * sum(p.numel() for p in mine)
    bytes_per_element = row["state_optim_bytes"] / row["state_optim_numel"]
    delta = int(round((exact - row["state_optim_numel"]) * bytes_per_element))
    out = dict(row)
    for key in ("peak_mem_bytes", "peak_mem_optim_bytes", "state_optim_bytes"):
        out[key] = row[key] + delta
    out["state_optim_numel"] = exact
    return out


def at_depth(workload, layers: int):
    """The workload with its model at ``layers`` blocks."""
    return dataclasses.replace(workload, model=dataclasses.replace(workload.model, layers=layers))
