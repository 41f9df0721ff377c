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
import re
import sys
import textwrap

from zerobench import commands
from zerobench.choices import closest, did_you_mean


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusals of a subcommand or an option also say which
    allowed one is closest (``zerobench rnu``: did you mean 'run'?), as every other
    refusal of zerobench does (zerobench/choices.py). Subparsers are of this class too."""

    def error(self, message: str):
        super().error(message + self._suggestion(message))

    def _suggestion(self, message: str) -> str:
        choice = re.search(r"invalid choice: '?([^'\s]+)'? \(choose from (.+)\)$", message)
        if choice:
            return did_you_mean(choice[1], re.findall(r"[\w:.-]+", choice[2]))
        unknown = re.match(r"unrecognized arguments: (.+)$", message)
        if not unknown:
            return ""
        words = unknown[1].split()
        options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        for i, word in enumerate(words):
            if not word.startswith("--"):
                continue
            name, _, value = word.partition("=")
            value = value or (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else "...")
            field = _workload_field_hint(name, value, exact=True) if "--set" in options else ""
            hint = field or did_you_mean(name, options, show=str)
            if not hint and "--set" in options:
                hint = _workload_field_hint(name, value)
            if hint:
                return hint
        return ""


def _workload_field_hint(option: str, value: str, exact: bool = False) -> str:
    """"; did you mean --set matrix.world_size=4?" for an option that names a workload
    field (``--steps 4``; unless ``exact``, also one close to a name: ``--wrold-sizes``),
    or "" when it names none."""
    import dataclasses

    from zerobench.spec.matrix import COMMON_AXES
    from zerobench.spec.workload import DataConfig, OptimizerConfig, RunConfig

    fields = {f"matrix.{axis}": axis for axis in COMMON_AXES}
    for table, config in (("data", DataConfig), ("optimizer", OptimizerConfig), ("run", RunConfig)):
        fields.update({f"{table}.{f.name}": f.name for f in dataclasses.fields(config)})
    bare = option.lstrip("-").replace("-", "_")
    names = list(fields.values())
    found = [bare] if bare in names else [] if exact else closest(bare.removesuffix("s"), names)
    if not found:
        return ""
    key = next(k for k, v in fields.items() if v == found[0])
    return f"; did you mean --set {key}={value}? (workload fields are set with --set KEY=VALUE)"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """A command's description (its module's docstring) refilled to the terminal's width
    (``COLUMNS`` when set), paragraph by paragraph; indented lines (examples, commands)
    are kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for paragraph in re.split(r"\n\s*\n", text.strip("\n")):
            lines = paragraph.splitlines()
            if any(line[:1].isspace() for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(textwrap.fill(" ".join(line.strip() for line in lines), width,
                                         initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(out)


def parse(parser: Parser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with options no command takes refused by that command's own parser,
    so the message names the command and its closest option (``zerobench run
    --wrold-sizes 4``: did you mean --world-sizes?)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = parser._subparsers._group_actions[0].choices[args.command]
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def build_parser() -> Parser:
    parser = Parser(
        prog="zerobench", description="Profiling-first benchmarks of ZeRO / FSDP engines. "
                                       "Start with `zerobench run` (README.md#quick-start).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in commands.COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=HelpFormatter)
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
    args = parse(build_parser(), argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:  # WorkloadError, ArgumentError, FileNotFoundError, PermissionError, ...
        print(f"zerobench {args.command}: error: {error_message(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
