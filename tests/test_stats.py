"""The one percentile function behind the benchmarks' and the chaos harness's figures."""

from __future__ import annotations

import pytest

from harness.stats import percentile


def test_interpolates_linearly_between_the_closest_ranks() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([1, 2, 3, 4], 25) == pytest.approx(1.75)


def test_the_ends_are_the_smallest_and_the_largest_value() -> None:
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0


def test_order_of_the_input_does_not_matter() -> None:
    assert percentile([10, 0, 5], 50) == 5
    assert percentile((x for x in [4, 1, 3, 2]), 50) == 2.5


def test_a_single_value_is_every_percentile() -> None:
    assert percentile([7.5], 1) == 7.5
    assert percentile([7.5], 99) == 7.5


def test_no_values_have_no_percentile() -> None:
    assert percentile([], 50) is None


def test_q_outside_0_to_100_is_an_error() -> None:
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        percentile([1.0], -1)
