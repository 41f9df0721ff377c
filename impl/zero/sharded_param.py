"""The life of one parameter under ZeRO stage 2: which slice this rank owns.

See [Note: stage-2 layout] in stage2.py for why shards are per-parameter chunks.

A parameter of ``numel`` elements is split into ``world_size`` chunks of
``chunk_numel = ceil(numel / world_size)``; the last chunks are padded with zeros
(a chunk may be all padding when ``numel < world_size``). Rank ``r`` owns elements
``[start, end)`` = ``[r * chunk_numel, (r + 1) * chunk_numel)`` clipped to ``numel``.

``sharded`` is a 1-D *view* of those elements inside the parameter itself: the local
optimizer updates it in place, so there is no second (master) copy of the shard;
the all-gather after the step then fills in the other ranks' chunks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from impl import comm


class ShardedParam:
    """One parameter's chunking and this rank's view of its shard."""

    def __init__(self, param: torch.Tensor, rank: int, world_size: int):
        if not param.is_contiguous():
            raise ValueError("ZeroStage2Optimizer needs contiguous parameters (a shard is a view of the flat parameter)")
        self.param = param
        self.world_size = world_size
        self.numel = param.numel()
        self.chunk_numel = math.ceil(self.numel / world_size)
        self.start = min(rank * self.chunk_numel, self.numel)
        self.end = min(self.start + self.chunk_numel, self.numel)
        # 1D view into param's storage: the tensor the local optimizer steps; its .grad
        # is this rank's reduced gradient shard (unpadded).
        self.sharded = param.detach().view(-1)[self.start : self.end]

    @property
    def shard_numel(self) -> int:
        return self.end - self.start

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (1D, ``numel``) right-padded to ``world_size * chunk_numel``."""
        padding = self.world_size * self.chunk_numel - self.numel
        return F.pad(flat, (0, padding)) if padding else flat

    # -- gradients ------------------------------------------------------------------------

    def reduce_scatter_inputs(self, grad: torch.Tensor) -> list[torch.Tensor]:
        """``grad / world_size`` as one padded chunk per rank (averaging, as DDP does).

        Divides ``grad`` in place (the caller gives it up), so that when no padding is
        needed the chunks are views of the gradient itself: consecutive slices of one
        buffer, which the bucketer sends without another copy.
        """
        flat = grad.reshape(-1).div_(self.world_size)
        padded = self._padded(flat)  # 1D, world_size * chunk_numel
        return list(padded.view(self.world_size, self.chunk_numel).unbind(0))

    def accumulate_reduced(self, reduced: torch.Tensor) -> None:
        """Bucketer callback: ``reduced`` (``chunk_numel``, padded) becomes or adds to the shard's grad.

        The first gradient is kept as a view of the bucket's output (no copy: that
        output buffer is what the sharded gradients live in); later ones (gradient
        accumulation over synchronized backwards) are added to it.
        """
        shard_grad = reduced[: self.shard_numel]
        if self.sharded.grad is None:
            self.sharded.grad = shard_grad
        else:
            self.sharded.grad.add_(shard_grad)

    # -- parameters -----------------------------------------------------------------------

    def write_all_gather_input(self, out: torch.Tensor) -> None:
        """Copy this rank's updated shard into ``out`` (``chunk_numel``), zero-padded."""
        out[: self.shard_numel].copy_(self.sharded)
        out[self.shard_numel :].zero_()

    def read_all_gather_output(self, chunks: torch.Tensor) -> None:
        """``chunks`` (2D ``world_size x chunk_numel``, every rank's shard) back into the parameter."""
        self.param.detach().view(-1).copy_(chunks.reshape(-1)[: self.numel])

    # -- optimizer state (checkpoints) ------------------------------------------------------

    def gather_full(self, shard_value: torch.Tensor, group) -> torch.Tensor:
        """All-gather a per-element state shard (e.g. Adam's ``exp_avg``) into the parameter's shape."""
        if shard_value.shape != self.sharded.shape:
            raise ValueError(f"state of shape {tuple(shard_value.shape)} is not elementwise for a shard of {self.shard_numel}")
        all_gather_input = torch.zeros(self.chunk_numel, dtype=shard_value.dtype, device=shard_value.device)
        all_gather_input[: self.shard_numel].copy_(shard_value)
        all_gather_output = all_gather_input.new_empty(self.world_size * self.chunk_numel)
        comm.all_gather(all_gather_output, all_gather_input, group=group, async_op=False)
        return all_gather_output[: self.numel].view(self.param.shape)

    def shard_of(self, full_value: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-size per-element state tensor, as a new tensor."""
        if full_value.numel() != self.numel:
            raise ValueError(f"state of {full_value.numel()} elements does not match a parameter of {self.numel}")
        return full_value.reshape(-1)[self.start : self.end].to(self.sharded.device, copy=True)
