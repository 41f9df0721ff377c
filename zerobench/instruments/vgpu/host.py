"""The host of the virtual GPU: what the CPU thread that drives a GPU pays for each thing
it does, and how those prices come from measurements of a real host.

[Note: host cost]
On a GPU the host thread issues the work: eager PyTorch costs it microseconds per
operator, and the engines' Python around the operators (module hooks, FSDP's pre- and
post-forward and backward hooks, the optimizer's grouping) costs it more. A host that
falls behind leaves the GPU idle. One H200 host measured 11-21 us per eager call and
45 us per operator under fully_shard's hooks (results/gpu/h200-20261126/host.json).

The host clock of a prediction must be a pure function of the program (the predict
gate compares every figure exactly, on any machine), so it cannot be this CPU's wall
time. It is a *count* of what the host executes, each item at a price measured on a
real host:

* every operator the dispatch mode sees: ``dispatch_s``; ``launch_s`` more when it
  launches a kernel, ``gemm_s`` more for a cuBLAS GEMM (its heuristics and workspace),
  ``foreach_tensor_s`` more per tensor in a ``_foreach_*`` operator's lists, ``alloc_s``
  for each output the caching allocator hands it;
* the stream and event calls of ``torch.cuda`` the engines make, each at its own
  measured price: ``Event.record``, ``Stream.wait_event``, ``with torch.cuda.stream(s)``
  (entering and leaving), ``record_stream``; ``wait_stream`` is an event record and a
  wait, as torch implements it; calls that were not measured (``current_stream``,
  making a stream or an event) cost a Python call and a torch C entry, the Python
  functions they are;
* every collective call (NCCL's enqueue and c10d's Python around it), and the
  ``wait()`` of an asynchronous one;
* the Python work of the engines', torch's, the model's and the harness's code
  (:class:`PythonCalls`), by kind (:data:`PYTHON_KINDS`): each call of a Python
  function (``python_frame_s``: a one-line call), each line of code it ran through
  before it returned (``python_line_s``: its body's own work), each entry into a
  generator (``generator_s``), each call of a C builtin (``c_call_s``) and each call
  into torch's C extension that dispatched no operator (``torch_call_s``).

A single price per Python call (the model before this one) had to stand for a hook of
fully_shard's and a one-line ``get_accelerator()`` alike; fitted on fully_shard's steps it
came to 4.1 us, and DeepSpeed ZeRO-3, which makes a hundred thousand one-line calls a
step, came out 2.4 times its measured step. Kinds tell those apart: a one-line call costs
its frame and one line; a hook its frame and its twenty lines.

What is not counted is what only this CPU runs: the virtual GPU's own code and every
other instrument's (zerobench/instruments/, which the counter skips with everything
they call), fake tensors (torch/_subclasses/), the Python dispatch mode's lookup of
its rules, imports made on first use, the garbage collector's pass, and the standard
library's own frames (their callees in torch are counted): Python's version should not
move a prediction (lines are the source's, not the bytecode's), and the fitted prices
are fitted on work counted the same way. Nor
are the Python calls of a prediction's build and warm-up steps
(``VirtualGpu.python_uncounted``; their operators and stream calls are):
the first steps of a process run first-call code (caches filled, modules imported)
whose amount depends on what the process ran before, and the host clock at the start of
the measured step would move with it (by a rounding only: the step starts after a
synchronisation, but a figure the gate compares exactly must not move at all).

The prices come from :func:`from_measurements`: a host.json-shaped dict of one host's
measurements (zerobench/validation/calibrate/host.py measures them; the H200's are in
results/gpu/h200-20261126/host.json). Per call: ``x.add_(1)`` is an operator with a
kernel, ``x + 1`` the same with an output to allocate, ``torch.empty`` an operator
without a kernel that allocates, ``F.linear`` a view and a GEMM; a loop calling a
one-line function is a frame, the same calling ``len`` adds a C builtin, ``x.dim()`` a
torch C entry, ``next(g)`` a generator's resumption (:data:`PYTHON_LOOPS`; a host.json
without one prices that kind as a one-line call). What no loop measures, a line's work
and a foreach list's tensor (:data:`FITTED_KINDS`), is fitted by least squares of the
relative errors over the plain and fully_shard training steps of an 8-layer MLP (their
counts made on the virtual GPU by zerobench/validation/calibrate/host.py's
``count_programs``); the FSDP1 step is held out, to check the model: :func:`fit_report`.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import inspect
import json
import os
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

#: What the host is charged for, by kind (VirtualGpu.host_counts). See [Note: host cost].
KINDS = ("op", "kernel", "gemm", "alloc", "foreach_tensor", "python_frame", "python_line", "generator", "c_call", "torch_call", "api_call",
         "event_record", "wait_event", "wait_stream", "stream_switch", "record_stream", "collective", "collective_wait")
#: The Python work :class:`PythonCalls` tells apart, in the order of its ``counts``: a call
#: of a Python function, the lines of code it ran through (:func:`_lines_run`), an entry into a generator or coroutine (its first run or a
#: resumption), a call of a C builtin that is not torch's (``len``, ``isinstance``,
#: ``getattr``...), and a call into torch's C extension that dispatched no operator
#: (``Tensor.dim``, ``torch.is_grad_enabled``, ``torch._C._get_tracing_state``...; one
#: that dispatches an operator is priced as the operator).
PYTHON_KINDS = ("python_frame", "python_line", "generator", "c_call", "torch_call")

#: The host's time by share, as predict reports it (``host_<share>_s``): the kinds each
#: share sums. Work the CPU does on host memory (operators on host tensors, the staging of
#: pageable copies) is the device's ``host_cpu_s``, not a count.
HOST_SHARES = {"operators": ("op", "kernel", "gemm", "foreach_tensor", "alloc"),
               "python": PYTHON_KINDS,
               "streams": ("api_call", "event_record", "wait_event", "wait_stream", "stream_switch", "record_stream"),
               "collectives": ("collective", "collective_wait")}

_US = 1e-6


@dataclass(frozen=True)
class HostPreset:
    """What the CPU thread pays for what it does ([Note: host cost]). Times in seconds.

    The stream and collective prices default to one ``dispatch_s`` each, and Python's
    prices all 0 turn the counting of Python off: the presets ``fast`` and ``slow`` price
    operators only, as the virtual GPU did before it counted more."""

    name: str
    dispatch_s: float
    """Every operator the host dispatches (Python's call into torch, the dispatcher, autograd)."""
    launch_s: float
    """More for an operator that launches a kernel."""
    bytes_per_s: float = 10e9
    """Memory speed of an operator the CPU itself runs on host memory (CPU offload's
    optimizer step): bytes read plus written per second, one thread's streaming rate."""
    alloc_s: float = 0.0
    """Each output tensor the caching allocator hands an operator."""
    gemm_s: float = 0.0
    """More for a cuBLAS GEMM's launch."""
    foreach_tensor_s: float = 0.0
    """More for each tensor in the lists of a ``_foreach_*`` operator (its per-tensor checks
    and the kernel arguments ``multi_tensor_apply`` builds; a tensor subclass's own dispatch
    of it, as DTensor's, per tensor)."""
    python_frame_s: float = 0.0
    """Each call of a Python function of the engines', torch's, the model's and the
    harness's code: a frame made, its body run, returned (0, with the three below: Python
    is not counted)."""
    python_line_s: float = 0.0
    """Each line of code such a call ran through before it returned (:func:`_lines_run`):
    its body's own work (attribute look-ups, arithmetic, branches), beside the calls it
    makes, which are counted on their own."""
    generator_s: float = 0.0
    """Each entry into a generator or coroutine frame of that code (its first run, or a
    resumption by ``next`` or a ``for`` loop)."""
    c_call_s: float = 0.0
    """Each call of a C builtin (not torch's) from that code: ``len``, ``isinstance``,
    ``getattr``, a dict's ``get``..."""
    torch_call_s: float = 0.0
    """Each call from that code into torch's C extension that dispatches no operator:
    tensor metadata (``Tensor.dim``, ``Tensor.size``), grad mode, the tracing and
    dispatch-key checks, hook registration."""
    event_record_s: float | None = None
    """``Event.record`` (default: ``dispatch_s``)."""
    wait_event_s: float | None = None
    """``Stream.wait_event`` (default: ``dispatch_s``)."""
    wait_stream_s: float | None = None
    """``Stream.wait_stream`` (default: ``dispatch_s``)."""
    stream_switch_s: float = 0.0
    """Entering and leaving ``with torch.cuda.stream(s)``."""
    record_stream_s: float | None = None
    """``Tensor.record_stream`` (default: ``dispatch_s``)."""
    collective_s: float | None = None
    """A collective call: NCCL's enqueue and c10d's Python around it (default: ``dispatch_s + launch_s``)."""
    collective_wait_s: float | None = None
    """``wait()`` of an asynchronous collective (default: ``dispatch_s``)."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self):
        defaults = {"event_record_s": self.dispatch_s, "wait_event_s": self.dispatch_s,
                    "wait_stream_s": self.dispatch_s, "record_stream_s": self.dispatch_s,
                    "collective_s": self.dispatch_s + self.launch_s, "collective_wait_s": self.dispatch_s}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"host preset {self.name}: {f.name} {value!r} is not allowed (allowed: seconds >= 0)")
        if not self.bytes_per_s > 0:
            raise ValueError(f"host preset {self.name}: bytes_per_s {self.bytes_per_s!r} is not allowed "
                             "(allowed: > 0)")

    @property
    def counts_python(self) -> bool:
        """Whether the Python work between operators is counted and charged."""
        return any(price > 0 for price in self.python_prices())

    def python_prices(self) -> tuple[float, ...]:
        """Seconds per item of each of :data:`PYTHON_KINDS`, in that order."""
        return (self.python_frame_s, self.python_line_s, self.generator_s, self.c_call_s, self.torch_call_s)

    def units(self) -> dict[str, float]:
        """Seconds per item of each kind the host is charged for (:data:`KINDS`)."""
        return {"op": self.dispatch_s, "kernel": self.launch_s, "gemm": self.gemm_s, "alloc": self.alloc_s,
                "foreach_tensor": self.foreach_tensor_s, **dict(zip(PYTHON_KINDS, self.python_prices())),
                "api_call": self.python_frame_s + self.torch_call_s,
                "event_record": self.event_record_s, "wait_event": self.wait_event_s,
                "wait_stream": self.wait_stream_s, "stream_switch": self.stream_switch_s,
                "record_stream": self.record_stream_s, "collective": self.collective_s,
                "collective_wait": self.collective_wait_s}

    def seconds(self, counts: dict) -> float:
        """Host time of ``counts`` (kind -> how many)."""
        units = self.units()
        return sum(n * units[kind] for kind, n in counts.items())

    def seconds_by_share(self, counts: dict) -> dict[str, float]:
        """Host time of ``counts`` in each of :data:`HOST_SHARES`."""
        units = self.units()
        return {share: sum(counts.get(kind, 0) * units[kind] for kind in kinds) for share, kinds in HOST_SHARES.items()}


# -- counting Python calls ---------------------------------------------------------------


def _root_codes() -> set:
    """Code objects whose calls, and everything they call, are not the program's (see the Note)."""
    import importlib._bootstrap as bootstrap

    return {bootstrap._find_and_load.__code__}


def _instrument_dir() -> str:
    return str(Path(__file__).resolve().parents[1]) + os.sep  # zerobench/instruments/


#: Paths (a part of the file name) whose frames start a subtree that is not counted: fake
#: tensors, the dispatch mode's rule lookup, the instruments' weak dictionaries, and the
#: profiler's annotations (``record_function``), priced by the two operators they
#: dispatch instead (see the Note).
_ROOT_PARTS = (os.sep + os.path.join("torch", "_subclasses") + os.sep,
               os.sep + os.path.join("torch", "_library", "simple_registry.py"),
               os.sep + os.path.join("torch", "utils", "weak.py"),
               os.sep + os.path.join("torch", "autograd", "profiler.py"),
               os.sep + os.path.join("torch", "profiler") + os.sep)

#: What a code object's frames are to the counter (counted ones compare >= _COUNT).
_SKIP, _ROOT, _COUNT, _GENERATOR = 0, 1, 2, 3


def _code_lines(code) -> tuple[int, ...]:
    """The lines of the source that hold ``code``'s instructions, sorted (the ``def`` line
    and its decorators left out, unless the body is on it)."""
    lines = sorted({line for _, _, line in code.co_lines() if line is not None})
    body = [line for line in lines if line > code.co_firstlineno]
    return tuple(body or lines)


def _lines_run(lines: tuple[int, ...], returned_at: int | None) -> int:
    """How many of a function's code lines lie before the line it returned from, that line
    included: the straight-line code it ran through (a loop's body counts once). A property
    of the source, not of the bytecode, so that Python's version does not move it."""
    if returned_at is None:
        return len(lines)
    return max(bisect.bisect_right(lines, returned_at), 1)


def _is_torch(function) -> bool:
    """Whether a C function a ``c_call`` event names is torch's: a function of a torch
    module (``torch.is_grad_enabled``, ``torch._C._get_tracing_state``) or a method of a
    torch object (``Tensor.dim``, a ``torch._C`` class's)."""
    module = getattr(function, "__module__", None)
    if module is not None:
        return module.startswith("torch")
    owner = getattr(function, "__self__", None)
    return owner is not None and (isinstance(owner, torch.Tensor)
                                  or (getattr(type(owner), "__module__", None) or "").startswith("torch"))


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if paths.get(k)})


