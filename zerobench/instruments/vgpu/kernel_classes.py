"""The classes a GPU kernel is priced and reported by, on the virtual GPU and in a real
GPU's trace alike: the cost model prices each class from its own measurements, and
``zerobench predict --against`` puts a measured run's kernels beside the prediction's,
class by class.

* ``gemm``: cuBLAS/cuBLASLt matrix multiplies (mm, addmm, bmm, linear, convolutions);
* ``attention``: fused scaled-dot-product attention, forward and backward, any backend;
* ``optimizer``: the kernels of an optimizer's step (foreach / fused multi-tensor kernels);
* ``elementwise``: other memory-bound compute: pointwise ops, activations, norms,
  reductions, softmax, losses;
* ``copy``: copies and dtype casts, fills, device-to-device, host-to-device and back;
* ``collective``: NCCL kernels;
* ``other``: anything else (a kernel no rule names).
"""

from __future__ import annotations

KERNEL_CLASSES: tuple[str, ...] = ("gemm", "attention", "optimizer", "elementwise", "copy", "collective", "other")
