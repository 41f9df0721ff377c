"""The ``zerobench`` subcommands, one module each.

[Note: one subcommand, one module]
Each module here is the one place that declares a subcommand: its module docstring
is the description ``zerobench NAME --help`` prints, ``HELP`` the line in
``zerobench --help``, ``arguments(parser)`` its options and ``main(args) -> int`` what
it does. A module imports only the standard library and :mod:`.args` at its top; the
harness, torch, pandas and matplotlib are imported inside ``main``, so that
``zerobench --help`` and every ``zerobench NAME --help`` answer without importing them
(tests/test_cli.py checks what is imported). A new subcommand is a new module and one
line in :data:`COMMANDS`.
"""

from __future__ import annotations

#: Subcommand -> its module, in the order ``zerobench --help`` lists them: first the
#: path of a run (run it, read it, compare it), then the what-if tools, then lookups.
COMMANDS: dict[str, str] = {
    "run": "zerobench.commands.run",
    "show": "zerobench.commands.show",
    "plot": "zerobench.commands.plot",
    "reference": "zerobench.commands.reference",
    "list": "zerobench.commands.list_runs",
    "latest": "zerobench.commands.latest",
    "compare": "zerobench.commands.compare",
    "analyze": "zerobench.commands.analyze",
    "estimate": "zerobench.commands.estimate",
    "simulate": "zerobench.commands.simulate",
    "predict": "zerobench.commands.predict",
    "calibrate": "zerobench.commands.calibrate",
    "engines": "zerobench.commands.engines",
    "cells": "zerobench.commands.cells",
}
