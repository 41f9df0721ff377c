"""Communication as NCCL delivers it: achieved bus bandwidth by message size, and what a
running NCCL kernel takes from the compute kernels beside it. Pure Python (no torch), so
the collective layer, the virtual GPU and the simulator can all call it.

[Note: achieved bus bandwidth]
A link preset (zerobench/instruments/link.py) gives the wire's peak. NCCL reaches less,
and much less for small messages, where a collective is latency-bound. Where an
nccl-tests curve of bus bandwidth by message size is published for a link, a collective
of ``nbytes`` (nccl-tests' size convention: an all-gather's output, a reduce-scatter's
input, an all-reduce's buffer) takes

    bus_factor(kind, n) * nbytes / busbw(nbytes)

with ``busbw`` interpolated log-log between the published points (below the smallest,
the time of the smallest; above the largest, its bandwidth). The curves, from
stas00/ml-engineering's network chapter (its measurements, 8 GPUs of one node):

* ``nvlink3-8gpu``: nccl-tests ``all_reduce_perf`` on an 8x A100 node, 32 KiB to 16 GiB,
  234.9 GB/s at 16 GiB (78 % of NVLink 3's 300 GB/s). All-gather and reduce-scatter
  run the same ring and are given the same curve.
* ``nvlink4-8gpu``: ml-engineering's ``network/benchmarks/all_reduce_bench.py`` on an 8x H200 node (H100 SXM has the same
  NVLink 4), 32 KiB to 16 GiB, 482.3 GB/s at 16 GiB: NCCL's NVLS algorithm (NVLink
  SHARP), which it selects for an all-reduce of more than 4 GPUs. Every other case
  runs a ring, measured at 16 GiB at 367.6 (all-reduce), 361.4 (all-gather) and 362.9
  GB/s (reduce-scatter): the curve capped at those rates.

A link without a published curve (InfiniBand, Ethernet, PCIe, explicit numbers) is
priced as before, latency plus bytes over the bandwidth, at ``ACHIEVED_FRACTION`` of
its peak: the network chapter's ~80 % rule, which its measurements bear out (78-82 %
on NVLink rings; 73 % per accelerator across four EFA nodes).

[Note: across nodes]
A collective over ``n`` ranks on ``k`` nodes of ``g = n / k`` GPUs each, one NIC per GPU,
does not run a flat ring at the NIC's rate: NCCL builds its rings (one per channel) so
that only the hops between nodes cross the network, and the node's ``g`` NICs carry
them in parallel. Each NIC then moves ``(k - 1) / k * S / g`` bytes of an all-gather of
``S`` (twice that for an all-reduce), so the bus bandwidth nccl-tests reports is the
NIC's rate times ``(n - 1) / (k - 1)``, and the rate per accelerator is ``busbw * (k - 1) /
(n - 1)`` (stas00/ml-engineering, network/README.md, "busbw overstates the wire by
exactly the reciprocal of the fraction of bytes that cross it": 73 % of a 50 GB/s NIC
measured across 4 EFA nodes). So the network part takes ``bus_factor * S * (k - 1) /
(n - 1)`` bytes at ``ACHIEVED_FRACTION`` of the NIC's rate, and the collective takes the
longer of that and the same collective inside a node (the ring's NVLink hops).

[Note: NCCL beside compute]
An NCCL kernel runs on SMs and moves its data through HBM, so the compute kernels that
overlap it run slower. NVIDIA/nccl#1428 measured it in GPT training on 8 A100s, each
kernel with and without an all-gather beside it: GEMM 1.18 -> 2.08 ms (x1.76), attention
0.18 -> 0.33 ms (x1.83), elementwise 0.02 -> 0.05 ms (x2.5); the NCCL maintainer's
explanation is HBM contention (each byte on the bus is stored and read back, and read
from or written to the user's buffer: 3 bytes of HBM). Those are the factors here, by
kind of kernel (compute-bound GEMMs and convolutions, attention, memory-bound), scaled
by how much traffic the collective beside it moves: a collective at the bus bandwidth
of that measurement (A100 NVLink's, 234.9 GB/s) or more slows by the full factor, one
at half of it by half the factor's excess, and so on (``contention``). Only the part of
a kernel that overlaps a collective is slowed. Kernels on a high-priority stream (FSDP2
makes its all-gather and reduce-scatter streams with priority -1) are scheduled first
and are not slowed. The NCCL kernel itself is not slowed in return (its time stays the
curve's), a simplification: nccl#1428 saw it slowed too.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

#: The fraction of a link's peak a collective reaches where no curve is published.
ACHIEVED_FRACTION = 0.80
#: Slowdown of a kernel beside an NCCL all-gather, by kind (NVIDIA/nccl#1428, 8x A100).
SLOWDOWN = {"compute": 2.08 / 1.18, "attention": 0.33 / 0.18, "memory": 0.05 / 0.02}
#: The bus bandwidth of that measurement's link, at which the factors apply in full (GB/s).
SLOWDOWN_AT_GBPS = 234.89

_KiB = 1024


@dataclass(frozen=True)
class BusbwCurve:
    """Published bus bandwidth (GB/s) by message size (bytes), increasing sizes."""

    sizes: tuple
    busbw_gbps: tuple
    source: str

    def __post_init__(self):
        if len(self.sizes) != len(self.busbw_gbps) or len(self.sizes) < 2 or list(self.sizes) != sorted(self.sizes):
            raise ValueError(f"BusbwCurve ({self.source}): sizes must increase and match busbw_gbps")

    def busbw(self, nbytes: float) -> float:
        """GB/s at ``nbytes``: log-log interpolation; the smallest point's time below it."""
        sizes, bws = self.sizes, self.busbw_gbps
        if nbytes <= sizes[0]:
            return bws[0] * nbytes / sizes[0]  # latency-bound: the smallest message's time
        if nbytes >= sizes[-1]:
            return bws[-1]
        i = bisect.bisect_right(sizes, nbytes) - 1
        x = (math.log(nbytes) - math.log(sizes[i])) / (math.log(sizes[i + 1]) - math.log(sizes[i]))
        return math.exp(math.log(bws[i]) + x * (math.log(bws[i + 1]) - math.log(bws[i])))


