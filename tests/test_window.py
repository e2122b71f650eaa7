"""relay.core.window: the one mechanism behind Relay's bounded repeats (no I/O)."""

from __future__ import annotations

from relay.core.window import CountedWindow, Passed


def test_the_limit_passes_the_rest_are_counted_into_the_next_window() -> None:
    window: CountedWindow[str] = CountedWindow(limit=2, window=10.0)
    assert [window.admit("a", 0.0), window.admit("a", 1.0)] == [Passed(0, 0.0), Passed(0, 0.0)]
    assert [window.admit("a", t) for t in (2.0, 3.0, 9.9)] == [None, None, None]
    assert window.admit("b", 5.0) == Passed(0, 5.0), "a key of its own"
    assert window.admit("a", 10.0) == Passed(3, 0.0), "the next window's first carries the count"
    window.hold("a", 4)
    assert window.admit("a", 11.0) == Passed(4, 10.0)


def test_at_most_size_keys_are_kept_the_least_recently_seen_forgotten() -> None:
    window: CountedWindow[int] = CountedWindow(limit=1, window=60.0, size=2)
    window.admit(1, 0.0)
    window.admit(2, 0.0)
    assert window.admit(1, 1.0) is None  # 1 seen again: 2 is now the least recent
    window.admit(3, 1.0)  # forgets 2
    assert window.admit(2, 2.0) == Passed(0, 2.0), "forgotten: it begins again"
    assert window.admit(3, 2.0) is None, "3 is kept"  # and 2's return forgot 1, the least recent
    assert window.admit(1, 2.0) == Passed(0, 2.0)
