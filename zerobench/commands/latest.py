"""Print the newest results folder under results/ (or --results): what `latest` names in
every other command, of any kind (a run, an estimate or a prediction); --kind KIND
prints what `latest:KIND` names. E.g. RUN=$(zerobench latest --kind run --results results/ci/run)."""

from __future__ import annotations

from zerobench.commands.args import ALL_KINDS, DEFAULT_RESULTS, LATEST, resolve_folder, results_root

HELP = "print the newest results folder (what `latest` names; --kind for `latest:KIND`)"


def arguments(p) -> None:
    p.add_argument("--results", type=results_root, default=DEFAULT_RESULTS, help="folder to look in (default: results)")
    p.add_argument("--kind", choices=ALL_KINDS, default=None,
                   help="the newest folder of this kind only, as `latest:KIND` (default: any kind, as `latest`)")


def main(args) -> int:
    name = LATEST if args.kind is None else f"{LATEST}:{args.kind}"
    print(resolve_folder(name, "--results", kinds=ALL_KINDS, results=args.results))
    return 0
