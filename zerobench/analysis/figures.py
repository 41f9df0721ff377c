"""What every zerobench plot shares: the non-interactive backend, how a figure reaches
the disk, the title line that says what was measured where, one colour per engine,
and numbers read from a table whatever pandas made of its empty cells.

Plots are drawn in worker processes and on CI machines without a display, so the Agg
backend is chosen here, before pyplot is imported anywhere. ``save_figure`` writes the
file atomically, like every other file of a run folder: a run killed while plotting
leaves the previous figure or none, never half of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from zerobench.runs.files import write_atomic  # noqa: E402

if TYPE_CHECKING:  # pandas is imported where a figure needs it
    import pandas as pd

__all__ = ["plt", "save_figure", "Setting", "figure_title", "EngineStyles", "numeric", "flag", "short_label",
           "REFERENCE_ENGINE"]

#: Every plot reads the others beside plain data parallelism (as the summary table does).
REFERENCE_ENGINE = "ddp"


def save_figure(fig, path: str | Path, dpi: int = 110, tight: bool = True) -> Path:
    """Lay ``fig`` out (unless ``tight`` is False: the caller did), pull its axes in where
    a legend or a label would cross the figure's edge (:func:`fit_inside`), write it to
    ``path`` (format from the suffix, png by default) and close it."""
    path = Path(path)
    if tight:
        fig.tight_layout()
    fit_inside(fig)
    fmt = path.suffix.lstrip(".") or "png"
    write_atomic(path, lambda f: fig.savefig(f, format=fmt, dpi=dpi), mode="wb")
    plt.close(fig)
    return path


def fit_inside(fig, pad_px: float = 4.0) -> None:
    """Shrink the subplots' area by as much as any legend, label or text of an axes
    reaches past the figure's edge, on each side: tight_layout leaves a legend placed
    beside its axes (``bbox_to_anchor=(1.01, 1)``) out of its sums, and the figure would
    cut it (tests/test_plot_layout.py checks every plot for that)."""
    if not fig.axes:
        return
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    edge = fig.bbox
    reach = [ax.get_tightbbox(renderer) for ax in fig.axes if ax.get_visible() and ax.get_subplotspec() is not None]
    reach = [b for b in reach if b is not None]
    if not reach:
        return
    width, height = edge.width, edge.height
    over_left = max(0.0, edge.x0 + pad_px - min(b.x0 for b in reach)) / width
    over_right = max(0.0, max(b.x1 for b in reach) - edge.x1 + pad_px) / width
    over_bottom = max(0.0, edge.y0 + pad_px - min(b.y0 for b in reach)) / height
    over_top = max(0.0, max(b.y1 for b in reach) - edge.y1 + pad_px) / height
    if not any((over_left, over_right, over_bottom, over_top)):
        return
    params = fig.subplotpars
    left, right = params.left + over_left, params.right - over_right
    bottom, top = params.bottom + over_bottom, params.top - over_top
    if right - left > 0.2 and top - bottom > 0.2:  # room left for the data: else leave it as drawn
        fig.subplots_adjust(left=left, right=right, bottom=bottom, top=top)


# [Note: plot titles]
# A plot is often read away from its folder (pasted in an issue, a slide), so its title
# names what it shows and where: the workload, the device (the CPU and gloo, the GPU, or
# the virtual GPU's preset), the link (an emulated one, the predicted one, or none) and the
# world sizes. Every figure of zerobench builds that line with :func:`figure_title`.


@dataclass(frozen=True)
class Setting:
    """Where a figure's numbers come from, for its title ([Note: plot titles])."""

    workload: str
    device: str
    """"CPU (AMD EPYC, gloo)", "NVIDIA H100 80GB HBM3 (nccl)", "virtual h100-sxm, fast host", ..."""
    link: str
    """"no emulated link", "emulated 0.05 GB/s + 100 µs", "nvlink4-8gpu", ..."""
    world_sizes: tuple[int, ...]

    def line(self) -> str:
        sizes = ", ".join(map(str, self.world_sizes))
        ws = f"world size{'s' if len(self.world_sizes) > 1 else ''} {sizes}" if sizes else "no world size"
        return f"{self.workload} · {self.device} · {self.link} · {ws}"


