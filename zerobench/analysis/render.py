"""Every table zerobench prints, laid out in one place: for a terminal of any width, and
as Markdown. Standard library only (rich is imported by :func:`print_table` alone), so
any command can build a table without importing pandas or torch.

[Note: tables at any width]
A :class:`Table` is columns of strings. :func:`layout` lays it out for a width (the
terminal's; ``COLUMNS`` when set; 160 for a log, :func:`console_width`):

* a column whose every cell is empty or ``-`` (missing) is left out (a ``note`` column
  without notes, MFU where no cell has one);
* a note column (``Column(role="note")``) is not a column: its text goes on a line of its
  own under its row, wrapped to the width, so a long error never squeezes the numbers;
* a group column (``Column(role="group")``) is printed once, as a heading above the rows
  that share its value (compare's cell ids above their metrics); a key column
  (``role="key"``: predict's configuration, one row per world size) is a column where
  the table fits at its natural widths, and a group otherwise;
* an identifier (``wrap="parts"``: a cell id, a metric name) wraps after its break
  characters (``-`` for cell ids, ``_`` for metric names), never inside a part. Where a
  part is wider than the column can be, the key of each ``key=value`` part is shortened
  to its initials and a legend under the table spells them out (``ss =
  sharding_strategy``);
* free text (``wrap="words"``) wraps at spaces; numbers (``wrap="none"``) never wrap;
* a header wraps at its spaces, never narrower than its longest word;
* when the columns cannot all fit even so, the optional columns (``optional=True``:
  compare's change in %, beside the change in the metric's unit) are left out, last
  first, and a line under the table says so; failing that, the table is printed in
  panels, the first column repeated in each.

Every line is at most the width. :func:`markdown` gives the same table as Markdown, every
column included (notes and groups as columns), for compare's report and the what-if
tools' summaries.
"""

from __future__ import annotations

import math
import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Iterable, Literal, Sequence

SEP = "  "  # between two columns
LOG_WIDTH = 160  # a log is no terminal: wide enough for every table without panels
NOTE_INDENT = "    "  # a note line under its row
PART_INDENT = "  "  # the second and later lines of a wrapped identifier, so none reads as a row of its own


@dataclass(frozen=True)
class Column:
    """One column of a :class:`Table`. See [Note: tables at any width]."""

    header: str
    align: Literal["left", "right"] = "right"
    wrap: Literal["none", "parts", "words"] = "none"
    """none: never wraps (numbers); parts: an identifier, wrapped after ``breaks``;
    words: free text, wrapped at spaces."""
    breaks: str = "-"
    """The characters a ``parts`` column may wrap after."""
    optional: bool = False
    """Left out (with a line saying so) where the table would not fit without it, before
    the table is split into panels."""
    role: Literal["value", "key", "note", "group"] = "value"
    """value: a column; key: a column where the table fits whole, else a heading above
    its rows (a configuration over its world sizes); note: a line under the row; group:
    a heading above its rows."""


@dataclass
class Table:
    """Columns and rows of strings, a title, and lines printed under the table."""

    columns: list[Column]
    title: str = ""
    rows: list[list[str]] = field(default_factory=list)
    styles: list[str | None] = field(default_factory=list)
    """A rich style per row (the console only)."""
    notes: list[str] = field(default_factory=list)
    """Lines under the table: what a reader must know that no cell says."""

    def add_row(self, *cells, style: str | None = None) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"a row of {len(cells)} cells for a table of {len(self.columns)} columns")
        self.rows.append(["" if c is None else str(c) for c in cells])
        self.styles.append(style)

    def column(self, header: str) -> list[str]:
        i = [c.header for c in self.columns].index(header)
        return [r[i] for r in self.rows]


# --------------------------------------------------------------------------- numbers


MISSING = "-"  # a value there is not; a column of nothing else is left out
BINARY_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40))


def _finite(values: Iterable) -> list[float]:
    out = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out.append(f)
    return out


