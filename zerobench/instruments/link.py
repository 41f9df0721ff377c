"""The interconnect as a model: how long a collective takes on a link, and in what order
collectives on one link are served. Pure Python (no torch), so the emulation inside a
rank and the simulator (which runs without torch) use the same numbers.

[Note: link model]
Each process group is a *link* with a bus bandwidth B (GB/s, 10^9 bytes per second) and
a latency L (microseconds, paid once per collective). A collective of ``nbytes`` over a
group of ``n`` ranks occupies the link for

    L + factor(kind, n) * nbytes / B

where ``nbytes`` and ``factor`` follow the nccl-tests bus-traffic convention
(PERFORMANCE.md of nccl-tests): an all-gather counts its gathered output and a
reduce-scatter its full input, each with factor (n-1)/n; an all-reduce counts its buffer
with factor 2(n-1)/n; a broadcast or anything else its buffer with factor 1. With that
convention the *bus* bandwidth of a ring collective is close to the link's bandwidth,
whatever n is, so one number describes the link.

Collectives on a link are served one at a time, in issue order: a collective starts
when it has been issued *and* the previous collective on that link has finished
(:class:`SerialLink`). Two collectives issued together therefore take the sum of their
times, not the max -- as on a real link, where they would share the wire (NCCL runs
the collectives of one communicator on one stream, in order).

Emulation built on this model only ever adds time: a collective is never reported
complete before the real one completed, so on a fast real interconnect the model is a
lower bound on nothing and an upper bound on speed.

Presets (:data:`PRESETS`) name common interconnects with the per-GPU, per-direction peak
from the vendors' data sheets and a typical small-message latency; their sources are in
docs/link.md. Achieved NCCL bus bandwidth is usually 70-90% of the peak: pass explicit
numbers (``gbps``, ``latency_us``) to model a measured link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerobench.schema.columns import COLLECTIVE_KINDS as KINDS  # the one vocabulary of kinds


def bus_factor(kind: str, group_size: int) -> float:
    """Bytes on the busiest wire per byte of the collective (nccl-tests convention)."""
    n = max(int(group_size), 1)
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class Link:
    """A link's bandwidth and latency. See [Note: link model]."""

    bandwidth_gbps: float
    """Bus bandwidth in GB/s (10^9 bytes per second)."""
    latency_us: float = 0.0
    """Fixed cost of each collective, in microseconds."""
    name: str = ""
    """A preset's name, or empty for explicit numbers."""

    def __post_init__(self):
        if not (self.bandwidth_gbps > 0 and math.isfinite(self.bandwidth_gbps)):
            raise ValueError(f"bandwidth_gbps must be a finite number > 0, got {self.bandwidth_gbps!r}")
        if not (self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise ValueError(f"latency_us must be a finite number >= 0, got {self.latency_us!r}")

    def duration_s(self, kind: str, nbytes: int, group_size: int) -> float:
        """Seconds the link is busy with one collective of ``nbytes`` over ``group_size`` ranks."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not a collective kind (allowed: {', '.join(KINDS)})")
        return self.latency_us * 1e-6 + bus_factor(kind, group_size) * nbytes / (self.bandwidth_gbps * 1e9)

    def describe(self) -> str:
        numbers = f"{self.bandwidth_gbps:g} GB/s, {self.latency_us:g} us"
        return f"{self.name} ({numbers})" if self.name else numbers


#: Named interconnects: per-GPU, per-direction peak bandwidth and a typical latency.
#: Sources and caveats: docs/link.md.
PRESETS: dict[str, Link] = {
    link.name: link
    for link in (
        Link(450.0, 10.0, "nvlink4-8gpu"),   # H100 SXM, NVLink 4: 900 GB/s bidirectional per GPU
        Link(300.0, 10.0, "nvlink3-8gpu"),   # A100 SXM, NVLink 3: 600 GB/s bidirectional per GPU
        Link(32.0, 15.0, "pcie4"),           # PCIe 4.0 x16: ~32 GB/s per direction
        Link(64.0, 15.0, "pcie5"),           # PCIe 5.0 x16: ~64 GB/s per direction
        Link(50.0, 20.0, "ib-400g"),         # InfiniBand NDR 400 Gb/s, one NIC per GPU
        Link(25.0, 20.0, "ib-200g"),         # InfiniBand HDR 200 Gb/s, one NIC per GPU
        Link(3.125, 50.0, "ethernet-25g"),   # 25 Gb/s Ethernet
        Link(0.25, 100.0, "cpu-demo"),       # slow enough that 2 CPU cores show overlap effects
    )
}


def resolve_link(preset: str | None = None, gbps: float | None = None, latency_us: float | None = None) -> Link:
    """A link from a preset name or explicit numbers (explicit numbers override the preset's)."""
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"link: unknown preset {preset!r} (allowed: {', '.join(PRESETS)})")
        base = PRESETS[preset]
        if gbps is None and latency_us is None:
            return base
        return Link(gbps if gbps is not None else base.bandwidth_gbps,
                    latency_us if latency_us is not None else base.latency_us)
    if gbps is None:
        raise ValueError(f"link: give a preset (one of {', '.join(PRESETS)}) or a bandwidth in GB/s")
    return Link(float(gbps), float(latency_us or 0.0))


class SerialLink:
    """One link's queue: collectives served in issue order, one at a time.

    ``reserve`` is called when a collective is issued, with the issue time on any clock
    (seconds); it returns the modelled (start, end) on that clock.
    """

    __slots__ = ("link", "busy_until", "served")

    def __init__(self, link: Link):
        self.link = link
        self.busy_until = -math.inf  # when the last collective reserved on this link ends
        self.served = 0

    def reserve(self, issued_at: float, kind: str, nbytes: int, group_size: int) -> tuple[float, float]:
        start = max(issued_at, self.busy_until)
        end = start + self.link.duration_s(kind, nbytes, group_size)
        self.busy_until = end
        self.served += 1
        return start, end


def link_from_config(config: dict):
    """The zerobench.instruments.link.Link a cell emulated, from its config (None when off)."""
    def value(name):
        v = config.get(name)
        if v is None or (isinstance(v, float) and math.isnan(v)) or v == "":
            return None
        return v

    preset, gbps = value("emulate_link"), value("emulate_gbps")
    if preset is None and not gbps:
        return None
    latency = value("emulate_latency_us")
    if gbps:
        return resolve_link(preset, float(gbps), (float(latency) or None) if preset else float(latency or 0.0))
    return resolve_link(preset)
