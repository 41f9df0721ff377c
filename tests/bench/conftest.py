"""Micro-benchmarks of the suite's own hot paths (pytest-benchmark).

tests/conftest.py turns on ``--benchmark-disable``: in the normal suite each benchmark
runs its function once, as a plain test (all of them together take a few seconds).
``-m "not bench"`` leaves them out. To measure and compare, see docs/ci.md. Without
pytest-benchmark installed they are skipped ([Note: optional plugins] in tests/conftest.py).
"""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "bench: pytest-benchmark micro-benchmark of a hot path (tests/bench)")


def pytest_collection_modifyitems(config, items):
    no_plugin = not config.pluginmanager.hasplugin("benchmark")
    for item in items:
        if "tests/bench/" in item.nodeid.replace("\\", "/") or item.nodeid.startswith("bench/"):
            item.add_marker(pytest.mark.bench)
            if no_plugin:
                item.add_marker(pytest.mark.skip(reason="pytest-benchmark is not installed"))


@pytest.fixture(autouse=True)
def _one_compute_thread():
    """One intra-op thread while a benchmark runs: on a shared 2-core machine extra
    OpenMP threads only add noise. Restored afterwards for the rest of the session."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
