"""What the virtual GPU is modelled on: a GPU's figures, each from a measurement or a data
sheet, and a host's costs.

[Note: virtual GPU presets]
A GPU preset is a JSON file, one per part (``zerobench/instruments/vgpu/gpus/<name>.json``
for the shipped ones; any path for a user's, as ``zerobench calibrate`` writes it). Each
figure is ``{"value": ..., "source": "..."}``: the measurement it was derived from (a file
and what was measured) or the data sheet it was copied from, so a preset says where every
number comes from. A file may name a ``"base"`` preset and give only the figures that
differ (the torchtitan H100s are the H100 SXM with their memory and power cap), as
workloads derive from each other by changing fields.

The figures that price kernels ([Note: operator cost] in costs.py):

* ``peak_flops`` (dense, per dtype), ``hbm_bytes_per_s``, ``pcie_bytes_per_s``,
  ``memory_bytes``, ``sm_count``, ``sm_clock_hz``, ``power_w``: the data sheet (memory as
  CUDA or nvidia-smi reports it where known);
* ``matmul_efficiency``: the fraction of the dense peak a full wave of large GEMM tiles
  reaches *in a burst* (costs.py prices other shapes around it: [Note: GEMM shapes]);
  calibrated on a grid of measured GEMMs; ``matmul_layouts`` the same per layout and
  ``gemm_measured`` the GEMMs measured alone, each priced at its own time ([Note: GEMM
  layouts] in gemm.py);
* ``sustained_ratio``: the rate of compute-bound kernels when the card has run at its
  power limit for seconds, over the burst rate (a GEMM run back to back for 12 s on the
  H200: 670 against 777 TFLOP/s); ``step_ratio``: the same in a training step, where
  traced steps showed it (the H200's: 1, no factor), else a step runs at the sustained
  ratio: see [Note: clocks under load] in costs.py. ``power_cap_w`` (a limit set below
  the board's ``power_w``, as Meta's H100s ran at 500 W) and ``idle_power_w`` scale both;
* ``attention_<backend>``: forward and backward FLOP rate of each SDPA backend (cudnn,
  flash, efficient) as a fraction of the dense peak, in a burst; which backend runs is
  torch's choice for the part, the dtype and the head size (sdpa.py); ``attention_grid``
  the same per sequence length and head size, where measured ([Note: attention over
  shapes] in costs.py);
* ``cast_efficiency``: what a copy or pointwise kernel PyTorch does not vectorize streams
  at, measured on a bf16-to-fp32 cast ([Note: vectorized kernels] in costs.py);
* ``copy_efficiency``, ``cast_efficiency``, ``elementwise_efficiency``,
  ``optimizer_efficiency``, ``pcie_efficiency``: the fraction of the HBM (or PCIe) peak
  that each kind of memory-bound kernel streams its bytes at, the bytes counted as the
  cost model counts them (each pass over memory the kernel makes);
* ``kernel_floor_s`` / ``gemm_floor_s``: the shortest kernel and the shortest cuBLAS
  GEMM, launch to completion when queued behind other work;
* ``context_bytes`` and ``nccl_bytes_per_group``: device memory a process holds outside
  PyTorch's caching allocator ([Note: capacity a process sees] in allocator.py).

A preset may also carry ``"host"``: host.json-shaped measurements of the host's costs
(microseconds) on the machine the GPU was measured in, which the host model (host.py)
turns into a host preset; ``predict --gpu`` uses it unless ``--host`` is given. A base
passes on its figures, not its host.

[Note: measured kernels in a preset]
A preset may carry ``"measured_kernels"``: ``{"value": {"gemm": [...], "attention":
[...]}, "source": ...}``, every GEMM and attention kernel calibrate timed, one row each,
for pricing a shape by what that shape (or its nearest measured neighbour) ran at rather
than by one efficiency per class. ``zerobench calibrate`` writes it
(calibration.py); a base passes it on, as its figures (the rows are the part's). Rows:

* ``gemm``: ``m, n, k, dtype`` (``torch.mm`` of ``[m, k]`` by ``[k, n]``), ``layout``:
  ``forward``, ``input_grad``, ``weight_grad`` (the three GEMMs of ``F.linear`` in
  training, with autograd's transposed operands: [Note: GEMM layouts] in microbench.py)
  or null (both operands contiguous), ``layer`` (the layer it was timed for, or null);
* ``attention``: ``backend`` (cudnn, flash, efficient), ``direction`` (forward,
  backward), ``batch, heads, seq, head_dim, causal, dtype``: causal SDPA on ``[batch,
  heads, seq, head_dim]``;
* each with ``seconds`` (per call, in a burst: the median of batches of calls back to
  back between two CUDA events when ``timing`` is ``batch``, or of calls each between
  its own two events when ``per call``: [Note: timing a kernel] in
  zerobench/validation/calibrate/kernels.py) and ``efficiency``: the class figure this
  row alone fits ([Note: calibrating on kernels] in calibration.py), for a GEMM the
  ``matmul_efficiency`` that makes the tile model give this row's time, for attention
  the fraction of the dense peak at the FLOPs the cost model counts (half when causal).
  ``seconds`` is what was measured; ``efficiency`` depends on the cost model of the
  commit that built the preset (its source says which measurements).

The class figures (``matmul_efficiency``, ``attention_<backend>``) are still fitted over
all rows of their class, and priced from unless a cost model reads these rows.

Fractions measured on one part carry over to a part of the same die (H100 SXM from the
H200: the same GH100 at the same clocks and 700 W), as fractions of that part's own peaks;
for other parts the file says what was assumed. ``zerobench calibrate`` measures a GPU and
writes such a file through :func:`zerobench.instruments.vgpu.calibration.preset_from_measurements`,
the function that also rebuilt the shipped ``h200`` from the H200's measurements.

A host preset is what the CPU thread pays for what it does: host.py ([Note: host
cost]), where the measured host (``h200-host``) and the two assumed ones (``fast``,
``slow``: per operator only) are defined.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerobench.choices import not_allowed

_MiB = 2**20

#: Where the shipped GPU presets live, one JSON file per part.
GPU_DIR = Path(__file__).parent / "gpus"
#: The format tag of a preset file.
PRESET_FORMAT = "zerobench-gpu-preset/1"
#: SDPA backends a preset may carry an efficiency for (math is priced as its kernels).
ATTENTION_BACKENDS = ("cudnn", "flash", "efficient")
#: What a preset's clocks may be ([Note: clocks under load] in costs.py).
CLOCKS = ("step", "sustained", "burst")
#: GEMM layouts: which of the two operands is a transposed view (gemm.py, [Note: GEMM layouts]).
LAYOUTS = ("nn", "nt", "tn", "tt")
#: The fields of one row of an attention grid in a preset file.
ATTENTION_ROW = ("backend", "seq", "head_dim", "forward", "backward")
#: The fields of one measured GEMM in a preset file.
GEMM_ROW = ("layout", "m", "n", "k", "dtype", "seconds")
#: dtype names in a preset file.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class GpuPreset:
    name: str
    """Preset name, as given to ``--gpu`` (or the file it was read from)."""
    memory_bytes: int
    """Device memory, as CUDA (``total_memory``) or nvidia-smi reports its total."""
    peak_flops: dict = field(default_factory=dict)
    """Dense peak FLOP/s by dtype (tensor cores for bf16/fp16; fp32 without TF32, PyTorch's default)."""
    hbm_bytes_per_s: float = 0.0
    """Peak device-memory bandwidth."""
    pcie_bytes_per_s: float = 0.0
    """Host-device copy bandwidth, per direction."""
    sm_count: int = 132
    """Streaming multiprocessors: what a GEMM's tiles are spread over, one wave at a time."""
    sm_clock_hz: float = 1.83e9
    """The clock that gives the data sheet's dense peak; ``_sleep(cycles)`` spins on it."""
    compute_capability: str = "9.0"
    """``major.minor``: what torch's choices depend on (SDPA backend, cuBLAS workspace size)."""
    power_w: float = 700.0
    """Board power limit (TDP)."""
    power_cap_w: float | None = None
    """The power limit the card runs at, when set below ``power_w`` (``nvidia-smi -pl``)."""
    idle_power_w: float = 0.0
    """Board power with a CUDA context and nothing running (the part of the power that does not scale with clocks)."""
    matmul_efficiency: float = 0.78
    """Fraction of the dense peak a full wave of large GEMM tiles reaches in a burst."""
    matmul_layouts: dict | None = None
    """The same per layout (``nn``, ``nt``, ``tn``, ``tt``: which operand is a transposed view,
    gemm.py [Note: GEMM layouts]); a layout without a figure takes ``matmul_efficiency``."""
    gemm_measured: tuple = ()
    """GEMMs timed alone in a burst, each ``(layout, m, n, k, dtype, seconds)``: a GEMM of one of
    these layouts, shapes and dtypes is priced at its measured time, any other by the tile model."""
    sustained_ratio: float = 1.0
    """Rate of compute-bound kernels run back to back for seconds at the board limit (a GEMM
    loop), over their burst rate."""
    step_ratio: float | None = None
    """Rate of compute-bound kernels in a training step over their burst rate, where traced
    steps measured it; None: ``sustained_ratio`` ([Note: clocks under load] in costs.py)."""
    clocks: str = "step"
    """``step`` (a training step), ``sustained`` (a GEMM loop at the power limit) or ``burst``
    (a microbenchmark's few milliseconds): [Note: clocks under load] in costs.py."""
    attention_cudnn: tuple | None = None
    """(forward, backward) fractions of the dense peak of cuDNN's fused attention; None: no figure."""
    attention_flash: tuple | None = (0.35, 0.30)
    attention_efficient: tuple | None = (0.175, 0.10)
    attention_grid: tuple = ()
    """Fused attention measured over shapes, each ``(backend, seq, head_dim, forward, backward)``
    (fractions of the dense peak, burst): a backend with rows here is priced by them over
    sequence length and head size ([Note: attention over shapes] in costs.py), any other by
    its ``attention_<backend>`` pair."""
    copy_efficiency: float = 0.90
    """Fraction of the HBM peak a same-dtype copy streams its bytes (read and written) at."""
    cast_efficiency: float = 0.90
    """The same for a copy or pointwise kernel PyTorch does not vectorize (most casts; strided,
    broadcast or mixed-dtype operands: [Note: vectorized kernels] in costs.py)."""
    elementwise_efficiency: float = 0.90
    """The same for other memory-bound kernels (pointwise, norms, softmax, losses), their passes counted."""
    optimizer_efficiency: float = 0.90
    """The same for an optimizer's multi-tensor (foreach) kernels."""
    pcie_efficiency: float = 0.90
    """Fraction of the PCIe peak a pinned host-device copy reaches."""
    kernel_floor_s: float = 2e-6
    gemm_floor_s: float = 6e-6
    context_bytes: int = 512 * _MiB
    """CUDA context, loaded kernels and the like, outside the caching allocator."""
    nccl_bytes_per_group: int = 688 * _MiB
    """NCCL's own buffers for one communicator (a process group that runs a collective)."""
    host: dict | None = None
    """host.json-shaped measurements of the host's costs (microseconds), or None."""
    measured_kernels: dict | None = None
    """GEMMs and attention as calibrate timed them, row by row ([Note: measured kernels in a preset]), or None."""
    description: str = ""
    sources: dict = field(default_factory=dict, compare=False)
    """figure -> where its value comes from (documentation; not part of the model)."""

    def __post_init__(self):
        for name in ("matmul_efficiency", "sustained_ratio", "copy_efficiency", "cast_efficiency",
                     "elementwise_efficiency", "optimizer_efficiency", "pcie_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"gpu preset {self.name}: {name} {value!r} is not allowed (allowed: 0 < x <= 1)")
        for backend in ATTENTION_BACKENDS:
            pair = getattr(self, f"attention_{backend}")
            if pair is not None and (len(pair) != 2 or not all(0 < x <= 1 for x in pair)):
                raise ValueError(f"gpu preset {self.name}: attention_{backend} {pair!r} is not allowed "
                                 "(allowed: [forward, backward], each 0 < x <= 1)")
        if self.clocks not in CLOCKS:
            raise ValueError(f"gpu preset {self.name}: clocks {self.clocks!r} is not allowed "
                             f"(allowed: {', '.join(CLOCKS)})")
        if self.step_ratio is not None and not 0 < self.step_ratio:
            raise ValueError(f"gpu preset {self.name}: step_ratio {self.step_ratio!r} is not allowed "
                             "(allowed: null, or x > 0)")
        for layout, value in (self.matmul_layouts or {}).items():
            if layout not in LAYOUTS or not 0 < value <= 1:
                raise ValueError(f"gpu preset {self.name}: matmul_layouts {layout}: {value!r} is not allowed "
                                 f"(allowed: layouts {', '.join(LAYOUTS)}, each 0 < x <= 1)")
        for row in self.attention_grid:
            if (len(row) != 5 or row[0] not in ATTENTION_BACKENDS or not all(isinstance(x, int) and x > 0
                                                                           for x in row[1:3])
                    or not all(0 < x <= 1 for x in row[3:])):
                raise ValueError(f"gpu preset {self.name}: attention_grid row {row!r} is not allowed (allowed: "
                                 f"{{backend: {'/'.join(ATTENTION_BACKENDS)}, seq, head_dim: > 0, forward, backward: "
                                 "0 < x <= 1}})")
        for row in self.gemm_measured:
            if (len(row) != 6 or row[0] not in LAYOUTS or row[4] not in DTYPES or not row[5] > 0
                    or not all(isinstance(x, int) and x > 0 for x in row[1:4])):
                raise ValueError(f"gpu preset {self.name}: gemm_measured row {row!r} is not allowed (allowed: "
                                 f"{{layout: {'/'.join(LAYOUTS)}, m, n, k: > 0, dtype: {'/'.join(DTYPES)}, "
                                 "seconds: > 0}})")
        if self.power_cap_w is not None and not 0 < self.power_cap_w:
            raise ValueError(f"gpu preset {self.name}: power_cap_w {self.power_cap_w!r} is not allowed "
                             "(allowed: watts > 0)")
        for name in ("context_bytes", "nccl_bytes_per_group"):
            if getattr(self, name) < 0:
                raise ValueError(f"gpu preset {self.name}: {name} {getattr(self, name)!r} is not allowed "
                                 "(allowed: bytes >= 0)")
        if self.context_bytes >= self.memory_bytes:
            raise ValueError(f"gpu preset {self.name}: context_bytes {self.context_bytes} is not allowed "
                             f"(allowed: less than memory_bytes {self.memory_bytes})")
        if torch.float32 not in self.peak_flops:
            raise ValueError(f"gpu preset {self.name}: peak_flops has no fp32 figure (allowed: a dict of "
                             f"{', '.join(DTYPES)} to FLOP/s, fp32 included)")

    @property
    def sleep_cycles_per_s(self) -> float:
        return self.sm_clock_hz

    @property
    def sm_major(self) -> int:
        return int(str(self.compute_capability).split(".")[0])

    def peak(self, dtype: torch.dtype) -> float:
        """Dense peak FLOP/s of ``dtype`` (fp32's for a dtype the card has no tensor-core rate for)."""
        return self.peak_flops.get(dtype, self.peak_flops[torch.float32])

    @property
    def cap_factor(self) -> float:
        """How much slower compute-bound kernels run under ``power_cap_w`` than at the board
        limit: see [Note: clocks under load] in costs.py."""
        cap = self.power_cap_w
        if cap is None or cap >= self.power_w:
            return 1.0
        dynamic = max(cap - self.idle_power_w, 1e-9) / max(self.power_w - self.idle_power_w, 1e-9)
        return dynamic ** (1.0 / 3.0)

    @property
    def compute_scale(self) -> float:
        """The rate of compute-bound kernels over their burst rate, at these clocks."""
        if self.clocks == "burst":
            return 1.0
        if self.clocks == "step" and self.step_ratio is not None:
            return self.step_ratio * self.cap_factor
        return self.sustained_ratio * self.cap_factor

    def flops_per_s(self, dtype: torch.dtype, layout: str | None = None) -> float:
        """What a full wave of large GEMM tiles of ``layout`` reaches at these clocks (costs.py
        prices shapes around it)."""
        return self.peak(dtype) * self.matmul_efficiency_of(layout) * self.compute_scale

    def matmul_efficiency_of(self, layout: str | None) -> float:
        """The large-GEMM efficiency of ``layout`` (``matmul_efficiency`` where none is given)."""
        return (self.matmul_layouts or {}).get(layout, self.matmul_efficiency)

    def measured_gemm(self, layout: str, m: int, n: int, k: int, dtype: torch.dtype) -> float | None:
        """The burst seconds of a GEMM of this layout, shape and dtype timed alone, or None."""
        name = _DTYPE_NAMES.get(dtype)
        for row in self.gemm_measured:
            if row[:5] == (layout, m, n, k, name):
                return row[5]
        return None

    def attention_efficiency(self, backend: str, backward: bool, seq: int | None = None,
                             head_dim: int | None = None) -> float:
        """The fraction of the dense peak ``backend``'s fused attention reaches in a burst, at
        this sequence length and head size where the preset's grid has the backend
        ([Note: attention over shapes] in costs.py)."""
        grid = [r for r in self.attention_grid if r[0] == backend]
        if grid and seq and head_dim:
            return _grid_efficiency(grid, seq, head_dim, 4 if backward else 3)
        pair = getattr(self, f"attention_{backend}", None)
        if pair is None:
            raise ValueError(f"gpu preset {self.name}: no attention_{backend} figure for the SDPA backend torch "
                             f"picks here (allowed: a preset that gives it, or --sdpa-backend "
                             f"{', '.join(b for b in ATTENTION_BACKENDS if getattr(self, f'attention_{b}'))}, math)")
        return pair[1 if backward else 0]

    def bandwidth(self, kind: str) -> float:
        """Bytes per second of a memory-bound kernel of ``kind``: copy, cast, elementwise, optimizer or pcie."""
        if kind == "pcie":
            return self.pcie_bytes_per_s * self.pcie_efficiency
        return self.hbm_bytes_per_s * getattr(self, f"{kind}_efficiency")

    def with_memory(self, context_bytes: int | None = None, nccl_bytes_per_group: int | None = None) -> "GpuPreset":
        """This preset with the memory held outside the allocator set by the user."""
        changes = {k: v for k, v in (("context_bytes", context_bytes), ("nccl_bytes_per_group", nccl_bytes_per_group))
                   if v is not None}
        return dataclasses.replace(self, **changes) if changes else self

    def with_clocks(self, clocks: str) -> "GpuPreset":
        return self if clocks == self.clocks else dataclasses.replace(self, clocks=clocks)

    # -- the file ---------------------------------------------------------------------

    def figures(self) -> dict:
        """Every model figure of this preset in its file's form (values only, JSON types)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in NOT_FIGURES:
                continue
            value = getattr(self, f.name)
            if f.name == "peak_flops":
                value = {_DTYPE_NAMES.get(k, str(k)): v for k, v in value.items()}
            elif f.name == "gemm_measured":
                value = [dict(zip(GEMM_ROW, row)) for row in value]
            elif f.name == "attention_grid":
                value = [dict(zip(ATTENTION_ROW, row)) for row in value]
            elif isinstance(value, tuple):
                value = {"forward": value[0], "backward": value[1]}
            out[f.name] = value
        return out

    def to_file(self) -> dict:
        """This preset as a self-contained preset file (no base), each figure with its source."""
        figures = {k: {"value": v, "source": self.sources.get(k, "")} for k, v in self.figures().items()}
        out = {"format": PRESET_FORMAT, "name": self.name, "description": self.description, "figures": figures}
        if self.host is not None:
            out["host"] = {"value": self.host, "source": self.sources.get("host", "")}
        if self.measured_kernels is not None:
            out["measured_kernels"] = {"value": self.measured_kernels,
                                       "source": self.sources.get("measured_kernels", "")}
        return out


#: Fields of a preset that are not figures: names, documentation, and what a file gives
#: beside its figures (``host``, ``measured_kernels``).
NOT_FIGURES = ("name", "description", "sources", "host", "clocks", "measured_kernels")
#: Figures a preset file may give, and the dataclass field each one sets.
FIGURES = tuple(f.name for f in dataclasses.fields(GpuPreset)
                if f.name not in NOT_FIGURES)


def _grid_efficiency(grid: list[tuple], seq: int, head_dim: int, column: int) -> float:
    """An attention grid's efficiency at ``seq`` and ``head_dim``: the nearest measured head
    size (by ratio), then linear in log2 of the sequence length between its two measured
    neighbours, the end's figure beyond the ends ([Note: attention over shapes] in costs.py)."""
    import math

    nearest = min({r[2] for r in grid}, key=lambda d: (abs(math.log2(d / head_dim)), d))
    points = sorted((r[1], r[column]) for r in grid if r[2] == nearest)
    if seq <= points[0][0]:
        return points[0][1]
    if seq >= points[-1][0]:
        return points[-1][1]
    for (s0, e0), (s1, e1) in zip(points, points[1:]):
        if s0 <= seq <= s1:
            w = (math.log2(seq) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return e0 + w * (e1 - e0)
    return points[-1][1]


def figure_value(name: str, value):
    """A figure's value from its file form into the dataclass's."""
    if name == "peak_flops":
        bad = [k for k in value if k not in DTYPES]
        if bad:
            raise ValueError(f"peak_flops: {bad[0]!r} is not allowed (allowed: {', '.join(DTYPES)})")
        return {DTYPES[k]: float(v) for k, v in value.items()}
    if name == "gemm_measured":
        try:
            return tuple((str(r["layout"]), int(r["m"]), int(r["n"]), int(r["k"]), str(r["dtype"]), float(r["seconds"]))
                         for r in value)
        except (KeyError, TypeError) as err:
            raise ValueError(f"gemm_measured: {value!r} is not allowed (allowed: a list of "
                             f"{{{', '.join(GEMM_ROW)}}}): {err}") from None
    if name == "attention_grid":
        try:
            return tuple((str(r["backend"]), int(r["seq"]), int(r["head_dim"]), float(r["forward"]),
                          float(r["backward"])) for r in value)
        except (KeyError, TypeError) as err:
            raise ValueError(f"attention_grid: {value!r} is not allowed (allowed: a list of "
                             f"{{{', '.join(ATTENTION_ROW)}}}): {err}") from None
    if name == "matmul_layouts":
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"matmul_layouts: {value!r} is not allowed (allowed: {{layout: efficiency}} or null)")
        return None if value is None else {str(k): float(v) for k, v in value.items()}
    if name.startswith("attention_"):
        if value is None:
            return None
        if not isinstance(value, dict) or set(value) != {"forward", "backward"}:
            raise ValueError(f"{name}: {value!r} is not allowed (allowed: {{\"forward\": x, \"backward\": y}} or null)")
        return (float(value["forward"]), float(value["backward"]))
    if name in ("memory_bytes", "sm_count", "context_bytes", "nccl_bytes_per_group"):
        return int(value)
    if name == "compute_capability":
        return str(value)
    return None if value is None else float(value)


def read_preset_file(path: Path) -> dict:
    """A preset file's contents, checked: its format, and every figure a known one with a
    value and a source. ValueError naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable preset file: {err}") from None
    if not isinstance(data, dict) or data.get("format") != PRESET_FORMAT:
        raise ValueError(f"{path}: format {data.get('format') if isinstance(data, dict) else None!r} is not "
                         f"allowed (allowed: {PRESET_FORMAT})")
    for name, figure in (data.get("figures") or {}).items():
        if name not in FIGURES:
            raise ValueError(f"{path}: figure {name!r} is not allowed (allowed: {', '.join(FIGURES)})")
        if not isinstance(figure, dict) or "value" not in figure or not figure.get("source"):
            raise ValueError(f"{path}: figure {name} must be {{\"value\": ..., \"source\": \"where it comes "
                             f"from\"}}, got {figure!r}")
    host = data.get("host")
    if host is not None and (not isinstance(host, dict) or not isinstance(host.get("value"), dict)
                             or not host.get("source")):
        raise ValueError(f"{path}: host must be {{\"value\": {{host.json's keys: microseconds}}, \"source\": "
                         f"...}}, got {host!r}")
    _check_measured_kernels(path, data.get("measured_kernels"))
    return data


#: The keys every row of ``measured_kernels`` has, by kernel ([Note: measured kernels in a preset]).
MEASURED_KERNEL_KEYS = {"gemm": ("m", "n", "k", "dtype", "layout", "seconds", "efficiency"),
                        "attention": ("backend", "direction", "batch", "heads", "seq", "head_dim", "causal", "dtype",
                                      "seconds", "efficiency")}


def _check_measured_kernels(path, measured) -> None:
    if measured is None:
        return
    value = measured.get("value") if isinstance(measured, dict) else None
    if not isinstance(value, dict) or not measured.get("source"):
        raise ValueError(f"{path}: measured_kernels must be {{\"value\": {{\"gemm\": [rows], \"attention\": "
                         f"[rows]}}, \"source\": ...}}, got {type(measured).__name__}")
    for kernel, rows in value.items():
        if kernel not in MEASURED_KERNEL_KEYS:
            raise ValueError(f"{path}: measured_kernels: {kernel!r} is not allowed "
                             f"(allowed: {', '.join(MEASURED_KERNEL_KEYS)})")
        for row in rows if isinstance(rows, list) else [rows]:
            missing = [k for k in MEASURED_KERNEL_KEYS[kernel] if not isinstance(row, dict) or k not in row]
            if missing:
                raise ValueError(f"{path}: measured_kernels.{kernel}: a row without {missing[0]} (allowed: rows "
                                 f"with {', '.join(MEASURED_KERNEL_KEYS[kernel])})")
            if not row["seconds"] > 0:
                raise ValueError(f"{path}: measured_kernels.{kernel}: seconds {row['seconds']!r} is not allowed "
                                 "(allowed: > 0)")


def _shipped_path(name: str) -> Path | None:
    path = GPU_DIR / f"{name}.json"
    return path if path.is_file() else None


def shipped_names() -> list[str]:
    return sorted(p.stem for p in GPU_DIR.glob("*.json"))


def load_preset_file(path: Path | str, _seen: tuple = ()) -> GpuPreset:
    """The preset a file describes, its ``base`` (a shipped name or a path relative to the
    file) resolved first and the file's figures laid over it."""
    path = Path(path)
    if path.resolve() in _seen:
        raise ValueError(f"{path}: its base chain loops back to itself")
    data = read_preset_file(path)
    base_name = data.get("base")
    kwargs: dict = {}
    sources: dict = {}
    if base_name:
        base_path = _shipped_path(base_name) or (path.parent / base_name)
        if not base_path.is_file():
            raise ValueError(f"{path}: base {base_name!r} is not allowed (allowed: a preset file, or one of "
                             f"{', '.join(shipped_names())})")
        base = load_preset_file(base_path, _seen + (path.resolve(),))
        # A base gives its figures, not its host: that is the measured machine's CPU, not the part's.
        kwargs = {f.name: getattr(base, f.name) for f in dataclasses.fields(GpuPreset)
                  if f.name not in ("name", "description", "sources", "host")}  # measured_kernels passed on
        sources = {k: f"{v} (from {base.name})" if "(from " not in v else v for k, v in base.sources.items()
                   if k != "host"}
    for name, figure in (data.get("figures") or {}).items():
        try:
            kwargs[name] = figure_value(name, figure["value"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None
        sources[name] = figure["source"]
    if data.get("host") is not None:
        kwargs["host"] = dict(data["host"]["value"])
        sources["host"] = data["host"]["source"]
    if data.get("measured_kernels") is not None:
        kwargs["measured_kernels"] = data["measured_kernels"]["value"]
        sources["measured_kernels"] = data["measured_kernels"]["source"]
    missing = [n for n in ("memory_bytes", "peak_flops", "hbm_bytes_per_s") if n not in kwargs]
    if missing:
        raise ValueError(f"{path}: figure {missing[0]} is missing (a preset gives it, or its base does)")
    name = data.get("name") or path.stem
    try:
        return GpuPreset(name=name, description=data.get("description", ""), sources=sources, **kwargs)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _load_shipped() -> dict[str, GpuPreset]:
    return {name: load_preset_file(GPU_DIR / f"{name}.json") for name in shipped_names()}


GPU_PRESETS: dict[str, GpuPreset] = _load_shipped()


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


def gpu_preset(value: str | Path | GpuPreset) -> GpuPreset:
    """A preset itself, a shipped preset by name, or a preset file by path (``--gpu NAME_OR_FILE``).
    ValueError naming the allowed names otherwise."""
    if isinstance(value, GpuPreset):
        return value
    text = str(value)
    if text in GPU_PRESETS:
        return GPU_PRESETS[text]
    path = Path(text)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"gpu preset file {text} does not exist (allowed: a preset file, or one of "
                             f"{', '.join(GPU_PRESETS)})")
        return load_preset_file(path)
    raise ValueError(not_allowed("gpu", text, GPU_PRESETS, show=str,
                                 what="is neither a shipped preset nor a preset file (zerobench calibrate writes "
                                      "one)"))

