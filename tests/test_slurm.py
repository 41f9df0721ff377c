"""docs/running.md's sbatch example, run on a faked node: every task srun would start
with its Slurm environment, through the rank's setup ([Note: ranks started by Slurm] in
zerobench/rank/protocol.py; the faked node: tests/helpers/topology.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from tests.helpers.topology import Topology, gpus, rank_setup, slurm_env

ROOT = Path(__file__).resolve().parents[1]


def sbatch_example() -> str:
    """The batch script of docs/running.md: its one bash block with #SBATCH lines."""
    text = (ROOT / "docs" / "running.md").read_text()
    found = [b for b in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S) if "#SBATCH" in b]
    assert len(found) == 1, "docs/running.md: one sbatch example"
    return found[0]


def sbatch_options(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, flags=re.M))


def srun_worker_args(script: str) -> list[str]:
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    argv = shlex.split(line)
    assert argv[1:4] == ["python", "-m", "zerobench.worker"], argv
    return argv[4:]


@pytest.mark.parametrize("per_task", [False, True], ids=["gpus-per-node", "gpus-per-task"])
def test_the_sbatch_example_starts_every_rank_on_its_own_gpu(monkeypatch, per_task):
    script = sbatch_example()
    options = sbatch_options(script)
    if per_task:  # the variant the page gives: --gpus-per-task=1 in place of --gpus-per-node=8
        options.pop("gpus-per-node")
        options["gpus-per-task"] = "1"
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    assert nodes * per_node > 1 and int(options.get("gpus-per-node", per_node)) == per_node

    # the worker takes the srun line's arguments, and the cell's world size is srun's task count
    from zerobench.rank import passes as worker

    args = srun_worker_args(script)
    parser_seen = {}
    monkeypatch.setattr(worker, "_run_cell_recorded", lambda a, harness: parser_seen.update(vars(a)))
    monkeypatch.setattr(worker.os, "_exit", lambda code: parser_seen.setdefault("exit", code))
    worker.main(args)
    assert parser_seen["exit"] == 0 and parser_seen["cell"].endswith(f"-ws{nodes * per_node}-bf16")

    node = Topology(gpus(per_node)).install(monkeypatch)
    masters = set()
    for rank in range(nodes * per_node):
        local = rank % per_node
        env = slurm_env(rank, nodes, per_node, gpus_per_task=1 if per_task else None, nodelist="gpu[017-018]",
                        job_id="870123")
        setup = rank_setup(node, env, visible=str(local) if per_task else None, requested="auto")
        assert (setup.ctx.rank, setup.ctx.world_size, setup.ctx.local_rank) == (rank, nodes * per_node, local)
        assert setup.device == torch.device("cuda", 0 if per_task else local)
        assert setup.gpu == node.nvml[local]  # each rank on its own GPU of its node, either way
        assert setup.calls[:2] == [("set_device", setup.device.index), ("init_process_group", "nccl", setup.device)]
        masters.add((setup.env["MASTER_ADDR"], setup.env["MASTER_PORT"]))
    assert masters == {("gpu017", "15123")}  # one rendezvous for all ranks: the first host, 15000 + the job id's last 4 digits
