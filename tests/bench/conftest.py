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


@pytest.fixture(autouse=True)
def _one_compute_thread():
    """One intra-op thread while a benchmark runs: on a shared 2-core machine extra
    OpenMP threads only add noise. Restored afterwards for the rest of the session."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
