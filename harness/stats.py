"""Statistics for the figures the benchmarks and the chaos harness report."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0 to 100) of ``values``, or None if there are none.

    Interpolated linearly between the two closest ranks, as numpy's default
    ("linear") method does: the 50th percentile of 1, 2, 3, 4 is 2.5.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100, not {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100
    below, above = math.floor(position), math.ceil(position)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
