"""This project's reference FSDP (``impl.fsdp``), one unit per block, the root taking the rest."""

from __future__ import annotations

from typing import Any

import torch

from impl.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from impl.fsdp import FullyShardedDataParallel as FSDP
from zerobench.engines.base import Engine
from zerobench.engines.options import ImplFSDPOptions

_BACKWARD_PREFETCH = {"none": None, "pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST}

#: bf16 cells: parameters and buffers computed in bf16, gradients reduced in fp32, the
#: sharded parameters and optimizer state kept in fp32 (the same split as torch-fsdp2's
#: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)).
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)


class FSDPEngine(Engine):
    name = "impl-fsdp"
    Options = ImplFSDPOptions

    @classmethod
    def unsupported(cls, options: dict[str, Any], dtype: str, world_size: int, device_type: str) -> str | None:
        why = super().unsupported(options, dtype, world_size, device_type)
        if why:
            return why
        settings = cls.Options.from_options(options)
        if settings.sharding_strategy == "HYBRID_SHARD":
            shard = settings.shard_group_size(world_size)
            if shard < 2 or world_size // shard < 2:
                return (
                    f"HYBRID_SHARD needs at least 2 groups of at least 2 ranks; world size {world_size} gives "
                    f"{world_size // shard} group(s) of {shard}, which is NO_SHARD or FULL_SHARD under another name"
                )
        return None

    def wrap(self, model, blocks):
        ids = {id(b) for b in blocks}
        s = self.settings  # every option, the cell's or its declared default
        self.module = FSDP(
            model,
            sharding_strategy=ShardingStrategy[s.sharding_strategy],
            cpu_offload=CPUOffload(offload_params=s.cpu_offload),
            auto_wrap_policy=lambda module, recurse, unwrapped_params: recurse or id(module) in ids,
            backward_prefetch=_BACKWARD_PREFETCH[s.backward_prefetch],
            mixed_precision=BF16 if self.dtype == "bf16" else None,
            device_id=self.ctx.device if self.ctx.device.type == "cuda" else None,
            forward_prefetch=s.forward_prefetch,
            limit_all_gathers=s.limit_all_gathers,
            limiter_depth=s.limiter_depth,
            use_orig_params=s.use_orig_params,
        )
        return self.module

    def clip_gradients(self, max_norm):
        """impl's ``clip_grad_norm_`` on the root, as FSDP1's: the flat shards' norm, all-reduced."""
        return self.module.clip_grad_norm_(max_norm)

    def ran(self):
        """NO_SHARD where impl's FSDP switched to it at world size 1, as PyTorch's FSDP1 does
        ([Note: say what ran])."""
        asked = self.settings.sharding_strategy
        strategies = {m.sharding_strategy.name for m in self.module.fsdp_instances()}
        if strategies == {asked} or len(strategies) != 1:
            return {}
        (strategy,) = strategies
        why = (f"impl's FSDP runs NO_SHARD when its shard group has one rank (world size {self.ctx.world_size}), "
               "as torch's FSDP1 does")
        return {"sharding_strategy": (strategy, why)}

    def _units(self):
        return [m._unit for m in self.module.fsdp_instances() if m._unit is not None]

    def parameter_tensors(self):
        """The sharded flat parameters (``sharded_flat``), plus any unmanaged parameters
        (with use_orig_params the optimizer's parameters are views of these)."""
        flats = [unit.handle.sharded_flat for unit in self._units()]
        ids = {id(p) for p in flats}
        return flats + [p for p in self.module.parameters()
                        if id(p) not in ids and not getattr(p, "_impl_fsdp_flattened", False)]

    def gradient_tensors(self):
        """The sharded gradients the optimizer reads (with use_orig_params, through views)."""
        return [p.grad for p in self.parameter_tensors() if p.grad is not None]

    def extra_metrics(self):
        """Rate-limiter counters since the previous call: limiter_stall_s (time blocked on
        all-gathers the limiter held back), limiter_stalls (all-gathers held back),
        limiter_overruns, max_inflight_all_gathers, all_gathers."""
        return self.module.limiter_metrics()
