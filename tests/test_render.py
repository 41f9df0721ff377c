"""Every table zerobench prints goes through one renderer (zerobench/analysis/render.py,
[Note: tables at any width]) and reads at 80, 100 and 160 columns: on the committed
result folders (results/curated/, results/baselines/) through ``zerobench show`` and
``zerobench compare``, and on long configuration names. "Reads" is checked on the
printed text: every line within the width; every cell id whole, wrapped only after one
of its parts (abbreviated keys spelled out by the legend under the table); every header
word whole; no column without content; numbers right-aligned in their columns."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers.tables import abbreviated, check_reads, legend, whole
from zerobench.analysis.render import Column, Table, bytes_unit, format_column, layout, markdown, text
from zerobench.cli import main
from zerobench.runs.kinds import folder_kind, results_folders

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = (80, 100, 160)
FOLDERS = [folder for _, folder in results_folders(ROOT / "results" / "curated")
           + results_folders(ROOT / "results" / "baselines")]
LONG = "torch-fsdp1-fp32-sharding_strategy=SHARD_GRAD_OP"
LONGER = "impl-fsdp-ws2-bf16-sharding_strategy=SHARD_GRAD_OP-backward_prefetch=pre-limit_all_gathers=on"


def show(folder: Path, width: int, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", str(width))
    capsys.readouterr()
    assert main(["show", str(folder)]) == 0
    return capsys.readouterr().out


# --------------------------------------------------------------------------- the committed folders


def _names(folder: Path) -> list[str]:
    kind = folder_kind(folder)
    if kind == "run":
        return list(dict.fromkeys(pd.read_csv(folder / "results.csv")["cell_id"]))
    return list(dict.fromkeys(pd.read_csv(folder / f"{kind}.csv")["config"]))


def test_there_are_folders_of_every_kind_to_read():
    assert {folder_kind(f) for f in FOLDERS} == {"run", "estimate", "predict"}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_show_reads_every_committed_folder_at_every_width(folder, width, capsys, monkeypatch):
    out = show(folder, width, capsys, monkeypatch)
    check_reads(out, width, _names(folder), headers=[], soft=("  zerobench ",))  # a command, whole to copy
    if folder_kind(folder) == "run":
        header = out.splitlines()[next(i for i, line in enumerate(out.splitlines()) if "─" in line) - 1]
        assert "note" not in header.split() and "error" not in header.split()  # no notes, no column for them
        for word in ("cell", "status"):
            assert word in out.split(), word


def test_at_80_columns_the_quickstart_reads_as_the_issue_asked(capsys, monkeypatch):
    """At 80 columns the cell column once shrank to nothing, `note` read one letter per
    line, and at 100 names broke mid-word (`torch-zero1-ws2-f` / `p32`)."""
    folder = ROOT / "results" / "curated" / "20261121-165230-quickstart"
    for width in (80, 100, 120):
        out = show(folder, width, capsys, monkeypatch)
        assert "torch-zero1-ws2-fp32" in out.splitlines()[4] or whole(out, "torch-zero1-ws2-fp32")
        assert not any(line.strip() in ("n", "o", "t", "e", "f", "p32") for line in out.splitlines())
        check_reads(out, width, _names(folder), ["cell", "status", "step ms", "peak MiB", "comm MiB/step", "loss dev"])
    assert "MiB" in out and "GB" not in out and "GiB" not in out  # a 1.3M-parameter model: MiB


# --------------------------------------------------------------------------- the renderer


def _table(names: list[str], note: str = "") -> Table:
    table = Table([Column("config", "left", "parts"), Column("ws"), Column("step ms"), Column("active MiB"),
                   Column("note", "left", "words", role="note")], title="a table")
    for i, name in enumerate(names):
        table.add_row(name, 8 * 8 ** i, f"{1.25 * (i + 1):.2f}", f"{12.5 * (i + 1):.1f}", note if i == 0 else "")
    return table


def _spans(out: str) -> list[tuple[int, int]]:
    rule = next(line for line in out.splitlines() if line.startswith("─"))
    return [m.span() for m in re.finditer("─+", rule)]


@pytest.mark.parametrize("width", WIDTHS + (50,))
def test_a_long_configuration_name_keeps_every_column_in_line(width):
    """predict's f-strings pushed every column out of line for this name."""
    out = text(_table(["ddp-fp32", LONG, LONGER, "torch-fsdp2-bf16"]), width)
    check_reads(out, width, ["ddp-fp32", LONG, LONGER, "torch-fsdp2-bf16"], ["config", "ws", "step ms"])
    spans = _spans(out)
    body = out.splitlines()[out.splitlines().index(next(line for line in out.splitlines() if line.startswith("─"))) + 1:]
    numbers = [line for line in body if re.search(r"\d\.\d", line)]
    assert len(numbers) == 4 * (1 if len(spans) == 4 else 1)
    for line in numbers:  # right-aligned: each figure ends where its column ends
        for start, end in spans[1:]:
            assert line[end - 1] != " " and (end == len(line) or line[end] == " "), (line, spans)


