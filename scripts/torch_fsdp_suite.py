#!/usr/bin/env python
"""Run PyTorch's own FSDP1 test files on CPU/gloo, against torch's FSDP1 and against impl.fsdp.

    python scripts/torch_fsdp_suite.py DIR [--files test_fsdp_core.py ...] [-k PATTERN]
                                       [--bind torch,impl] [--devices 2] [--out RESULTS_DIR]
    python scripts/torch_fsdp_suite.py --report RESULTS_DIR        # the table again, no run

``DIR`` holds test files from PyTorch's ``test/distributed/fsdp/`` (download them; they are
never part of this repository, docs/fsdp.md says where from). Each file runs twice, each
time in a fresh interpreter: once as it is (torch's FSDP1) and once with impl.fsdp bound
in place of torch's FSDP names. The script prints one Markdown row per file (tests,
passed/failed/skipped under each binding), then the tests whose outcome differs.

[Note: running PyTorch's FSDP tests on CPU]
The tests are written for one accelerator per rank (``FSDPTest``, ``FSDPTestContinuous``,
``MultiProcessTestCase``); on a CPU-only machine torch.testing picks ``DEVICE_TYPE="cpu"``
and the gloo backend by itself, but every test still skips or is never instantiated.
What it takes, all applied in the test process before the test file is imported
(forked ranks inherit it):

* ``torch.accelerator.device_count()``, ``torch.cuda.device_count()`` and common_fsdp's
  ``DEVICE_COUNT`` report ``--devices`` (2), so the "not enough GPUs" exits do not fire and tests without their
  own ``world_size`` run on that many ranks; ``skip_if_lt_x_gpu(n)`` skips only when
  ``n`` exceeds it.
* ``instantiate_device_type_tests(..., only_for=("cuda", "hpu", "xpu"))`` also
  instantiates for ``cpu`` (tests named ``..._cpu``).
* Ranks are forked (0.1 s) instead of spawned (3-4 s each on two cores), after
  ``torch.set_num_threads(1)``, as zerobench.harness.testing does.
* Tests that still say ``"cuda"`` (``torch.device("cuda")`` inputs, ``.cuda()``) get
  CPU tensors: a TorchFunctionMode rewrites a CUDA ``device`` argument (or an accelerator
  index given as ``device=``) to ``cpu`` and makes ``Tensor.cuda()`` the identity.
  ``torch.cuda.synchronize`` and the device setters (``torch.cuda.set_device``,
  ``torch.accelerator.set_device_index``) become no-ops; the current-device getters
  (``torch.cuda.current_device``, ``torch.accelerator.current_device_index``) say 0.
* An accelerator index as FSDP's ``device_id`` (``device_id=torch.accelerator.
  current_device_index()``) becomes ``device_id=cpu``, for both bindings alike.
* ``FSDPTestContinuous`` skips the rest of a class after one failure (its ranks may be
  stuck in a collective): here the ranks are killed and new ones started instead, so
  each test counts on its own. A test's ranks time out after ``--test-timeout`` s.

[Note: binding impl in place of torch's FSDP]
Test files import FSDP's names in every way: ``from torch.distributed.fsdp import
FullyShardedDataParallel as FSDP``, ``...fully_sharded_data_parallel import ...``,
``...fsdp.wrap import ModuleWrapPolicy``, ``...fsdp.api import ...``, and common_fsdp
imports them at its own import. So before anything imports them, each public name of
``torch.distributed.fsdp`` (and its ``fully_sharded_data_parallel``, ``api`` and
``wrap`` modules) that impl.fsdp (impl.fsdp.wrap for ``wrap``) also defines, other than
a module, is replaced by impl's; then, after the
test file is imported, any module-level name or constant of the test file and of
torch.testing's helper modules that still holds one of torch's objects (a class, an
enum member, a policy function, a tuple of them) is mapped to impl's as well.
torch's private modules (``_flat_param``, ``_runtime_utils``, ...) are left alone: tests
reaching into them test torch, not the public behaviour.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import re
import subprocess
import sys
import time
import traceback
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BINDINGS = ("torch", "impl")
_ENV_BIND = "ZEROBENCH_FSDP_SUITE_BIND"


# -- the CPU patches (see [Note: running PyTorch's FSDP tests on CPU]) ----------------


def _is_cuda(device, index_too: bool = False) -> bool:
    """``device`` names a CUDA device (or, with ``index_too``, is an accelerator index)."""
    import torch

    if index_too and isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


def _cuda_as_cpu_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaAsCpu(TorchFunctionMode):
        """Tensors asked for on ``cuda`` are made on the CPU; ``Tensor.cuda()`` is the identity."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if getattr(func, "__name__", "") == "cuda" and args and isinstance(args[0], torch.Tensor):
                return args[0]
            if _is_cuda(kwargs.get("device"), index_too=True):
                kwargs["device"] = "cpu"
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
            return func(*args, **kwargs)

    return CudaAsCpu()


