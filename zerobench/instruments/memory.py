"""A tensor-storage tracker: live tensor bytes per rank, their peak, and what the peak is made of.

Works on any device, CPU included, where no allocator statistics exist. It listens to
the one follower of storages (zerobench/instruments/storages.py, [Note: storage
lifetime]; the approach of ``torch.distributed._tools.mem_tracker``): every storage an
operator reads or writes is registered when first seen and dropped when it dies;
``UntypedStorage.resize_`` is followed too, because FSDP frees and re-allocates
unsharded parameters by resizing storages in place. It is also a layer of the one
interception of collectives (zerobench/instruments/collectives.py): it counts bytes and
calls per kind and marks all-gather outputs.

[Note: telling storages apart]
A storage's role is only known for sure after the fact (a gradient is whatever ends
up in ``.grad``), so each storage gets a unique id when first seen and the role is
decided at the end of the step, in this order:
  1. parameters, gradients, optimizer state: identity with what the engine reports
     (``Engine.parameter_tensors`` ...; gradients are read as the optimizer phase starts,
     before ``zero_grad`` drops them);
  2. "unsharded": outputs of all-gather collectives (unsharded parameters under FSDP),
     and storages an engine allocates inside ``allocated_as("unsharded")`` (DeepSpeed
     ZeRO-3 copies each parameter out of its all-gather buffer: engines/deepspeed.py);
  3. "activations": storages first allocated during the forward phase, and those a
     checkpointed block allocates while its forward is recomputed in backward
     (zerobench/spec/checkpointing.py marks the recomputation);
  4. "other": everything else (gradient temporaries and buckets, reduce-scatter inputs,
     optimizer temporaries, communication buffers): [Note: what other holds].
The peak's composition is the classification of the storages live at the peak.

[Note: what other holds]
"other" holds the storages that are none of the five roles, and on a small model it is
often the largest part of the peak besides the model states, because activations are small
(a batch of 16 rows of an MLP of width 512 holds 32 KiB per block) while what is left is
sized like the parameters or the gradients. :meth:`StorageTracker.peak_other_breakdown`
splits it by when its storages were allocated (the ``peak_mem_other_{kept,backward,
optimizer}_bytes`` columns, which peak_memory.png draws):
  * "kept": live when the measured step began, kept from earlier steps: DDP's gradient
    buckets (a flat copy of every gradient, unless gradient_as_bucket_view), fully_shard's
    unsharded parameters, which it copies out of the all-gather output into storages it
    resizes (so they are not all-gather outputs, which "unsharded" counts), communication
    buffers an engine keeps;
  * "backward": allocated in backward: ZeRO-2's flat gradient partitions and reduce
    buckets, reduce-scatter inputs, gradient temporaries;
  * "optimizer": allocated in the optimizer step: the foreach implementations' temporaries
    (Adam's are each the size of the parameters they update).

The tracker slows a step down 1.5-2x on CPU: it runs in its own pass, never while
step times are measured.

[Note: freed but still in use]
On a device with stream queues (CUDA, or the virtual GPU) a storage's death is not the
end of its memory. A block handed to another stream with ``record_stream`` stays
*active* in the caching allocator after its last reference dies, until every stream it
was used on has passed that point; the allocator notices at its next allocation. The
rate limiter (``limit_all_gathers``) exists to bound exactly these blocks: with the
host far ahead of the device, every freed unsharded buffer is still in use. So the
tracker does what the allocator does: it follows ``Tensor.record_stream`` (noting each
stream other than the one the storage was allocated on), and when such a storage dies
or is resized smaller, its bytes move to a stand-in entry with the storage's role and an
event recorded on each of those streams; at each new allocation, stand-ins whose events
have all completed are dropped. Its peak is then the allocator's *active* peak (up to
the allocator's rounding), not its *allocated* one. On plain CPU nothing is deferred.

[Note: frees on other threads]
Storages can die on other threads: gloo runs each collective on a worker thread, and
that thread keeps its reference to the collective's ``Work`` (and so to the tensors the
work holds) for a moment after ``wait()`` has returned on the main thread. When the main
thread drops its own last reference within that moment, the storage dies on the worker
thread, later than the program freed it; every allocation the main thread makes in
between counts it still. So the bookkeeping takes a lock, and a peak taken while such a
free was late is too high by that storage, and lands at a different moment of the step
with a different composition. That is why two runs of the same FSDP cell used to differ
by one unit's buffer in ``peak_mem_bytes`` and by one activation (32 KiB on the quick
matrix) in ``peak_mem_activations_bytes``: in tests here one step in three to eight had a
late free, more under load.

A late free can only raise the count, and only while the storage is late. So a peak is
exact -- the peak of the program's own order of allocations and frees -- unless a
storage that died on another thread was live at the moment of the peak and the program
may already have dropped it then: no operator used it at or after the peak (one that
did shows that the program still held it). :attr:`StorageTracker.peak_exact` says which; the memory
pass (:func:`measure_exact_step`) repeats the measured step until every rank's peak is
exact, with Python's cyclic garbage collector held off during the step (a collection's
frees would fall where the allocation counts, which late frees change, put them).
Measured on the quick matrix under load: every exact step of a cell gave the same peak
and composition, every engine, fp32 and bf16.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
from collections import defaultdict

import torch

from impl.streams import accelerator
from zerobench.instruments import collectives, storages
from zerobench.instruments.collectives import CommCounter, Layer
from zerobench.instruments.storages import Listener, storages_of
from zerobench.schema.columns import MEMORY_PASS_ATTEMPTS

CATEGORIES = ("params", "grads", "optim", "unsharded", "activations", "other")
#: The parts of "other" by when they were allocated: [Note: what other holds].
OTHER_PARTS = ("kept", "backward", "optimizer")

_scope = threading.local()


@contextlib.contextmanager
def allocated_as(role: str):
    """Storages first seen on this thread inside the block have ``role`` (e.g. "unsharded"),
    unless identity with the engine's tensors decides otherwise (see [Note: telling
    storages apart]). For what an engine allocates that no collective or phase tells apart."""
    if role not in CATEGORIES:
        raise ValueError(f"role: {role!r} is not allowed (allowed: {', '.join(map(repr, CATEGORIES))})")
    outer = getattr(_scope, "role", None)
    _scope.role = role
    try:
        yield
    finally:
        _scope.role = outer


# -- the recomputation mark: set by activation checkpointing (zerobench/spec/checkpointing.py)
#    around a unit's forward recomputed in backward, read by the tracker ----------------

_recompute = threading.local()


def recomputing() -> bool:
    """Whether a checkpointed unit's forward is being recomputed in backward on this thread
    (the tracker counts what it allocates as activations, recomputed)."""
    return getattr(_recompute, "depth", 0) > 0


@contextlib.contextmanager
def marking_recompute(active: bool = True):
    """Mark the block as a recomputation (when ``active``) for :func:`recomputing`."""
    if not active:
        yield
        return
    _recompute.depth = getattr(_recompute, "depth", 0) + 1
    try:
        yield
    finally:
        _recompute.depth -= 1


class StorageTracker(Listener, Layer):
    """Follow live tensor storages on one device type; report the peak and its parts.

    Usage::

        tracker = StorageTracker("cpu")
        with tracker:
            ... build, warm up ...
            tracker.reset_peak()
            ... measured step, calling tracker.set_phase(...) ...
        tracker.classify(params=..., grads=..., optim=...)
        tracker.peak_bytes, tracker.peak_breakdown()
    """

    def __init__(self, device_type: str = "cpu", timeline: bool = True, module=None):
        self.device_type = device_type
        # The device module (torch.cuda, or what stands in for it) where the device has
        # stream queues, else None. See [Note: freed but still in use].
        self.module = module if module is not None else accelerator(device_type)
        # uid (the storage's id in storages.StorageEvents) -> the stream a storage was
        # allocated on, and the other streams it was used on
        self._allocated_on: dict[int, object] = {}
        self._used_on: dict[int, list] = {}
        # (stand-in uid, events) of freed bytes still in use on other streams; stand-ins
        # have negative uids, apart from the storages'
        self._in_use: list[tuple[int, list]] = []
        self._stand_ins = itertools.count(1)
        # stand-in uid -> the uid whose bytes it holds (its role is that storage's)
        self._stand_in_for: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.comm = CommCounter()
        self._events: storages.StorageEvents | None = None
        self._listening = False
        # uid -> current nbytes of the storages (and stand-ins) followed, while alive
        self._live: dict[int, int] = {}
        # uid -> phase in which it was first seen, and uids of all-gather outputs
        self._born_in: dict[int, str] = {}
        self._gathered: set[int] = set()
        self._phase = "setup"
        # uid -> bytes of each storage live at the peak (re-taken each time the peak rises)
        self._at_peak: dict[int, int] = {}
        # (seconds since reset_peak, uid, byte delta) while the timeline is recorded
        self._record_timeline = timeline
        self._events_log: list[tuple[float, int, int]] = []
        # (seconds since reset_peak, phase) at each phase's start, for the timeline's marks
        self._phase_log: list[tuple[float, str]] = []
        self._t0 = time.perf_counter()
        self._start_bytes: dict[int, int] = {}
        # uid -> role decided by identity with the engine's tensors
        self._roles: dict[int, str] = {}
        # storages die on gloo's worker threads too: see [Note: frees on other threads]
        self._lock = threading.RLock()
        # the thread that runs the step (set on entry); the storages that died on another
        # thread since reset_peak, with the last operator that used each; the operator
        # during which the peak was reached (counts of storages.StorageEvents.ops)
        self._owner: int | None = None
        self._late: dict[int, int] = {}
        self._peak_op = 0

    # -- storage events ([Note: storage lifetime]) -----------------------------------

    def wants(self, storage) -> bool:
        return storage.device.type == self.device_type

    def on_new(self, sid: int, storage, nbytes: int) -> None:
        with self._lock:
            self._live[sid] = nbytes
            self._born_in[sid] = getattr(_scope, "role", None) or ("recompute" if recomputing() else self._phase)
            if self.module is not None:
                self._allocated_on[sid] = self.module.current_stream()
                self._release_passed()
            self._change(sid, nbytes)

    def on_free(self, sid: int) -> None:
        with self._lock:
            nbytes = self._live.pop(sid, None)
            if nbytes is not None:
                if threading.get_ident() != self._owner:  # See [Note: frees on other threads]
                    self._late[sid] = self._events.last_use(sid) if self._events is not None else -1
                self._allocated_on.pop(sid, None)
                self._change(sid, self._keep_in_use(sid, nbytes) - nbytes)

    def on_resize(self, sid: int, storage, old_nbytes: int, new_nbytes: int) -> None:
        with self._lock:
            old = self._live.get(sid)
            if old is None:
                return
            self._live[sid] = new_nbytes
            if new_nbytes < old:
                self._change(sid, new_nbytes - old + self._keep_in_use(sid, old - new_nbytes))
            else:
                if self.module is not None:  # a new block, on the current stream
                    self._allocated_on[sid] = self.module.current_stream()
                    self._release_passed()
                self._change(sid, new_nbytes - old)

    def on_record_stream(self, sid: int | None, tensor: torch.Tensor, stream) -> None:
        if sid is None or self.module is None:
            return
        with self._lock:
            if sid not in self._live or stream == self._allocated_on.get(sid):
                return
            used = self._used_on.setdefault(sid, [])
            if stream not in used:
                used.append(stream)

    def _track(self, storage) -> int | None:
        """Follow ``storage`` (if it is of this tracker's device type); its uid, or None."""
        if not self._listening or not self.wants(storage):
            return None
        return self._events.see(storage)

    def _keep_in_use(self, uid: int, nbytes: int) -> int:
        """Of ``nbytes`` just freed from ``uid``, the bytes still in use on other streams:
        they move to a stand-in entry until those streams pass this point."""
        streams = self._used_on.pop(uid, None)
        if not streams or self.module is None or nbytes == 0:
            return 0
        events = []
        for stream in streams:
            event = self.module.Event()
            event.record(stream)
            events.append(event)
        stand_in = -next(self._stand_ins)
        self._live[stand_in] = nbytes
        self._stand_in_for[stand_in] = uid
        self._in_use.append((stand_in, events))
        return nbytes

    def _release_passed(self) -> None:
        """Drop the stand-ins whose streams have all passed their free (as the caching
        allocator does, at an allocation)."""
        still = []
        for stand_in, events in self._in_use:
            if all(e.query() for e in events):
                nbytes = self._live.pop(stand_in)
                self._change(stand_in, -nbytes)
            else:
                still.append((stand_in, events))
        self._in_use = still

    def _change(self, uid: int, delta: int) -> None:
        if delta == 0:
            return
        self.current_bytes += delta
        if self._record_timeline:
            self._events_log.append((time.perf_counter() - self._t0, uid, delta))
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._peak_op = self._events.ops if self._events is not None else 0
            self._at_peak = dict(self._live)

    def issue(self, call, issue):
        """A collective ([Note: one interception]): counted, and an all-gather's output
        storages marked as unsharded parameters."""
        self.comm.record(call.kind, call.nbytes)
        work = issue()
        if call.kind == "all_gather":
            for storage in storages_of(call.outputs()):
                uid = self._track(storage)
                if uid is not None:
                    self._gathered.add(uid)
        return work

    def __enter__(self) -> "StorageTracker":
        self._events = storages.listen(self)  # kept after exit: classify() looks storages up
        self._listening = True
        self._owner = threading.get_ident()
        collectives.push(self)
        return self

    def __exit__(self, *exc) -> None:
        collectives.pop(self)
        storages.unlisten(self)
        self._listening = False

    # -- what the harness calls ----------------------------------------------------

    def track_tensors(self, tensors) -> None:
        """Register tensors that already exist (allocated before tracking began)."""
        for storage in storages_of(tensors):
            self._track(storage)

    def set_phase(self, phase: str) -> None:
        self._phase = phase
        if self._record_timeline:
            self._phase_log.append((time.perf_counter() - self._t0, phase))

    def phases(self) -> list[tuple[float, str]]:
        """(seconds since :meth:`reset_peak`, phase) at the start of each phase of the
        measured step: the times of the timeline's marks (forward, backward, optimizer,
        "after" at its end)."""
        return [(round(t, 6), name) for t, name in self._phase_log]

    def reset_peak(self) -> None:
        """Start a measured interval: the peak restarts at the current live bytes (less
        freed bytes whose streams have passed them)."""
        with self._lock:
            self._release_passed()
        self.peak_bytes = self.current_bytes
        self._at_peak = dict(self._live)
        self._start_bytes = dict(self._at_peak)
        self._events_log = []
        self._phase_log = []
        self._t0 = time.perf_counter()
        with self._lock:
            self._late = {}
            self._peak_op = self._events.ops if self._events is not None else 0
        self.comm.reset()

    @property
    def peak_exact(self) -> bool:
        """Whether the peak since :meth:`reset_peak` is the program's own: no storage live at
        the peak, and not used by an operator at or after it, died on another thread. See
        [Note: frees on other threads]."""
        with self._lock:
            return all(self._late[uid] >= self._peak_op for uid in self._late.keys() & self._at_peak.keys())

    def classify(self, params=(), grads=(), optim=()) -> None:
        """Decide roles (see [Note: telling storages apart]); call with live tensors."""
        for role, tensors in (("optim", optim), ("grads", grads), ("params", params)):
            for storage in storages_of(tensors):
                uid = self._events.sid_of(storage) if self._events is not None else None
                if uid is not None:
                    self._roles[uid] = role

    def note_roles(self, role: str, tensors) -> None:
        """Record the role of tensors that may be gone by the time ``classify`` runs
        (gradients, read as the optimizer phase starts)."""
        for storage in storages_of(tensors):
            uid = self._track(storage)
            if uid is not None:
                self._roles[uid] = role

    def role(self, uid: int) -> str:
        uid = self._stand_in_for.get(uid, uid)
        if uid in self._roles:
            return self._roles[uid]
        born = self._born_in.get(uid)
        if born in CATEGORIES:  # allocated inside allocated_as(role)
            return born
        if uid in self._gathered:
            return "unsharded"
        if born in ("forward", "recompute"):
            return "activations"
        return "other"

    def peak_other_breakdown(self) -> dict[str, int]:
        """The bytes of "other" live at the peak by when they were allocated: "kept" (live
        when the measured step began), "backward", "optimizer" (they sum to
        ``peak_breakdown()["other"]``). See [Note: what other holds]."""
        out = dict.fromkeys(OTHER_PARTS, 0)
        for uid, nbytes in self._at_peak.items():
            if self.role(uid) != "other":
                continue
            own = self._stand_in_for.get(uid, uid)
            born = self._born_in.get(own)
            kept = uid in self._start_bytes or own in self._start_bytes
            out["kept" if kept or born not in OTHER_PARTS else born] += nbytes
        return out

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes of each category live at the peak (they sum to ``peak_bytes``)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for uid, nbytes in self._at_peak.items():
            out[self.role(uid)] += nbytes
        return out

    def timeline(self):
        """Bytes per category over the measured interval, as a DataFrame with columns
        t_s, total_bytes and one per category (one row per change)."""
        import pandas as pd

        live = defaultdict(int)
        for uid, nbytes in self._start_bytes.items():
            live[self.role(uid)] += nbytes
        rows = [{"t_s": 0.0, **{c: live[c] for c in CATEGORIES}}]
        for t, uid, delta in self._events_log:
            live[self.role(uid)] += delta
            rows.append({"t_s": t, **{c: live[c] for c in CATEGORIES}})
        df = pd.DataFrame(rows, columns=["t_s", *CATEGORIES])
        df["total_bytes"] = df[list(CATEGORIES)].sum(axis=1)
        return df


def measure_exact_step(tracker: StorageTracker, step, all_exact=None,
                       attempts: int = MEMORY_PASS_ATTEMPTS) -> tuple[object, int]:
    """Run ``step(i)`` (i = 0, 1, ...), one measured step that restarts the tracker's peak
    itself, until the peak is exact; return the last step's result and how many steps that
    took. See [Note: frees on other threads].

    Each attempt runs with the cyclic garbage collector held off. ``all_exact(flag)`` turns
    this rank's verdict into the verdict of every rank (ranks must run the same number of
    steps); it is called with the tracker's dispatch mode off, so its tensors are not
    tracked. After ``attempts`` steps without an exact peak the last one stands, and the
    count returned is ``attempts + 1``.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    result = None
    for attempt in range(attempts):
        result = None  # nothing of the last attempt (its loss, its graph) lives into this one
        gc.collect()
        gc.disable()
        try:
            result = step(attempt)
        finally:
            gc.enable()
        exact = tracker.peak_exact
        if all_exact is not None:
            with _disable_current_modes():
                exact = all_exact(exact)
        if exact:
            return result, attempt + 1
    return result, attempts + 1
