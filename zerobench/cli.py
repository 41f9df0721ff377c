"""The ``zerobench`` command line: a thin front door over the subcommands of
zerobench/commands/, one module each ([Note: one subcommand, one module]).

Parsing imports each subcommand's module, which holds nothing heavier than argparse;
the harness, torch, pandas and matplotlib are imported by the command that runs, after
its arguments parsed. ``zerobench --help`` and ``zerobench NAME --help`` therefore
answer without importing torch (tests/test_cli.py).

[Note: pointers in help]
A help text that sends the reader to a document names the file, and a section of it as
GitHub's anchor of its heading: ``docs/models.md#depth-extrapolation-in-zerobench-estimate``.
tests/test_cli.py checks that every file and section a help text names exists.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from zerobench import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerobench", description="Profiling-first benchmarks of ZeRO / FSDP engines. "
                                       "Start with `zerobench run` (README.md#quick-start).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in commands.COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.arguments(p)
        p.set_defaults(func=module.main)
    return parser


def error_message(err: BaseException) -> str:
    """One line for an error the user can act on: a bad value (naming the option, field
    or file and what is allowed) or a file that cannot be read or written."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    return str(err)


# [Note: refuse early]
# Bad input is refused before anything is written or run: each command checks every
# option, workload field and folder it is given, naming it and what is allowed, and runs
# the user's model code once (zerobench/spec/user_check.py), before it makes a results
# folder or starts a rank. The error reaches main() below, which prints one line and
# returns 2: a command that fails leaves no new folder, a failed ``--resume`` leaves the
# run's files as they were.


def main(argv: list[str] | None = None) -> int:
    """Exit codes: what the command returns (0 ok; see each command's --help), 2 on
    bad input or a file that cannot be read or written (argparse's own code for a bad
    option), with one line on stderr saying which and why."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:  # WorkloadError, ArgumentError, FileNotFoundError, PermissionError, ...
        print(f"zerobench {args.command}: error: {error_message(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
