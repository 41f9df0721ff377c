"""The contract between simulate's written specification of FSDP's program order
(zerobench/whatif/simulate/model.py, [Note: simulation model]) and the code it
specifies: impl's FSDP, run by the rank session on the virtual GPU.

For each setting of the knobs both share (sharding strategy, backward prefetch, forward
prefetch, the limiter), one measured step of impl-fsdp is observed through the
instruments themselves: the one interception of collectives sees each all-gather (by
its output storage), the one follower of storages sees each unit's unsharded buffer
freed (``resize_(0)``). The simulator, given the same units and knobs, must issue the
all-gathers and frees in the same order, and so agree on the most units alive at once.
"""

from __future__ import annotations

import itertools

import pytest

from zerobench.instruments import collectives, storages
from zerobench.rank.session import Session
from zerobench.rank.worlds import FakeWorld
from zerobench.spec.cell import Cell
from zerobench.spec.workload import parse_workload
from zerobench.whatif.simulate import Knobs, Schedule, Unit, simulate

LAYERS = 3
WORKLOAD = {"name": "contract", "model": {"kind": "gpt", "layers": LAYERS, "d_model": 32, "heads": 2, "vocab": 64,
                                          "seq_len": 8},
            "data": {"batch_size": 2, "warmup_steps": 1, "steps": 1}, "run": {"memory_warmup_steps": 1},
            "matrix": {"engine": ["impl-fsdp"]}}


class ProgramOrder(collectives.Layer, storages.Listener):
    """All-gathers (at issue) and frees of their outputs, in the order the host makes them."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []  # (kind, storage id)
        self.recording = False
        self._gathered: set[int] = set()

    def issue(self, call, issue):
        work = issue()
        if self.recording and call.kind == "all_gather":
            for storage in storages.storages_of(call.outputs()):
                sid = storages.current().see(storage)
                self._gathered.add(sid)
                self.events.append(("all_gather", sid))
        return work

    def on_resize(self, sid, storage, old_nbytes, new_nbytes):
        if self.recording and new_nbytes == 0 and sid in self._gathered:
            self.events.append(("free", sid))


def observed_order(opts: dict, engine: str = "impl-fsdp") -> tuple[list[tuple[str, int]], int]:
    """An engine's program order in one measured step (units numbered by their first
    all-gather: the root first, then the blocks; an engine that gathers into a new
    buffer each time, as fully_shard does, numbers each all-gather anew), and the number
    of units so numbered."""
    w = parse_workload({**WORKLOAD, "matrix": {"engine": [engine]}})
    cell = Cell(engine, 4, "fp32", tuple(sorted(opts.items())))
    order = ProgramOrder()
    from zerobench.instruments.vgpu import VirtualGpu

    with FakeWorld(4, fake_tensors=True, gpu=VirtualGpu()) as world:
        session = Session(w, cell, world)
        with collectives.intercepted(order):
            storages.listen(order)
            try:
                engine = session.build()
                session.warm_up(engine, 1)
                order.recording = True
                session.measured_step(engine, 1)
            finally:
                storages.unlisten(order)
    number: dict[int, int] = {}
    for kind, sid in order.events:
        if kind == "all_gather":
            number.setdefault(sid, len(number))
    return [(kind, number[sid]) for kind, sid in order.events], len(number)


def simulated_order(opts: dict, units: int) -> list[tuple[str, int]]:
    knobs = Knobs(sharding_strategy=opts["sharding_strategy"], backward_prefetch=opts["backward_prefetch"],
                  forward_prefetch=opts["forward_prefetch"], limit_all_gathers=opts["limit_all_gathers"],
                  limiter_depth=2)
    schedule = Schedule("impl-fsdp", 4, [Unit(f"u{i}", 1 << 20, 1e-3, 2e-3) for i in range(units)], knobs=knobs)
    return simulate(schedule, _link()).order


def _link():
    from zerobench.instruments.link import Link

    return Link(100.0, 10.0)


def _alive(order: list[tuple[str, int]]) -> int:
    held, most = set(), 0
    for kind, unit in order:
        (held.add if kind == "all_gather" else held.discard)(unit)
        most = max(most, len(held))
    return most


SETTINGS = [dict(sharding_strategy=s, backward_prefetch=b, forward_prefetch=f, limit_all_gathers=lim)
            for s, b, f, lim in itertools.product(("FULL_SHARD", "SHARD_GRAD_OP"), ("pre", "post", "none"),
                                                  (False, True), (True, False))]
#: the defaults of both engines, and the settings each knob changes from them: in the fast suite
FAST = [SETTINGS[0]] + [s for s in SETTINGS if sum((s["sharding_strategy"] != "FULL_SHARD", s["backward_prefetch"] != "pre",
                                                    s["forward_prefetch"], not s["limit_all_gathers"])) == 1]


def _id(opts):
    return "-".join(str(v) for v in opts.values())


@pytest.mark.parametrize("opts", FAST, ids=_id)
def test_simulate_issues_all_gathers_and_frees_in_impls_order(opts):
    observed, units = observed_order(opts)
    assert units == LAYERS + 1  # the root and each block
    assert simulated_order(opts, units) == observed
    assert simulate(Schedule("impl-fsdp", 4, [Unit(f"u{i}", 1 << 20, 1e-3, 2e-3) for i in range(units)],
                             knobs=Knobs(**{k: v for k, v in opts.items()}, limiter_depth=2)),
                    _link()).max_unsharded_units == _alive(observed)


@pytest.mark.slow
@pytest.mark.parametrize("opts", [s for s in SETTINGS if s not in FAST], ids=_id)
def test_simulate_matches_impl_on_every_other_setting(opts):
    observed, units = observed_order(opts)
    assert simulated_order(opts, units) == observed


def test_the_contract_sees_a_changed_order():
    """A simulator that forgot backward prefetch would break the contract."""
    opts = FAST[0]
    observed, units = observed_order(opts)
    assert simulated_order({**opts, "backward_prefetch": "none"}, units) != observed


@pytest.mark.parametrize("reshard", [True, False])
def test_simulate_gathers_as_often_as_fully_shard(reshard):
    """fully_shard as the torch-fsdp2 engine runs it (reshard_after_forward passed
    explicitly) reshards its root after forward too and gathers it again in backward:
    [Note: fully_shard's root] (zerobench/whatif/simulate/model.py). The simulator once
    kept the root, one all-gather a step short of the engine's own."""
    observed, _ = observed_order({"forward_prefetch": False, "reshard_after_forward": reshard}, "torch-fsdp2")
    gathers = sum(kind == "all_gather" for kind, _ in observed)
    units = LAYERS + 1
    assert gathers == (2 * units if reshard else units)
    schedule = Schedule("torch-fsdp2", 4, [Unit(f"u{i}", 1 << 20, 1e-3, 2e-3) for i in range(units)],
                        knobs=Knobs(reshard_after_forward=reshard))
    assert sum(kind == "all_gather" for kind, _ in simulate(schedule, _link()).order) == gathers
