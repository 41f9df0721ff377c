"""Interconnect emulation inside a rank, for every engine.

The harness slows every collective a rank issues down to what the link model
(zerobench/instruments/link.py, [Note: link model]) says it would take on the emulated link, by
wrapping the torch.distributed functions the engines call. See [Note: emulation].

[Note: emulation]
:func:`install` replaces the collectives in the ``torch.distributed`` namespace
(``all_gather_single`` / ``all_gather_into_tensor``, ``reduce_scatter_single`` /
``reduce_scatter_tensor``, ``all_reduce``, ``broadcast``, ``all_gather``,
``reduce_scatter``, ``all_reduce_coalesced``) with wrappers. That is what torch 2.13's
fully_shard (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), FSDP1
(_flat_param.py, _runtime_utils.py), ZeroRedundancyOptimizer (broadcast) and impl.comm
call, all through the module attribute, so they are all covered. A call made while
another wrapped call is running (torch's deprecated names forward to the new ones) is
not emulated twice.

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

DDP's reducer calls all-reduce from C++, past these wrappers: :func:`ddp_comm_hook`
routes its buckets through the emulated all_reduce (the DDP engine registers it when
emulation is on). DDP's initial parameter broadcast (C++ ``_broadcast_coalesced``) is
not emulated; it happens once, before the timed steps.

Emulation only ever adds time: a collective never completes before the real one.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from zerobench.instruments.link import Link, SerialLink

#: Label of the span where a rank waits for an emulated collective (``<prefix><kind>``).
WAIT_PREFIX = "zerobench::wait_"


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def call_arg(args, kwargs, index: int, name: str):
    """Argument ``name`` of a torch.distributed call, given by position ``index`` or by keyword."""
    return args[index] if len(args) > index else kwargs.get(name)


#: name in torch.distributed -> (link-model kind, the bytes from the call's arguments)
_COLLECTIVES: dict[str, tuple[str, Callable]] = {
    # all-gather: the gathered output; reduce-scatter: the full input (nccl-tests)
    "all_gather_single": ("all_gather", lambda a, k: _nbytes(call_arg(a, k, 0, "output_tensor"))),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _nbytes(call_arg(a, k, 0, "output_tensor"))),
    "all_gather": ("all_gather", lambda a, k: _nbytes(call_arg(a, k, 0, "tensor_list"))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _nbytes(call_arg(a, k, 1, "input"))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nbytes(call_arg(a, k, 1, "input"))),
    "reduce_scatter": ("reduce_scatter", lambda a, k: _nbytes(call_arg(a, k, 1, "input_list"))),
    "all_reduce": ("all_reduce", lambda a, k: _nbytes(call_arg(a, k, 0, "tensor"))),
    "all_reduce_coalesced": ("all_reduce", lambda a, k: _nbytes(call_arg(a, k, 0, "tensors"))),
    "broadcast": ("broadcast", lambda a, k: _nbytes(call_arg(a, k, 0, "tensor"))),
}

#: name in torch.distributed -> the position of its ``group`` argument (``async_op`` follows it)
GROUP_POSITION = {"all_gather_single": 2, "all_gather_into_tensor": 2, "all_gather": 2,
                  "reduce_scatter_single": 3, "reduce_scatter_tensor": 3, "reduce_scatter": 3,
                  "all_reduce": 2, "all_reduce_coalesced": 2, "broadcast": 2}


def _tensor_of(args, kwargs):
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
            return x[0]
    return None


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


class Emulator:
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
        self._local = threading.local()

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

    def wrap(self, name: str, fn: Callable) -> Callable:
        kind, nbytes_of = _COLLECTIVES[name]
        group_at = GROUP_POSITION[name]

        @functools.wraps(fn)
        def emulated(*args, **kwargs):
            if getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            group = call_arg(args, kwargs, group_at, "group")
            async_op = bool(kwargs.get("async_op", False)) or (len(args) > group_at + 1 and bool(args[group_at + 1]))
            nbytes = nbytes_of(args, kwargs)
            size = dist.get_world_size(group)
            issued = time.monotonic()
            tensor = _tensor_of(args, kwargs)
            on_cuda = tensor is not None and tensor.is_cuda
            if on_cuda:
                # The link's stream starts the modelled time where the issuing stream is now.
                issued_event = torch.cuda.Event()
                issued_event.record(torch.cuda.current_stream(tensor.device))
            elif not async_op:
                # Issue asynchronously and wait below, so that the whole wait (real and
                # emulated) lies in one zerobench::wait_<kind> span.
                args, kwargs = as_async(args, kwargs, group_at)
            self._local.inside = True
            try:
                work = fn(*args, **kwargs)
            finally:
                self._local.inside = False
            sl = self.serial_link(group)
            with self._lock:
                start, end = sl.reserve(issued, kind, nbytes, size)
                self.served += 1
                self.modelled_s += end - start
            if on_cuda:
                done = self.sleep_on_link(group, tensor.device, issued_event, end - start)
                if not async_op:  # the real call made the current stream wait already
                    torch.cuda.current_stream(tensor.device).wait_event(done)
                    return work
                return EmulatedCudaWork(work, done, tensor.device)
            emulated_work = EmulatedWork(work, kind, end, _future_value(name, args, kwargs))
            if not async_op:
                emulated_work.wait()
                return None
            return emulated_work

        emulated.__zerobench_emulated__ = True
        return emulated


def as_async(args, kwargs, group_at: int):
    """The call's arguments with ``async_op=True`` (positional right after the group at
    ``group_at``, or keyword)."""
    if len(args) > group_at + 1:
        args = (*args[:group_at + 1], True, *args[group_at + 2:])
    else:
        kwargs = {**kwargs, "async_op": True}
    return args, kwargs


def _future_value(name: str, args, kwargs):
    """What a real Work's future would resolve to: the list of output tensors."""
    if name in ("all_reduce", "broadcast"):
        return [call_arg(args, kwargs, 0, "tensor")]
    if name == "all_reduce_coalesced":
        return list(call_arg(args, kwargs, 0, "tensors"))
    return [args[0] if args else next(iter(kwargs.values()), None)]


_active: Emulator | None = None
_originals: dict[str, Callable] = {}


def active() -> Emulator | None:
    """The installed emulator, or None when the interconnect is not emulated."""
    return _active


def install(link: Link, cuda_cycles_per_s: float | None = None) -> Emulator:
    """Emulate ``link`` for every collective this process issues from now on."""
    global _active
    if _active is not None:
        uninstall()
    emulator = Emulator(link, cuda_cycles_per_s)
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        _originals[name] = fn
        setattr(dist, name, emulator.wrap(name, fn))
    _active = emulator
    return emulator


def uninstall() -> None:
    global _active
    for name, fn in _originals.items():
        setattr(dist, name, fn)
    _originals.clear()
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


def ddp_comm_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP comm hook: average a bucket with the (emulated) all_reduce.

    Register with ``ddp.register_comm_hook(group_or_None, ddp_comm_hook)``; same result
    as DDP's built-in all-reduce, but the bucket is served by the emulated link."""
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
ddp_comm_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


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
