"""Gradient clipping over gradients sharded across ranks (ZeRO stages 1 and 2).

[Note: a sharded norm]
Each rank of a ZeRO-1 or ZeRO-2 group steps only its partition, so it only needs its
partition's gradients scaled; but the scale needs the norm of every gradient of the
model. The partitions are disjoint and together cover the model, so the squared norm of
the whole is the sum over ranks of each partition's squared norm: each rank sums its
own squares, one all-reduce adds them up, and every rank scales its own gradients by
the same ``max_norm / (norm + 1e-6)`` (at most 1), the formula of
``torch.nn.utils.clip_grad_norm_``, which DeepSpeed's ZeRO optimizers also use.
Padding in a shard is zero and adds nothing. The norm is the 2-norm, the one LLM
training loops clip by.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from impl import comm


@torch.no_grad()
def clip_grad_norm_(local_grads: list[torch.Tensor], max_norm: float, group=None,
                    device: torch.device | None = None) -> torch.Tensor:
    """Scale ``local_grads`` (this rank's disjoint part of the gradients) so that the
    norm of every rank's together is at most ``max_norm``; return that norm (fp32, the
    same on every rank). A collective: every rank of ``group`` must call it. See
    [Note: a sharded norm]."""
    with record_function("impl::clip_grad_norm"):
        if device is None:
            device = local_grads[0].device if local_grads else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float32, device=device)  # this rank's sum of squares
        if local_grads:
            norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in local_grads])
            squares = torch.stack(norms).square().sum().to(device)
        comm.all_reduce(squares, op=dist.ReduceOp.SUM, group=group).wait()
        total_norm = squares.sqrt()
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        if local_grads:
            torch._foreach_mul_(local_grads, clip_coef.to(local_grads[0].device))
        return total_norm
