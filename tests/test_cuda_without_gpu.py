"""CUDA-side pieces of the harness checked on a machine without a GPU (torch.cuda faked
where a GPU would answer): the caching allocator's columns, the calibration of
``torch.cuda._sleep``, the gloo probe's timeout, and scripts/gpu-check's command line."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


# -- the caching allocator's peaks (worker, schema, compare) ---------------------------


class _FakeAllocator:
    """A device module whose memory_stats answers as torch.cuda's does: a freed
    all-gather output still waiting for compute keeps ``active`` above ``allocated``."""

    STATS = {"allocated_bytes.all.peak": 3 << 20, "active_bytes.all.peak": 7 << 20,
             "reserved_bytes.all.peak": 8 << 20, "num_alloc_retries": 1, "num_ooms": 0}

    def __init__(self):
        self.asked = []

    def memory_stats(self, device=None):
        self.asked.append(device)
        return dict(self.STATS)


def test_allocator_metrics_read_any_device_module():
    from zerobench.schema.columns import METRIC_BY_NAME, allocator_columns

    fake = _FakeAllocator()
    metrics = allocator_columns(fake.memory_stats(torch.device("cuda", 1)))
    assert fake.asked == [torch.device("cuda", 1)]
    assert metrics == {"peak_allocated_bytes": 3 << 20, "peak_active_bytes": 7 << 20,
                       "peak_reserved_bytes": 8 << 20, "num_alloc_retries": 1, "num_ooms": 0}
    assert set(metrics) <= set(METRIC_BY_NAME)  # every column is documented in the schema


def test_timing_pass_on_cuda_records_active_allocated_and_reserved_peaks(monkeypatch):
    """The worker's timing pass with torch.cuda faked: the three peaks are recorded."""
    from zerobench.rank import passes
    from zerobench.rank.session import Session
    from zerobench.rank.worlds import World
    from zerobench.spec.matrix import expand
    from zerobench.spec.workload import parse_workload

    fake = _FakeAllocator()
    monkeypatch.setattr(torch.cuda, "memory_stats", fake.memory_stats)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(passes, "_gpu_telemetry", lambda device: contextlib.nullcontext())

    class CudaWorld(World):  # a rank of a one-rank NCCL world, without the process group
        rank, size, local_rank, backend = 0, 1, 0, "nccl"
        device, module = torch.device("cuda", 0), torch.cuda

        def barrier(self):
            pass

    workload = parse_workload({"data": {"warmup_steps": 1, "steps": 2}, "matrix": {"engine": ["ddp"]}})
    cell = expand(workload)[0]
    session = Session(workload, cell, CudaWorld())
    monkeypatch.setattr(session, "batch", lambda step: (torch.zeros(1), torch.zeros(1)))

    class Engine:
        def train_step(self, inputs, targets, loss):
            return torch.tensor(1.0)

        def extra_metrics(self):
            return {}

    metrics = passes.timing_pass(session, Engine())["metrics"]
    assert metrics["peak_active_bytes"] == 7 << 20
    assert metrics["peak_allocated_bytes"] == 3 << 20
    assert metrics["peak_reserved_bytes"] == 8 << 20
    assert fake.asked == [torch.device("cuda", 0)]


def test_active_peak_is_compared_like_the_allocated_peak():
    from zerobench.analysis.compare.rules import default_rule, resolve_metric
    from zerobench.schema.columns import COLUMN_DTYPES, METRIC_BY_NAME

    active, allocated = METRIC_BY_NAME["peak_active_bytes"], METRIC_BY_NAME["peak_allocated_bytes"]
    assert (active.unit, active.kind, active.better) == (allocated.unit, allocated.kind, allocated.better)
    rule, reference = default_rule(active.name), default_rule(allocated.name)
    assert (rule.rel, rule.abs, rule.k, rule.gates) == (reference.rel, reference.abs, reference.k, reference.gates)
    assert resolve_metric("peak_active", [m for m in METRIC_BY_NAME]) == ["peak_active_bytes"]
    assert COLUMN_DTYPES["peak_active_bytes"] == "Int64"
    columns = (ROOT / "docs" / "running.md").read_text()  # the columns' page (the README links it)
    assert "`peak_active_bytes`" in columns


