"""How long an operator runs on the virtual GPU: a roofline over FLOPs and bytes, with
the shape of each GEMM and the direction of each attention kernel taken into account.

[Note: operator cost]
For an operator that launches a kernel,

    duration = max(compute_s, bytes / (hbm_bandwidth * memory_efficiency)) + floor

* a GEMM (``mm``, ``addmm``, ``bmm``, ``baddbmm``): ``compute_s`` is its FLOPs at the
  card's large-GEMM rate times the shape factor of gemm.py ([Note: GEMM shapes]: tile
  and wave quantisation, small K), and ``floor`` is ``gemm_floor_s``;
* fused attention: its FLOPs (half when causal, as a flash kernel skips the masked half
  of the score matrix) at ``attention_fwd_efficiency`` or ``attention_bwd_efficiency``
  of the peak, FlashAttention-2's backward reaching less of it than its forward;
* any other operator ``torch.utils.flop_counter`` counts FLOPs for (convolutions): its
  FLOPs at the large-GEMM rate;
* everything else is memory-bound: ``compute_s`` is 0.

The bytes are those of the tensor inputs and outputs (what a kernel must read and
write at least), an expanded input counted once per element it really holds (a stride-0
dimension reads the same element again), as ``torch.utils._runtime_estimation``'s
``get_num_bytes`` counts them; memory-bound kernels stream them at the preset's
measured fraction of HBM bandwidth. The dtype of the peak is that of the first
floating-point input. This is PyTorch's ``RuntimeEstimator`` roofline with measured
efficiencies in place of its peaks (see [Note: virtual GPU presets]).

Operators that launch no kernel cost only host time: views and other metadata-only
operators, ``empty``-style allocations, ``record_stream``, the few that only read a
tensor's metadata, and the dispatcher ops of collectives and of ``record_function``.
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


def launches_kernel(func) -> bool:
    return not func.is_view and func not in NO_KERNEL and func.namespace not in NO_KERNEL_NAMESPACES


def _tensors(obj) -> list:
    return list(tensors_in(obj))


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


def flops(func, args, kwargs, out) -> int:
    counter = flop_registry.get(func._overloadpacket)
    if counter is None:
        return 0
    try:
        return int(counter(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - an overload the registry's shape rule does not cover
        return 0


def attention_flops(func, args, kwargs) -> int:
    """FLOPs of the fused attention kernel this CPU build runs in place of a GPU's
    (``flop_counter`` has no rule for the CPU variant): the shapes' matmul FLOPs, half of
    them when causal, as a flash kernel skips the masked half of the score matrix."""
    if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
        q, k, v = args[:3]
        n = sdpa_flop_count(q.shape, k.shape, v.shape)
        causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    else:
        grad_out, q, k, v = args[:4]
        n = sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)
        causal = args[7] if len(args) > 7 else kwargs.get("is_causal", False)
    return n // 2 if causal else n


# Fused attention: priced by attention_flops at the preset's forward or backward efficiency.
ATTENTION_FORWARD = {aten._scaled_dot_product_flash_attention_for_cpu.default}
ATTENTION_BACKWARD = {aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
ATTENTION = ATTENTION_FORWARD | ATTENTION_BACKWARD


class Cost(NamedTuple):
    """One kernel's modelled cost on an idle device."""

    compute_s: float
    memory_s: float
    floor_s: float
    flops: int
    nbytes: int

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.floor_s


def kernel_cost(func, args, kwargs, out, gpu: GpuPreset) -> Cost:
    """The parts of one kernel's time on ``gpu``. See [Note: operator cost]."""
    inputs = _tensors((args, kwargs))
    nbytes = sum(accessed_bytes(t) for t in inputs) + sum(accessed_bytes(t) for t in _tensors(out))
    dtype = next((t.dtype for t in inputs if t.is_floating_point()), torch.float32)
    floor = gpu.kernel_floor_s
    if func in ATTENTION:
        n_flops = attention_flops(func, args, kwargs)
        efficiency = gpu.attention_fwd_efficiency if func in ATTENTION_FORWARD else gpu.attention_bwd_efficiency
        compute_s = n_flops / (gpu.peak(dtype) * efficiency)
    else:
        n_flops = flops(func, args, kwargs, out)
        compute_s = n_flops / gpu.flops_per_s(dtype) if n_flops else 0.0
        shape = gemm.dims(func._overloadpacket.__name__, [tuple(local_tensor(t).shape) for t in inputs])
        if shape is not None:
            compute_s /= gemm.shape_factor(*shape, gpu.sm_count)
            floor = gpu.gemm_floor_s
    memory_s = nbytes / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)
    return Cost(compute_s, memory_s, floor, n_flops, nbytes)


def duration(func, args, kwargs, out, gpu: GpuPreset) -> tuple[float, int, int]:
    """(seconds, flops, bytes) of one kernel on an idle ``gpu``."""
    cost = kernel_cost(func, args, kwargs, out, gpu)
    return cost.seconds, cost.flops, cost.nbytes


def host_duration(args, kwargs, out, host) -> float:
    """An operator the CPU runs on host memory: its bytes in and out at the host preset's
    memory speed (``host_bytes_per_s``)."""
    nbytes = sum(tensor_bytes(t) for t in _tensors((args, kwargs))) + sum(tensor_bytes(t) for t in _tensors(out))
    return nbytes / host.bytes_per_s


def copy_duration(read_bytes: int, write_bytes: int, gpu: GpuPreset, host_device: bool) -> float:
    """A copy that reads ``read_bytes`` and writes ``write_bytes``: over PCIe when one side
    is host memory (the larger of the two crosses it), else within HBM (both)."""
    if host_device:
        return max(read_bytes, write_bytes) / (gpu.pcie_bytes_per_s * gpu.memory_efficiency) + gpu.kernel_floor_s
    return (read_bytes + write_bytes) / (gpu.hbm_bytes_per_s * gpu.memory_efficiency) + gpu.kernel_floor_s
