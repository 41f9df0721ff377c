"""The behaviour contract lives in the repository: every ``behaviour.md §X`` a docstring
or doc cites names a section of docs/behaviour.md, and nothing points at files outside
the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*ROOT.glob("impl/**/*.py"), *ROOT.glob("zerobench/**/*.py"), *ROOT.glob("tests/**/*.py"),
           *ROOT.glob("docs/*.md"), ROOT / "README.md"]
SELF = Path(__file__).resolve()


def _sections() -> set[str]:
    text = (ROOT / "docs" / "behaviour.md").read_text()
    return set(re.findall(r"^#{2,3} (Z\d(?:\.\d+)?|F\d*(?:\.\d+)?)[. ]", text, flags=re.M)) | {"F"}


def test_every_cited_section_exists():
    sections = _sections()
    assert {"Z1.1", "Z1.2", "Z1.4", "Z1.6", "Z2.2", "F2", "F11", "F12"} <= sections, sorted(sections)
    cited = []
    for path in (p for p in SOURCES if p.resolve() != SELF):
        for m in re.finditer(r"behaviour\.md\)? ((?:§[A-Z]\d*(?:\.\d+)?(?:, |/| and )?)+)", path.read_text()):
            cited += [(path.relative_to(ROOT), s) for s in re.findall(r"§([A-Z]\d*(?:\.\d+)?)", m.group(1))]
    assert len(cited) >= 20  # the docstrings do cite it
    missing = [(str(p), s) for p, s in cited if s not in sections]
    assert not missing, f"cited sections not in docs/behaviour.md: {missing}"


def _outside_references(path: Path, text: str) -> list[str]:
    """Relative paths in ``text`` (``../...``) that climb out of the repository."""
    return [m.group(1) for m in re.finditer(r"(?<![\w/])((?:\.\./)+[\w./-]*[\w-])", text)
            if ROOT not in (path.parent / m.group(1)).resolve().parents]


def test_no_reference_to_files_outside_the_repository():
    hits = [f"{p.relative_to(ROOT)}:{i}: {ref}" for p in SOURCES if p.resolve() != SELF
            for i, line in enumerate(p.read_text().splitlines(), 1) for ref in _outside_references(p, line)]
    assert not hits, hits


def test_the_reference_check_catches_a_path_out_of_the_repository():
    doc = ROOT / "docs" / "x.md"
    assert _outside_references(doc, "see ../../elsewhere/notes.txt") == ["../../elsewhere/notes.txt"]
    assert _outside_references(doc, "as behaviour.md and ../README.md say") == []
    assert _outside_references(doc, "https://example.org/a/../b") == []
