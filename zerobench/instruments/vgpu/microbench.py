"""The kernels the cost model is calibrated on, as code: ``zerobench calibrate`` times them
on a GPU, the preset builder counts what the cost model makes of them
(calibration.py), and the kernel table prices them on the virtual GPU
(zerobench/validation/kernels.py). One definition, so that what was measured and
what is predicted are the same operators on the same shapes.

A measured row names its kernel and its parameters:

* ``gemm``: ``m, n, k, dtype``: ``torch.mm`` of ``[m, k]`` by ``[k, n]``, both contiguous;
  with ``layout``, either one of the three GEMMs of ``F.linear`` in a training step
  (:data:`GEMM_LAYOUTS`), with the operands' strides autograd gives them, or the
  operands' transposition itself (``nn``, ``nt``, ``tn``, ``tt``: a ``t`` operand is a
  transposed view), which is what the cost model reads from a step's strides
  ([Note: GEMM layouts] in gemm.py; :func:`gemm_layout` maps the first to the second);
* ``attention``: ``backend`` (cudnn, flash, efficient, math), ``direction`` (forward,
  backward), ``batch, heads, seq, head_dim, causal, dtype``: ``F.scaled_dot_product_attention``
  under ``torch.nn.attention.sdpa_kernel(backend)``; backward is the gradient of q, k and
  v alone;
* ``copy``: ``numel, dtype``: ``dst.copy_(src)``; ``cast``: ``shape, dtype, to``:
  ``x.to(to)``; ``h2d``: ``numel, dtype``: a pinned host buffer copied to the device;
  ``d2h``: the other way, a device buffer copied into a pinned host buffer (CPU offload's
  two directions);
* ``pointwise``: ``shape, dtype``: ``F.silu(a) * b`` (SwiGLU's gate);
* ``rms_norm``: ``shape, dtype``: ``F.rms_norm`` over the last dimension with a weight;
* ``cross_entropy``: ``shape`` ``[tokens, vocabulary]``, ``dtype``: ``F.cross_entropy``;
* ``optimizer``: ``optimizer`` (adamw, adam, sgd), ``shapes``, ``dtype``: one step of the
  foreach optimizer over parameters of those shapes (its state made by a first step).

:func:`prepare` builds a row's tensors on a device and returns what runs the kernel once.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KERNELS = ("gemm", "attention", "copy", "cast", "h2d", "d2h", "pointwise", "rms_norm", "cross_entropy", "optimizer")
#: The kernel class (kernel_classes.py) each measured kernel calibrates.
CLASS_OF = {"gemm": "gemm", "attention": "attention", "copy": "copy", "cast": "copy", "h2d": "copy", "d2h": "copy",
            "pointwise": "elementwise", "rms_norm": "elementwise", "cross_entropy": "elementwise",
            "optimizer": "optimizer"}
#: The preset figure each memory-bound kernel's rate sets.
EFFICIENCY_OF = {"copy": "copy_efficiency", "cast": "cast_efficiency", "h2d": "pcie_efficiency", "d2h": "pcie_efficiency",
                 "pointwise": "elementwise_efficiency", "rms_norm": "elementwise_efficiency",
                 "cross_entropy": "elementwise_efficiency", "optimizer": "optimizer_efficiency"}

#: The GEMMs of ``F.linear(x, weight)`` in training ([Note: GEMM layouts]).
GEMM_LAYOUTS = ("forward", "input_grad", "weight_grad")
#: Each of them as the transposition of its operands (the cost model's layouts, gemm.py).
TRANSPOSITION_OF = {"forward": "nt", "input_grad": "nn", "weight_grad": "tn"}
TRANSPOSITIONS = ("nn", "nt", "tn", "tt")

# A layer's three GEMMs as calibrate times them ([Note: GEMM layouts] in gemm.py: why each
# is priced in its own layout). For x [T, in] and weight [out, in], F.linear's forward and autograd's backward run
# three GEMMs (aten.mm, or addmm with a bias; logged on torch 2.13 by
# tests/test_calibrate.py), each ``[m, k] @ [k, n]``:
#   forward      y = x @ weight.t()     m=T,   n=out, k=in   the second operand a transposed view
#   input_grad   dx = dy @ weight       m=T,   n=in,  k=out  both contiguous
#   weight_grad  dW = dy.t() @ x        m=out, n=in,  k=T    the first operand a transposed view
# (weight_grad's mm gives dW in the weight's own layout: mm_mat2_backward computes
# (x.t() @ dy).t() as dy.t() @ x when the weight is transposed in the forward). cuBLAS
# picks other kernels for a transposed operand, and the three have different shapes: a
# layer's three GEMMs, of equal FLOPs, run at different rates (the H200, Llama 3 8B's wk at
# 8192 tokens: forward 674, input_grad 625, weight_grad 664 TFLOP/s; results/gpu/
# h200-20261126/micro.json). Calibrate times each layer GEMM in its own layout.

#: One block of Llama 3 8B (d 4096, 8 KV heads of 128, FFN 14336): its parameters' shapes.
LLAMA3_8B_BLOCK = ((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (4096, 14336),
                   (14336, 4096), (4096,), (4096,))


def describe(row: dict) -> str:
    """A short name of a measured row, for tables and logs."""
    k, p = row["kernel"], row["params"]
    if k == "gemm":
        layout = p.get("layout") or "nn"
        return f"mm {p['m']}x{p['n']}x{p['k']} {p['dtype']}" + ("" if layout == "nn" else f" {layout}")
    if k == "attention":
        return (f"sdpa {p['backend']} {p['direction']} ({p['batch']},{p['heads']},{p['seq']},{p['head_dim']})"
                f"{' causal' if p.get('causal') else ''} {p['dtype']}")
    if k == "optimizer":
        numel = sum(_numel(s) for s in p["shapes"])
        return f"{p['optimizer']} foreach step, {_count(numel)} params {p['dtype']}"
    if k in ("copy", "h2d", "d2h"):
        nbytes = p['numel'] * DTYPES[p['dtype']].itemsize
        return f"{k} {nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{k} {nbytes / 2**10:.0f} KiB"
    if k == "cast":
        return f"cast {p['dtype']}->{p['to']} {list(p['shape'])}"
    return f"{k} {list(p['shape'])} {p['dtype']}"


def _count(n: int) -> str:
    """218M, 1.3M, 64k, 512: a count to two significant figures or more."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.{0 if n >= 10 * size else 1}f}{suffix}"
    return str(n)


