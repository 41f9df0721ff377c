"""The per-rank entry point: run one cell of a workload on this rank.

It reads the standard torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the same command runs under
``zerobench run`` (which starts the ranks of each cell on this machine) and under
``torchrun`` across nodes::

    torchrun --nnodes 2 --nproc-per-node 8 -m zerobench.worker \\
        --run-dir results/my-run --cell impl-fsdp-ws16-bf16

(``zerobench run --prepare-only`` makes the run folder; ``zerobench cells WORKLOAD``
lists the cell ids.) Rank 0 gathers every rank's measurements and writes
``cells/<cell>.json``; traces are written by each rank to ``traces/<cell>/rank<r>.json.gz``.
``zerobench show``, ``plot`` and ``compare`` then build the run's tables from ``cells/``
(with the single-process loss reference) when no ``zerobench run`` did.

A cell runs up to three passes, in this order, so that measuring never distorts
what is measured:
  1. timing: warm-up, then the measured steps, each timed on its own;
  2. profiling (``--profile``): a few more steps under torch.profiler;
  3. memory: a fresh model and engine built under the storage tracker, which slows
     steps 1.5-2x; it yields the peak, its composition and the bytes communicated.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing import errors as elastic_errors

from zerobench.engines.base import BF16_LOSS_NOTE, ran_record, row_note
from zerobench.instruments.memory import StorageTracker, measure_exact_step
from zerobench.rank import devices
from zerobench.rank.protocol import HARNESS_ENV, code_root, torchrun_env
from zerobench.rank.session import Session
from zerobench.rank.worlds import TorchrunWorld
from zerobench.runs.files import write_atomic
from zerobench.runs.folder import RunFolder
from zerobench.schema.columns import peak_columns
from zerobench.schema.records import CellRecord, RankRecord
from zerobench.spec.cell import Cell
from zerobench.spec.matrix import expand, find_cell
from zerobench.spec.models import samples_to_tokens

TIMELINE_POINTS = 400  # rows kept of each rank's memory timeline


def watch_harness() -> int | None:
    """Under ``zerobench run`` (HARNESS_ENV set): make this rank die with the harness.

    On Linux the kernel sends SIGKILL when the parent exits (PR_SET_PDEATHSIG); elsewhere
    a daemon thread notices the parent pid change within a second. A rank whose harness
    is already gone exits at once. Returns the harness pid (None under torchrun)."""
    value = os.environ.get(HARNESS_ENV)
    if not value:
        return None
    harness = int(value)
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if not harness_alive(harness):
        os._exit(3)

    def watch():
        while harness_alive(harness):
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="zerobench-harness-watch", daemon=True).start()
    return harness


def harness_alive(harness: int | None) -> bool:
    """Whether this rank's harness still runs (always True under torchrun): it is the
    parent until it dies, when the rank is re-parented."""
    return harness is None or os.getppid() == harness


def pick_device(requested: str, local_rank: int, local_world: int) -> torch.device:
    """The rank's device; zerobench.rank.devices decides (and raises rather than falling back)."""
    return devices.choose(requested, local_rank, local_world).device


# --------------------------------------------------------------------------------------


# The passes are functions of the rank session (zerobench/rank/session.py, [Note: the rank
# session]), which builds and steps the cell's engine for every tool: what is the worker's
# own is only which passes run, in which order, and what each measures.


def timing_pass(session: Session, engine) -> dict:
    """Pass 1: warm-up, then the measured steps, each timed on its own."""
    world, ctx, d = session.world, session.ctx, session.workload.data
    session.warm_up(engine, d.warmup_steps)
    engine.extra_metrics()  # discard what warm-up accumulated
    world.reset_peak_memory_stats()
    telemetry = _gpu_telemetry(ctx.device)
    times, losses = [], []
    world.barrier()
    with telemetry:
        for step in range(d.warmup_steps, d.warmup_steps + d.steps):
            result = session.measured_step(engine, step)
            times.append(result.seconds)
            losses.append(float(result.loss))
            loss_dtype = str(result.loss.dtype).removeprefix("torch.")
    metrics = _time_metrics(times, ctx.world_size * d.batch_size, samples_to_tokens(session.workload.model))
    metrics.update(engine.extra_metrics())
    metrics.update(telemetry.summary() if hasattr(telemetry, "summary") else {})
    telemetry_note = getattr(telemetry, "note", None)
    metrics.update(session.allocator_metrics())
    if ctx.device.type == "cuda":
        metrics.update(_mfu(session.workload, session.cell.dtype, metrics, ctx))
    metrics["loss_first"], metrics["loss_last"] = losses[0], losses[-1]
    record = {"metrics": metrics, "step_times": times, "losses": losses, "loss_dtype": loss_dtype}
    if telemetry_note:  # why GPU columns are absent: never without a word ([Note: which GPU NVML reads])
        record["telemetry_note"] = telemetry_note
        print(f"note: {telemetry_note}", file=sys.stderr)  # in the rank's log too
    return record


