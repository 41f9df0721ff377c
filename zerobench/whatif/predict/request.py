"""What ``zerobench predict`` is asked: one value, made by the command line (or a notebook,
or the published runs' check), that :func:`zerobench.whatif.predict.predict` takes whole."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zerobench.whatif.cells import parse_world_sizes


@dataclass(frozen=True)
class PredictRequest:
    """Every option of a prediction, with the command line's defaults. The names of the
    GPU, host and links are checked when they are resolved (``resolve_devices``), the
    numbers here; either way before any folder is made, naming the option."""

    workload: str | Path
    """The workload file, or the name of a shipped one."""
    world_sizes: tuple[int, ...]
    """Each configuration is predicted at each of these."""
    gpu: str = "h100-sxm"
    """A GPU preset's name, or a preset file (docs/vgpu.md)."""
    host: str | None = None
    """A host preset's name; None: the GPU preset's own measured host."""
    link: str = "nvlink4-8gpu"
    """The link within a node (a preset name or numbers: docs/link.md)."""
    inter_link: str | None = None
    """The link between nodes; None: the one link everywhere."""
    node_size: int = 8
    """Ranks per node: HYBRID_SHARD's shard group, and where inter_link starts."""
    results_root: Path = Path("results")
    matrix: bool = False
    """Also sweep the knobs of the matrix's engines (each option's ``sweep``)."""
    only: tuple[str, ...] | None = None
    """Configuration ids to predict (``--config``); None: every one."""
    alloc_conf: str = ""
    """Caching-allocator settings, in ``PYTORCH_CUDA_ALLOC_CONF`` syntax."""
    context_mib: int | None = None
    """Device memory of the CUDA context, in place of the preset's."""
    nccl_mib: int | None = None
    """Device memory of each NCCL communicator, in place of the preset's."""
    record_streams: bool = False
    """As ProcessGroupNCCL did before avoiding record_stream became its default."""
    sdpa_backend: str = "auto"
    """The attention backend (``auto``: torch's choice)."""
    overrides: tuple[str, ...] = ()
    """``--set KEY=VALUE`` applied to the workload file ([Note: overrides] in
    zerobench/spec/workload.py)."""

    def __post_init__(self):
        object.__setattr__(self, "world_sizes", tuple(parse_world_sizes(",".join(map(str, self.world_sizes)))))
        if self.node_size < 1:
            raise ValueError(f"--node-size: {self.node_size} is not allowed (allowed: ints >= 1)")
        for name in ("only", "overrides"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
