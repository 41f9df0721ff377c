"""Reference ZeRO stages 1 and 2 (Rajbhandari et al., arXiv 1910.02054).

* :class:`ZeroRedundancyOptimizer` — stage 1 (optimizer state sharded), a drop-in
  for ``torch.distributed.optim.ZeroRedundancyOptimizer``.
* :class:`ZeroStage2Optimizer` — stage 2 (optimizer state and gradients sharded):
  gradients are reduce-scattered in buckets during backward.
* :class:`ReduceScatterBucketer` — the bucketer stage 2 uses (fairscale semantics).

Design notes and the memory formulas: docs/zero.md.
"""

from impl.zero.bucketer import ReduceScatterBucketer
from impl.zero.optimizer import ZeroRedundancyOptimizer
from impl.zero.stage2 import ZeroStage2Optimizer

__all__ = ["ReduceScatterBucketer", "ZeroRedundancyOptimizer", "ZeroStage2Optimizer"]
