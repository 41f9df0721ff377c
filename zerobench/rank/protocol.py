"""What a rank process is told by whoever starts it: the torchrun environment, the
harness's pid, and where the harness's own code is. Pure Python (no torch), so the
launcher (zerobench/harness/launch.py) and the rank (zerobench/rank/) share it.

The torchrun protocol: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``. ``zerobench run`` sets them as torchrun does, plus
:data:`HARNESS_ENV`; under torchrun itself that one is unset and nothing changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Set by the harness in each rank's environment: the harness's pid. A rank that sees it
#: dies with the harness and never records a result once the harness is gone
#: (zerobench.rank.passes.watch_harness). Unset under torchrun, where nothing changes.
HARNESS_ENV = "ZEROBENCH_HARNESS_PID"


def code_root() -> Path:
    """The folder holding the ``zerobench`` and ``impl`` packages this process runs."""
    return Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TorchrunEnv:
    """Where this process sits in the world, as torchrun says."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env(prog: str = "zerobench.worker") -> TorchrunEnv:
    """The torchrun environment of this process; SystemExit naming what is missing."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as err:
        raise SystemExit(
            f"{prog}: {err.args[0]} is not set. Run it under torchrun "
            "(torchrun --nproc-per-node N -m zerobench.worker ...) or through `zerobench run`."
        ) from None
    return TorchrunEnv(rank, world, int(os.environ.get("LOCAL_RANK", rank)),
                       int(os.environ.get("LOCAL_WORLD_SIZE", world)))