_SIZES = tuple(32 * _KiB * 2**i for i in range(20))  # 32 KiB .. 16 GiB, doubling

#: nccl-tests all_reduce_perf, 8x A100 NVLink 3 (stas00/ml-engineering, network/README.md).
A100_NVLINK3 = BusbwCurve(_SIZES, (1.31, 2.45, 4.43, 7.47, 11.41, 18.00, 36.18, 72.33, 109.93, 106.16, 138.49,
                                   171.54, 176.92, 194.07, 222.72, 229.04, 231.41, 233.88, 234.61, 234.89),
                          "nccl-tests all_reduce_perf, 8x A100 NVLink 3")
#: network/benchmarks/all_reduce_bench.py, 8x H200 NVLink 4, NVLS (stas00/ml-engineering, network/README.md).
H200_NVLINK4_NVLS = BusbwCurve(_SIZES, (1.44, 2.93, 5.73, 11.74, 23.94, 39.93, 64.53, 107.16, 155.53, 219.89,
                                        275.84, 346.51, 401.93, 436.15, 450.29, 463.58, 469.17, 473.10, 477.45,
                                        482.26),
                               "all_reduce_bench.py, 8x H200 NVLink 4 (NVLS)")
#: Ring bus bandwidth at 16 GiB on the same H200 node, by collective (nccl-tests).
NVLINK4_RING_GBPS = {"all_reduce": 367.61, "all_gather": 361.4, "reduce_scatter": 362.9}
#: NCCL selects NVLS for an all-reduce of more than this many GPUs (H200 node, measured).
NVLS_ABOVE = 4


