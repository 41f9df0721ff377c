"""What a rank process is told by whoever starts it: the torchrun environment (or Slurm's,
when ``srun`` starts the ranks itself), the harness's pid, and where the harness's own
code is. Pure Python (no torch), so the launcher (zerobench/harness/launch.py) and the
rank (zerobench/rank/) share it.

The torchrun protocol: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``. ``zerobench run`` sets them as torchrun does, plus
:data:`HARNESS_ENV`; under torchrun itself that one is unset and nothing changes.

[Note: ranks started by Slurm]
``srun --ntasks-per-node=8 --gpus-per-node=8 python -m zerobench.worker ...`` starts
every rank itself, with no torchrun: there is no ``RANK``, only Slurm's task variables.
When ``RANK`` is unset and ``SLURM_PROCID`` is set, the torchrun variables are derived
from Slurm's, as PyTorch Lightning's SLURM environment does: ``RANK`` from
``SLURM_PROCID``, ``LOCAL_RANK`` from ``SLURM_LOCALID``, ``WORLD_SIZE`` from
``SLURM_NTASKS``, ``LOCAL_WORLD_SIZE`` from the tasks of this node
(``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``, at ``SLURM_NODEID``),
``MASTER_ADDR`` from the first host of ``SLURM_JOB_NODELIST`` and ``MASTER_PORT`` from
the job id (15000 plus its last four digits, so every task of the job agrees on it
without talking). A ``MASTER_ADDR`` or ``MASTER_PORT`` already set wins. The rank's
device then follows zerobench/rank/devices.py; under ``--gpus-per-task`` Slurm shows each
task only its own GPUs (``SLURM_GPUS_PER_TASK``), so the rank's device is the first of
those, whatever its local rank.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

#: Set by the harness in each rank's environment: the harness's pid. A rank that sees it
#: dies with the harness and never records a result once the harness is gone
#: (zerobench.rank.passes.watch_harness). Unset under torchrun, where nothing changes.
HARNESS_ENV = "ZEROBENCH_HARNESS_PID"

#: MASTER_PORT under Slurm: this plus the last four digits of SLURM_JOB_ID (Lightning's choice).
SLURM_PORT_BASE = 15000
#: MASTER_PORT under Slurm when the job has no id (an srun outside sbatch/salloc always has one).
SLURM_PORT_DEFAULT = 12910


def code_root() -> Path:
    """The folder holding the ``zerobench`` and ``impl`` packages this process runs."""
    return Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TorchrunEnv:
    """Where this process sits in the world, as torchrun (or Slurm) says."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str = "torchrun"
    """"torchrun" (torchrun, ``zerobench run``, anything setting RANK) or "slurm" (srun itself)"""
    gpus_per_task: int | None = None
    """Slurm's ``--gpus-per-task``: each rank sees only its own GPUs (None: the node's GPUs are shared out)"""
    exports: dict[str, str] = field(default_factory=dict)
    """torchrun variables derived here that ``init_process_group("env://")`` reads: set them in the environment"""


def torchrun_env(prog: str = "zerobench.worker", env: Mapping[str, str] | None = None) -> TorchrunEnv:
    """The torchrun environment of this process (``env``: os.environ by default), derived
    from Slurm's where srun started it ([Note: ranks started by Slurm]); SystemExit naming
    what is missing."""
    env = os.environ if env is None else env
    if "RANK" not in env and "SLURM_PROCID" in env:
        return slurm_env(env, prog)
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except KeyError as err:
        raise SystemExit(
            f"{prog}: {err.args[0]} is not set. Run it under torchrun "
            "(torchrun --nproc-per-node N -m zerobench.worker ...), under srun (Slurm's task variables), "
            "or through `zerobench run`."
        ) from None
    return TorchrunEnv(rank, world, int(env.get("LOCAL_RANK", rank)), int(env.get("LOCAL_WORLD_SIZE", world)))


def slurm_env(env: Mapping[str, str], prog: str = "zerobench.worker") -> TorchrunEnv:
    """The torchrun environment of a rank srun started: [Note: ranks started by Slurm]."""

    def need(name: str) -> str:
        value = env.get(name, "").strip()
        if not value:
            raise SystemExit(f"{prog}: started by srun (SLURM_PROCID is set) but {name} is not set; "
                             "srun sets it for every task (srun --ntasks-per-node=N python -m zerobench.worker ...)")
        return value

    def number(name: str) -> int:
        value = need(name)
        if not value.isdigit():
            raise SystemExit(f"{prog}: {name} must be a whole number, got {value!r}")
        return int(value)

    rank, local_rank, world = number("SLURM_PROCID"), number("SLURM_LOCALID"), number("SLURM_NTASKS")
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or need("SLURM_NTASKS_PER_NODE")
    counts = tasks_per_node(per_node)
    node = int(env.get("SLURM_NODEID", "0") or 0)
    local_world = counts[min(node, len(counts) - 1)]
    job = env.get("SLURM_JOB_ID", "")
    port = SLURM_PORT_BASE + int(job[-4:]) if job[-4:].isdigit() else SLURM_PORT_DEFAULT
    exports = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
               "LOCAL_WORLD_SIZE": str(local_world),
               "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(need("SLURM_JOB_NODELIST")),
               "MASTER_PORT": env.get("MASTER_PORT") or str(port)}
    gpus = env.get("SLURM_GPUS_PER_TASK", "").strip()
    gpus_per_task = int(gpus.split(":")[-1]) if gpus.split(":")[-1].isdigit() else None  # "1" or "h200:1"
    return TorchrunEnv(rank, world, local_rank, local_world, "slurm", gpus_per_task, exports)


def tasks_per_node(value: str) -> list[int]:
    """Slurm's tasks per node, one entry per node: ``"8(x2),4"`` is ``[8, 8, 4]``."""
    out = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise SystemExit(f"tasks per node {value!r}: not Slurm's form (e.g. 8 or 8(x2),4)")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``"gpu[003-004,010],cpu1"`` is ``gpu003``."""
    host, text = [], nodelist.strip()
    i = 0
    while i < len(text):
        c = text[i]
        if c == ",":
            break
        if c == "[":
            end = text.index("]", i)
            host.append(re.split(r"[,-]", text[i + 1:end])[0])  # the first number of the first range
            i = end + 1
            continue
        host.append(c)
        i += 1
    if not host:
        raise SystemExit(f"SLURM_JOB_NODELIST {nodelist!r}: no host in it")
    return "".join(host)
