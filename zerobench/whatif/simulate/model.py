"""The discrete-event model of one rank's training step.

[Note: simulation model]
One rank has a *compute stream* and one :class:`~zerobench.instruments.link.SerialLink` per process
group (one link, or two for HYBRID_SHARD: the shard group inside a node and the
replica group across nodes). The thread that drives training issues compute and
collectives in program order; the model walks that program once, keeping

* ``t``: when the compute stream is free (the next compute starts at ``t``, or when the
  all-gather it needs ends, whichever is later -- that difference is a *wait*);
* for each link, when its last collective ends (collectives on one link are served in
  issue order, one at a time: [Note: link model] in zerobench/instruments/link.py);
* which units hold unsharded parameters, from their all-gather's issue to their free.

Program order, as in impl/fsdp/runtime.py and PyTorch FSDP1:

* forward, unit ``i`` (root first): all-gather it unless held; with forward prefetch
  also issue the next ``prefetch_depth`` units' all-gathers; wait; compute; free it
  when the strategy reshards after forward (FULL_SHARD, HYBRID_SHARD, fully_shard with
  ``reshard_after_forward``; under impl and FSDP1 never the root, which backward needs
  at once; fully_shard's root too, gathered again first thing in backward: [Note:
  fully_shard's root]);
* backward, units in reverse: all-gather unless held; BACKWARD_PRE prefetches the next
  unit(s) in backward order before the compute, BACKWARD_POST after it; compute; free
  (sharded strategies); reduce the gradient (reduce-scatter; all-reduce for NO_SHARD;
  HYBRID_SHARD then all-reduces the shard across nodes on the second link);
* limit_all_gathers with depth ``d`` (see [Note: rate limiter] in impl/fsdp/rate_limiter.py):
  a ticket per all-gather of a unit that will be freed; with ``d`` tickets out a
  *prefetch* is deferred until the oldest ticket's free, an all-gather needed now is
  issued anyway;
* end of backward: wait for every gradient reduction, then the optimizer step;
* with ``blocking_collectives`` (PyTorch's FSDPs on CPU, whose ``async_op=False``
  calls wait there), the thread waits for each collective as it issues it: a prefetch
  then only moves a wait earlier, it hides nothing.

[Note: fully_shard's root]
fully_shard exempts the root from ``reshard_after_forward`` only when that argument is
left to its default (``None``: torch's ``_lazy_init`` then keeps the root unsharded,
since backward needs it at once). zerobench's torch-fsdp2 engine passes it explicitly,
so its root reshards after forward like every block and is
gathered again at the start of backward, when its outputs get their gradients: twice
as many all-gathers per step as units, the root's included (tests/test_simulate_contract.py
counts them in the engine's own step). The model kept that root, one all-gather short:
every fully_shard cell of the validation was predicted 1-4 % low, and more for a model
whose root (embeddings and head) outweighs a block.

DDP and ZeRO: no all-gathers in forward or backward; gradients are put into buckets
of ``bucket_mb`` in backward order and each full bucket is all-reduced (DDP, ZeRO-1)
or reduce-scattered (ZeRO-2) at once, overlapping the rest of backward; after the
optimizer step ZeRO all-gathers the updated parameters (nothing hides it).

The model times one step in steady state. It ignores the CPU running ahead of a GPU
(launch overhead and queueing), compute slowed down by concurrent communication, and
memory-bandwidth contention: docs/simulate.md says how large those were when measured.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from zerobench.analysis.profiling import intervals as iv
from zerobench.instruments.link import Link, SerialLink

from .schedule import Schedule

SHARDED_OPTIMIZER = ("impl-fsdp", "torch-fsdp1", "torch-fsdp2", "impl-zero", "torch-zero1")


@dataclass
class Span:
    lane: str
    """"compute", "wait", or a link's name."""
    label: str
    start: float
    end: float


@dataclass
class SimResult:
    step_time_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    overlap_ratio: float
    link_utilisation: dict
    """link name -> busy seconds / step seconds."""
    max_unsharded_units: int
    max_unsharded_bytes: int
    spans: list[Span] = field(default_factory=list)
    alive: list[tuple[float, int, int]] = field(default_factory=list)
    """(time, unsharded units, unsharded bytes) after each change."""
    order: list[tuple[str, int]] = field(default_factory=list)
    """("all_gather" | "free", unit index) in program order: what the contract with the
    engines' own code checks (tests/test_simulate_contract.py)."""

    def row(self) -> dict:
        return {"step_time_s": self.step_time_s, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "exposed_comm_s": self.exposed_comm_s, "overlap_ratio": self.overlap_ratio,
                **{f"util_{k}": v for k, v in self.link_utilisation.items()},
                "max_unsharded_units": self.max_unsharded_units,
                "max_unsharded_bytes": self.max_unsharded_bytes}


