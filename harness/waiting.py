"""Waiting for a condition with a deadline, never a bare ``sleep`` followed by a hope."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def assert_eventually(condition: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "") -> T:
    """Poll ``condition`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: T | AssertionError | None = None
    while True:
        try:
            value = condition()
        except AssertionError as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true within {timeout}s: {what or condition!r}; last: {last!r}")
        time.sleep(interval)
