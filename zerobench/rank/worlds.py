"""The worlds a rank runs in: real ranks under torchrun, or one rank of a fake process
group in this process.

[Note: two worlds]
A :class:`World` is a rank's process group, its device, and the module that answers for
that device's streams, events and memory (``torch.cuda`` on a GPU, the virtual GPU,
or none on a CPU). The rank session (zerobench/rank/session.py) runs the same cell in
either:

* :class:`TorchrunWorld`: this process is one rank of a real world, started by
  ``zerobench run`` or by torchrun (the environment of zerobench/rank/protocol.py);
  gloo on CPU, NCCL with one GPU per local rank. Collectives move real data.
* :class:`JoinedWorld`: a rank of a process group something else initialised (tests).
* :class:`FakeWorld`: this process is rank ``rank`` of a world of any size whose other
  ranks do not exist: a process group of backend "fake"
  (``torch.testing._internal.distributed.fake_pg``), whose collectives return at once
  with garbage contents. Memory and the program's order are right, numerics are not.
  Optionally the tensors are fake too (:func:`fake_tensor_mode`: shapes only, any model
  size), the device is the virtual GPU (zerobench/instruments/vgpu), and the backend's
  own buffers are modelled (``GlooReduceScatterBuffers``, zerobench/instruments/gloo.py).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

from zerobench.engines.base import RankContext
from zerobench.instruments import collectives, storages
from zerobench.instruments.gloo import GlooReduceScatterBuffers
from zerobench.rank import devices
from zerobench.rank.protocol import torchrun_env


class World:
    """A rank's process group and device; see [Note: two worlds]. Use as a context manager."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str
    module = None
    """the device module (``torch.cuda``, a virtual GPU), or None on a CPU"""
    fake_tensors = False
    """whether tensors are FakeTensors (shapes only)"""

    def context(self) -> RankContext:
        return RankContext(self.rank, self.size, self.local_rank, self.device, self.backend)

    def barrier(self) -> None:
        dist.barrier()

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank: a MIN all-reduce that no instrument sees
        (torch.distributed.distributed_c10d's function, not the intercepted one)."""
        from torch.distributed import distributed_c10d

        agreed = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        distributed_c10d.all_reduce(agreed, op=dist.ReduceOp.MIN)
        return bool(agreed.item())

    def gather_object(self, obj) -> list | None:
        """Every rank's ``obj``, on rank 0 (None on the others)."""
        gathered = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered

    def synchronize(self) -> None:
        """Wait for the device (a no-op on a CPU)."""
        if self.module is not None:
            self.module.synchronize()

    def clock(self) -> float:
        """Seconds on the host: the wall clock, or the virtual GPU's host clock."""
        return time.perf_counter()

    def reset_peak_memory_stats(self) -> None:
        if self.module is not None:
            self.module.reset_peak_memory_stats()

    def memory_stats(self) -> dict:
        return self.module.memory_stats(self.device) if self.module is not None else {}

    def building(self):
        """Around building and wrapping the model: on a virtual GPU, the build as users do
        it ([Note: build as users do] in zerobench/instruments/vgpu/device.py); elsewhere
        the tensors are made where they are (the harness builds real ones on its device)."""
        return contextlib.nullcontext()

    def materialize(self) -> None:
        """After :meth:`building`: what the rank holds gets its device memory."""

    def on_device(self):
        """Around the harness making, without a device, what a real run makes on its
        device (a fake batch): on a virtual GPU, device memory ([Note: host memory] in
        zerobench/instruments/vgpu/device.py); elsewhere nothing."""
        return contextlib.nullcontext()

    def __enter__(self) -> "World":
        raise NotImplementedError

    def __exit__(self, *exc) -> None:
        raise NotImplementedError


class TorchrunWorld(World):
    """This process as one rank of a real world (the torchrun environment)."""

    def __init__(self, requested_device: str = "auto", threads: int = 1):
        env = torchrun_env()
        self.rank, self.size, self.local_rank = env.rank, env.world_size, env.local_rank
        choice = devices.choose(requested_device, env.local_rank, env.local_world_size,
                                gpus_per_task=env.gpus_per_task)
        self.device, self.backend = choice.device, choice.backend
        self.exports = env.exports  # what init_process_group reads that srun did not set: [Note: ranks started by Slurm]
        self.threads = threads
        self.module = torch.cuda if self.device.type == "cuda" else None

    def synchronize(self) -> None:
        if self.module is not None:
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> "TorchrunWorld":
        os.environ.update(self.exports)
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)
        else:
            torch.cuda.set_device(self.device)
        dist.init_process_group(self.backend, device_id=self.device if self.backend == "nccl" else None)
        return self

    def __exit__(self, *exc) -> None:
        _destroy_process_group()