def curve_busbw(link_name: str, kind: str, nbytes: float, group_size: int) -> float | None:
    """Published bus bandwidth (GB/s) of this collective on this link preset, or None
    where no curve is published. See [Note: achieved bus bandwidth]."""
    if link_name == "nvlink3-8gpu":
        return A100_NVLINK3.busbw(nbytes)
    if link_name == "nvlink4-8gpu":
        nvls = H200_NVLINK4_NVLS.busbw(nbytes)
        if kind == "all_reduce" and group_size > NVLS_ABOVE:
            return nvls
        return min(nvls, NVLINK4_RING_GBPS.get(kind, NVLINK4_RING_GBPS["all_reduce"]))
    return None


#: The measured curve a kind without its own takes, nearest in traffic first ([Note: measured links]).
_STAND_INS = ("all_reduce", "all_gather", "reduce_scatter")


def measured_busbw(link, kind: str, nbytes: float) -> float:
    """Bus bandwidth (GB/s) of this collective on a measured link ([Note: measured links]
    in zerobench/instruments/link.py), interpolated as a published curve is."""
    curves = {k: (sizes, busbw) for k, sizes, busbw in link.curves}
    chosen = kind if kind in curves else next(k for k in (*_STAND_INS, *curves) if k in curves)
    sizes, busbw = curves[chosen]
    if len(sizes) == 1:  # one size measured: its time below it, its bandwidth above
        return busbw[0] * min(nbytes / sizes[0], 1.0)
    return BusbwCurve(sizes, busbw, link.name).busbw(nbytes)


def bus_factor(kind: str, group_size: int) -> float:
    """Bytes on the busiest wire per byte of the collective (nccl-tests convention)."""
    from zerobench.instruments.link import bus_factor as factor

    return factor(kind, group_size)


def collective_seconds(kind: str, nbytes: int, group_size: int, link, nodes: int = 1, intra_link=None) -> float:
    """How long NCCL takes for one collective of ``nbytes`` over ``group_size`` ranks on
    ``link`` (a zerobench.instruments.link.Link): the published curve's bus bandwidth
    where the link has one, else its latency plus the bytes at ``ACHIEVED_FRACTION``
    of its peak. A group of one rank costs nothing on the wire. A group spanning
    ``nodes`` > 1 nodes (``link`` then being the network, ``intra_link`` the node's own)
    takes the longer of its two parts: [Note: across nodes]."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    factor = bus_factor(kind, group_size)
    if nodes > 1:
        # [Note: across nodes]: each node's NICs carry (nodes - 1) / group_size of the
        # collective's bus bytes between them; the rest of the ring is inside the nodes.
        wire = factor * nbytes * (nodes - 1) / (group_size - 1)
        network = link.latency_us * 1e-6 + wire / (link.bandwidth_gbps * 1e9 * ACHIEVED_FRACTION)
        inside = collective_seconds(kind, nbytes, group_size, intra_link) if intra_link is not None else 0.0
        return max(network, inside)
    busbw = measured_busbw(link, kind, nbytes) if link.curves else curve_busbw(link.name, kind, nbytes, group_size)
    if busbw is not None:
        return factor * nbytes / (busbw * 1e9)
    return link.latency_us * 1e-6 + factor * nbytes / (link.bandwidth_gbps * 1e9 * ACHIEVED_FRACTION)


def bus_bytes_per_s(kind: str, nbytes: int, group_size: int, seconds: float) -> float:
    """The bus bandwidth a collective of that size achieved in ``seconds`` (bytes/s)."""
    if seconds <= 0:
        return 0.0
    return bus_factor(kind, group_size) * nbytes / seconds


def contention(kind: str, busbw_bytes_per_s: float) -> float:
    """How much slower a kernel of ``kind`` ("compute", "attention", "memory") runs beside
    collectives moving ``busbw_bytes_per_s`` on the bus. See [Note: NCCL beside compute]."""
    share = min(busbw_bytes_per_s / (SLOWDOWN_AT_GBPS * 1e9), 1.0)
    return 1.0 + (SLOWDOWN[kind] - 1.0) * share
