"""A child for tests/test_jobs.py: each job's row says its label; a job labelled "crash"
kills the process, as a segfault in an engine would."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from zerobench.whatif.jobs import child_loop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", type=Path)
    parser.add_argument("--jobs", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    def run_one(job) -> dict:
        if job.label == "crash":
            print("boom: the engine crashed", flush=True, file=sys.stderr)
            os._exit(3)
        return {"status": "ok", "seen": f"{job.label}@{job.world_size}"}

    child_loop(args.jobs, args.out, run_one)


if __name__ == "__main__":
    main()
