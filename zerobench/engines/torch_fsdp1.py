"""PyTorch's FullyShardedDataParallel (FSDP1, flat parameters), one unit per block."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision, ShardingStrategy

from zerobench.engines.base import Engine
from zerobench.engines.options import TorchFSDP1Options

_PREFETCH = {"none": None, "pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST}


class TorchFSDP1Engine(Engine):
    name = "torch-fsdp1"
    Options = TorchFSDP1Options

    @classmethod
    def unsupported(cls, options, dtype, world_size, device_type):
        if options.get("sharding_strategy") == "HYBRID_SHARD" and world_size < 2:
            return "HYBRID_SHARD needs world_size >= 2"
        return super().unsupported(options, dtype, world_size, device_type)

    def ran(self):
        """NO_SHARD where FSDP1 switched to it: a shard group of one rank ([Note: say what ran])."""
        asked = self.settings.sharding_strategy
        strategies = {m.sharding_strategy.name for m in FullyShardedDataParallel.fsdp_modules(self.module)}
        if strategies == {asked} or len(strategies) != 1:
            return {}
        (strategy,) = strategies
        why = "torch's FSDP1 runs NO_SHARD when its shard group has one rank"
        if asked == "HYBRID_SHARD":
            why += (f" (HYBRID_SHARD over {self.ctx.world_size} shard groups of one rank): the replicas' gradients "
                    "are not averaged")
        else:
            why += f" (world size {self.ctx.world_size})"
        return {"sharding_strategy": (strategy, why)}

    def wrap(self, model, blocks):
        units = set(blocks)

        def policy(module, recurse, nonwrapped_numel):
            return recurse or module in units

        # HYBRID_SHARD: FSDP1 takes a node to be torch.cuda.device_count() ranks, which has no
        # meaning on a CPU device (torch.cpu says 1). The shard groups are given as a 2-D mesh
        # instead, of the size impl's HYBRID_SHARD takes (LOCAL_WORLD_SIZE, the ranks of one
        # node as torchrun sets it, else half the world), as users pass one with device_mesh.
        s = self.settings
        mesh = None
        if s.sharding_strategy == "HYBRID_SHARD":
            from torch.distributed.device_mesh import init_device_mesh

            shard = s.shard_group_size(self.ctx.world_size)
            mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size // shard, shard),
                                    mesh_dim_names=("replicate", "shard"))
        mp = None
        if self.dtype == "bf16":
            mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
        self.module = FullyShardedDataParallel(
            model,
            auto_wrap_policy=policy,
            sharding_strategy=ShardingStrategy[s.sharding_strategy],
            backward_prefetch=_PREFETCH[s.backward_prefetch],
            forward_prefetch=s.forward_prefetch,
            limit_all_gathers=s.limit_all_gathers,
            mixed_precision=mp,
            use_orig_params=s.use_orig_params,
            device_mesh=mesh,
            # FSDP1 refuses CPU-only execution unless told the device explicitly.
            device_id=self.ctx.device if self.ctx.device.type == "cuda" else torch.device("cpu"),
        )
        return self.module

    def clip_gradients(self, max_norm):
        """FSDP1's own ``clip_grad_norm_`` on the root: the flat shards' norm, all-reduced."""
        return self.module.clip_grad_norm_(max_norm)
