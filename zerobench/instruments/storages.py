"""The life of tensor storages, followed once for every instrument that needs it.

[Note: storage lifetime]
The storage tracker (zerobench/instruments/memory.py) and the virtual GPU's caching
allocator (zerobench/instruments/vgpu/) both need to know when a storage is made, when
it dies, when it is resized in place (FSDP frees an unsharded parameter with
``untyped_storage().resize_(0)`` and makes it again the same way) and when it is used on
another stream (``Tensor.record_stream``). One :class:`StorageEvents` sees all four, and
tells every :class:`Listener` that wants the storage:

* new: a ``TorchDispatchMode`` registers every storage an operator reads or writes the
  first time it sees it (inputs too: a tensor made before any listener listened is new
  when first used), and :meth:`StorageEvents.see` registers one on request;
* free: a weak reference to the storage reports its death (on whichever thread drops
  the last reference: gloo frees a collective's tensors on its worker thread);
* resize: ``UntypedStorage.resize_`` is patched; and a storage an operator resizes
  itself is seen when the operator returns, its size being checked at every sighting:
  ``Tensor.set_(storage, offset, size, stride)`` grows a storage too small for ``size``
  (on CUDA that is a new block of the caching allocator, on the current stream), as
  does ``Tensor.resize_``;
* record_stream: ``Tensor.record_stream`` is patched. A listener that stands in for the
  device (the virtual GPU, whose streams a CPU tensor's real ``record_stream`` cannot
  take) says so (``replaces_record_stream``), and the real call is then not made.

Each storage gets one id, shared by every listener; a listener added later hears of a
storage the first time the storage is seen after it started listening. It is installed
while at least one listener listens (:func:`listen` / :func:`unlisten`).

[Note: views while building]
A view makes no storage: its output shares its input's. Building a model on a fake
world of many ranks makes views by the hundred thousand (fully_shard chunks every
parameter into one piece per rank: 600,000 views for Llama 3 8B at 1024 ranks), and as
many reads of a fake tensor's ``device`` (``prim.device``, which a tensor subclass
answers through the dispatch modes); following each through the modes cost most of
such a build. Under :func:`views_unobserved` (the fake world's build,
zerobench/rank/worlds.py) those operators go straight through: their storage is not
marked as used by them, which only the last-use order of a measured step needs.
Outside it every operator is followed (the virtual GPU charges each the host's
dispatch time, as it always has).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary


class Listener:
    """A consumer of storage events (see [Note: storage lifetime]). Override what you need."""

    #: whether this listener stands in for the device's own ``Tensor.record_stream``
    replaces_record_stream = False

    def wants(self, storage) -> bool:
        """Whether to follow this storage (asked once, when it is first seen)."""
        return True

    def on_new(self, sid: int, storage, nbytes: int) -> None:
        pass

    def on_free(self, sid: int) -> None:
        pass

    def on_resize(self, sid: int, storage, old_nbytes: int, new_nbytes: int) -> None:
        pass

    def on_record_stream(self, sid: int | None, tensor: torch.Tensor, stream) -> None:
        """``sid`` is None for a storage this listener does not follow."""


# [Note: a tensor's storages]
# Which storages hold a tensor's bytes on this rank is decided here, once, for every
# instrument (the storage follower, the storage tracker, the virtual GPU, the cost
# model, the model-state counts of the rank session):
#   * a DTensor's bytes are its local shard's (``_local_tensor``), not its global size:
#     the dispatch modes see a DTensor operator (fully_shard's optimizer step on sharded
#     parameters) before DTensor maps it onto the shard;
#   * a tensor on the meta device holds no memory anywhere (DeepSpeed's ZeRO-1/2 keep one
#     per parameter, ``round_robin_bit16_meta``);
#   * under fake tensors every storage is a meta storage, so it is the tensor's own device
#     that tells: a fake tensor's ``fake_device`` (a plain attribute: reading it
#     dispatches nothing, where ``Tensor.device`` goes through the dispatch modes), a real
#     tensor's ``device``;
#   * two tensors share a storage when ``untyped_storage()`` returns the same object
#     (views; torch keeps one Python object per storage while it lives);
#   * an operator's tensors are found in its ``(args, kwargs)`` at any depth: an ``out=``
#     tensor is one it writes (fully_shard's copy-out ``split_with_sizes_copy(..., out=)``
#     and copy-in ``_chunk_cat(..., out=)``).


def tensors_in(obj):
    """The tensors in an operator's arguments or outputs (tensors, and lists, tuples and
    dicts of them at any depth: ``(args, kwargs)``), in order: a cheaper walk than
    pytree's on the hot path."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, _CONTAINERS):
                yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            if isinstance(item, _CONTAINERS):
                yield from tensors_in(item)


