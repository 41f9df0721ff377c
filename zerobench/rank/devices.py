"""Which device and collective backend a rank uses: decided here and nowhere else.

* ``--device cpu``: CPU and gloo, GPUs or not.
* ``--device cuda``: one GPU per local rank and NCCL. Fewer visible GPUs than local
  ranks is an error naming both counts; never a quiet fall-back to CPU.
* ``--device auto`` (the default): ``cuda`` when a GPU is visible, else ``cpu``. So on a
  GPU node a cell runs on the GPUs or fails; CPU happens only when asked for.
* Under Slurm's ``--gpus-per-task`` each rank sees only its own GPUs: the rank's device
  is the first of them, whatever its local rank ([Note: ranks started by Slurm] in
  zerobench/rank/protocol.py).
* Several ranks on one GPU (the only way to run multi-rank cells on a one-GPU machine):
  opt in with ``ZEROBENCH_CUDA_SHARED_BACKEND=gloo``. NCCL refuses two ranks on one
  device, so the backend is gloo with CUDA tensors (docs/gpu.md lists which collectives
  torch's gloo supports on CUDA tensors). Timings of such cells say nothing about a
  real interconnect; they check that the engines run and agree.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Mapping

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
SHARED_ENV = "ZEROBENCH_CUDA_SHARED_BACKEND"
SHARED_BACKENDS = ("gloo",)
# Environment variables that change measurements, recorded in meta.json.
_ENV_PATTERN = re.compile(r"^(CUDA_VISIBLE_DEVICES|CUDA_LAUNCH_BLOCKING|NCCL_.*|TORCH_NCCL_.*|OMP_.*|MKL_NUM_THREADS"
                          r"|PYTORCH_CUDA_ALLOC_CONF|ZEROBENCH_.*)$")


class DeviceError(RuntimeError):
    """The cell cannot run on the device it asked for."""


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    backend: str
    shared: bool = False  # several ranks on one GPU (gloo)


def _check_requested(requested: str) -> None:
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {requested!r}")


def device_type(requested: str) -> str:
    """'cuda' or 'cpu': what ``requested`` means on this machine."""
    _check_requested(requested)
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    return requested


def shared_backend(env: Mapping[str, str] | None = None) -> str | None:
    value = (os.environ if env is None else env).get(SHARED_ENV, "").strip()
    if not value:
        return None
    if value not in SHARED_BACKENDS:
        raise ValueError(f"{SHARED_ENV} must be one of {', '.join(SHARED_BACKENDS)} (or unset), got {value!r}")
    return value


def backend(requested: str, env: Mapping[str, str] | None = None) -> str:
    """The collective backend cells of this run use."""
    if device_type(requested) == "cpu":
        return "gloo"
    return shared_backend(env) or "nccl"


def choose(requested: str, local_rank: int, local_world: int, env: Mapping[str, str] | None = None,
           gpus_per_task: int | None = None) -> DeviceChoice:
    """The device and backend of one rank, always with an index. See the module docstring.
    ``gpus_per_task``: set where Slurm gave each rank its own GPUs (``--gpus-per-task``)."""
    kind = device_type(requested)
    if kind == "cpu":
        return DeviceChoice(torch.device("cpu"), "gloo")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    if count == 0:
        raise DeviceError(f"--device {requested}: no GPU is visible{where}; use --device cpu to run on CPU with gloo")
    shared = shared_backend(env)
    if shared is not None:
        return DeviceChoice(torch.device("cuda", local_rank % count), shared, shared=True)
    if gpus_per_task is not None and count <= gpus_per_task:  # this rank's own GPUs only
        return DeviceChoice(torch.device("cuda", 0), "nccl")
    if count < local_world:
        raise DeviceError(
            f"--device {requested}: this cell has {local_world} ranks per node but {count} GPU"
            f"{'s are' if count != 1 else ' is'} visible{where}; NCCL needs one GPU per rank. Run with "
            f"--device cpu, fewer ranks per node, or {SHARED_ENV}=gloo to share the GPUs over gloo"
        )
    return DeviceChoice(torch.device("cuda", local_rank), "nccl")


def environment(requested: str = "auto") -> dict:
    """What meta.json records about the devices and the settings that change measurements."""
    cuda = device_type(requested) == "cuda"
    info: dict = {
        "device_requested": requested,
        "device_type": "cuda" if cuda else "cpu",
        "backend": backend(requested),
        "torch_threads": torch.get_num_threads(),
        "env": {k: v for k, v in sorted(os.environ.items()) if _ENV_PATTERN.match(k)},
        "cuda_version": torch.version.cuda,
        "nccl_version": None,
        "gpu_driver_version": None,
        "gpu_models": [],
    }
    if cuda:
        info["gpu_models"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            info["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a build without NCCL
            info["nccl_version"] = None
        info["gpu_driver_version"] = _driver_version()
    return info


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no nvidia-ml-py, or no driver
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None
