"""PyTorch DistributedDataParallel: every rank holds everything, gradients are all-reduced."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from zerobench.engines.base import AutocastEngine
from zerobench.engines.options import DDPOptions
from zerobench.instruments import collectives


def wrap_ddp(model, ctx, gradient_as_bucket_view: bool = False):
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=gradient_as_bucket_view)
    if collectives.intercepting():
        # The reducer all-reduces from C++, past the collective layers: route its buckets
        # through torch.distributed.all_reduce, where they see them ([Note: one interception]).
        ddp.register_comm_hook(None, collectives.ddp_comm_hook)
    return ddp


class DDPEngine(AutocastEngine):
    name = "ddp"
    Options = DDPOptions

    def wrap(self, model, blocks):
        self.module = wrap_ddp(model, self.ctx, self.settings.gradient_as_bucket_view)
        return self.module
