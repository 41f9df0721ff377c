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
    """Lay ``fig`` out (unless ``tight`` is False: the caller did), write it to ``path``
    (format from the suffix, png by default) and close it."""
    path = Path(path)
    if tight:
        fig.tight_layout()
    fmt = path.suffix.lstrip(".") or "png"
    write_atomic(path, lambda f: fig.savefig(f, format=fmt, dpi=dpi), mode="wb")
    plt.close(fig)
    return path


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
    """Whether a table cell holds a true boolean: True, "True", "true", 1; empty (NaN, NA,
    None) and anything else are False."""
    if value is None or value is False:
        return False
    try:
        import pandas as pd

        if pd.isna(value):
            return False
    except (TypeError, ValueError):
        return False
    return str(value).strip().lower() in ("true", "1", "1.0", "on")


#: How a cell id's options read in a plot's labels (the id spells them in full).
_SHORT_OPTIONS = (("sharding_strategy=", ""), ("backward_prefetch=", "bwd "), ("forward_prefetch=", "fwd "),
                  ("limit_all_gathers=", "limiter "), ("limiter_depth=", "depth "), ("reshard_after_forward=", "reshard "),
                  ("activation_checkpointing=", "ckpt "),
                  ("emulate_link=", "link "), ("parameters_as_bucket_view=", "bucket view "),
                  ("gradient_as_bucket_view=", "grad view "), ("cpu_offload=", "offload "))


def short_label(cell_id: str) -> str:
    """A cell id (or a configuration id: a cell id without the world size) as a plot
    label: without its world size and dtype (the panel says them), its options shortened
    (``impl-fsdp SHARD_GRAD_OP, bwd post``)."""
    import re

    rest = re.sub(r"-(fp32|bf16|fp16)(?=-|$)", "", re.sub(r"-ws\d+(?=-)", "", str(cell_id), count=1), count=1)
    engine, *options = re.split(r"-(?=[a-z_]+=)", rest)
    for long, short in _SHORT_OPTIONS:
        options = [o.replace(long, short) if o.startswith(long) else o for o in options]
    options = [re.sub(r"^emulate_gbps=(.*)$", r"\1 GB/s", re.sub(r"^emulate_latency_us=(.*)$", r"\1 µs", o))
               for o in options]
    return engine + (" " + ", ".join(options) if options else "")


_LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (1, 3)))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


class EngineStyles:
    """One colour per engine, the same in every plot of zerobench, and within an engine
    a line style and marker per configuration, so twenty configurations need seven
    colours, not twenty. The reference engine is black."""

    ENGINE_ORDER = ("ddp", "torch-zero1", "impl-zero1", "impl-zero2", "torch-fsdp1", "torch-fsdp2", "impl-fsdp")

    def __init__(self):
        palette = plt.get_cmap("tab10").colors
        others = [c for i, c in enumerate(palette) if i != 7]  # tab10's grey reads as "disabled"
        self._colors = {REFERENCE_ENGINE: "black"}
        for i, engine in enumerate(e for e in self.ENGINE_ORDER if e != REFERENCE_ENGINE):
            self._colors[engine] = others[i % len(others)]
        self._variants: dict[str, list[str]] = {}

    def color(self, engine: str):
        if engine not in self._colors:
            palette = plt.get_cmap("tab10").colors
            self._colors[engine] = palette[(len(self._colors) + 1) % len(palette)]
        return self._colors[engine]

    def _index(self, engine: str, key: str) -> int:
        seen = self._variants.setdefault(engine, [])
        if key not in seen:
            seen.append(key)
        return seen.index(key)

    def line(self, engine: str, key: str) -> dict:
        """matplotlib keywords for configuration ``key`` of ``engine`` (a line)."""
        i = self._index(engine, key)
        return {"color": self.color(engine), "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
                "marker": _MARKERS[i % len(_MARKERS)]}

    def point(self, engine: str, key: str) -> dict:
        """matplotlib keywords for configuration ``key`` of ``engine`` (a scatter point)."""
        i = self._index(engine, key)
        return {"color": self.color(engine), "marker": _MARKERS[i % len(_MARKERS)]}
