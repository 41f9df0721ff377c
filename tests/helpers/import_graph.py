"""The import graph of this repository's packages, from their source, and its cycles.

Every ``import`` and ``from ... import`` counts, at module level or inside a function
(a function-level import is a dependency that only waits to be called), except those
under ``if TYPE_CHECKING:``, which never run. An edge goes to the module named: ``from
a.b import c`` depends on ``a.b.c`` if that is a module, else on ``a.b``. Importing
``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``; those implicit edges are left
out, as import linters do, since every submodule would otherwise close a cycle with a
package ``__init__`` that re-exports it.

    python -m tests.helpers.import_graph impl zerobench    # prints the cycles, if any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """(node, is_type_checking_only) for every import statement in ``tree``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
            yield node


def import_graph(packages: list[str], root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: {modules it imports}}`` over the modules of ``packages`` (top-level
    package names under ``root``, the repository by default); imports of anything else
    are dropped."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((Path(root) / package).rglob("*.py")):
            modules[_module_name(path, Path(root))] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                # ``import a.b.c`` of a non-module attribute path: the longest module prefix.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each a set of
    modules that import each other, directly or not), sorted; empty when acyclic."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # Tarjan; the graphs here are a few dozen modules deep at most
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    """One line per edge inside a cycle: ``a -> b``."""
    members = set(component)
    return "\n".join(f"  {a} -> {b}" for a in component for b in sorted(graph[a] & members))


if __name__ == "__main__":
    packages = sys.argv[1:] or ["impl", "zerobench"]
    g = import_graph(packages)
    found = cycles(g)
    for c in found:
        print(f"cycle ({len(c)} modules):\n{describe(c, g)}")
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports, {len(found)} cycles")
    sys.exit(1 if found else 0)
