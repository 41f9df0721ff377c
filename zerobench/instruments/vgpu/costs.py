"""How long an operator runs on the virtual GPU, and which class of kernel it is: a
roofline over FLOPs and the bytes each kernel moves, every class priced from its own
measurement (presets.py).

[Note: operator cost]
Every kernel has a class (kernel_classes.py) and, for an operator that launches one,

    duration = max(compute_s, bytes / bandwidth(class)) + floor

* ``gemm`` (``mm``, ``addmm``, ``bmm``, ``baddbmm``; convolutions and anything else
  ``torch.utils.flop_counter`` counts FLOPs for): its measured time where the preset
  timed that layout, shape and dtype alone, else its FLOPs at the card's large-GEMM rate
  for its layout times the shape factor of gemm.py ([Note: GEMM shapes]: tile and wave
  quantisation, small K; [Note: GEMM layouts]); ``floor`` is ``gemm_floor_s``;
* ``attention``: fused SDPA, forward or backward: its FLOPs (half when causal, as the
  fused kernels skip the masked half of the score matrix) at the efficiency of the
  backend torch picks ([Note: SDPA backend choice] in sdpa.py), measured per backend and
  direction, and over sequence length and head size where the preset has a grid
  ([Note: attention over shapes]); the math backend is priced as the kernels it launches (two or four batched
  GEMMs, and passes over the score matrix);
* ``optimizer``: an optimizer's multi-tensor (``_foreach_*``) and fused kernels, at the
  measured rate of a foreach AdamW step;
* ``copy``: copies, fills and concatenations, at the measured rate of a device copy
  (``nll_loss_backward`` too: its time is the zero-fill of its gradient);
* ``elementwise``: every other kernel (pointwise, activations, norms, softmax, losses,
  reductions), at the rate measured on such kernels;
* a copy or a pointwise kernel that PyTorch does not vectorize (a cast other than fp32
  to bf16 or fp16, a broadcast or strided operand, operands of mixed dtypes) at the rate
  of the measured unvectorized kernel, the bf16 to fp32 cast: [Note: vectorized kernels].

The bytes are what the kernel moves through HBM: [Note: passes over memory]. Compute
runs at the clocks of a card under load: [Note: clocks under load]. The dtype of the
peak is that of the first floating-point input. This is PyTorch's ``RuntimeEstimator``
roofline with measured rates in place of its peaks.

Operators that launch no kernel cost only host time: views and other metadata-only
operators, ``empty``-style allocations, ``record_stream``, the few that only read a
tensor's metadata, and the dispatcher ops of collectives and of ``record_function``.

[Note: passes over memory]
A kernel's bytes are those of its tensor inputs read and its outputs written, counted as
PyTorch's CUDA kernels move them:

* an expanded (stride-0) input counts once per element it really holds, as
  ``torch.utils._runtime_estimation.get_num_bytes`` counts it; the same tensor given twice
  (``_foreach_addcmul_(v, g, g)``) is read once;
* an argument the operator writes in place counts as written too, also where the
  operator returns nothing (every in-place ``_foreach_*`` op: without it, a foreach AdamW
  step was priced at a third of its traffic); ``copy_`` and fills do not read their
  destination;
* a gather reads what it gathers, not its whole source (``embedding``, ``index_select``,
  ``gather``, ``nll_loss_forward``); ``nll_loss_backward`` reads its input's shape only;
* softmax and log-softmax over a row larger than a block's shared memory (48 KiB, the
  ``sharedMemPerBlock`` of every NVIDIA part since Volta) read the row three times (its
  maximum, its sum, the output: ``cunn_SoftMaxForward`` in SoftMax.cu) and their backward
  reads the incoming gradient twice; a row that fits is loaded once
  (``cunn_SoftMaxForwardSmem``). A cross-entropy over a 128k vocabulary is the first kind;
* the fused RMSNorm reads its input twice, for the row's statistics and then to normalise
  it (layer_norm_kernel.cu, ``vectorized_layer_norm_kernel_impl``), and its backward is two
  kernels (fused.py, [Note: fused on the GPU]).

[Note: vectorized kernels]
PyTorch's CUDA pointwise kernels (``gpu_kernel`` in ATen's CUDALoops.cuh) take one of two
paths. When every operand is laid out the same way, densely, with no broadcast, and no
operand needs converting to the kernel's dtype, it loads and stores 4-16 bytes per
thread at once (``vectorized_elementwise_kernel``); otherwise it loads element by element
through an offset calculator or a casting loader (``unrolled_elementwise_kernel``,
``elementwise_kernel<128, ...>``). The copy kernel is one of them, with one exception:
fp32 to bf16 or fp16 has its own vectorized kernel (``bfloat16_copy_kernel_cuda``,
``float16_copy_kernel_cuda`` in Copy.cu). The H200's step shows the two rates apart
(results/gpu/h200-20261128/llama3-8b-l4-ws1-deepspeed/traces, by kernel name): its
fp32-to-bf16 casts at 4.2-4.4 TB/s, a copy's rate, its bf16-to-fp32 casts at 1.85-2.0
TB/s, the rate micro.json measured for that cast (2.1); rotary embedding's broadcast
products and strided copies at 0.8-3.2 TB/s. Pricing every cast at the
upcast's rate made the step's copies 21 % too slow (its downcasts twice too slow) and
every kernel at the vectorized rate made its pointwise work too fast. So a copy
(``copy_``, ``_to_copy``, ``clone``, ``contiguous``) or a pointwise operator
(``torch.Tag.pointwise``) whose operands are not all of one shape, one set of strides
(dense) and one dtype (but fp32 to bf16/fp16) runs at ``bandwidth("cast")``: the
measured unvectorized kernel. Zero-dimensional operands are scalars to the kernel and
do not count. Concatenations, fills, reductions and the other kernels keep their class's
rate.

[Note: attention over shapes]
A fused attention kernel's efficiency moves with the shape: cuDNN's causal forward on the
H200 reached 47 % of the peak at sequence 4096 and 60 % at 8192 (head 128;
results/gpu/h200-20261128/calibrate and ../h200-20261126/micro.json), as short sequences
leave more of each tile masked and the kernel's fixed cost larger. A preset whose
``attention_grid`` has rows for the backend that runs prices it over sequence length and
head size: the nearest measured head size (by ratio: 64 for 80, 128 for 96), then linear
in log2 of the sequence length between the two measured lengths around it, the nearest
end's figure beyond them. A backend without rows takes the preset's one pair
(``attention_<backend>``), measured at one shape. ``zerobench calibrate`` measures the
grid (sequence 1024, 4096, 8192; head 64, 128) and the builder writes it
(calibration.py); the shipped ``h200`` has one shape measured in the files it is built
from (8192, head 128), so it has no grid and prices every shape at that pair.

[Note: clocks under load]
A GPU runs compute-bound kernels at the clock its power limit allows. In a burst (a
microbenchmark's few milliseconds, or a step that leaves the card mostly idle) it boosts;
kept busy, it settles within a second to what the power limit sustains. The H200 ran an
8192^3 GEMM at 777 TFLOP/s in a burst and at 668-672 TFLOP/s in six 2-second windows
back to back, its power at 690-695 W of its 700 W limit and its SM clock at 1,410-1,530
MHz (results/gpu/h200-20261126/micro.log, smi.csv): a sustained ratio of 0.862
(``sustained_ratio``, clocks ``sustained``).

A training step is not such a loop. Its memory-bound kernels, copies and waits on the
host draw less power than GEMMs, and the card stays under its limit: the H200's traced
Llama steps (results/gpu/h200-20261128/llama3-8b-l4-ws1-deepspeed) drew 640-680 W of its
700 at 1,560-1,740 MHz, and ran each GEMM layout at 0.90-0.98 times the time its
kernels took alone in a burst, attention at 1.03-1.08 (``python -m
zerobench.validation.step_kernels``; docs/vgpu.md, "GEMMs as steps run them"). A
preset says what compute runs at in a step (``step_ratio``, clocks ``step``, the
default) where traced steps showed it: 1.0 on the H200, no factor; a preset without it
runs steps at the sustained ratio, the safe side when nothing was traced. The step's
figure is read off kernels in a trace, not fitted to a step's time. Memory-bound kernels
keep their rate: HBM's clock does not move (3,201 MHz throughout smi.csv).

A card capped below its board limit (``power_cap_w``) sustains a lower clock. Dynamic
power goes with frequency times voltage squared, and voltage with frequency across the
DVFS range, so the power above idle goes with the clock cubed: the rate scales by
``((cap - idle) / (limit - idle)) ** (1/3)``, with ``idle_power_w`` the board's power with
a context and nothing running (124 W on the H200). A textbook approximation, not a
measurement: the H200 has not been measured capped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from zerobench.instruments.storages import local_tensor, tensors_in
from zerobench.instruments.vgpu import gemm
from zerobench.instruments.vgpu.presets import GpuPreset

aten = torch.ops.aten

# Operators that allocate or alias memory without running a kernel.
NO_KERNEL = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.detach.default, aten.alias.default, aten.lift_fresh.default,
    aten.set_.source_Storage_storage_offset, aten.set_.source_Storage, aten.set_.source_Tensor, aten.set_.default,
    aten.resize_.default, aten.record_stream.default, aten._local_scalar_dense.default, aten.sym_size.int,
    aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default, aten.is_same_size.default,
    aten._has_compatible_shallow_copy_type.default, aten.is_nonzero.default,
    aten._unsafe_view.default,  # a view that autograd does not track as one
}

# Namespaces whose operators never run a kernel of their own: ``prim`` (metadata such
# as a fake tensor's ``prim::device``), ``profiler`` (``record_function``'s markers) and
# ``c10d`` (a collective's dispatcher op: its time is the communication stream's, set
# by the link model where the ``torch.distributed`` call is made).
NO_KERNEL_NAMESPACES = {"prim", "profiler", "c10d"}

# Operators after which the host has the value of a device tensor: it waits for the stream.
SYNCHRONIZING = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
                 aten.equal.default}

#: cuBLAS GEMMs: they take a cuBLAS handle and its workspace (allocator.py,
#: [Note: cuBLAS workspaces] in device.py).
CUBLAS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}

# Fused attention, as the CPU build runs it: priced as the GPU's backend would run it.
ATTENTION_FORWARD = {aten._scaled_dot_product_flash_attention_for_cpu.default}
ATTENTION_BACKWARD = {aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
ATTENTION = ATTENTION_FORWARD | ATTENTION_BACKWARD

#: Operators of the copy class: copies, casts, fills and concatenations.
COPY_OPS = {"copy_", "_to_copy", "clone", "cat", "stack", "fill_", "zero_", "zeros", "ones", "full", "zeros_like",
            "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "scalar_tensor", "_copy_from",
            "_copy_from_and_resize", "index_copy", "index_copy_", "split_with_sizes_copy", "contiguous"}
#: Operators whose CUDA time is a fill: ``nll_loss_backward`` zeroes its whole gradient
#: (``grad_input.zero_()`` in Loss.cu, a ``FillFunctor`` kernel: 0.45 ms for each half of
#: the [8192, 128256] fp32 gradient in the H200's step) and scatters one element per row
#: (0.01 ms): a copy-class kernel, as a real trace classes it.
_FILLS = {"nll_loss_backward", "nll_loss2d_backward"}
#: Operators that write their output without reading their destination.
_WRITE_ONLY = {"fill_", "zero_"}
#: Fused optimizer kernels (the ``fused=True`` optimizers of torch.optim).
_FUSED_OPTIMIZERS = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_", "_fused_adam",
                     "_fused_adamw", "_fused_sgd"}
#: sharedMemPerBlock of every NVIDIA part since Volta: a softmax row that fits is read once.
SMEM_PER_BLOCK = 48 * 1024


def launches_kernel(func) -> bool:
    return not func.is_view and func not in NO_KERNEL and func.namespace not in NO_KERNEL_NAMESPACES


_CLASS: dict = {}


def kernel_class(func) -> str:
    """The class of the kernel ``func`` launches (kernel_classes.py)."""
    cls = _CLASS.get(func)
    if cls is None:
        name = func._overloadpacket.__name__
        if func in ATTENTION or name.startswith("_scaled_dot_product") or name.startswith("_efficient_attention") \
                or name.startswith("_flash_attention") or name.startswith("_cudnn_attention"):
            cls = "attention"
        elif func in CUBLAS or func._overloadpacket in flop_registry:
            cls = "gemm"
        elif name.startswith("_foreach_") or name in _FUSED_OPTIMIZERS:
            cls = "optimizer"
        elif name in COPY_OPS or name in _FILLS:
            cls = "copy"
        else:
            cls = "elementwise"
        _CLASS[func] = cls
    return cls


# Namespaces of operators the host pays nothing for as operators: ``prim`` (a fake
# tensor's metadata, which a GPU's tensor answers without dispatching) and ``c10d`` (a
# collective's dispatcher op, inside the collective call's own price): [Note: host cost].
NO_HOST_NAMESPACES = {"prim", "c10d"}


def charges_host(func) -> bool:
    """Whether the host pays for this operator as one dispatched operator."""
    return func.namespace not in NO_HOST_NAMESPACES


#: cuBLAS GEMMs, any overload: their launch costs the host more ([Note: host cost]).
GEMM_PACKETS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}


def is_gemm(func) -> bool:
    return func._overloadpacket in GEMM_PACKETS


def is_foreach(func) -> bool:
    """A ``_foreach_*`` operator: one call over lists of tensors ([Note: host cost])."""
    return func.name().startswith("aten::_foreach_")


def _tensors(obj) -> list:
    return list(tensors_in(obj))


def _distinct(tensors) -> list:
    """Each tensor once (the same tensor given twice is read once)."""
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements this rank's tensor spans (a DTensor by its local shard)."""
    t = local_tensor(t)
    return t.numel() * t.element_size()