class PythonCalls:
    """Counts the Python work the host thread does while installed, by kind
    (:data:`PYTHON_KINDS`): see [Note: host cost] for which code counts. ``counts`` holds
    one count per kind; ``ops[0]`` is raised by the virtual GPU at each operator it
    dispatches, so that a call into torch that dispatched one is told from one that did not.

    It is a ``sys.setprofile`` function of the thread that installs it (Python 3.11 has
    no cheaper hook; it sees Python frames and C calls alike), restored to the previous one
    on :meth:`uninstall`. The virtual GPU pauses it where it runs its own code
    (:meth:`pause` / :meth:`resume`, which nest), so that what it spends there costs no
    profiling; other instruments' code is skipped by the counter itself, as a subtree
    whose root is their frame."""

    def __init__(self):
        self.counts = [0] * len(PYTHON_KINDS)
        self.ops = [0]
        self._depth = 0  # pauses in effect
        self._previous = None
        self._thread: int | None = None
        kinds: dict = dict.fromkeys(_root_codes(), _ROOT)
        instruments, stdlib = _instrument_dir(), _stdlib_dirs()
        root: list = [None]  # the frame whose subtree is not counted, while one runs
        # For each C call of counted code not yet returned: the operator count when it was
        # made (a call into torch), or None (another builtin). C calls nest through Python.
        pending: list = []
        counts, ops = self.counts, self.ops
        generator_flags = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

        def kind_of(code) -> int:
            path = code.co_filename
            if path.startswith(instruments) or any(part in path for part in _ROOT_PARTS):
                kind = _ROOT
            elif path.startswith("<") or (path.startswith(stdlib) and "-packages" not in path):
                kind = _SKIP
            else:
                kind = _GENERATOR if code.co_flags & generator_flags else _COUNT
            kinds[code] = kind
            return kind

        lines_of: dict = {}  # code -> the lines that hold its code, sorted

        def profile(frame, event, arg):
            if root[0] is not None:
                if event == "return" and frame is root[0]:
                    root[0] = None
                return
            if event == "call":
                code = frame.f_code
                kind = kinds.get(code)
                if kind is None:
                    kind = kind_of(code)
                if kind == _COUNT:
                    counts[0] += 1
                elif kind == _GENERATOR:
                    counts[2] += 1
                elif kind == _ROOT:
                    root[0] = frame
            elif event == "return":
                code = frame.f_code
                if kinds.get(code) == _COUNT:
                    lines = lines_of.get(code)
                    if lines is None:
                        lines = lines_of[code] = _code_lines(code)
                    counts[1] += _lines_run(lines, frame.f_lineno)
            elif event == "c_call":
                code = frame.f_code
                kind = kinds.get(code)
                if kind is None:
                    kind = kind_of(code)
                if kind >= _COUNT:
                    if _is_torch(arg):
                        pending.append(ops[0])
                    else:
                        counts[3] += 1
                        pending.append(None)
            elif event == "c_return" or event == "c_exception":
                if pending and (kinds.get(frame.f_code) or _SKIP) >= _COUNT:
                    made = pending.pop()
                    if made is not None and made == ops[0]:
                        counts[4] += 1

        self._profile = profile
        self._root = root
        self._pending = pending

    def install(self) -> None:
        self._thread = threading.get_ident()
        self._root[0] = None
        self._pending.clear()
        self._previous = sys.getprofile()
        self._depth = 0
        gc.callbacks.append(self._gc)
        sys.setprofile(self._profile)

    def uninstall(self) -> None:
        gc.callbacks.remove(self._gc)
        sys.setprofile(self._previous)
        self._thread = None

    def pause(self) -> None:
        self._depth += 1
        if self._depth == 1:
            sys.setprofile(None)
            if self._root[0] is sys._getframe():  # called where nothing was skipped: it returns while paused
                self._root[0] = None

    def resume(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            sys.setprofile(self._profile)

    def _gc(self, phase: str, info: dict) -> None:
        """The collector's pass (and the finalizers it runs) is not the program's."""
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self.pause()
            if self._root[0] is sys._getframe():  # this call, seen as a root, returns while paused
                self._root[0] = None
        elif self._depth > 0:
            self.resume()


# -- the programs host.json times ------------------------------------------------------

#: host.json's training steps: an 8-layer MLP (width 256, batch 32, foreach AdamW), plain,
#: under fully_shard (one unit per layer and the root), under FSDP1 (use_orig_params,
#: one unit per nn.Sequential), and the steps of three engines' adapters around it (DDP,
#: impl's ZeRO-2, DeepSpeed ZeRO-3: zerobench/engines, default options, fp32), by their key
#: prefix in host.json (the H200's of 2026-11-26 has the first three). What each makes the host
#: execute is counted on the virtual GPU by zerobench/validation/calibrate/host.py.
PROGRAMS = ("plain_mlp8", "fsdp2_mlp8", "fsdp1_mlp8", "ddp_mlp8", "impl_zero2_mlp8", "deepspeed_zero3_mlp8")
#: The programs the fitted prices (:data:`FITTED_KINDS`) are fitted on; the others are held out.
FITTED = ("plain_mlp8", "fsdp2_mlp8")

#: A host that charges nothing but counts everything (for counting a program).
COUNTING = HostPreset("counting", dispatch_s=0.0, launch_s=0.0, python_frame_s=1e-9, stream_switch_s=0.0,
                      event_record_s=0.0, wait_event_s=0.0, wait_stream_s=0.0, record_stream_s=0.0,
                      collective_s=0.0, collective_wait_s=0.0)


# -- prices from measurements ------------------------------------------------------------


def _units_from(measured: dict) -> dict[str, float]:
    """Seconds per kind from the per-call measurements of host.json (microseconds): see
    [Note: host cost]. Every figure is a difference of two measured calls."""
    def us(key: str) -> float:
        if key not in measured:
            raise ValueError(f"host measurements: {key!r} is missing (host.json's keys: {', '.join(REQUIRED)})")
        value = measured[key]
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"host measurements: {key} {value!r} is not allowed (allowed: microseconds >= 0)")
        return float(value)

    alloc = max(us("add_out_of_place_us") - us("add_inplace_us"), 0.0)  # x + 1 allocates its output; x.add_(1) not
    dispatch = max(us("empty_alloc_us") - alloc, 0.0)  # torch.empty: no kernel, one allocation
    launch = max(us("add_inplace_us") - dispatch, 0.0)
    gemm = max(us("linear_small_us") - (2 * dispatch + launch + alloc), 0.0)  # F.linear: t (a view) + mm
    event_record, wait_event = us("event_record_us"), us("wait_event_us")
    collective = us("all_gather_1mib_ws1_us")
    return {"op": dispatch * _US, "kernel": launch * _US, "gemm": gemm * _US, "alloc": alloc * _US,
            "event_record": event_record * _US, "wait_event": wait_event * _US,
            "wait_stream": (event_record + wait_event) * _US, "stream_switch": us("stream_ctx_us") * _US,
            "record_stream": us("record_stream_us") * _US, "collective": collective * _US,
            "collective_wait": max(us("all_gather_1mib_ws1_async_wait_us") - collective, 0.0) * _US}