class JoinedWorld(World):
    """This process as one rank of a process group that is already initialised (by the
    tests' ``run_ranks``, a script, a notebook): it is neither started nor ended here."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.local_rank = self.rank
        self.device = torch.device(device)
        self.backend = dist.get_backend()
        self.module = torch.cuda if self.device.type == "cuda" else None

    def __enter__(self) -> "JoinedWorld":
        return self

    def __exit__(self, *exc) -> None:
        pass


#: Backends whose own buffers a fake world can model (``FakeWorld(buffers_of=...)``).
BACKENDS = ("nccl", "gloo")


class FakeWorld(World):
    """Rank ``rank`` of a world of ``size`` ranks that do not exist; see [Note: two worlds].

    ``fake_tensors``: build and run on FakeTensors. ``gpu``: a virtual GPU to run on
    (a :class:`zerobench.instruments.vgpu.VirtualGpu`, installed while the world is).
    ``buffers_of``: the real backend whose own buffers to model besides the engine's
    tensors: ``nccl`` (the default) none, as the fake group allocates nothing; ``gloo``
    also the buffer gloo's reduce-scatter holds (``GlooReduceScatterBuffers``,
    zerobench/instruments/gloo.py). The world's own :attr:`backend` is the process
    group's: "fake"."""

    backend = "fake"

    def __init__(self, size: int, rank: int = 0, *, fake_tensors: bool = False, gpu=None, buffers_of: str = "nccl"):
        if buffers_of not in BACKENDS:
            raise ValueError(f"buffers_of: {buffers_of!r} is not allowed (allowed: {', '.join(BACKENDS)})")
        self.size, self.rank, self.local_rank = size, rank, rank
        self.device = torch.device("cpu")  # the virtual GPU's tensors are CPU tensors too
        self.fake_tensors = fake_tensors
        self.gpu = gpu
        self.module = gpu
        self.buffers_of = buffers_of  # whose buffers GlooReduceScatterBuffers and the like model
        self._stack: contextlib.ExitStack | None = None

    def clock(self) -> float:
        return self.gpu.host.now if self.gpu is not None else time.perf_counter()

    @contextlib.contextmanager
    def building(self):
        """The virtual GPU's build as users do, if any; view operators followed by no
        instrument meanwhile ([Note: views while building] in instruments/storages.py)."""
        with storages.views_unobserved(), (self.gpu.deferred() if self.gpu is not None else contextlib.nullcontext()):
            yield

    def materialize(self) -> None:
        if self.gpu is not None:
            self.gpu.materialize()

    def on_device(self):
        return self.gpu.on_device() if self.gpu is not None else contextlib.nullcontext()

    def barrier(self) -> None:
        pass  # no other rank to wait for

    def all_true(self, flag: bool) -> bool:
        return flag  # the only rank there is

    def __enter__(self) -> "FakeWorld":
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

        dist.init_process_group("fake", world_size=self.size, rank=self.rank, store=FakeStore())
        stack = contextlib.ExitStack()
        stack.callback(_destroy_process_group)
        # A cell leaves torch as it found it: DeepSpeed's ZeRO-3 replaces F.linear with its
        # own and says so ("this will persist unless manually reset"), and the next cell
        # of the same process (estimate's and predict's jobs) would run it.
        stack.callback(setattr, torch.nn.functional, "linear", torch.nn.functional.linear)
        try:
            if self.fake_tensors:
                stack.enter_context(fake_tensor_mode())
                stack.enter_context(single_rank_ddp())
            if self.buffers_of == "gloo":
                stack.enter_context(collectives.intercepted(GlooReduceScatterBuffers()))
            if self.gpu is not None:
                stack.enter_context(self.gpu)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        stack.close()


