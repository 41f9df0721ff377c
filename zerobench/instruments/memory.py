"""A tensor-storage tracker: live tensor bytes per rank, their peak, and what the peak is made of.

Works on any device, CPU included, where no allocator statistics exist. It is a
``TorchDispatchMode`` (the approach of ``torch.distributed._tools.mem_tracker``): every
operator's output storages are registered when first seen and dropped, through a weak
reference, when the storage dies. ``UntypedStorage.resize_`` is followed too, because
FSDP frees and re-allocates unsharded parameters by resizing storages in place.

[Note: telling storages apart]
A storage's role is only known for sure after the fact (a gradient is whatever ends
up in ``.grad``), so each storage gets a unique id when first seen and the role is
decided at the end of the step, in this order:
  1. parameters, gradients, optimizer state: identity with what the engine reports
     (``Engine.parameter_tensors`` ...; gradients are read as the optimizer phase starts,
     before ``zero_grad`` drops them);
  2. "unsharded": outputs of all-gather collectives (unsharded parameters under FSDP);
  3. "activations": storages first allocated during the forward phase, and those a
     checkpointed block allocates while its forward is recomputed in backward
     (zerobench/spec/checkpointing.py marks the recomputation);
  4. "other": everything else (gradient temporaries and buckets, reduce-scatter inputs,
     optimizer temporaries, communication buffers).
The peak's composition is the classification of the storages live at the peak.

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

Storages can die on other threads: a gloo ``Work`` drops its tensors on gloo's worker
thread when the collective completes. So the bookkeeping takes a lock, and the peak
of engines with asynchronous collectives depends on scheduling (seen here: FSDP peaks
vary by about one unit's buffer between runs; steady-state bytes do not).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from impl.streams import accelerator
from zerobench.spec.checkpointing import recomputing
from zerobench.instruments import collectives
from zerobench.instruments.collectives import CommCounter, Layer

CATEGORIES = ("params", "grads", "optim", "unsharded", "activations", "other")


def _storages(tensors):
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = getattr(t, "_local_tensor", None)  # DTensor: its local shard holds the bytes
            t = local if local is not None else t
            if t.device.type != "meta":
                yield t.untyped_storage()


class StorageTracker(TorchDispatchMode, Layer):
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
        super().__init__()
        self.device_type = device_type
        # The device module (torch.cuda, or what stands in for it) where the device has
        # stream queues, else None. See [Note: freed but still in use].
        self.module = module if module is not None else accelerator(device_type)
        # uid -> the stream a storage was allocated on, and the other streams it was used on
        self._allocated_on: dict[int, object] = {}
        self._used_on: dict[int, list] = {}
        # (stand-in uid, events) of freed bytes still in use on other streams
        self._in_use: list[tuple[int, list]] = []
        # stand-in uid -> the uid whose bytes it holds (its role is that storage's)
        self._stand_in_for: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.comm = CommCounter()
        # storage -> uid: storages of the device being followed, while alive
        self._uid_of = WeakIdKeyDictionary()
        # uid -> (weakref keeping the finalizer alive, current nbytes)
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._uids = itertools.count()
        # uid -> phase in which it was first seen, and uids of all-gather outputs
        self._born_in: dict[int, str] = {}
        self._gathered: set[int] = set()
        self._phase = "setup"
        # uid -> bytes of each storage live at the peak (re-taken each time the peak rises)
        self._at_peak: dict[int, int] = {}
        # (seconds since reset_peak, uid, byte delta) while the timeline is recorded
        self._record_timeline = timeline
        self._events: list[tuple[float, int, int]] = []
        self._t0 = time.perf_counter()
        self._start_bytes: dict[int, int] = {}
        # uid -> role decided by identity with the engine's tensors
        self._roles: dict[int, str] = {}
        self._original_resize = None
        # storages die on gloo's worker threads too (see the module docstring)
        self._lock = threading.RLock()

    # -- tracking -----------------------------------------------------------------

    def _track(self, storage) -> int | None:
        if storage.device.type != self.device_type:
            return None
        with self._lock:
            return self._track_locked(storage)

    def _track_locked(self, storage) -> int:
        uid = self._uid_of.get(storage)
        if uid is not None:
            return uid
        uid = next(self._uids)
        nbytes = storage.nbytes()
        self._uid_of[storage] = uid
        self._live[uid] = (weakref.ref(storage, lambda _ref, uid=uid: self._on_free(uid)), nbytes)
        self._born_in[uid] = "recompute" if recomputing() else self._phase
        if self.module is not None:
            self._allocated_on[uid] = self.module.current_stream()
            self._release_passed()
        self._change(uid, nbytes)
        return uid

    def _on_free(self, uid: int) -> None:
        with self._lock:
            entry = self._live.pop(uid, None)
            if entry is not None:
                self._allocated_on.pop(uid, None)
                self._change(uid, self._keep_in_use(uid, entry[1]) - entry[1])

    def _on_resize(self, storage, new_nbytes: int) -> None:
        with self._lock:
            uid = self._uid_of.get(storage)
            if uid is None:
                self._track_locked(storage)
                return
            ref, old = self._live[uid]
            self._live[uid] = (ref, new_nbytes)
            if new_nbytes < old:
                self._change(uid, new_nbytes - old + self._keep_in_use(uid, old - new_nbytes))
            else:
                if self.module is not None:  # a new block, on the current stream
                    self._allocated_on[uid] = self.module.current_stream()
                    self._release_passed()
                self._change(uid, new_nbytes - old)

    def _on_record_stream(self, tensor: torch.Tensor, stream) -> None:
        for storage in _storages([tensor]):
            with self._lock:
                uid = self._track(storage)
                if uid is None or stream == self._allocated_on.get(uid):
                    continue
                used = self._used_on.setdefault(uid, [])
                if stream not in used:
                    used.append(stream)

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
        stand_in = next(self._uids)
        self._live[stand_in] = (None, nbytes)
        self._stand_in_for[stand_in] = uid
        self._in_use.append((stand_in, events))
        return nbytes

    def _release_passed(self) -> None:
        """Drop the stand-ins whose streams have all passed their free (as the caching
        allocator does, at an allocation)."""
        still = []
        for stand_in, events in self._in_use:
            if all(e.query() for e in events):
                _, nbytes = self._live.pop(stand_in)
                self._change(stand_in, -nbytes)
            else:
                still.append((stand_in, events))
        self._in_use = still

    def _change(self, uid: int, delta: int) -> None:
        if delta == 0:
            return
        self.current_bytes += delta
        if self._record_timeline:
            self._events.append((time.perf_counter() - self._t0, uid, delta))
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._at_peak = {u: n for u, (_, n) in self._live.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        for storage in _storages(flat_in):  # inputs allocated before tracking began
            self._track(storage)
        flat_out, _ = tree_flatten(out)
        for storage in _storages(flat_out):
            self._track(storage)
        return out

    def issue(self, call, issue):
        """A collective ([Note: one interception]): counted, and an all-gather's output
        storages marked as unsharded parameters."""
        self.comm.record(call.kind, call.nbytes)
        work = issue()
        if call.kind == "all_gather":
            for storage in _storages(call.outputs()):
                uid = self._track(storage)
                if uid is not None:
                    self._gathered.add(uid)
        return work

    def __enter__(self):
        self._original_resize = torch.UntypedStorage.resize_
        tracker, original = self, self._original_resize

        def resize_(storage, size):
            result = original(storage, size)
            tracker._on_resize(storage, size)
            return result

        torch.UntypedStorage.resize_ = resize_
        collectives.push(self)
        # Tensor.record_stream: the class's own (a device module's patch) or inherited
        self._own_record_stream = torch.Tensor.__dict__.get("record_stream")
        if self.module is not None:
            original_record_stream = torch.Tensor.record_stream

            def record_stream(tensor, stream):
                result = original_record_stream(tensor, stream)
                tracker._on_record_stream(tensor, stream)
                return result

            torch.Tensor.record_stream = record_stream
        return super().__enter__()

    def __exit__(self, *exc):
        collectives.pop(self)
        torch.UntypedStorage.resize_ = self._original_resize
        if self.module is not None:
            if self._own_record_stream is None:
                del torch.Tensor.record_stream
            else:
                torch.Tensor.record_stream = self._own_record_stream
        return super().__exit__(*exc)

    # -- what the harness calls ----------------------------------------------------

    def track_tensors(self, tensors) -> None:
        """Register tensors that already exist (allocated before tracking began)."""
        for storage in _storages(tensors):
            self._track(storage)

    def set_phase(self, phase: str) -> None:
        self._phase = phase

    def reset_peak(self) -> None:
        """Start a measured interval: the peak restarts at the current live bytes (less
        freed bytes whose streams have passed them)."""
        with self._lock:
            self._release_passed()
        self.peak_bytes = self.current_bytes
        self._at_peak = {u: n for u, (_, n) in self._live.items()}
        self._start_bytes = dict(self._at_peak)
        self._events = []
        self._t0 = time.perf_counter()
        self.comm.reset()

    def classify(self, params=(), grads=(), optim=()) -> None:
        """Decide roles (see [Note: telling storages apart]); call with live tensors."""
        for role, tensors in (("optim", optim), ("grads", grads), ("params", params)):
            for storage in _storages(tensors):
                uid = self._uid_of.get(storage)
                if uid is not None:
                    self._roles[uid] = role

    def note_roles(self, role: str, tensors) -> None:
        """Record the role of tensors that may be gone by the time ``classify`` runs
        (gradients, read as the optimizer phase starts)."""
        for storage in _storages(tensors):
            uid = self._track(storage)
            if uid is not None:
                self._roles[uid] = role

    def role(self, uid: int) -> str:
        uid = self._stand_in_for.get(uid, uid)
        if uid in self._roles:
            return self._roles[uid]
        if uid in self._gathered:
            return "unsharded"
        if self._born_in.get(uid) in ("forward", "recompute"):
            return "activations"
        return "other"

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
        for t, uid, delta in self._events:
            live[self.role(uid)] += delta
            rows.append({"t_s": t, **{c: live[c] for c in CATEGORIES}})
        df = pd.DataFrame(rows, columns=["t_s", *CATEGORIES])
        df["total_bytes"] = df[list(CATEGORIES)].sum(axis=1)
        return df
