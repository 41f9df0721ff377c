"""``limit_all_gathers``: a bound on the unsharded units in flight.

[Note: rate limiter]
PyTorch 1.13 records a CUDA event at every free of a unit's unsharded parameters and,
before issuing an all-gather, blocks the CPU on the oldest recorded event once two are
queued. The CPU thread, which otherwise runs far ahead of the GPU, can then be at most
two frees ahead of it, so the caching allocator holds about two units' unsharded
parameters at a time instead of every unit the CPU has already issued gathers for.

On a CPU compute device there is no device queue for the main thread to run ahead of:
a free happens when the main thread reaches it. What does run ahead is a *prefetch*
(forward prefetch, BACKWARD_PRE/BACKWARD_POST), whose all-gather allocates the next
unit's unsharded buffer while the current unit still holds its own. So this limiter
counts what the bound is about, directly:

* a *ticket* is taken when an all-gather is issued for a unit that the schedule will
  free again (FULL_SHARD/HYBRID_SHARD units other than the root in forward; every
  sharded unit in backward) and returned when that unit frees. Units the strategy
  deliberately keeps unsharded (the root through forward, SHARD_GRAD_OP from forward to
  backward) hold no ticket: they are held, not in flight, and a memory budget counts
  them separately;
* before issuing an all-gather, if ``depth`` tickets are out, the new all-gather waits
  for the oldest free. A prefetch waits without blocking: it is queued here and issued
  by the very reshard that returns the oldest ticket (the moment PyTorch's CPU thread
  would return from its event wait). A unit that needs its parameters *now* cannot wait
  for a free that only this thread can perform later, so it is issued at once and
  counted as an overrun (this happens with nesting deeper than ``depth`` or with units
  that stay unsharded until the end of backward, e.g. frozen ones);
* the cost is recorded as a stall: when a unit later blocks on an all-gather that the
  limiter held back, that wait runs under ``impl::rate_limiter_wait`` and its time is
  ``stall_s``. Without the limiter that gather would have been in flight earlier.

With the 1-ahead prefetch of PyTorch 1.13, at most two units are in flight at once
(the current one and the prefetched one), so the default depth 2 rarely binds; depth 1
turns every prefetch into "issue right after the current unit frees", which is the
configuration to study. ``max_in_flight`` is counted whether or not the limit is on.

On a CUDA compute device the limiter does what PyTorch 1.13 does instead (the CPU
behaviour above is unchanged): each free of a unit's unsharded parameters records an
event on the compute stream into a :class:`FreeEventQueue`; before a new all-gather,
once ``depth`` free events are queued, the CPU thread blocks on the oldest one
(``event.synchronize()``). The CPU thread can then be at most ``depth`` frees ahead of
the GPU, so the caching allocator holds about ``depth`` units' unsharded parameters
beyond the one being computed on. Every such block counts as a stall and its time is
``stall_s``. Nothing is deferred in this mode, so ``limiter_overruns`` stays 0.
"""

from __future__ import annotations

import time
from collections import deque


class FreeEventQueue:
    """Events recorded at each free, oldest first (PyTorch 1.13's ``_FreeEventQueue``).

    Works with any object that has ``synchronize()``: CUDA events in use, fakes in tests.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self._queue: deque = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def enqueue(self, event) -> None:
        self._queue.append(event)

    def dequeue_if_needed(self):
        """The oldest event when ``depth`` are queued (the caller blocks on it), else None."""
        if len(self._queue) >= self.depth:
            return self._queue.popleft()
        return None


class RateLimiter:
    """Shared by every unit under one root. See [Note: rate limiter]."""

    def __init__(self, enabled: bool, depth: int, use_events: bool = False, clock=None):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"limiter_depth must be an int >= 1, got {depth!r}")
        self.enabled = enabled
        self.depth = depth
        # CUDA: bound the CPU thread's lead with free events (see the note) instead of
        # deferring prefetches.
        self.use_events = use_events
        # Host seconds (time.perf_counter unless the device module has a host clock of
        # its own, as a virtual GPU does): what stall_s is measured in.
        self.clock = clock or now
        self.free_events = FreeEventQueue(depth)
        # Units (FlatParamUnit) holding a ticket, oldest first: the frees a new all-gather
        # may have to wait for.
        self._in_flight: deque = deque()
        # Prefetches held back until a ticket is returned, in request order; each is issued
        # through its issue_deferred_all_gather().
        self._deferred: deque = deque()
        # Metrics since the last take_metrics() (read by the harness through the engine).
        self.max_in_flight = 0
        self.stalls = 0  # all-gathers held back
        self.stall_s = 0.0  # time blocked on all-gathers that were held back
        self.overruns = 0  # required all-gathers issued beyond depth
        self.all_gathers = 0

    # -- issue ---------------------------------------------------------------------

    def admit(self, unit, prefetch: bool, ticketed: bool) -> bool:
        """May ``unit`` issue its all-gather now? False means it was queued (prefetch only)."""
        if ticketed and self.enabled and not self.use_events and len(self._in_flight) >= self.depth:
            if prefetch:
                self._deferred.append(unit)
                self.stalls += 1
                return False
            self.overruns += 1
        return True

    @property
    def wants_free_events(self) -> bool:
        """Whether ``on_free`` needs an event (event mode with the limit on)."""
        return self.enabled and self.use_events

    def is_deferred(self, unit) -> bool:
        return unit in self._deferred

    def cancel(self, unit) -> None:
        """``unit`` needs its parameters now: it leaves the queue and issues itself."""
        self._deferred.remove(unit)

    def before_all_gather(self) -> None:
        """Event mode: block the CPU thread on the oldest free once ``depth`` are queued."""
        if not (self.enabled and self.use_events):
            return
        event = self.free_events.dequeue_if_needed()
        if event is None or event.query():
            return  # the device has passed that free: nothing to wait for, no stall
        start = self.clock()
        event.synchronize()
        self.stalls += 1
        self.stall_s += self.clock() - start

    def on_issue(self, unit, ticketed: bool) -> None:
        self.all_gathers += 1
        if ticketed:
            self._in_flight.append(unit)
            self.max_in_flight = max(self.max_in_flight, len(self._in_flight))

    # -- free ----------------------------------------------------------------------

    def on_free(self, unit, event=None) -> None:
        """``unit`` freed its unsharded parameters: return its ticket, release queued prefetches.

        ``event`` (event mode): recorded on the compute stream right after the free."""
        if self.enabled and self.use_events and event is not None:
            self.free_events.enqueue(event)
        try:
            self._in_flight.remove(unit)
        except ValueError:
            pass  # it held no ticket
        while self._deferred and len(self._in_flight) < self.depth:
            self._deferred.popleft().issue_deferred_all_gather()

    def record_stall(self, seconds: float) -> None:
        self.stall_s += seconds

    def end_of_backward(self) -> None:
        """Prefetches still queued are dropped: their units were not needed this iteration."""
        self._deferred.clear()

    def take_metrics(self) -> dict[str, float]:
        out = {
            "limiter_stall_s": self.stall_s,
            "limiter_stalls": float(self.stalls),
            "limiter_overruns": float(self.overruns),
            "max_inflight_all_gathers": float(self.max_in_flight),
            "all_gathers": float(self.all_gathers),
        }
        self.stall_s, self.stalls, self.overruns, self.all_gathers = 0.0, 0, 0, 0
        self.max_in_flight = len(self._in_flight)
        return out


def now() -> float:
    return time.perf_counter()
