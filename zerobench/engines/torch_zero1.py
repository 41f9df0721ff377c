"""PyTorch's ZeroRedundancyOptimizer over DDP: ZeRO stage 1 (optimizer state sharded)."""

from __future__ import annotations

from torch.distributed.optim import ZeroRedundancyOptimizer

from impl.zero.clip import clip_grad_norm_
from zerobench.engines.base import AutocastEngine
from zerobench.engines.ddp import wrap_ddp
from zerobench.engines.options import TorchZero1Options


class TorchZero1Engine(AutocastEngine):
    name = "torch-zero1"
    #: the ZeroRedundancyOptimizer class; impl-zero1 swaps in impl's drop-in
    zero_class = ZeroRedundancyOptimizer
    Options = TorchZero1Options

    def wrap(self, model, blocks):
        self.module = wrap_ddp(model, self.ctx)
        return self.module

    def build_optimizer(self, spec):
        spec.refuse_groups(self.name)
        self.optimizer = self.zero_class(
            self.module.parameters(),
            optimizer_class=spec.cls,
            parameters_as_bucket_view=self.settings.parameters_as_bucket_view,
            **spec.kwargs(),
        )
        return self.optimizer

    def clip_gradients(self, max_norm):
        """A sharded norm over the gradients of the parameters this rank steps (those of
        ZeroRedundancyOptimizer's local optimizer): torch's ZeroRedundancyOptimizer has no
        clip_grad_norm_ of its own ([Note: a sharded norm] in impl/zero/clip.py)."""
        grads = [p.grad for g in self.optimizer.optim.param_groups for p in g["params"] if p.grad is not None]
        return clip_grad_norm_(grads, max_norm, group=self.optimizer.process_group)
