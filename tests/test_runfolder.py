"""The run folder: cells run under torchrun become tables on `show`, traces that other
tools read, typed loading, documented columns, and an import graph without cycles."""

import ast
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from zerobench.cli import main
from zerobench.runs.folder import RunFolder
from zerobench.schema.columns import COLUMN_ALIASES, COLUMN_DOCS, METRIC_BY_NAME

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = textwrap.dedent("""
    name = "torchrun"
    [model]
    kind = "mlp"
    depth = 2
    width = 32
    [data]
    batch_size = 8
    warmup_steps = 1
    steps = 2
    [run]
    timeout_s = 120
    memory_pass = false
    [matrix]
    engine = ["ddp"]
    world_size = [2]
""")
CELL = "ddp-ws2-fp32"


def _worker_env(rank: int, world: int, port: int, **extra) -> dict:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """A run prepared with --prepare-only whose cell ran its ranks through the worker's
    entry point, as torchrun starts them: no results.csv, no reference."""
    root = tmp_path_factory.mktemp("torchrun")
    (root / "w.toml").write_text(WORKLOAD)
    assert main(["run", str(root / "w.toml"), "--results", str(root), "--prepare-only"]) == 0
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "zerobench.worker", "--run-dir", str(run_dir), "--cell", CELL,
                               "--profile", "--device", "cpu"], env=_worker_env(r, 2, port), cwd=ROOT)
             for r in range(2)]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    assert not (run_dir / "results.csv").exists()
    return run_dir


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file()}


def test_reading_a_folder_writes_nothing_trains_nothing_imports_nothing(torchrun_run, tmp_path, monkeypatch, capsys):
    """show, plot and compare of a folder whose cells ran under torchrun: the tables come
    from cells/ in memory, the missing reference is named, nothing is trained or written
    (plots/ aside, for plot), and no code the folder names is imported."""
    import shutil

    from zerobench.harness import reference
    from zerobench.spec import user_models

    run = tmp_path / "received"
    shutil.copytree(torchrun_run, run)
    workload = json.loads((run / "workload.json").read_text())
    workload["model"]["factory"] = "os:system"  # a received folder may name anything
    (run / "workload.json").write_text(json.dumps(workload))

    def forbidden(*args, **kwargs):
        raise AssertionError("a reader trained a model or imported code the folder names")

    monkeypatch.setattr(reference, "reference_losses", forbidden)
    monkeypatch.setattr(user_models, "import_entry_point", forbidden)
    before = _files(run)
    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out
    assert "no single-process loss reference" in out and f"zerobench reference {run}" in out
    assert main(["compare", str(run), str(run)]) == 0
    assert _files(run) == before
    assert main(["plot", str(run)]) == 0
    assert {k: v for k, v in _files(run).items() if not k.startswith("plots/")} == before
    results = RunFolder(run).results()
    assert list(results["rank"]) == [0, 1] and results["loss_max_abs_diff_ref"].isna().all()
    assert RunFolder(run).missing_references() == [CELL]


def test_reference_step_computes_the_reference_and_writes_the_tables(torchrun_run, tmp_path):
    import shutil

    run = tmp_path / "mine"
    shutil.copytree(torchrun_run, run)
    assert main(["reference", str(run)]) == 0
    assert (run / "results.csv").exists() and not RunFolder(run).tables_stale()
    folder = RunFolder(run)
    results = folder.results()
    assert list(results["rank"]) == [0, 1] and (results["status"] == "ok").all()
    assert results["loss_max_abs_diff_ref"].notna().all()  # the single-process reference was computed
    assert results["loss_max_abs_diff_ref"].max() < 1e-4
    assert 2 in folder.references() and folder.missing_references() == []
    meta = folder.meta()
    assert meta["zerobench_version"] and Path(meta["working_directory"]) == Path.cwd()
    # Axes and counts read back as plain pandas reads them ([Note: types in results.csv]).
    assert dict(results.dtypes) == dict(pd.read_csv(run / "results.csv").dtypes)
    assert results["gradient_as_bucket_view"].dtype == bool and results["world_size"].dtype == "int64"