def bytes_unit(values: Iterable, smallest: str = "MiB") -> tuple[str, int]:
    """(name, bytes) of the binary unit that fits ``values``: the largest in which their
    largest magnitude is at least 1, and never below ``smallest``. One family (KiB, MiB,
    GiB: powers of 1024) in every table, so MiB never stands beside GB."""
    finite = [abs(v) for v in _finite(values)]
    names = [n for n, _ in BINARY_UNITS]
    start = names.index(smallest)
    unit = BINARY_UNITS[start]
    top = max(finite, default=0.0)
    for name, size in BINARY_UNITS[start:]:
        if top >= size:
            unit = (name, size)
    return unit


def memory_unit(values: Iterable, reference: Iterable = ()) -> tuple[str, int]:
    """(name, bytes) of the one unit a folder's table and plots show a kind of bytes in
    ([Note: one unit a folder]): the unit of the reference engine's largest value
    (``reference``: DDP's cells), else of the values' median; never of the largest cell,
    which one engine's outlier would move."""
    ref = [abs(v) for v in _finite(reference)]
    if ref:
        return bytes_unit([max(ref)])
    finite = sorted(abs(v) for v in _finite(values))
    return bytes_unit([finite[len(finite) // 2]] if finite else [])


# [Note: one unit a folder]
# A table in MiB and its plot in GiB, or the same DDP cell at "307 MiB" in one run and
# "0.300 GiB" in the next (because a new engine's cell passed 1 GiB), make a reader
# convert before comparing. Each kind of bytes (peak memory, communication) of a folder
# is shown in one unit, in its table and in every plot, chosen by :func:`memory_unit`
# from the reference engine's cells: what the workload costs plain data parallelism, the
# same whichever other engines a run adds.


def decimals_for(values: Iterable, significant: int = 3, most: int = 3) -> int:
    """Decimals that give the smallest non-zero magnitude of ``values`` ``significant``
    digits (at most ``most``); 0 when every value is whole."""
    finite = _finite(values)
    if all(v == int(v) for v in finite):
        return 0
    small = min((abs(v) for v in finite if v != 0), default=1.0)
    return max(0, min(most, significant - 1 - math.floor(math.log10(small))))


def format_column(values: Sequence, scale: float = 1.0, decimals: int | None = None, signed: bool = False,
                  missing: str = MISSING) -> list[str]:
    """``values`` * ``scale`` as strings with one number of decimals for the whole column
    (:func:`decimals_for` unless given): integers print as integers (a count is never
    ``3.0``). None and NaN print as ``missing``."""
    scaled = [None if v is None or not _finite([v]) else float(v) * scale for v in values]
    places = decimals_for([v for v in scaled if v is not None]) if decimals is None else decimals
    sign = "+" if signed else ""
    return [missing if v is None else f"{v:{sign}.{places}f}" for v in scaled]


# --------------------------------------------------------------------------- layout


def _parts(text: str, breaks: str) -> list[str]:
    """``text`` cut after each of ``breaks``: "a-b=c-d" -> ["a-", "b=c-", "d"]."""
    if not breaks:
        return [text]
    return [p for p in re.split(f"(?<=[{re.escape(breaks)}])", text) if p]


def _fold(text: str, width: int) -> list[str]:
    """A word wider than ``width`` in pieces of ``width``: the last resort."""
    return [text[i:i + width] for i in range(0, len(text), width)] or [""]


def _fill(pieces: list[str], width: int) -> list[str]:
    """``pieces`` (the parts of an identifier) filled greedily into lines of at most
    ``width``; a piece wider than that is folded."""
    lines: list[str] = []
    line = ""
    for piece in pieces:
        candidate = line + piece
        if len(candidate.rstrip()) <= width:
            line = candidate
            continue
        if line:
            lines.append(line.rstrip())
        while len(piece) > width:
            lines.append(piece[:width])
            piece = piece[width:]
        line = piece
    lines.append(line.rstrip())
    return lines


def wrap_id(text: str, width: int, breaks: str = "-") -> list[str]:
    """An identifier (a cell id) in lines of at most ``width``, each cut after one of
    ``breaks``, as a table's key column wraps it."""
    return _fill(_parts(text, breaks), width)


def wrap_cell(text: str, column: Column, width: int) -> list[str]:
    """The lines of one cell at ``width``."""
    if len(text) <= width and "\n" not in text:
        return [text]
    if column.wrap == "parts":
        indent = PART_INDENT if width > 2 * len(PART_INDENT) else ""
        first, *rest = _fill(_parts(text, column.breaks), width)
        if not rest:
            return [first]
        rest = _fill(_parts("".join(rest), column.breaks), width - len(indent))
        return [first] + [indent + line for line in rest]
    if column.wrap == "words":
        out = []
        for paragraph in text.splitlines() or [""]:
            out += textwrap.wrap(paragraph, width, break_long_words=True, break_on_hyphens=False) or [""]
        return out
    return _fold(text, width)


def _min_width(texts: list[str], column: Column) -> int:
    if column.wrap == "parts":
        parts = [p for t in texts for p in _parts(t, column.breaks)[1:]]  # a part on a line of its own is indented
        return max([len(_parts(t, column.breaks)[0]) for t in texts] + [len(PART_INDENT) + len(p) for p in parts])
    if column.wrap == "words":
        # a long word (a path) may be folded rather than widen the column beyond 24
        return min(max((len(w) for t in texts for w in t.split()), default=0), 24)
    return max((len(t) for t in texts), default=0)


def _header_min(header: str) -> int:
    return max((len(w) for w in header.split()), default=0)


class _Abbreviations:
    """key -> initials of the ``key=value`` parts of identifiers, collisions numbered."""

    def __init__(self):
        self.short: dict[str, str] = {}

    def of(self, key: str) -> str:
        if key not in self.short:
            base = "".join(w[0] for w in re.split(r"[_.]", key) if w) or key[:1]
            short, n = base, 2
            while short in self.short.values():
                short, n = f"{base}{n}", n + 1
            self.short[key] = short if len(short) < len(key) else key
        return self.short[key]

    def apply(self, text: str, breaks: str) -> str:
        out = []
        for part in _parts(text, breaks):
            key, eq, rest = part.partition("=")
            out.append(f"{self.of(key)}={rest}" if eq and key and re.fullmatch(r"[A-Za-z_][\w.]*", key) else part)
        return "".join(out)

    def legend(self) -> str:
        used = {k: v for k, v in self.short.items() if v != k}
        return ", ".join(f"{v} = {k}" for k, v in used.items())


def _visible(table: Table) -> list[int]:
    """The columns that have something to show: not every cell empty or missing."""
    return [i for i, _ in enumerate(table.columns) if any(r[i].strip() not in ("", MISSING) for r in table.rows)]


def _whole(texts: list[str], column: Column) -> int:
    return max([len(column.header)] + [len(t) for t in texts])


def _least(texts: list[str], column: Column) -> int:
    return max(_header_min(column.header), _min_width(texts, column))


def _widths(texts: dict[int, list[str]], columns: list[Column], keep: list[int], width: int,
            force: bool = False) -> list[int] | None:
    """Column widths for ``keep`` that fit ``width``, or None when even their minimum does
    not; with ``force``, narrower than that minimum (cells then fold), never None."""
    whole = [_whole(texts[i], columns[i]) for i in keep]
    least = [_least(texts[i], columns[i]) for i in keep]
    room = width - len(SEP) * (len(keep) - 1)
    if sum(whole) <= room:
        return whole
    if sum(least) > room:
        if not force:
            return None
        # the last resort: every column its share of the room, at least one character
        scale = max(room, len(keep)) / sum(least)
        widths = [max(1, int(w * scale)) for w in least]
        widths[0] += max(room, len(keep)) - sum(widths)
        return widths
    widths = list(least)
    spare = room - sum(least)
    # Identifiers first, up to their median length (most ids on one line), then headers
    # on one line, then identifiers whole, then free text.
    typical = [sorted(len(t) for t in texts[i])[len(texts[i]) // 2] if texts[i] else 0 for i in keep]
    for kinds, target in ((("parts",), typical), (("none",), whole), (("parts",), whole), (("words",), whole)):
        for k, i in enumerate(keep):
            if columns[i].wrap in kinds and spare > 0:
                grow = max(0, min(spare, target[k] - widths[k]))
                widths[k] += grow
                spare -= grow
    return widths


def _header_lines(header: str, width: int) -> list[str]:
    # a word wider than the column breaks only where the column was forced narrower than it
    return textwrap.wrap(header, width, break_long_words=True) or [""]


def _render_block(table: Table, keep: list[int], widths: list[int], texts: dict[int, list[str]],
                  notes: list[int], group: int | None, width: int) -> list[tuple[str, str | None]]:
    columns = table.columns
    out: list[tuple[str, str | None]] = []

    def join(cells: list[str]) -> str:
        padded = []
        for k, i in enumerate(keep):
            text = cells[k]
            padded.append(text.ljust(widths[k]) if columns[i].align == "left" else text.rjust(widths[k]))
        return SEP.join(padded).rstrip()

    headers = [_header_lines(columns[i].header, widths[k]) for k, i in enumerate(keep)]
    height = max((len(h) for h in headers), default=1)
    for line in range(height):  # headers sit on the rule, their first lines padded above
        out.append((join([(h[line - (height - len(h))] if line >= height - len(h) else "") for h in headers]),
                    "bold"))
    out.append((SEP.join("─" * w for w in widths), None))
    last_group = None
    for r, row in enumerate(table.rows):
        style = table.styles[r] if r < len(table.styles) else None
        if group is not None and row[group] != last_group:
            last_group = row[group]
            for line in wrap_cell(texts[group][r], Column("", wrap="parts", breaks=columns[group].breaks), width):
                out.append((line, "bold"))
        cells = [wrap_cell(texts[i][r], columns[i], widths[k]) for k, i in enumerate(keep)]
        for line in range(max(len(c) for c in cells)):
            out.append((join([c[line] if line < len(c) else "" for c in cells]), style))
        for i in notes:
            text = row[i].strip()
            if text:
                for line in textwrap.wrap(text, width - len(NOTE_INDENT), break_long_words=True,
                                          break_on_hyphens=False):
                    out.append((NOTE_INDENT + line, style))
    return out


def layout(table: Table, width: int) -> list[tuple[str, str | None]]:
    """(line, rich style) of the table at ``width``, title and notes included. See
    [Note: tables at any width]."""
    width = max(int(width), 20)
    out: list[tuple[str, str | None]] = [(line, "bold") for line in textwrap.wrap(table.title, width)]
    visible = _visible(table)
    columns = table.columns
    values = [i for i in visible if columns[i].role in ("value", "key")]
    notes = [i for i in visible if columns[i].role == "note"]
    group = next((i for i in visible if columns[i].role == "group"), None)
    texts = {i: [r[i] for r in table.rows] for i in range(len(columns))}
    key = next((i for i in values if columns[i].role == "key"), None)
    if key is not None and group is None and len(values) > 1:
        need = _whole(texts[key], columns[key]) + sum(_least(texts[i], columns[i]) for i in values if i != key)
        if need + len(SEP) * (len(values) - 1) > width:  # the key would wrap: a heading above its rows
            group = key
            values = [i for i in values if i != key]
    if not table.rows or not values:
        out.append(("(nothing to show)", None) if not table.rows else ("", None))
    else:
        abbreviations = _Abbreviations()
        widths, shown, left_out = _fit(texts, columns, values, width, abbreviations)
        if widths is not None:
            out += _render_block(table, shown, widths, texts, notes, group, width)
        else:
            for k, panel in enumerate(_panels(texts, columns, shown, width)):
                if k:
                    out.append(("", None))
                out += _render_block(table, panel, _widths(texts, columns, panel, width, force=True), texts,
                                     notes if k == 0 else [], group, width)
        legend = abbreviations.legend()
        if legend:
            out += [(line, "dim") for line in textwrap.wrap(f"abbreviated: {legend}", width)]
        if left_out:
            names = ", ".join(columns[i].header for i in left_out)
            need = sum(_least(texts[i], columns[i]) for i in values) + len(SEP) * (len(values) - 1)
            out += [(line, "dim") for line in textwrap.wrap(f"not shown at {width} columns: {names} (a terminal of "
                                                              f"{need} columns shows it)", width)]
    for note in table.notes:
        out += [(line, "dim") for line in textwrap.wrap(note, width, break_long_words=True,
                                                         break_on_hyphens=False)] or [("", None)]
    return out


def _fit(texts, columns, values: list[int], width: int, abbreviations: _Abbreviations):
    """(widths or None, the columns shown, the optional ones left out): the columns at
    ``width`` as they are; else with the keys of ``key=value`` parts abbreviated (in
    ``texts``); else without optional columns, last first. None: panels it is, every
    column shown."""
    widths = _widths(texts, columns, values, width)
    if widths is None:
        for i in values:
            if columns[i].wrap == "parts":
                texts[i] = [abbreviations.apply(t, columns[i].breaks) for t in texts[i]]
        widths = _widths(texts, columns, values, width)
    left_out: list[int] = []
    for i in reversed([i for i in values if columns[i].optional]):
        if widths is not None:
            break
        left_out.insert(0, i)  # rather than a panel far below the rows it belongs to
        widths = _widths(texts, columns, [v for v in values if v not in left_out], width)
    if widths is None:
        return None, values, []
    return widths, [v for v in values if v not in left_out], left_out


def _panels(texts, columns, values: list[int], width: int) -> list[list[int]]:
    """``values`` in groups that each fit ``width`` beside the first column (repeated);
    a column too wide on its own is folded to the width."""
    key, rest = values[0], values[1:]
    panels: list[list[int]] = []
    current = [key]
    for i in rest:
        if _widths(texts, columns, current + [i], width) is not None or len(current) == 1:
            current.append(i)
        else:
            panels.append(current)
            current = [key, i]
    panels.append(current)
    return panels


def text(table: Table, width: int) -> str:
    """The table as plain text at ``width`` columns."""
    return "\n".join(line for line, _ in layout(table, width))


# --------------------------------------------------------------------------- Markdown


def _md_cell(value: str) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(table: Table) -> str:
    """The table as Markdown: every column that has something to show, notes and groups
    included, numbers right-aligned; the notes under it as a paragraph each."""
    keep = _visible(table)
    order = [i for i in keep if table.columns[i].role == "group"] + \
            [i for i in keep if table.columns[i].role in ("value", "key")] + \
            [i for i in keep if table.columns[i].role == "note"]
    lines = []
    if table.rows and order:
        lines.append("| " + " | ".join(_md_cell(table.columns[i].header) for i in order) + " |")
        lines.append("|" + "|".join("---:" if table.columns[i].align == "right" else "---" for i in order) + "|")
        lines += ["| " + " | ".join(_md_cell(row[i]) for i in order) + " |" for row in table.rows]
    else:
        lines.append("(nothing to show)")
    for note in table.notes:
        lines += ["", note]
    return "\n".join(lines)


# --------------------------------------------------------------------------- console


def console_width() -> int:
    """The width tables are laid out for: ``COLUMNS`` when it holds a number, else the
    terminal's, else (a log, a pipe) :data:`LOG_WIDTH`."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
        if columns > 0:
            return columns
    except ValueError:
        pass
    if sys.stdout.isatty():
        import shutil

        return shutil.get_terminal_size().columns
    return LOG_WIDTH


def make_console():
    """A rich console at :func:`console_width` (progress bars and tables agree on it)."""
    from rich.console import Console

    return Console(width=console_width())


def print_table(table: Table, console=None) -> None:
    """Print ``table`` on a rich ``console`` (a new one at :func:`console_width` when
    None), each line as plain text in its row's style ([Note: plain text] in
    zerobench/analysis/summary.py)."""
    from rich.text import Text

    console = console or make_console()
    for line, style in layout(table, console.width):
        console.print(Text(line, style=style or ""), soft_wrap=True, highlight=False)
