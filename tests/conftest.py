"""Test-suite wiring: the repository root on ``sys.path``, the options of the optional
plugins, and the ``world_size`` mark.

``@pytest.mark.world_size(2, 4)`` runs a test once per world size, as DeepSpeed's
``DistributedTest`` does with its ``world_size`` attribute: the test takes a
``world_size`` argument and hands it to ``zerobench.harness.testing.run_ranks``. The test ids
read ``ws2``, ``ws4``, so ``pytest -k ws4`` selects the larger worlds.
"""

from __future__ import annotations

import os
import sys

import pytest

# The repository root, so that ``tests.helpers`` imports whether or not the project is
# installed and whatever PYTHONPATH says (impl/ and zerobench/ are found the same way).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


#: Per-test time limit (pytest-timeout) when neither --timeout nor PYTEST_TIMEOUT gives one.
TEST_TIMEOUT_S = 300.0


# [Note: optional plugins]
# pytest-benchmark and pytest-timeout are in the `test` extra, but a machine that installs
# with `pip install --no-deps -e .` (scripts/gpu-check on a GPU node) may lack them. Their
# options therefore live here, set only when the plugin is loaded, and not in pyproject's
# addopts / ini (an unknown `--benchmark-disable` there stops pytest before it collects
# anything). Without pytest-benchmark, tests/bench/ is skipped (tests/bench/conftest.py).
@pytest.hookimpl(tryfirst=True)  # before the plugins' own pytest_configure reads them
def pytest_configure(config):
    if config.pluginmanager.hasplugin("benchmark"):
        # Each benchmark runs once, as a plain test; --benchmark-enable still measures.
        config.option.benchmark_disable = True
    if (config.pluginmanager.hasplugin("timeout") and config.getoption("timeout", None) is None
            and not os.environ.get("PYTEST_TIMEOUT")):
        config.option.timeout = TEST_TIMEOUT_S
    config.addinivalue_line(
        "markers", "world_size(*sizes): run the test once per world size, passed as its `world_size` argument"
    )


def pytest_generate_tests(metafunc):
    mark = metafunc.definition.get_closest_marker("world_size")
    if mark is None:
        return
    sizes = mark.args
    if not sizes or not all(isinstance(n, int) and n >= 1 for n in sizes):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: world_size mark needs ints >= 1, got {sizes!r}")
    if "world_size" not in metafunc.fixturenames:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: a world_size-marked test must take a `world_size` argument")
    metafunc.parametrize("world_size", sizes, ids=[f"ws{n}" for n in sizes])
