"""Interval arithmetic behind the overlap analysis, on intervals with known answers."""

import numpy as np
import pytest

from zerobench.analysis.profiling import intervals as iv


def test_merge_joins_overlapping_nested_and_touching():
    got = iv.merge([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6.5), (10, 10)])
    np.testing.assert_array_equal(got, [[0, 4], [5, 7]])  # empty (10, 10) dropped


def test_merge_of_nothing():
    assert iv.merge([]).shape == (0, 2)
    assert iv.total([]) == 0.0


def test_total_counts_overlaps_once():
    assert iv.total([(0, 10), (2, 3), (5, 12), (20, 21)]) == 13.0


def test_intersect():
    a = [(0, 4), (6, 10)]
    b = [(2, 7), (9, 12), (3, 5)]
    np.testing.assert_array_equal(iv.intersect(a, b), [[2, 4], [6, 7], [9, 10]])
    assert iv.intersect(a, []).shape == (0, 2)


def test_subtract():
    a = [(0, 10), (20, 30)]
    b = [(2, 3), (5, 6), (9, 22), (25, 26)]
    np.testing.assert_array_equal(iv.subtract(a, b), [[0, 2], [3, 5], [6, 9], [22, 25], [26, 30]])
    np.testing.assert_array_equal(iv.subtract(a, []), [[0, 10], [20, 30]])
    assert iv.subtract([(1, 2)], [(0, 5)]).shape == (0, 2)


@pytest.mark.parametrize("seed", range(5))
def test_intersect_plus_subtract_is_a_partition(seed):
    rng = np.random.default_rng(seed)
    a = np.sort(rng.uniform(0, 100, (30, 2)), axis=1)
    b = np.sort(rng.uniform(0, 100, (30, 2)), axis=1)
    inside, outside = iv.intersect(a, b), iv.subtract(a, b)
    assert iv.total(inside) + iv.total(outside) == pytest.approx(iv.total(a))
    assert iv.total(iv.intersect(inside, outside)) == 0.0
    # Against a fine grid.
    grid = np.linspace(0, 100, 200001)[:-1] + 0.00025
    covered = lambda s: np.any((grid[:, None] >= s[:, 0]) & (grid[:, None] < s[:, 1]), axis=1)  # noqa: E731
    assert covered(inside).mean() * 100 == pytest.approx(iv.total(inside), abs=0.01)


def test_clip():
    np.testing.assert_array_equal(iv.clip([(0, 5), (8, 12)], 3, 10), [[3, 5], [8, 10]])


def test_concurrency_counts_open_intervals():
    times, counts = iv.concurrency([(0, 10), (2, 4), (3, 5), (10, 11)])
    assert list(zip(times, counts)) == [(0, 1), (2, 2), (3, 3), (4, 2), (5, 1), (10, 1), (11, 0)]
    assert counts.max() == 3


def test_counting_issued_minus_completed_needs_no_pairing():
    # Three issued at 0, 1, 2; completed (waited) at 5, 3, 6 in any order.
    times, counts = iv.counting([0, 1, 2], [5, 3, 6])
    assert list(zip(times, counts)) == [(0, 1), (1, 2), (2, 3), (3, 2), (5, 1), (6, 0)]