def figure_title(fig, what: str, setting: Setting | None) -> float:
    """Title a figure: what it shows, then the setting line under it. Returns the
    fraction of the figure's height left below the title (the top of tight_layout's rect)."""
    import textwrap

    lines = [what] if setting is None else [what, setting.line()]
    width = int(fig.get_figwidth() * 12.5)  # characters of 11 pt text that fit the figure
    text = "\n".join(textwrap.fill(line, width) for line in lines)
    fig.suptitle(text, fontsize=11, x=0.01, y=0.995, ha="left", va="top")
    return 1 - (0.25 + 0.2 * text.count("\n") + 0.1) / fig.get_figheight()


def numeric(values) -> "pd.Series":
    """A column as float64, empty cells NaN: pandas' nullable Int64/boolean (whose NA has no
    truth value) and object columns alike, so plots never branch on NA."""
    import pandas as pd

    return pd.to_numeric(pd.Series(values), errors="coerce").astype("float64")


def flag(value) -> bool:
    """Whether a table cell holds True. Boolean columns are read as booleans
    (zerobench/runs/folder.py, booleans_as_read), so anything else -- empty (NaN, NA,
    None), a number, text -- is False."""
    import numpy as np

    return value is True or (isinstance(value, np.bool_) and bool(value))  # Python's or numpy's True


def short_label(cell_id: str) -> str:
    """A cell id (or a configuration id: a cell id without the world size) as a plot
    label: :attr:`CellId.short` (``impl-fsdp SHARD_GRAD_OP, bwd post``); a bare engine
    name as it is."""
    from zerobench.spec.cell import CellId

    return (CellId.try_parse(cell_id) or CellId(str(cell_id), "")).short


# [Note: one look per configuration]
# Every plot draws a configuration the same way, so that a shape means one thing in every
# figure: its colour names the engine (DDP black), its marker -- and in a line plot its line
# style -- what the engine shards (SHARDINGS: FULL_SHARD of torch-fsdp1 and impl-fsdp and
# fully_shard's reshard_after_forward=True are one strategy, one marker), and a hollow or
# half-filled marker its activation checkpointing (FILLS). Each figure's legend lists the
# colours, markers and fills it drew (EngineStyles.legend_handles): none goes unexplained.

#: What a configuration shards: (key, marker, line style, what the legend says), in legend order.
SHARDINGS = (
    ("replicated", "o", "-.", "nothing sharded (DDP, NO_SHARD)"),
    ("zero1", "v", (0, (3, 1, 1, 1, 1, 1)), "optimizer state sharded (ZeRO-1)"),
    ("zero2", "^", (0, (1, 1)), "optimizer state and gradients sharded (ZeRO-2)"),
    ("grad_op", "s", "--", "all sharded, parameters kept from forward to backward (SHARD_GRAD_OP, "
                           "reshard_after_forward off)"),
    ("full", "D", "-", "all sharded, parameters resharded after forward (FULL_SHARD, reshard_after_forward on, "
                       "ZeRO-3)"),
    ("hybrid", "h", ":", "sharded within a node, replicated across nodes (HYBRID_SHARD)"),
)
#: Activation checkpointing (zerobench/spec/checkpointing.py): its mode -> (fillstyle, legend).
FILLS = {"none": ("full", "no activation checkpointing (filled)"), "full": ("none", "checkpointing every block (hollow)"),
         "every": ("left", "checkpointing every K-th block (half filled)"),
         "ops": ("bottom", "selective checkpointing of ops (lower half filled)")}


#: ZeRO stage of the engines that have no sharding axis; an FSDP is stage 3 unless its
#: sharding_strategy says otherwise. The same as engine_stage in zerobench/engines/stages.py
#: (tests/test_plots.py holds them together), written here because plots run without torch.
ENGINE_STAGES = {"ddp": 0, "torch-zero1": 1, "impl-zero1": 1, "impl-zero2": 2, "deepspeed-zero1": 1,
                 "deepspeed-zero2": 2, "deepspeed-zero3": 3}


def sharding_of(engine: str, options: dict) -> str:
    """The SHARDINGS key of a configuration: its ZeRO stage, and for a fully sharded one
    whether parameters stay unsharded from forward to backward."""
    strategy = options.get("sharding_strategy")
    strategy = strategy if isinstance(strategy, str) and strategy else None
    reshard = options.get("reshard_after_forward")
    stage = ENGINE_STAGES.get(engine, 0 if strategy == "NO_SHARD" else 3)
    if stage < 3:
        return ("replicated", "zero1", "zero2")[stage]
    if strategy and "HYBRID" in strategy:
        return "hybrid"
    if strategy == "SHARD_GRAD_OP" or (_present(reshard) and not flag(reshard)):
        return "grad_op"
    return "full"


