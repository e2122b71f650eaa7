"""The pure reader of a sequence-numbered table (relay/core/tail.py): no I/O, the clock passed in."""

from __future__ import annotations

from relay.core.tail import Tail


def test_rows_above_the_head_are_new_once() -> None:
    tail = Tail(head=10, wait_secs=5)
    assert tail.seen([11, 12], now=0) == [11, 12]
    assert tail.seen([11, 12], now=1) == []  # read again: nothing new
    assert tail.top == 12 and tail.gaps == []


def test_a_row_committed_late_fills_its_gap_and_is_delivered() -> None:
    tail = Tail(head=10, wait_secs=5)
    assert tail.seen([11, 13, 14], now=0) == [11, 13, 14]
    assert tail.gaps == [12]  # taken by a transaction that had not committed yet
    assert tail.seen([12], now=2) == [12]
    assert tail.gaps == [] and tail.top == 14
    assert tail.seen([12, 14], now=3) == []


def test_a_gap_that_never_fills_is_given_up_after_the_wait() -> None:
    tail = Tail(head=0, wait_secs=5)
    tail.seen([3], now=0)
    assert tail.gaps == [1, 2]
    tail.seen([], now=4.9)
    assert tail.gaps == [1, 2]
    tail.seen([], now=5.1)  # rolled back, or burnt by an insert that did nothing
    assert tail.gaps == []
    assert tail.seen([1], now=6) == []  # too late: below the top and no longer awaited


def test_gaps_are_bounded() -> None:
    tail = Tail(head=0, wait_secs=60, max_gaps=100)
    assert tail.seen([1_000_000], now=0) == [1_000_000]
    assert len(tail.gaps) <= 100
    tail.seen([1_000_500], now=1)
    assert len(tail.gaps) == 100 and max(tail.gaps) == 1_000_499  # the newest are kept


def test_a_reader_starting_over_below_the_numbers_drawn_awaits_none_of_them() -> None:
    """The database went back in time: executors are read again from 0; the numbers between their rows
    belong to rows changed again or deleted. Only those drawn after it are awaited."""
    tail = Tail(head=0, wait_secs=5, drawn=500)
    assert tail.seen([40, 300, 499], now=0) == [40, 300, 499]
    assert tail.gaps == []
    assert tail.seen([503], now=1) == [503]
    assert tail.gaps == [501, 502]  # drawn since: may commit late
