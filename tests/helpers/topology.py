"""A faked GPU node, for the tests of device selection that need no GPU.

[Note: faked topologies]
A :class:`Topology` is a node's GPUs in NVML's order (PCI bus order), each with its UUID,
and the order CUDA enumerates them in (fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``;
the two differ on a node of mixed models). Installed (:meth:`Topology.install`), it
answers for ``torch.cuda`` (``is_available``, ``device_count``, ``set_device``,
``current_device``, ``get_device_properties`` with UUIDs, ``get_device_name``),
``torch.distributed.init_process_group`` (recorded, never connected) and ``pynvml``
(handles by index and by UUID, each GPU answering its own power, so a test can tell
which GPU was read). ``CUDA_VISIBLE_DEVICES`` is read from the environment at every
call, as indices in CUDA's order, as UUIDs or their prefixes, or as a MIG instance.
Every call that picks a device or starts a process group is logged in order
(:attr:`Topology.calls`), and every CUDA ``device_id`` handed over is checked to carry
an index (:func:`check_device_id`, the same check as tests/conftest.py's guard).

:func:`rank_setup` then runs one rank's setup as the worker does (``TorchrunWorld``
from the environment a launcher gives it), and reports its device, the calls it made
and which NVML device its telemetry reads.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def check_device_id(device_id, where: str) -> None:
    """Fail a CUDA ``device_id`` without an index: it means "the current device", which is
    whatever was set last (often cuda:0), never the rank's own device by construction."""
    if device_id is None or isinstance(device_id, int):
        return
    device = torch.device(device_id)
    if device.type == "cuda" and device.index is None:
        raise AssertionError(f"{where}: device_id={device} has no index; pass the rank's device, e.g. cuda:3")


@dataclass(frozen=True)
class Gpu:
    name: str
    uuid: str  # as NVML and nvidia-smi print it: "GPU-..." (or "MIG-..." for an instance)
    speed: int = 0  # CUDA enumerates the fastest first (CUDA_DEVICE_ORDER=FASTEST_FIRST)
    total_memory: int = 141 * 2**30

    @property
    def mig(self) -> bool:
        return self.uuid.startswith("MIG-")


def gpus(n: int, name: str = "NVIDIA H200", tag: int = 0, speed: int = 0) -> list[Gpu]:
    """``n`` GPUs of one model, with distinct UUIDs (``tag`` tells nodes apart)."""
    return [Gpu(name, f"GPU-{tag:02x}{i:06x}-1111-2222-3333-{tag * 100 + i:012x}", speed) for i in range(n)]


class NvmlError(Exception):
    pass


@dataclass
class Topology:
    """A faked node: [Note: faked topologies]."""

    nvml: list[Gpu]  # in NVML's (PCI bus) order
    calls: list[tuple] = field(default_factory=list)
    nvml_reads: list[str] = field(default_factory=list)  # UUIDs of the GPUs NVML was asked about, in order
    current: int = 0  # torch.cuda's current device (an index among the visible ones)

    # -- what CUDA sees --------------------------------------------------------------

    def cuda_order(self) -> list[Gpu]:
        if os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
            return list(self.nvml)
        return sorted(self.nvml, key=lambda g: -g.speed)  # stable: PCI order among equals

    def visible(self) -> list[Gpu]:
        ordered = self.cuda_order()
        value = os.environ.get("CUDA_VISIBLE_DEVICES")
        if value is None:
            return ordered
        out = []
        for entry in (e.strip() for e in value.split(",")):
            if entry.isdigit():
                if int(entry) >= len(ordered):
                    break  # CUDA stops at the first invalid entry
                out.append(ordered[int(entry)])
            else:
                found = [g for g in self.nvml if g.uuid.startswith(entry)]
                if len(found) != 1:
                    break
                out.append(found[0])
        return out

    def gpu(self, index: int) -> Gpu:
        visible = self.visible()
        if not 0 <= index < len(visible):
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {index} of {len(visible)} visible)")
        return visible[index]

    def _index(self, device) -> int:
        if isinstance(device, int):
            return device
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"not a CUDA device: {device}")
        return self.current if device.index is None else device.index

    # -- the fakes -------------------------------------------------------------------

    def set_device(self, device) -> None:
        index = self._index(device)
        self.gpu(index)  # an invalid ordinal fails here, as CUDA does
        self.current = index
        self.calls.append(("set_device", index))

    def properties(self, device=None):
        gpu = self.gpu(self.current if device is None else self._index(device))
        return types.SimpleNamespace(name=gpu.name, uuid=gpu.uuid[4:], total_memory=gpu.total_memory,
                                     major=9, minor=0, multi_processor_count=132)

    def init_process_group(self, backend=None, *args, device_id=None, **kwargs) -> None:
        check_device_id(device_id, "init_process_group")
        self.calls.append(("init_process_group", backend, device_id))

    def install(self, monkeypatch) -> "Topology":
        try:  # DeepSpeed picks its accelerator once a process (at its import), by whether CUDA is
            # there: imported before the fake, and put back after it, it keeps the machine's
            from deepspeed.accelerator import get_accelerator, real_accelerator
        except ImportError:
            pass
        else:
            monkeypatch.setattr(real_accelerator, "ds_accelerator", get_accelerator())
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: bool(self.visible()))
        monkeypatch.setattr(cuda, "device_count", lambda: len(self.visible()))
        monkeypatch.setattr(cuda, "set_device", self.set_device)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "get_device_properties", self.properties)
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: self.properties(device).name)
        from torch.distributed import distributed_c10d

        for module in (dist, distributed_c10d):
            monkeypatch.setattr(module, "init_process_group", self.init_process_group)
            monkeypatch.setattr(module, "destroy_process_group", lambda *a, **k: self.calls.append(("destroy",)))
        monkeypatch.setitem(sys.modules, "pynvml", self.pynvml())
        return self

    def pynvml(self) -> types.ModuleType:
        """pynvml, answering for this node: every GPU's power is 100 W plus its NVML index,
        so what was read says which GPU it was; a MIG instance answers memory only."""
        m = types.ModuleType("pynvml")
        m.NVMLError = NvmlError
        m.NVML_CLOCK_SM = 1
        m.nvmlInit = lambda: None
        m.nvmlShutdown = lambda: None
        m.nvmlDeviceGetCount = lambda: len(self.nvml)

        def by_index(i):
            if not 0 <= i < len(self.nvml):
                raise NvmlError("invalid argument")
            return self.nvml[i]

        def by_uuid(uuid):
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            found = [g for g in self.nvml if g.uuid == uuid]  # NVML takes whole UUIDs only
            if not found:
                raise NvmlError("not found")
            return found[0]

        def read(handle, what):
            self.nvml_reads.append(handle.uuid)
            if handle.mig and what in ("utilization", "power"):
                raise NvmlError("not supported")
            return 100_000 + 1000 * self.nvml.index(handle)  # mW

        m.nvmlDeviceGetHandleByIndex = by_index
        m.nvmlDeviceGetHandleByUUID = by_uuid
        m.nvmlDeviceIsMigDeviceHandle = lambda h: h.mig
        m.nvmlDeviceGetUUID = lambda h: h.uuid
        m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=read(h, "utilization") % 97)
        m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=read(h, "memory"), total=h.total_memory)
        m.nvmlDeviceGetPowerUsage = lambda h: read(h, "power")
        m.nvmlDeviceGetEnforcedPowerLimit = lambda h: read(h, "power")
        m.nvmlDeviceGetPowerManagementDefaultLimit = lambda h: read(h, "power")
        m.nvmlDeviceGetClockInfo = lambda h, kind: 1980
        return m