def install_cpu_patches(devices: int, test_timeout: int) -> None:
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(test_timeout))
    import torch

    torch.set_num_threads(1)  # before any op: forked ranks then never inherit an OpenMP pool
    torch.accelerator.device_count = lambda: devices
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.set_device = lambda *a, **k: None
        torch.cuda.current_device = lambda: 0
        torch.cuda.device_count = lambda: devices
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.set_device_index = lambda *a, **k: None
        torch.accelerator.current_device_index = lambda: 0
    import torch.multiprocessing as mp
    from torch.testing._internal import common_device_type, common_distributed

    def skip_if_lt_x_gpu(x, *, allow_cpu=False):
        def decorator(fn):
            return unittest.skip(f"needs {x} ranks, --devices is {devices}")(fn) if x > devices else fn

        return decorator

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu

    instantiate = common_device_type.instantiate_device_type_tests

    def instantiate_with_cpu(generic_test_class, scope, except_for=None, only_for=None, **kwargs):
        if only_for is not None:
            only_for = [only_for] if isinstance(only_for, str) else list(only_for)
            only_for = [*only_for, "cpu"] if "cpu" not in only_for else only_for
        if except_for is not None:
            except_for = [except_for] if isinstance(except_for, str) else list(except_for)
            except_for = [d for d in except_for if d != "cpu"]
        return instantiate(generic_test_class, scope, except_for=except_for, only_for=only_for, **kwargs)

    common_device_type.instantiate_device_type_tests = instantiate_with_cpu

    fork = mp.get_context("fork")
    common_distributed.MultiProcessTestCase._spawn_processes = lambda self: self._start_processes(fork.Process)

    @classmethod
    def spawn_continuous(cls, world_size):
        import tempfile

        cls.processes, cls.task_queues, cls.completion_queues = [], [], []
        with tempfile.NamedTemporaryFile(delete=False) as f:
            cls.rdvz_file = f.name
        for rank in range(int(world_size)):
            tasks, done = fork.Queue(), fork.Queue()
            process = fork.Process(
                target=cls._worker_loop, name=f"process {rank}", daemon=True,
                args=(rank, world_size, cls.rdvz_file, tasks, done),
            )
            process.start()
            cls.processes.append(process)
            cls.task_queues.append(tasks)
            cls.completion_queues.append(done)

    continuous = common_distributed.MultiProcContinuousTest
    continuous._spawn_processes = spawn_continuous
    continuous_set_up = continuous.setUp

    def set_up_with_fresh_ranks(self):
        cls = type(self)
        if cls.poison_pill:  # a previous test failed: new ranks instead of skipping the rest
            for process in cls.processes:
                process.kill()
                process.join()
            cls._processes_spawned = False
            cls.poison_pill = False
        continuous_set_up(self)

    continuous.setUp = set_up_with_fresh_ranks

    # DDP refuses device_ids for a CPU module; the tests pass [rank] or [device].
    from torch.nn.parallel import DistributedDataParallel

    ddp_init = DistributedDataParallel.__init__

    def ddp_init_on_cpu(self, module, device_ids=None, output_device=None, *args, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        ddp_init(self, module, device_ids, output_device, *args, **kwargs)

    DistributedDataParallel.__init__ = ddp_init_on_cpu

    from torch.testing._internal import common_fsdp

    common_fsdp.DEVICE_COUNT = devices
    common_fsdp.FSDPTestContinuous.world_size = devices
    torch.overrides.TorchFunctionMode.__enter__(_cuda_as_cpu_mode())


# -- binding impl (see [Note: binding impl in place of torch's FSDP]) -----------------

_TORCH_MODULES = {  # torch's module -> impl's module that defines the same public names
    "torch.distributed.fsdp": "impl.fsdp",
    "torch.distributed.fsdp.fully_sharded_data_parallel": "impl.fsdp",
    "torch.distributed.fsdp.api": "impl.fsdp",
    "torch.distributed.fsdp.wrap": "impl.fsdp.wrap",
}


def _torch_to_impl() -> dict[int, tuple[object, object]]:
    """id(torch's object) -> (torch's object, impl's): the public classes and functions
    impl.fsdp defines under the same name in the corresponding module (never a module:
    ``impl.fsdp.wrap`` the module is not ``torch.distributed.fsdp.wrap.wrap`` the
    function), the members of their enums, and torch's private TrainingState
    (common_fsdp's ``_assert_state`` uses it)."""
    import importlib
    import types

    from torch.distributed.fsdp import _common_utils

    ifsdp = importlib.import_module("impl.fsdp")
    pairs = {}
    for module_name, impl_name in _TORCH_MODULES.items():
        module, impl_module = importlib.import_module(module_name), importlib.import_module(impl_name)
        for name in dir(module):
            if name.startswith("__") or not hasattr(impl_module, name):
                continue
            theirs, ours = getattr(module, name), getattr(impl_module, name)
            if isinstance(ours, types.ModuleType) or isinstance(theirs, types.ModuleType):
                continue
            if isinstance(theirs, type) or callable(theirs):
                pairs[id(theirs)] = (theirs, ours)
    pairs[id(_common_utils.TrainingState)] = (_common_utils.TrainingState, ifsdp.TrainingState)
    for theirs, ours in list(pairs.values()):
        if isinstance(theirs, type) and issubclass(theirs, enum.Enum) and isinstance(ours, type):
            for member in theirs:
                if hasattr(ours, member.name):
                    pairs[id(member)] = (member, getattr(ours, member.name))
    return pairs


def _mapped(value, pairs):
    hit = pairs.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    if isinstance(value, (tuple, list, set, frozenset)):
        items = [_mapped(v, pairs) for v in value]
        if any(a is not b for a, b in zip(items, value)):
            return type(value)(items)
    return value


def rebind_module(module, pairs) -> None:
    """Replace every module-level name of ``module`` that holds torch's FSDP object."""
    for name, value in list(vars(module).items()):
        new = _mapped(value, pairs)
        if new is not value:
            setattr(module, name, new)


def bind_impl() -> dict:
    import importlib

    pairs = _torch_to_impl()
    for module_name in _TORCH_MODULES:
        rebind_module(importlib.import_module(module_name), pairs)
    from torch.testing._internal import common_fsdp

    rebind_module(common_fsdp, pairs)
    return pairs


# -- one file under one binding, in this process --------------------------------------


def device_id_on_cpu(fsdp_class, *, when_none: bool) -> None:
    """Without an accelerator, an accelerator index given as ``device_id`` means the CPU
    here (see [Note: running PyTorch's FSDP tests on CPU]); with ``when_none`` a missing
    ``device_id`` does too: torch's FSDP1 refuses a machine without an accelerator unless
    given ``device_id=cpu`` ("FSDP needs a non-CPU accelerator device")."""
    import inspect

    import torch

    if torch.accelerator.current_accelerator() is not None:
        return
    fsdp_init = fsdp_class.__init__
    signature = inspect.signature(fsdp_init)

    def init_on_cpu(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        device_id = bound.arguments.get("device_id")
        if (device_id is None and when_none) or (isinstance(device_id, int) and not isinstance(device_id, bool)):
            bound.arguments["device_id"] = torch.device("cpu")
        return fsdp_init(*bound.args, **bound.kwargs)

    fsdp_class.__init__ = init_on_cpu


def _prepare_process() -> dict | None:
    """What every process of a run needs, keyed by the environment (forked ranks inherit it)."""
    binding = os.environ[_ENV_BIND]
    sys.path.insert(0, str(ROOT))
    install_cpu_patches(int(os.environ["ZEROBENCH_FSDP_SUITE_DEVICES"]),
                        int(os.environ["ZEROBENCH_FSDP_SUITE_TIMEOUT"]))
    if binding == "impl":
        from impl.fsdp import FullyShardedDataParallel

        device_id_on_cpu(FullyShardedDataParallel, when_none=False)
        return bind_impl()
    from torch.distributed.fsdp import FullyShardedDataParallel

    device_id_on_cpu(FullyShardedDataParallel, when_none=True)
    return None


class _Recorder(unittest.TestResult):
    """Outcome of each test: pass, fail (a failure or an error), skip."""

    def __init__(self):
        super().__init__()
        self.outcomes: dict[str, dict] = {}
        self._start = time.monotonic()

    def _record(self, test, outcome, detail=""):
        self.outcomes[test.id().split(".", 1)[-1]] = {
            "outcome": outcome, "detail": detail[-2000:], "seconds": round(time.monotonic() - self._start, 2)
        }

    def startTest(self, test):
        super().startTest(test)
        self._start = time.monotonic()
        print(f"  {test.id()} ...", file=sys.stderr, flush=True)

    def addSuccess(self, test):
        self._record(test, "pass")

    def addFailure(self, test, err):
        self._record(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        self._record(test, "fail", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        self._record(test, "skip", str(reason))

    def addExpectedFailure(self, test, err):
        self._record(test, "pass")

    def addUnexpectedSuccess(self, test):
        self._record(test, "fail", "unexpected success")


def run_file(path: Path, pattern: str | None, out: Path) -> None:
    pairs = _prepare_process()
    sys.path.insert(0, str(path.parent))
    try:
        module = __import__(path.stem)
    except BaseException:  # SystemExit included: some files exit when a feature is missing
        out.write_text(json.dumps({"import_error": traceback.format_exc()[-3000:], "tests": {}}))
        return
    if pairs is not None:
        rebind_module(module, pairs)
    suite = unittest.TestLoader().loadTestsFromModule(module)
    if pattern:
        suite = unittest.TestSuite(t for t in _flatten(suite) if pattern in t.id())
    recorder = _Recorder()
    suite.run(recorder)
    out.write_text(json.dumps({"import_error": None, "tests": recorder.outcomes}, indent=1))


def _flatten(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _flatten(item)
        else:
            yield item


# -- the driver ----------------------------------------------------------------------


def _run_one(path: Path, binding: str, args, out_dir: Path) -> dict:
    out = out_dir / f"{path.stem}.{binding}.json"
    log = out_dir / f"{path.stem}.{binding}.log"
    env = dict(os.environ, **{_ENV_BIND: binding, "ZEROBENCH_FSDP_SUITE_DEVICES": str(args.devices),
                              "ZEROBENCH_FSDP_SUITE_TIMEOUT": str(args.test_timeout)})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, __file__, "--run-file", str(path), "--json", str(out)]
    if args.k:
        command += ["-k", args.k]
    start = time.monotonic()
    with open(log, "w") as log_file:
        try:
            subprocess.run(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=args.file_timeout)
        except subprocess.TimeoutExpired:
            pass
    result = json.loads(out.read_text()) if out.exists() else {"import_error": f"no result (see {log})", "tests": {}}
    result["seconds"] = round(time.monotonic() - start, 1)
    out.write_text(json.dumps(result, indent=1))
    return result


def _counts(result: dict) -> dict[str, int]:
    counts = {"pass": 0, "fail": 0, "skip": 0}
    for test in result["tests"].values():
        counts[test["outcome"]] += 1
    return counts


def error_line(detail: str) -> str:
    """The exception line of a test's traceback (without torch.testing's repro note)."""
    detail = detail.split("To execute this test, run the following")[0]
    lines = [line for line in detail.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Warning|Failure)\b", line):
            return line.strip()
    return lines[-1].strip() if lines else ""


def report(out_dir: Path) -> str:
    """The Markdown table and the differing tests, from the JSON files of a run."""
    files = sorted({p.name.split(".")[0] for p in out_dir.glob("*.json")})
    lines = ["| file | tests | torch: pass / fail / skip | impl: pass / fail / skip |", "|---|---|---|---|"]
    differences = []
    totals = {b: {"pass": 0, "fail": 0, "skip": 0} for b in BINDINGS}
    for name in files:
        results = {}
        for binding in BINDINGS:
            path = out_dir / f"{name}.{binding}.json"
            if path.exists():
                results[binding] = json.loads(path.read_text())
        cells = []
        for binding in BINDINGS:
            result = results.get(binding)
            if result is None:
                cells.append("not run")
            elif result["import_error"] and not result["tests"]:
                cells.append("import error")
            else:
                c = _counts(result)
                for k in c:
                    totals[binding][k] += c[k]
                cells.append(f"{c['pass']} / {c['fail']} / {c['skip']}")
        tests = max((len(r["tests"]) for r in results.values()), default=0)
        lines.append(f"| {name} | {tests} | {cells[0]} | {cells[1]} |")
        if len(results) == 2:
            theirs, ours = results["torch"]["tests"], results["impl"]["tests"]
            for test in sorted(set(theirs) | set(ours)):
                a = theirs.get(test, {}).get("outcome", "absent")
                b = ours.get(test, {}).get("outcome", "absent")
                if a != b:
                    failed = ours.get(test) if b == "fail" else theirs.get(test) if a == "fail" else None
                    why = f" ({error_line(failed['detail'])[:240]})" if failed else ""
                    differences.append(f"- {name}::{test}: torch {a}, impl {b}{why}")
    lines.append("| **total** | | " + " | ".join(
        f"**{t['pass']} / {t['fail']} / {t['skip']}**" for t in totals.values()) + " |")
    text = "\n".join(lines)
    if differences:
        text += "\n\nTests whose outcome differs:\n" + "\n".join(differences)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, help="folder of PyTorch's test_fsdp_*.py files")
    parser.add_argument("--files", nargs="*", help="file names in DIRECTORY (default: every test_*.py)")
    parser.add_argument("-k", help="only tests whose id contains this string")
    parser.add_argument("--bind", default="torch,impl", help="torch, impl or both (default)")
    parser.add_argument("--devices", type=int, default=2, help="ranks a test may use (default 2)")
    parser.add_argument("--test-timeout", type=int, default=240, help="seconds before a test's ranks are killed")
    parser.add_argument("--file-timeout", type=int, default=7200, help="seconds for one file under one binding")
    parser.add_argument("--out", type=Path, help="where the per-file JSON and logs go (default: a temporary folder)")
    parser.add_argument("--report", type=Path, help="print the table of an earlier --out folder and stop")
    parser.add_argument("--run-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_file:  # inner: one file, one binding, in this process
        run_file(args.run_file, args.k, args.json)
        return 0
    if args.report:
        print(report(args.report))
        return 0
    if args.directory is None:
        parser.error("give DIRECTORY (or --report)")
    names = args.files or sorted(p.name for p in args.directory.glob("test_*.py"))
    bindings = [b for b in args.bind.split(",") if b]
    bad = [b for b in bindings if b not in BINDINGS]
    if bad:
        parser.error(f"--bind takes {', '.join(BINDINGS)}, got {', '.join(bad)}")
    out_dir = args.out or Path(__import__("tempfile").mkdtemp(prefix="torch-fsdp-suite-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        for binding in bindings:
            result = _run_one(args.directory / name, binding, args, out_dir)
            c = _counts(result)
            note = " (import error)" if result["import_error"] and not result["tests"] else ""
            print(f"{name} [{binding}]: {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped "
                  f"in {result['seconds']} s{note}", file=sys.stderr, flush=True)
    print(report(out_dir))
    print(f"\n(results and logs: {out_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__" and _ENV_BIND in os.environ:  # a spawned rank: same patches
    _prepare_process()
