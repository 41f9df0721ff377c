"""Interconnect emulation inside a rank, for every engine.

The harness slows every collective a rank issues down to what the link model
(zerobench/instruments/link.py, [Note: link model]) says it would take on the emulated link, by
wrapping the torch.distributed functions the engines call. See [Note: emulation].

[Note: emulation]
:func:`install` puts an :class:`Emulator` on the stack of collective layers
(zerobench/instruments/collectives.py, [Note: one interception]), so every collective
the engines issue through ``torch.distributed`` -- fully_shard, FSDP1,
ZeroRedundancyOptimizer, impl.comm, and DDP's buckets through its comm hook -- is
served on the emulated link.

Each process group is one link (:class:`zerobench.instruments.link.SerialLink`): a collective is
reserved on its group's link when it is issued and occupies it from
``max(issued, previous end)`` for the modelled duration, so two collectives issued
together take the sum of their times.

* CPU (gloo): the modelled end is served at completion. The wrapper returns an
  :class:`EmulatedWork` whose ``wait()`` waits for the real collective, then sleeps
  until the modelled end; compute issued in between hides it, as it would hide a
  slow wire. A synchronous call (``async_op=False``) is issued asynchronously and
  waited at once, so its whole wait is one ``zerobench::wait_<kind>`` span. Sleeping, not
  spinning, leaves the core to the compute.
* CUDA (NCCL): the host does not wait. Each link has a side stream per device (made
  once, :meth:`Emulator.link_stream`). At issue, an event is recorded on the current
  stream; the link's stream waits on it, then sleeps the modelled duration
  (``torch.cuda._sleep``, cycles per second measured once:
  :func:`calibrate_cycles_per_s`) and records a second event. The collective returns an
  :class:`EmulatedCudaWork` whose ``wait()`` (and future) makes the current stream wait
  on the real collective and on that second event, as NCCL's Work does for its own
  stream; a synchronous call (``async_op=False``) makes the current stream wait at
  once, as NCCL's synchronous collectives do. So the modelled time runs beside the real
  collective (it completes at the later of the two) and beside whatever the issuing
  stream does next: DDP's comm-hook all-reduces, issued from backward's compute stream,
  no longer hold that stream up until backward ends, and impl's asynchronous
  collectives and torch's synchronous ones pay the same model. The link's stream runs
  its sleeps one after the other, so it is the serial link on the device. Every call
  goes through the ``torch.cuda`` module at call time (``Stream``, ``Event``,
  ``current_stream``, ``stream``, ``_sleep``; a stream's ``wait_event``), so a
  replacement of those attributes (a virtual GPU) runs this same code.

DDP's initial parameter broadcast (``_broadcast_coalesced``) is emulated like any
broadcast; it happens once, before the timed steps.

Emulation only ever adds time: a collective never completes before the real one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from zerobench.instruments import collectives
from zerobench.instruments.collectives import Collective, Layer, ddp_comm_hook  # noqa: F401 (ddp_comm_hook: re-exported)
from zerobench.instruments.link import Link, SerialLink

#: Label of the span where a rank waits for an emulated collective (``<prefix><kind>``).
WAIT_PREFIX = "zerobench::wait_"


# -- CUDA: the device sleeps -----------------------------------------------------------


def cycles_for(duration_s: float, cycles_per_s: float) -> int:
    """``torch.cuda._sleep`` cycles for ``duration_s`` seconds (never negative)."""
    return max(int(round(duration_s * cycles_per_s)), 0)


def calibrate_cycles_per_s(time_sleep_ms: Callable[[int], float], cycles: int = 10_000_000, repeats: int = 3) -> float:
    """Cycles per second of the device's sleep, from ``time_sleep_ms(cycles)``: the
    milliseconds one ``_sleep(cycles)`` took (best of ``repeats``, after a warm-up)."""
    time_sleep_ms(cycles)  # warm-up: first launch pays for initialisation
    best = min(time_sleep_ms(cycles) for _ in range(repeats))
    if not best > 0:
        raise RuntimeError(f"emulation: could not calibrate the GPU sleep ({cycles} cycles took {best} ms)")
    return cycles / (best * 1e-3)


def _time_cuda_sleep_ms(cycles: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


class EmulatedCudaWork:
    """A collective in flight on an emulated link, on CUDA: the real collective and the
    modelled sleep on the link's stream, which ends with the event ``done``.

    As with NCCL's own Work, the host never blocks: ``wait()`` makes the current stream
    wait for the real collective and for ``done``; the future's value is ready once
    both are (a stream waiting on the future waits on ``done`` too)."""

    __slots__ = ("_work", "done", "device")

    def __init__(self, work, done, device: torch.device):
        self._work = work  # the real dist.Work (asynchronous call)
        self.done = done  # torch.cuda.Event, recorded on the link's stream after the sleep
        self.device = device  # the collective's device: whose current stream waits

    def is_completed(self) -> bool:
        return self._work.is_completed() and self.done.query()

    def wait(self, timeout=None) -> bool:
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        torch.cuda.current_stream(self.device).wait_event(self.done)
        return True

    def get_future(self) -> torch.futures.Future:
        done, device = self.done, self.device

        def after_sleep(fut):
            # A CUDA future runs its callback on a stream that waits for the real
            # collective; the child future is ready once that stream passes ``done`` too.
            torch.cuda.current_stream(device).wait_event(done)
            return fut.value()

        return self._work.get_future().then(after_sleep)

    def result(self):
        self.wait()
        return self._work.result()

    def exception(self):
        return None


# -- CPU: the wait sleeps ------------------------------------------------------------


class EmulatedWork:
    """A collective in flight on an emulated link: complete once the real collective
    is and the modelled end has passed (``time.monotonic`` clock)."""

    __slots__ = ("_work", "kind", "not_before", "_result", "_done")

    def __init__(self, work, kind: str, not_before: float, result=None):
        self._work = work  # the real dist.Work, or None once waited (or synchronous)
        self.kind = kind
        self.not_before = not_before
        self._result = result  # what get_future() resolves to
        self._done = False

    def is_completed(self) -> bool:
        real = self._work is None or self._work.is_completed()
        return real and time.monotonic() >= self.not_before

    def wait(self, timeout=None) -> bool:
        if not self._done:
            # The span marks where the rank uses the result (trace analysis: WAIT_LABELS).
            with record_function(f"{WAIT_PREFIX}{self.kind}"):
                if self._work is not None:
                    self._work.wait()
                    self._work = None
                remaining = self.not_before - time.monotonic()
                if remaining > 0:
                    time.sleep(remaining)
            self._done = True
        return True

    def get_future(self) -> torch.futures.Future:
        fut = torch.futures.Future()

        def serve():
            try:
                self.wait()
                fut.set_result(self._result)
            except Exception as exc:  # surfaced to whoever waits on the future
                fut.set_exception(exc)

        threading.Thread(target=serve, daemon=True, name="zerobench-emulated-wait").start()
        return fut

    def result(self):
        self.wait()
        return self._result

    def exception(self):
        return None


class Emulator(Layer):
    """The emulated link: one :class:`SerialLink` per process group."""

    def __init__(self, link: Link, cuda_cycles_per_s: float | None = None):
        self.link = link
        self.links: dict[object, SerialLink] = {}
        self.cuda_cycles_per_s = cuda_cycles_per_s
        self.served = 0
        self.modelled_s = 0.0  # the sum of modelled durations, for tests and reports
        # CUDA: (group, device) -> the stream the link's modelled durations sleep on, one
        # after the other (made once: a stream per call would let them overlap)
        self.link_streams: dict[tuple[object, torch.device], object] = {}
        self._lock = threading.Lock()

    def serial_link(self, group) -> SerialLink:
        key = group if group is not None else dist.group.WORLD
        with self._lock:
            if key not in self.links:
                self.links[key] = SerialLink(self.link)
            return self.links[key]

    def link_stream(self, group, device: torch.device):
        """The side stream of ``group``'s link on ``device`` (CUDA), made on first use."""
        key = (group if group is not None else dist.group.WORLD, device)
        with self._lock:
            if key not in self.link_streams:
                self.link_streams[key] = torch.cuda.Stream(device=device)
            return self.link_streams[key]

    def sleep_on_link(self, group, device: torch.device, issued, duration_s: float):
        """Enqueue the modelled ``duration_s`` on the link's stream, after the event
        ``issued`` (recorded on the issuing stream); returns the event that ends it."""
        cycles = cycles_for(duration_s, self._cycles_per_s())  # calibrates on first use, outside the link's stream
        link_stream = self.link_stream(group, device)
        done = torch.cuda.Event()
        with torch.cuda.stream(link_stream):
            link_stream.wait_event(issued)
            torch.cuda._sleep(cycles)
            done.record(link_stream)
        return done

    def _cycles_per_s(self) -> float:
        if self.cuda_cycles_per_s is None:
            self.cuda_cycles_per_s = calibrate_cycles_per_s(_time_cuda_sleep_ms)
        return self.cuda_cycles_per_s

    def issue(self, call: Collective, issue):
        """Issue ``call`` and serve its modelled end on its group's link (see the Note)."""
        issued = time.monotonic()
        tensors = call.tensors()
        on_cuda = bool(tensors) and tensors[0].is_cuda
        if on_cuda:
            # The link's stream starts the modelled time where the issuing stream is now.
            device = tensors[0].device
            issued_event = torch.cuda.Event()
            issued_event.record(torch.cuda.current_stream(device))
        work = issue()
        sl = self.serial_link(call.group)
        with self._lock:
            start, end = sl.reserve(issued, call.kind, call.nbytes, call.group_size)
            self.served += 1
            self.modelled_s += end - start
        if on_cuda:
            return EmulatedCudaWork(work, self.sleep_on_link(call.group, device, issued_event, end - start), device)
        return EmulatedWork(work, call.kind, end, call.future_value())


