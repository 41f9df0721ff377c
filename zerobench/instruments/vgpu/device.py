"""The virtual GPU: a CUDA device's streams, events, host clock and caching allocator,
modelled while the operators run on the CPU.

[Note: virtual device]
Tensors stay CPU tensors (real ones, or fake ones when only shapes matter): this CPU-only
build of torch cannot run autograd on tensors whose device says ``cuda``. What makes the
device virtual is the *device module*: :class:`VirtualGpu` offers the part of
``torch.cuda``'s API that training engines use (``Stream``, ``Event``,
``current_stream``, ``stream``, ``synchronize``, ``_sleep``, ``memory_stats`` ...), and
while it is installed

* impl's engines get it from ``impl.streams.accelerator(cpu)``, so they take the same
  code path they take on a real GPU with ``torch.cuda`` (three streams, events,
  ``record_stream``, the event-based rate limiter);
* ``torch.cpu``'s stream stubs (``Stream``, ``Event``, ``current_stream``, ``stream``,
  ``synchronize``), through which PyTorch's FSDP1 and fully_shard route every stream
  call on a CPU device, are replaced by the virtual ones;
* every storage's life (new, free, ``UntypedStorage.resize_``, ``Tensor.record_stream``)
  reaches the allocator model from the one follower of storages
  (zerobench/instruments/storages.py, [Note: storage lifetime]), of which the device is
  a listener;
* a ``TorchDispatchMode`` sees every operator: it charges the host its dispatch cost,
  enqueues a kernel of the modelled duration (zerobench/instruments/vgpu/costs.py) on the current
  stream, blocks the host where the host reads a value (``.item()``), and gives every
  new storage a block of the caching-allocator model (zerobench/instruments/vgpu/allocator.py);
* collectives called through ``torch.distributed`` still run (gloo, or the fake
  backend); the device is a layer of the one interception of collectives
  (zerobench/instruments/collectives.py) and times each on a communication stream of
  its process group by the link model (zerobench/instruments/link.py), as NCCL runs
  them: the communication stream first waits for the current stream, the returned
  work's ``wait()`` makes the current stream wait for the collective's end, and a
  synchronous call does that at once.

The timeline is computed as the host issues work: [Note: virtual timeline]. Every kernel
carries its class (kernel_classes.py): in the Chrome trace (``args["class"]`` of its event)
and in the device's per-class totals (``class_seconds``, ``class_kernels``,
``class_bytes``), so a prediction and a real GPU's trace can be put side by side class by
class.

[Note: cuBLAS workspaces]
torch gives each cuBLAS handle a workspace per stream it runs on, from the caching
allocator, at the first GEMM on that (handle, stream) pair, and keeps it for the life of
the process (aten/src/ATen/cuda/CublasHandlePool.cpp, ``setWorkspaceForHandle`` and
``cublas_handle_stream_to_workspace``). Handles are per thread, and autograd runs a CUDA
device's backward on a thread of its own: a training step on one stream holds two
workspaces, the forward thread's and the backward thread's. Their size is
``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs, summed) or, unset, 32 MiB on
sm90 (``:4096:8``) and 8 MiB + 128 KiB elsewhere (``:4096:2:16:8``). cuBLASLt shares them
since torch 2.11 (pytorch#168175 and #175879 made the unified workspace the default
outside fbcode). The H200 held exactly these: two 32 MiB blocks more than the virtual GPU
did before it modelled them (results/gpu/h200-20261126/README.md). Here a GEMM issued
inside autograd's backward (``torch._C._current_autograd_node()``) stands for the
backward thread's handle.

[Note: host memory]
A program written for a GPU makes host memory wherever it calls a factory without a
device (torch's default device is the CPU): Llama's rotary tables, computed each forward
from ``torch.arange(seq_len)``, are cos and sin on the host, then ``.to(device)``. On the
H200 that is 4-5 ms a step of the CPU computing while the device waits, the largest host
gap of the shared Llama run (results/gpu/h200-20261128/llama3-8b-l4-ws1-deepspeed, traces:
``aten::cos``, ``aten::sin`` on the CPU, then two pageable copies). Here the CPU is the
device, and a factory's output looks the same with or without one, so with
``host_factories`` (what ``zerobench predict`` runs) the virtual GPU wraps torch's
factories (:data:`HOST_FACTORIES`): called without a device, while the default device
is the CPU and outside a model's build or the harness's batch (``on_device``, where the
harness makes without a device what a real rank makes on its device), their outputs are
host memory, and so is what operators compute from host memory alone: the CPU runs
those, at its memory speed. ``Tensor.to`` naming a device copies host memory there,
which torch would skip here as the tensor is already on the CPU. A copy from pageable
host memory is CUDA's staged copy: the stream drains first, the host copies the bytes
into its staging buffer, and unless ``non_blocking`` torch synchronises after it; a
pinned buffer's copy is a plain DMA on the stream.

[Note: collective tensors]
A collective's tensors must not be reused while NCCL's stream still reads or writes
them. ProcessGroupNCCL has had two ways: ``record_stream`` of every input and output
onto its stream (the default until TORCH_NCCL_AVOID_RECORD_STREAMS=1 became it: torch
2.13's ProcessGroupNCCL warns that the variable is deprecated for that reason), so that
a freed tensor stays active until the stream has passed the free, everything queued on
it by then included; and *stashing* the tensors in the work until ``wait()`` orders the
caller's stream after the collective (the default now). ``VirtualGpu(record_streams=...)``
chooses (``zerobench predict --nccl-record-streams`` for the old way, which is what the
runs published in 2023-2024 had, and the pile-up FSDP1's limiter exists to bound).

[Note: build as users do]
Users of sharded engines do not build the whole model on the GPU: torchtitan builds it
on the meta device, applies ``fully_shard``, then ``to_empty(device="cuda")`` and
initialises the weights, so each rank only ever allocates its shards; FSDP1's
``param_init_fn`` materialises one unit at a time as it wraps. Building the unsharded
model in the device instead leaves its blocks cached and split for activations (for
Llama 2 7B, 227 segments, 26.1 GiB, in every reserved peak). So a model is built and
wrapped under ``deferred()``: the storages made meanwhile (parameters, the engine's
flat and sharded copies of them) get no device memory, and ``materialize()`` gives it
to the ones still alive when wrapping is done -- what the rank holds: the shards under
the FSDPs, the whole model under DDP and ZeRO-1/2, whose ranks keep it. The values are
unchanged: the tensors are built as before (on the CPU or as fake tensors); only the
allocator model sees the build as meta-device initialisation does.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from zerobench.instruments import collectives, storages
from zerobench.instruments.collectives import Collective, Layer
from zerobench.instruments.link import Link
from zerobench.instruments.storages import Listener, makes_no_storage, storages_of
from zerobench.instruments.vgpu import comm, costs, sdpa
from zerobench.instruments.vgpu.alloc_conf import AllocatorConfig
from zerobench.instruments.vgpu.allocator import CachingAllocator
from zerobench.instruments.vgpu.host import PYTHON_KINDS, HostPreset, PythonCalls, host_preset
from zerobench.instruments.vgpu.kernel_classes import KERNEL_CLASSES
from zerobench.instruments.vgpu.presets import GpuPreset, gpu_preset
from zerobench.instruments.vgpu.timeline import Host, Trace, VEvent, VStream

aten = torch.ops.aten
_active: list["VirtualGpu"] = []
#: The trace arguments of a kernel of each class, one shared dict per class (no
#: allocation per kernel).
CLASS_ARGS = {cls: {"class": cls} for cls in KERNEL_CLASSES}


def cublas_workspace_bytes(compute_capability: str, config: str | None = None) -> int:
    """The workspace torch gives one cuBLAS handle on one stream: [Note: cuBLAS workspaces]."""
    import re

    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 8 * 1024 if str(compute_capability) == "9.0" else 4096 * 1024 * 2 + 16 * 1024 * 8


def _dynamo_patched() -> None:
    """Puts torch in the state ``torch.compile`` leaves it in, once per process, before
    Python calls are counted: dynamo's ``TorchPatcher`` wraps every optimizer's
    ``_init_group`` (and ``jit.trace``, fused optimizer functions) in ``disable``, and turns
    off ``torch.distributions``' argument validation by default. A process that compiled
    something, or ran DeepSpeed, is in that state and one that did not is not; the wrappers
    are Python calls, so without this a step's count, and its predicted host time, would
    depend on what the process ran before. A fresh GPU host runs a few calls fewer per
    optimizer step (the wrappers), microseconds in a step of milliseconds."""
    from torch._dynamo.eval_frame import TorchPatcher

    TorchPatcher.patch()  # functools.cache: once


def current() -> "VirtualGpu | None":
    """The installed virtual GPU, if any."""
    return _active[-1] if _active else None


class VirtualGpu(Layer, Listener):
    """One virtual CUDA device. Use as a context manager: see [Note: virtual device].

    ``gpu``/``host``: preset names, files or presets (zerobench/instruments/vgpu/presets.py and
    host.py; a host that prices Python calls counts them: [Note: host cost]). ``link``: the
    interconnect collectives are timed on (default: none, collectives take only the
    kernel floor); ``inter_link``: the one of a process group whose ranks span more than
    one node of ``node_size`` ranks (default: ``link``). ``sdpa_backend``: the attention
    backend (``auto``: torch's choice, sdpa.py). ``clocks``: ``sustained`` (the preset's
    default) or ``burst`` ([Note: clocks under load] in costs.py). ``cublas_workspace_config``:
    ``CUBLAS_WORKSPACE_CONFIG`` as the run would have it (default: this process's
    environment). ``host_factories``: a factory called without a device makes host memory,
    as in a program written for a GPU (``zerobench predict``); off, the CPU is the device
    everywhere, as tests write their programs ([Note: host memory])."""

    def __init__(self, gpu: str | GpuPreset = "h100-sxm", host: str | HostPreset = "fast",
                 link: Link | None = None, trace: bool = True, rank: int = 0, malloc_synchronizes: bool = False,
                 inter_link: Link | None = None, node_size: int = 8, alloc_conf: AllocatorConfig | str | None = None,
                 record_streams: bool = False, sdpa_backend: str = "auto", clocks: str | None = None,
                 cublas_workspace_config: str | None = None, host_factories: bool = False):
        import os

        self.preset = gpu_preset(gpu)
        if clocks is not None:
            self.preset = self.preset.with_clocks(clocks)
        self.sdpa_backend = sdpa.check(sdpa_backend)
        # (dtype, head size) -> the SDPA backend that runs it (sdpa.py)
        self._attention_backends: dict = {}
        # [Note: cuBLAS workspaces]: one block per (backward thread?, stream), held for good.
        if cublas_workspace_config is None:
            cublas_workspace_config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        self.cublas_workspace_bytes = cublas_workspace_bytes(self.preset.compute_capability, cublas_workspace_config)
        self._cublas_workspaces: dict = {}
        # How ProcessGroupNCCL keeps a collective's tensors alive: see [Note: collective tensors].
        self.record_streams = record_streams
        if not isinstance(alloc_conf, AllocatorConfig):
            alloc_conf = AllocatorConfig.parse(alloc_conf)
        self.host_preset = host_preset(host)
        # What the host was charged for, by kind, and each kind's price ([Note: host cost]).
        self.host_counts: Counter = Counter()
        # Seconds the host spent computing on host memory: [Note: host memory].
        self.host_cpu_s = 0.0
        self._units = self.host_preset.units()
        # The Python calls the host thread makes, while installed (None: not counted).
        self.python: PythonCalls | None = PythonCalls() if self.host_preset.counts_python else None
        self.link = link
        self.inter_link = inter_link
        self.node_size = node_size
        # The longest the compute stream's queue ran ahead of the host (seconds).
        self.host_lead_max_s = 0.0
        self.rank = rank
        self.device = torch.device("cpu")  # where the tensors are; see the Note
        self.host = Host()
        self.trace = Trace(trace)
        # What the allocator may reserve: [Note: capacity a process sees] in allocator.py.
        self.allocator = CachingAllocator(self, self.preset.memory_bytes - self.preset.context_bytes,
                                          malloc_synchronizes, alloc_conf)
        self.default = VStream(self, "compute")
        self._current = self.default
        self.streams: list[VStream] = [self.default]
        self._comm_streams: dict = {}
        # storage id (storages.StorageEvents) -> its allocator block, for storages that
        # live on the device (None while resized to nothing)
        self._blocks: dict[int, object] = {}
        self._events: storages.StorageEvents | None = None
        # >0 while an operator runs inside the device's dispatch mode: its new storages get
        # their blocks once its kernel is enqueued (_Mode), wherever the follower sits
        self._in_op = 0
        # pinned host storages: never on the device
        self._host_storages = WeakIdKeyDictionary()  # storage -> PINNED or PAGEABLE
        self.host_factories = host_factories
        # Factories running without a device, now: their outputs are host memory ([Note: host memory]).
        self._making_host = 0
        # Inside on_device(): the harness makes tensors that the real run makes on its device.
        self._on_device = 0
        self._lock = threading.RLock()
        self._label: str | None = None  # see label()
        self._exit_stack: contextlib.ExitStack | None = None
        self.kernels = 0
        self.collectives = 0
        # Per kernel class: device seconds, kernels and bytes moved, since creation.
        self.class_seconds = dict.fromkeys(KERNEL_CLASSES, 0.0)
        self.class_kernels = dict.fromkeys(KERNEL_CLASSES, 0)
        self.class_bytes = dict.fromkeys(KERNEL_CLASSES, 0)
        # [Note: build as users do]: storages made while a model is built and wrapped,
        # not yet given device memory, and whether such a build is under way.
        self._deferred: dict[int, int] = {}  # storage id -> bytes, not yet on the device
        self._deferring = False
        self._fusing: "_FusedKernel | None" = None  # see fused() and [Note: fused on the GPU]
        # NCCL kernels that may still be running beside the next compute kernel:
        # [(start, end, bus bytes/s, share of SMs)]; see [Note: NCCL beside compute] in comm.py.
        self._collectives_running: list[tuple[float, float, float, float]] = []

    # -- the torch.cuda API ----------------------------------------------------------

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device) -> None:
        pass

    def get_device_name(self, device=None) -> str:
        return f"virtual {self.preset.name}"

    def Stream(self, device=None, priority: int = 0, **kwargs) -> VStream:  # noqa: N802 - torch.cuda's name
        self.charge("api_call")
        stream = VStream(self, f"stream{len(self.streams)}", priority)
        self.streams.append(stream)
        return stream

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,  # noqa: N802
              **kwargs) -> VEvent:
        self.charge("api_call")
        return VEvent(self, enable_timing, blocking, interprocess)

    def current_stream(self, device=None) -> VStream:
        self.charge("api_call")
        return self._current

    def default_stream(self, device=None) -> VStream:
        self.charge("api_call")
        return self.default

    def set_stream(self, stream: VStream) -> None:
        self._current = stream

    @contextlib.contextmanager
    def stream(self, stream: VStream | None):
        if stream is None:
            yield
            return
        self.charge("stream_switch")  # entering and leaving, as measured together
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def synchronize(self, device=None) -> None:
        self.charge("api_call")
        waited_from = self.host.now
        self.host.block_until(max(s.tail for s in self.streams))
        if self.host.now > waited_from:
            self.trace.span("host", "synchronize", waited_from, self.host.now)

    def _sleep(self, cycles: int) -> None:
        self.charge("op")
        self.charge("kernel")
        self.run_kernel(int(cycles) / self.preset.sleep_cycles_per_s, "_sleep", "other", 0)

    def memory_stats(self, device=None) -> dict:
        return self.allocator.memory_stats()

    def reset_peak_memory_stats(self, device=None) -> None:
        self.allocator.reset_peak()
        self.host_lead_max_s = 0.0

    def memory_allocated(self, device=None) -> int:
        return self.allocator.stats["allocated"]

    def max_memory_allocated(self, device=None) -> int:
        return self.allocator.stats["allocated_peak"]

    def memory_reserved(self, device=None) -> int:
        return self.allocator.stats["reserved"]

    def max_memory_reserved(self, device=None) -> int:
        return self.allocator.stats["reserved_peak"]

    def empty_cache(self) -> None:
        self.synchronize()  # cudaFree waits for the device
        self.allocator.process_events()
        self.allocator.release_cached()

    # -- the model -------------------------------------------------------------------

    def host_clock(self) -> float:
        """The host's virtual time in seconds (impl's rate limiter measures stalls with it)."""
        return self.host.now

    def charge(self, kind: str, n: int = 1) -> None:
        """The host pays for ``n`` items of ``kind`` (host.py's KINDS): [Note: host cost]."""
        self.host_counts[kind] += n
        self.host.advance(n * self._units[kind])

    def host_work(self, seconds: float) -> None:
        """The host computes on host memory for ``seconds`` ([Note: host memory])."""
        self.host_cpu_s += seconds
        self.host.advance(seconds)

    def _python_charged(self, deltas: list, start: float, end: float) -> None:
        """The host clock has charged ``deltas`` (Python work by kind, host.py's
        PYTHON_KINDS), from ``start`` to ``end``."""
        for kind, n in zip(PYTHON_KINDS, deltas):
            self.host_counts[kind] += n
        self.trace.span("host", "python", start, end, dict(zip(PYTHON_KINDS, deltas)))

    @contextlib.contextmanager
    def label(self, name: str):
        """Blocks allocated inside are counted under ``name`` in the allocator's
        ``active_by_label`` and ``peak_active_by_label`` (what piles up, by role)."""
        previous, self._label = self._label, name
        try:
            yield
        finally:
            self._label = previous

    def nodes_of(self, group) -> int:
        """How many nodes of ``node_size`` ranks the group's ranks span."""
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        return len({r // self.node_size for r in ranks})

    def link_of(self, group) -> Link | None:
        """``inter_link`` for a group whose ranks span nodes of ``node_size``, else ``link``."""
        if self.inter_link is None:
            return self.link
        return self.link if self.nodes_of(group) <= 1 else self.inter_link

    @contextlib.contextmanager
    def fused(self, name: str):
        """Operators run inside are the GPU's fused kernels ([Note: fused on the GPU] in
        fused.py): no host cost or kernel each; on leaving, the launches the caller counted
        and memory-bound kernels of the bytes it says they read and wrote."""
        kernel = _FusedKernel()
        previous, self._fusing = self._fusing, kernel
        try:
            yield kernel
        finally:
            self._fusing = previous
        for nbytes in kernel.launches:
            for kind in ("op", "kernel", "alloc"):  # one operator, its kernel and its output
                self.charge(kind)
            memory_s = nbytes / self.preset.bandwidth("elementwise")
            self.run_kernel(self.beside_collectives(self._current, 0.0, memory_s, self.preset.kernel_floor_s), name,
                            "elementwise", nbytes)

    def run_kernel(self, seconds: float, name: str, kind: str, nbytes: int, stream: VStream | None = None):
        """Enqueue one kernel of class ``kind`` on ``stream`` (the current one), counted in
        the per-class totals; returns its (start, end)."""
        stream = stream if stream is not None else self._current
        span = stream.enqueue(seconds, name, CLASS_ARGS[kind])
        self.class_seconds[kind] += seconds
        self.class_kernels[kind] += 1
        self.class_bytes[kind] += nbytes
        if kind != "collective":
            self.kernels += 1
        return span

    def attention_backend(self, dtype: torch.dtype, head_dim: int) -> str:
        """The SDPA backend that runs attention of this dtype and head size ([Note: SDPA backend choice])."""
        key = (dtype, head_dim)
        backend = self._attention_backends.get(key)
        if backend is None:
            backend = sdpa.choose(dtype, head_dim, self.preset.sm_major, requested=self.sdpa_backend)
            self._attention_backends[key] = backend
        return backend

    def cublas_workspace(self) -> None:
        """The workspace of the handle a GEMM issued now takes: [Note: cuBLAS workspaces]."""
        key = (torch._C._current_autograd_node() is not None, self._current.id)
        if key not in self._cublas_workspaces:
            self._cublas_workspaces[key] = self.allocator.malloc(self.cublas_workspace_bytes, self._current,
                                                                 "cublas_workspace")
            self._count()

    def record_collective(self, start: float, end: float, bus_bytes_per_s: float) -> None:
        """An NCCL kernel runs on the device in [start, end]: compute kernels beside it run slower."""
        now = self.host.now  # a kernel issued from now on starts at or after now
        self._collectives_running = [c for c in self._collectives_running if c[1] > now]
        if end > start:
            self._collectives_running.append((start, end, bus_bytes_per_s))

    def beside_collectives(self, stream: VStream, compute_s: float, memory_s: float, floor_s: float,
                           attention: bool = False) -> float:
        """How long a kernel issued now on ``stream`` runs, given the NCCL kernels running
        beside it (piecewise: slowed while one runs, at its own speed otherwise). A kernel
        on a high-priority stream is not slowed. See [Note: NCCL beside compute]."""
        body = max(compute_s, memory_s)
        alone = body + floor_s
        running = self._collectives_running
        if not running or stream.priority < 0 or body <= 0:
            return alone
        kind = "attention" if attention else "compute" if compute_s >= memory_s else "memory"
        t = max(stream.tail, self.host.now)
        start, left = t, 1.0  # the fraction of the kernel still to run
        while left > 0:
            active = [c for c in running if c[0] <= t < c[1]]
            upcoming = [c[0] for c in running if c[0] > t] + [c[1] for c in active]
            if active:
                speed = 1.0 / (body * comm.contention(kind, sum(c[2] for c in active)) + floor_s)
            else:
                speed = 1.0 / alone
            until = min(upcoming, default=math.inf)
            if t + left / speed <= until:
                return t + left / speed - start
            left -= (until - t) * speed
            t = until
        return t - start

    def relabel(self, storage, label: str) -> None:
        sid = self._events.sid_of(storage) if self._events is not None else None
        block = self._blocks.get(sid) if sid is not None else None
        if block is not None:
            self.allocator.relabel(block, label)

    def comm_stream(self, group) -> VStream:
        key = group if group is not None else "WORLD"
        stream = self._comm_streams.get(key)
        if stream is None:
            stream = VStream(self, f"comm{len(self._comm_streams)}")
            self.streams.append(stream)
            self._comm_streams[key] = stream
            if dist.get_world_size(group) > 1:  # NCCL sets up this group's communicator and its buffers
                self.allocator.hold_outside(self.preset.nccl_bytes_per_group)
        return stream

    @contextlib.contextmanager
    def deferred(self):
        """Build and wrap a model as users do on a GPU: see [Note: build as users do]."""
        self._deferring = True
        try:
            with self.python_uncounted():  # the build is not the step
                yield
        finally:
            self._deferring = False

    @contextlib.contextmanager
    def on_device(self):
        """Tensors made inside without a device are device memory: where the harness makes
        on fake tensors what a real run makes on its device (a batch), or builds a model
        (``deferred``). Elsewhere such a factory makes host memory: [Note: host memory]."""
        self._on_device += 1
        try:
            yield
        finally:
            self._on_device -= 1

    @contextlib.contextmanager
    def python_uncounted(self):
        """Python calls made inside cost the host nothing: a prediction's build and warm-up
        steps, whose first-call code (caches filled, modules imported on first use)
        depends on what ran before in the process ([Note: host cost])."""
        if self.python is None:
            yield
            return
        self.host.now  # noqa: B018 - reading the clock charges the calls made before
        self.python.pause()
        try:
            yield
        finally:
            self.python.resume()

    def materialize(self) -> int:
        """Give every storage made under ``deferred()`` that is still alive its device
        memory now (what ``to_empty`` / ``param_init_fn`` allocate); returns its bytes."""
        with self._lock:
            waiting, self._deferred = self._deferred, {}
            for sid, nbytes in waiting.items():
                self._blocks[sid] = self.allocator.malloc(nbytes, self._current, self._label) if nbytes else None
            self._count()
        return sum(waiting.values())

    # -- storage events ([Note: storage lifetime]) -----------------------------------

    replaces_record_stream = True  # a CPU tensor's own record_stream cannot take a virtual stream

    def wants(self, storage) -> bool:
        """Device memory: CPU tensors' storages (meta ones under fake tensors), not pinned
        host buffers, and not before the operator making it has enqueued its kernel."""
        return (self._in_op == 0 and storage.device.type in ("cpu", "meta")
                and storage not in self._host_storages)

    def track(self, storage) -> None:
        """Give ``storage`` a block on the current stream unless it has one."""
        if self._events is not None:
            self._events.see(storage)

    def on_new(self, sid: int, storage, nbytes: int) -> None:
        with self._lock:
            if self._deferring:  # [Note: build as users do]: no device memory yet
                self._deferred[sid] = nbytes
                return
            self._blocks[sid] = self.allocator.malloc(nbytes, self._current, self._label) if nbytes else None
            self._count()
            self._count()

    def on_free(self, sid: int) -> None:
        with self._lock:
            if self._deferred.pop(sid, None) is not None:
                return  # never had device memory
            block = self._blocks.pop(sid, None)
            if block is not None:
                self.allocator.free(block)
            self._count()

    def on_resize(self, sid: int, storage, old_nbytes: int, new_nbytes: int) -> None:
        """The old block is freed, a new one allocated (unless it shrank in place)."""
        with self._lock:
            if sid in self._deferred:
                self._deferred[sid] = new_nbytes  # its size when it is materialized counts
                return
            block = self._blocks.get(sid)
            if block is not None and block.size >= new_nbytes and new_nbytes:
                return  # unchanged or shrunk in place: the block stays
            if block is not None:
                self.allocator.free(block)
            self._blocks[sid] = self.allocator.malloc(new_nbytes, self._current, self._label) if new_nbytes else None
            self._count()

    def on_record_stream(self, sid: int | None, tensor: torch.Tensor, stream: VStream) -> None:
        self.charge("record_stream")
        block = self._blocks.get(sid) if sid is not None else None
        if block is not None:
            self.allocator.record_stream(block, stream)

    def _count(self) -> None:
        s = self.allocator.stats
        self.trace.counter(self.host.now, {"allocated": s["allocated"], "active": s["active"],
                                           "reserved": s["reserved"]})

    def record_storage_use(self, tensor: torch.Tensor, stream: VStream) -> None:
        """The allocator's side of ``record_stream`` (no host time: C++ does it inside a call)."""
        for storage in storages_of(tensor):
            sid = self._events.sid_of(storage) if self._events is not None else None
            block = self._blocks.get(sid) if sid is not None else None
            if block is not None:
                self.allocator.record_stream(block, stream)

    # -- installing ------------------------------------------------------------------

    def __enter__(self) -> "VirtualGpu":
        import impl.streams

        stack = contextlib.ExitStack()
        stack.enter_context(impl.streams.use_accelerator("cpu", self))
        patches = {
            (torch.cpu, "Stream"): self.Stream, (torch.cpu, "Event"): self.Event,
            (torch.cpu, "current_stream"): self.current_stream, (torch.cpu, "stream"): self.stream,
            (torch.cpu, "synchronize"): self.synchronize,
        }
        # PyTorch's FSDP1 skips record_stream on a device type other than cuda, mtia, xpu
        # or privateuse1: the only CPU-only branch of its stream code. On the virtual GPU
        # the hand-over is what sets its memory profile, so it is made, through
        # Tensor.record_stream (which a memory tracker may follow too).
        import torch.distributed.fsdp._flat_param as flat_param_module
        import torch.distributed.fsdp._runtime_utils as runtime_utils_module

        for module in (flat_param_module, runtime_utils_module):
            patches[(module, "_no_dispatch_record_stream")] = lambda t, s: t.record_stream(s)
        # torch.optim takes its foreach path (a few multi-tensor kernels per step) only for
        # parameters on a device type it lists; on "cpu" it loops over the parameters one at
        # a time, ten-odd kernels each. A GPU takes the foreach path, so the virtual GPU
        # lists "cpu" too. The foreach and single-tensor updates compute the same values.
        import torch.optim.optimizer as optimizer_module

        supported = optimizer_module._get_foreach_kernels_supported_devices
        patches[(optimizer_module, "_get_foreach_kernels_supported_devices")] = lambda: [*supported(), "cpu"]
        # It also takes it only for the tensor types it lists, and a parameter made under
        # fake tensors (as predict runs) is a FakeTensor, not an nn.Parameter: every engine
        # but fully_shard's (DTensors, which torch lists) stepped one parameter at a time,
        # with the temporaries of the largest parameter at the optimizer's peak instead of
        # the foreach path's. So the virtual GPU lists FakeTensor too.
        import torch.utils._foreach_utils as foreach_utils_module
        from torch._subclasses.fake_tensor import FakeTensor

        for listed in (optimizer_module._foreach_supported_types, foreach_utils_module._foreach_supported_types):
            stack.enter_context(_listed(listed, FakeTensor))
        # Operators a GPU fuses into one kernel: [Note: fused on the GPU] in fused.py.
        from zerobench.instruments.vgpu import fused

        patches[(torch.nn.functional, "rms_norm")] = fused.rms_norm(self)
        if self.host_factories:  # a factory called without a device makes host memory: [Note: host memory]
            # torch's device context (``with torch.device(...)``) knows its factories by a set it
            # caches on first use: made while they are wrapped, it would hold the wrappers and
            # give the factories no device (a build on "meta" made real tensors). Made now.
            from torch.utils._device import _device_constructors

            _device_constructors()
            for name in HOST_FACTORIES:
                patches[(torch, name)] = _host_factory(self, getattr(torch, name))
            patches[(torch.Tensor, "to")] = _to_device(self, torch.Tensor.to)
        for (owner, name), value in patches.items():
            stack.enter_context(_patched(owner, name, value))
        stack.enter_context(collectives.intercepted(self))  # collectives: issue() below
        stack.enter_context(_Mode(self))
        self._events = storages.listen(self)  # after the mode: see [Note: storage lifetime]
        stack.callback(storages.unlisten, self)
        _active.append(self)
        stack.callback(_active.pop)
        if self.python is not None:  # last: installing is not the program ([Note: host cost])
            _dynamo_patched()
            self.host.watch_python(self.python.counts, self.host_preset.python_prices(), self._python_charged)
            self._events.python = self.python
            self.python.install()
            stack.callback(self.host.watch_python, None)
            stack.callback(setattr, self._events, "python", None)
            stack.callback(self.python.uninstall)
        self._exit_stack = stack
        return self

    def __exit__(self, *exc) -> None:
        stack, self._exit_stack = self._exit_stack, None
        stack.close()

    def issue(self, call: Collective, issue):
        """A collective on the communication stream of its group, as NCCL runs it: the
        stream first waits for the issuing stream; the returned work's ``wait()`` makes the
        current stream wait for the collective's end ([Note: one interception])."""
        work = issue()  # the real (or fake) collective: data stays right
        self.charge("collective")
        stream = self.comm_stream(call.group)
        stream.tail = max(stream.tail, self._current.tail)  # NCCL: waits for the issuing stream
        seconds = self.preset.kernel_floor_s
        link = self.link_of(call.group)
        if link is not None and call.group_size > 1:
            # NCCL's achieved bus bandwidth for this size ([Note: achieved bus bandwidth])
            nodes = self.nodes_of(call.group) if link is not self.link else 1
            seconds = max(comm.collective_seconds(call.kind, call.nbytes, call.group_size, link, nodes, self.link),
                          seconds)
        # [Note: collective tensors]: recorded on the communication stream, or stashed in
        # the work until it is waited on.
        if self.record_streams:
            for tensor in call.tensors():
                self.record_storage_use(tensor, stream)
        # Count what the outputs hold by role: gathered parameters, reduced gradients.
        role = {"all_gather": "unsharded", "reduce_scatter": "reduced"}.get(call.kind)
        if role is not None:
            for storage in storages_of(call.outputs()):
                self.relabel(storage, role)
        start, end = self.run_kernel(seconds, f"{call.kind} {call.nbytes / 2**20:.2f} MiB", "collective", call.nbytes,
                                     stream)
        if link is not None and call.group_size > 1:  # it slows the compute beside it
            self.record_collective(start, end, comm.bus_bytes_per_s(call.kind, call.nbytes, call.group_size, seconds))
        self.collectives += 1
        done = VEvent(self)
        done.time, done.stream = end, stream
        return VirtualWork(self, work, done, stash=None if self.record_streams else call.tensors(),
                           waited_by_caller=call.async_op)


class VirtualWork:
    """A collective in flight on the virtual GPU (NCCL's ``Work`` semantics)."""

    def __init__(self, gpu: VirtualGpu, work, done: VEvent, stash: list | None = None,
                 waited_by_caller: bool = True):
        self._gpu = gpu
        self._work = work
        self.done = done
        # The collective's tensors, kept alive until wait(): [Note: collective tensors].
        self._stash = stash
        # An asynchronous call's wait() is the caller's, and costs the host; a synchronous
        # call's is inside the call, whose measured price has it ([Note: host cost]).
        self._waited_by_caller = waited_by_caller

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            self._work.wait()  # the real data movement (gloo) or nothing (fake)
            self._work = None
        if self._waited_by_caller:
            self._gpu.charge("collective_wait")
        stream = self._gpu._current
        stream.tail = max(stream.tail, self.done.time)  # NCCL: the current stream waits for the collective
        self._stash = None  # the current stream is now ordered after the collective
        return True

    def is_completed(self) -> bool:
        return self.done.query()

    def get_future(self):
        fut = torch.futures.Future()
        self.wait()
        fut.set_result(None)
        return fut


@contextlib.contextmanager
def _listed(items: list, item):
    """``item`` in the list ``items`` (in place: others hold the same list) while inside."""
    added = item not in items
    if added:
        items.append(item)
    try:
        yield
    finally:
        if added:
            items.remove(item)


@contextlib.contextmanager
def _patched(owner, name: str, value):
    missing = object()
    original = owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(owner, name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if original is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


#: torch's factories that take a ``device`` ([Note: host memory]).
HOST_FACTORIES = ("arange", "empty", "empty_strided", "eye", "full", "linspace", "logspace", "ones", "rand",
                  "randint", "randn", "randperm", "zeros")
#: What ``VirtualGpu._host_storages`` holds for a host storage: pinned or pageable memory.
PINNED, PAGEABLE = "pinned", "pageable"


def _host_factory(gpu: VirtualGpu, factory):
    """``factory`` making host memory when called without a device while torch's default
    device is the CPU ([Note: host memory])."""
    @functools.wraps(factory)
    def made(*args, **kwargs):
        if (kwargs.get("device") is not None or gpu._deferring or gpu._on_device > 0
                or torch.get_default_device().type != "cpu"):
            return factory(*args, **kwargs)
        gpu._making_host += 1
        try:
            return factory(*args, **kwargs)
        finally:
            gpu._making_host -= 1

    return made


def _names_a_device(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names a device (or a tensor whose device it takes)."""
    if kwargs.get("device") is not None:
        return True
    return bool(args) and isinstance(args[0], (torch.device, str, int, torch.Tensor)) and not isinstance(args[0], bool)


def _to_device(gpu: VirtualGpu, to):
    """``Tensor.to`` that copies host memory to the device when it names one: here the
    device is the CPU, and torch returns the tensor itself ([Note: host memory])."""
    @functools.wraps(to)
    def moved(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if out is self and _names_a_device(args, kwargs) and any(s in gpu._host_storages for s in storages_of(self)):
            non_blocking = kwargs.get("non_blocking", any(a is True for a in args[1:]))
            out = aten._to_copy.default(self, device=self.device, non_blocking=non_blocking)
        return out

    return moved


class _FusedKernel:
    """The bytes each kernel of a fused operator reads and writes (VirtualGpu.fused)."""

    def __init__(self):
        self.launches = [0]  # bytes of each kernel, in launch order

    def launch(self) -> None:
        """The next bytes are another kernel's."""
        self.launches.append(0)

    def reads(self, *tensors, times: int = 1) -> None:
        """``tensors`` read ``times`` times each ([Note: passes over memory] in costs.py)."""
        self.launches[-1] += times * sum(costs.accessed_bytes(t) for t in tensors if t is not None)

    def writes(self, *tensors) -> None:
        self.launches[-1] += sum(costs.accessed_bytes(t) for t in tensors if t is not None)


class _Mode(TorchDispatchMode):
    """Every operator: host cost, a kernel on the current stream, new storages tracked."""

    def __init__(self, gpu: VirtualGpu):
        super().__init__()
        self.gpu = gpu

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No ``torch._disable_dynamo`` wrapper around ``__torch_dispatch__``: nothing is
        compiled here, and the wrapper's Python is no program's ([Note: host cost])."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        python = self.gpu.python
        if python is None:
            return self._dispatch(func, args, kwargs or {})
        python.ops[0] += 1  # a call into torch that led here dispatched an operator
        python.pause()  # the virtual GPU's own work (and fake tensors') is not the host's: [Note: host cost]
        try:
            return self._dispatch(func, args, kwargs or {})
        finally:
            python.resume()

    def _dispatch(self, func, args, kwargs):
        gpu = self.gpu
        if gpu._deferring and makes_no_storage(func):  # [Note: views while building]
            return func(*args, **kwargs)
        if gpu._fusing is not None:  # part of one fused kernel: its memory is followed, not its time
            for storage in storages_of((args, kwargs)):
                gpu.track(storage)
            gpu._in_op += 1
            try:
                out = func(*args, **kwargs)
            finally:
                gpu._in_op -= 1
            for storage in storages_of(out):
                gpu.track(storage)
            return out
        pinned = bool(kwargs.get("pin_memory"))
        if pinned:  # a host buffer: this CPU-only build cannot pin, and it is not device memory
            kwargs = {**kwargs, "pin_memory": False}
        inputs = list(storages_of((args, kwargs)))
        if func is aten.lift_fresh.default:
            for storage in inputs:
                gpu._host_storages[storage] = PAGEABLE
        # An operator on host memory alone (a pinned buffer and what is computed from it, as
        # CPU offload's optimizer step; ``torch.tensor(data)``, an optimizer's step counters)
        # runs on the CPU: its outputs are host memory, and it costs the host its bytes at
        # host memory speed instead of a kernel. A copy to a device it names does not:
        # [Note: host memory].
        to_device = func is aten._to_copy.default and kwargs.get("device") is not None
        on_host = pinned or gpu._making_host > 0 or (
            not to_device and bool(inputs) and all(s in gpu._host_storages for s in inputs))
        kernel = costs.launches_kernel(func)
        launch = kernel and not on_host
        start = gpu.host.now
        if costs.charges_host(func):
            gpu.charge("op")
        if launch:
            gpu.charge("kernel")
            if costs.is_gemm(func):
                gpu.charge("gemm")
            elif costs.is_foreach(func):
                gpu.charge("foreach_tensor", sum(1 for a in tree_leaves(args) if isinstance(a, torch.Tensor)))
        for storage in inputs:  # tensors made before the device was installed
            gpu.track(storage)
        if func in costs.SYNCHRONIZING and not on_host:
            gpu.host.block_until(gpu._current.tail)
        gpu._in_op += 1
        try:
            out = func(*args, **kwargs)
        finally:
            gpu._in_op -= 1
        if on_host:
            for storage in storages_of(out):
                gpu._host_storages[storage] = PINNED if pinned else PAGEABLE
            if kernel:  # the CPU runs it
                gpu.host_work(costs.host_duration(args, kwargs, out, gpu.host_preset))
        if launch:
            outputs = list(storages_of(out))
            if outputs and gpu._events is not None:  # the caching allocator hands out each new one
                new = sum(1 for storage in outputs if gpu._events.sid_of(storage) is None)
                if new:
                    gpu.charge("alloc", new)
            host_side = (func in (aten.copy_.default, aten._to_copy.default)
                         and len(args) > (func is aten.copy_.default)
                         and any(s in gpu._host_storages for s in storages_of((args, out))))
            pageable = False
            if host_side:  # across PCIe
                source = args[1] if func is aten.copy_.default else args[0]
                nbytes = costs.tensor_bytes(source)  # the destination has the source's shape
                seconds, kind = costs.pcie_duration(costs.accessed_bytes(source), nbytes, gpu.preset), "copy"
                pageable = any(gpu._host_storages.get(s) == PAGEABLE for s in storages_of((args, out)))
                if pageable:  # CUDA's staged copy: the stream drained first, then a host memcpy
                    gpu.host.block_until(gpu._current.tail)
                    gpu.host_work(nbytes / gpu.host_preset.bytes_per_s)
            else:
                backend = None
                if func in costs.ATTENTION:
                    backend = gpu.attention_backend(*costs.attention_shape(func, args))
                cost = costs.kernel_cost(func, args, kwargs, out, gpu.preset, backend)
                if func in costs.CUBLAS:
                    gpu.cublas_workspace()
                seconds = gpu.beside_collectives(gpu._current, cost.compute_s, cost.memory_s, cost.floor_s,
                                                 attention=cost.kind == "attention")
                kind, nbytes = cost.kind, cost.nbytes
            gpu.run_kernel(seconds, func.__name__, kind, nbytes)
            if pageable and not kwargs.get("non_blocking", False):  # torch synchronises the stream after it
                gpu.host.block_until(gpu._current.tail)
            lead = gpu.default.tail - gpu.host.now
            if lead > gpu.host_lead_max_s:
                gpu.host_lead_max_s = lead
        for storage in storages_of(out):
            gpu.track(storage)
        gpu.trace.span("host", func.__name__, start, gpu.host.now)
        return out
