"""Where a step's device time goes, by kernel class (zerobench/instruments/vgpu/kernel_classes.py):
a real GPU's trace, a CPU run's trace, or the virtual GPU's, read the same way, so that
``zerobench predict --against`` can put a measured run beside its prediction.

[Note: kernel classes in a trace]
* A real GPU's kernel is classed by its name, as CUDA libraries name them: NCCL's
  (``ncclDevKernel_*``) are ``collective``; copies and fills (``Memcpy``/``Memset``
  events, ``direct_copy_kernel``, ``CatArrayBatchedCopy``, ``FillFunctor``) ``copy``;
  fused attention (FlashAttention's ``flash_fwd``/``flash_bwd``, the memory-efficient
  ``fmha_cutlass``, cuDNN's ``sdpa`` ``fprop``/``bprop``) ``attention``; multi-tensor
  kernels (``multi_tensor_apply_kernel``, fused Adam/SGD) ``optimizer``; cuBLAS and
  CUTLASS GEMMs (``gemm``, ``nvjet``, ``cutlass``, ``cublas``, ``gemv``, split-K
  reductions) ``gemm``; ATen's other kernels (``at::native::``: pointwise, reductions,
  norms, softmax, losses) and Triton's ``elementwise``; anything else ``other``. A
  kernel launched inside an optimizer step (``Optimizer.step#...`` on the host; the
  launch found through the kernel's ``correlation``) is ``optimizer`` whatever its name
  (but a copy or a collective): an optimizer that is not foreach runs ordinary
  pointwise kernels. So is an operator a CPU runs inside one. A kernel whose name no
  rule names takes the class of the ``aten::`` operator that launched it (the profiler's
  ``External id``): cuDNN attention's backward launches ``cudnn::fusion`` helpers beside
  its ``bprop`` kernel, 0.5 ms a step of the shared H200 run that were ``other``.
* A CPU run's "kernels" are its outermost ``aten::`` operators on the main thread, and
  the virtual GPU's are operators too (``mm.default``); both are classed by the
  operator's name (:func:`operator_class`). The virtual GPU names the class of each of
  its kernels (``args["class"]``) where it knows it; its communication streams are
  ``collective``.

Per step (``zerobench::step`` windows, each extended to the next step's start so that a
GPU running behind its host keeps its kernels): the busy time of each class (kernel
durations summed: two streams at once count twice), ``exposed_comm_s`` (communication
no computation hides) and ``host_idle_s`` (the step less everything the device did: on
a GPU, the device waiting on the host; on a CPU, Python and framework time between
operators).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from zerobench.instruments.vgpu.kernel_classes import KERNEL_CLASSES

from . import intervals as iv
from .overlap import WAIT_PREFIXES, comm_intervals, is_gpu_trace, step_windows
from .trace import Trace

#: (class, pattern of a real CUDA kernel's name), first match wins ([Note: kernel classes in a trace]).
CUDA_RULES: tuple[tuple[str, re.Pattern], ...] = tuple((cls, re.compile(p, re.IGNORECASE)) for cls, p in (
    ("collective", r"nccl"),
    ("copy", r"^mem(cpy|set)|copy_kernel|copykernel|CatArrayBatchedCopy|FillFunctor|fill_kernel|"
             r"split_with_sizes_copy|chunk_cat"),
    ("attention", r"flash|fmha|sdpa|attention|_attn_|cudnn.*(fprop|bprop)"),
    ("optimizer", r"multi_tensor_apply|fused_adam|fused_sgd|FusedAdam|FusedSGD|adam_kernel"),
    ("gemm", r"gemm|nvjet|cutlass|cublas|gemv|splitKreduce|xmma|_s16816|_s1688|wgmma"),
    ("elementwise", r"at::native::|elementwise|reduce_kernel|softmax|norm|triton_|cross_entropy|nll_loss"),
))

_GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot", "vdot", "einsum",
             "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution"}
_COPY_OPS = {"copy_", "_to_copy", "to", "clone", "contiguous", "cat", "stack", "fill_", "zero_", "zeros", "ones",
             "full", "zeros_like", "ones_like", "full_like", "split_with_sizes_copy", "chunk_cat", "_chunk_cat",
             "index_copy_", "narrow_copy", "_copy_from", "_copy_from_and_resize", "_foreach_copy_", "new_zeros",
             "new_ones", "new_full", "lift_fresh_copy"}
_COLLECTIVE_PREFIXES = ("c10d::", "nccl", "gloo:", "all_gather", "reduce_scatter", "all_reduce", "broadcast",
                        "_allgather", "allgather", "allreduce", "_reduce_scatter", "reduce_scatter_")


def operator_class(name: str) -> str:
    """The class of an operator's kernel from the operator's name: ``aten::mm`` (a CPU
    trace), ``mm.default`` (the virtual GPU's), ``all_gather 4.00 MiB`` (its collectives)."""
    if name.startswith(_COLLECTIVE_PREFIXES):
        return "collective"
    base = name.removeprefix("aten::").split(".")[0].split(" ")[0]
    if base in _GEMM_OPS:
        return "gemm"
    if "attention" in base or base.startswith(("_flash", "_efficient", "_cudnn_attention")):
        return "attention"
    if base in _COPY_OPS:
        return "copy"
    if base.startswith(("_foreach_", "_fused_adam", "_fused_sgd", "_fused_adagrad")):
        return "optimizer"
    if base in ("_sleep", ""):
        return "other"
    return "elementwise"


def cuda_kernel_class(name: str) -> str:
    """The class of a real CUDA kernel from its name ([Note: kernel classes in a trace])."""
    for cls, pattern in CUDA_RULES:
        if pattern.search(name):
            return cls
    return "other"


def _optimizer_steps(trace: Trace) -> np.ndarray:
    """The host's optimizer steps (``Optimizer.step#...`` spans, torch.optim's label)."""
    ev = trace.events
    steps = ev[ev["name"].str.startswith("Optimizer.step#") & (ev["cat"] != "gpu_user_annotation")]
    return steps[["ts", "end"]].to_numpy(dtype=float).reshape(-1, 2)


def _inside(ts: float, spans: np.ndarray) -> bool:
    return bool(len(spans)) and bool(((spans[:, 0] <= ts) & (ts <= spans[:, 1])).any())


def _optimizer_correlations(trace: Trace) -> set:
    """Correlation ids of the kernels launched inside an optimizer step on the host."""
    spans = _optimizer_steps(trace)
    if not len(spans):
        return set()
    ev = trace.events
    launches = ev[ev["cat"] == "cuda_runtime"]
    return {args.get("correlation") for ts, args in zip(launches["ts"], launches["args"])
            if args.get("correlation") is not None and _inside(ts, spans)}


def _launching_operators(trace: Trace) -> dict:
    """External id -> the name of the ``aten::`` operator that launched the kernels of that
    id (the profiler joins a kernel to its operator by it)."""
    ev = trace.events
    ops = ev[(ev["cat"] == "cpu_op") & ev["name"].str.startswith("aten::")]
    out: dict = {}
    for name, args in zip(ops["name"], ops["args"]):
        if isinstance(args, dict) and args.get("External id") is not None:
            out.setdefault(args["External id"], name)
    return out


def device_kernels(trace: Trace) -> pd.DataFrame:
    """The device's work in a trace, one row per kernel: ts, end, class, comm (bool).
    A GPU's kernels, copies and fills; a CPU's outermost aten operators on the main
    thread and its communication spans; the virtual GPU's stream spans."""
    ev = trace.events
    if _is_virtual(trace):
        lanes = trace.thread_names
        spans = ev[ev["cat"] == "stream"].copy()
        comm = spans["tid"].map(lambda tid: lanes.get(tid, "").startswith("stream comm"))
        named = [a.get("class") if isinstance(a, dict) else None for a in spans["args"]]
        cls = [c if c in KERNEL_CLASSES else ("collective" if is_comm else operator_class(n))
               for c, is_comm, n in zip(named, comm, spans["name"])]
        return pd.DataFrame({"ts": spans["ts"], "end": spans["end"], "class": cls, "comm": comm.to_numpy()})
    if is_gpu_trace(trace):
        k = ev[ev["cat"].isin(("kernel", "gpu_memcpy", "gpu_memset"))]
        optimizer = _optimizer_correlations(trace)
        launcher = _launching_operators(trace)
        named = [cuda_kernel_class(n) if cat == "kernel" else "copy" for n, cat in zip(k["name"], k["cat"])]
        named = [operator_class(launcher[args.get("External id")]) if c == "other" and isinstance(args, dict)
                 and args.get("External id") in launcher else c for c, args in zip(named, k["args"])]
        cls = ["optimizer" if args.get("correlation") in optimizer and c not in ("collective", "copy") else c
               for c, args in zip(named, k["args"])]
        return pd.DataFrame({"ts": k["ts"], "end": k["end"], "class": cls,
                             "comm": [c == "collective" for c in cls]})
    main = trace.main
    ops = main[(main["cat"] == "cpu_op") & main["name"].str.startswith("aten::")]
    excluded = iv.merge(main[main["name"].str.startswith(("c10d::", *WAIT_PREFIXES))][["ts", "end"]]
                        .to_numpy(dtype=float).reshape(-1, 2))
    optimizer = _optimizer_steps(trace)
    rows, outer_end = [], -np.inf
    for ts, end, name in zip(ops["ts"], ops["end"], ops["name"]):  # sorted by ts, longest first
        if ts < outer_end:
            continue  # inside an operator already counted
        outer_end = end
        if iv.total(iv.intersect(np.array([[ts, end]]), excluded)) > 0:
            continue  # inside a collective or a wait: communication
        cls = operator_class(name)
        rows.append((ts, end, "optimizer" if cls not in ("collective", "copy") and _inside(ts, optimizer) else cls,
                     False))
    comm = comm_intervals(trace)
    rows += [(a, b, "collective", True) for a, b in comm]
    return pd.DataFrame(rows, columns=["ts", "end", "class", "comm"])


def _is_virtual(trace: Trace) -> bool:
    return bool(len(trace.events)) and set(trace.events["cat"].unique()) <= {"host", "stream"}


def _windows(trace: Trace, kernels: pd.DataFrame) -> list[tuple[float, float]]:
    """Each step's window, extended to the next step's start (the last: to the end of
    the device's work after it), so that a device behind its host keeps its kernels."""
    if _is_virtual(trace):  # one measured step: the whole trace
        return [(float(trace.events["ts"].min()), float(trace.events["end"].max()))]
    w = step_windows(trace)
    starts = w["ts"].to_numpy(dtype=float)
    ends = list(starts[1:]) + [max(float(w["end"].iloc[-1]), float(kernels["end"].max()) if len(kernels) else 0.0)]
    return list(zip(starts, ends))


def class_breakdown(trace: Trace) -> pd.DataFrame:
    """One row per step: ``step_s``, ``<class>_s`` for every kernel class (busy time),
    ``busy_s`` (the device doing anything), ``exposed_comm_s`` and ``host_idle_s``; see
    [Note: kernel classes in a trace]. Seconds."""
    kernels = device_kernels(trace)
    spans = kernels[["ts", "end"]].to_numpy(dtype=float).reshape(-1, 2)
    comm = iv.merge(spans[kernels["comm"].to_numpy(dtype=bool)])
    compute = iv.merge(spans[~kernels["comm"].to_numpy(dtype=bool)])
    busy = iv.merge(spans)
    rows = []
    for step, (start, end) in enumerate(_windows(trace, kernels)):
        row = {"step": step, "step_s": (end - start) * 1e-6}
        clipped = np.clip(spans, start, end)
        durations = clipped[:, 1] - clipped[:, 0]
        for cls in KERNEL_CLASSES:
            row[f"{cls}_s"] = float(durations[(kernels["class"] == cls).to_numpy()].sum()) * 1e-6
        row["busy_s"] = iv.total(iv.clip(busy, start, end)) * 1e-6
        row["exposed_comm_s"] = iv.total(iv.clip(iv.subtract(comm, compute), start, end)) * 1e-6
        row["host_idle_s"] = row["step_s"] - row["busy_s"]
        rows.append(row)
    return pd.DataFrame(rows)


def mean_breakdown(trace: Trace) -> dict:
    """:func:`class_breakdown`'s per-step means (the trace's steps, one for the virtual GPU's)."""
    b = class_breakdown(trace)
    return {c: float(b[c].mean()) for c in b.columns if c != "step"} | {"steps": len(b)}
