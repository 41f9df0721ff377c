"""`pytest` works with and without the optional plugins (pytest-benchmark, pytest-timeout):
a GPU node installs with ``pip install --no-deps -e .`` and may lack them. See
[Note: optional plugins] in tests/conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = "tests/bench/test_bench_zero.py::test_sorted_greedy_partition"


def _pytest(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_TIMEOUT" and k != "PYTEST_ADDOPTS"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def test_pytest_runs_without_the_benchmark_and_timeout_plugins():
    proc = _pytest("-p", "no:benchmark", "-p", "no:timeout", "-rs", BENCH)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 skipped" in proc.stdout and "pytest-benchmark is not installed" in proc.stdout
    assert "Unknown config option" not in proc.stdout + proc.stderr


def test_with_the_plugins_benchmarks_run_once_and_tests_have_a_timeout():
    proc = _pytest(BENCH)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout
    assert "timeout: 300.0s" in proc.stdout  # pytest-timeout's header line
    assert "Legend:" not in proc.stdout  # --benchmark-disable: no table of measurements


BURN = """
import time, pytest

def _burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_quick():
    pass

def test_heavy():
    _burn(0.6)

@pytest.mark.slow
def test_heavy_but_slow():
    _burn(0.6)
"""


def test_a_fast_test_over_its_cpu_budget_is_reported_and_fails_in_strict_mode(tmp_path):
    """[Note: test budgets] in tests/conftest.py: the budget is CPU time; a test marked
    slow has none."""
    (tmp_path / "test_burn.py").write_text(BURN)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "ZEROBENCH_FAST_TEST_CPU_S": "0.3"}
    env.pop("ZEROBENCH_TEST_BUDGETS", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-c", os.devnull,
           "--rootdir", str(tmp_path), str(tmp_path / "test_burn.py")]
    relaxed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert relaxed.returncode == 0, relaxed.stdout[-2000:]
    report = relaxed.stdout.split("fast tests over their budget", 1)[1]
    assert "test_burn.py::test_heavy " in report and "test_quick" not in report and "but_slow" not in report
    strict = subprocess.run(cmd, env={**env, "ZEROBENCH_TEST_BUDGETS": "strict"}, capture_output=True, text=True,
                            timeout=120)
    assert strict.returncode == 1 and "3 passed" in strict.stdout
