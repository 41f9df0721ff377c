"""Interconnect emulation (zerobench/instruments/emulation.py): serial links, every engine's calls."""

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from zerobench.harness.testing import run_ranks
from zerobench.instruments import emulation
from zerobench.instruments.link import Link

LATENCY_US = 60_000.0  # 60 ms per collective: far above gloo's own time on 2 busy cores
SLOW = Link(1000.0, LATENCY_US)


def _timed(fn):
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def serial_body(rank, world_size):
    with emulation.emulated(SLOW):
        t = [torch.ones(16) for _ in range(2)]
        dist.barrier()
        one = _timed(lambda: dist.all_reduce(t[0], async_op=True).wait())

        def two_together():
            works = [dist.all_reduce(x, async_op=True) for x in t]
            for w in works:
                w.wait()

        two = _timed(two_together)
        # A second group is a second link: its collective does not queue behind WORLD's.
        other = dist.new_group(list(range(world_size)))

        def two_links():
            works = [dist.all_reduce(t[0], async_op=True), dist.all_reduce(t[1], group=other, async_op=True)]
            for w in works:
                w.wait()

        parallel = _timed(two_links)
        sync = _timed(lambda: dist.all_reduce(t[0]))
    return {"one": one, "two": two, "parallel": parallel, "sync": sync, "value": t[0].clone()}


def test_collectives_on_one_link_are_served_one_at_a_time():
    out = run_ranks(serial_body, 2)[0]
    assert out["two"] > 1.7 * out["one"]           # the sum, not the max
    assert out["parallel"] < 0.8 * out["two"]      # two links overlap
    assert out["sync"] > 0.8 * out["one"]          # a synchronous call waits at once
    assert torch.equal(out["value"], torch.full((16,), 2.0 ** 4))  # results are the real ones (4 sums)


def hidden_body(rank, world_size):
    with emulation.emulated(SLOW):
        t = torch.ones(16)
        dist.barrier()
        exposed = _timed(lambda: dist.all_reduce(t, async_op=True).wait())

        def hidden():
            w = dist.all_reduce(t, async_op=True)
            time.sleep(LATENCY_US * 1e-6)  # compute issued in between hides the wire time
            w.wait()

        overlapped = _timed(hidden)
    return exposed, overlapped


def test_compute_in_between_hides_the_emulated_time():
    exposed, overlapped = run_ranks(hidden_body, 2)[0]
    assert overlapped < 1.5 * exposed  # not exposed + compute (~2x)


