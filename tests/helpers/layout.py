"""What a reader sees as a broken plot, found from matplotlib's own text extents: text
that overlaps other text or a legend, and text or a legend cut off by the figure's edge.

Used by tests/test_plot_layout.py on every plot zerobench draws. Standard matplotlib
only: the extents are those of the renderer that saved the figure."""

from __future__ import annotations

from matplotlib.transforms import Bbox

#: Pixels two boxes may share before they count as overlapping (antialiasing, rounding).
SLACK = 1.0


def _box(artist, renderer) -> Bbox | None:
    if not artist.get_visible():
        return None
    if hasattr(artist, "get_text") and not artist.get_text().strip():
        return None
    box = artist.get_window_extent(renderer)
    return box if box.width > 0 and box.height > 0 else None


def _texts(fig, renderer) -> list[tuple[str, Bbox]]:
    """(what, box) of every piece of text a reader reads: titles, axis labels, tick
    labels, annotations, figure texts, and each legend as one box."""
    out = []
    for text in fig.texts:  # the title (suptitle) among them
        out.append((f"figure text {text.get_text()[:40]!r}", _box(text, renderer)))
    for legend in fig.legends:
        out.append(("figure legend", _box(legend, renderer)))
    for i, ax in enumerate(fig.axes):
        if not ax.get_visible():
            continue
        name = f"axes {i}"
        for title in (ax.title, ax._left_title, ax._right_title):
            out.append((f"{name} title {title.get_text()[:30]!r}", _box(title, renderer)))
        out.append((f"{name} x label", _box(ax.xaxis.label, renderer)))
        out.append((f"{name} y label", _box(ax.yaxis.label, renderer)))
        for axis, ticks in (("x", ax.get_xticklabels()), ("y", ax.get_yticklabels())):
            lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
            slack = 1e-9 * (hi - lo)
            for tick in ticks:
                position = tick.get_position()[0 if axis == "x" else 1]
                if lo - slack <= position <= hi + slack:  # inside the view: drawn
                    out.append((f"{name} {axis} tick {tick.get_text()[:30]!r}", _box(tick, renderer)))
        for text in ax.texts:
            out.append((f"{name} text {text.get_text()[:30]!r}", _box(text, renderer)))
        if ax.get_legend() is not None:
            out.append((f"{name} legend", _box(ax.get_legend(), renderer)))
    return [(what, box) for what, box in out if box is not None]


def _overlap(a: Bbox, b: Bbox) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > SLACK) and (min(a.y1, b.y1) - max(a.y0, b.y0) > SLACK)


def layout_problems(fig) -> list[str]:
    """Every overlap of two texts (or a text and a legend), and every text or legend that
    the figure's edge cuts, in words; empty for a clean figure."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    edge = fig.bbox
    items = _texts(fig, renderer)
    problems = [f"{what} cut by the figure's edge" for what, box in items
                if box.x0 < edge.x0 - SLACK or box.y0 < edge.y0 - SLACK
                or box.x1 > edge.x1 + SLACK or box.y1 > edge.y1 + SLACK]
    for i, (what_a, a) in enumerate(items):
        for what_b, b in items[i + 1:]:
            if _overlap(a, b):
                problems.append(f"{what_a} overlaps {what_b}")
    return problems
