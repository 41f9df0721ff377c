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

from zerobench.analysis.figures import (
    REFERENCE_ENGINE,
    EngineStyles,
    Setting,
    figure_title,
    fit_inside,
    numeric,
    plt,
    save_figure,
)
from zerobench.engines.options import axes_with_role


def pareto_front(frame: pd.DataFrame, x: str, y: str, x_spread: tuple[str, str] | None = None) -> pd.Series:
    """Boolean Series (frame's index): which rows are on the lower-left Pareto front of
    columns ``x`` and ``y``. Rows with a missing value are never on it; of rows with
    equal values, each is on it.

    ``x_spread``: the columns of each row's measured low and high ``x`` (a step time's
    p10 and p90). Two rows whose ranges overlap are then equal in ``x``: a row beats
    another in ``x`` only by a difference outside both spreads ([Note: a front outside
    the noise])."""
    xs, ys = numeric(frame[x]).to_numpy(), numeric(frame[y]).to_numpy()
    if x_spread is None:
        lo, hi = xs, xs
    else:
        lo = numeric(frame[x_spread[0]]).fillna(pd.Series(xs, index=frame.index)).to_numpy()
        hi = numeric(frame[x_spread[1]]).fillna(pd.Series(xs, index=frame.index)).to_numpy()

    def beats(j: int, i: int) -> bool:  # j at least as good as i on both axes, better on one
        x_tie = not (hi[j] < lo[i] or hi[i] < lo[j])
        x_better, x_worse = hi[j] < lo[i], hi[i] < lo[j]
        if x_spread is None:
            x_tie, x_better, x_worse = xs[j] == xs[i], xs[j] < xs[i], xs[j] > xs[i]
        return not x_worse and ys[j] <= ys[i] and (x_better or (ys[j] < ys[i] and (x_tie or x_better)))

    known = [i for i in range(len(frame)) if xs[i] == xs[i] and ys[i] == ys[i]]  # not NaN
    on = [i in known and not any(beats(j, i) for j in known if j != i) for i in range(len(frame))]
    return pd.Series(on, index=frame.index, dtype=bool)


# [Note: a front outside the noise]
# A measured step time is a spread, not a number: on a shared CPU two cells 6 % apart can
# each have a p10-p90 of +-20 %. A front drawn from medians alone then names one of them
# "the choice" by chance. With the spread given, a cell beats another on time only when
# its p90 is below the other's p10; within that, the two tie on time and memory (exact)
# decides. The plot draws each spread as a bar through its point, so a reader sees why
# two close cells are both on the front. Predictions have no spread: their front is exact.


#: Option columns a point's look is read from ([Note: one look per configuration]): the
#: engines' sharding knobs (zerobench/engines/options.py) and activation checkpointing.
STYLE_OPTIONS = (*axes_with_role("sharding"), "activation_checkpointing")


def plot_pareto(points: pd.DataFrame, path: Path, *, x: str, y: str, x_label: str, y_label: str,
                setting: Setting | None, what: str = "peak memory against step time, one point per configuration",
                group: str = "group", x_spread: tuple[str, str] | None = None) -> Path | None:
    """One panel per value of ``group``: a point per row of ``points`` (columns ``label``,
    ``engine``, ``x``, ``y``, ``group`` and any of STYLE_OPTIONS), its colour the engine, its
    marker the sharding and its fill the activation checkpointing ([Note: one look per
    configuration]); the reference engine's point a black star with dashed cross-hairs; the
    front ringed and joined by a line, each of its points labelled beside it with a leader
    line to it (:func:`place_labels`). With ``x_spread`` (the columns of each point's low
    and high ``x``), each point's spread is a bar through it and the front counts only
    differences outside it ([Note: a front outside the noise]). Returns None when no row
    has both values."""
    points = points.assign(_x=numeric(points[x]).to_numpy(), _y=numeric(points[y]).to_numpy())
    points = points.dropna(subset=["_x", "_y"])
    if points.empty:
        return None
    groups = list(dict.fromkeys(points[group]))
    styles = EngineStyles()
    fig, axes = plt.subplots(1, len(groups), figsize=(max(7.5 * len(groups), 9.5), 6.8), squeeze=False)
    labels, drew_reference = [], False
    for ax, name in zip(axes[0], groups):
        frame = points[points[group] == name]
        front = pareto_front(frame, "_x", "_y", x_spread)
        for (_, row), on in zip(frame.iterrows(), front):
            ref = row["engine"] == REFERENCE_ENGINE and bool(row.get("reference", True))
            options = {k: row.get(k) for k in STYLE_OPTIONS if k in row}
            style = {"color": "black", "marker": "*", "linestyle": "none"} if ref else styles.point(row["engine"], options)
            drew_reference |= ref
            ax.plot([row["_x"]], [row["_y"]], markersize=15 if ref else 8, zorder=4, gid=row["label"], **style)
            if x_spread is not None:
                low, high = (numeric(pd.Series([row[c]])).iloc[0] for c in x_spread)
                if low == low and high == high:  # not NaN: the measured spread, p10 to p90
                    ax.hlines(row["_y"], low, high, color=style["color"], lw=1.2, alpha=0.6, zorder=3)
            if on:  # the front: ringed
                ax.plot([row["_x"]], [row["_y"]], marker="o", markersize=19 if ref else 15, fillstyle="none",
                        color="black", linestyle="none", lw=1, zorder=3)
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
        ax.margins(0.2)
    from matplotlib.lines import Line2D

    handles, names = styles.legend_handles()
    if drew_reference:
        handles.append(Line2D([], [], color="black", marker="*", linestyle="none", markersize=11))
        names.append(f"{REFERENCE_ENGINE}'s default configuration (the reference)")
    handles.append(Line2D([], [], color="black", alpha=0.5, lw=1, marker="o", fillstyle="none", markersize=11))
    names.append("Pareto front (ringed, joined)" + ("; closer than the spread counts as a tie" if x_spread else ""))
    if x_spread is not None:
        handles.append(Line2D([], [], color="0.3", lw=1.2, alpha=0.6))
        names.append("step time p10-p90 (the measured spread)")
    ncol = 3
    legend_rows = -(-len(handles) // ncol)
    fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=7.5, frameon=False)
    top = figure_title(fig, what + "; lower left is better, DDP the reference", setting)
    fig.tight_layout(rect=(0, (0.22 * legend_rows + 0.2) / fig.get_figheight(), 1, top))
    fit_inside(fig)  # the panels where they will stay, before labels are placed against them
    place_labels(fig, labels)
    return save_figure(fig, path, tight=False)


