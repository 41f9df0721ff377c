"""The simulator's input: one training step of one rank, as a small JSON document.

A :class:`Schedule` holds what the schedule rules need and nothing that needs torch:
the units in forward order (the root first) with their unsharded parameter bytes and
their forward / backward compute seconds, the optimizer step's seconds, the engine and
its knobs, and the world size the numbers were measured at. :mod:`.extract` fills one
from a profiled cell; tests write them by hand.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

ENGINES = ("impl-fsdp", "torch-fsdp1", "torch-fsdp2", "ddp", "impl-zero", "torch-zero1")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
PREFETCH = ("none", "pre", "post")


@dataclass
class Unit:
    """One communication unit (an FSDP unit, or a module's parameters for DDP/ZeRO)."""

    name: str
    param_bytes: int
    """Unsharded bytes of the unit's parameters: what an all-gather outputs and a
    reduce-scatter reduces."""
    forward_s: float
    backward_s: float


@dataclass
class Knobs:
    """The engine's schedule settings (names as the matrix axes spell them)."""

    sharding_strategy: str = "FULL_SHARD"
    """FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD."""
    backward_prefetch: str = "pre"
    """none | pre | post (fully_shard: its default, one unit ahead, is ``pre``)."""
    forward_prefetch: bool = False
    prefetch_depth: int = 1
    """Units prefetched ahead (fully_shard explicit prefetch may name more than one)."""
    limit_all_gathers: bool = False
    limiter_depth: int = 2
    reshard_after_forward: bool | None = None
    """fully_shard's knob; None: follows sharding_strategy."""
    bucket_mb: float = 25.0
    """DDP / ZeRO gradient bucket size (MiB)."""
    zero_stage: int = 2
    """impl-zero / torch-zero1: 1 all-reduces gradients, 2 reduce-scatters them."""
    gpus_per_node: int = 8
    """HYBRID_SHARD: shard group size (intra-node link); replicas across nodes."""
    blocking_collectives: bool = False
    """Each collective blocks the issuing thread until it ends, so nothing overlaps it.
    PyTorch's FSDP1 and fully_shard issue their all-gathers and reduce-scatters with
    ``async_op=False``: on CUDA that only queues them on a communication stream, on CPU
    (gloo) it waits for them. :mod:`.extract` sets it for those engines' CPU traces."""

    def validate(self) -> None:
        if self.sharding_strategy not in STRATEGIES:
            raise ValueError(f"sharding_strategy: {self.sharding_strategy!r} (allowed: {', '.join(STRATEGIES)})")
        if self.backward_prefetch not in PREFETCH:
            raise ValueError(f"backward_prefetch: {self.backward_prefetch!r} (allowed: {', '.join(PREFETCH)})")
        for name in ("prefetch_depth", "limiter_depth", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {v!r}")
        if self.zero_stage not in (1, 2):
            raise ValueError(f"zero_stage: {self.zero_stage!r} (allowed: 1, 2)")


@dataclass
class Schedule:
    engine: str
    world_size: int
    units: list[Unit]
    optimizer_s: float = 0.0
    """Optimizer step at ``world_size`` (sharded engines step a 1/world_size shard)."""
    knobs: Knobs = field(default_factory=Knobs)
    cell_id: str = ""
    measured: dict = field(default_factory=dict)
    """What the run measured for this cell (step_time_s, exposed_comm_s, ...), for validation."""
    source: dict = field(default_factory=dict)
    """Where the numbers came from (run folder, trace, link it was measured under)."""

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine: {self.engine!r} (allowed: {', '.join(ENGINES)})")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size: must be an int >= 1, got {self.world_size!r}")
        if not self.units:
            raise ValueError("units: a schedule needs at least one unit")
        for u in self.units:
            for name in ("forward_s", "backward_s"):
                v = getattr(u, name)
                if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                    raise ValueError(f"units[{u.name}].{name}: must be a finite number >= 0, got {v!r}")
            if not isinstance(u.param_bytes, int) or u.param_bytes < 0:
                raise ValueError(f"units[{u.name}].param_bytes: must be an int >= 0, got {u.param_bytes!r}")
        self.knobs.validate()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict) -> Schedule:
        known = {f for f in Knobs.__dataclass_fields__}
        knobs = d.get("knobs") or {}
        unknown = set(knobs) - known
        if unknown:
            raise ValueError(f"knobs: unknown {sorted(unknown)} (allowed: {', '.join(sorted(known))})")
        s = cls(engine=d["engine"], world_size=int(d["world_size"]),
                units=[Unit(**u) for u in d["units"]], optimizer_s=float(d.get("optimizer_s", 0.0)),
                knobs=Knobs(**knobs), cell_id=d.get("cell_id", ""), measured=d.get("measured", {}),
                source=d.get("source", {}))
        s.validate()
        return s

    @classmethod
    def load(cls, path) -> Schedule:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def with_knobs(self, **changes) -> Schedule:
        d = json.loads(self.to_json())
        d["knobs"].update(changes)
        return Schedule.from_dict(d)

    @property
    def param_bytes(self) -> int:
        return sum(u.param_bytes for u in self.units)
