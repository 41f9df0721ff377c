"""The import graph of impl/ and zerobench/ (module- and function-level imports, read
with ``ast``): it has no cycle, impl.fsdp's hooks and utilities do not depend on its
module class, and zerobench's folders import only the folders below them (FLOORS).

Run ``python -m tests.helpers.import_graph impl zerobench`` to print every cycle.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.helpers.import_graph import cycles, describe, import_graph

# Cycles tolerated while a restructure removes them (issue 14). None is left: a cycle
# added here needs a plan to remove it.
KNOWN_CYCLES: list[list[str]] = []


@pytest.fixture(scope="module")
def graph():
    return import_graph(["impl", "zerobench"])


def _write(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_checker_finds_cycles_through_function_level_and_relative_imports(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from . import b\nA = 1\n",
        "pkg/b.py": "def f():\n    from .c import C\n",
        "pkg/c.py": "import pkg.a\nC = 1\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import E\n",
        "pkg/e.py": "import pkg.d\nimport os\nE = 1\n",
    })
    g = import_graph(["pkg"], root=tmp_path)
    assert g["pkg.a"] == {"pkg.b"} and g["pkg.b"] == {"pkg.c"} and g["pkg.c"] == {"pkg.a"}
    assert g["pkg.d"] == set()  # TYPE_CHECKING-only imports never run
    assert g["pkg.e"] == {"pkg.d"}  # imports outside the packages are dropped
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert "pkg.c -> pkg.a" in describe(cycles(g)[0], g)


def test_no_new_import_cycle(graph):
    new = [c for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert not new, "new import cycles:\n" + "\n".join(describe(c, graph) for c in new)


@pytest.mark.parametrize("package", ["impl.zero", "impl.comm", "impl.fsdp", "zerobench"])
def test_package_is_in_no_cycle(graph, package):
    assert any(m == package or m.startswith(package + ".") for m in graph), f"{package} not found"
    inside = [c for c in cycles(graph) if any(m == package or m.startswith(package + ".") for m in c)]
    assert not inside, "\n".join(describe(c, graph) for c in inside)


def test_whole_graph_is_acyclic(graph):
    found = cycles(graph)
    assert not found, "\n".join(describe(c, graph) for c in found)


def _reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


@pytest.mark.parametrize("module", ["state", "traversal", "runtime", "utils", "state_dict", "optim_state"])
def test_fsdp_hooks_and_utilities_do_not_need_the_module_class(graph, module):
    """They reach FSDP instances through their FSDPState (state.py, traversal.py), so
    fully_sharded.py can import them all without a cycle."""
    assert f"impl.fsdp.{module}" in graph
    assert "impl.fsdp.fully_sharded" not in _reachable(graph, f"impl.fsdp.{module}")


# -- zerobench's floors ---------------------------------------------------------------------

#: What each folder of zerobench/ may import (besides itself, impl and LEAVES). The order
#: is how a cell's data flows, bottom up: the column vocabulary every floor shares (schema,
#: which imports none), the instruments a rank is measured with, the engines, the spec of a
#: cell, run folders (which read their workload.json with spec's parser:
#: RunFolder.workload), the rank, the harness; analysis reads run
#: folders and never runs a cell (so never the rank or the harness: readers run no code,
#: [Note: readers have no side effects]); the what-if tools use everything. cli.py,
#: __main__.py and worker.py sit on top.
FLOORS = {
    "schema": set(),
    "instruments": {"schema"},
    "engines": {"instruments", "schema"},
    "spec": {"engines", "instruments", "schema"},
    "runs": {"spec", "engines", "instruments", "schema"},
    "rank": {"runs", "spec", "engines", "instruments", "schema"},
    "harness": {"rank", "runs", "spec", "engines", "instruments", "schema"},
    "analysis": {"runs", "spec", "engines", "instruments", "schema"},
    "whatif": {"analysis", "harness", "rank", "runs", "spec", "engines", "instruments", "schema"},
    # checks against real hardware: they drive ranks, engines and the virtual GPU
    "validation": {"whatif", "analysis", "harness", "rank", "runs", "spec", "engines", "instruments", "schema"},
    # the command line: one module per subcommand, each calling whichever floor it needs
    "commands": {"validation", "whatif", "analysis", "harness", "rank", "runs", "spec", "engines", "instruments",
                 "schema"},
}
#: Modules anyone may import: atomic writes and the one "did you mean" message (no imports
#: of their own). The column vocabulary is a floor of its own (schema, the lowest).
LEAVES = {"zerobench.runs.files", "zerobench.choices"}
#: Modules that build models from a workload, importing whatever factory it names.
USER_CODE = {"zerobench.spec.models", "zerobench.spec.user_models", "zerobench.spec.data"}


def _floor(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "zerobench" and len(parts) > 1 and parts[1] in FLOORS else None


def floor_violations(graph) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        floor = _floor(module)
        if floor is None:
            continue
        for dep in sorted(deps):
            target = _floor(dep)
            if dep in LEAVES or target == floor or target in FLOORS[floor]:
                continue
            if dep.startswith("zerobench"):
                out.append(f"{module} -> {dep}")
    return out


def test_every_folder_of_zerobench_has_a_floor():
    import zerobench

    folders = {p.name for p in Path(zerobench.__file__).parent.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(FLOORS)


def test_folders_import_only_the_floors_below(graph):
    bad = floor_violations(graph)
    assert not bad, "imports against the floors:\n" + "\n".join(bad)


def test_the_floor_check_catches_an_upward_import():
    graph = {"zerobench.instruments.memory": {"zerobench.spec.checkpointing", "zerobench.schema.columns"},
             "zerobench.analysis.plots": {"zerobench.harness.reference"}, "zerobench.whatif.predict": {"zerobench.rank"}}
    assert floor_violations(graph) == ["zerobench.analysis.plots -> zerobench.harness.reference",
                                       "zerobench.instruments.memory -> zerobench.spec.checkpointing"]


def test_readers_never_reach_user_code(graph):
    """Nothing analysis/ imports, directly or not, builds a model from a workload."""
    for module in (m for m in graph if _floor(m) == "analysis"):
        assert not (_reachable(graph, module) & USER_CODE), module
