"""Streams, events and the host clock of the virtual GPU.

[Note: virtual timeline]
The operators run for real (or on fake tensors) on the CPU, one after the other, in the
order the host thread issues them. That order is a valid execution of the GPU program:
every dependency the program states (stream order, ``wait_event``, ``wait_stream``,
host synchronisation) points backwards in issue order. So the timeline of the GPU can
be computed as the work is issued, without running anything concurrently:

* the host clock ``host.now`` advances by the host cost of each operator it dispatches
  and jumps forward when the host blocks (``Event.synchronize``, ``.item()``,
  ``synchronize()``);
* a stream is an in-order queue. Its ``tail`` is when the last thing enqueued on it
  ends. A kernel issued at host time ``h`` runs from ``max(h, tail)`` for its modelled
  duration; ``wait_event(e)`` raises ``tail`` to ``e.time``; ``wait_stream(s)`` to
  ``max(s.tail, h)``;
* an event's ``time`` is when the stream reaches it: ``max(tail, h)`` at record time.
  ``query()`` is ``time <= host.now``.

Everything is in seconds from the virtual GPU's creation. Nothing here reads the wall
clock, so a timeline is a pure function of the program and the presets, and tests can
work one out by hand.
"""

from __future__ import annotations

import itertools

_ids = itertools.count(1)


class Host:
    """The CPU thread's clock.

    With Python calls counted ([Note: host cost] in host.py), the calls made since the
    clock was last read are charged when it is next read: they were made before
    whatever reads it (an operator, a stream call, a wait), so they come first."""

    def __init__(self):
        self._now = 0.0
        # Total time the host spent blocked on the device (synchronize, item, events).
        self.blocked_s = 0.0
        # (the counter's counts by kind, seconds per item of each, told (deltas, start, end)
        # of each charge)
        self._python = None
        self._charged = ()  # the counts already charged

    def watch_python(self, counts: list | None, prices: tuple = (), charged=None) -> None:
        """Charge the Python work ``counts`` counts (one count per kind, each at its price
        in ``prices``) from now on (None: stop)."""
        self._python = (counts, tuple(prices), charged) if counts is not None else None
        self._charged = list(counts) if counts is not None else ()

    @property
    def now(self) -> float:
        python = self._python
        if python is not None and python[0] != self._charged:
            counts, prices, charged = python
            deltas = [n - done for n, done in zip(counts, self._charged)]
            self._charged = list(counts)
            start = self._now
            for n, price in zip(deltas, prices):  # in a fixed order: the sum is bit for bit the same
                self._now += n * price
            charged(deltas, start, self._now)
        return self._now

    def advance(self, seconds: float) -> None:
        self._now = self.now + seconds

    def block_until(self, t: float) -> float:
        """The host waits for device time ``t``; returns how long it waited."""
        waited = max(t - self.now, 0.0)
        self._now += waited
        self.blocked_s += waited
        return waited


class VStream:
    """An in-order queue of device work. See [Note: virtual timeline]."""

    def __init__(self, gpu, name: str, priority: int = 0):
        self.gpu = gpu
        self.name = name
        self.priority = priority
        self.id = next(_ids)
        self.tail = 0.0  # when the last work enqueued so far ends
        self.device = gpu.device
        self.device_index = 0
        self.busy_s = 0.0  # sum of kernel durations (not idle gaps)

    # -- the torch.cuda.Stream API -------------------------------------------------

    def wait_event(self, event: "VEvent") -> None:
        self.gpu.charge("wait_event")
        if event.time is not None:
            self.tail = max(self.tail, event.time)

    def wait_stream(self, stream: "VStream") -> None:
        self.gpu.charge("wait_stream")
        self.tail = max(self.tail, stream.tail, self.gpu.host.now)

    def record_event(self, event: "VEvent | None" = None) -> "VEvent":
        event = event or VEvent(self.gpu)
        event.record(self)
        return event

    def query(self) -> bool:
        self.gpu.charge("api_call")
        return self.tail <= self.gpu.host.now

    def synchronize(self) -> None:
        self.gpu.charge("api_call")
        self.gpu.host.block_until(self.tail)

    def __eq__(self, other) -> bool:
        return isinstance(other, VStream) and other.id == self.id

    def __hash__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"<virtual stream {self.name} tail={self.tail * 1e3:.3f} ms>"

    # -- used by the virtual GPU ---------------------------------------------------

    def enqueue(self, duration: float, name: str, lane_args: dict | None = None) -> tuple[float, float]:
        """Enqueue work of ``duration`` seconds issued now; returns its (start, end)."""
        start = max(self.tail, self.gpu.host.now)
        end = start + duration
        self.tail = end
        self.busy_s += duration
        self.gpu.trace.span(self.name, name, start, end, lane_args)
        return start, end


