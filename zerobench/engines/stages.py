"""Model-state memory per rank, as the ZeRO paper counts it (Rajbhandari et al., arXiv 1910.02054, §3 and Figure 1).

Pure Python: anyone can call it without torch. For Ψ parameters, N data-parallel ranks
and an optimizer with K bytes of state per parameter, the bytes per rank are::

    stage 0 (DDP):            (P + G + K) Ψ
    stage 1 (P_os):           (P + G) Ψ + K Ψ / N
    stage 2 (P_os+g):         P Ψ + (G + K) Ψ / N
    stage 3 (P_os+g+p):       (P + G + K) Ψ / N

with P and G the bytes of one parameter and one gradient element. Two precisions:
``"mixed"`` is the paper's (fp16 parameters and gradients, P = G = 2; the fp32 master
copy belongs to K, so K = 12 for Adam); ``"fp32"`` is what this project's engines keep in
both of their dtypes (fp32 parameters, fp32 gradients, P = G = 4; K = 8 for Adam: bf16
cells compute in bf16 but store fp32). These are model states only: a lower bound of
the peak, which adds activations, unsharded parameters and communication buffers.
"""

from __future__ import annotations

PRECISIONS = ("fp32", "mixed")
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum")
STAGES = (0, 1, 2, 3)


def bytes_per_element(precision: str, optimizer: str = "adam") -> tuple[int, int, int]:
    """(P, G, K): bytes per parameter element of parameters, gradients, optimizer state."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not allowed (allowed: {', '.join(map(repr, PRECISIONS))})")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: {optimizer!r} is not allowed (allowed: {', '.join(map(repr, OPTIMIZERS))})")
    # optimizer state in fp32 elements per parameter: Adam keeps m and v, SGD momentum one buffer
    states = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}[optimizer]
    if precision == "fp32":
        return 4, 4, 4 * states
    return 2, 2, 4 + 4 * states  # + the fp32 master copy of the parameters


def model_state_bytes(psi: float, world_size: int, stage: int, precision: str = "fp32",
                      optimizer: str = "adam") -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer state, and their total."""
    if stage not in STAGES:
        raise ValueError(f"stage: {stage!r} is not allowed (allowed: 0, 1, 2, 3)")
    if world_size < 1:
        raise ValueError(f"world_size: {world_size} is not allowed (allowed: int >= 1)")
    p, g, k = bytes_per_element(precision, optimizer)
    n = world_size
    out = {
        "params": p * psi / (n if stage >= 3 else 1),
        "grads": g * psi / (n if stage >= 2 else 1),
        "optim": k * psi / (n if stage >= 1 else 1),
    }
    out["total"] = out["params"] + out["grads"] + out["optim"]
    return out


def engine_stage(engine: str, options: dict, world_size: int, shard_group_size: int | None = None) -> tuple[int, int]:
    """(ZeRO stage, ranks the model states are sharded over) of an engine cell.

    FSDP's SHARD_GRAD_OP and fully_shard(reshard_after_forward=False) shard parameters at
    rest like stage 3 (they only keep them unsharded between forward and backward, which
    the peak, not the model states, pays for). HYBRID_SHARD shards within its shard group,
    ``shard_group_size`` (the cell's ``Cell.shard_group_size``; None: the world)."""
    if engine == "ddp":
        return 0, 1
    if engine in ("torch-zero1", "impl-zero1"):
        return 1, world_size
    if engine == "impl-zero2":
        return 2, world_size
    if engine.startswith("deepspeed-zero"):  # deepspeed-zero1, -zero2, -zero3
        return int(engine[-1]), world_size
    strategy = options.get("sharding_strategy", "FULL_SHARD")
    if strategy == "NO_SHARD":
        return 0, 1
    if strategy == "HYBRID_SHARD":
        return 3, int(shard_group_size or world_size)
    return 3, world_size


def engine_model_state_bytes(engine: str, options: dict, world_size: int, psi: float,
                             optimizer: str = "adam", precision: str = "fp32",
                             shard_group_size: int | None = None) -> dict[str, float]:
    stage, n = engine_stage(engine, options, world_size, shard_group_size)
    return model_state_bytes(psi, n, stage, precision, optimizer)


def figure1(psi: float = 7.5e9, world_size: int = 64) -> dict[str, float]:
    """The ZeRO paper's Figure 1 in GB (1e9 bytes): mixed precision, Adam (K = 12)."""
    names = ("baseline", "P_os", "P_os+g", "P_os+g+p")
    return {name: model_state_bytes(psi, world_size, stage, "mixed", "adam")["total"] / 1e9
            for stage, name in enumerate(names)}


#: Figure 1 as printed in the paper, GB per device (Ψ = 7.5B, N = 64, K = 12)
FIGURE1_PAPER_GB = {"baseline": 120.0, "P_os": 31.4, "P_os+g": 16.6, "P_os+g+p": 1.9}


def keeps_master_copy(engine: str) -> bool:
    """Whether the engine's optimizer state includes an fp32 master copy of its parameter
    partition besides the optimizer's own tensors: DeepSpeed's ZeRO does, in every dtype
    (zerobench/engines/deepspeed.py, [Note: DeepSpeed's tensors by role])."""
    return engine.startswith("deepspeed-zero")


def paper_bytes_from_counts(params_numel: int, grads_numel: int, optim_numel: int,
                            optimizer: str = "adam", master_copy: bool = False) -> float:
    """Model-state bytes with the paper's mixed-precision convention, from the elements a
    rank holds (as the estimator measures them): 2 bytes per parameter and gradient
    element, K = 12 bytes per parameter element whose optimizer state the rank owns.
    ``master_copy``: the optimizer state counted includes a master copy of the owned
    parameters (:func:`keeps_master_copy`), one more element per owned element.

    The engines here store fp32 parameters and gradients in both dtypes, so their real
    bytes differ from the paper's layout; the element counts (how each engine shards)
    are what the comparison with Figure 1 checks."""
    states = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}[optimizer] + (1 if master_copy else 0)
    owned = optim_numel / states if states else 0
    p, g, k = bytes_per_element("mixed", optimizer)
    return p * params_numel + g * grads_numel + k * owned
