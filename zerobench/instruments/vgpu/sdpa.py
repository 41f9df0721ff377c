"""Which fused attention kernel ``F.scaled_dot_product_attention`` runs on a CUDA GPU: the
backend torch would pick for the part, the dtype, the head size and the torch version.

[Note: SDPA backend choice]
On CUDA, ``scaled_dot_product_attention`` tries its backends in a priority order and runs
the first whose checks pass (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
``select_sdp_backend``, "Note [SDPA Runtime Dispatch]"). The order:

* flash, memory-efficient, math, cuDNN, in every release except where torch prefers
  cuDNN first. It did in 2.5.0 on sm90 (pytorch#125343's idea, shipped with 2.5 and
  withdrawn in 2.5.1 by pytorch#138522 after pytorch#139298's wrong results), and does
  again from 2.9 (pytorch#162073, ``check_prefer_cudnn_attention``) on sm90 and sm100
  when the cuDNN torch runs with is newer than 9.15.0 (the seq_len fix of
  pytorch#169849). The cuDNN bundled with the CUDA wheels crossed that in 2.11 (9.19 on
  the measured H200, torch 2.11.0+cu130), so from 2.11 on cuDNN runs first there; 2.9
  and 2.10 kept flash first in practice (huggingface/transformers#48163 traces this).
* Each backend's checks, as far as they depend on what a prediction knows (dtype, head
  size, the part): flash needs sm80 or newer, fp16 or bf16, the same head size for q, k
  and v and at most 256; cuDNN sm80 or newer (preferred first only on sm90/sm100), fp16
  or bf16, a head size that is a multiple of 8 and at most 128 (256 with a recent
  cuDNN frontend, ``kCuDNNFrontendSupportsD256``: taken as available from 2.11);
  memory-efficient any of fp16, bf16 and fp32 with a head size that is a multiple of 8
  (fp16/bf16) or 4 (fp32) on sm80+; math always.

The CPU build runs ``_scaled_dot_product_flash_attention_for_cpu`` whatever the GPU
would; the virtual GPU prices that kernel as the backend chosen here would run it
(costs.py). ``predict --sdpa-backend`` names one instead, as ``torch.nn.attention.sdpa_kernel``
does in a user's script, or as the software of a published run did.
"""

from __future__ import annotations

import torch

BACKENDS = ("cudnn", "flash", "efficient", "math")
#: what ``--sdpa-backend`` takes
CHOICES = ("auto",) + BACKENDS


def _version(text: str) -> tuple[int, int, int]:
    parts = []
    for piece in str(text).split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


def prefers_cudnn(torch_version: str, sm_major: int) -> bool:
    """Whether torch ``torch_version`` tries cuDNN first on a part of ``sm_major`` (see the Note)."""
    v = _version(torch_version)
    if v[:3] == (2, 5, 0):
        return sm_major == 9
    return v >= (2, 11, 0) and sm_major in (9, 10)


def priority(torch_version: str, sm_major: int) -> tuple[str, ...]:
    if prefers_cudnn(torch_version, sm_major):
        return ("cudnn", "flash", "efficient", "math")
    return ("flash", "efficient", "math", "cudnn")


def eligible(backend: str, dtype: torch.dtype, head_dim: int, sm_major: int, torch_version: str) -> bool:
    """Whether ``backend``'s checks pass for these inputs on this part (see the Note)."""
    half = dtype in (torch.float16, torch.bfloat16)
    if backend == "math":
        return True
    if sm_major < 8:
        return backend == "efficient" and head_dim % (8 if half else 4) == 0
    if backend == "flash":
        return half and head_dim <= 256
    if backend == "cudnn":
        limit = 256 if _version(torch_version) >= (2, 11, 0) and sm_major >= 9 else 128
        return half and head_dim % 8 == 0 and head_dim <= limit
    if backend == "efficient":
        return dtype in (torch.float16, torch.bfloat16, torch.float32) and head_dim % (8 if half else 4) == 0
    raise ValueError(f"sdpa backend {backend!r} is not allowed (allowed: {', '.join(BACKENDS)})")


def check(requested: str) -> str:
    """``requested`` if ``--sdpa-backend`` allows it; ValueError naming the allowed ones otherwise."""
    if requested not in CHOICES:
        from zerobench.choices import not_allowed

        raise ValueError(not_allowed("--sdpa-backend", requested, CHOICES))
    return requested


def choose(dtype: torch.dtype, head_dim: int, sm_major: int, torch_version: str | None = None,
           requested: str = "auto") -> str:
    """The backend that runs: ``requested`` if it is one (as ``sdpa_kernel`` forces it), else
    the first of torch's priority order whose checks pass."""
    if check(requested) != "auto":
        return requested
    version = torch_version or torch.__version__
    for backend in priority(version, sm_major):
        if eligible(backend, dtype, head_dim, sm_major, version):
            return backend
    return "math"
