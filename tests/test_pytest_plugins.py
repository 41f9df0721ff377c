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