_active: Emulator | None = None


def active() -> Emulator | None:
    """The installed emulator, or None when the interconnect is not emulated."""
    return _active


def install(link: Link, cuda_cycles_per_s: float | None = None) -> Emulator:
    """Emulate ``link`` for every collective this process issues from now on."""
    global _active
    if _active is not None:
        uninstall()
    _active = Emulator(link, cuda_cycles_per_s)
    collectives.push(_active)
    return _active


def uninstall() -> None:
    global _active
    if _active is not None:
        collectives.pop(_active)
    _active = None


@contextlib.contextmanager
def emulated(link: Link | None, cuda_cycles_per_s: float | None = None):
    """``with emulated(link):`` -- emulate ``link`` in the block (None: do nothing)."""
    if link is None:
        yield None
        return
    emulator = install(link, cuda_cycles_per_s)
    try:
        yield emulator
    finally:
        uninstall()


def cell_link(opts: dict) -> Link | None:
    """The link a cell's ``emulate_*`` axes name, or None when emulation is off.

    ``emulate_link`` names a preset; ``emulate_gbps`` (> 0) and ``emulate_latency_us``
    give explicit numbers, which override the preset's (with a preset, a latency of 0
    -- the axis's default -- keeps the preset's latency)."""
    from zerobench.instruments.link import resolve_link

    preset = opts.get("emulate_link") or None
    gbps = opts.get("emulate_gbps") or None
    if preset is None and gbps is None:
        return None
    latency = (opts.get("emulate_latency_us") or None) if gbps else None
    if preset is None and latency is None:
        latency = 0.0
    return resolve_link(preset, gbps, latency)