def _destroy_process_group() -> None:
    """Destroy the default group, and the HYBRID_SHARD groups impl.fsdp made over it (a
    later world in this process must never be handed a group of this one)."""
    from impl.fsdp.process_groups import forget_cached_groups

    forget_cached_groups()
    dist.destroy_process_group()


# -- what a fake world needs ----------------------------------------------------------


def fake_tensor_mode():
    """FakeTensorMode, except that small integer tensors on the host stay real.

    Engines keep bookkeeping in small int tensors that they exchange with the other
    ranks and then read as data: DDP's C++ reducer its bucket indices and sizes (through
    data pointers, when it rebuilds its buckets after the first iteration), impl's FSDP
    its first-iteration execution-order check (``.tolist()``), a DeviceMesh its rank
    layout. A FakeTensor has no data, so those stay real: what a non-random factory
    (``empty``, ``zeros``, ``arange``, ...) makes when the result is an integer host
    tensor of at most ``HOST_CONTROL_MAX_NUMEL`` elements, and what any op makes from
    inputs that are all such real tensors. A few hundred bytes, outside the tracked
    (meta) storages. Every floating-point tensor, whatever its size, and every tensor
    derived from a fake one (the token ids of a fake batch included) stays fake.

    A value read back to the host from a fake tensor (``.item()``, ``bool(t)``) that
    fake tensors cannot answer (one that is not a constant they carry) reads 0:
    DeepSpeed's ZeRO reads its gradient norm every step (``is_invalid_grad_norm``) and,
    at stages 1-2 in bf16, an overflow flag; 0 says "finite, no overflow", the answer of a
    healthy step. The virtual GPU still makes the host wait for the device at that read,
    as a real one does.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._pytree import tree_leaves

    def small_host_int(t, device: torch.device) -> bool:
        return (device.type == "cpu" and not t.is_floating_point() and not t.is_complex()
                and t.numel() <= HOST_CONTROL_MAX_NUMEL)

    class HostControlFakeMode(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if storages.makes_no_storage(func) and args and isinstance(args[0], FakeTensor):
                # a fake tensor's view or device: what the path below does, sooner
                return super().__torch_dispatch__(func, types, args, kwargs)
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if tensors and all(not isinstance(t, FakeTensor) and small_host_int(t, t.device) for t in tensors):
                with no_dispatch():
                    return func(*args, **kwargs)
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            except DataDependentOutputException:
                if func is not torch.ops.aten._local_scalar_dense.default:
                    raise
                return False if args[0].dtype == torch.bool else 0  # a host read: see the docstring
            if (not tensors and func.overloadpacket in HOST_CONTROL_FACTORIES and isinstance(out, FakeTensor)
                    and small_host_int(out, out.fake_device)):
                with no_dispatch():  # the fake result said what it is: a small integer host tensor
                    return func(*args, **kwargs)
            return out

    return HostControlFakeMode(allow_non_fake_inputs=True)


#: The largest integer host tensor fake_tensor_mode leaves real (elements).
HOST_CONTROL_MAX_NUMEL = 1 << 16
#: Factories whose small integer host results fake_tensor_mode leaves real (never random ones).
HOST_CONTROL_FACTORIES = {torch.ops.aten.empty, torch.ops.aten.zeros, torch.ops.aten.ones, torch.ops.aten.full,
                          torch.ops.aten.arange, torch.ops.aten.scalar_tensor}


@contextlib.contextmanager
def single_rank_ddp():
    """DDP's constructor checks that every rank holds parameters of the same shapes by
    exchanging them as data. One rank against a fake group has no one to disagree with,
    and under fake tensors the shapes cannot be read as data: the check is skipped."""
    from unittest import mock

    with mock.patch("torch.nn.parallel.distributed._verify_param_shape_across_processes", lambda *a, **k: None):
        yield
