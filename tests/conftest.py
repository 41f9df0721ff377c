"""Test-suite wiring: the repository root on ``sys.path``, the options of the optional
plugins, the ``world_size`` mark, and the fast tests' budget.

``@pytest.mark.world_size(2, 4)`` runs a test once per world size, as DeepSpeed's
``DistributedTest`` does with its ``world_size`` attribute: the test takes a
``world_size`` argument and hands it to ``zerobench.harness.testing.run_ranks``. The test ids
read ``ws2``, ``ws4``, so ``pytest -k ws4`` selects the larger worlds.
"""

from __future__ import annotations

import functools
import inspect
import os
import resource
import sys
import time

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


# [Note: indexed CUDA devices]
# A CUDA device without an index ("cuda") means whatever device is current, which is
# cuda:0 until someone sets another: on a node of 8 GPUs, eight ranks would then start
# NCCL or FSDP on the same GPU. Every CUDA device_id zerobench or impl hands over names
# its index; this guard fails any test in which one does not, at the hand-overs:
# init_process_group, torch's FSDP1 and impl's FSDP (tests/helpers/topology.py's
# check_device_id). It patches functions only, once per session before the first test (so
# no test's CPU budget pays for the imports), and costs nothing when none is called.
_device_id_guard: pytest.MonkeyPatch | None = None


def pytest_sessionstart(session):
    global _device_id_guard
    try:
        import torch.distributed as dist
    except ImportError:  # the plots' venv of the oldest allowed versions has no torch: nothing to guard
        return
    from torch.distributed import distributed_c10d
    from torch.distributed.fsdp import _init_utils

    import impl.fsdp.fully_sharded as impl_fsdp
    from tests.helpers.topology import check_device_id

    def guarded(fn, where):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            check_device_id(signature.bind_partial(*args, **kwargs).arguments.get("device_id"), where)
            return fn(*args, **kwargs)
        return call

    get_fsdp1_device = _init_utils._get_device_from_device_id

    def guarded_fsdp1(device_id, rank, device_handle):
        check_device_id(device_id, "torch FSDP1")
        return get_fsdp1_device(device_id, rank, device_handle)

    patch = _device_id_guard = pytest.MonkeyPatch()
    init = guarded(dist.init_process_group, "init_process_group")
    patch.setattr(dist, "init_process_group", init)
    patch.setattr(distributed_c10d, "init_process_group", init)
    patch.setattr(_init_utils, "_get_device_from_device_id", guarded_fsdp1)
    patch.setattr(impl_fsdp.FullyShardedDataParallel, "__init__",
                  guarded(impl_fsdp.FullyShardedDataParallel.__init__, "impl's FSDP"))


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


# [Note: test budgets]
# The suite has two parts. Fast tests (`pytest -m "not slow"`): unit tests and small
# distributed ones, for the edit-test loop. Slow tests (`-m slow`): end-to-end runs of the
# harness and the what-if tools on real workloads. The budgets, stated in README.md:
#   * a fast test spends at most FAST_TEST_CPU_S seconds of CPU, its rank processes and
#     other children included (CPU time, not wall time: a loaded machine slows a test
#     down, it does not make it use more CPU);
#   * the fast suite finishes in about 4 minutes on 2 quiet cores, the whole suite in
#     about 10 (README.md: "Tests and CI").
# Every run reports the fast tests over their budget at the end; with
# ZEROBENCH_TEST_BUDGETS=strict (.ci/run sets it) the run fails on them: such a test
# belongs under @pytest.mark.slow.

#: CPU seconds a test not marked slow may spend (setup, call and teardown, children included).
FAST_TEST_CPU_S = float(os.environ.get("ZEROBENCH_FAST_TEST_CPU_S", 30.0))
_cpu_spent: dict[str, float] = {}
_slow: set[str] = set()  # node ids of the collected tests marked slow


def pytest_collection_modifyitems(session, config, items):
    _slow.update(item.nodeid for item in items if item.get_closest_marker("slow"))


def _cpu_now() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu_now()
    yield
    _cpu_spent[item.nodeid] = _cpu_now() - start


def over_budget(spent: dict[str, float], slow: set[str], budget: float = FAST_TEST_CPU_S) -> list[tuple[str, float]]:
    """The tests not marked slow that spent more than ``budget`` CPU seconds, worst first."""
    return sorted(((node, cpu) for node, cpu in spent.items() if node not in slow and cpu > budget),
                  key=lambda x: -x[1])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    over = over_budget(_cpu_spent, _slow)
    if over:
        terminalreporter.section("fast tests over their budget")
        for node, cpu in over:
            terminalreporter.write_line(f"{cpu:6.1f} CPU-s > {FAST_TEST_CPU_S:g}: {node} (mark it slow)")


def pytest_sessionfinish(session, exitstatus):
    if _device_id_guard is not None:
        _device_id_guard.undo()
    if os.environ.get("ZEROBENCH_TEST_BUDGETS") == "strict" and over_budget(_cpu_spent, _slow):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