#: Where a label may sit, in points from its point (dx, dy), tried in turn: near first, then
#: farther; a leader line joins the label to its point.
_OFFSETS = tuple((round(r * dx), round(r * dy)) for r in (22, 40, 62, 90)
                 for dx, dy in ((1, 0.6), (1, -0.6), (-1, 0.6), (-1, -0.6), (0.3, 1), (0.3, -1), (1, 0), (-1, 0),
                                (0.6, 1.4), (0.6, -1.4)))


def place_labels(fig, labels) -> None:
    """Annotate each (ax, text, x, y) with a leader line to its point, the text at the first
    offset of :data:`_OFFSETS` where it overlaps no label placed before, no point drawn on
    the axes and none of their tick or axis labels, and stays inside them (the least
    crowded place otherwise, never past the figure's edge when anywhere else will do): a
    label never sits on another configuration's point, and its line says whose it is. A
    label that has no place where it overlaps no other text is left out, and the panel's
    title counts what was left out (a crowded front: its points are still ringed)."""
    renderer = fig.canvas.get_renderer()
    placed = []
    markers = {}
    for ax in {id(a): a for a, *_ in labels}.values():
        boxes = []
        for artist in ax.lines:
            if artist.get_marker() in (None, "None", "", " "):
                continue
            half = artist.get_markersize() * fig.dpi / 72 / 2
            for px, py in ax.transData.transform(artist.get_xydata()):
                boxes.append((px - half, py - half, px + half, py + half))
        markers[id(ax)] = boxes
    edge = fig.bbox
    axis_texts = [t.get_window_extent(renderer) for ax in fig.axes  # every panel's: a label may cross into the next
                  for t in (ax.xaxis.label, ax.yaxis.label, ax.title, *ax.get_xticklabels(), *ax.get_yticklabels())
                  if t.get_visible() and t.get_text()]
    left_out: dict[int, tuple] = {}
    for ax, text, x, y in sorted(labels, key=lambda item: (id(item[0]), item[2])):
        frame = ax.get_window_extent(renderer)
        best, best_cost = None, None
        for dx, dy in _OFFSETS:
            note = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=7,
                               ha="left" if dx >= 0 else "right", va="center", zorder=6,
                               arrowprops=dict(arrowstyle="-", color="0.35", lw=0.6, shrinkA=1, shrinkB=5),
                               bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.8))
            box = note.get_window_extent(renderer)
            cost = (3 * sum(box.overlaps(other) for other in placed)  # a label on a label: unreadable
                    + 2 * sum(_overlaps(box, m) for m in markers[id(ax)])  # on a point: whose is it?
                    + (0 if frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1) else 2)
                    + 3 * sum(box.overlaps(t) for t in axis_texts)  # on a tick or an axis label
                    + (0 if edge.contains(box.x0, box.y0) and edge.contains(box.x1, box.y1) else 10))  # cut off
            if best is None or cost < best_cost:
                if best is not None:
                    best.remove()
                best, best_cost = note, cost
            else:
                note.remove()
            if cost == 0:
                break
        box = best.get_window_extent(renderer)
        unreadable = any(box.overlaps(other) for other in placed) or any(box.overlaps(t) for t in axis_texts) \
            or not (edge.contains(box.x0, box.y0) and edge.contains(box.x1, box.y1))
        if unreadable and not text.endswith("(reference)"):  # no room anywhere: left out, and counted
            best.remove()
            left_out[id(ax)] = (ax, left_out.get(id(ax), (ax, 0))[1] + 1)
            continue
        placed.append(box)
    for ax, count in left_out.values():  # said where the panel says what it shows
        ax.set_title(f"{ax.get_title()} ({count} of the front's labels left out: no room)", fontsize=10)


def _overlaps(box, marker) -> bool:
    x0, y0, x1, y1 = marker
    return box.x0 < x1 and x0 < box.x1 and box.y0 < y1 and y0 < box.y1