def profile_pass(session: Session, engine, trace_path: Path) -> None:
    """Pass 2 (``--profile``): a few more steps under torch.profiler, written to ``trace_path``."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    activities = [ProfilerActivity.CPU]
    if session.ctx.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    d = session.workload.data
    first = d.warmup_steps + d.steps
    batches = [session.batch(first + i) for i in range(session.workload.run.profile_steps)]
    session.world.barrier()
    # A schedule makes prof.step() label each step ProfilerStep#N (all of them traced).
    with profile(activities=activities, record_shapes=True,
                 schedule=schedule(wait=0, warmup=0, active=len(batches), repeat=1)) as prof:
        for inputs, targets in batches:
            with record_function("zerobench::step"):
                engine.train_step(inputs, targets, session.loss)
                session.world.synchronize()
            prof.step()  # marks ProfilerStep#N, the step boundaries trace tools (HTA) read
    _export_trace(prof, trace_path)


def memory_pass(session: Session) -> dict:
    """Pass 3: a fresh engine under the storage tracker: the peak, its composition and the
    bytes communicated, and the memory timeline."""
    world = session.world
    if session.ctx.device.type == "cuda":  # nothing of the timing pass is counted here
        torch.cuda.synchronize(session.ctx.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(session.ctx.device)
    warmup = session.workload.run.memory_warmup_steps
    with session.tracker() as tracker:
        engine = session.build()
        session.warm_up(engine, warmup)

        def step(attempt: int, engine=engine):
            world.barrier()
            return session.measured_step(engine, warmup + attempt, tracker)

        # the step again until every rank's peak is exact: [Note: frees on other threads]
        _, steps = measure_exact_step(tracker, step, world.all_true)
        world.barrier()
        steady = _settled_bytes(tracker)
    metrics = {
        **peak_columns(tracker.peak_bytes, tracker.peak_breakdown()),
        **{f"peak_mem_other_{part}_bytes": n for part, n in tracker.peak_other_breakdown().items()},
        "steady_mem_bytes": steady,
        "memory_steps": steps,
        **tracker.comm.columns(),
    }
    timeline = tracker.timeline()
    if len(timeline) > TIMELINE_POINTS:
        timeline = timeline.iloc[:: len(timeline) // TIMELINE_POINTS + 1]
    del engine, step
    gc.collect()
    return {"metrics": metrics, "timeline": timeline.to_dict(orient="list"), "phases": tracker.phases()}


def _export_trace(prof, trace_path: Path) -> None:
    """Write the profile as gzipped Chrome trace JSON, atomically. The trace's
    ``traceName`` (which torch sets to the file it exported to) names the final path,
    not the temporary file."""
    import gzip

    trace_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = trace_path.with_name(f".{trace_path.name}.{os.getpid()}.json")
    try:
        prof.export_chrome_trace(str(tmp))
        trace = json.loads(tmp.read_text())
    finally:
        tmp.unlink(missing_ok=True)
    trace["traceName"] = str(trace_path)
    write_atomic(trace_path, lambda f: f.write(gzip.compress(json.dumps(trace).encode())), mode="wb")


def _settled_bytes(tracker: StorageTracker, quiet_s: float = 0.03, limit_s: float = 1.0) -> int:
    """Live bytes once nothing has been freed or allocated for ``quiet_s``.

    A collective's buffers are released by the gloo worker thread that ran it, a moment
    after ``wait()`` has returned on the main thread; reading the total at once would
    count them or not depending on scheduling (seen: 7.5 MiB either way for impl-zero2's
    last all-gather)."""
    deadline = time.monotonic() + limit_s
    last, since = tracker.current_bytes, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.005)
        now = tracker.current_bytes
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def _time_metrics(times: list[float], global_batch: int, tokens_per_sample: int) -> dict:
    ordered = sorted(times)

    def pct(q):
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    median = statistics.median(times)
    return {
        "step_time_s": median,
        "step_time_p10_s": pct(0.10),
        "step_time_p90_s": pct(0.90),
        "step_time_mad_s": statistics.median(abs(t - median) for t in times),
        "throughput_samples_s": global_batch / median,
        "throughput_tokens_s": global_batch * tokens_per_sample / median if tokens_per_sample else None,
    }


def _mfu(w, dtype: str, metrics: dict, ctx) -> dict:
    """tflops_per_gpu and mfu of a GPU run ([Note: model FLOPs] in zerobench/spec/flops.py),
    against the dense peak of the closest preset to this device."""
    from zerobench.instruments.vgpu.presets import gpu_preset, preset_for_device
    from zerobench.spec.flops import mfu_metrics, model_flops_per_token

    tokens = metrics.get("throughput_tokens_s")
    flops = model_flops_per_token(w.model)
    if not tokens or not flops:  # a model without token FLOPs (an MLP, a user's model)
        return {}
    peak = gpu_preset(preset_for_device(torch.cuda.get_device_name(ctx.device))).peak(
        torch.bfloat16 if dtype == "bf16" else torch.float32)
    return mfu_metrics(tokens / ctx.world_size, flops, peak)


def _gpu_telemetry(device: torch.device):
    """NVML sampling during the timing pass where a GPU is present; a no-op otherwise."""
    import contextlib

    if device.type != "cuda":
        return contextlib.nullcontext()
    try:
        from zerobench.instruments.telemetry import GpuTelemetry
    except ImportError:
        return contextlib.nullcontext()
    return GpuTelemetry(device)


def _rss_max_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------------------


def run_cell(run_dir: Path, cell_id: str, profile: bool, device: str, harness: int | None = None) -> None:
    env = torchrun_env()
    folder = RunFolder(run_dir)
    workload = folder.workload()
    # the cell as it runs on this rank's device: its notes say what the engine ignores there
    cell = find_cell(workload, cell_id, devices.device_type(device))
    if cell is None:
        cells = ", ".join(c.id for c in expand(workload))
        raise SystemExit(f"zerobench.worker: no cell {cell_id!r} in {run_dir} (cells: {cells})")
    if cell.world_size != env.world_size:
        raise SystemExit(f"zerobench.worker: cell {cell_id} needs WORLD_SIZE={cell.world_size}, got {env.world_size}")

    with TorchrunWorld(device, workload.run.threads_per_rank) as world:
        rank = world.rank
        _set_emulation(cell)
        started = time.perf_counter()
        session = Session(workload, cell, world)
        engine = session.build()
        ran = ran_record(engine)
        rank_record = timing_pass(session, engine)
        loss_dtype = rank_record.pop("loss_dtype")  # this rank's; rank 0's goes in the note
        if ran:
            rank_record["ran"] = ran  # See [Note: say what ran] (zerobench/engines/base.py)
        if profile:
            profile_pass(session, engine, folder.trace_path(cell_id, rank))
        del engine
        gc.collect()
        if workload.run.memory_pass:
            mem = memory_pass(session)
            rank_record["metrics"].update(mem["metrics"])
            rank_record["timeline"] = mem["timeline"]
            rank_record["phases"] = mem["phases"]  # where memory_timeline.png marks forward, backward, optimizer
        rank_record["metrics"]["rss_max_bytes"] = _rss_max_bytes()
        rank_record["rank"] = rank
        rank_record["pass_wall_s"] = time.perf_counter() - started
        # checked here, on the rank that measured it (a RecordError names the field)
        gathered = world.gather_object(RankRecord.from_json(rank_record).to_json())
        if rank == 0 and harness_alive(harness):  # an orphan's record is no result: see watch_harness
            diverged = divergence(gathered)
            ran = gathered[0].get("ran") or {}
            folder.write_cell(CellRecord(
                cell_id=cell_id, status="failed" if diverged else "ok", error=diverged, config=cell.config(),
                backend=world.backend, device=world.device.type, code_root=str(code_root()), ranks=gathered,
                # accepted by the harness, which adds cell_wall_s, or rerun by --resume
                harness_pid=harness, ran=ran or None,
                # what the engine ignored here (Engine.notes), and what it ran instead (Engine.ran)
                note=row_note(cell.note, ran, BF16_LOSS_NOTE if loss_dtype == "bfloat16" else None)))


def divergence(ranks: list[dict]) -> str | None:
    """Why a cell's training diverged (a loss that is NaN or infinite), None if it did not."""
    for r in ranks:
        for step, loss in enumerate(r["losses"]):
            if not math.isfinite(loss):
                return (f"diverged: rank {r['rank']}'s loss is {loss} at measured step {step} "
                        "(timings and memory are recorded, but they are not of a training run)")
    return None


