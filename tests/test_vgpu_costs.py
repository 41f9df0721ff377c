"""The operator cost model of the virtual GPU (zerobench/instruments/vgpu/costs.py, gemm.py,
sdpa.py, presets.py): GEMM shapes against published measurements, attention by backend
and direction, the passes each kind of kernel makes over memory, clocks under load,
cuBLAS's workspaces, kernel classes, and the presets' figures."""

from __future__ import annotations

import dataclasses

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
    mamf = 794.5 / 989 / gemm.shape_factor(1, 2048, 2048, 13312, 132)  # the burst rate at its measured shape
    h100 = GpuPreset("h100-burst", memory_bytes=80 << 30, peak_flops={torch.bfloat16: 989e12, torch.float32: 67e12},
                     hbm_bytes_per_s=3.35e12, sm_count=132, matmul_efficiency=mamf, clocks="burst")
    a, w = torch.empty(b, m, k, dtype=torch.bfloat16), torch.empty(b, k, n, dtype=torch.bfloat16)
    seconds, flops, _ = costs.duration(aten.bmm.default, (a, w), {}, torch.empty(b, m, n, dtype=torch.bfloat16), h100)
    assert flops == 2 * b * m * n * k
    assert flops / seconds / 1e12 == pytest.approx(published, rel=0.15)


def test_the_presets_give_back_their_measured_and_published_gemm_rates():
    """A100: the achievable rate (MAMF 271.2 TFLOP/s) at the shape it was measured at, in a
    burst; H200: its measured sustained rate (670.1 TFLOP/s for 8192^3 over 12 s) at the
    clocks of a card under load, which the H100 SXM shares (the same die and power)."""
    a100 = gpu_preset("a100-80gb").with_clocks("burst")
    factor = gemm.shape_factor(1, 1024, 10240, 5120, a100.sm_count)
    assert a100.flops_per_s(torch.bfloat16) * factor / 1e12 == pytest.approx(271.2, rel=1e-5)
    a = torch.empty(8192, 8192, dtype=torch.bfloat16)
    for name in ("h200", "h100-sxm"):
        tile_model = dataclasses.replace(gpu_preset(name), gemm_measured=()).with_clocks("sustained")
        seconds, flops, _ = costs.duration(aten.mm.default, (a, a), {}, a, tile_model)
        assert flops / seconds / 1e12 == pytest.approx(670.1, rel=1e-3)
        # in a training step: the GEMM's own burst time ([Note: GEMM layouts], step_ratio 1)
        seconds, flops, _ = costs.duration(aten.mm.default, (a, a), {}, a, gpu_preset(name))
        assert flops / seconds / 1e12 == pytest.approx(777.5, rel=1e-3)


def test_every_preset_reproduces_its_data_sheet_peak_from_its_clock():
    """bf16 peak = SMs x 4 tensor cores x FMAs per clock (512 Hopper, 256 Ampere) x 2 x clock."""
    for p in GPU_PRESETS.values():
        fma = 256 if p.name.startswith("a100") else 512
        assert p.sm_count * 4 * fma * 2 * p.sm_clock_hz == pytest.approx(p.peak(torch.bfloat16), rel=0.01), p.name
        assert p.memory_bytes - p.context_bytes > 0


def test_attention_is_priced_per_backend_and_direction():
    gpu = gpu_preset("h100-sxm")
    q = torch.randn(1, 8, 2048, 128, dtype=torch.bfloat16, requires_grad=True)
    out, lse, *_ = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, True)
    forward = (aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.0, True), (out, lse))
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(out, q, q, q, out, lse, 0.0, True)
    backward = (aten._scaled_dot_product_flash_attention_for_cpu_backward.default, (out, q, q, q, out, lse, 0.0, True),
                grads)
    scale = gpu.compute_scale
    for backend in ("cudnn", "flash", "efficient"):
        f_s, f_flops, _ = costs.duration(forward[0], forward[1], {}, forward[2], gpu, backend)
        b_s, b_flops, _ = costs.duration(backward[0], backward[1], {}, backward[2], gpu, backend)
        f_eff, b_eff = getattr(gpu, f"attention_{backend}")
        assert f_s == pytest.approx(f_flops / (989e12 * f_eff * scale) + gpu.kernel_floor_s)
        assert b_s == pytest.approx(b_flops / (989e12 * b_eff * scale) + gpu.kernel_floor_s)
        assert b_flops == pytest.approx(2.5 * f_flops)
    # the math backend computes the masked half too, and passes over the score matrix
    math_s, math_flops, _ = costs.duration(forward[0], forward[1], {}, forward[2], gpu, "math")
    assert math_flops == 2 * f_flops
    assert math_s > costs.duration(forward[0], forward[1], {}, forward[2], gpu, "flash")[0]


