"""A run of requests refused for the database, told to the log once, not once per request.

While Relay's database is away, every request of a console, an agent or a script is answered 503
``database_unavailable``; a warning for each wrote a line per request for as long as the outage
lasted. :class:`RefusalRun` is the bookkeeping (no I/O, the caller gives the time): the first
refusal of a run is to be logged, the rest are counted, and the run ends at the first request
served after the database answered again, with how many were refused and for how long.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunEnded:
    refused: int  # requests answered 503 in the run, the first (logged) included
    secs: float  # from the first refusal to the request served


class RefusalRun:
    def __init__(self) -> None:
        self.refused = 0
        self._since = 0.0
        self._mark = 0  # how many times the database had answered at the latest refusal
        self._last = 0.0  # when the latest refusal was

    def refuse(self, now: float, answered: int) -> bool:
        """Counts a refusal; True if it is the first of a run (the one to log). ``answered`` is how
        many times the database has answered so far (:attr:`relay.store.db.Database.answered`)."""
        first = self.refused == 0
        if first:
            self._since = now
        self.refused += 1
        self._mark, self._last = answered, now
        return first

    def ended_unseen(self, started: float, recovered_at: float | None) -> RunEnded | None:
        """The run under way, ended though no request served saw it end: the database answered
        again (``recovered_at``, after it could not be reached) after the run's latest refusal and
        before this request began (``started``). A request that waited through the same outage and
        was refused late began before the database answered again: it stays in the run. A refusal
        after it is then the first of a new run (another outage), logged as such."""
        if self.refused == 0 or recovered_at is None or not self._last < recovered_at <= started:
            return None
        ended = RunEnded(self.refused, self._last - self._since)
        self.refused = 0
        return ended

    def serve(self, now: float, answered: int) -> RunEnded | None:
        """A request answered otherwise: the run ends if the database answered since its latest
        refusal (a request that needs no database, such as ``/healthz``, proves nothing)."""
        if self.refused == 0 or answered <= self._mark:
            return None
        ended = RunEnded(self.refused, now - self._since)
        self.refused = 0
        return ended


@dataclass(frozen=True)
class Recovered:
    failed: int  # failures in a row before the success, the first (told) included
    secs: float  # from the first failure to the success


class FailureRun:
    """A recurring task's failures in a row (the database away fails each round of a loop): the
    first of a run is to be told, the next ones counted, and the first success after them ends the
    run, told with how many there were. No I/O: the caller gives the time."""

    def __init__(self) -> None:
        self.failed = 0
        self._since = 0.0

    def fail(self, now: float) -> bool:
        """Counts a failure; True if it is the first of a run (the one to tell)."""
        first = self.failed == 0
        if first:
            self._since = now
        self.failed += 1
        return first

    def succeed(self, now: float) -> Recovered | None:
        """A round that worked: the run it ends, if one was under way."""
        if self.failed == 0:
            return None
        ended = Recovered(self.failed, now - self._since)
        self.failed = 0
        return ended
