"""References that cannot go stale: every ``behaviour.md §X`` a docstring or doc cites
names a section of docs/behaviour.md; every ``[Note: X]`` cited is defined, and defined
once; every file path the docs and the code's comments name exists; and nothing points
at files outside the repository."""

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


# -- [Note: X] blocks: defined once, every citation defined --------------------------------

#: Where notes are defined and cited: the code, its tests and scripts, and the docs.
NOTE_SOURCES = sorted({*ROOT.glob("impl/**/*.py"), *ROOT.glob("zerobench/**/*.py"), *ROOT.glob("tests/**/*.py"),
                       *(p for p in ROOT.glob("scripts/*") if p.is_file()), *ROOT.glob(".ci/*"),
                       *ROOT.glob("docs/**/*.md"), ROOT / "README.md"})
#: A definition: a line that is the note's name alone, in a comment or opening a docstring.
_NOTE_DEFINITION = re.compile(r'^\s*(?:#:?\s*|[rbu]?"""\s*)?\[Note: ([^\]\n]+)\]\s*$')
#: The break of a citation over lines, with the next line's indentation and comment mark.
_LINE_BREAK = re.compile(r"\s*\n\s*(?:#:?|//)?\s*")


def notes(text: str) -> tuple[list[str], list[str]]:
    """(names defined, names cited) in ``text``: a definition is a line holding only
    ``[Note: name]``; any other ``[Note: name]``, also one broken over two lines, cites it."""
    lines = text.splitlines()
    defined = [m.group(1).strip() for line in lines if (m := _NOTE_DEFINITION.match(line))]
    body = "\n".join("" if _NOTE_DEFINITION.match(line) else line for line in lines)
    cited = [" ".join(m.group(1).split()) for m in re.finditer(r"\[Note:\s+([^\]]+?)\]", _LINE_BREAK.sub(" ", body))]
    return defined, cited


def _all_notes() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    defined: dict[str, list[str]] = {}
    cited: dict[str, list[str]] = {}
    for path in NOTE_SOURCES:
        if path.resolve() == SELF:
            continue
        names, refs = notes(path.read_text(errors="replace"))
        for name in names:
            defined.setdefault(name, []).append(str(path.relative_to(ROOT)))
        for name in refs:
            cited.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return defined, cited


def test_every_note_is_defined_once_and_every_cited_note_is_defined():
    defined, cited = _all_notes()
    assert len(defined) >= 50 and sum(map(len, cited.values())) >= 200  # the code does use them
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert not twice, f"notes defined more than once: {twice}"
    undefined = {name: sorted(set(where)) for name, where in cited.items() if name not in defined}
    assert not undefined, f"notes cited and defined nowhere: {undefined}"


def test_the_note_check_reads_definitions_and_citations_broken_over_lines():
    text = ('"""[Note: a]\nwhy a\n"""\n# [Note: b]\n#: see [Note: a] and [Note:\n#: b], and\n'
            "    # [Note: c\n    # d] in x.py\n")
    assert notes(text) == (["a", "b"], ["a", "b", "c d"])
    assert notes("x = 1  # [Note: e]\n") == ([], ["e"])  # a citation at the end of a code line


# -- file paths named in the docs and in code comments exist -------------------------------

#: The repository's top-level folders: a path starting with one of them is this repository's.
TOP_FOLDERS = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (not p.name.startswith(".") or p.name == ".ci")
                     and p.name not in ("build", "dist") and not p.name.endswith(".egg-info"))
#: results/ holds run outputs (results/ci/run, results/tmp, ...): only what .gitignore keeps is
#: in the repository, and a path there must exist.
COMMITTED_RESULTS = [line[1:].strip().rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
                     if line.startswith("!results/")]
_PATH = re.compile(r"(?<![\w./<{$~-])((?:" + "|".join(map(re.escape, TOP_FOLDERS)) + r")/(?:[\w./+*-]*[\w*])?)")
#: A bare file name of Python code (``rules.py``): it must be one of this repository's; another
#: project's file is named with its path there (torch/distributed/fsdp/_flat_param.py).
_BARE_PY = re.compile(r"(?<![\w./-])([A-Za-z_]\w*\.py)\b(?![/\w])")


def named_paths(text: str) -> list[str]:
    """The repository paths (``zerobench/runs/folder.py``, ``docs/``, ``tests/test_x*.py``) in ``text``."""
    return [m.group(1).rstrip("/.") for m in _PATH.finditer(text)]