#: host.json's keys that from_measurements needs (besides each program's counts and step).
REQUIRED = ("add_out_of_place_us", "add_inplace_us", "linear_small_us", "empty_alloc_us", "event_record_us",
            "wait_event_us", "stream_ctx_us", "record_stream_us", "all_gather_1mib_ws1_us",
            "all_gather_1mib_ws1_async_wait_us")


#: What host.json's programs make the host execute at this torch, counted on the virtual
#: GPU (zerobench.validation.calibrate.host.count_programs): a property of the programs and
#: torch, not of the machine measured, so measurements without their own counts use these.
SHIPPED_COUNTS = Path(__file__).with_name("host_counts.json")


def _program_counts(measured: dict) -> dict[str, dict[str, int]]:
    counts = measured.get("counts")
    if counts is None:
        counts = json.loads(SHIPPED_COUNTS.read_text())["counts"]
    if not isinstance(counts, dict) or not all(p in counts for p in FITTED):
        raise ValueError("host measurements: 'counts' must give what each of "
                         f"{', '.join(FITTED)} executes (zerobench.validation.calibrate.host.count_programs)")
    return counts


#: host.json's per-call loops of Python work (microseconds; zerobench/validation/calibrate/host.py):
#: a call of a one-line function (the loop's own cost with it), the same calling a C builtin,
#: a torch C entry that dispatches nothing, and resuming a generator.
PYTHON_LOOPS = ("python_noop_us", "c_builtin_us", "torch_entry_us", "generator_resume_us")