_CONTAINERS = (torch.Tensor, list, tuple, dict)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s bytes on this rank: a DTensor's local shard, else ``t``
    ([Note: a tensor's storages])."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


def storages_of(values):
    """The storages holding the bytes of the tensors in ``values`` (a tensor, or lists,
    tuples and dicts of them), one per tensor, in order; tensors on the meta device are
    skipped. See [Note: a tensor's storages]."""
    for t in tensors_in(values):
        t = local_tensor(t)
        fake_device = getattr(t, "fake_device", None)
        if (fake_device if fake_device is not None else t.device).type != "meta":
            yield t.untyped_storage()


def distinct_nbytes(tensors) -> tuple[int, int]:
    """(bytes of the distinct storages, elements) of ``tensors``, the model states an
    engine reports (a tensor shares its storage's bytes with its views; 0-d tensors, an
    optimizer's step counters, are no model state and are left out)."""
    seen: dict[int, object] = {}  # id -> storage, held so that no id is reused meanwhile
    numel = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or local_tensor(t).dim() == 0:
            continue
        for storage in storages_of(t):
            numel += local_tensor(t).numel()
            seen.setdefault(id(storage), storage)
    return sum(s.nbytes() for s in seen.values()), numel


class StorageEvents(TorchDispatchMode):
    """The one follower of storages ([Note: storage lifetime]). Use the module's
    :func:`listen` and :func:`unlisten`, not this class."""

    def __init__(self):
        super().__init__()
        self.listeners: list[Listener] = []
        self._sid_of = WeakIdKeyDictionary()  # storage -> its id, while alive
        # sid -> (the weak reference reporting its death, current nbytes, listeners following it)
        self._live: dict[int, tuple[weakref.ref, int, list[Listener]]] = {}
        self._ids = itertools.count()
        # operators dispatched so far, and sid -> the last of them that read or wrote the
        # storage (a resize or record_stream counts as a use too): who held it when
        self.ops = 0
        self._last_use: dict[int, int] = {}
        # > 0 under views_unobserved(): See [Note: views while building].
        self.skip_views = 0
        self._lock = threading.RLock()
        self._originals: dict = {}
        # The virtual GPU's counter of the host's Python calls, paused while this follows an
        # operator (zerobench/instruments/vgpu/host.py, PythonCalls); None: none counts.
        self.python = None

    # -- events ---------------------------------------------------------------------

    def see(self, storage) -> int:
        """Register ``storage`` (if new) with every listener that wants it and does not
        follow it yet; return its id. A known storage whose size changed since it was last
        seen (an operator resized it: see [Note: storage lifetime]) is reported as resized
        to the listeners that follow it."""
        resized = None
        with self._lock:
            sid = self._sid_of.get(storage)
            if sid is None:
                sid = next(self._ids)
                self._sid_of[storage] = sid
                ref = weakref.ref(storage, lambda _ref, sid=sid: self._freed(sid))
                self._live[sid] = (ref, storage.nbytes(), [])
            ref, nbytes, following = self._live[sid]
            now = storage.nbytes()
            if now != nbytes:
                resized = (nbytes, list(following))
                self._live[sid] = (ref, now, following)
                nbytes = now
            self._last_use[sid] = self.ops
            new = [lst for lst in self.listeners if lst not in following and lst.wants(storage)]
            following.extend(new)
        if resized is not None:
            for listener in resized[1]:
                listener.on_resize(sid, storage, resized[0], nbytes)
        for listener in new:
            listener.on_new(sid, storage, nbytes)
        return sid

    def sid_of(self, storage) -> int | None:
        return self._sid_of.get(storage)

    def last_use(self, sid: int) -> int:
        """The count of :attr:`ops` when the storage was last read or written (-1: unknown)."""
        return self._last_use.get(sid, -1)

    def _freed(self, sid: int) -> None:
        with self._lock:
            entry = self._live.pop(sid, None)
        if entry is not None:
            for listener in entry[2]:
                listener.on_free(sid)
        with self._lock:
            self._last_use.pop(sid, None)  # after the listeners, who may ask

    def _resized(self, storage, size: int) -> None:
        with self._lock:
            sid = self._sid_of.get(storage)
            entry = self._live.get(sid) if sid is not None else None
            if entry is not None:
                self._live[sid] = (entry[0], int(size), entry[2])
        if entry is None:
            self.see(storage)
            return
        for listener in list(entry[2]):
            listener.on_resize(sid, storage, entry[1], int(size))
        self.see(storage)  # listeners that joined since it was last seen

    def _recorded(self, tensor: torch.Tensor, stream) -> None:
        for storage in storages_of([tensor]):
            sid = self.see(storage)
            with self._lock:
                following = list(self._live[sid][2]) if sid in self._live else []
            for listener in self.listeners:
                listener.on_record_stream(sid if listener in following else None, tensor, stream)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No ``torch._disable_dynamo`` wrapper around ``__torch_dispatch__``: nothing is
        compiled here, and the wrapper's Python is no program's (the virtual GPU counts
        the program's: [Note: host cost] in zerobench/instruments/vgpu/host.py)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        python = self.python
        if python is None:
            return self._dispatch(func, args, kwargs or {})
        python.pause()  # following storages is no program's work: [Note: host cost] in vgpu/host.py
        try:
            return self._dispatch(func, args, kwargs or {})
        finally:
            python.resume()

    def _dispatch(self, func, args, kwargs):
        if self.skip_views and makes_no_storage(func):  # See [Note: views while building].
            return func(*args, **kwargs)
        self.ops += 1
        for storage in storages_of((args, kwargs)):  # tensors made before anyone listened
            self.see(storage)
        out = func(*args, **kwargs)
        for storage in storages_of(out):
            self.see(storage)
        return out

    # -- installing -----------------------------------------------------------------

    def install(self) -> None:
        events = self
        resize = torch.UntypedStorage.resize_
        self._originals["resize_"] = resize
        # Tensor.record_stream: the class's own attribute, or inherited from the C class
        self._originals["record_stream"] = torch.Tensor.__dict__.get("record_stream")
        record_stream = torch.Tensor.record_stream

        def resize_(storage, size):
            result = resize(storage, size)
            events._resized(storage, size)
            return result

        def recorded(tensor, stream):
            if not any(lst.replaces_record_stream for lst in events.listeners):
                record_stream(tensor, stream)
            events._recorded(tensor, stream)

        torch.UntypedStorage.resize_ = resize_
        torch.Tensor.record_stream = recorded
        self.__enter__()

    def uninstall(self) -> None:
        self.__exit__(None, None, None)
        torch.UntypedStorage.resize_ = self._originals.pop("resize_")
        own = self._originals.pop("record_stream")
        if own is None:
            del torch.Tensor.record_stream
        else:
            torch.Tensor.record_stream = own


_events: StorageEvents | None = None
#: ``Tensor.device`` of a tensor subclass, dispatched as an operator.
_DEVICE = torch.ops.prim.device.default


def makes_no_storage(func) -> bool:
    """A view, or a read of a tensor's device: an operator that makes no storage and
    launches no kernel ([Note: views while building])."""
    return func.is_view or func is _DEVICE


def listen(listener: Listener) -> StorageEvents:
    """Start telling ``listener`` of storages; installs the follower with the first one.
    Call on the thread that runs the operators (the dispatch mode is pushed there)."""
    global _events
    if _events is None:
        _events = StorageEvents()
        _events.install()
    _events.listeners.append(listener)
    return _events


def unlisten(listener: Listener) -> None:
    global _events
    events = _events
    events.listeners.remove(listener)
    with events._lock:
        for _, _, following in events._live.values():
            if listener in following:
                following.remove(listener)
    if not events.listeners:
        events.uninstall()
        _events = None


@contextlib.contextmanager
def views_unobserved():
    """View operators pass the follower unseen meanwhile: [Note: views while building]."""
    events = _events
    if events is None:
        yield
        return
    events.skip_views += 1
    try:
        yield
    finally:
        events.skip_views -= 1


def current() -> StorageEvents | None:
    """The installed follower, if any listener listens."""
    return _events
