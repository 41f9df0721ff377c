"""Operators a GPU runs as one fused kernel where this CPU build decomposes them.

[Note: fused on the GPU]
``F.rms_norm`` on a CUDA tensor whose weight has its dtype runs one kernel forward and
one backward (``_fused_rms_norm``), saving for backward only its input and the per-row
reciprocal RMS. On the CPU it decomposes into eight operators (an fp32 copy of the
input, ``pow``, ``mean``, ``add``, ``rsqrt``, two ``mul`` and a copy back), and autograd
saves two fp32 copies of the input for backward. Priced and counted as the CPU runs it,
a Llama block's two norms cost sixteen kernels instead of two, and 8 bytes per element
of saved activations instead of 2: for Llama 3 8B at sequence 8192, 12 GiB more at the
peak than the GPU holds.

So, while the virtual GPU is installed, ``F.rms_norm`` with a matching weight is an
autograd function that computes the same values with the same operators but as the GPU
does it (``VirtualGpu.fused``), and what it saves is the input and the reciprocal RMS.
Its kernels move what the CUDA kernels move (layer_norm_kernel.cu, which RMSNorm shares):
forward, one kernel that reads each row twice (``vectorized_layer_norm_kernel_impl``:
the row's statistics, then the normalisation) and writes it once; backward, one kernel
that reads the input and the gradient twice each (``layer_norm_grad_input_kernel``: the
row's two dot products, then the input's gradient) and one that reads them once more
for the weight's gradient. A weight of another dtype takes the decomposition, on the GPU
as here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_original_rms_norm = F.rms_norm


def _rstd(x32: torch.Tensor, dims: tuple, eps: float) -> torch.Tensor:
    return torch.rsqrt(x32.pow(2).mean(dims, keepdim=True) + eps)


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gpu, x, weight, normalized_shape, eps):
        dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
        with gpu.fused("fused_rms_norm") as kernel:
            x32 = x.float()
            rstd = _rstd(x32, dims, eps)
            y = x32 * rstd
            if weight is not None:
                y = y * weight.float()
            y = y.to(x.dtype)
            kernel.reads(x, times=2)
            kernel.reads(weight)
            kernel.writes(y, rstd)
        ctx.gpu, ctx.dims, ctx.has_weight = gpu, dims, weight is not None
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        with ctx.gpu.fused("fused_rms_norm_backward") as kernel:
            x32, g32 = x.float(), grad.float()
            normalized = x32 * rstd
            gw = g32 * weight.float() if ctx.has_weight else g32
            n = 1
            for d in ctx.dims:
                n *= x.shape[d]
            # d/dx of x * rstd(x) * w: rstd * (gw - normalized * mean(gw * normalized))
            dot = (gw * normalized).sum(ctx.dims, keepdim=True) / n
            grad_x = (rstd * (gw - normalized * dot)).to(x.dtype)
            grad_w = None
            if ctx.has_weight:
                reduce = tuple(range(x.dim() - len(ctx.dims)))
                grad_w = (g32 * normalized).sum(reduce).to(weight.dtype)
            kernel.reads(x, grad, times=2)  # the input's gradient
            kernel.reads(weight, rstd)
            kernel.writes(grad_x)
            if ctx.has_weight:  # the weight's gradient: a second kernel
                kernel.launch()
                kernel.reads(x, grad, rstd)
                kernel.writes(grad_w)
        return None, grad_x, grad_w, None, None


def rms_norm(gpu):
    """``F.rms_norm`` as the GPU runs it, for the virtual GPU ``gpu`` (see the Note)."""

    def fused_rms_norm(input, normalized_shape, weight=None, eps=None):
        if weight is not None and weight.dtype != input.dtype:
            return _original_rms_norm(input, normalized_shape, weight, eps)
        if eps is None:
            eps = torch.finfo(input.dtype).eps
        return _FusedRMSNorm.apply(gpu, input, weight, tuple(normalized_shape), eps)

    return fused_rms_norm
