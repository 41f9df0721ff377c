"""What every zerobench plot shares: the non-interactive backend, and how a figure
reaches the disk.

Plots are drawn in worker processes and on CI machines without a display, so the Agg
backend is chosen here, before pyplot is imported anywhere. ``save_figure`` writes the
file atomically, like every other file of a run folder: a run killed while plotting
leaves the previous figure or none, never half of one.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from zerobench.runs.files import write_atomic  # noqa: E402

__all__ = ["plt", "save_figure"]


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
