"""Following a table in the order of a sequence, without missing a row committed late.

Rows of the audit log (by ``id``) and changes of executors (by ``change_seq``)
take their numbers from sequences, when they are written, not when they commit:
a transaction that took 41 may commit after the one that took 42. A reader
that only asks for rows above the highest number it has seen would skip 41 for
ever. :class:`Tail` remembers every number it jumped over as a gap, for
``wait_secs``: the reader asks for those again, by number, until they appear
or the wait runs out (a number can also be burnt by a transaction that rolled
back, or by an insert that did nothing, and then it never appears).

No I/O here: the reader (:mod:`relay.domain.events`) runs the queries and
hands the numbers it found, with the time, to :meth:`Tail.seen`.
"""

from __future__ import annotations

from collections.abc import Iterable


class Tail:
    def __init__(self, head: int, wait_secs: float, max_gaps: int = 10_000, drawn: int = 0) -> None:
        """``head``: the highest number to take as already seen (the table's end when reading starts).
        ``drawn``: for a reader that starts again from a ``head`` below the numbers drawn already (the
        database went back in time, and rows are read again): the numbers up to it that are jumped
        over belong to rows changed again or deleted, not to late commits, and are not awaited."""
        self.top = head
        self.wait_secs = wait_secs
        self.max_gaps = max_gaps
        self.drawn = drawn
        self._gaps: dict[int, float] = {}  # number -> when it was jumped over

    @property
    def gaps(self) -> list[int]:
        """The numbers jumped over and still awaited, lowest first."""
        return sorted(self._gaps)

    def seen(self, numbers: Iterable[int], now: float) -> list[int]:
        """Of ``numbers`` (rows found above :attr:`top` or in :attr:`gaps`), those not seen before,
        in order. Numbers jumped over become gaps; gaps older than ``wait_secs`` are given up."""
        fresh: list[int] = []
        for number in sorted(set(numbers)):
            if number in self._gaps:
                del self._gaps[number]
                fresh.append(number)
            elif number > self.top:
                # After a long jump only the numbers just below the new one are awaited: a late
                # transaction took its number shortly before the rows that committed first.
                for missing in range(max(self.top + 1, number - self.max_gaps, self.drawn + 1), number):
                    self._gaps[missing] = now
                self.top = number
                fresh.append(number)
        self._expire(now)
        return fresh

    def _expire(self, now: float) -> None:
        for number, since in list(self._gaps.items()):
            if now - since > self.wait_secs:
                del self._gaps[number]
        if len(self._gaps) > self.max_gaps:  # the oldest numbers are the least likely to come
            for number in sorted(self._gaps)[: len(self._gaps) - self.max_gaps]:
                del self._gaps[number]