def accessed_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads or writes for ``t``: an expanded (stride-0) dimension counts
    once, as ``torch.utils._runtime_estimation.get_num_bytes`` counts it."""
    t = local_tensor(t)
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


_MUTATED: dict = {}


def _mutated_args(func) -> tuple[int, ...]:
    """Indices of the arguments ``func`` writes in place (its schema's ``(a!)``)."""
    found = _MUTATED.get(func)
    if found is None:
        found = tuple(i for i, a in enumerate(func._schema.arguments)
                      if a.alias_info is not None and a.alias_info.is_write)
        _MUTATED[func] = found
    return found


def _row_bytes(t: torch.Tensor, dim: int) -> int:
    return t.shape[dim] * t.element_size() if t.dim() else t.element_size()


def _softmax_bytes(args, out) -> int:
    x, dim = args[0], args[1]
    reads = 3 if _row_bytes(x, dim) > SMEM_PER_BLOCK else 1
    return reads * accessed_bytes(x) + sum(accessed_bytes(t) for t in tensors_in(out))


def _softmax_backward_bytes(args, out) -> int:
    grad, output, dim = args[0], args[1], args[2]
    reads = 2 if _row_bytes(grad, dim) > SMEM_PER_BLOCK else 1
    return reads * accessed_bytes(grad) + accessed_bytes(output) + sum(accessed_bytes(t) for t in tensors_in(out))


def _gather_bytes(args, out) -> int:
    """A gather reads what it writes from its source, and its indices."""
    written = sum(accessed_bytes(t) for t in tensors_in(out))
    indices = sum(accessed_bytes(t) for t in tensors_in(args[1:]) if not t.is_floating_point())
    return 2 * written + indices


def _nll_loss_forward_bytes(args, out) -> int:
    x, target = args[0], args[1]
    return accessed_bytes(target) + target.numel() * x.element_size() + sum(accessed_bytes(t) for t in
                                                                            tensors_in(out))


def _nll_loss_backward_bytes(args, out) -> int:
    grad, target = args[0], args[2]
    return accessed_bytes(grad) + accessed_bytes(target) + sum(accessed_bytes(t) for t in tensors_in(out))


def _copy_bytes(args, out) -> int:
    return accessed_bytes(args[1]) + tensor_bytes(args[0])


def _write_only_bytes(args, out) -> int:
    return sum(accessed_bytes(t) for t in tensors_in(out)) or accessed_bytes(args[0])


_BYTES_RULES = {
    "_softmax": _softmax_bytes, "_log_softmax": _softmax_bytes,
    "_softmax_backward_data": _softmax_backward_bytes, "_log_softmax_backward_data": _softmax_backward_bytes,
    "embedding": _gather_bytes, "index_select": _gather_bytes, "gather": _gather_bytes,
    "nll_loss_forward": _nll_loss_forward_bytes, "nll_loss_backward": _nll_loss_backward_bytes,
    "copy_": _copy_bytes, "fill_": _write_only_bytes, "zero_": _write_only_bytes,
}


def kernel_bytes(func, args, kwargs, out) -> int:
    """What the kernel moves through HBM: [Note: passes over memory]."""
    rule = _BYTES_RULES.get(func._overloadpacket.__name__)
    if rule is not None:
        return rule(args, out)
    nbytes = sum(accessed_bytes(t) for t in _distinct(tensors_in((args, kwargs))))
    outputs = _tensors(out)
    if outputs:
        return nbytes + sum(accessed_bytes(t) for t in outputs)
    for i in _mutated_args(func):  # written in place, nothing returned (in-place foreach ops)
        if i < len(args):
            nbytes += sum(accessed_bytes(t) for t in tensors_in(args[i]))
    return nbytes


def flops(func, args, kwargs, out) -> int:
    counter = flop_registry.get(func._overloadpacket)
    if counter is None:
        return 0
    try:
        return int(counter(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - an overload the registry's shape rule does not cover
        return 0


def attention_shape(func, args) -> tuple[torch.dtype, int]:
    """(dtype, head size) of a fused attention call: what picks its backend (sdpa.py)."""
    q = args[0] if func in ATTENTION_FORWARD else args[1]
    return q.dtype, int(q.shape[-1])


def _causal(func, args, kwargs) -> bool:
    if func in ATTENTION_FORWARD:
        return bool(args[4] if len(args) > 4 else kwargs.get("is_causal", False))
    return bool(args[7] if len(args) > 7 else kwargs.get("is_causal", False))


def attention_flops(func, args, kwargs) -> int:
    """FLOPs of the fused attention kernel this CPU build runs in place of a GPU's
    (``flop_counter`` has no rule for the CPU variant): the shapes' matmul FLOPs, half of
    them when causal, as a flash kernel skips the masked half of the score matrix."""
    n = _full_attention_flops(func, args)
    return n // 2 if _causal(func, args, kwargs) else n


def _full_attention_flops(func, args) -> int:
    if func in ATTENTION_FORWARD:
        q, k, v = args[:3]
        return sdpa_flop_count(q.shape, k.shape, v.shape)
    grad_out, q, k, v = args[:4]
    return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


class Cost(NamedTuple):
    """One kernel's modelled cost on an idle device."""

    compute_s: float
    memory_s: float
    floor_s: float
    flops: int
    nbytes: int
    kind: str = "other"
    """its class (kernel_classes.py)"""

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.floor_s


def _math_attention(func, args, kwargs, gpu: GpuPreset) -> Cost:
    """The math backend: the batched GEMMs it launches (two forward, four backward, over
    the whole score matrix: it computes the masked half too) and its passes over the
    score matrix (forward: written, masked, softmaxed and read back, five; backward:
    eight)."""
    q, k = (args[0], args[1]) if func in ATTENTION_FORWARD else (args[1], args[2])
    batch = 1
    for size in q.shape[:-2]:
        batch *= size
    s_q, s_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    n_flops = _full_attention_flops(func, args)
    factor = (gemm.shape_factor(batch, s_q, s_k, d, gpu.sm_count) + gemm.shape_factor(batch, s_q, d, s_k, gpu.sm_count)) / 2
    compute_s = n_flops / (gpu.flops_per_s(q.dtype) * factor)
    passes = 5 if func in ATTENTION_FORWARD else 8
    scores = batch * s_q * s_k * q.element_size()
    memory_s = passes * scores / gpu.bandwidth("elementwise")
    kernels = 5 if func in ATTENTION_FORWARD else 8
    return Cost(compute_s + memory_s, 0.0, kernels * gpu.kernel_floor_s, n_flops, passes * scores, "attention")


def kernel_cost(func, args, kwargs, out, gpu: GpuPreset, attention_backend: str | None = None) -> Cost:
    """The parts of one kernel's time on ``gpu``. See [Note: operator cost].
    ``attention_backend``: the SDPA backend of an attention kernel (sdpa.py chooses it)."""
    kind = kernel_class(func)
    if kind == "attention" and func in ATTENTION:
        if attention_backend is None:
            from zerobench.instruments.vgpu import sdpa

            dtype, head_dim = attention_shape(func, args)
            attention_backend = sdpa.choose(dtype, head_dim, gpu.sm_major)
        if attention_backend == "math":
            return _math_attention(func, args, kwargs, gpu)
        n_flops = attention_flops(func, args, kwargs)
        dtype, head_dim = attention_shape(func, args)
        seq = int((args[0] if func in ATTENTION_FORWARD else args[1]).shape[-2])
        efficiency = gpu.attention_efficiency(attention_backend, backward=func in ATTENTION_BACKWARD, seq=seq,
                                              head_dim=head_dim)
        compute_s = n_flops / (gpu.peak(dtype) * efficiency * gpu.compute_scale)
        nbytes = kernel_bytes(func, args, kwargs, out)
        return Cost(compute_s, nbytes / gpu.bandwidth("copy"), gpu.kernel_floor_s, n_flops, nbytes, kind)
    nbytes = kernel_bytes(func, args, kwargs, out)
    if kind == "gemm":
        inputs = _tensors((args, kwargs))
        dtype = next((t.dtype for t in inputs if t.is_floating_point()), torch.float32)
        n_flops = flops(func, args, kwargs, out)
        compute_s = n_flops / gpu.flops_per_s(dtype) if n_flops else 0.0
        floor = gpu.kernel_floor_s
        shape = gemm.dims(func._overloadpacket.__name__, [tuple(local_tensor(t).shape) for t in inputs])
        if shape is not None:
            floor = gpu.gemm_floor_s
            layout = gemm.layout(local_tensor(inputs[-2]), local_tensor(inputs[-1]))
            measured = gpu.measured_gemm(layout, *shape[1:], dtype) if shape[0] == 1 else None
            if measured is not None:  # timed alone in a burst, its floor included
                compute_s = max(measured - floor, 0.0) / gpu.compute_scale
            else:
                compute_s = n_flops / gpu.flops_per_s(dtype, layout) / gemm.shape_factor(*shape, gpu.sm_count)
        return Cost(compute_s, nbytes / gpu.bandwidth("copy"), floor, n_flops, nbytes, kind)
    rate = gpu.bandwidth("cast" if not vectorized(func, args, kwargs, out) else kind)
    return Cost(0.0, nbytes / rate, gpu.kernel_floor_s, 0, nbytes, kind)


#: Copies that run PyTorch's copy kernel (a pointwise kernel): [Note: vectorized kernels].
_COPY_KERNELS = {"copy_", "_to_copy", "clone", "contiguous", "_copy_from"}
#: Casts with a vectorized kernel of their own (Copy.cu): (source, destination).
_VECTORIZED_CASTS = {(torch.float32, torch.bfloat16), (torch.float32, torch.float16)}


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span with no gap and no repeat, in some
    order of its dimensions (a contiguous or a permuted tensor)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def vectorized(func, args, kwargs, out) -> bool:
    """Whether PyTorch's CUDA kernel for this memory-bound operator is its vectorized one:
    [Note: vectorized kernels]. Operators that are neither a copy nor pointwise are."""
    name = func._overloadpacket.__name__
    if name not in _COPY_KERNELS and torch.Tag.pointwise not in func.tags:
        return True
    operands = [local_tensor(t) for t in _distinct([*tensors_in((args, kwargs)), *_tensors(out)])]
    operands = [t for t in operands if t.dim() > 0]
    if not operands:
        return True
    first = operands[0]
    if any(t.shape != first.shape or t.stride() != first.stride() for t in operands[1:]) or not _dense(first):
        return False
    dtypes = {t.dtype for t in operands}
    if len(dtypes) == 1:
        return True
    if name in _COPY_KERNELS and len(dtypes) == 2:
        source = args[1].dtype if name == "copy_" else args[0].dtype
        return (source, next(d for d in dtypes if d != source)) in _VECTORIZED_CASTS
    return False


def duration(func, args, kwargs, out, gpu: GpuPreset, attention_backend: str | None = None) -> tuple[float, int, int]:
    """(seconds, flops, bytes) of one kernel on an idle ``gpu``."""
    cost = kernel_cost(func, args, kwargs, out, gpu, attention_backend)
    return cost.seconds, cost.flops, cost.nbytes


def host_duration(args, kwargs, out, host) -> float:
    """An operator the CPU runs on host memory: its bytes in and out at the host preset's
    memory speed (``host_bytes_per_s``)."""
    nbytes = sum(tensor_bytes(t) for t in _tensors((args, kwargs))) + sum(tensor_bytes(t) for t in _tensors(out))
    return nbytes / host.bytes_per_s


def pcie_duration(read_bytes: int, write_bytes: int, gpu: GpuPreset) -> float:
    """A copy between host and device memory: the larger side crosses PCIe (or the C2C link)."""
    return max(read_bytes, write_bytes) / gpu.bandwidth("pcie") + gpu.kernel_floor_s
