"""The mutation study: each mutant of tests/helpers/mutants.py through both gates.

Used by tests/test_mutants.py, and as a command that prints the table of docs/ci.md
("Which gate catches which regression")::

    python -m tests.helpers.mutation_study            # about 40 s on 2 quiet cores

* the predict gate: ``zerobench predict tests/data/mutants.toml --world-sizes 8 --link
  pcie4`` (H100 preset) of the mutant's engine, compared with the same prediction of
  unchanged code by ``zerobench compare`` (every figure exact);
* the CPU run gate: the mutant's engine cell of ``tests/data/mutants-cpu.toml`` on two
  real gloo ranks, compared with the same cell of unchanged code by ``zerobench
  compare``'s default gate (memory, communication, losses; times reported only).

Both sides are made in this process (tests/helpers/gate_folders.py), so the mutant's
monkeypatch is in force in what they run.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.gate_folders import predict_folder, run_folder
from tests.helpers.mutants import MUTANTS, Mutant
from zerobench.cli import main as cli_main

DATA = Path(__file__).parents[1] / "data"
PREDICT_WORKLOAD = DATA / "mutants.toml"
CPU_WORKLOAD = DATA / "mutants-cpu.toml"
PREDICT_WORLD_SIZES = [8]
PREDICT_LINK = "pcie4"


def predict_config(engine: str) -> str:
    return f"{engine}-bf16"


def predict_cell(engine: str) -> str:
    return f"{engine}-ws{PREDICT_WORLD_SIZES[0]}-bf16"


def cpu_cell(engine: str) -> str:
    return f"{engine}-ws2-bf16"


@dataclass
class Outcome:
    """What ``zerobench compare`` said about one mutant."""

    exit_code: int
    regressions: list[dict]
    """the gated regression rows: metric, baseline, new, change_pct"""
    rows: list[dict]
    """every compared row (the loss rows tell whether training stayed the same)"""

    def named(self) -> str:
        return ", ".join(f"{r['metric']} {_pct(r['change_pct'])}" for r in self.regressions) or "-"


def _pct(value) -> str:
    if value is None or value == "inf":
        return "(from 0)"
    return f"{value:+.1f} %" if abs(value) >= 0.05 else f"{value:+.2g} %"


def compare(baseline: Path, new: Path, cell: str, out: Path) -> Outcome:
    """``zerobench compare BASELINE NEW --cells CELL --json OUT``, read back."""
    code = cli_main(["compare", str(baseline), str(new), "--cells", cell, "--json", str(out)])
    report = json.loads(out.read_text())
    regressions = [r for r in report["rows"] if r["gated"] and r["verdict"] == "regression"]
    return Outcome(code, regressions, report["rows"])


def baselines(root: Path) -> dict[str, Path]:
    """Both gates' folders of unchanged code."""
    return {"predict": predict_folder(root / "predict", PREDICT_WORKLOAD, PREDICT_WORLD_SIZES, PREDICT_LINK),
            "run": run_folder(root / "run", CPU_WORKLOAD, "unchanged")}


def through_predict_gate(mutant: Mutant | None, engine: str, base: Path, root: Path) -> Outcome:
    """The mutant (None: unchanged code) predicted and compared with ``base``."""
    with pytest.MonkeyPatch.context() as mp:
        if mutant is not None:
            mutant.apply(mp)
        new = predict_folder(root / "predict", PREDICT_WORKLOAD, PREDICT_WORLD_SIZES, PREDICT_LINK,
                             only=(predict_config(engine),))
    return compare(base, new, predict_cell(engine), root / "predict.json")


def through_run_gate(mutant: Mutant | None, engine: str, base: Path, root: Path) -> Outcome:
    """The mutant (None: unchanged code) run on real ranks and compared with ``base``."""
    with pytest.MonkeyPatch.context() as mp:
        if mutant is not None:
            mutant.apply(mp)
        new = run_folder(root / "run", CPU_WORKLOAD, "new", only=(cpu_cell(engine),))
    return compare(base, new, cpu_cell(engine), root / "run.json")


def markdown_table(outcomes: dict[str, tuple[Outcome, Outcome]]) -> str:
    lines = ["| mutant | the regression | engine | predict gate | CPU run gate |", "|---|---|---|---|---|"]
    for m in MUTANTS:
        predicted, run = outcomes[m.name]
        lines.append(f"| `{m.name}` | {m.story} | {m.engine} | "
                     f"{'caught' if predicted.exit_code == 1 else 'passes'}: {predicted.named()} | "
                     f"{'caught' if run.exit_code == 1 else 'passes'}: {run.named()} |")
    return "\n".join(lines)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="zerobench-mutants-") as tmp:
        root = Path(tmp)
        base = baselines(root / "base")
        outcomes = {}
        for m in MUTANTS:
            where = root / m.name
            with contextlib.redirect_stdout(io.StringIO()):  # the comparisons' own reports
                outcomes[m.name] = (through_predict_gate(m, m.engine, base["predict"], where),
                                    through_run_gate(m, m.engine, base["run"], where))
            print(f"{m.name}: predict gate exit {outcomes[m.name][0].exit_code}, "
                  f"run gate exit {outcomes[m.name][1].exit_code}", file=sys.stderr)
        print(markdown_table(outcomes))


if __name__ == "__main__":
    main()
