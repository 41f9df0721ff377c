"""What the virtual GPU is modelled on: a GPU's peaks and a host's costs.

[Note: virtual GPU presets]
Each GPU preset gives the data-sheet figures of one card (dense peaks, HBM bandwidth
and size, SM count and clock, power) and the fractions of those peaks that published
microbenchmarks reach on it. Every figure and its source is listed in docs/vgpu.md
("Presets and their sources"); none is fitted to the training runs the validation
table compares with.

* ``matmul_efficiency``: the fraction of the dense peak one full wave of large GEMM
  tiles sustains. It is the published *sustained* matmul rate (MSMF, the power-limited
  rate of a GEMM that keeps the card at its power limit; stas00/ml-engineering's
  MAMF/MSMF table: H200 834 achievable, 755 sustained TFLOP/s of 989) where one is
  published, else the achievable rate (MAMF; A100 SXM 271.2 of 312), divided by the
  tile and wave quantisation and the small-K loss of the shape it was measured at
  (costs.py, [Note: GEMM shapes]), so that the cost model gives back the published
  figure at that shape.
* ``attention_fwd_efficiency`` / ``attention_bwd_efficiency``: FlashAttention-2's
  forward and backward kernels, separately: on A100 up to 73 % and 63 % of the peak
  (FlashAttention-2 paper, Dao 2023); on H100 35 % forward (FlashAttention-3 paper,
  Shah et al. 2024), the backward at the same backward/forward ratio as on A100.
* ``memory_efficiency``: the fraction of HBM peak that memory-bound kernels stream at:
  0.90 (DeepSeek's FlashMLA: 3000 GB/s of the H800's 3.35 TB/s HBM3 in its
  memory-bound configuration; the same fraction is assumed for HBM2e and HBM3e parts,
  which have no comparable published measurement).
* ``kernel_floor_s`` / ``gemm_floor_s``: the shortest kernel and the shortest cuBLAS
  GEMM, launch to completion when queued behind other work.
* ``context_bytes`` and ``nccl_bytes_per_group``: device memory a process holds
  outside PyTorch's caching allocator (the CUDA context; NCCL's buffers for each
  communicator), subtracted from ``memory_bytes`` to give what the allocator may
  reserve ([Note: capacity a process sees] in allocator.py).

A host preset is what the CPU thread pays for what it does: host.py ([Note: host
cost]), where the measured host (``h200-host``) and the two assumed ones (``fast``,
``slow``: per operator only) are defined.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from zerobench.instruments.vgpu.gemm import shape_factor
from zerobench.instruments.vgpu.host import HOST_PRESETS, HostPreset, host_preset  # noqa: F401 - their home is host.py

_MiB = 2**20
_TB = 1e12


@dataclass(frozen=True)
class GpuPreset:
    name: str
    """Preset name, as given to ``--gpu``."""
    memory_bytes: int
    """Device memory, as nvidia-smi reports its total."""
    peak_flops: dict = field(default_factory=dict)
    """Dense peak FLOP/s by dtype (tensor cores for bf16/fp16; fp32 without TF32, PyTorch's default)."""
    hbm_bytes_per_s: float = 0.0
    """Peak device-memory bandwidth."""
    pcie_bytes_per_s: float = 0.0
    """Host-device copy bandwidth, per direction."""
    sm_count: int = 132
    """Streaming multiprocessors: what a GEMM's tiles are spread over, one wave at a time."""
    sm_clock_hz: float = 1.83e9
    """The clock that gives the data sheet's dense peak (SMs x tensor-core FMAs per clock x 2 x
    clock); ``_sleep(cycles)`` spins on it."""
    power_w: float = 700.0
    """Board power limit (documentation: why sustained matmul rates sit below the peak)."""
    matmul_efficiency: float = 0.78
    """Fraction of the dense peak a full wave of large GEMM tiles sustains (see the Note)."""
    attention_fwd_efficiency: float = 0.35
    attention_bwd_efficiency: float = 0.30
    memory_efficiency: float = 0.90
    kernel_floor_s: float = 2e-6
    gemm_floor_s: float = 6e-6
    context_bytes: int = 512 * _MiB
    """CUDA context, cuBLAS handles and the like, outside the caching allocator."""
    nccl_bytes_per_group: int = 688 * _MiB
    """NCCL's own buffers for one communicator (a process group that runs a collective)."""

    def __post_init__(self):
        for name in ("matmul_efficiency", "attention_fwd_efficiency", "attention_bwd_efficiency",
                     "memory_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"gpu preset {self.name}: {name} {value!r} is not allowed (allowed: 0 < x <= 1)")
        for name in ("context_bytes", "nccl_bytes_per_group"):
            if getattr(self, name) < 0:
                raise ValueError(f"gpu preset {self.name}: {name} {getattr(self, name)!r} is not allowed "
                                 "(allowed: bytes >= 0)")
        if self.context_bytes >= self.memory_bytes:
            raise ValueError(f"gpu preset {self.name}: context_bytes {self.context_bytes} is not allowed "
                             f"(allowed: less than memory_bytes {self.memory_bytes})")

    @property
    def sleep_cycles_per_s(self) -> float:
        return self.sm_clock_hz

    def peak(self, dtype: torch.dtype) -> float:
        """Dense peak FLOP/s of ``dtype`` (fp32's for a dtype the card has no tensor-core rate for)."""
        return self.peak_flops.get(dtype, self.peak_flops[torch.float32])

    def flops_per_s(self, dtype: torch.dtype) -> float:
        """What a full wave of large GEMM tiles sustains (costs.py prices shapes around it)."""
        return self.peak(dtype) * self.matmul_efficiency

    def with_memory(self, context_bytes: int | None = None, nccl_bytes_per_group: int | None = None) -> "GpuPreset":
        """This preset with the memory held outside the allocator set by the user."""
        changes = {k: v for k, v in (("context_bytes", context_bytes), ("nccl_bytes_per_group", nccl_bytes_per_group))
                   if v is not None}
        return dataclasses.replace(self, **changes) if changes else self


def _tensor_core(bf16_tflops: float, fp32_tflops: float) -> dict:
    return {torch.bfloat16: bf16_tflops * _TB, torch.float16: bf16_tflops * _TB, torch.float32: fp32_tflops * _TB}


def _large_gemm_efficiency(published_tflops: float, peak_tflops: float, shape: tuple, sm_count: int) -> float:
    """The efficiency of a full wave of large tiles that gives back a published matmul
    rate at the shape it was measured at (gemm.py, [Note: GEMM shapes])."""
    return published_tflops / peak_tflops / shape_factor(1, *shape, sm_count)


# H100 SXM and H200 share the die, clocks and 700 W limit ("H200 is the same" in the MAMF
# table), so they share the sustained rate: MSMF 755 of 989 TFLOP/s (stas00/ml-engineering),
# taken at the MAMF table's best H100 shape since the MSMF shape is not published. The other
# Hopper parts have no published rate and are given the same fraction. A100: MAMF 271.2 of
# 312 at 1024x10240x5120 (no sustained rate is published for it).
_HOPPER_SUSTAINED = _large_gemm_efficiency(755, 989, (2048, 2048, 13312), 132)
_AMPERE_ACHIEVABLE = _large_gemm_efficiency(271.2, 312, (1024, 10240, 5120), 108)

GPU_PRESETS: dict[str, GpuPreset] = {p.name: p for p in (
    GpuPreset("h100-sxm", memory_bytes=81_559 * _MiB, peak_flops=_tensor_core(989, 67), hbm_bytes_per_s=3.35 * _TB,
              pcie_bytes_per_s=64e9, sm_count=132, sm_clock_hz=1.83e9, power_w=700,
              matmul_efficiency=_HOPPER_SUSTAINED, attention_fwd_efficiency=0.35, attention_bwd_efficiency=0.30),
    GpuPreset("h100-nvl", memory_bytes=94 * 1024 * _MiB, peak_flops=_tensor_core(835, 60), hbm_bytes_per_s=3.9 * _TB,
              pcie_bytes_per_s=64e9, sm_count=132, sm_clock_hz=1.545e9, power_w=400,
              matmul_efficiency=_HOPPER_SUSTAINED, attention_fwd_efficiency=0.35, attention_bwd_efficiency=0.30),
    GpuPreset("h100-pcie", memory_bytes=81_559 * _MiB, peak_flops=_tensor_core(756, 51), hbm_bytes_per_s=2.0 * _TB,
              pcie_bytes_per_s=64e9, sm_count=114, sm_clock_hz=1.62e9, power_w=350,
              matmul_efficiency=_HOPPER_SUSTAINED, attention_fwd_efficiency=0.35, attention_bwd_efficiency=0.30),
    GpuPreset("gh200-96gb", memory_bytes=96 * 1024 * _MiB, peak_flops=_tensor_core(989, 67),
              hbm_bytes_per_s=4.0 * _TB, pcie_bytes_per_s=450e9, sm_count=132, sm_clock_hz=1.83e9, power_w=900,
              matmul_efficiency=_HOPPER_SUSTAINED, attention_fwd_efficiency=0.35, attention_bwd_efficiency=0.30),
    GpuPreset("h200", memory_bytes=143_771 * _MiB, peak_flops=_tensor_core(989, 67), hbm_bytes_per_s=4.8 * _TB,
              pcie_bytes_per_s=64e9, sm_count=132, sm_clock_hz=1.83e9, power_w=700,
              matmul_efficiency=_HOPPER_SUSTAINED, attention_fwd_efficiency=0.35, attention_bwd_efficiency=0.30),
    GpuPreset("a100-80gb", memory_bytes=81_920 * _MiB, peak_flops=_tensor_core(312, 19.5),
              hbm_bytes_per_s=2.039 * _TB, pcie_bytes_per_s=32e9, sm_count=108, sm_clock_hz=1.41e9, power_w=400,
              matmul_efficiency=_AMPERE_ACHIEVABLE, attention_fwd_efficiency=0.73, attention_bwd_efficiency=0.63),
    GpuPreset("a100-40gb", memory_bytes=40_960 * _MiB, peak_flops=_tensor_core(312, 19.5),
              hbm_bytes_per_s=1.555 * _TB, pcie_bytes_per_s=32e9, sm_count=108, sm_clock_hz=1.41e9, power_w=400,
              matmul_efficiency=_AMPERE_ACHIEVABLE, attention_fwd_efficiency=0.73, attention_bwd_efficiency=0.63),
)}


def _lookup(kind: str, presets: dict, value):
    """``value`` itself if it is a preset, else the preset of that name; a bad name is
    an error naming the allowed ones."""
    if not isinstance(value, str):
        return value
    if value not in presets:
        raise ValueError(f"{kind} must be one of {', '.join(presets)}, got {value!r}")
    return presets[value]


def preset_for_device(device_name: str) -> str:
    """The preset closest to a CUDA device name (``torch.cuda.get_device_name``); h100-sxm
    when unknown."""
    name = device_name.upper()
    if "GH200" in name:
        return "gh200-96gb"
    if "H200" in name:
        return "h200"
    if "A100" in name:
        return "a100-40gb" if "40GB" in name else "a100-80gb"
    if "H100" in name and "NVL" in name:
        return "h100-nvl"
    if "H100" in name and "PCIE" in name:
        return "h100-pcie"
    return "h100-sxm"


def gpu_preset(name: str | GpuPreset) -> GpuPreset:
    return _lookup("gpu", GPU_PRESETS, name)