def _python_units(measured: dict) -> dict[str, float]:
    """Seconds per frame, generator entry, C builtin call and torch C entry (see
    [Note: host cost]), each the difference of two measured loops. A host.json that lacks a
    loop (the H200's of 2026-11-26 has only ``python_noop_us``) prices that kind as a
    one-line call."""
    def us(key: str) -> float:
        value = measured.get(key, measured["python_noop_us"] if key != "python_noop_us" else None)
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"host measurements: {key} {value!r} is not allowed (allowed: microseconds >= 0)")
        return float(value)

    frame = us("python_noop_us")
    c_call = max(us("c_builtin_us") - frame, 0.0) if "c_builtin_us" in measured else frame
    torch_call = max(us("torch_entry_us") - frame, 0.0) if "torch_entry_us" in measured else frame
    generator = (max(us("generator_resume_us") - frame - c_call, 0.0) if "generator_resume_us" in measured
                 else frame)  # the loop's lambda calls next(), a builtin, which resumes the generator
    return {"python_frame": frame * _US, "generator": generator * _US, "c_call": c_call * _US,
            "torch_call": torch_call * _US}


#: The prices fitted on :data:`FITTED` (what no per-call loop measures), by kind.
FITTED_KINDS = ("python_line", "foreach_tensor")


