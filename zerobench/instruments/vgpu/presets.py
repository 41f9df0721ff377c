"""What the virtual GPU is modelled on: a GPU's peaks and a host's costs.

[Note: virtual GPU presets]
Each GPU preset gives the dense (no sparsity) peaks of NVIDIA's data sheets and the
fraction of each peak that the cost model assumes is reached. The fractions are
assumptions, stated here and in docs/vgpu.md, not measurements of this project:

* ``matmul_efficiency`` 0.70: large bf16 GEMMs on Hopper and Ampere typically reach
  60-80 % of the tensor-core peak; training runs report 35-45 % MFU over a whole step,
  which includes everything that is not a GEMM.
* ``attention_efficiency``: fused attention (FlashAttention-2, what SDPA runs in eager
  PyTorch) reaches about 35 % of the bf16 peak on H100 (FlashAttention-3 paper, Shah et
  al. 2024, abstract) and 50-73 % on A100 (FlashAttention-2 paper, Dao 2023); the presets
  take 0.35 on Hopper and 0.50 on A100. Its FLOPs are counted as the kernel does them:
  half the score matrix when causal.
* ``memory_efficiency`` 0.80: elementwise kernels stream at about 80 % of HBM peak.
* ``kernel_floor_s``: the shortest kernel (launch to completion on an idle device).

Sources: NVIDIA H100 Tensor Core GPU data sheet (SXM5: 989 TFLOPS bf16 dense, 67 TFLOPS
fp32, 3.35 TB/s HBM3, 80 GB), NVIDIA A100 data sheet (SXM4 80 GB: 312 TFLOPS bf16,
19.5 TFLOPS fp32, 2.039 TB/s HBM2e), NVIDIA H200 data sheet (SXM: 989 TFLOPS bf16,
67 TFLOPS fp32, 4.8 TB/s HBM3e, 141 GB). Host-to-device copies run at the PCIe link's
per-direction bandwidth (Gen5 x16: 64 GB/s; Gen4 x16: 32 GB/s) at ``memory_efficiency``.
``memory_bytes`` is the total that nvidia-smi reports for each card (81,559 MiB for the
H100 SXM 80GB, 81,920 MiB for the A100 80GB, 143,771 MiB for the H200): what the caching
allocator can reserve at most, before the CUDA context's own share.

A host preset is what the CPU thread pays per operator it dispatches: ``dispatch_s``
for every operator (Python, the dispatcher, autograd bookkeeping) and ``launch_s`` more
for one that launches a kernel. PyTorch eager mode costs a few to tens of microseconds
per operator; ``fast`` and ``slow`` bracket that range. An operator the CPU runs on
host memory (CPU offload's optimizer step on pinned shards) costs its bytes in and out
at ``bytes_per_s``, 10 GB/s in both presets: about what one thread of a server CPU
streams (an assumption; a multi-threaded CPU Adam is faster).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class GpuPreset:
    name: str
    """Preset name, as given to ``--gpu``."""
    memory_bytes: int
    """Device memory the caching allocator may reserve."""
    peak_flops: dict = field(default_factory=dict)
    """Dense peak FLOP/s by dtype (matmul-class operators)."""
    hbm_bytes_per_s: float = 0.0
    """Peak device-memory bandwidth."""
    pcie_bytes_per_s: float = 0.0
    """Host-device copy bandwidth, per direction."""
    sleep_cycles_per_s: float = 1.5e9
    """Clock that ``_sleep(cycles)`` spins on (the SM clock)."""
    matmul_efficiency: float = 0.70
    attention_efficiency: float = 0.35
    memory_efficiency: float = 0.80
    kernel_floor_s: float = 2e-6

    def flops_per_s(self, dtype: torch.dtype) -> float:
        return self.peak_flops.get(dtype, self.peak_flops[torch.float32]) * self.matmul_efficiency


_TB = 1e12
GPU_PRESETS: dict[str, GpuPreset] = {
    "h100-sxm": GpuPreset(
        "h100-sxm", memory_bytes=81_559 * 2**20,
        peak_flops={torch.bfloat16: 989 * _TB, torch.float16: 989 * _TB, torch.float32: 67 * _TB},
        hbm_bytes_per_s=3.35 * _TB, pcie_bytes_per_s=64e9, sleep_cycles_per_s=1.98e9),
    "a100-80gb": GpuPreset(
        "a100-80gb", memory_bytes=81_920 * 2**20,
        peak_flops={torch.bfloat16: 312 * _TB, torch.float16: 312 * _TB, torch.float32: 19.5 * _TB},
        hbm_bytes_per_s=2.039 * _TB, pcie_bytes_per_s=32e9, sleep_cycles_per_s=1.41e9,
        attention_efficiency=0.50),
    "h200": GpuPreset(
        "h200", memory_bytes=143_771 * 2**20,
        peak_flops={torch.bfloat16: 989 * _TB, torch.float16: 989 * _TB, torch.float32: 67 * _TB},
        hbm_bytes_per_s=4.8 * _TB, pcie_bytes_per_s=64e9, sleep_cycles_per_s=1.98e9),
}


@dataclass(frozen=True)
class HostPreset:
    name: str
    dispatch_s: float
    """Host time of every operator the CPU thread dispatches."""
    launch_s: float
    """Additional host time of an operator that launches a kernel."""
    bytes_per_s: float = 10e9
    """Memory speed of an operator the CPU itself runs on host memory (CPU offload's
    optimizer step): bytes read plus written per second, one thread's streaming rate."""


HOST_PRESETS: dict[str, HostPreset] = {
    "fast": HostPreset("fast", dispatch_s=2e-6, launch_s=3e-6),
    "slow": HostPreset("slow", dispatch_s=15e-6, launch_s=10e-6),
}


def _lookup(kind: str, presets: dict, value):
    """``value`` itself if it is a preset, else the preset of that name; a bad name is
    an error naming the allowed ones."""
    if not isinstance(value, str):
        return value
    if value not in presets:
        raise ValueError(f"{kind} must be one of {', '.join(presets)}, got {value!r}")
    return presets[value]


def gpu_preset(name: str | GpuPreset) -> GpuPreset:
    return _lookup("gpu", GPU_PRESETS, name)


def host_preset(name: str | HostPreset) -> HostPreset:
    return _lookup("host", HOST_PRESETS, name)
