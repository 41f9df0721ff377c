"""How much of a GPU a GEMM of a given shape can use: tile and wave quantisation, and
the fixed cost of each tile that a short reduction (small K) cannot hide.

[Note: GEMM shapes]
cuBLAS computes ``C[m, n] = A[m, k] @ B[k, n]`` (``batch`` times) in output tiles of
``tile_m x tile_n``, one tile per SM at a time, in *waves* of ``sm_count`` tiles
(NVIDIA, "Matrix Multiplication Background User's Guide": tile quantisation and wave
quantisation). Each tile runs its k-loop plus a fixed prologue/epilogue, which we
count as ``K0`` extra steps of the loop. So a GEMM costs

    waves(tile) * 2 * tile_m * tile_n * (k + K0) / (peak / sm_count * efficiency)

for the tile that makes this smallest (cuBLAS's heuristics pick among tile shapes;
the candidates are ``TILES``), and its *shape factor* -- useful FLOPs over the FLOPs
that time could have done -- is what multiplies the card's large-GEMM efficiency.
A full wave of large tiles with a long reduction has a factor near 1; a GEMM with a
few tiles (skinny) or a short reduction (small K) has a small one.

``K0`` = 128, the tile set and the ``gemm_floor_s`` of the presets (6 us) are fitted
to the H100 bf16 GEMM rates that XLA publishes for its cost model (openxla/xla,
``xla/service/gpu/model/matmul_interpolator_data.h``, ``sm_90``): with them the model
is within 12 % of all 31 shapes from 256 to 4096 a side (docs/vgpu.md lists them;
tests/test_vgpu_costs.py checks eight). The large-GEMM efficiency itself comes from
each card's measured GEMMs, or its published achievable matmul rate (presets.py).

[Note: GEMM layouts]
A GEMM's operands reach cuBLAS as they lie in memory: row-major (``n``) or a transposed
view (``t``: its rows strided by one). ``F.linear`` runs three GEMMs a layer, each in its
own layout: the forward ``x @ W.T`` (``nt``), the input's gradient ``dY @ W`` (``nn``) and
the weight's ``dY.T @ x`` (``tn``); cuBLAS picks other kernels for each (the H200's step
ran ``nvjet_..._TN``, ``_NN`` and ``_NT`` kernels, in its column-major naming), and
they run at different rates: in the H200's traced step the 8192x14336x4096 GEMM took
1.20 ms as a forward and 1.30 ms as an input gradient. So a preset gives the large-GEMM
efficiency per layout (``matmul_layouts``), fitted to GEMMs measured in that layout, and
the GEMMs it measured, each priced at its own time when a step runs that layout, shape
and dtype (``gemm_measured``); any other shape is the tile model's at its layout's
efficiency.
"""

from __future__ import annotations

import math

#: Output tile shapes cuBLAS chooses among (tile_m, tile_n).
TILES = ((128, 256), (128, 128), (64, 128), (64, 64))
#: Fixed cost of one tile, in steps of its k-loop (fitted; see the Note).
K0 = 128


def shape_factor(batch: int, m: int, n: int, k: int, sm_count: int) -> float:
    """Useful FLOPs of the GEMM over what its tiles and waves occupy (<= 1)."""
    if min(batch, m, n, k) <= 0:
        return 1.0
    best = math.inf
    for tile_m, tile_n in TILES:
        tiles = batch * math.ceil(m / tile_m) * math.ceil(n / tile_n)
        waves = math.ceil(tiles / sm_count)
        best = min(best, waves * sm_count * tile_m * tile_n * (k + K0))
    return batch * m * n * k / best


def dims(func_name: str, shapes: list[tuple]) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a matmul operator from its tensor inputs' shapes, or None.

    ``mm(a, b)``, ``addmm(bias, a, b)``, ``bmm(a, b)``, ``baddbmm(bias, a, b)``: the last
    two shapes are the operands."""
    if func_name not in ("mm", "addmm", "bmm", "baddbmm") or len(shapes) < 2:
        return None
    a, b = shapes[-2], shapes[-1]
    if func_name in ("mm", "addmm") and len(a) == 2 and len(b) == 2:
        return 1, a[0], b[1], a[1]
    if func_name in ("bmm", "baddbmm") and len(a) == 3 and len(b) == 3:
        return a[0], a[1], b[2], a[2]
    return None


def _side(shape: tuple, stride: tuple) -> str:
    """``t`` when an operand is a transposed view (its rows strided by one), else ``n``."""
    if len(shape) < 2 or len(stride) < 2:
        return "n"
    return "t" if stride[-2] == 1 and stride[-1] != 1 and shape[-1] > 1 else "n"


def layout(a, b) -> str:
    """The layout of ``a @ b`` (``nn``, ``nt``, ``tn`` or ``tt``) from the operands' strides."""
    return _side(tuple(a.shape), tuple(a.stride())) + _side(tuple(b.shape), tuple(b.stride()))
