"""What ``zerobench estimate`` is asked: one value, made by the command line (or a
notebook), that :func:`zerobench.whatif.estimate.estimate` takes whole."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zerobench.whatif.cells import check_hybrid_shard_size, parse_world_sizes


@dataclass(frozen=True)
class EstimateRequest:
    """Every option of an estimate, with the command line's defaults, checked as it is
    made (the backend and the GPU preset when they are resolved): before any folder is
    made, naming the option."""

    workload: str | Path
    """The workload file, or the name of a shipped one."""
    world_sizes: tuple[int, ...]
    """Each configuration is estimated at each of these."""
    rank: int = 0
    """The rank whose memory is estimated."""
    results_root: Path = Path("results")
    fake_tensors: bool | None = None
    """Fake tensors instead of real ones; None: on above FAKE_TENSORS_ABOVE of model states."""
    hybrid_shard_size: int | None = None
    """HYBRID_SHARD's shard group (``--hybrid-shard-size``); None: one node's ranks."""
    only: tuple[str, ...] | None = None
    """Configuration ids to estimate (``--config``); None: every one."""
    backend: str = "nccl"
    """Whose own communication buffers to count (zerobench/whatif/estimate/job.py)."""
    full_depth: bool = False
    """Run every block even where the estimate would extrapolate from two shallow copies
    of the model (zerobench/whatif/estimate/depth.py)."""
    overrides: tuple[str, ...] = ()
    """``--set KEY=VALUE`` applied to the workload file ([Note: overrides] in
    zerobench/spec/workload.py)."""
    gpu: str | None = None
    """A GPU preset (a name or a file): each row then says what its caching allocator may
    reserve there (``capacity_bytes``, as predict counts it: [Note: capacity a process sees])."""

    def __post_init__(self):
        sizes = tuple(parse_world_sizes(",".join(map(str, self.world_sizes))))
        object.__setattr__(self, "world_sizes", sizes)
        if self.rank < 0:
            raise ValueError(f"--rank: {self.rank} is not allowed (allowed: 0 <= rank < world size)")
        for ws in sizes:
            if self.rank >= ws:
                raise ValueError(f"--rank: {self.rank} is not allowed at world size {ws} (allowed: 0..{ws - 1})")
        check_hybrid_shard_size(self.hybrid_shard_size, sizes)
        for name in ("only", "overrides"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