def _fit(units: dict, measured: dict, counts: dict) -> dict[str, float]:
    """Seconds per item of each of :data:`FITTED_KINDS`: least squares of the relative
    errors over :data:`FITTED` (step = counted items at their prices + the fitted kinds at
    theirs; each program's error a fraction of its step, as every error the model is judged
    by), none below zero (one that would be is 0 and the other refitted alone)."""
    rows = []  # (each fitted kind's count / step, the rest of the step / step)
    for program in FITTED:
        step_key = f"{program}_step_us"
        if step_key not in measured:
            raise ValueError(f"host measurements: {step_key!r} is missing")
        c = counts[program]
        step = measured[step_key] * _US
        rest = sum(n * units[k] for k, n in c.items() if k in units and k not in FITTED_KINDS)
        rows.append(([c.get(k, 0) / step for k in FITTED_KINDS], (step - rest) / step))

    def solve(free: list[int]) -> list[float]:
        # normal equations of the free kinds (one or two)
        a = [[sum(x[i] * x[j] for x, _ in rows) for j in free] for i in free]
        b = [sum(x[i] * y for x, y in rows) for i in free]
        if len(free) == 1:
            return [b[0] / a[0][0] if a[0][0] else 0.0]
        det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
        if det == 0:
            return [float("nan")] * 2
        return [(b[0] * a[1][1] - b[1] * a[0][1]) / det, (a[0][0] * b[1] - a[1][0] * b[0]) / det]

    prices = solve([0, 1])
    if not all(p >= 0 for p in prices):  # a kind the programs cannot carry: the other alone
        best = None
        for keep in (0, 1):
            one = max(solve([keep])[0], 0.0)
            trial = [0.0, 0.0]
            trial[keep] = one
            error = sum((y - sum(p * xi for p, xi in zip(trial, x))) ** 2 for x, y in rows)
            if best is None or error < best[0]:
                best = (error, trial)
        prices = best[1]
    if not any(prices):
        raise ValueError("host measurements: the fitted programs leave nothing to fit "
                         f"({', '.join(FITTED_KINDS)} come out 0)")
    return dict(zip(FITTED_KINDS, prices))


