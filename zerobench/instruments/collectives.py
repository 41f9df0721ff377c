"""The collectives of ``torch.distributed``: one vocabulary, and one interception that
every instrument consumes.

[Note: one interception]
Every instrument that needs to see collectives sees them here, at the
``torch.distributed`` functions the engines call through the module attribute
(torch 2.13's fully_shard in ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``,
FSDP1 in ``torch/distributed/fsdp/_flat_param.py`` and
``torch/distributed/fsdp/_runtime_utils.py``, ZeroRedundancyOptimizer's broadcasts, DDP's buffer broadcast
``_broadcast_coalesced``, and ``impl.comm``). :data:`FUNCTIONS` names each function's
kind and where its group, tensors and outputs are; a call becomes one
:class:`Collective` record (kind, bytes, group, async), the same for every consumer.

Consumers are :class:`Layer` objects on a stack (:func:`intercepted`). The wrapper
always issues the real call asynchronously and hands each layer, outermost first, the
record and a function that issues the call through the layers below it; each layer
returns a ``Work``-like object (its own, or the one it got). A caller that asked for a
synchronous call gets ``None`` after the wrapper has waited on what the layers
returned, so a layer never has to tell the two apart. The consumers:

* the emulated link (:mod:`zerobench.instruments.emulation`): serves the call's modelled
  end on its group's link;
* the virtual GPU (:mod:`zerobench.instruments.vgpu`): times the call on its group's
  communication stream;
* the storage tracker (:mod:`zerobench.instruments.memory`): counts bytes and calls per
  kind (:class:`CommCounter`) and marks all-gather outputs as unsharded parameters;
* the fake world's model of gloo's reduce-scatter buffer (:mod:`zerobench.rank.worlds`).

A call made while a wrapped call runs (a deprecated name forwarding to the new one) goes
straight through. DDP's reducer all-reduces its buckets from C++, past any Python
wrapper: while a layer is installed, the DDP-based engines register
:func:`ddp_comm_hook`, which issues the same all-reduce through ``torch.distributed``
(the reducer divides nothing once a hook is registered; the hook divides, as DDP's own
default does before its all-reduce).

Sizes follow the nccl-tests convention (its ``doc/PERFORMANCE.md``): an all-gather counts
its gathered output, a reduce-scatter its full input, an all-reduce or a broadcast its
buffer.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerobench.instruments.link import KINDS
from zerobench.instruments.storages import tensors_in

__all__ = ["KINDS", "FUNCTIONS", "Collective", "Layer", "CommCounter", "intercepted", "intercepting",
           "ddp_comm_hook"]


@dataclass(frozen=True)
class Signature:
    """Where a ``torch.distributed`` function keeps what the layers need."""

    kind: str
    group_at: int
    """position of the ``group`` argument; ``async_op`` follows it (``async_op=False``: none)"""
    sized: tuple[int, str]
    """(position, keyword) of the tensor(s) whose bytes count (nccl-tests convention)"""
    output: tuple[int, str]
    """(position, keyword) of the tensor(s) the call writes"""
    async_op: bool = True
    """whether the function takes ``async_op`` (``_broadcast_coalesced`` does not)"""
    group_keyword: str = "group"


#: The functions intercepted, by their name in ``torch.distributed``.
FUNCTIONS: dict[str, Signature] = {
    "all_gather_single": Signature("all_gather", 2, (0, "output_tensor"), (0, "output_tensor")),
    "all_gather_into_tensor": Signature("all_gather", 2, (0, "output_tensor"), (0, "output_tensor")),
    "all_gather": Signature("all_gather", 2, (0, "tensor_list"), (0, "tensor_list")),
    "reduce_scatter_single": Signature("reduce_scatter", 3, (1, "input"), (0, "output")),
    "reduce_scatter_tensor": Signature("reduce_scatter", 3, (1, "input"), (0, "output")),
    "reduce_scatter": Signature("reduce_scatter", 3, (1, "input_list"), (0, "output")),
    "all_reduce": Signature("all_reduce", 2, (0, "tensor"), (0, "tensor")),
    "all_reduce_coalesced": Signature("all_reduce", 2, (0, "tensors"), (0, "tensors")),
    "broadcast": Signature("broadcast", 2, (0, "tensor"), (0, "tensor")),
    # DDP's parameter and buffer broadcast: (process_group, tensors, buffer_size, src), synchronous
    "_broadcast_coalesced": Signature("broadcast", 0, (1, "tensors"), (1, "tensors"), async_op=False,
                                      group_keyword="process_group"),
}


def _arg(args: tuple, kwargs: dict, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


@dataclass(frozen=True)
class Collective:
    """One call of a collective, as every layer sees it."""

    name: str
    """the ``torch.distributed`` function called"""
    kind: str
    """one of :data:`KINDS`"""
    nbytes: int
    """bytes by the nccl-tests convention"""
    group: Any
    """the process group (``None``: the default group)"""
    group_size: int
    async_op: bool
    """what the caller asked for (every layer gets an asynchronous issue)"""
    args: tuple
    kwargs: dict

    @classmethod
    def of(cls, name: str, args: tuple, kwargs: dict) -> "Collective":
        sig = FUNCTIONS[name]
        group = _arg(args, kwargs, sig.group_at, sig.group_keyword)
        async_op = sig.async_op and bool(_arg(args, kwargs, sig.group_at + 1, "async_op"))
        return cls(name, sig.kind, nbytes(_arg(args, kwargs, *sig.sized)), group, dist.get_world_size(group),
                   async_op, args, kwargs)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor argument (the first tells the device)."""
        return [t for a in (*self.args, *self.kwargs.values()) for t in tensors_in(a)]

    def outputs(self) -> list[torch.Tensor]:
        """The tensors the call writes (all-gather output, reduce-scatter output, the buffer)."""
        return list(tensors_in(_arg(self.args, self.kwargs, *FUNCTIONS[self.name].output)))

    def input(self) -> torch.Tensor | None:
        """A reduce-scatter's full input (None for other kinds)."""
        if self.kind != "reduce_scatter":
            return None
        found = list(tensors_in(_arg(self.args, self.kwargs, *FUNCTIONS[self.name].sized)))
        return found[0] if len(found) == 1 else None

    def future_value(self) -> list:
        """What a real ``Work``'s future resolves to: the list of output tensors."""
        return self.outputs()