# -- scripts/gpu-check's Python side -------------------------------------------------------


class _FakeTimedCuda:
    """torch.cuda's events and sleep for cycles_per_ms: each timed sleep takes the next
    of ``ms`` milliseconds."""

    def __init__(self, ms):
        self.ms = list(ms)
        self.slept = []

    def install(self, monkeypatch):
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                self.at = fake.clock

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.at - self.at

        self.clock = 0.0
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "_sleep", self.sleep)

    def sleep(self, cycles):
        self.slept.append(cycles)
        self.clock += self.ms.pop(0)


def test_cycles_per_ms_is_a_trimmed_mean_of_ten_samples(monkeypatch):
    from zerobench.validation import gpu_check

    # 1e6 cycles per ms, except a slow first launch and one sample disturbed each way
    ms_per_sample = [40.0, 10.0, 10.0, 9.0, 10.0, 10.0, 10.0, 12.0, 10.0, 10.0]
    fake = _FakeTimedCuda(ms_per_sample)
    fake.install(monkeypatch)
    rate = gpu_check.cycles_per_ms()
    assert len(fake.slept) == 10 and len(set(fake.slept)) == 1
    cycles = fake.slept[0]
    kept = sorted(cycles / ms for ms in ms_per_sample)[2:8]
    assert rate == pytest.approx(sum(kept) / 6)
    assert rate == pytest.approx(cycles / 10.0)  # the outliers left out
    with pytest.raises(ValueError, match="samples"):
        gpu_check.cycles_per_ms(samples=4, trim=2)


