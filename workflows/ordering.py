"""A group failure's recoveries take turns, the earliest deaths first (issue 15).

Each death's recovery is a DBOS workflow of its own, and in a group failure all
of them worked at once: each step of each one waited for the event loop,
Relay's connections and DBOS's threads behind a step of every other, so a group
of a thousand advanced together, one step per round, and was recovered nearly
all at once at the end, in no particular order.

A recovery works only during a turn (:data:`TURNS`): at most
:data:`relay.core.failover.RECOVERIES_AT_ONCE` at once on an instance, enough to keep its cores busy
and to fill shared recovery frames. It gives its turn back while it waits for a
peer, an operator or its backoff. The waiting get the turns given back by rank:
the moment the executor was due to be declared dead (:func:`rank_by`), set by
its grace period and inherited by the recovery it starts (a task inherits its
creator's rank). The group's last death is recovered no sooner (the work is the
same), most of the others sooner.

Unranked (0, before any death), and so first: a recovery that an operator or
the repair sweep started, or that DBOS resumed after a restart. Grace periods
do not take turns: declaring an executor dead when its grace runs out stays
prompt (an alert follows it), and so do a grace period's start and its durable
deadline. Making the grace periods take turns too (declaring dead in turn) was
measured: the first recoveries came sooner still, but the declarations came up
to half a minute late and the group's last recovery later; not kept.

The turns are not durable and need not be: a recovery that a crash of Relay
interrupts waits for a turn again when DBOS resumes it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from contextvars import ContextVar

from relay.core.failover import RECOVERIES_AT_ONCE

_rank: ContextVar[float] = ContextVar("relay_death_rank", default=0.0)


def rank_by(due_at: float) -> None:
    """Rank this task, and the tasks it starts, by ``due_at`` (``time.time()`` when its executor was
    due to be declared dead): the earlier, the sooner its turn."""
    _rank.set(due_at)


def current_rank() -> float:
    """This task's rank (0: none, it goes first)."""
    return _rank.get()


class Turns:
    """At most ``size`` holders at once; those waiting for a turn get it by rank, then arrival.

    Shared by tasks on different event loops (DBOS runs queued workflows on a loop of its own,
    Relay's on the server's), so it is guarded by a thread lock, and a waiter is woken on its own
    loop.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._free = size
        self._waiting: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def held(self) -> int:
        return self.size - self._free

    async def take(self) -> None:
        """Wait for a turn, by this task's rank."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._free > 0 and not self._waiting:
                self._free -= 1
                return
            waiter: asyncio.Future[None] = loop.create_future()
            heapq.heappush(self._waiting, (current_rank(), next(self._arrivals), loop, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            with self._lock:
                granted = waiter.done() and not waiter.cancelled()
                if not granted:
                    self._waiting = [w for w in self._waiting if w[3] is not waiter]
                    heapq.heapify(self._waiting)
            if granted:
                self.give_back()
            raise

    def give_back(self) -> None:
        """End a turn: the best-ranked waiter, if any, gets it."""
        with self._lock:
            while self._waiting:
                _, _, loop, waiter = heapq.heappop(self._waiting)
                if waiter.cancelled():
                    continue
                try:
                    loop.call_soon_threadsafe(self._grant, waiter)
                except RuntimeError:  # its loop is closed: the waiter is gone with it
                    continue
                return
            self._free += 1

    def _grant(self, waiter: asyncio.Future[None]) -> None:
        """On the waiter's loop: its turn, or the next one's if it was cancelled meanwhile."""
        if waiter.cancelled():
            self.give_back()
        elif not waiter.done():
            waiter.set_result(None)


TURNS = Turns(RECOVERIES_AT_ONCE)


class Turn:
    """A recovery's turn among :data:`TURNS`: held while it works, given back while it waits (for a
    peer, an operator, a backoff) and when it ends."""

    def __init__(self) -> None:
        self.held = False

    async def take(self) -> None:
        await TURNS.take()
        self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            TURNS.give_back()