class _Rank:
    """State of one simulated step. See [Note: simulation model]."""

    def __init__(self, schedule: Schedule, links: dict[str, Link], world_size: int, compute_scale: float):
        self.s, self.k = schedule, schedule.knobs
        self.n = world_size
        self.scale = compute_scale
        self.links = {name: SerialLink(link) for name, link in links.items()}
        self.t = 0.0
        self.spans: list[Span] = []
        self.ag_end: dict[int, float] = {}  # unit -> when its (issued) all-gather ends
        self.held: set[int] = set()  # units with unsharded parameters (gathered or being gathered)
        self.tickets: deque = deque()  # limiter: units holding a ticket, oldest first
        self.deferred: deque = deque()  # limiter: prefetches waiting for a ticket
        self.pending_grads: list[float] = []  # ends of gradient reductions in flight
        self.alive: list[tuple[float, int, int]] = [(0.0, 0, 0)]
        self.order: list[tuple[str, int]] = []  # ("all_gather" | "free", unit) in program order

    # ---- links
    def group(self) -> tuple[str, int]:
        """The link and group size all-gathers and reduce-scatters use."""
        if self.k.sharding_strategy == "HYBRID_SHARD":
            return "intra", min(self.k.gpus_per_node, self.n)
        return "link", self.n

    def collective(self, link: str, kind: str, nbytes: int, group_size: int, at: float, label: str) -> float:
        start, end = self.links[link].reserve(at, kind, nbytes, group_size)
        self.spans.append(Span(link, label, start, end))
        if self.k.blocking_collectives and end > self.t:
            self.spans.append(Span("wait", f"blocked in {label}", self.t, end))
            self.t = end
        return end

    # ---- memory
    def _mark(self, at: float) -> None:
        units = self.s.units
        self.alive.append((at, len(self.held), sum(units[u].param_bytes for u in self.held)))

    # ---- all-gather, limiter, free
    def all_gather(self, u: int, at: float, prefetch: bool, ticketed: bool) -> None:
        if u in self.held:
            return
        if self.k.limit_all_gathers and ticketed and len(self.tickets) >= self.k.limiter_depth:
            if prefetch:
                if u not in self.deferred:
                    self.deferred.append(u)
                return
        if u in self.deferred:
            self.deferred.remove(u)
        link, size = self.group()
        self.ag_end[u] = self.collective(link, "all_gather", self.s.units[u].param_bytes, size, at,
                                         f"all_gather {self.s.units[u].name}")
        self.held.add(u)
        self.order.append(("all_gather", u))
        if ticketed:
            self.tickets.append(u)
        self._mark(at)

    def free(self, u: int, at: float) -> None:
        self.held.discard(u)
        self.order.append(("free", u))
        if u in self.tickets:
            self.tickets.remove(u)
        self._mark(at)
        while self.deferred and len(self.tickets) < self.k.limiter_depth:
            self.all_gather(self.deferred[0], at, prefetch=False, ticketed=True)

    def wait_for(self, u: int) -> None:
        end = self.ag_end.get(u, 0.0)
        if end > self.t:
            self.spans.append(Span("wait", f"wait {self.s.units[u].name}", self.t, end))
            self.t = end

    def compute(self, seconds: float, label: str) -> None:
        d = seconds / self.scale
        self.spans.append(Span("compute", label, self.t, self.t + d))
        self.t += d

    # ---- FSDP
    def frees_after_forward(self, u: int) -> bool:
        if self.k.reshard_after_forward is not None:  # fully_shard: See [Note: fully_shard's root]
            return bool(self.k.reshard_after_forward) and self.k.sharding_strategy != "NO_SHARD"
        if u == 0:
            return False  # impl and FSDP1: the root stays unsharded, backward starts with it
        return self.k.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")

    def fsdp_step(self) -> None:
        k, units = self.k, self.s.units
        n_units = len(units)
        sharded = k.sharding_strategy != "NO_SHARD"
        if not sharded:
            self.held = set(range(n_units))
            self._mark(0.0)
        for i in range(n_units):
            self.all_gather(i, self.t, prefetch=False, ticketed=self.frees_after_forward(i))
            if k.forward_prefetch and sharded:
                for j in range(i + 1, min(i + 1 + k.prefetch_depth, n_units)):
                    self.all_gather(j, self.t, prefetch=True, ticketed=self.frees_after_forward(j))
            self.wait_for(i)
            self.compute(units[i].forward_s, f"forward {units[i].name}")
            if sharded and self.frees_after_forward(i):
                self.free(i, self.t)
        if sharded and self.frees_after_forward(0):
            # The root's outputs get the first gradients: a root resharded after forward
            # is gathered again before anything else of backward. See [Note: fully_shard's root].
            self.all_gather(0, self.t, prefetch=False, ticketed=True)
            self.wait_for(0)
        order = list(range(n_units - 1, -1, -1))
        for pos, i in enumerate(order):
            nxt = order[pos + 1: pos + 1 + k.prefetch_depth]
            self.all_gather(i, self.t, prefetch=False, ticketed=sharded)
            if k.backward_prefetch == "pre" and sharded:
                for j in nxt:
                    self.all_gather(j, self.t, prefetch=True, ticketed=True)
            self.wait_for(i)
            self.compute(units[i].backward_s, f"backward {units[i].name}")
            if sharded:
                self.free(i, self.t)
                if k.backward_prefetch == "post":
                    for j in nxt:
                        self.all_gather(j, self.t, prefetch=True, ticketed=True)
            self.reduce_grad(i)
        self.finish()

    def reduce_grad(self, i: int) -> None:
        u = self.s.units[i]
        if self.k.sharding_strategy == "NO_SHARD":
            self.pending_grads.append(self.collective("link", "all_reduce", u.param_bytes, self.n, self.t,
                                                      f"all_reduce {u.name}"))
            return
        link, size = self.group()
        end = self.collective(link, "reduce_scatter", u.param_bytes, size, self.t, f"reduce_scatter {u.name}")
        if self.k.sharding_strategy == "HYBRID_SHARD" and self.n > size:
            end = self.collective("inter", "all_reduce", u.param_bytes // size, self.n // size, end,
                                  f"all_reduce {u.name} (replicas)")
        self.pending_grads.append(end)

    def finish(self, after_step=None) -> None:
        end = max(self.pending_grads, default=0.0)
        if end > self.t:
            self.spans.append(Span("wait", "wait gradients", self.t, end))
            self.t = end
        opt = self.s.optimizer_s
        if self.s.engine in SHARDED_OPTIMIZER:
            opt *= self.s.world_size / self.n  # each rank steps its shard
        self.compute(opt, "optimizer")
        if after_step:
            after_step()

    # ---- DDP / ZeRO
    def bucketed_step(self) -> None:
        units = self.s.units
        zero = self.s.engine in ("impl-zero", "torch-zero1")
        kind = "reduce_scatter" if zero and self.k.zero_stage == 2 else "all_reduce"
        cap = self.k.bucket_mb * 2**20
        for u in units:
            self.compute(u.forward_s, f"forward {u.name}")
        bucket = 0
        for i in range(len(units) - 1, -1, -1):
            self.compute(units[i].backward_s, f"backward {units[i].name}")
            bucket += units[i].param_bytes
            if cap <= 0 or bucket >= cap or i == 0:
                self.pending_grads.append(self.collective("link", kind, bucket, self.n, self.t, f"{kind} bucket"))
                bucket = 0

        def gather_params():
            if zero:
                self.t = self.collective("link", "all_gather", self.s.param_bytes, self.n, self.t,
                                         "all_gather parameters")
                self.spans.append(Span("wait", "wait parameters", self.spans[-1].start, self.t))
        self.finish(gather_params)