def test_gloo_probe_kills_its_ranks_on_a_timeout(monkeypatch):
    from zerobench.validation import gpu_check

    started = []
    real_popen = subprocess.Popen

    def popen(args, **kwargs):  # a rank that never finishes, as one stuck in a collective
        proc = real_popen([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    begin = time.monotonic()
    try:
        result = gpu_check.probe_gloo(world=2, timeout_s=1.0)
    finally:
        for proc in started:  # whatever happens, no sleeper outlives the test
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert len(started) == 2
    assert not result["pass"] and "timed out" in result["error"]
    assert all(code is not None and code != 0 for code in result["exit_codes"]), result
    assert time.monotonic() - begin < 60  # returned on the timeout, not when the ranks ended


# -- scripts/gpu-check's command line --------------------------------------------------------


def _gpu_check(args, path, tmp_path, env_python=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = path
    if env_python:
        env["PYTHON"] = env_python
    return subprocess.run([str(ROOT / "scripts" / "gpu-check"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def _bin_with(tmp_path, pythons):
    """A PATH folder with the tools the script uses before its first step, and
    ``pythons`` (names linked to this interpreter)."""
    folder = tmp_path / "bin"
    folder.mkdir(parents=True)
    for tool in ("bash", "env", "dirname", "date", "mkdir", "tee", "timeout", "sed", "git", "cat"):
        found = shutil.which(tool)
        if found:
            (folder / tool).symlink_to(found)
    for name in pythons:  # a wrapper, not a link: a link would leave this venv behind
        (folder / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (folder / name).chmod(0o755)
    return str(folder)


def test_gpu_check_rejects_an_unknown_option_without_making_a_folder(tmp_path):
    proc = _gpu_check(["--bogus", "out"], os.environ["PATH"], tmp_path, env_python=sys.executable)
    assert proc.returncode == 2
    assert "unknown option --bogus" in proc.stderr and "usage: scripts/gpu-check [--quick] [--virtual] [--within SECONDS] [OUT_DIR]" in proc.stderr
    assert not (tmp_path / "--bogus").exists() and not (ROOT / "--bogus").exists()
    proc = _gpu_check(["a", "b"], os.environ["PATH"], tmp_path, env_python=sys.executable)
    assert proc.returncode == 2 and "one OUT_DIR at most" in proc.stderr
    for bad in (["--within"], ["--within", "0"], ["--within", "soon", "out"]):
        proc = _gpu_check(bad, os.environ["PATH"], tmp_path, env_python=sys.executable)
        assert proc.returncode == 2 and "--within needs a whole number of seconds >= 1" in proc.stderr, bad
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers without a GPU")
def test_gpu_check_names_a_missing_interpreter_and_falls_back_to_python3(tmp_path):
    out = tmp_path / "out"
    proc = _gpu_check([str(out)], _bin_with(tmp_path / "none", []), tmp_path)
    assert proc.returncode == 2 and "neither python nor python3 is on PATH" in proc.stderr
    assert "no CUDA device" not in proc.stdout + proc.stderr
    proc = _gpu_check([str(out)], _bin_with(tmp_path / "py3", ["python3"]), tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device (python3: " in proc.stdout  # python3 ran the check
    assert "command not found" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers without a GPU")
def test_gpu_check_virtual_needs_no_gpu_and_runs_only_the_virtual_steps(tmp_path):
    # The interpreter runs everything but the checks themselves, which it only logs
    # (what they answer is zerobench.validation.gpu_check's business, tested with it).
    calls = tmp_path / "checks.log"
    python = tmp_path / "python-logging-checks"
    python.write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = zerobench.validation.gpu_check ]; then echo "$*" >> "{calls}"; exit 0; fi
exec "{sys.executable}" "$@"
""")
    python.chmod(0o755)
    out = tmp_path / "out"
    proc = _gpu_check(["--virtual", str(out)], os.environ["PATH"], tmp_path, env_python=str(python))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device" not in proc.stdout
    assert not (tmp_path / "--virtual").exists() and not (ROOT / "--virtual").exists()
    assert calls.read_text().splitlines() == [f"-m zerobench.validation.gpu_check --virtual {name} {out}/{name}.json"
                                              for name in ("overlap", "limiter")]
    summary = (out / "summary.md").read_text()
    steps = [line.split("|")[1].strip() for line in summary.splitlines() if line.startswith("| ")][1:]
    assert steps == ["overlap", "limiter"], summary
    assert "- command: scripts/gpu-check --virtual " in summary and "RESULT: PASS" in summary
    assert json.loads((out / "environment.json").read_text())["device_type"] == "cpu"


def _fake_gpu_python(tmp_path, slow: str = "", gpus: int = 1):
    """An interpreter for scripts/gpu-check on a machine without a GPU: it answers the
    script's environment probe as a machine of ``gpus`` GPUs would, logs every ``-m``
    step it is asked to run (sleeping 30 s in the one naming ``slow``), with the
    CUDA_VISIBLE_DEVICES it was given in ``visible.log``, and runs everything else (the
    summary) with this interpreter."""
    calls = tmp_path / "calls.log"
    python = tmp_path / "python-gpu"
    models = json.dumps({"device_type": "cuda", "gpu_models": ["NVIDIA H200"] * gpus})
    python.write_text(f"""#!/bin/sh
if [ "$1" = - ] && [ "$3" = gpu ]; then cat > /dev/null; echo '{models}' > "$2"; exit 0; fi
if [ "$1" = -m ]; then
    echo "$*" >> "{calls}"
    echo "${{CUDA_VISIBLE_DEVICES-unset}} $*" >> "{tmp_path / 'visible.log'}"
    case "$*" in *"{slow or '@none@'}"*) sleep 30 ;; esac
    exit 0
fi
exec "{sys.executable}" "$@"
""")
    python.chmod(0o755)
    return python, calls


def _steps(out: Path) -> list[dict]:
    summary = json.loads((out / "summary.json").read_text())
    return [{"name": name, **step} for name, step in summary["steps"].items()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the GPU machine's answers")
def test_gpu_check_runs_the_required_steps_first_within_six_minutes_and_the_gloo_steps_last(tmp_path):
    """Issue 33 item 3: required steps first, each with a budget it is cut at (printed),
    their budgets within the 6 minutes; the world-size-1 run profiled; the shared-GPU
    (gloo) steps last and optional; pytest without the two tests that are steps already."""
    python, calls = _fake_gpu_python(tmp_path)
    out = tmp_path / "out"
    proc = _gpu_check([str(out)], os.environ["PATH"], tmp_path, env_python=str(python))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = _steps(out)
    names = [s["name"] for s in steps]
    assert names == ["overlap", "limiter", "pytest", "world1-run", "world1", "predict", "predicted-vs-measured",
                     "gloo-probe", "shared-run", "shared"]
    summary = (out / "summary.md").read_text()
    required = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in summary.splitlines()
                if line.startswith("| ") and "---" not in line and "required" not in line}
    assert [n for n in names if required[n] == "yes"] == names[:5]  # required first
    assert all(required[n] == "no" for n in ("gloo-probe", "shared-run", "shared"))
    assert sum(s["budget_s"] for s in steps if required[s["name"]] == "yes") <= 360 - 10
    assert json.loads((out / "summary.json").read_text())["deadline_s"] == 360
    for s in steps:  # each step's budget is printed as it starts
        assert f"gpu-check: {s['name']} (budget {s['budget_s']} s" in proc.stdout
    logged = calls.read_text().splitlines()
    run = next(c for c in logged if "zerobench.cli run workloads/gpu-check.toml" in c)
    assert "--profile" in run.split() and "--device cuda" in run
    pytest_call = next(c for c in logged if c.startswith("-m pytest"))
    assert "--deselect tests/test_cuda.py::test_prefetch_hides_delayed_all_gathers" in pytest_call
    assert "--deselect tests/test_cuda.py::test_limiter_bounds_peak_memory" in pytest_call
    assert "gpu-check-shared.toml" in logged[-2] and "probe-gloo" in logged[-3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the GPU machine's answers")
def test_gpu_check_quick_runs_only_the_required_steps_with_two_engines(tmp_path):
    from zerobench.spec.matrix import expand
    from zerobench.spec.workload import load_workload

    python, calls = _fake_gpu_python(tmp_path)
    out = tmp_path / "out"
    proc = _gpu_check(["--quick", str(out)], os.environ["PATH"], tmp_path, env_python=str(python))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [s["name"] for s in _steps(out)] == ["overlap", "limiter", "world1-run", "world1"]
    assert json.loads((out / "summary.json").read_text())["deadline_s"] == 180
    run = next(c for c in calls.read_text().splitlines() if "zerobench.cli run" in c).split()
    assert run.count("--cell") == 2 and "--profile" in run
    ids = {c.id for c in expand(load_workload(ROOT / "workloads" / "gpu-check.toml"))}
    assert {run[i + 1] for i, arg in enumerate(run) if arg == "--cell"} <= ids  # cells the workload has
    assert "- command: scripts/gpu-check --quick " in (out / "summary.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the GPU machine's answers")
def test_gpu_check_cuts_a_step_at_the_deadline_and_skips_what_no_longer_fits(tmp_path):
    python, _ = _fake_gpu_python(tmp_path, slow="overlap")
    out = tmp_path / "out"
    begin = time.monotonic()
    proc = _gpu_check(["--within", "14", str(out)], os.environ["PATH"], tmp_path, env_python=str(python))
    assert time.monotonic() - begin < 25  # the 30 s step was cut
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = {s["name"]: s["result"] for s in _steps(out)}
    assert results["overlap"] == "FAIL (cut at its budget)"
    assert all(r == "skipped (no time left)" for name, r in results.items() if name != "overlap"), results
    assert "RESULT: FAIL" in (out / "summary.md").read_text()


def test_gpu_check_pins_its_shared_gpu_steps_to_one_gpu(tmp_path, monkeypatch):
    """Issue 39 defect 7: on a node of several GPUs the shared run put its two ranks on two
    GPUs yet reported "two ranks on one GPU"; both gloo steps now see one GPU only."""
    for visible, pinned in ((None, "0"), ("GPU-8932f937,GPU-77aa0000", "GPU-8932f937"), ("5,6", "5")):
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        folder = tmp_path / (visible or "unset")
        folder.mkdir()
        python, _ = _fake_gpu_python(folder)
        proc = _gpu_check([str(folder / "out")], os.environ["PATH"], folder, env_python=str(python))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        seen = [line.split(" ", 1) for line in (folder / "visible.log").read_text().splitlines()]
        shared = [v for v, call in seen if "probe-gloo" in call or "gpu-check-shared.toml" in call]
        assert shared == [pinned, pinned], seen
        assert {v for v, call in seen if "gpu-check.toml" in call} == {visible or "unset"}  # the others: as given


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers without a GPU")
def test_gpu_check_names_a_commit_only_from_its_own_checkout(tmp_path):
    """Issue 39 defect 8: a plain copy inside another git checkout printed that checkout's commit."""
    def git(*args, cwd):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                       capture_output=True)

    outer = tmp_path / "outer"
    copy = outer / "vendor" / "zerobench"
    for part in ("scripts", "zerobench", "impl"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    (outer / "README").write_text("another project\n")
    git("init", "-q", cwd=outer)
    git("add", "README", cwd=outer)
    git("commit", "-q", "-m", "other", cwd=outer)
    python = tmp_path / "python-logging-checks"
    python.write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = zerobench.validation.gpu_check ]; then exit 0; fi
exec "{sys.executable}" "$@"
""")
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PYTHONPATH")}
    env["PYTHON"] = str(python)

    def summary() -> str:
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        proc = subprocess.run([str(copy / "scripts" / "gpu-check"), "--virtual", str(out)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return (out / "summary.md").read_text()

    assert "- commit: unknown" in summary()
    git("init", "-q", cwd=copy)
    git("add", "scripts", cwd=copy)
    git("commit", "-q", "-m", "own", cwd=copy)
    own = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=copy, capture_output=True, text=True).stdout
    assert f"- commit: {own.strip()}" in summary()


# -- docs ---------------------------------------------------------------------------------


def test_gpu_doc_names_the_pinned_torch():
    import re

    pinned = re.search(r"torch==(\d+\.\d+)", (ROOT / ".ci" / "run").read_text()).group(1)
    named = set(re.findall(r"torch (\d+\.\d+)", (ROOT / "docs" / "gpu.md").read_text()))
    assert named == {pinned}, (named, pinned)


def test_a_gpu_run_of_a_token_model_records_mfu_against_its_cards_peak(monkeypatch):
    """[Note: model FLOPs]: a timing pass on an H100 (faked) of a Llama records
    tflops_per_gpu and mfu against the bf16 peak of the closest preset, 989 TFLOP/s."""
    from zerobench.rank import passes
    from zerobench.rank.session import Session
    from zerobench.rank.worlds import World
    from zerobench.spec.flops import model_flops_per_token
    from zerobench.spec.matrix import expand
    from zerobench.spec.workload import parse_workload

    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(passes, "_gpu_telemetry", lambda device: contextlib.nullcontext())

    class CudaWorld(World):
        rank, size, local_rank, backend = 0, 1, 0, "nccl"
        device, module = torch.device("cuda", 0), torch.cuda

        def barrier(self):
            pass

    workload = parse_workload({"model": {"kind": "llama", "layers": 2, "d_model": 64, "heads": 4, "kv_heads": 2,
                                         "ffn_hidden": 128, "vocab": 100, "seq_len": 32},
                               "data": {"warmup_steps": 0, "steps": 2, "batch_size": 4},
                               "matrix": {"engine": ["ddp"], "dtype": ["bf16"]}})
    session = Session(workload, expand(workload)[0], CudaWorld())
    monkeypatch.setattr(session, "batch", lambda step: (torch.zeros(1), torch.zeros(1)))

    class Engine:
        def train_step(self, inputs, targets, loss):
            return torch.tensor(1.0)

        def extra_metrics(self):
            return {}

    metrics = passes.timing_pass(session, Engine())["metrics"]
    per_gpu = metrics["throughput_tokens_s"]  # one rank
    flops = model_flops_per_token(workload.model)
    assert metrics["tflops_per_gpu"] == pytest.approx(per_gpu * flops / 1e12)
    assert metrics["mfu"] == pytest.approx(per_gpu * flops / 989e12)
