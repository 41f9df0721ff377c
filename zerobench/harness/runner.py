"""Running a workload's matrix: one real torch.distributed world per cell, with progress,
resume, a timeout per cell, and failures recorded instead of stopping the matrix."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from zerobench.choices import not_allowed
from zerobench.harness import active, preflight
from zerobench.harness.launch import code_root, launch_cell
from zerobench.harness.reference import ReferenceFailed, complete_run, loss_deviation, reference_losses
from zerobench.instruments import load
from zerobench.rank import devices
from zerobench.runs.files import new_stamped_dir
from zerobench.runs.folder import DamagedFile, RunFolder, zerobench_version
from zerobench.runs.tables import write_tables
from zerobench.spec.cell import Cell
from zerobench.spec.matrix import expand, matrix_notes
from zerobench.spec.user_check import check_user_model
from zerobench.spec.workload import Workload, WorkloadError, load_workload

FINISHED = ("ok", "skipped")  # statuses --resume does not run again


def new_run_dir(root: Path, workload: Workload) -> Path:
    """Create and return a new run folder ``<root>/<date-time>-<workload>``. The folder is
    made by ``mkdir``, which fails when it exists, so two runs started in the same second
    never share one: the second gets ``-2`` (and so on)."""
    try:
        return new_stamped_dir(root, workload.name)
    except OSError as err:  # PermissionError, a file in the way, a read-only filesystem
        raise RunSetupError(f"--results {root}: cannot create a run folder there: {err.strerror or err}") from None


class RunSetupError(ValueError):
    """The run cannot start (a folder it cannot write, a device this machine lacks);
    nothing was written."""


def prepare_run(workload: Workload, run_dir: Path, cells: list[Cell], device: str,
                meta: dict | None = None) -> None:
    """Write the run folder's workload.json and meta.json (what the ranks read)."""
    folder = RunFolder(run_dir)
    folder.write_workload(workload)
    folder.write_meta(meta or run_metadata(workload, cells, device))


def resumed_metadata(old: dict, workload: Workload, all_cells: list[Cell], cells: list[Cell], device: str) -> dict:
    """meta.json after a ``--resume``: the original run's, its cell list grown by the
    cells run now (never shrunk by ``--cell``), and one more entry under ``resumes``
    saying when, how and with which code it went on."""
    now = run_metadata(workload, cells, device)
    meta = dict(old) if old else dict(now)
    listed = set(meta.get("cells", [])) | {c.id for c in cells}
    meta["cells"] = [c.id for c in all_cells if c.id in listed]
    meta["world_sizes"] = sorted({c.world_size for c in all_cells if c.id in listed})
    meta["resumes"] = [*meta.get("resumes", []), {k: now[k] for k in (
        "date", "command", "working_directory", "code_root", "git_commit", "git_dirty", "zerobench_version",
        "torch_version", "hostname", "concurrent_runs")}]
    return meta