def gemm_layout(p: dict) -> str:
    """A GEMM row's operands' transposition (``nn``, ``nt``, ``tn``, ``tt``): the one its
    ``layout`` names or implies (``forward`` is ``nt``), ``nn`` when it names none."""
    layout = p.get("layout") or "nn"
    layout = TRANSPOSITION_OF.get(layout, layout)
    if layout not in TRANSPOSITIONS:
        raise ValueError(f"gemm layout {p.get('layout')!r} is not allowed (allowed: {', '.join(GEMM_LAYOUTS)}, "
                         f"{', '.join(TRANSPOSITIONS)}, or none)")
    return layout


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def gemm_flops(p: dict) -> int:
    return 2 * p["m"] * p["n"] * p["k"]


def prepare(row: dict, device: torch.device | str, pin: bool | None = None) -> Callable[[], object]:
    """The row's tensors on ``device``, and a function that runs its kernel once. ``pin``:
    whether ``h2d``'s and ``d2h``'s host buffer is made with ``pin_memory=True`` (default: on a CUDA
    device). The virtual GPU's pricing passes True: a pinned buffer is what its dispatch
    mode takes for host memory, so the copy crosses PCIe there as it does on the GPU
    (without it, the "host" buffer would be device memory and the copy an HBM one)."""
    kernel, p = row["kernel"], row["params"]
    device = torch.device(device)
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not allowed (allowed: {', '.join(KERNELS)})")
    dtype = DTYPES[p["dtype"]]
    if kernel == "gemm":
        return _gemm(p, dtype, device)
    if kernel == "attention":
        return _attention(p, dtype, device)
    if kernel == "copy":
        src = torch.randn(p["numel"], dtype=dtype, device=device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    if kernel == "h2d":
        src = torch.randn(p["numel"], dtype=dtype, pin_memory=device.type == "cuda" if pin is None else pin)
        dst = torch.empty(p["numel"], dtype=dtype, device=device)
        return lambda: dst.copy_(src, non_blocking=True)
    if kernel == "d2h":
        src = torch.randn(p["numel"], dtype=dtype, device=device)
        dst = torch.empty(p["numel"], dtype=dtype, pin_memory=device.type == "cuda" if pin is None else pin)
        return lambda: dst.copy_(src, non_blocking=True)
    if kernel == "cast":
        x = torch.randn(*p["shape"], dtype=dtype, device=device)
        to = DTYPES[p["to"]]
        return lambda: x.to(to)
    if kernel == "pointwise":
        a = torch.randn(*p["shape"], dtype=dtype, device=device)
        b = torch.randn(*p["shape"], dtype=dtype, device=device)
        return lambda: F.silu(a) * b
    if kernel == "rms_norm":
        x = torch.randn(*p["shape"], dtype=dtype, device=device)
        w = torch.ones(p["shape"][-1], dtype=dtype, device=device)
        return lambda: F.rms_norm(x, (p["shape"][-1],), w, 1e-5)
    if kernel == "cross_entropy":
        tokens, vocabulary = p["shape"]
        logits = torch.randn(tokens, vocabulary, dtype=dtype, device=device)
        target = torch.randint(0, vocabulary, (tokens,), device=device)
        return lambda: F.cross_entropy(logits, target)
    return _optimizer(p, dtype, device)


def _gemm(p: dict, dtype, device) -> Callable[[], object]:
    """``[m, k] @ [k, n]`` with the operands' strides of its layout ([Note: GEMM layouts]):
    a ``t`` operand made as the transposed view autograd hands to ``aten.mm``."""
    m, n, k = p["m"], p["n"], p["k"]
    layout = gemm_layout(p)
    a = (torch.randn(k, m, dtype=dtype, device=device).t() if layout[0] == "t"
         else torch.randn(m, k, dtype=dtype, device=device))
    b = (torch.randn(n, k, dtype=dtype, device=device).t() if layout[1] == "t"
         else torch.randn(k, n, dtype=dtype, device=device))
    return lambda: torch.mm(a, b)


def _attention(p: dict, dtype, device) -> Callable[[], object]:
    import contextlib

    shape = (p["batch"], p["heads"], p["seq"], p["head_dim"])
    backward = p["direction"] == "backward"
    q, k, v = (torch.randn(*shape, dtype=dtype, device=device, requires_grad=backward) for _ in range(3))

    def backend():
        if device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
        return sdpa_kernel(names[p["backend"]])

    def forward():
        with backend():
            return F.scaled_dot_product_attention(q, k, v, is_causal=bool(p.get("causal")))

    if not backward:
        return forward
    out = forward()
    grad = torch.randn_like(out)

    def run():
        with backend():
            return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    return run


def _optimizer(p: dict, dtype, device) -> Callable[[], object]:
    params = [torch.nn.Parameter(torch.randn(*s, dtype=dtype, device=device)) for s in p["shapes"]]
    for param in params:
        param.grad = torch.randn_like(param)
    name = p["optimizer"]
    if name == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    elif name == "adam":
        opt = torch.optim.Adam(params, lr=1e-4, foreach=True)
    elif name == "sgd":
        opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=True)
    else:
        raise ValueError(f"optimizer {name!r} is not allowed (allowed: adamw, adam, sgd)")
    opt.step()  # its state, as after the first step of training
    return opt.step