@pytest.mark.parametrize("version,sm,dtype,head_dim,expected", [
    ("2.11.0+cu130", 9, torch.bfloat16, 128, "cudnn"),  # the measured H200: cuDNN first
    ("2.13.0", 10, torch.bfloat16, 128, "cudnn"),
    ("2.10.0", 9, torch.bfloat16, 128, "flash"),  # prefers cuDNN only with a newer cuDNN than it ships
    ("2.5.0", 9, torch.bfloat16, 128, "cudnn"),  # cuDNN first in 2.5.0 ...
    ("2.5.1", 9, torch.bfloat16, 128, "flash"),  # ... withdrawn in 2.5.1
    ("2.13.0", 8, torch.bfloat16, 128, "flash"),  # never cuDNN first on A100
    ("2.13.0", 9, torch.float32, 128, "efficient"),  # fused kernels for fp32: memory-efficient only
    ("2.13.0", 9, torch.float32, 30, "math"),  # a head size the efficient kernel cannot align
    ("2.13.0", 8, torch.bfloat16, 512, "efficient"),  # too wide for flash
])
def test_the_sdpa_backend_is_torchs_choice(version, sm, dtype, head_dim, expected):
    from zerobench.instruments.vgpu import sdpa

    assert sdpa.choose(dtype, head_dim, sm, version) == expected
    assert sdpa.choose(dtype, head_dim, sm, version, requested="math") == "math"
    with pytest.raises(ValueError, match="--sdpa-backend: 'fa3' is not allowed"):
        sdpa.choose(dtype, head_dim, sm, version, requested="fa3")


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
    # a broadcast source: PyTorch's unvectorized copy ([Note: vectorized kernels]; the H200's
    # step ran this copy as ``elementwise_kernel<128, 2>``)
    assert seconds == pytest.approx(nbytes / gpu.bandwidth("cast") + gpu.kernel_floor_s)


