"""Micro-benchmarks of the suite's own hot paths (pytest-benchmark).

The project's addopts has ``--benchmark-disable``: in the normal suite each benchmark
runs its function once, as a plain test (all of them together take a few seconds).
``-m "not bench"`` leaves them out. To measure and compare, see docs/ci.md.
"""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "bench: pytest-benchmark micro-benchmark of a hot path (tests/bench)")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/bench/" in item.nodeid.replace("\\", "/") or item.nodeid.startswith("bench/"):
            item.add_marker(pytest.mark.bench)
