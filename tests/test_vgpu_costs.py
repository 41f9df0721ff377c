"""The operator cost model of the virtual GPU (zerobench/instruments/vgpu/costs.py, gemm.py,
presets.py): GEMM shapes against published measurements, attention by direction, bytes
of expanded inputs, and the presets' figures."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerobench.instruments.vgpu import costs, gemm
from zerobench.instruments.vgpu.presets import GPU_PRESETS, GpuPreset, gpu_preset

aten = torch.ops.aten


def test_shape_factor_worked_by_hand():
    """256x256 output, k 512, on 4 SMs: 128x128 tiles are 4, one full wave, each running
    its 512 steps plus the fixed 128: 512/640 of the time is useful."""
    assert gemm.shape_factor(1, 256, 256, 512, sm_count=4) == pytest.approx(512 / 640)
    # One tile more than a wave: the second wave runs one tile on 4 SMs' worth of time.
    five_tiles = gemm.shape_factor(1, 5 * 64, 64, 512, sm_count=4)
    assert five_tiles == pytest.approx((5 * 64 * 64 * 512) / (2 * 4 * 64 * 64 * 640))


def test_skinny_and_short_reduction_gemms_use_less_of_the_card():
    square = gemm.shape_factor(1, 8192, 8192, 8192, 132)
    assert square > 0.95
    assert gemm.shape_factor(1, 8192, 8192, 256, 132) < 0.7 * square  # small K
    assert gemm.shape_factor(1, 128, 128, 8192, 132) < 0.05  # one tile on 132 SMs
    assert gemm.shape_factor(4, 128, 128, 8192, 132) == pytest.approx(4 * gemm.shape_factor(1, 128, 128, 8192, 132))


# H100 bf16 GEMM rates XLA publishes for its cost model (openxla/xla,
# xla/service/gpu/model/matmul_interpolator_data.h, sm_90): (batch, m, n, k, TFLOP/s).
# XLA measured short bursts, so they are compared with the card's *achievable* rate
# (MAMF 794.5 TFLOP/s), not the sustained one the preset uses for training.
XLA_H100 = [(1, 4096, 4096, 4096, 783.3), (1, 2048, 2048, 2048, 632.0), (1, 4096, 4096, 256, 392.2),
            (1, 256, 4096, 4096, 412.0), (1, 1024, 256, 4096, 169.7), (1, 256, 2048, 256, 41.8),
            (1, 512, 512, 2048, 114.7), (2, 4096, 4096, 256, 464.0)]


@pytest.mark.parametrize("b,m,n,k,published", XLA_H100)
def test_gemm_rates_are_within_fifteen_percent_of_published_h100_measurements(b, m, n, k, published):
    from zerobench.instruments.vgpu.presets import _large_gemm_efficiency

    h100 = GpuPreset("h100-burst", memory_bytes=80 << 30, peak_flops={torch.bfloat16: 989e12, torch.float32: 67e12},
                     hbm_bytes_per_s=3.35e12, sm_count=132,
                     matmul_efficiency=_large_gemm_efficiency(794.5, 989, (2048, 2048, 13312), 132))
    a, w = torch.empty(b, m, k, dtype=torch.bfloat16), torch.empty(b, k, n, dtype=torch.bfloat16)
    seconds, flops, _ = costs.duration(aten.bmm.default, (a, w), {}, torch.empty(b, m, n, dtype=torch.bfloat16), h100)
    assert flops == 2 * b * m * n * k
    assert flops / seconds / 1e12 == pytest.approx(published, rel=0.15)


def test_the_presets_give_back_the_published_large_gemm_rates():
    """H100 SXM and H200: the sustained rate (MSMF 755 TFLOP/s); A100: the achievable one
    (MAMF 271.2), each at the shape it was measured at."""
    for name, shape, rate in (("h100-sxm", (2048, 2048, 13312), 755), ("h200", (2048, 2048, 13312), 755),
                              ("a100-80gb", (1024, 10240, 5120), 271.2)):
        p = gpu_preset(name)
        factor = gemm.shape_factor(1, *shape, p.sm_count)
        assert p.flops_per_s(torch.bfloat16) * factor / 1e12 == pytest.approx(rate, rel=1e-6)


def test_every_preset_reproduces_its_data_sheet_peak_from_its_clock():
    """bf16 peak = SMs x 4 tensor cores x FMAs per clock (512 Hopper, 256 Ampere) x 2 x clock."""
    for p in GPU_PRESETS.values():
        fma = 256 if p.name.startswith("a100") else 512
        assert p.sm_count * 4 * fma * 2 * p.sm_clock_hz == pytest.approx(p.peak(torch.bfloat16), rel=0.01), p.name
        assert p.memory_bytes - p.context_bytes > 0


def test_attention_backward_is_priced_at_its_own_efficiency():
    gpu = gpu_preset("h100-sxm")
    q = torch.randn(1, 8, 2048, 128, dtype=torch.bfloat16, requires_grad=True)
    out, lse, *_ = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, True)
    forward_s, forward_flops, _ = costs.duration(aten._scaled_dot_product_flash_attention_for_cpu.default,
                                                 (q, q, q, 0.0, True), {}, (out, lse), gpu)
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(out, q, q, q, out, lse, 0.0, True)
    backward_s, backward_flops, _ = costs.duration(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        (out, q, q, q, out, lse, 0.0, True), {}, grads, gpu)
    assert forward_s == pytest.approx(forward_flops / (989e12 * 0.35) + gpu.kernel_floor_s)
    assert backward_s == pytest.approx(backward_flops / (989e12 * 0.30) + gpu.kernel_floor_s)
    assert backward_flops == pytest.approx(2.5 * forward_flops)


def test_an_expanded_input_is_read_once():
    """GQA repeats each key/value head with ``expand``: the copy reads one head and writes
    four, as PyTorch's estimator counts it (``get_num_bytes``)."""
    kv = torch.empty(1, 2, 1, 1024, 128)
    expanded = kv.expand(1, 2, 4, 1024, 128)
    assert costs.accessed_bytes(expanded) == kv.numel() * 4
    assert costs.tensor_bytes(expanded) == 4 * kv.numel() * 4
    gpu = gpu_preset("h100-sxm")
    out = expanded.contiguous()
    seconds, _, nbytes = costs.duration(aten.clone.default, (expanded,), {}, out, gpu)
    assert nbytes == 5 * kv.numel() * 4  # one head read, four written
    assert seconds == pytest.approx(nbytes / (gpu.hbm_bytes_per_s * gpu.memory_efficiency) + gpu.kernel_floor_s)