def run_metadata(workload: Workload, cells: list[Cell], device: str) -> dict:
    cuda = devices.device_type(device) == "cuda"
    model = workload.model
    return {
        "workload": workload.name,
        "workload_file": workload.source,
        "description": workload.description,
        "zerobench_version": zerobench_version(),
        "working_directory": str(Path.cwd()),
        "code_root": str(code_root()),  # the zerobench and impl every rank runs (see launch.rank_env)
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "backend": devices.backend(device),
        "world_sizes": sorted({c.world_size for c in cells}),
        "cpu_model": _cpu_model(),
        "cpu_count": _cpu_count(),
        "cpu_flags": cpu_isa_flags(),
        "gpu_model": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "hostname": platform.node(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "cells": [c.id for c in cells],
        "overrides": list(workload.overrides),  # --set KEY=VALUE as given; workload.json holds their result
        "concurrent_runs": active.others(),  # other zerobench runs on this machine: contended timings
        "devices": devices.environment(device),  # versions, CUDA_VISIBLE_DEVICES, NCCL_*, threads
        "context": {
            "workload": workload.name,
            "model": f"{model.kind}(" + ", ".join(f"{k}={v}" for k, v in vars(model).items() if k != "kind") + ")",
            "batch_size": workload.data.batch_size,
            "steps": workload.data.steps,
        },
    }


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: CPU feature flags that change which instructions numeric kernels use (and so how bf16
#: and sometimes fp32 results round). See [Note: losses across machines] in
#: zerobench/analysis/compare/rules.py.
_ISA_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "amx", "vnni", "bf16", "asimd", "sve", "neon")


def cpu_isa_flags() -> list[str]:
    """The processor's instruction-set flags that matter for numerics, sorted (may be empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line.split(":", 1)[1].split()
                return sorted({f for f in flags if f.startswith(_ISA_PREFIXES)})
    except OSError:
        pass
    return []


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# --------------------------------------------------------------------------------------


def run_matrix(workload_path: str | Path, *, results_root: Path = Path("results"), resume: Path | None = None,
               only: list[str] | None = None, profile: bool = False, device: str = "auto",
               prepare_only: bool = False, console: Console | None = None, overrides=()) -> Path:
    """Run every cell of the workload (or the ``only`` ones); return the run folder.
    With ``prepare_only``, write the run folder and list the cells without running them
    (for launching each cell under torchrun yourself). ``overrides``: ``--set KEY=VALUE``
    applied to the workload file ([Note: overrides] in zerobench/spec/workload.py).

    Everything that can be refused is checked before anything is written ([Note: refuse
    early] in zerobench/cli.py)."""
    console = console or Console()
    if resume is not None:
        run_dir = resume
        if not RunFolder(run_dir).workload_path.exists():
            raise FileNotFoundError(f"--resume {run_dir}: not a zerobench run folder (no workload.json)")
        workload = RunFolder(run_dir).workload()
        if not os.access(run_dir, os.W_OK):
            raise RunSetupError(f"--resume {run_dir}: the run folder is not writable")
    else:
        workload = load_workload(workload_path, overrides)
    device_type = devices.device_type(device)
    all_cells = expand(workload, device_type)  # a matrix that is refused is refused before any note
    notes = matrix_notes(workload)
    check_user_model(workload.model, workload.data.batch_size, workload.data.seed,
                     label=workload.label)  # its errors before any folder
    if device_type == "cuda":
        try:
            devices.choose(device, 0, 1)
        except devices.DeviceError as err:
            raise RunSetupError(str(err)) from None
    cells = all_cells
    if only:
        known = [c.id for c in cells]
        unknown = [c for c in only if c not in known]
        if unknown:
            raise ValueError(not_allowed("--cell", unknown[0], known, show=str, what=f"is not a cell of {workload.name}"))
        cells = [c for c in cells if c.id in only]
    for note in notes:
        console.print(Text(f"note: {note}"))
    if resume is not None:
        folder = RunFolder(run_dir)
        try:
            old_meta = folder.meta()
        except DamagedFile as err:
            console.print(Text(f"warning: {err}; meta.json is written anew"), style="yellow")
            old_meta = {}
        todo = [c for c in cells if not finished(folder.read_cell(c.id))]
        meta = resumed_metadata(old_meta, workload, all_cells, cells, device)
        prepare_run(workload, run_dir, cells, device, meta)
    else:
        todo = list(cells)
        run_dir = new_run_dir(results_root, workload)
        meta = run_metadata(workload, cells, device)
        prepare_run(workload, run_dir, cells, device, meta)
    if prepare_only:
        runnable = [c for c in todo if c.skip_reason is None]
        kept = len(cells) - len(todo)
        console.print(Text(f"prepared {run_dir} ({len(cells)} cells"
                           + (f"; {kept} already finished are kept and not listed" if kept else "")
                           + ("); run each under torchrun:" if runnable else "); no cell left to run")))
        for cell in runnable:
            console.print(Text(f"  torchrun --nproc-per-node <G> --nnodes <N> ... -m zerobench.worker "
                               f"--run-dir {run_dir} --cell {cell.id}"), soft_wrap=True)
        console.print(Text(f"then: zerobench reference {run_dir}   (the loss reference and the tables)"),
                      soft_wrap=True)
        return run_dir
    with active.register(run_dir):
        try:
            _run_cells(workload, run_dir, cells, todo, profile, device, device_type, console)
            if RunFolder(run_dir).missing_references():  # cells that ran under torchrun before a --resume
                complete_run(run_dir, log=lambda line: console.print(Text(line)))
        except OSError as err:  # disk full, a folder made read-only: the finished cells stay
            raise CannotWrite(run_dir, err) from None
    return run_dir


class CannotWrite(OSError):
    """The run could not write a file of its folder (a full disk, a read-only folder);
    the cells finished before are kept and ``--resume`` runs the others."""

    def __init__(self, run_dir: Path, err: OSError):
        what = f"{err.filename}: {err.strerror}" if err.filename and err.strerror else str(err)
        super().__init__(f"cannot write {what}. The cells that finished are kept in {run_dir}; make room "
                         f"(or make it writable), then run the others with:\n  zerobench run --resume {run_dir}")
        self.run_dir = run_dir


def finished(record: dict | None) -> bool:
    """Whether ``--resume`` leaves this cell record be: ok or skipped, and (when written by
    ranks under the harness) accepted by a harness that saw the cell through. A rank
    outliving its harness writes no record (zerobench.rank.passes.watch_harness); should one
    have slipped through, it lacks the cell_wall_s the harness adds, and is run again."""
    if record is None or record.get("status") not in FINISHED:
        return False
    return not (record.get("harness_pid") is not None and "cell_wall_s" not in record)


def _run_cells(workload: Workload, run_dir: Path, cells: list[Cell], todo: list[Cell], profile: bool, device: str,
               device_type: str, console: Console) -> None:
    concurrent = active.others()
    if concurrent:
        console.print(Text(f"warning: {active.describe(concurrent)}"), style="bold yellow")
    folder = RunFolder(run_dir)
    references: dict[int, list[float]] = {}
    reference_failures: dict[int, str] = {}
    console.print(f"[bold]{escape(workload.name)}[/]: {len(cells)} cells ({len(cells) - len(todo)} already done) "
                  f"-> {escape(str(run_dir))}")

    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    params = preflight.parameter_count(workload)
    run_started = load.sample()
    try:
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("cells", total=len(todo))
            for i, cell in enumerate(todo, 1):
                progress.update(task, description=escape(f"cell {i}/{len(todo)} {cell.id}"))
                now_concurrent = active.others()
                if now_concurrent and now_concurrent != concurrent:
                    console.print(Text(f"warning: {active.describe(now_concurrent)}"), style="bold yellow")
                concurrent = now_concurrent
                refused = preflight.refusal(workload, cell, device_type, params) if cell.skip_reason is None else None
                ws = cell.world_size
                if (refused is None and cell.skip_reason is None and workload.run.reference
                        and ws not in references and ws not in reference_failures):
                    # in this process, so bounded like a cell; a reference that cannot be had
                    # leaves the cell's deviation unknown, saying why, and the cell runs
                    reference_failures[ws] = preflight.reference_refusal(workload, ws, params)
                    if reference_failures[ws] is None:
                        try:
                            references[ws] = reference_losses(workload, ws, workload.run.timeout_s)
                            folder.write_references(references)
                        except (ReferenceFailed, WorkloadError) as err:  # the user's loss or batch, say
                            reference_failures[ws] = str(err)
                if refused is not None:  # never allocate what cannot fit; the matrix goes on
                    record = {"cell_id": cell.id, "status": "failed", "error": refused, "config": cell.config(),
                              "ranks": []}
                    folder.write_cell(record)
                else:
                    record = run_one(run_dir, workload, cell, profile, device, references.get(ws),
                                     concurrent=concurrent, reference_error=reference_failures.get(ws),
                                     started=load.sample())
                console.print(_one_line(record))
                progress.advance(task)
                write_tables(run_dir)
    except KeyboardInterrupt:
        # launch_cell has killed the ranks of the cell in flight; it left no record, so
        # --resume runs it again. Finished cells are on disk already.
        if folder.has_cells():
            write_tables(run_dir)
            record_machine_load(run_dir, run_started)
        raise Interrupted(run_dir) from None
    write_tables(run_dir)
    record_machine_load(run_dir, run_started)


def record_machine_load(run_dir: Path, started: load.LoadSample) -> None:
    """meta.json's ``machine_load``: what the machine did during the run's cells
    ([Note: machine load] in zerobench/instruments/load.py), from every cell record that has
    it (a resumed run's earlier cells too) and the load averages of this invocation."""
    folder = RunFolder(run_dir)
    try:
        meta = folder.meta()
    except DamagedFile:
        return
    per_cell = [r.get("machine_load") for r in folder.cell_records()]
    folder.write_meta({**meta, "machine_load": load.summarize(per_cell, started, load.sample())})


class Interrupted(Exception):
    """The user stopped a run (Ctrl-C); ``run_dir`` holds what finished and resumes."""

    def __init__(self, run_dir: Path):
        super().__init__(f"interrupted: {run_dir}")
        self.run_dir = run_dir


def cell_counts(run_dir: Path) -> dict[str, int]:
    """How many cells of a run folder ended ok, failed and skipped (from cells/*.json; a
    damaged record counts as failed)."""
    counts = {"ok": 0, "failed": 0, "skipped": 0}
    for record in RunFolder(run_dir).cell_records():
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    return counts


def run_one(run_dir: Path, workload: Workload, cell: Cell, profile: bool, device: str,
            reference: list[float] | None, concurrent: list[dict] = (), reference_error: str | None = None,
            started: load.LoadSample | None = None) -> dict:
    """Run one cell (or record it skipped) and write its record; ``started``: the machine
    as the cell began, so that the record says what else it did meanwhile
    ([Note: machine load])."""
    folder = RunFolder(run_dir)
    folder.discard_cell(cell.id)  # a stale record from an earlier attempt must not pass for this one
    if cell.skip_reason is not None:
        record = {"cell_id": cell.id, "status": "skipped", "error": cell.skip_reason, "config": cell.config(),
                  "ranks": []}
    else:
        result = launch_cell(run_dir, cell.id, cell.world_size, workload.run.timeout_s,
                             threads=workload.run.threads_per_rank, profile=profile, device=device)
        record = folder.read_cell(cell.id) if result.ok else None
        if record is not None:
            record["loss_max_abs_diff_ref"] = loss_deviation(record, reference or [], workload.data.warmup_steps)
            ran = record.get("code_root")
            if ran != str(code_root()):  # one run, one code tree: see launch.rank_env
                record.update(status="failed", error=f"the ranks ran the code in {ran}, not the harness's "
                                                     f"{code_root()}: their results are not this run's")
        else:
            error = result.error or "ranks exited without writing results"
            record = {"cell_id": cell.id, "status": "failed", "error": error, "config": cell.config(), "ranks": []}
        record["cell_wall_s"] = result.wall_s
        if reference_error and cell.skip_reason is None:
            record["reference_error"] = reference_error  # why loss_max_abs_diff_ref is empty
        if concurrent:
            record["concurrent_runs"] = list(concurrent)
        if started is not None:
            record["machine_load"] = load.between(started, load.sample())
    if cell.note and not record.get("note"):
        record["note"] = cell.note  # what the engine ignored here (Engine.notes); the ranks' note says more
    folder.write_cell(record)
    return record


def _one_line(record: dict) -> str:
    cid, status = record["cell_id"], record["status"]
    # Errors and cell ids are plain text: a gloo error such as "[/__w/.../pair.cc:553]"
    # is not rich markup. See [Note: plain text] in zerobench/analysis/summary.py.
    if status == "skipped":
        return f"[yellow]skip[/] {escape(cid)}: {escape(str(record['error']))}"
    if status == "failed":
        first = (record["error"] or "").splitlines()
        return f"[red]FAIL[/] {escape(cid)}: {escape(' | '.join(first[:1] + first[-1:]))}"
    m = [r["metrics"] for r in record["ranks"]]
    step = sorted(x["step_time_s"] for x in m)[len(m) // 2] * 1e3
    peaks = [p for p in (x.get("peak_mem_bytes") for x in m) if p is not None and p == p and p > 0]
    peak_s = f"peak {max(peaks) / 2**20:.1f} MiB" if peaks else "no memory pass"
    dev = record.get("loss_max_abs_diff_ref")
    dev_s = f", loss dev {dev:.1e}" if dev is not None else ""
    note = f"\n     note: {escape(record['note'])}" if record.get("note") else ""
    return (f"[green]ok[/]   {escape(cid)}: {step:.1f} ms/step, {peak_s}{dev_s} "
            f"({record.get('cell_wall_s', 0):.1f} s){note}")
