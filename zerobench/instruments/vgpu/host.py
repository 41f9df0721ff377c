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
  ``alloc_s`` for each output the caching allocator hands it;
* the stream and event calls of ``torch.cuda`` the engines make, each at its own
  measured price: ``Event.record``, ``Stream.wait_event``, ``with torch.cuda.stream(s)``
  (entering and leaving), ``record_stream``; ``wait_stream`` is an event record and a
  wait, as torch implements it; calls that were not measured (``current_stream``,
  making a stream or an event) cost one Python call, as the Python functions they are;
* every collective call (NCCL's enqueue and c10d's Python around it), and the
  ``wait()`` of an asynchronous one;
* every *Python function call* the host thread makes in the engines', torch's, the
  model's and the harness's code (:class:`PythonCalls`), at ``python_call_s``: the
  average cost of a call with the work done in it, fitted on whole training steps.

What is not counted is what only this CPU runs: the virtual GPU's own code and every
other instrument's (zerobench/instruments/, which the counter skips with everything
they call), fake tensors (torch/_subclasses/), the Python dispatch mode's lookup of
its rules, imports made on first use, the garbage collector's pass, and the standard
library's own frames (their callees in torch are counted): Python's version should not
move a prediction, and ``python_call_s`` is fitted on calls counted the same way. Nor
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
without a kernel that allocates, ``F.linear`` a view and a GEMM. ``python_call_s`` is
the one figure fitted, by least squares of the relative errors over the plain and
fully_shard training steps
of an 8-layer MLP (their counts made on the virtual GPU by
zerobench/validation/calibrate/host.py's ``count_programs``);
the FSDP1 step is held out, to check the model: :func:`fit_report`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path

#: What the host is charged for, by kind (VirtualGpu.host_counts). See [Note: host cost].
KINDS = ("op", "kernel", "gemm", "alloc", "python_call", "api_call", "event_record", "wait_event", "wait_stream",
         "stream_switch", "record_stream", "collective", "collective_wait")

_US = 1e-6


@dataclass(frozen=True)
class HostPreset:
    """What the CPU thread pays for what it does ([Note: host cost]). Times in seconds.

    The stream and collective prices default to one ``dispatch_s`` each, and a
    ``python_call_s`` of 0 turns the counting of Python calls off: the presets ``fast``
    and ``slow`` price operators only, as the virtual GPU did before it counted more."""

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
    python_call_s: float = 0.0
    """Each Python function call of the engines', torch's, the model's and the harness's
    code (0: not counted)."""
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
        """Whether the Python calls between operators are counted and charged."""
        return self.python_call_s > 0

    def units(self) -> dict[str, float]:
        """Seconds per item of each kind the host is charged for (:data:`KINDS`)."""
        return {"op": self.dispatch_s, "kernel": self.launch_s, "gemm": self.gemm_s, "alloc": self.alloc_s,
                "python_call": self.python_call_s, "api_call": self.python_call_s,
                "event_record": self.event_record_s, "wait_event": self.wait_event_s,
                "wait_stream": self.wait_stream_s, "stream_switch": self.stream_switch_s,
                "record_stream": self.record_stream_s, "collective": self.collective_s,
                "collective_wait": self.collective_wait_s}

    def seconds(self, counts: dict) -> float:
        """Host time of ``counts`` (kind -> how many)."""
        units = self.units()
        return sum(n * units[kind] for kind, n in counts.items())


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

#: What a code object's frames are to the counter.
_SKIP, _COUNT, _ROOT = 0, 1, 2


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if paths.get(k)})


class PythonCalls:
    """Counts the Python function calls the host thread makes while installed: see
    [Note: host cost] for which ones. ``calls[0]`` is the count.

    It is a ``sys.setprofile`` function of the thread that installs it (Python 3.11 has
    no cheaper hook), restored to the previous one on :meth:`uninstall`. The virtual GPU
    pauses it where it runs its own code (:meth:`pause` / :meth:`resume`, which nest),
    so that what it spends there costs no profiling; other instruments' code is skipped
    by the counter itself, as a subtree whose root is their frame."""

    def __init__(self):
        self.calls = [0]
        self._depth = 0  # pauses in effect
        self._previous = None
        self._thread: int | None = None
        kinds: dict = dict.fromkeys(_root_codes(), _ROOT)
        instruments, stdlib = _instrument_dir(), _stdlib_dirs()
        root: list = [None]  # the frame whose subtree is not counted, while one runs
        calls = self.calls

        def kind_of(code) -> int:
            path = code.co_filename
            if path.startswith(instruments) or any(part in path for part in _ROOT_PARTS):
                kind = _ROOT
            elif path.startswith("<") or (path.startswith(stdlib) and "-packages" not in path):
                kind = _SKIP
            else:
                kind = _COUNT
            kinds[code] = kind
            return kind

        def profile(frame, event, arg):
            if event == "call":
                if root[0] is None:
                    code = frame.f_code
                    kind = kinds.get(code)
                    if kind is None:
                        kind = kind_of(code)
                    if kind == _COUNT:
                        calls[0] += 1
                    elif kind == _ROOT:
                        root[0] = frame
            elif event == "return" and frame is root[0]:
                root[0] = None

        self._profile = profile
        self._root = root

    def install(self) -> None:
        self._thread = threading.get_ident()
        self._root[0] = None
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
#: one unit per nn.Sequential), by their key prefix in host.json. What each makes the host
#: execute is counted on the virtual GPU by zerobench/validation/calibrate/host.py.
PROGRAMS = ("plain_mlp8", "fsdp2_mlp8", "fsdp1_mlp8")
#: The programs python_call_s is fitted on; the others are held out.
FITTED = ("plain_mlp8", "fsdp2_mlp8")

#: A host that charges nothing but counts everything (for counting a program).
COUNTING = HostPreset("counting", dispatch_s=0.0, launch_s=0.0, python_call_s=1e-9, stream_switch_s=0.0,
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


def _fit_python_call(units: dict, measured: dict, counts: dict) -> float:
    """Least squares of the relative errors over :data:`FITTED`: step = counted items at
    their prices + Python calls x python_call_s (the unmeasured API calls count as Python
    calls); each program's error counts as a fraction of its step, as every error the
    model is judged by."""
    num = den = 0.0
    for program in FITTED:
        step_key = f"{program}_step_us"
        if step_key not in measured:
            raise ValueError(f"host measurements: {step_key!r} is missing")
        c = counts[program]
        step = measured[step_key] * _US
        calls = (c.get("python_call", 0) + c.get("api_call", 0)) / step
        rest = sum(n * units[k] for k, n in c.items() if k in units)
        num += calls * (step - rest) / step
        den += calls * calls
    if den == 0:
        raise ValueError("host measurements: the fitted programs made no Python call")
    return max(num / den, 0.0)


def from_measurements(measured: dict, name: str = "measured", source: str = "") -> HostPreset:
    """A host preset from one host's measurements: a host.json-shaped dict (times in
    microseconds, and ``counts``: what each program executes, counted on the virtual GPU
    by zerobench.validation.calibrate.host.count_programs).
    See [Note: host cost]."""
    units = _units_from(measured)
    counts = _program_counts(measured)
    python_call = _fit_python_call(units, measured, counts)
    return HostPreset(name, dispatch_s=units["op"], launch_s=units["kernel"], alloc_s=units["alloc"],
                      gemm_s=units["gemm"], python_call_s=python_call, event_record_s=units["event_record"],
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