def from_measurements(measured: dict, name: str = "measured", source: str = "") -> HostPreset:
    """A host preset from one host's measurements: a host.json-shaped dict (times in
    microseconds, and ``counts``: what each program executes, counted on the virtual GPU
    by zerobench.validation.calibrate.host.count_programs).
    See [Note: host cost]."""
    units = _units_from(measured)
    counts = _program_counts(measured)
    units.update(_python_units(measured))
    units["api_call"] = units["python_frame"] + units["torch_call"]
    fitted = _fit(units, measured, counts)
    memory = measured.get("host_bytes_per_s", HostPreset.bytes_per_s)  # the H200's host.json has none
    if not isinstance(memory, (int, float)) or not memory > 0:
        raise ValueError(f"host measurements: host_bytes_per_s {memory!r} is not allowed (allowed: bytes/s > 0)")
    return HostPreset(name, dispatch_s=units["op"], launch_s=units["kernel"], alloc_s=units["alloc"],
                      bytes_per_s=float(memory),
                      gemm_s=units["gemm"], foreach_tensor_s=fitted["foreach_tensor"],
                      python_frame_s=units["python_frame"], python_line_s=fitted["python_line"],
                      generator_s=units["generator"], c_call_s=units["c_call"], torch_call_s=units["torch_call"], event_record_s=units["event_record"],
                      wait_event_s=units["wait_event"], wait_stream_s=units["wait_stream"],
                      stream_switch_s=units["stream_switch"], record_stream_s=units["record_stream"],
                      collective_s=units["collective"], collective_wait_s=units["collective_wait"],
                      source=source or str(measured.get("source", "")))