class VEvent:
    """A point in a stream's queue (torch.cuda.Event's API)."""

    def __init__(self, gpu, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.gpu = gpu
        self.time: float | None = None  # device time at which the stream reaches it
        self.stream: VStream | None = None
        self.id = next(_ids)

    def record(self, stream: VStream | None = None) -> None:
        stream = stream if stream is not None else self.gpu._current
        self.gpu.charge("event_record")
        self.stream = stream
        self.time = max(stream.tail, self.gpu.host.now)

    def wait(self, stream: VStream | None = None) -> None:
        (stream if stream is not None else self.gpu._current).wait_event(self)

    def query(self) -> bool:
        self.gpu.charge("api_call")
        return self.time is None or self.time <= self.gpu.host.now

    def synchronize(self) -> None:
        self.gpu.charge("api_call")
        if self.time is not None:
            waited = self.gpu.host.block_until(self.time)
            if waited:
                self.gpu.trace.span("host", "event.synchronize", self.gpu.host.now - waited, self.gpu.host.now)

    def elapsed_time(self, end: "VEvent") -> float:
        """Milliseconds from this event to ``end`` (both recorded)."""
        if self.time is None or end.time is None:
            raise RuntimeError("elapsed_time: both events must be recorded")
        return (end.time - self.time) * 1e3

    def __repr__(self) -> str:
        at = "unrecorded" if self.time is None else f"{self.time * 1e3:.3f} ms"
        return f"<virtual event {at}>"


class Trace:
    """Spans per lane (host and each stream) and memory counters, for a Chrome trace.

    Keeps at most ``limit`` spans so a long run cannot grow without bound."""

    def __init__(self, enabled: bool = True, limit: int = 2_000_000):
        self.enabled = enabled
        self.limit = limit
        self.spans: list[tuple[str, str, float, float, dict | None]] = []
        self.counters: list[tuple[float, dict]] = []
        self.dropped = 0

    def span(self, lane: str, name: str, start: float, end: float, args: dict | None = None) -> None:
        if not self.enabled:
            return
        if len(self.spans) >= self.limit:
            self.dropped += 1
            return
        self.spans.append((lane, name, start, end, args))

    def counter(self, t: float, values: dict) -> None:
        if self.enabled and len(self.counters) < self.limit:
            self.counters.append((t, values))

    def clear(self) -> None:
        self.spans.clear()
        self.counters.clear()
        self.dropped = 0

    def chrome(self, pid: int = 0, label: str = "virtual GPU") -> dict:
        """The trace as Chrome trace JSON (Perfetto opens it): one thread per lane."""
        lanes: dict[str, int] = {"host": 0}
        events: list[dict] = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}}]
        for lane, name, start, end, args in self.spans:
            tid = lanes.setdefault(lane, len(lanes))
            event = {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": start * 1e6,
                     "dur": max(end - start, 0.0) * 1e6, "cat": "host" if lane == "host" else "stream"}
            if args:
                event["args"] = args
            events.append(event)
        for lane, tid in lanes.items():
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": lane if lane == "host" else f"stream {lane}"}})
        for t, values in self.counters:
            events.append({"ph": "C", "pid": pid, "name": "memory (bytes)", "ts": t * 1e6, "args": values})
        return {"traceEvents": events, "displayTimeUnit": "ms"}
