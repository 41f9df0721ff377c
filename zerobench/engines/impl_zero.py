"""This project's reference ZeRO (``impl.zero``): stage 1 over DDP, and stage 2.

* ``impl-zero1`` mirrors ``torch-zero1``: DDP all-reduces the gradients, and
  ``impl.zero.ZeroRedundancyOptimizer`` shards the optimizer state and broadcasts the
  updated parameters. Only the broadcasts go through ``impl.comm``; DDP's all-reduce
  is emulated through a comm hook (zerobench/emulation.py).
* ``impl-zero2`` is ``impl.zero.ZeroStage2Optimizer`` on the bare model: gradients are
  reduce-scattered in buckets during backward, each rank keeps and steps its shard,
  parameters are all-gathered after the step. Every collective goes through
  ``impl.comm``.

Both report, per rank, ``zero_partition_imbalance_pct``: how far the largest rank's
stepped elements exceed the mean, in percent (0 is perfect; stage 1 never splits a
parameter, stage 2 always does), and ``zero_rank_numel_count``: the elements this rank
steps (and holds optimizer state for). Named with unit suffixes so the comparison
classifies them as metrics (zerobench/compare.py).
"""

from __future__ import annotations

import torch

from impl import comm
from impl.zero import ZeroRedundancyOptimizer, ZeroStage2Optimizer
from impl.zero.partition import imbalance
from zerobench.engines.base import AutocastEngine, Axis
from zerobench.engines.torch_zero1 import TorchZero1Engine


def partition_metrics(rank_numels: list[int], rank: int) -> dict[str, float]:
    return {
        "zero_partition_imbalance_pct": 100.0 * (imbalance(rank_numels) - 1.0),
        "zero_rank_numel_count": float(rank_numels[rank]),
    }


class Zero1Engine(TorchZero1Engine):
    """torch-zero1 with impl's ZeroRedundancyOptimizer swapped in: the same DDP, the same
    constructor call, so the two differ only by the optimizer's implementation."""

    name = "impl-zero1"
    zero_class = ZeroRedundancyOptimizer

    def extra_metrics(self):
        return partition_metrics(self.optimizer.rank_numels(), self.ctx.rank)


class Zero2Engine(AutocastEngine):
    name = "impl-zero2"
    options = {
        "bucket_cap_mb": Axis(25.0, type=float, minimum=0,
                              doc="reduce-scatter (and all-gather) bucket size; 0 sends every gradient alone"),
        "max_in_flight": Axis(2, type=int, minimum=1,
                              doc="reduce-scatters in flight before backward waits for the oldest"),
    }

    @torch.no_grad()
    def wrap(self, model, blocks):
        """The bare model, with rank 0's parameters and buffers broadcast (as DDP's constructor does)."""
        handles = [comm.broadcast(t.data, src=0) for t in [*model.parameters(), *model.buffers()]]
        for handle in handles:
            handle.wait()
        self.module = model
        return self.module

    def build_optimizer(self, spec):
        self.optimizer = ZeroStage2Optimizer(
            self.module.parameters(),
            optimizer_class=spec.cls,
            bucket_cap_mb=float(self.opts.get("bucket_cap_mb", 25.0)),
            max_in_flight=int(self.opts.get("max_in_flight", 2)),
            **spec.kwargs(),
        )
        return self.optimizer

    def gradient_tensors(self):
        """The reduced gradient shards, plus any full gradients (only left by no_sync)."""
        full = [p.grad for p in self.module.parameters() if p.grad is not None]
        return full + self.optimizer.gradient_shards()

    def extra_metrics(self):
        return partition_metrics(self.optimizer.rank_numels(), self.ctx.rank)