def missing_path(path: str, root: Path = ROOT) -> bool:
    """Whether a path named in the docs or a comment names nothing in the repository (a
    glob matching nothing counts; an output under results/ outside its committed folders does not)."""
    if path.startswith("results/") and not any(path == kept or path.startswith(kept + "/")
                                               for kept in COMMITTED_RESULTS):
        return False
    if "*" in path:
        return not list(root.glob(path))
    return not (root / path).exists()


def _comments_and_docstrings(path: Path) -> str:
    """The comments and docstrings of a Python file (its code and other strings are data)."""
    import ast
    import io
    import tokenize

    source = path.read_text()
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            parts.append(node.value.value)
    return "\n".join(parts)


def _shell_comments(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.lstrip().startswith("#"))


def _path_sources() -> list[tuple[Path, str]]:
    sources = [(p, p.read_text()) for p in sorted({*ROOT.glob("docs/**/*.md"), ROOT / "README.md",
                                                   *ROOT.glob("results/**/README.md")})]
    for p in sorted({*ROOT.glob("impl/**/*.py"), *ROOT.glob("zerobench/**/*.py"), *ROOT.glob("tests/**/*.py"),
                     *ROOT.glob("scripts/*.py")}):
        if p.resolve() != SELF:
            sources.append((p, _comments_and_docstrings(p)))
    for p in sorted({*ROOT.glob(".ci/*"), *(p for p in ROOT.glob("scripts/*") if p.suffix == "")}):
        sources.append((p, _shell_comments(p)))
    return sources


#: Files README.md tells the reader to create.
MADE_BY_THE_READER = {"workloads/limiter.toml"}


def test_every_file_path_named_in_the_docs_and_in_comments_exists():
    python_files = {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    missing = []
    for path, text in _path_sources():
        where = str(path.relative_to(ROOT))
        missing += [f"{where}: {p}" for p in named_paths(text) if missing_path(p) and p not in MADE_BY_THE_READER]
        if where.startswith(("zerobench/", "impl/")):
            missing += [f"{where}: {name}" for name in _BARE_PY.findall(text) if name not in python_files]
    assert not missing, "paths that name nothing in the repository:\n" + "\n".join(missing)


def test_the_path_check_finds_repository_paths_and_tells_outputs_apart(tmp_path):
    text = ("see zerobench/runs/folder.py, docs/ and tests/test_x*.py; results/ci/run/ is an output; "
            "torch/distributed/fsdp/_flat_param.py is torch's; results/<run-id>/cells")
    assert named_paths(text) == ["zerobench/runs/folder.py", "docs", "tests/test_x*.py", "results/ci/run", "results"]
    assert not missing_path("zerobench/runs/folder.py") and missing_path("zerobench/runs/compare_rules.py")
    assert not missing_path("tests/test_docs_*.py") and missing_path("tests/test_predict_gate*.py")
    assert not missing_path("results/ci/run") and missing_path("results/baselines/nothing-here")
    assert _BARE_PY.findall("in compare_rules.py and zerobench/x.py (rules.py)") == ["compare_rules.py", "rules.py"]


def _layout_entries() -> dict[str, str]:
    """zerobench's folder -> its entry in docs/layout.md's tree (the top folder's own
    lines under ``zerobench``), with ``zerobench`` itself for its top-level modules."""
    import re

    tree = (ROOT / "docs" / "layout.md").read_text().split("```")[1]
    block = tree.split("\nzerobench/", 1)[1].split("\nworkloads/", 1)[0]
    entries, name = {"zerobench": ""}, "zerobench"
    for line in block.splitlines():
        m = re.match(r"^  (\S+?)/?\s", line)
        if m and not line.startswith("   "):
            name = m.group(1).rstrip("/") if line.split()[0].endswith("/") else "zerobench"
        entries[name] = entries.get(name, "") + " " + line
    return entries


def test_the_layout_names_every_module_in_its_folders_entry():
    """docs/layout.md says what every module of zerobench/ is for, in the entry of the
    folder it is in (a subfolder's, such as vgpu/, inside its top folder's)."""
    import re

    entries = _layout_entries()
    missing = []
    for path in sorted((ROOT / "zerobench").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        parts = path.relative_to(ROOT / "zerobench").parts
        folder = parts[0] if len(parts) > 1 else "zerobench"
        if not re.search(rf"\b{re.escape(path.stem)}\b", entries.get(folder, "")):
            missing.append(f"zerobench/{'/'.join(parts)} (not in the entry of {folder})")
    assert not missing, "modules docs/layout.md does not name:\n" + "\n".join(missing)