def fit_report(measured: dict, preset: HostPreset | None = None) -> list[dict]:
    """Each program's measured step beside the host time the preset gives its counts:
    the fitted ones, and the held-out ones (FSDP1) that check the model."""
    preset = preset or from_measurements(measured)
    rows = []
    for program, counts in _program_counts(measured).items():
        key = f"{program}_step_us"
        if key not in measured:
            continue
        modelled = preset.seconds(counts) / _US
        rows.append({"program": program, "role": "fitted" if program in FITTED else "held out",
                     "measured_us": measured[key], "modelled_us": modelled,
                     "error": modelled / measured[key] - 1})
    return rows


# -- the hosts --------------------------------------------------------------------------

#: The measured hosts: name -> (the file holding its measurements, the counts of host.json's
#: programs at this torch). The H200's host.json travels inside the package as the host of
#: the h200 GPU preset (gpus/h200.json, built from results/gpu/h200-20261126/host.json).
MEASURED = {"h200-host": (Path(__file__).with_name("gpus") / "h200.json", SHIPPED_COUNTS)}


def load_measurements(path: Path, counts_json: Path | None = None) -> dict:
    """A host.json, or the ``"host"`` of a GPU preset file, with its programs' counts (from
    ``counts_json``, when the measurements carry none)."""
    data = json.loads(Path(path).read_text())
    measured = dict(data["host"]["value"]) if "format" in data else data
    if "counts" not in measured and counts_json is not None:
        measured["counts"] = json.loads(Path(counts_json).read_text())["counts"]
    return measured