def simulate(schedule: Schedule, link: Link, world_size: int | None = None, compute_scale: float = 1.0,
             inter_link: Link | None = None) -> SimResult:
    """One step of ``schedule`` on ``link`` (HYBRID_SHARD: ``link`` inside a node,
    ``inter_link`` across nodes, default the same) at ``world_size`` ranks (default: as
    measured), with compute ``compute_scale`` times faster. See [Note: simulation model]."""
    schedule.validate()
    n = int(world_size or schedule.world_size)
    if n < 1:
        raise ValueError(f"world_size: must be >= 1, got {n}")
    if not compute_scale > 0:
        raise ValueError(f"compute_scale: must be > 0, got {compute_scale}")
    links = {"link": link}
    if schedule.knobs.sharding_strategy == "HYBRID_SHARD":
        links = {"intra": link, "inter": inter_link or link}
    r = _Rank(schedule, links, n, compute_scale)
    if schedule.engine in ("ddp", "impl-zero", "torch-zero1"):
        r.bucketed_step()
    else:
        r.fsdp_step()
    step = r.t
    compute = iv.merge([(s.start, s.end) for s in r.spans if s.lane == "compute"])
    comm = iv.merge([(s.start, s.end) for s in r.spans if s.lane in links])
    comm_s = iv.total(comm)
    exposed = iv.total(iv.subtract(comm, compute))
    util = {}
    for name in links:
        busy = sum(s.end - s.start for s in r.spans if s.lane == name)
        util[name] = busy / step if step > 0 else 0.0
    return SimResult(
        step_time_s=step, compute_s=iv.total(compute), comm_s=comm_s, exposed_comm_s=exposed,
        overlap_ratio=(comm_s - exposed) / comm_s if comm_s > 0 else float("nan"),
        link_utilisation=util, max_unsharded_units=max(a[1] for a in r.alive),
        max_unsharded_bytes=max(a[2] for a in r.alive), spans=r.spans, alive=r.alive, order=r.order)