def test_gqa_attention_prices_its_repeated_heads_as_reads_of_one():
    b, heads, kv_heads, t, d = 1, 8, 2, 256, 64
    k = torch.empty(b, kv_heads, t, d)
    repeated = k[:, :, None].expand(b, kv_heads, heads // kv_heads, t, d)
    assert costs.accessed_bytes(repeated) == k.numel() * 4
    assert F.scaled_dot_product_attention is not None


def test_a_bad_preset_figure_names_the_field():
    with pytest.raises(ValueError, match=r"memory_efficiency 1.5 is not allowed \(allowed: 0 < x <= 1\)"):
        GpuPreset("bad", memory_bytes=1 << 30, peak_flops={torch.float32: 1e12}, memory_efficiency=1.5)
    with pytest.raises(ValueError, match="context_bytes"):
        GpuPreset("bad", memory_bytes=1 << 20, peak_flops={torch.float32: 1e12}, context_bytes=2 << 20)


def test_rms_norm_is_one_kernel_each_way_saving_its_input_and_rstd_as_on_a_gpu():
    """[Note: fused on the GPU]: the CPU decomposes F.rms_norm into eight kernels and saves
    two fp32 copies of its input; the virtual GPU runs it as the GPU's fused kernel, with
    the same values and gradients."""
    from zerobench.instruments.vgpu import HostPreset, VirtualGpu

    torch.manual_seed(0)
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    reference = F.rms_norm(x.float(), (64,), w.float(), 1e-5)
    reference.sum().backward()
    ref_gx, ref_gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    gpu = VirtualGpu(host=HostPreset("zero", 0.0, 0.0))
    with gpu:
        kernels = gpu.kernels
        y = F.rms_norm(x, (64,), w, 1e-5)
        assert gpu.kernels == kernels + 1
        saved = [t for t in y.grad_fn.saved_tensors]
        assert {tuple(t.shape) for t in saved} == {(4, 16, 64), (64,), (4, 16, 1)}
        assert {t.dtype for t in saved if t.dim() == 3 and t.shape[-1] == 64} == {torch.bfloat16}
        y.sum().backward()
        assert gpu.kernels <= kernels + 4  # the backward kernel (and autograd's own accumulation)
    assert torch.allclose(y.float(), reference, atol=2e-2)
    assert torch.allclose(x.grad.float(), ref_gx.float(), atol=3e-2, rtol=3e-2)
    assert torch.allclose(w.grad.float(), ref_gw.float(), atol=5e-1, rtol=5e-2)
