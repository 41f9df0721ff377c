"""Whether ``zerobench predict``'s figures are the same on every run: the evidence behind
the predict gate's exact rule (docs/ci.md, "The predict gate").

    python scripts/predict_determinism.py [--runs 3] [--threads 1,2,4]

Predicts the gate's workload (workloads/ci-predict.toml, its command in .ci/gate):

* ``--runs`` times as the gate does: ``zerobench predict`` in a fresh process, which
  predicts every configuration in turn in one child process ([Note: one process for
  many cells] in zerobench/whatif/jobs.py), with torch at one thread. Python's hash
  seed is random in each process (``PYTHONHASHSEED`` is taken out of the environment),
  so each run hashes differently;
* once with the configurations in the reverse order, in one child process as the gate
  runs them: each configuration follows other ones than in the gate's order (the first
  now runs last, the last alone in a fresh process), so a figure that depended on what
  ran before it in the process would move;
* once per CPU instruction set this machine has (``ATEN_CPU_CAPABILITY=default``,
  ``avx2``, ``avx512``: which kernels torch picks), which the child inherits;
* in this process with torch at each of ``--threads`` threads (the gate's child pins
  torch to one): each configuration as the child runs it
  (zerobench.whatif.predict.job.run_job).

and compares every prediction with the first through ``zerobench compare`` (exact on
every figure). It prints one line per prediction with the number of figures that moved,
and ends with ``identical`` (exit 0) or ``DIFFERENT`` (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "workloads" / "ci-predict.toml"
ARGS = dict(world_sizes=[8], gpu="h100-sxm", link="pcie4")


def _cli_prediction(results: Path, env: dict) -> Path:
    command = [sys.executable, "-m", "zerobench", "predict", str(WORKLOAD), "--world-sizes",
               ",".join(map(str, ARGS["world_sizes"])), "--gpu", ARGS["gpu"], "--link", ARGS["link"],
               "--results", str(results)]
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # a random seed per process
    subprocess.run(command, cwd=ROOT, env={**environ, **env}, check=True, capture_output=True)
    (folder,) = results.iterdir()
    return folder


def _predict(results: Path, run_jobs) -> Path:
    """``zerobench predict`` of the gate's workload, its configurations run by ``run_jobs``
    (in place of ``zerobench.whatif.predict._run_jobs``, same arguments)."""
    import zerobench.whatif.predict as predict
    from zerobench.whatif.predict.request import PredictRequest

    original = predict._run_jobs
    predict._run_jobs = run_jobs
    try:
        return predict.predict(PredictRequest(WORKLOAD, ARGS["world_sizes"], gpu=ARGS["gpu"], link=ARGS["link"],
                                              results_root=results), log=lambda *_: None)
    finally:
        predict._run_jobs = original


def _reversed_prediction(results: Path) -> Path:
    """The configurations in the reverse order, in one child process as the gate runs them."""
    import zerobench.whatif.predict as predict

    child = predict._run_jobs

    def backwards(w, jobs, *args):
        return child(w, jobs[::-1], *args)[::-1]

    return _predict(results, backwards)


def _in_process_prediction(results: Path, threads: int) -> Path:
    """Every configuration in this process as the child runs it, torch at ``threads``."""
    import torch

    from zerobench.instruments.vgpu.presets import load_preset_file
    from zerobench.whatif.predict.job import run_job

    def here(w, jobs, gpu_file, host, links, node_size, traces, memory, log, progress=None):
        return [run_job(w, job, load_preset_file(gpu_file), host, links["link"], links["inter_link"], node_size,
                        None, memory["alloc_conf"], memory["record_streams"], memory["sdpa_backend"]) for job in jobs]

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _predict(results, here)
    finally:
        torch.set_num_threads(before)


def _moved(first: Path, other: Path, scratch: Path) -> tuple[int, int]:
    """(exit code of zerobench compare, figures that moved at all)."""
    from zerobench.cli import main

    report = scratch / "compare.json"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["compare", str(first), str(other), "--json", str(report)])
    rows = json.loads(report.read_text())["rows"]
    return code, sum(1 for r in rows if r["kind"] == "deterministic" and r["change"] not in (0, None))


def _capabilities() -> list[str]:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return ["default"] + [cap for cap, flag in (("avx2", "avx2"), ("avx512", "avx512f")) if flag in flags]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", default="1,2,4")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zerobench-determinism-") as tmp:
        tmp = Path(tmp)
        predictions = [(f"run {i + 1}", _cli_prediction(tmp / f"run{i}", {})) for i in range(args.runs)]
        predictions += [("reverse order", _reversed_prediction(tmp / "reversed"))]
        predictions += [(f"ATEN_CPU_CAPABILITY={cap}",
                         _cli_prediction(tmp / f"cap-{cap}", {"ATEN_CPU_CAPABILITY": cap})) for cap in _capabilities()]
        predictions += [(f"in process, {n} torch threads", _in_process_prediction(tmp / f"threads{n}", n))
                        for n in map(int, args.threads.split(","))]
        first_name, first = predictions[0]
        same = True
        for name, folder in predictions[1:]:
            code, moved = _moved(first, folder, tmp)
            same &= code == 0 and moved == 0
            print(f"{name} vs {first_name}: compare exit {code}, {moved} figures moved")
    print("identical" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
