"""Workloads and run-registry fixtures shared by the harness's tests (test_faults,
test_machine_load, test_show)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: One DDP cell of a one-layer MLP at world size 1, two steps: the smallest real run.
TINY = textwrap.dedent("""
    name = "tiny"
    [model]
    kind = "mlp"
    depth = 1
    width = 8
    [data]
    batch_size = 2
    warmup_steps = 1
    steps = 2
    [run]
    timeout_s = 120
    memory_pass = false
    [matrix]
    engine = ["ddp"]
    world_size = [1]
""")


@contextlib.contextmanager
def another_run_registered(run_dir: Path):
    """A separate process that registers ``run_dir`` as a running harness
    (zerobench.harness.active) until the block ends, then is killed (SIGKILL: it
    releases nothing itself). Yields the process."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from zerobench.harness import active
        with active.register(sys.argv[1]):
            print("registered", flush=True)
            time.sleep(60)
    """), str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert holder.stdout.readline().strip() == "registered"
        yield holder
    finally:
        holder.kill()
        holder.wait()
