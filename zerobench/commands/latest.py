"""Print the newest results folder under results/ (or --results): what `latest` names in
the other commands, e.g. RUN=$(zerobench latest --results results/ci)."""

from __future__ import annotations

from zerobench.commands.args import DEFAULT_RESULTS, FOLDER_KINDS, LATEST, resolve_folder, results_root

HELP = "print the newest results folder (what `latest` names)"


def arguments(p) -> None:
    p.add_argument("--results", type=results_root, default=DEFAULT_RESULTS, help="folder to look in (default: results)")
    p.add_argument("--kind", choices=tuple(FOLDER_KINDS), default="run",
                   help="which kind of folder (default: run)")


def main(args) -> int:
    print(resolve_folder(LATEST, "--results", kinds=(args.kind,), results=args.results))
    return 0