class Layer:
    """A consumer of every collective call; see [Note: one interception].

    ``issue(call, issue)`` runs when a call is made: ``issue()`` issues it through the
    layers below (asynchronously) and returns their ``Work``; return that or a ``Work``
    of your own wrapping it (``wait``, ``is_completed``, ``get_future``)."""

    def issue(self, call: Collective, issue: Callable[[], Any]) -> Any:
        return issue()


class _Done:
    """The ``Work`` of a call that completed when it returned (``_broadcast_coalesced``)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


# -- the interception ----------------------------------------------------------------

_layers: list[Layer] = []  # outermost first
_originals: dict[str, Callable] = {}  # the torch.distributed functions replaced while a layer is installed
_inside = threading.local()  # set while a wrapped call runs: calls it makes go straight through


def intercepting() -> bool:
    """Whether any layer sees collectives now."""
    return bool(_layers)


def layers() -> list[Layer]:
    return list(_layers)


@contextlib.contextmanager
def intercepted(layer: Layer):
    """``with intercepted(layer):`` -- ``layer`` sees every collective of the block,
    inside the layers already installed."""
    push(layer)
    try:
        yield layer
    finally:
        pop(layer)


def push(layer: Layer) -> None:
    if not _layers:
        _install()
    _layers.append(layer)


def pop(layer: Layer) -> None:
    _layers.remove(layer)
    if not _layers:
        _uninstall()


def _install() -> None:
    for name in FUNCTIONS:
        fn = getattr(dist, name, None)
        if fn is not None:
            _originals[name] = fn
            setattr(dist, name, _wrap(name, fn))


def _uninstall() -> None:
    for name, fn in _originals.items():
        setattr(dist, name, fn)
    _originals.clear()


def _wrap(name: str, fn: Callable) -> Callable:
    sig = FUNCTIONS[name]

    @functools.wraps(fn)
    def collective(*args, **kwargs):
        if getattr(_inside, "active", False) or not _layers:
            return fn(*args, **kwargs)
        call = Collective.of(name, args, kwargs)

        def real():
            a, k = _as_async(args, kwargs, sig.group_at) if sig.async_op else (args, kwargs)
            _inside.active = True
            try:
                work = fn(*a, **k)
            finally:
                _inside.active = False
            return work if sig.async_op else _Done()

        issue = real
        for layer in reversed(_layers):
            issue = functools.partial(layer.issue, call, issue)
        work = issue()
        if call.async_op:
            return work
        work.wait()
        return None

    collective.__zerobench_intercepted__ = True
    return collective


def _as_async(args: tuple, kwargs: dict, group_at: int) -> tuple[tuple, dict]:
    """The call's arguments with ``async_op=True`` (positional right after the group, or keyword)."""
    if len(args) > group_at + 1:
        return (*args[:group_at + 1], True, *args[group_at + 2:]), kwargs
    return args, {**kwargs, "async_op": True}


# -- consumers every instrument shares -----------------------------------------------


class CommCounter(Layer):
    """Bytes and calls of each kind of collective since the last ``reset``."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def issue(self, call: Collective, issue):
        self.record(call.kind, call.nbytes)
        return issue()

    def columns(self) -> dict[str, int]:
        """``comm_<kind>_bytes`` and ``comm_<kind>_calls`` for every kind,
        ``comm_total_bytes`` and ``comm_calls`` (schema/columns.py)."""
        out = {f"comm_{kind}_bytes": self.bytes.get(kind, 0) for kind in KINDS}
        out["comm_total_bytes"] = sum(self.bytes.values())
        out["comm_calls"] = sum(self.calls.values())
        out.update({f"comm_{kind}_calls": self.calls.get(kind, 0) for kind in KINDS})
        return out


def ddp_comm_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP comm hook: average a bucket with ``torch.distributed.all_reduce``, so that the
    layers see it ([Note: one interception]).

    The same result as DDP's built-in all-reduce: the bucket is divided by the group's
    size, summed in place, and the future resolves to it."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda _fut: buffer)


# DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
ddp_comm_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
