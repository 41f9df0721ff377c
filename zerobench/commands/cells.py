"""List a workload's cell ids, skipped ones with their reason (a cell id is what
`zerobench run --cell` and `torchrun ... -m zerobench.worker --cell` take)."""

from __future__ import annotations

from zerobench.commands.args import add_overrides

HELP = "list a workload's cell ids (for running one under torchrun)"


def arguments(p) -> None:
    p.add_argument("workload", nargs="?", default="quickstart",
                   help="workload TOML file or shipped workload name (default: quickstart)")
    add_overrides(p)


def main(args) -> int:
    from zerobench.spec.matrix import expand, matrix_notes
    from zerobench.spec.workload import load_workload

    workload = load_workload(args.workload, args.overrides)
    cells = expand(workload)  # a matrix that is refused is refused before any note
    for note in matrix_notes(workload):
        print(f"# note: {note}")
    for cell in cells:
        note = f"   # skipped: {cell.skip_reason}" if cell.skip_reason else ""
        note += f"   # note: {cell.note}" if cell.note else ""
        print(f"{cell.id}{note}")
    return 0