def _set_emulation(cell: Cell) -> None:
    from zerobench.instruments import emulation

    link = emulation.cell_link(cell.opts)
    if link is not None:
        emulation.install(link)


@elastic_errors.record  # under torchrun: the error goes to its error file, which its failure summary names
def _run_cell_recorded(args: argparse.Namespace, harness: int | None) -> None:
    run_cell(args.run_dir, args.cell, args.profile, args.device, harness)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zerobench.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run folder made by `zerobench run`")
    parser.add_argument("--cell", required=True, help="cell id (see `zerobench cells WORKLOAD`)")
    parser.add_argument("--profile", action="store_true", help="also record a torch.profiler trace per rank")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)
    harness = watch_harness()
    # A crash in C++ (abort, segfault) then leaves every thread's Python stack in the log.
    faulthandler.enable(all_threads=True)
    try:
        _run_cell_recorded(args, harness)
    except Exception:
        traceback.print_exc()
        code = 1  # peers may be blocked in a collective with this rank: exit hard, at once
    else:
        code = 0
    # [Note: exiting without teardown]
    # Everything this rank had to say is on disk (written atomically) or gathered by
    # rank 0 by now. Interpreter teardown after gloo and the profiler have run
    # occasionally aborts in C++ ("terminate called without an active exception":
    # a thread object destroyed while still joinable), seen here about once in 30 cells.
    # Skipping it keeps a finished cell from being recorded as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
