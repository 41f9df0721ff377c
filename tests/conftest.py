"""Test-suite wiring: the repository root on ``sys.path`` and the ``world_size`` mark.

``@pytest.mark.world_size(2, 4)`` runs a test once per world size, as DeepSpeed's
``DistributedTest`` does with its ``world_size`` attribute: the test takes a
``world_size`` argument and hands it to ``zerobench.testing.run_ranks``. The test ids
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


def pytest_configure(config):
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