def _measured(name: str) -> HostPreset:
    path, counts_json = MEASURED[name]
    data = json.loads(path.read_text())
    source = data["host"]["source"] if "format" in data else path.name
    return from_measurements(load_measurements(path, counts_json), name=name, source=source)


HOST_PRESETS: dict[str, HostPreset] = {
    "fast": HostPreset("fast", dispatch_s=2e-6, launch_s=3e-6, source="bracket of eager PyTorch (assumed)"),
    "slow": HostPreset("slow", dispatch_s=15e-6, launch_s=10e-6, source="bracket of eager PyTorch (assumed)"),
    **{name: _measured(name) for name in MEASURED},
}

#: The host of a GPU preset that names none: the one measured host.
DEFAULT_HOST = "h200-host"


def host_preset(name: "str | HostPreset") -> HostPreset:
    """``name`` itself if it is a preset, else the preset of that name (an error naming
    the allowed ones otherwise)."""
    if isinstance(name, HostPreset):
        return name
    if name not in HOST_PRESETS:
        from zerobench.choices import not_allowed

        raise ValueError(not_allowed("host", name, HOST_PRESETS, show=str))
    return HOST_PRESETS[name]


def host_for(gpu, host: "str | HostPreset | None" = None) -> HostPreset:
    """The host a prediction runs with: ``host`` when given, else the GPU preset's own
    (``gpu.host``, when its preset file measured one), else :data:`DEFAULT_HOST`."""
    if host is not None:
        return host_preset(host)
    own = getattr(gpu, "host", None)
    if isinstance(own, HostPreset):
        return own
    if isinstance(own, dict):
        return from_measurements(own, name=f"{getattr(gpu, 'name', 'gpu')}-host")
    return HOST_PRESETS[DEFAULT_HOST]
