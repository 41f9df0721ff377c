"""PyTorch's ``fully_shard`` (FSDP2, per-parameter DTensor sharding), one unit per block.

fully_shard always prefetches the next block's all-gather in backward (like FSDP1's
BACKWARD_PRE), so it has no backward_prefetch axis; forward prefetch is explicit.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from zerobench.engines.base import Engine
from zerobench.engines.options import TorchFSDP2Options


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class TorchFSDP2Engine(Engine):
    name = "torch-fsdp2"
    Options = TorchFSDP2Options

    def wrap(self, model, blocks):
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        mp = MixedPrecisionPolicy()
        if self.dtype == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = dict(mesh=mesh, reshard_after_forward=self.settings.reshard_after_forward, mp_policy=mp)
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        if self.settings.forward_prefetch:
            for current, following in zip(blocks, blocks[1:]):
                current.set_modules_to_forward_prefetch([following])
        self.module = model
        return model

    def parameter_tensors(self):
        return [_local(p) for p in self.module.parameters()]

    def gradient_tensors(self):
        return [_local(p.grad) for p in self.module.parameters() if p.grad is not None]

    def optimizer_state_tensors(self):
        return [_local(t) for t in super().optimizer_state_tensors()]