# -- launchers: the environment each rank is started with --------------------------------


def zerobench_env(rank: int, world: int) -> dict[str, str]:
    """What ``zerobench run`` gives a rank (zerobench/harness/launch.py's rank_env)."""
    from zerobench.harness.launch import rank_env

    env = rank_env(rank, world, 29500, 1)
    return {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def torchrun_env(rank: int, nodes: int, per_node: int) -> dict[str, str]:
    """What ``torchrun --nnodes NODES --nproc-per-node PER_NODE`` gives global rank ``rank``."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(nodes * per_node),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "MASTER_ADDR": "node001",
            "MASTER_PORT": "29500"}


def slurm_env(rank: int, nodes: int, per_node: int, gpus_per_task: int | None = None,
              nodelist: str = "gpu[007-008]", job_id: str = "4242") -> dict[str, str]:
    """What ``srun --ntasks-per-node=PER_NODE`` (with ``--gpus-per-node`` or
    ``--gpus-per-task``) gives task ``rank``: Slurm's variables only, no torchrun's."""
    env = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node),
           "SLURM_NTASKS": str(nodes * per_node), "SLURM_NTASKS_PER_NODE": str(per_node),
           "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
           "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": job_id, "SLURM_NNODES": str(nodes)}
    if gpus_per_task is not None:
        env["SLURM_GPUS_PER_TASK"] = str(gpus_per_task)
    return env


#: Variables a launcher sets; cleared before each rank's own are set.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
               "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_NODELIST", "SLURM_JOB_ID",
               "SLURM_NNODES", "SLURM_GPUS_PER_TASK", "ZEROBENCH_CUDA_SHARED_BACKEND")


@contextlib.contextmanager
def environment(env: dict[str, str], visible: str | None = None):
    """``os.environ`` with the launcher variables cleared, ``env`` set and
    ``CUDA_VISIBLE_DEVICES`` = ``visible`` (unset when None), restored after."""
    saved = dict(os.environ)
    for name in (*LAUNCH_VARS, "CUDA_VISIBLE_DEVICES"):
        os.environ.pop(name, None)
    os.environ.update(env)
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@dataclass
class RankSetup:
    """One rank's setup as the worker does it, on a faked topology."""

    device: torch.device
    backend: str
    calls: list[tuple]
    gpu: Gpu  # the GPU the rank's device is
    telemetry_reads: str | None  # the UUID of the GPU its telemetry read (None: nothing read)
    telemetry_note: str | None
    ctx: object  # the rank's RankContext
    env: dict[str, str]  # the torchrun variables of the process once set up


def rank_setup(topology: Topology, env: dict[str, str], visible: str | None = None, requested: str = "auto",
               inside=None) -> RankSetup:
    """Run one rank's setup under ``env``: ``TorchrunWorld(requested)`` entered (device
    chosen, ``set_device``, ``init_process_group``), its GPU telemetry sampled once, and
    ``inside(world)`` if given (an engine's device hand-over). The world is left as the
    worker leaves it."""
    from zerobench.instruments.telemetry import GpuTelemetry
    from zerobench.rank.worlds import TorchrunWorld

    topology.calls.clear()
    topology.nvml_reads.clear()
    topology.current = 0  # a fresh process
    with environment(env, visible):
        world = TorchrunWorld(requested)
        with world:
            if inside is not None:
                inside(world)
            reads = len(topology.nvml_reads)
            with GpuTelemetry(world.device, interval_s=60) as telemetry:
                pass
            read = topology.nvml_reads[reads] if len(topology.nvml_reads) > reads else None
            gpu = topology.gpu(world.device.index)
            final = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
                     if k in os.environ}
    return RankSetup(world.device, world.backend, list(topology.calls), gpu, read, telemetry.note, world.context(),
                     final)