def test_gqa_attention_prices_its_repeated_heads_as_reads_of_one():
    b, heads, kv_heads, t, d = 1, 8, 2, 256, 64
    k = torch.empty(b, kv_heads, t, d)
    repeated = k[:, :, None].expand(b, kv_heads, heads // kv_heads, t, d)
    assert costs.accessed_bytes(repeated) == k.numel() * 4
    assert F.scaled_dot_product_attention is not None


def test_a_bad_preset_figure_names_the_field():
    with pytest.raises(ValueError, match=r"copy_efficiency 1.5 is not allowed \(allowed: 0 < x <= 1\)"):
        GpuPreset("bad", memory_bytes=1 << 30, peak_flops={torch.float32: 1e12}, copy_efficiency=1.5)
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
        assert gpu.kernels <= kernels + 5  # the backward's two kernels (and autograd's own accumulation)
    assert torch.allclose(y.float(), reference, atol=2e-2)
    assert torch.allclose(x.grad.float(), ref_gx.float(), atol=3e-2, rtol=3e-2)
    assert torch.allclose(w.grad.float(), ref_gw.float(), atol=5e-1, rtol=5e-2)


# -- [Note: passes over memory] ----------------------------------------------------------


def _bytes(func, args, out=None):
    return costs.kernel_bytes(func, args, {}, out)


def test_in_place_foreach_ops_write_what_they_return_nothing_of():
    """``_foreach_mul_`` returns nothing: its writes count all the same; ``addcmul_(v, g, g)``
    reads ``g`` once. A foreach AdamW step is 80 bytes per fp32 parameter on these rules."""
    v, g = [torch.empty(1000)], [torch.empty(1000)]
    assert _bytes(aten._foreach_mul_.Scalar, (v, 0.9)) == 2 * 4000
    assert _bytes(aten._foreach_addcmul_.Scalar, (v, g, g, 0.1)) == 3 * 4000


def test_a_softmax_row_larger_than_shared_memory_is_read_three_times():
    small, large = torch.empty(8, 1024), torch.empty(8, 128256)  # 4 KiB rows, 501 KiB rows
    assert _bytes(aten._log_softmax.default, (small, 1, False), small) == 2 * small.nbytes
    assert _bytes(aten._log_softmax.default, (large, 1, False), large) == 4 * large.nbytes
    assert _bytes(aten._log_softmax_backward_data.default, (large, large, 1, torch.float32), large) == 4 * large.nbytes


def test_gathers_read_what_they_gather_and_copies_do_not_read_their_destination():
    logits, target = torch.empty(16, 50000), torch.zeros(16, dtype=torch.long)
    out = (torch.empty(()), torch.empty(()))
    assert _bytes(aten.nll_loss_forward.default, (logits, target, None, 1, -100), out) == 16 * 8 + 16 * 4 + 8
    weight, ids = torch.empty(50000, 64), torch.zeros(16, dtype=torch.long)
    assert _bytes(aten.embedding.default, (weight, ids), torch.empty(16, 64)) == 2 * 16 * 64 * 4 + 16 * 8
    dst, src = torch.empty(1000, dtype=torch.bfloat16), torch.empty(1000)
    assert _bytes(aten.copy_.default, (dst, src), dst) == 1000 * 2 + 1000 * 4


def test_a_copy_streams_at_the_copy_rate_unless_pytorch_cannot_vectorize_it():
    """[Note: vectorized kernels]: fp32 to bf16 has a vectorized kernel, bf16 to fp32 does not."""
    gpu = gpu_preset("h200")
    x = torch.empty(1 << 20, dtype=torch.bfloat16)
    same, _, n_same = costs.duration(aten._to_copy.default, (x,), {}, torch.empty_like(x), gpu)
    up, _, n_up = costs.duration(aten._to_copy.default, (x,), {}, x.float(), gpu)
    down, _, n_down = costs.duration(aten._to_copy.default, (x.float(),), {}, x, gpu)
    assert same == pytest.approx(n_same / gpu.bandwidth("copy") + gpu.kernel_floor_s)
    assert up == pytest.approx(n_up / gpu.bandwidth("cast") + gpu.kernel_floor_s)
    assert down == pytest.approx(n_down / gpu.bandwidth("copy") + gpu.kernel_floor_s)
    assert gpu.bandwidth("cast") < 0.6 * gpu.bandwidth("copy")  # measured: 2.11 against 4.21 TB/s
    dst, src = torch.empty(1 << 20, dtype=torch.bfloat16), torch.empty(1 << 20, dtype=torch.float32)
    assert costs.vectorized(aten.copy_.default, (dst, src), {}, dst)
    assert not costs.vectorized(aten.copy_.default, (src, dst), {}, src)


def test_strided_broadcast_and_mixed_dtype_pointwise_kernels_are_not_vectorized():
    q = torch.empty(1, 32, 64, 16, dtype=torch.bfloat16)
    rotary = torch.empty(64, 16, dtype=torch.float32)
    same = torch.empty_like(q)
    assert costs.vectorized(aten.mul.Tensor, (q, same), {}, torch.empty_like(q))
    assert not costs.vectorized(aten.mul.Tensor, (q, rotary), {}, torch.empty(q.shape))  # broadcast, two dtypes
    transposed = torch.empty(16, 64, dtype=torch.bfloat16).t()  # [64, 16], strides (1, 64)
    assert not costs.vectorized(aten.add.Tensor, (transposed, torch.empty(64, 16, dtype=torch.bfloat16)), {},
                                torch.empty(64, 16, dtype=torch.bfloat16))
    assert costs.vectorized(aten.clone.default, (transposed,), {}, torch.empty_like(transposed))  # dense, permuted
    assert not costs.vectorized(aten.clone.default, (transposed,), {}, torch.empty(64, 16, dtype=torch.bfloat16))
    assert costs.vectorized(aten.mul.Tensor, (q, torch.tensor(2.0)), {}, torch.empty_like(q))  # a scalar
    assert costs.vectorized(aten.sum.dim_IntList, (q, [1]), {}, torch.empty(1, 64, 16))  # not pointwise
    gpu = gpu_preset("h200")
    fast, _, n = costs.duration(aten.mul.Tensor, (q, same), {}, torch.empty_like(q), gpu)
    slow, _, m = costs.duration(aten.mul.Tensor, (q, rotary), {}, torch.empty(q.shape), gpu)
    assert fast == pytest.approx(n / gpu.bandwidth("elementwise") + gpu.kernel_floor_s)
    assert slow == pytest.approx(m / gpu.bandwidth("cast") + gpu.kernel_floor_s)


def test_each_kernel_has_a_class():
    assert costs.kernel_class(aten.mm.default) == "gemm"
    assert costs.kernel_class(aten.convolution.default) == "gemm"
    assert costs.kernel_class(aten._scaled_dot_product_flash_attention_for_cpu.default) == "attention"
    assert costs.kernel_class(aten._foreach_addcdiv_.ScalarList) == "optimizer"
    assert costs.kernel_class(aten.copy_.default) == "copy" and costs.kernel_class(aten.fill_.Scalar) == "copy"
    assert costs.kernel_class(aten._log_softmax.default) == "elementwise"
    # its CUDA kernel's time is the zero-fill of the whole gradient (Loss.cu)
    assert costs.kernel_class(aten.nll_loss_backward.default) == "copy"


# -- [Note: clocks under load] -----------------------------------------------------------


def test_compute_runs_at_the_step_rate_where_steps_showed_one_and_slower_under_a_power_cap():
    h200 = gpu_preset("h200")
    assert h200.with_clocks("burst").compute_scale == 1.0
    assert h200.with_clocks("sustained").compute_scale == h200.sustained_ratio < 1.0
    assert h200.clocks == "step" and h200.compute_scale == h200.step_ratio == 1.0
    nvl = gpu_preset("h100-nvl")  # no step traced on it: the sustained ratio
    assert nvl.step_ratio is None and nvl.compute_scale == nvl.sustained_ratio < 1.0
    capped = gpu_preset("h100-96gb-500w")
    dynamic = (500 - capped.idle_power_w) / (700 - capped.idle_power_w)
    assert capped.cap_factor == pytest.approx(dynamic ** (1 / 3))
    assert capped.compute_scale == pytest.approx(capped.step_ratio * capped.cap_factor)
    assert capped.with_clocks("sustained").compute_scale == pytest.approx(capped.sustained_ratio * capped.cap_factor)
    # memory-bound kernels keep their rate: HBM's clock does not move
    assert capped.bandwidth("copy") == pytest.approx(2.4e12 * capped.copy_efficiency)


# -- [Note: cuBLAS workspaces] ------------------------------------------------------------


def _linear_step(gpu, steps=2):
    from zerobench.instruments.vgpu import HostPreset, VirtualGpu

    with VirtualGpu(gpu=gpu, host=HostPreset("zero", 0.0, 0.0), trace=True) as vgpu:
        layer = torch.nn.Linear(64, 64)
        for _ in range(steps):
            layer(torch.randn(8, 64)).sum().backward()
        vgpu.synchronize()
    return vgpu


@pytest.mark.parametrize("preset,config,each", [
    ("h200", None, 32 << 20),  # sm90: :4096:8
    ("a100-80gb", None, 8 * 2**20 + 128 * 1024),  # elsewhere: :4096:2:16:8
    ("h200", ":4096:2", 8 << 20),
])
def test_a_forward_and_a_backward_hold_one_cublas_workspace_each(preset, config, each, monkeypatch):
    if config is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    vgpu = _linear_step(preset)
    assert vgpu.cublas_workspace_bytes == each
    # the forward thread's handle and autograd's backward thread's, on one stream; a second step adds none
    assert vgpu.allocator.active_by_label["cublas_workspace"] == 2 * each


def test_the_trace_and_the_totals_carry_each_kernels_class():
    from zerobench.instruments.vgpu.kernel_classes import KERNEL_CLASSES

    vgpu = _linear_step("h200", steps=1)
    events = [e for e in vgpu.trace.chrome()["traceEvents"] if e.get("cat") == "stream"]
    assert events and all(e["args"]["class"] in KERNEL_CLASSES for e in events)
    assert {e["args"]["class"] for e in events} >= {"gemm", "elementwise"}
    busy = sum(e["dur"] for e in events) / 1e6
    assert sum(vgpu.class_seconds.values()) == pytest.approx(busy)
    assert vgpu.class_kernels["gemm"] == 2  # forward, and the weight's gradient (the input needs none)


# -- [Note: GEMM layouts] ------------------------------------------------------------------


def test_linears_three_gemms_each_have_their_layout():
    """forward x @ W.T (nt), input gradient dY @ W (nn), weight gradient dY.T @ x (tn)."""
    x, w, dy = torch.empty(64, 32), torch.empty(16, 32), torch.empty(64, 16)
    assert gemm.layout(x, w.t()) == "nt"
    assert gemm.layout(dy, w) == "nn"
    assert gemm.layout(dy.t(), x) == "tn"
    assert gemm.layout(x.t().contiguous().t(), w.t()) == "tt"
    from zerobench.instruments.vgpu.microbench import TRANSPOSITION_OF

    assert set(TRANSPOSITION_OF.values()) == {"nt", "nn", "tn"}


def test_a_measured_gemm_is_priced_at_its_time_and_another_shape_at_its_layouts_efficiency():
    h200 = gpu_preset("h200")
    # the weight gradient of wq/wo, measured alone in a burst (micro.json): 0.353 ms
    grad, x = torch.empty(8192, 4096, dtype=torch.bfloat16), torch.empty(8192, 4096, dtype=torch.bfloat16)
    measured = h200.measured_gemm("tn", 4096, 4096, 8192, torch.bfloat16)
    assert measured == pytest.approx(0.000353408, rel=1e-3)
    seconds, _, _ = costs.duration(aten.mm.default, (grad.t(), x), {}, torch.empty(4096, 4096), h200)
    assert seconds == pytest.approx(measured / h200.compute_scale)
    # the same shape as an nn GEMM was not measured: the tile model at nn's efficiency
    a, b = torch.empty(4096, 8192, dtype=torch.bfloat16), torch.empty(8192, 4096, dtype=torch.bfloat16)
    assert h200.measured_gemm("nn", 4096, 4096, 8192, torch.bfloat16) is None
    seconds, flops, _ = costs.duration(aten.mm.default, (a, b), {}, torch.empty(4096, 4096), h200)
    factor = gemm.shape_factor(1, 4096, 4096, 8192, h200.sm_count)
    assert seconds == pytest.approx(flops / (h200.flops_per_s(torch.bfloat16, "nn") * factor) + h200.gemm_floor_s)
    assert h200.flops_per_s(torch.bfloat16, "nn") != h200.flops_per_s(torch.bfloat16, "tn")
    assert h200.matmul_efficiency_of("tt") == h200.matmul_efficiency  # no figure: the overall one


@pytest.mark.parametrize("change, field", [
    ({"matmul_layouts": {"nx": 0.7}}, "matmul_layouts nx"),
    ({"matmul_layouts": {"nn": 1.2}}, "matmul_layouts nn"),
    ({"gemm_measured": (("nn", 8, 8, 8, "bf16", -1.0),)}, "gemm_measured row"),
    ({"gemm_measured": (("nn", 8, 8, 8, "int8", 1e-5),)}, "gemm_measured row"),
    ({"step_ratio": 0.0}, "step_ratio"),
    ({"clocks": "turbo"}, "clocks"),
])
def test_bad_gemm_and_clock_figures_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(gpu_preset("h200"), **change)


# -- [Note: attention over shapes] ----------------------------------------------------------

GRID = (("cudnn", 1024, 128, 0.30, 0.20), ("cudnn", 4096, 128, 0.47, 0.37), ("cudnn", 8192, 128, 0.60, 0.49),
        ("cudnn", 4096, 64, 0.40, 0.30))


def test_an_attention_grid_prices_sequence_length_and_head_size_worked_by_hand():
    grid = dataclasses.replace(gpu_preset("h200"), attention_grid=GRID)
    assert grid.attention_efficiency("cudnn", False, 8192, 128) == 0.60  # a measured point
    assert grid.attention_efficiency("cudnn", True, 4096, 128) == 0.37
    # 2048 is halfway between 1024 and 4096 in log2: (0.30 + 0.47) / 2
    assert grid.attention_efficiency("cudnn", False, 2048, 128) == pytest.approx(0.385)
    assert grid.attention_efficiency("cudnn", False, 512, 128) == 0.30  # the nearest end beyond the ends
    assert grid.attention_efficiency("cudnn", False, 16384, 128) == 0.60
    assert grid.attention_efficiency("cudnn", False, 4096, 80) == 0.40  # nearest head size by ratio: 64
    assert grid.attention_efficiency("cudnn", False, 4096, 256) == 0.47  # 128
    # a backend without rows keeps its pair, whatever the shape
    assert grid.attention_efficiency("flash", False, 1024, 64) == grid.attention_flash[0]
    # the shipped h200 has no grid: one pair, measured at (8192, 128)
    h200 = gpu_preset("h200")
    assert h200.attention_grid == () and h200.attention_efficiency("cudnn", False, 1024, 64) == h200.attention_cudnn[0]


def test_attention_kernels_are_priced_at_their_shapes_point_of_the_grid():
    gpu = dataclasses.replace(gpu_preset("h200"), attention_grid=GRID)
    q = torch.empty(1, 4, 2048, 128, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(1, 4, 2048)
    func = aten._scaled_dot_product_flash_attention_for_cpu.default
    seconds, flops, _ = costs.duration(func, (q, q, q, 0.0, True), {}, (out, lse), gpu, "cudnn")
    assert seconds == pytest.approx(flops / (989e12 * 0.385 * gpu.compute_scale) + gpu.kernel_floor_s)


def test_a_bad_attention_grid_row_names_the_field():
    with pytest.raises(ValueError, match="attention_grid row"):
        dataclasses.replace(gpu_preset("h200"), attention_grid=(("fa9", 1024, 128, 0.3, 0.2),))