def checkpointing_of(options: dict) -> str:
    """The FILLS key of a configuration's activation checkpointing ("none" when absent)."""
    mode = options.get("activation_checkpointing")
    mode = mode if isinstance(mode, str) and mode else "none"
    return "every" if mode.startswith("every") else (mode if mode in FILLS else "none")


def _present(value) -> bool:
    import pandas as pd

    try:
        return value is not None and not pd.isna(value)
    except (TypeError, ValueError):
        return True


class EngineStyles:
    """The look of each configuration in every plot ([Note: one look per configuration]):
    one colour per engine, the same in every plot of zerobench (the reference engine
    black), one marker and line style per sharding, one fill per activation checkpointing.
    It remembers what it handed out, for the figure's legend."""

    ENGINE_ORDER = ("ddp", "torch-zero1", "impl-zero1", "impl-zero2", "torch-fsdp1", "torch-fsdp2", "impl-fsdp",
                    "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")

    def __init__(self):
        palette = plt.get_cmap("tab10").colors
        others = [c for i, c in enumerate(palette) if i != 7]  # tab10's grey reads as "disabled"
        self._colors = {REFERENCE_ENGINE: "black"}
        for i, engine in enumerate(e for e in self.ENGINE_ORDER if e != REFERENCE_ENGINE):
            self._colors[engine] = others[i % len(others)]
        self.used: dict[str, set] = {"engines": set(), "shardings": set(), "fills": set()}

    def color(self, engine: str):
        if engine not in self._colors:
            extra = plt.get_cmap("tab20b").colors
            self._colors[engine] = extra[(len(self._colors) * 3) % len(extra)]
        self.used["engines"].add(engine)
        return self._colors[engine]

    def point(self, engine: str, options: dict | None = None) -> dict:
        """matplotlib keywords of ``Axes.plot`` for one configuration's point."""
        options = options or {}
        sharding, fill = sharding_of(engine, options), checkpointing_of(options)
        self.used["shardings"].add(sharding)
        self.used["fills"].add(fill)
        color = self.color(engine)
        return {"color": color, "marker": _MARKER[sharding], "fillstyle": FILLS[fill][0], "markeredgecolor": color,
                "linestyle": "none"}

    def line(self, engine: str, options: dict | None = None) -> dict:
        """matplotlib keywords of ``Axes.plot`` for one configuration's line (with markers)."""
        style = self.point(engine, options)
        return {**style, "linestyle": _LINESTYLE[sharding_of(engine, options or {})]}

    def legend_handles(self, markers: bool = True, lines: bool = False) -> tuple[list, list]:
        """(handles, labels) for what this object handed out: a swatch per engine, a grey
        marker (and line style) per sharding, a fill per checkpointing mode when any is
        not "none". Engines first, in ENGINE_ORDER."""
        from matplotlib.lines import Line2D

        order = {e: i for i, e in enumerate(self.ENGINE_ORDER)}
        handles, labels = [], []
        for engine in sorted(self.used["engines"], key=lambda e: (order.get(e, len(order)), e)):
            handles.append(Line2D([], [], color=self._colors[engine], marker="s", linestyle="-" if lines else "none",
                                  markersize=8))
            labels.append(engine)
        if markers or lines:
            for key, marker, linestyle, text in SHARDINGS:
                if key in self.used["shardings"]:
                    handles.append(Line2D([], [], color="0.35", marker=marker if markers else None,
                                          linestyle=linestyle if lines else "none", markersize=7))
                    labels.append(text)
        if markers and self.used["fills"] - {"none"}:
            for key, (fillstyle, text) in FILLS.items():
                if key in self.used["fills"]:
                    handles.append(Line2D([], [], color="0.35", marker="o", fillstyle=fillstyle, linestyle="none",
                                          markersize=7))
                    labels.append(text)
        return handles, labels


_MARKER = {key: marker for key, marker, _, _ in SHARDINGS}
_LINESTYLE = {key: linestyle for key, _, linestyle, _ in SHARDINGS}
