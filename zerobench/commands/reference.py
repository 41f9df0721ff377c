"""Complete a run whose cells ran under torchrun (zerobench run --prepare-only, then
torchrun ... -m zerobench.worker): compute the single-process loss reference of every
cell without one and write results.csv and steps.csv. It trains the run's model, and so
imports any factory its workload.json names: run it on folders you trust. Reading a
folder (show, plot, compare) never does this ([Note: readers have no side effects] in
zerobench/runs/folder.py).
"""

from __future__ import annotations

from zerobench.commands.args import resolve_folder

HELP = ("compute the loss reference of cells run under torchrun and write the tables "
        "(trains the run's model: only for folders you trust)")


def arguments(p) -> None:
    p.add_argument("run", help="run folder, or `latest:run` (the newest run; `latest`: the newest folder of any kind)")


def main(args) -> int:
    run = resolve_folder(args.run, "RUN")

    from zerobench.harness.reference import complete_run
    from zerobench.runs.folder import RunFolder

    folder = RunFolder(run)
    if not folder.workload_path.exists():
        raise FileNotFoundError(f"{run}: not a zerobench run folder (no workload.json)")
    updated = complete_run(run)
    print(f"reference: {len(updated)} cell(s) checked against the single-process reference; "
          f"tables written to {folder.results_path}")
    return 0
