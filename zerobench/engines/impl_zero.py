"""This project's reference ZeRO (``impl.zero``): stage 1 over DDP, and stage 2.

* ``impl-zero1`` mirrors ``torch-zero1``: DDP all-reduces the gradients, and
  ``impl.zero.ZeroRedundancyOptimizer`` shards the optimizer state and broadcasts the
  updated parameters. Only the broadcasts go through ``impl.comm``; DDP's all-reduce
  is emulated through a comm hook (zerobench/instruments/emulation.py).
* ``impl-zero2`` is ``impl.zero.ZeroStage2Optimizer`` on the bare model: gradients are
  reduce-scattered in buckets during backward, each rank keeps and steps its shard,
  parameters are all-gathered after the step. Every collective goes through
  ``impl.comm``.

``impl-zero1`` has the axis ``overlap_with_ddp`` (PyTorch's constructor argument): the
optimizer step runs inside DDP's communication hook, bucket by bucket
(``impl.zero.ddp_hooks``; ``overlap_hook`` picks ``hook_with_zero_step`` or the
interleaved one). Those first iterations do not update the parameters, so
the engine's first ``train_step`` runs them itself on its batch, forward and backward
only, before the real step (PyTorch's documented remedy, "prepend dummy inputs"). The
losses and parameters then follow plain DDP training step for step.

Both report, per rank, ``zero_partition_imbalance_pct``: how far the largest rank's
stepped elements exceed the mean, in percent (0 is perfect; stage 1 never splits a
parameter, stage 2 always does), and ``zero_rank_numel_count``: the elements this rank
steps (and holds optimizer state for). Named with unit suffixes so the comparison
classifies them as metrics (zerobench/analysis/compare/gate.py).
"""

from __future__ import annotations

import torch

from impl import comm
from impl.zero import ZeroRedundancyOptimizer, ZeroStage2Optimizer
from impl.zero.overlap import OverlapStatus
from impl.zero.partition import imbalance
from zerobench.engines.base import AutocastEngine
from zerobench.engines.options import ImplZero1Options, ImplZero2Options
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
    Options = ImplZero1Options

    @property
    def _overlap(self) -> bool:
        return self.settings.overlap_with_ddp

    def build_optimizer(self, spec):
        spec.refuse_groups(self.name)
        if self._overlap and self.max_grad_norm:
            raise ValueError(f"optimizer.max_grad_norm = {self.max_grad_norm} is not supported by impl-zero1 with "
                             "overlap_with_ddp = true: each bucket steps inside DDP's hook, before the norm of "
                             "every gradient is known (allowed there: 0)")
        if not self._overlap:
            return super().build_optimizer(spec)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        from impl.zero.ddp_hooks import hook_with_zero_step, hook_with_zero_step_interleaved

        self.optimizer = self.zero_class(
            self.module.parameters(), optimizer_class=spec.cls, overlap_with_ddp=True, **spec.kwargs()
        )
        make_hook = hook_with_zero_step_interleaved if self.settings.overlap_hook == "interleaved" else hook_with_zero_step
        self.module.register_comm_hook(None, make_hook(allreduce_hook, self.module, self.optimizer))
        return self.optimizer

    def clip_gradients(self, max_norm):
        """impl's ZeroRedundancyOptimizer.clip_grad_norm_: a sharded norm over this rank's partition."""
        return self.optimizer.clip_grad_norm_(max_norm)

    def train_step(self, inputs, targets, loss_fn):
        if not self._overlap:
            return super().train_step(inputs, targets, loss_fn)
        # The iterations before DDP's buckets are final and recorded update nothing: run
        # them here, on this batch, so that every step the harness sees is a real one.
        for _ in range(3):
            if self.optimizer._overlap_info.status is not OverlapStatus.UNINITIALIZED:
                break
            with self.autocast():
                warm = loss_fn(self.module(inputs), targets)
            warm.backward()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            raise RuntimeError("overlap_with_ddp: DDP did not rebuild its buckets within 3 iterations")
        with self.phase("forward"):
            with self.autocast():
                loss = loss_fn(self.module(inputs), targets)
        with self.phase("backward"):
            loss.backward()  # the hook steps and broadcasts
        with self.phase("optimizer"):
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def extra_metrics(self):
        return partition_metrics(self.optimizer.rank_numels(), self.ctx.rank)


class Zero2Engine(AutocastEngine):
    name = "impl-zero2"
    Options = ImplZero2Options

    @torch.no_grad()
    def wrap(self, model, blocks):
        """The bare model, with rank 0's parameters and buffers broadcast (as DDP's constructor does)."""
        handles = [comm.broadcast(t.data, src=0) for t in [*model.parameters(), *model.buffers()]]
        for handle in handles:
            handle.wait()
        self.module = model
        return self.module

    def build_optimizer(self, spec):
        spec.refuse_groups(self.name)
        self.optimizer = ZeroStage2Optimizer(
            self.module.parameters(),
            optimizer_class=spec.cls,
            bucket_cap_mb=float(self.settings.bucket_cap_mb),
            max_in_flight=self.settings.max_in_flight,
            **spec.kwargs(),
        )
        return self.optimizer

    def clip_gradients(self, max_norm):
        """impl's ZeroStage2Optimizer.clip_grad_norm_: a sharded norm over the reduced gradient shards."""
        return self.optimizer.clip_grad_norm_(max_norm)

    def gradient_tensors(self):
        """The reduced gradient shards, plus any full gradients (only left by no_sync)."""
        full = [p.grad for p in self.module.parameters() if p.grad is not None]
        return full + self.optimizer.gradient_shards()

    def extra_metrics(self):
        return partition_metrics(self.optimizer.rank_numels(), self.ctx.rank)
