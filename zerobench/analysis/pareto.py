"""The first plot a user wants: peak memory against time per configuration, DDP as the
reference, and the Pareto front marked (``pareto.png`` of a run and of a prediction).

A configuration is on the front when no other is at least as good on both axes and
better on one (both axes: lower is better). The front is what there is to choose
from: every other configuration costs more memory for the same time, or more time for
the same memory. :func:`pareto_front` is a plain function of a DataFrame, usable from a
notebook; :func:`plot_pareto` draws one panel per group (world size and dtype).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from zerobench.analysis.figures import REFERENCE_ENGINE, EngineStyles, Setting, figure_title, numeric, plt, save_figure


def pareto_front(frame: pd.DataFrame, x: str, y: str) -> pd.Series:
    """Boolean Series (frame's index): which rows are on the lower-left Pareto front of
    columns ``x`` and ``y``. Rows with a missing value are never on it; of rows with
    equal values, each is on it."""
    xs, ys = numeric(frame[x]).to_numpy(), numeric(frame[y]).to_numpy()
    on = []
    for i in range(len(frame)):
        if xs[i] != xs[i] or ys[i] != ys[i]:  # NaN
            on.append(False)
            continue
        dominated = any(xs[j] <= xs[i] and ys[j] <= ys[i] and (xs[j] < xs[i] or ys[j] < ys[i])
                        for j in range(len(frame)) if xs[j] == xs[j] and ys[j] == ys[j])
        on.append(not dominated)
    return pd.Series(on, index=frame.index, dtype=bool)


def plot_pareto(points: pd.DataFrame, path: Path, *, x: str, y: str, x_label: str, y_label: str,
                setting: Setting | None, what: str = "peak memory against step time, one point per configuration",
                group: str = "group") -> Path | None:
    """One panel per value of ``group``: a point per row of ``points`` (columns ``label``,
    ``engine``, ``x``, ``y``, ``group``), coloured by engine, the reference engine's
    point as a black star with dashed cross-hairs, the front joined by a line and its
    points labelled. Returns None when no row has both values."""
    points = points.assign(_x=numeric(points[x]).to_numpy(), _y=numeric(points[y]).to_numpy())
    points = points.dropna(subset=["_x", "_y"])
    if points.empty:
        return None
    groups = list(dict.fromkeys(points[group]))
    styles = EngineStyles()
    fig, axes = plt.subplots(1, len(groups), figsize=(max(7.5 * len(groups), 9.5), 6.2), squeeze=False)
    handles, labels = {}, []
    for ax, name in zip(axes[0], groups):
        frame = points[points[group] == name]
        front = pareto_front(frame, "_x", "_y")
        for (_, row), on in sorted(zip(frame.iterrows(), front), key=lambda item: item[0][1]["_x"]):
            ref = row["engine"] == REFERENCE_ENGINE and bool(row.get("reference", True))
            style = {"color": "black", "marker": "*"} if ref else styles.point(row["engine"], row["label"])
            h = ax.scatter(row["_x"], row["_y"], s=(190 if ref else 60), zorder=4, edgecolors="black" if on else "none",
                           linewidths=1.2, **style)
            handles.setdefault(row["engine"], h)
            if ref:
                ax.axvline(row["_x"], ls="--", lw=0.8, color="black", alpha=0.6)
                ax.axhline(row["_y"], ls="--", lw=0.8, color="black", alpha=0.6)
            if on or ref:
                labels.append((ax, row["label"] + (" (reference)" if ref else ""), row["_x"], row["_y"]))
        line = frame[front.to_numpy()].sort_values("_x")
        ax.step(line["_x"], line["_y"], where="post", color="black", lw=1, alpha=0.5, zorder=2)
        ax.set_title(str(name), fontsize=10)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
        ax.margins(0.15)
    order = {e: i for i, e in enumerate(EngineStyles.ENGINE_ORDER)}
    names = sorted(handles, key=lambda e: order.get(e, len(order)))
    legend = [handles[e] for e in names] + [plt.Line2D([], [], color="black", alpha=0.5, lw=1)]
    fig.legend(legend, names + ["Pareto front (points outlined)"], loc="lower center", ncol=min(len(legend), 8),
               fontsize=8, frameon=False)
    top = figure_title(fig, what + "; lower left is better, DDP the reference", setting)
    fig.tight_layout(rect=(0, 0.4 / fig.get_figheight(), 1, top))
    place_labels(fig, labels)
    return save_figure(fig, path, tight=False)


#: Offsets (points) tried in turn for a label, until one overlaps no label placed before.
_OFFSETS = ((7, 6), (7, -13), (7, 18), (7, -25), (-7, 6), (-7, -13), (7, 30), (7, -37))


def place_labels(fig, labels) -> None:
    """Annotate each (ax, text, x, y) beside its point, at the first offset of
    :data:`_OFFSETS` whose box overlaps no label placed before (the last one tried
    otherwise): neighbours on a front stay readable."""
    renderer = fig.canvas.get_renderer()
    placed = []
    for ax, text, x, y in sorted(labels, key=lambda item: (id(item[0]), item[2])):
        for dx, dy in _OFFSETS:
            note = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=7,
                               ha="left" if dx > 0 else "right")
            box = note.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
            note.remove()
        else:
            note = ax.annotate(text, (x, y), xytext=_OFFSETS[0], textcoords="offset points", fontsize=7)
            box = note.get_window_extent(renderer)
        placed.append(box)
