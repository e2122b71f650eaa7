"""What passes a window: the first ``limit`` of each key in a window pass, the rest are held back
and counted, and the next that passes carries the count. No I/O: the caller gives the time.

One mechanism for Relay's bounded repeats: refused handshakes logged once a minute per reason,
host and app (:class:`relay.net.hub.RefusalLog`), refused attempts audited at most ten a minute
per key and action (:class:`relay.api.refusals.RefusalBudget`), the libraries' repeated warnings
written once a minute (:class:`relay.logs.QuietRepeats`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Passed:
    held: int  # held back since the last one that passed
    since: float  # when the window before this one began (the time of the first call, the first time)


class CountedWindow(Generic[K]):
    """Per key: a window begins at the first call, ``limit`` pass in it, the rest are held back;
    the first call ``window`` seconds or more after it begins the next. At most ``size`` keys are
    kept, the least recently seen forgotten first."""

    def __init__(self, limit: int = 1, window: float = 60.0, size: int = 10_000) -> None:
        self.limit = limit
        self.window = window
        self.size = size
        # key -> [window start, passed in it, held back since the last that passed]
        self._keys: OrderedDict[K, list[float]] = OrderedDict()

    def admit(self, key: K, now: float) -> Passed | None:
        """None: held back (counted); else what passed with it."""
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = [now, 0, 0]
            while len(self._keys) > self.size:
                self._keys.popitem(last=False)
        self._keys.move_to_end(key)
        since = state[0]
        if now - state[0] >= self.window:
            state[0], state[1] = now, 0
        if state[1] >= self.limit:
            state[2] += 1
            return None
        state[1] += 1
        held, state[2] = int(state[2]), 0
        return Passed(held, since)

    def hold(self, key: K, count: int) -> None:
        """Count ``count`` more held back for ``key`` (passed, but not acted on after all)."""
        state = self._keys.get(key)
        if state is not None:
            state[2] += count