def fsdp2_body(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    x = torch.randn(4, 16)
    model(x).sum().backward()  # warm-up, not emulated
    with emulation.emulated(SLOW) as emu:
        start = time.monotonic()
        model(x).sum().backward()
        step = time.monotonic() - start
    return step, emu.served, emu.modelled_s


def test_torch_fsdp2_collectives_are_emulated():
    step, served, modelled = run_ranks(fsdp2_body, 2)[0]
    assert served >= 6  # all-gathers and reduce-scatters went through the wrapper
    # The step takes at least the link's busy time (the root's all-gather overlaps nothing).
    assert step >= 0.9 * modelled


def ddp_body(rank, world_size, hook):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    if hook:
        ddp.register_comm_hook(None, emulation.ddp_comm_hook)
    x = torch.randn(4, 16) + rank
    ddp(x).sum().backward()  # warm-up (bucket rebuild)
    with emulation.emulated(SLOW) as emu:
        step = _timed(lambda: ddp(x).sum().backward())
    return step, emu.served, [p.grad.clone() for p in model.parameters()]


def test_ddp_buckets_go_through_the_emulated_all_reduce():
    with_hook = run_ranks(ddp_body, 2, args=(True,))
    without = run_ranks(ddp_body, 2, args=(False,))
    assert with_hook[0][1] >= 1 and without[0][1] == 0  # the C++ reducer bypasses the wrappers
    assert with_hook[0][0] > 2 * without[0][0]
    for a, b in zip(with_hook[0][2], without[0][2]):  # same gradients as DDP's own all-reduce
        torch.testing.assert_close(a, b)


def test_cycle_math_and_calibration_with_a_fake_clock():
    rate = 1.5e9  # a fake GPU: 1.5 G sleep cycles per second
    calls = []

    def fake_time_ms(cycles):
        calls.append(cycles)
        return cycles / rate * 1e3 + (5.0 if len(calls) == 1 else 0.0)  # first launch slow

    measured = emulation.calibrate_cycles_per_s(fake_time_ms, cycles=3_000_000)
    assert measured == pytest.approx(rate)
    assert emulation.cycles_for(0.002, measured) == 3_000_000
    assert emulation.cycles_for(-1.0, measured) == 0
    with pytest.raises(RuntimeError, match="calibrate"):
        emulation.calibrate_cycles_per_s(lambda cycles: 0.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_sleep_calibration_matches_events():
    rate = emulation.calibrate_cycles_per_s(emulation._time_cuda_sleep_ms)
    cycles = emulation.cycles_for(0.05, rate)
    elapsed_ms = emulation._time_cuda_sleep_ms(cycles)
    assert 0.5 * 50 < elapsed_ms < 2 * 50


def test_cells_name_a_preset_or_explicit_numbers():
    from zerobench.instruments.link import PRESETS
    from zerobench.spec.matrix import expand
    from zerobench.spec.workload import WorkloadError, parse_workload

    def cells(matrix):
        return expand(parse_workload({"matrix": matrix}))

    out = cells({"engine": ["ddp", "torch-fsdp2", "impl-fsdp", "torch-zero1"], "emulate_link": ["ib-400g"]})
    assert len(out) == 4 and all(c.opts["emulate_link"] == "ib-400g" for c in out)
    assert emulation.cell_link(out[0].opts) == PRESETS["ib-400g"]
    link = emulation.cell_link(cells({"engine": ["ddp"], "emulate_gbps": [2.0], "emulate_latency_us": [30.0]})[0].opts)
    assert (link.bandwidth_gbps, link.latency_us) == (2.0, 30.0)
    # explicit bandwidth overrides the preset's, keeping its latency
    link = emulation.cell_link(cells({"engine": ["ddp"], "emulate_link": ["pcie4"], "emulate_gbps": [1.0]})[0].opts)
    assert (link.bandwidth_gbps, link.latency_us) == (1.0, PRESETS["pcie4"].latency_us)
    assert emulation.cell_link(cells({"engine": ["ddp"]})[0].opts) is None
    with pytest.raises(WorkloadError, match=r"emulate_link: 'ib-800g' is not allowed; did you mean 'ib-[24]00g'\? \(allowed: .*'ib-400g'"):
        cells({"engine": ["ddp"], "emulate_link": ["ib-800g"]})
    with pytest.raises(WorkloadError, match=r"emulate_gbps: -1.0 is not allowed"):
        cells({"engine": ["ddp"], "emulate_gbps": [-1.0]})


# -- CUDA: the modelled time on the link's own stream (torch.cuda faked) -----------------


class _FakeCuda:
    """The torch.cuda calls the emulation makes, logging (action, stream, event) in order."""

    def __init__(self):
        self.log = []
        self.compute = _FakeStream(self, "compute")
        self.current = self.compute
        self.streams = 0

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's name
        self.streams += 1
        return _FakeStream(self, f"side{self.streams}")

    def Event(self, enable_timing=False):  # noqa: N802
        return _FakeEvent(self)

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def _sleep(self, cycles):
        self.log.append(("sleep", self.current.name, cycles))

    def install(self, monkeypatch):
        for name in ("Stream", "Event", "current_stream", "stream", "_sleep"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


class _FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_event(self, event):
        self.cuda.log.append(("wait_event", self.name, event))


class _FakeEvent:
    def __init__(self, cuda):
        self.cuda, self.stream = cuda, None

    def record(self, stream=None):
        self.stream = (stream or self.cuda.current).name
        self.cuda.log.append(("record", self.stream, self))

    def query(self):
        return True


class _FakeWork:
    def __init__(self, cuda, tensor):
        self.cuda, self.tensor = cuda, tensor

    def wait(self, timeout=None):
        self.cuda.log.append(("work_wait", self.cuda.current.name, None))

    def is_completed(self):
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result([self.tensor])
        return fut


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda faked, a CUDA tensor (fake), and an all_reduce that only logs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def all_reduce(tensor, op=None, group=None, async_op=False):
        cuda.log.append(("all_reduce", cuda.current.name, async_op))
        return _FakeWork(cuda, tensor) if async_op else None

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with FakeTensorMode():
        tensor = torch.empty(1024, device="cuda")
        yield cuda, tensor


LINK_1MS = Link(1000.0, 1000.0)  # 1 ms latency: 1e6 sleep cycles at 1e9 cycles/s


def _sleeps(log):
    return [(stream, cycles) for action, stream, cycles in log if action == "sleep"]


def test_cuda_async_collective_sleeps_on_the_link_stream_and_wait_joins_it(fake_cuda):
    cuda, tensor = fake_cuda
    group, other = object(), object()
    emu = emulation.install(LINK_1MS, cuda_cycles_per_s=1e9)
    try:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        issued = list(cuda.log)
        work.wait()
        dist.all_reduce(tensor, group=group, async_op=True)
        dist.all_reduce(tensor, group=other, async_op=True)
    finally:
        emulation.uninstall()
    # issue: an event on compute, then the link's stream waits on it and sleeps the model
    record_issue, real, wait_issue, sleep, record_done = issued
    assert record_issue[:2] == ("record", "compute") and real == ("all_reduce", "compute", True)
    assert wait_issue == ("wait_event", "side1", record_issue[2])
    assert sleep[:2] == ("sleep", "side1") and sleep[2] == pytest.approx(1e6, rel=1e-3)
    assert record_done[:2] == ("record", "side1")
    # nothing held the compute stream at issue; wait() joins the real work and the sleep
    assert cuda.log[len(issued):len(issued) + 2] == [("work_wait", "compute", None),
                                                     ("wait_event", "compute", record_done[2])]
    # one stream per link, made once; no sleep ever on the compute stream
    assert cuda.streams == 2
    assert [s for s, _ in _sleeps(cuda.log)] == ["side1", "side1", "side2"]
    assert sum(c for _, c in _sleeps(cuda.log)) == pytest.approx(emu.modelled_s * 1e9, rel=1e-6)


def test_cuda_sync_collective_makes_the_current_stream_wait_at_once(fake_cuda):
    cuda, tensor = fake_cuda
    with emulation.emulated(LINK_1MS, cuda_cycles_per_s=1e9):
        assert dist.all_reduce(tensor, group=object()) is None
    # issued asynchronously and waited at once, as NCCL's synchronous call is: the current
    # stream joins the real collective, then the modelled sleep
    assert ("all_reduce", "compute", True) in cuda.log
    done = [ev for action, stream, ev in cuda.log if action == "record" and stream == "side1"]
    assert len(done) == 1 and cuda.log[-2:] == [("work_wait", "compute", None), ("wait_event", "compute", done[0])]
    assert [s for s, _ in _sleeps(cuda.log)] == ["side1"]


def test_cuda_ddp_hook_future_waits_for_the_modelled_time(fake_cuda):
    cuda, tensor = fake_cuda

    class Bucket:
        def buffer(self):
            return tensor

    with emulation.emulated(LINK_1MS, cuda_cycles_per_s=1e9):
        fut = emulation.ddp_comm_hook(object(), Bucket())
        assert fut.wait() is tensor
    # the hook's all-reduce left backward's stream free; its future joins the sleep
    assert [s for s, _ in _sleeps(cuda.log)] == ["side1"]
    done = [ev for action, stream, ev in cuda.log if action == "record" and stream == "side1"]
    assert ("wait_event", "compute", done[0]) in cuda.log