def test_an_empty_column_is_left_out_and_a_note_goes_under_its_row():
    out = text(_table(["ddp-fp32", LONG]), 160)
    assert "note" not in out  # no notes: no column for them
    noted = text(_table(["ddp-fp32", LONG], note="engine ignored limit_all_gathers"), 80)
    lines = noted.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("ddp-fp32"))
    assert lines[row + 1] == "    engine ignored limit_all_gathers"  # under its row, not a column
    assert "note" not in lines[1]
    missing = Table([Column("cell", "left", "parts"), Column("MFU %")])
    missing.add_row("ddp-fp32", "-")
    assert "MFU" not in text(missing, 80)  # a column of missing values says nothing


def test_a_key_column_becomes_a_heading_where_it_cannot_fit_whole():
    table = Table([Column("config", "left", "parts", role="key"), Column("ws"), Column("step ms")])
    for ws in (8, 64):
        table.add_row(LONGER, ws, "1.00")
    wide = text(table, 160).splitlines()
    assert wide[2].startswith(LONGER)  # a column
    narrow = text(table, 60).splitlines()
    assert narrow[2].startswith("impl-fsdp-ws2-bf16-") and narrow.count(narrow[2]) == 1  # a heading, once
    assert whole("\n".join(narrow), LONGER) and all(len(line) <= 60 for line in narrow)


def test_too_many_columns_fold_into_panels_that_repeat_the_first():
    table = Table([Column("cell", "left", "parts")] + [Column(f"figure number {i}") for i in range(12)])
    table.add_row(LONG, *[f"{1000 * i:.1f}" for i in range(12)])
    out = text(table, 80)
    assert out.count("torch-fsdp1-fp32-") == 2 or out.count(abbreviated(LONG, legend(out))) >= 2
    assert all(len(line) <= 80 for line in out.splitlines())
    for i in range(12):
        assert f"{1000 * i:.1f}" in out


def test_an_optional_column_gives_way_before_panels():
    table = Table([Column("metric", "left", "parts", breaks="_"), Column("baseline"), Column("new"),
                   Column("change %", optional=True), Column("verdict", "left")])
    table.add_row("peak_mem_activations_bytes", "20.070 MiB" * 2, "20.164 MiB" * 2, "+0.47%", "regression")
    assert "change %" in text(table, 160).splitlines()[0]
    narrow = text(table, 72)  # fits without change %, not with it
    assert "+0.47%" not in narrow and "not shown at 72 columns: change %" in narrow.replace("\n", " ")
    assert "regression" in narrow.splitlines()[2]  # on its row, not in a panel below
    assert "(a terminal of 78 columns shows it)" in narrow.replace("\n", " ")
    assert "+0.47%" in text(table, 78)


def test_markdown_has_every_column_and_escapes_pipes():
    table = _table(["a|b", LONG], note="n")
    md = markdown(table).splitlines()
    assert md[0] == "| config | ws | step ms | active MiB | note |"
    assert md[1] == "|---|---:|---:|---:|---|"
    assert md[2].startswith("| a\\|b | 8 |")


def test_units_fit_the_numbers_in_one_family():
    assert bytes_unit([27.2 * 2**20, 12 * 2**20]) == ("MiB", 2**20)  # quickstart: MiB
    assert bytes_unit([0.01 * 2**30, 0.03 * 2**30]) == ("MiB", 2**20)  # predict's old "active GiB 0.01"
    assert bytes_unit([64.5 * 2**30, 0.5 * 2**30]) == ("GiB", 2**30)  # Llama 3 8B: GiB
    assert bytes_unit([]) == ("MiB", 2**20)
    assert format_column([3.0, 5.0, 0.0]) == ["3", "5", "0"]  # a count is an integer
    assert format_column([1.622, 3.0], decimals=1) == ["1.6", "3.0"]
    assert format_column([0.0112, 1.5]) == ["0.011", "1.500"]  # three significant digits for the smallest
    assert format_column([None, float("nan"), 2.0]) == ["-", "-", "2"]
    assert format_column([0.5], signed=True, decimals=2) == ["+0.50"]


def test_every_line_fits_even_far_below_any_sensible_width():
    out = layout(_table([LONGER, LONG], note="x " * 50), 30)
    assert all(len(line) <= 30 for line, _ in out)
