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

    def refuse(self, now: float, answered: int) -> bool:
        """Counts a refusal; True if it is the first of a run (the one to log). ``answered`` is how
        many times the database has answered so far (:attr:`relay.store.db.Database.answered`)."""
        first = self.refused == 0
        if first:
            self._since = now
        self.refused += 1
        self._mark = answered
        return first

    def serve(self, now: float, answered: int) -> RunEnded | None:
        """A request answered otherwise: the run ends if the database answered since its latest
        refusal (a request that needs no database, such as ``/healthz``, proves nothing)."""
        if self.refused == 0 or answered <= self._mark:
            return None
        ended = RunEnded(self.refused, now - self._since)
        self.refused = 0
        return ended
