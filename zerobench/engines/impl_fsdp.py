"""This project's reference FSDP (``impl.fsdp``), one unit per block, the root taking the rest."""

from __future__ import annotations

from typing import Any

import torch

from impl.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from impl.fsdp import FullyShardedDataParallel as FSDP
from impl.fsdp.process_groups import default_shard_size
from zerobench.engines.base import Axis, Engine

_BACKWARD_PREFETCH = {"none": None, "pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST}

#: bf16 cells: parameters and buffers computed in bf16, gradients reduced in fp32, the
#: sharded parameters and optimizer state kept in fp32 (the same split as torch-fsdp2's
#: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)).
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)


class FSDPEngine(Engine):
    name = "impl-fsdp"
    options = {
        "sharding_strategy": Axis(
            "FULL_SHARD", choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"),
            doc="HYBRID_SHARD shards within groups of world/2 ranks (or LOCAL_WORLD_SIZE) and replicates across them",
        ),
        # Defaults follow torch-fsdp1's (PyTorch 2.x FSDP: BACKWARD_PRE, limit_all_gathers=True), as
        # impl's class does, so a workload that leaves these axes out compares the same schedule on both.
        "backward_prefetch": Axis("pre", choices=("none", "pre", "post"),
                                  doc="BACKWARD_PRE / BACKWARD_POST / no backward prefetch"),
        "forward_prefetch": Axis(False, choices=(False, True),
                                 doc="prefetch the next unit's all-gather in forward (recorded order)"),
        "limit_all_gathers": Axis(True, choices=(True, False),
                                  doc="bound the unsharded units in flight to limiter_depth"),
        "limiter_depth": Axis(2, type=int, minimum=1, applies_when=("limit_all_gathers", True),
                              doc="units in flight allowed by limit_all_gathers"),
        "use_orig_params": Axis(False, choices=(False, True),
                                doc="the optimizer sees the original parameters (views of each unit's shard) "
                                    "instead of flat shards: per-parameter groups (optimizer.no_decay)"),
        "cpu_offload": Axis(False, choices=(False, True),
                            doc="keep sharded parameters and gradients in host memory "
                                "(on a GPU or the virtual GPU; a no-op on a CPU device)"),
    }

    @classmethod
    def unsupported(cls, options: dict[str, Any], dtype: str, world_size: int, device_type: str) -> str | None:
        why = super().unsupported(options, dtype, world_size, device_type)
        if why:
            return why
        if options.get("sharding_strategy") == "HYBRID_SHARD":
            shard = default_shard_size(world_size)
            if shard < 2 or world_size // shard < 2:
                return (
                    f"HYBRID_SHARD needs at least 2 groups of at least 2 ranks; world size {world_size} gives "
                    f"{world_size // shard} group(s) of {shard}, which is NO_SHARD or FULL_SHARD under another name"
                )
        return None

    def wrap(self, model, blocks):
        ids = {id(b) for b in blocks}
        self.module = FSDP(
            model,
            sharding_strategy=ShardingStrategy[self.opts.get("sharding_strategy", "FULL_SHARD")],
            cpu_offload=CPUOffload(offload_params=bool(self.opts.get("cpu_offload", False))),
            auto_wrap_policy=lambda module, recurse, unwrapped_params: recurse or id(module) in ids,
            backward_prefetch=_BACKWARD_PREFETCH[self.opts.get("backward_prefetch", "none")],
            mixed_precision=BF16 if self.dtype == "bf16" else None,
            device_id=self.ctx.device if self.ctx.device.type == "cuda" else None,
            forward_prefetch=bool(self.opts.get("forward_prefetch", False)),
            limit_all_gathers=bool(self.opts.get("limit_all_gathers", False)),
            limiter_depth=int(self.opts.get("limiter_depth", 2)),
            use_orig_params=bool(self.opts.get("use_orig_params", False)),
        )
        return self.module

    def ran(self):
        """NO_SHARD where impl's FSDP switched to it at world size 1, as PyTorch's FSDP1 does
        ([Note: say what ran])."""
        asked = self.opts.get("sharding_strategy", "FULL_SHARD")
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
