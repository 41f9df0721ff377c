"""Interval arithmetic on half-open time intervals ``[start, end)``.

Pure functions on ``(n, 2)`` float arrays (anything ``np.asarray`` turns into one, e.g.
a list of pairs). Functions named ``*_merged`` expect their inputs already merged
(sorted, disjoint, non-adjacent), as :func:`merge` returns; the others merge first.
This is the arithmetic behind Holistic Trace Analysis' overlap: each side is merged
into disjoint intervals before they are intersected, so nested or concurrent events
are never counted twice.
"""

from __future__ import annotations

import numpy as np

EMPTY = np.zeros((0, 2))


def as_intervals(intervals) -> np.ndarray:
    """``(n, 2)`` float array; drops intervals with ``end <= start``."""
    a = np.asarray(intervals, dtype=float).reshape(-1, 2)
    return a[a[:, 1] > a[:, 0]]


def merge(intervals) -> np.ndarray:
    """Union of the intervals as sorted, disjoint intervals (touching ones are joined)."""
    a = as_intervals(intervals)
    if len(a) == 0:
        return EMPTY.copy()
    a = a[np.argsort(a[:, 0], kind="stable")]
    # An interval starts a new group when it begins after every earlier one has ended.
    running_end = np.maximum.accumulate(a[:, 1])
    new_group = np.empty(len(a), dtype=bool)
    new_group[0] = True
    new_group[1:] = a[1:, 0] > running_end[:-1]
    starts = a[new_group, 0]
    group_ids = np.cumsum(new_group) - 1
    ends = np.zeros(len(starts))
    np.maximum.at(ends, group_ids, a[:, 1])
    return np.column_stack([starts, ends])


def total(intervals) -> float:
    """Length of the union of the intervals."""
    m = merge(intervals)
    return float((m[:, 1] - m[:, 0]).sum())


def intersect(a, b) -> np.ndarray:
    """Intersection of two sets of intervals, merged."""
    return _intersect_merged(merge(a), merge(b))


def _intersect_merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        if lo < hi:
            out.append((lo, hi))
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return np.array(out, dtype=float).reshape(-1, 2)


def subtract(a, b) -> np.ndarray:
    """Parts of ``a`` not covered by ``b``, merged."""
    a, b = merge(a), merge(b)
    out, j = [], 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j, 1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k, 0] < end:
            if b[k, 0] > cur:
                out.append((cur, b[k, 0]))
            cur = max(cur, b[k, 1])
            if cur >= end:
                break
            k += 1
        if cur < end:
            out.append((cur, end))
    return np.array(out, dtype=float).reshape(-1, 2)


def clip(intervals, lo: float, hi: float) -> np.ndarray:
    """The merged intervals restricted to ``[lo, hi)``."""
    return intersect(intervals, [(lo, hi)])


def concurrency(intervals) -> tuple[np.ndarray, np.ndarray]:
    """How many of the (unmerged) intervals are open over time, as a step function.

    Returns ``(times, counts)``: from ``times[k]`` until ``times[k+1]`` exactly
    ``counts[k]`` intervals are open. An interval ending at the instant another starts
    is not counted as overlapping it."""
    a = as_intervals(intervals)
    if len(a) == 0:
        return np.zeros(0), np.zeros(0, dtype=int)
    return counting(a[:, 0], a[:, 1])


def counting(starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """Step function of ``#starts <= t`` minus ``#ends <= t`` (ends first at ties).

    Unlike :func:`concurrency` the starts and ends need not be paired: this counts
    operations issued and not yet finished when only the events are known."""
    starts, ends = np.asarray(starts, float), np.asarray(ends, float)
    times = np.concatenate([starts, ends])
    deltas = np.concatenate([np.ones(len(starts), int), -np.ones(len(ends), int)])
    order = np.lexsort((deltas, times))  # at equal times, -1 before +1
    times, counts = times[order], np.cumsum(deltas[order])
    # Keep the last value at each distinct time.
    last = np.append(times[1:] != times[:-1], True)
    return times[last], counts[last]
