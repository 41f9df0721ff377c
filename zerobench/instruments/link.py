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
import os
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
    curves: tuple = ()
    """Measured bus bandwidth by collective and size, from a link file ([Note: measured links]):
    ``((kind, sizes in bytes, bus bandwidths in GB/s), ...)``; empty for a preset or explicit numbers."""
    world_size: int = 0
    """The ranks the curves were measured over (0: no curves)."""

    def __post_init__(self):
        if not (self.bandwidth_gbps > 0 and math.isfinite(self.bandwidth_gbps)):
            raise ValueError(f"bandwidth_gbps must be a finite number > 0, got {self.bandwidth_gbps!r}")
        if not (self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise ValueError(f"latency_us must be a finite number >= 0, got {self.latency_us!r}")
        curves = tuple((str(kind), tuple(int(n) for n in sizes), tuple(float(b) for b in busbw))
                       for kind, sizes, busbw in self.curves)  # JSON's lists, read back
        for kind, sizes, busbw in curves:
            if kind not in KINDS:
                raise ValueError(f"curves: kind {kind!r} is not allowed (allowed: {', '.join(KINDS)})")
            if len(sizes) != len(busbw) or not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] <= 0:
                raise ValueError(f"curves: {kind}'s sizes must be distinct, increasing, > 0 and one per bandwidth")
            if not all(b > 0 and math.isfinite(b) for b in busbw):
                raise ValueError(f"curves: {kind}'s bandwidths must be finite numbers > 0, got {list(busbw)}")
        object.__setattr__(self, "curves", curves)

    def to_json(self) -> dict:
        """The link as JSON, read back by ``Link(**...)``."""
        return {"bandwidth_gbps": self.bandwidth_gbps, "latency_us": self.latency_us, "name": self.name,
                "curves": [list(c) for c in self.curves], "world_size": self.world_size}

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
    """A link from a preset name, a link file (``zerobench calibrate``'s ``link.json``: [Note:
    measured links]) or explicit numbers (explicit numbers override the preset's)."""
    if preset:
        if preset not in PRESETS and (preset.endswith(".json") or os.path.isfile(preset)):
            if gbps is not None or latency_us is not None:
                raise ValueError(f"link: {preset} is a measured link file; it takes no bandwidth or latency besides")
            return read_link_file(preset)
        if preset not in PRESETS:
            raise ValueError(f"link: unknown preset {preset!r} (allowed: {', '.join(PRESETS)}, or a link file "
                             "that zerobench calibrate wrote)")
        base = PRESETS[preset]
        if gbps is None and latency_us is None:
            return base
        return Link(gbps if gbps is not None else base.bandwidth_gbps,
                    latency_us if latency_us is not None else base.latency_us)
    if gbps is None:
        raise ValueError(f"link: give a preset (one of {', '.join(PRESETS)}) or a bandwidth in GB/s")
    return Link(float(gbps), float(latency_us or 0.0))


# [Note: measured links]
# ``zerobench calibrate`` on a node of several GPUs measures each collective's time by
# message size over all of them (zerobench/validation/calibrate/collectives.py) and writes
# a link file beside its preset: per collective, the sizes and the bus bandwidths measured
# (nccl-tests' convention), the world size they were measured at, the best bandwidth and the
# smallest message's time as the link's bandwidth and latency. ``predict --link FILE`` prices
# a collective on it as on a published curve ([Note: achieved bus bandwidth] in
# zerobench/instruments/vgpu/comm.py): log-log between the measured sizes, the smallest
# message's time below them, the largest one's bandwidth above. A collective measured at a
# size takes the time measured at it. A kind it did not measure (an all-reduce where only
# all-gather and reduce-scatter were) takes the curve of the one nearest in traffic:
# all-reduce's, else all-gather's. Measured inside one node: a group spanning nodes is
# priced by ``--inter-link``.

#: The ``format`` of a link file.
LINK_FORMAT = "zerobench-link/1"


def link_file_contents(rows: list[dict], name: str, source: str) -> dict:
    """A link file's contents from measured rows (``kind``, ``nbytes``, ``seconds``,
    ``busbw_gbps``, ``world_size``): [Note: measured links]. ValueError without rows."""
    rows = [r for r in rows if r.get("seconds", 0) > 0 and r.get("busbw_gbps", 0) > 0]
    if not rows:
        raise ValueError("link file: no measured collective (the collectives section needs two GPUs or more)")
    worlds = {int(r["world_size"]) for r in rows}
    if len(worlds) != 1:
        raise ValueError(f"link file: rows measured at several world sizes {sorted(worlds)}; one link is one size")
    curves = []
    for kind in KINDS:
        mine = sorted((int(r["nbytes"]), float(r["busbw_gbps"])) for r in rows if r["kind"] == kind)
        if mine:
            curves.append([kind, [n for n, _ in mine], [b for _, b in mine]])
    smallest = min(int(r["nbytes"]) for r in rows)
    latency_s = min(float(r["seconds"]) for r in rows if int(r["nbytes"]) == smallest)
    return {"format": LINK_FORMAT, "name": name, "source": source, "world_size": worlds.pop(),
            "bandwidth_gbps": max(float(r["busbw_gbps"]) for r in rows), "latency_us": latency_s * 1e6,
            "curves": curves, "rows": rows}


def read_link_file(path) -> Link:
    """The Link of a link file; ValueError naming the file and the field that is wrong."""
    import json

    try:
        data = json.loads(open(path).read())
    except OSError as err:
        raise ValueError(f"link file {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(f"link file {path}: not JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != LINK_FORMAT:
        raise ValueError(f"link file {path}: format must be {LINK_FORMAT!r} (zerobench calibrate's link.json)")
    missing = [k for k in ("bandwidth_gbps", "latency_us", "curves", "world_size") if k not in data]
    if missing:
        raise ValueError(f"link file {path}: {missing[0]} is missing")
    try:
        return Link(float(data["bandwidth_gbps"]), float(data["latency_us"]), str(data.get("name") or path),
                    tuple(data["curves"]), int(data["world_size"]))
    except (TypeError, ValueError) as err:
        raise ValueError(f"link file {path}: {err}") from None


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