def test_plain_read_csv_gives_the_types_zerobench_reads(tmp_path):
    """Booleans and integers with gaps: pandas.read_csv on results.csv, zerobench's load and
    the table built from cells/ in memory agree, column by column ([Note: types in results.csv])."""
    from zerobench.runs.tables import load

    run = tmp_path / "run"
    (run / "cells").mkdir(parents=True)
    metrics = {"step_time_s": 0.01, "peak_mem_bytes": 1000, "comm_calls": 4}
    cells = [("ddp-ws2-fp32", {"engine": "ddp", "gradient_as_bucket_view": True}, "ok"),
             ("impl-fsdp-ws2-fp32", {"engine": "impl-fsdp", "limit_all_gathers": True, "limiter_depth": 2}, "ok"),
             ("impl-fsdp-ws2-fp32-limit_all_gathers=off",
              {"engine": "impl-fsdp", "limit_all_gathers": False, "limiter_depth": 2}, "failed")]
    for cell_id, config, status in cells:
        ranks = [{"rank": r, "metrics": {**metrics, "max_inflight_all_gathers": 2} if "fsdp" in cell_id else metrics,
                  "step_times": [0.01], "losses": [1.0]} for r in range(2)] if status == "ok" else []
        record = {"cell_id": cell_id, "status": status, "config": {"world_size": 2, "dtype": "fp32", **config},
                  "ranks": ranks}
        (run / "cells" / f"{cell_id}.json").write_text(json.dumps(record))
    in_memory = load(run)  # no results.csv yet: built from cells/
    RunFolder(run).write_tables()
    plain = pd.read_csv(run / "results.csv")
    assert dict(load(run).dtypes) == dict(plain.dtypes) == dict(in_memory.dtypes)
    assert plain["limit_all_gathers"].dtype == object and plain["limit_all_gathers"].isna().sum() == 2  # ddp's rows
    assert plain["gradient_as_bucket_view"].dtype == object
    assert plain["comm_calls"].dtype == "float64" and plain["rank"].dtype == "int64"  # a failed cell's gap; none
    text = (run / "results.csv").read_text()
    assert ",4," in text and ",4.0," not in text  # integers stay integers in the file


def test_traces_are_per_cell_with_profiler_steps(torchrun_run):
    folder = RunFolder(torchrun_run)
    assert [(c, r) for c, r, _ in folder.find_traces()] == [(CELL, 0), (CELL, 1)]
    trace = json.loads(__import__("gzip").open(folder.trace_path(CELL, 0), "rt").read())
    assert Path(trace["traceName"]) == folder.trace_path(CELL, 0)  # not a deleted temporary file
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) >= 3  # run.profile_steps defaults to 3
    # zerobench's own analysis reads the per-cell layout
    assert main(["analyze", str(torchrun_run), "--no-plots"]) == 0
    assert RunFolder(torchrun_run).results()["overlap_ratio"].notna().all()


def test_holistic_trace_analysis_reads_one_rank_per_file(torchrun_run):
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis not installed (pip install "
                              "'zerobench[hta]' or HolisticTraceAnalysis --no-deps)")
    analysis = hta.TraceAnalysis(trace_dir=str(RunFolder(torchrun_run).traces_dir / CELL))
    assert sorted(analysis.t.get_ranks()) == [0, 1]


def test_worker_records_errors_for_torchrun(tmp_path):
    error_file = tmp_path / "error.json"
    proc = subprocess.run([sys.executable, "-m", "zerobench.worker", "--run-dir", str(tmp_path / "missing"),
                           "--cell", CELL], env=_worker_env(0, 1, _free_port(), TORCHELASTIC_ERROR_FILE=str(error_file)),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    message = json.loads(error_file.read_text())["message"]
    assert "FileNotFoundError" in json.dumps(message)


def test_every_results_column_is_documented():
    from zerobench.engines import ENGINES
    from zerobench.spec.axes import EMULATION_AXES, engine_axes

    axes = set(EMULATION_AXES) | {a for e in ENGINES for a in engine_axes(e)}
    documented = set(METRIC_BY_NAME) | set(COLUMN_DOCS) | axes | set(COLUMN_ALIASES)  # old names read as new
    for csv in sorted((ROOT / "results").glob("**/results.csv")):
        undocumented = set(pd.read_csv(csv, nrows=1).columns) - documented
        assert not undocumented, f"{csv}: {sorted(undocumented)}"


def test_schema_imports_no_pandas_or_analyses():
    code = "import sys, zerobench.schema.columns; print(sorted(m for m in sys.modules if m == 'pandas' or m.startswith('zerobench.')))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['zerobench.schema', 'zerobench.schema.columns']"  # the package's __init__ holds no code


def _imports(package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (anywhere in the file)."""
    graph = {}
    paths = sorted((ROOT / package).rglob("*.py"))
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in paths}
    for path in paths:
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if parts[-1] == "__init__" else name.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                # `from pkg import sub` depends on pkg.sub, not on pkg's __init__, when sub is a module
                subs = {f"{base}.{a.name}" for a in node.names}
                deps |= subs if subs & modules else {base}
        graph[name] = {d for d in deps if d.split(".")[0] == package}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, stack + [dep])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_zerobench_has_no_import_cycle():
    graph = _imports("zerobench")
    assert graph["zerobench.runs.folder"] and graph["zerobench.cli"]  # the walk sees imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cli_never_swallows_an_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "zerobench.analysis.compare.gate", None)  # as a broken module would
    baseline = str(ROOT / "results" / "baselines" / "cpu-quickstart")
    with pytest.raises(ImportError):  # not exit 2, "bad input"
        main(["compare", baseline, baseline])
