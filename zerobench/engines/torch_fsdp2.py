"""PyTorch's ``fully_shard`` (FSDP2, per-parameter DTensor sharding), one unit per block.

fully_shard always prefetches the next block's all-gather in backward (like FSDP1's
BACKWARD_PRE), so it has no backward_prefetch axis; forward prefetch is explicit.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from zerobench.engines.base import Engine
from zerobench.engines.options import TorchFSDP2Options


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def fused_on_dtensor(kind: str) -> bool:
    """Whether DTensor has a sharding strategy for torch.optim's fused kernel of ``kind``
    (``aten._fused_adam_``, ...): fully_shard's parameters are DTensors, and an optimizer
    whose fused kernel DTensor cannot shard fails at its first step. torch 2.13 has them
    for adam and adamw, not for sgd."""
    op = getattr(torch.ops.aten, f"_fused_{kind}_", None)
    propagator = DTensor._op_dispatcher.sharding_propagator  # private: where DTensor registers its strategies
    registered = (getattr(propagator, name, {}) for name in ("op_strategy_funcs", "op_single_dim_strategy_funcs"))
    return op is not None and any(op.default in funcs for funcs in registered)


class TorchFSDP2Engine(Engine):
    name = "torch-fsdp2"
    Options = TorchFSDP2Options

    @classmethod
    def notes(cls, options, dtype, world_size, device_type, optimizer=None):
        """What fully_shard cannot do of the cell: a fused optimizer DTensor cannot shard
        (then the foreach one runs: :meth:`build_optimizer`), CPU offload on a CPU device."""
        out = [note for note in [super().notes(options, dtype, world_size, device_type, optimizer)] if note]
        if optimizer is not None and optimizer.implementation == "fused" and not fused_on_dtensor(optimizer.kind):
            out.append(f"optimizer.implementation = \"fused\": ran foreach, torch {torch.__version__.split('+')[0]}'s "
                       f"DTensor has no sharding strategy for aten._fused_{optimizer.kind}_")
        if options.get("cpu_offload") and device_type != "cuda":
            out.append("cpu_offload: CPUOffloadPolicy runs (the optimizer steps the sharded parameters in host "
                       "memory) but on a CPU device they are there already: no copies to or from a GPU")
        return "; ".join(out) or None

    def build_optimizer(self, spec):
        """The workload's optimizer, foreach where it asks for a fused kernel DTensor cannot
        shard (:func:`fused_on_dtensor`; the cell's note says so)."""
        if spec.implementation == "fused" and not fused_on_dtensor(spec.kind):
            spec = dataclasses.replace(spec, implementation="foreach")
        return super().build_optimizer(spec)

    def wrap(self, model, blocks):
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        mp = MixedPrecisionPolicy()
        if self.dtype == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = dict(mesh=mesh, reshard_after_forward=self.settings.reshard_after_forward, mp_policy=mp,
                      offload_policy=self._offload_policy())
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        if self.settings.forward_prefetch:
            for current, following in zip(blocks, blocks[1:]):
                current.set_modules_to_forward_prefetch([following])
        self.module = model
        return model

    def _offload_policy(self) -> OffloadPolicy:
        """CPUOffloadPolicy with cpu_offload, else none. Its buffers are pinned where pinning
        means something (a CUDA device: the copies to and from the GPU are then
        asynchronous, as torch's default pin_memory=True has them); a CPU rank has no
        device to pin for, and torch refuses to pin without one."""
        if not self.settings.cpu_offload:
            return OffloadPolicy()
        return CPUOffloadPolicy(pin_memory=self.ctx.device.type == "cuda")

    def parameter_tensors(self):
        return [_local(p) for p in self.module.parameters()]

    def gradient_tensors(self):
        return [_local(p.grad) for p in self.module.parameters() if p.grad is not None]

    def optimizer_state_tensors(self):
        return [_local(t) for t in super().optimizer_state_tensors()]
