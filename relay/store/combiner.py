"""Write-combining: fenced writes that arrive together share one transaction.

A write is a function of a connection (its statements, and what it returns);
:meth:`WriteCombiner.run` queues it and awaits its result. Up to ``lanes``
transactions run at once; each takes every write queued when it begins (up to
``max_batch``). Two lanes take whatever is queued; more, up to ``lanes``, open
only while more than a batch waits. A batch's statements run one after the
other on its connection, so a batch is as slow as its writes together: two
lanes batch best (a group failure's writes), and the extra ones keep a burst
(a thousand sockets closing at a shutdown) from queuing behind itself. An idle
instance so runs each write at once in its own transaction, and a busy one (a
group of executors dying together: their declarations, recovery state changes
and audit entries) pays for one transaction, one check of its lease and one
commit per batch instead of per write.

What stays per write:

- Its guards. Each write's statements are its own (``WHERE state = ... AND
  epoch = ...``); sharing a transaction changes none of them.
- Fencing. The batch's transaction is :meth:`Database.fenced`: its lease check
  holds until the commit for every write in it. A stale instance's batch commits
  nothing, and every write in it gets :class:`Fenced`.
- Its locks' order. A batch runs its writes in the order of the executors they lock
  (the ``locks`` of :meth:`WriteCombiner.run`: by org, app, executor id, code point by
  code point), not in the order they were queued: as every batch that locks several
  executors' rows does (a batch of handshakes or of disconnections, a stop, an adoption:
  ``_LOCK_ORDER`` in :mod:`relay.store.executors`), so that such a batch and this one wait
  for each other, and neither holds a row the other waits for (a deadlock, which PostgreSQL
  breaks by failing one). Writes of one executor keep the order they were queued in; writes
  that lock no executor's row (an audit entry of its own) come after the others, holding
  what they lock for the shortest time and taking nothing a keyed write could wait for.
  A batch of several executors first locks their remembered ids (``executor_ids``), in
  key order, as a batch of handshakes does before it writes their records: a write that
  deletes a record (a recovery verified) updates its id's row before the record, and
  run after another executor's write it held that executor's record while it waited for
  an id row such a batch held, waiting for that record.
- Its failure. A write whose statement fails (a NUL in a text, a deadlock) aborts
  the transaction; the others are rolled back with it and run again in the next
  transaction without it, and that write alone gets the error. A bad row never
  fails the others. (No savepoint per write: the failure is rare, and the common
  case pays nothing for it.)

A write must touch nothing but the connection: it may run more than once
before its transaction commits. Its result is delivered only after the commit.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import psycopg

from relay.core.ids import ExecutorKey
from relay.errors import DatabaseError
from relay_protocol.limits import has_unstorable

if TYPE_CHECKING:
    from relay.store.db import Database

T = TypeVar("T")
Conn = psycopg.AsyncConnection[dict[str, Any]]
Write = Callable[[Conn], Awaitable[T]]


@dataclass
class _Queued(Generic[T]):
    write: Write[T]
    done: asyncio.Future[T]
    locks: ExecutorKey | None = None


def _lock_order(queued: _Queued[Any]) -> tuple[bool, str, str, str]:
    """Where a write runs in its batch: by the executor whose rows it locks, as Python compares
    strings (code point by code point, as ``COLLATE "C"`` orders them in ``_LOCK_ORDER``); a
    write that locks none, after."""
    key = queued.locks
    return (True, "", "", "") if key is None else (False, key.org, key.app, key.executor_id)


class _Failed(Exception):
    """One write of a batch failed: roll the transaction back, leaving the error with that write."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(index)
        self.index = index
        self.error = error


def _as_database_error(exc: BaseException) -> BaseException:
    if isinstance(exc, psycopg.Error):
        error = DatabaseError(f"database error: {exc}")
        error.__cause__ = exc
        return error
    return exc


class WriteCombiner:
    def __init__(self, db: Database, *, lanes: int = 8, max_batch: int = 64, base_lanes: int = 2) -> None:
        self.db = db
        self.lanes = lanes
        self.base_lanes = min(base_lanes, lanes)
        self.max_batch = max_batch
        self._queue: deque[_Queued[Any]] = deque()
        self._running: set[asyncio.Task[None]] = set()
        # For /metrics and the benchmarks: transactions committed and the writes they carried.
        self.batches = 0
        self.writes = 0

    async def run(self, write: Write[T], *, locks: ExecutorKey | None = None) -> T:
        """``write``'s result once its transaction has committed; its error if it failed, or
        the batch's (:class:`Fenced`, the database unreachable) if the transaction did.

        ``locks``: the executor whose rows (its record, its id, its recoveries) ``write`` locks,
        which places it in its batch (in key order); None for a write that locks no executor's row."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(write, done, locks))
        running = len(self._running)
        if running < self.base_lanes or (running < self.lanes and len(self._queue) > self.max_batch):
            self._running.add(asyncio.get_running_loop().create_task(self._drain()))
        return await done

    async def settled(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until the lanes running now have nothing left to
        write (a stop's first step: the writes in flight touch the rows its own statement is about
        to; bounded, since new writes may keep a lane busy for as long as they come)."""
        if self._running:
            await asyncio.wait(list(self._running), timeout=timeout)

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
                # A write whose caller has gone (a cancelled step) is not run.
                await self._commit([q for q in batch if not q.done.done()])
        finally:
            # With no await since the queue was last seen empty: a write queued from here on
            # finds this lane gone and starts another.
            self._running.discard(asyncio.current_task())

    async def _commit(self, batch: list[_Queued[Any]]) -> None:
        batch = sorted(batch, key=_lock_order)  # stable: one executor's writes in the order queued
        while batch:
            results: list[Any] = []
            # (A key PostgreSQL cannot store has no id to lock: its write fails alone, as any bad row.)
            keys = list(dict.fromkeys(q.locks for q in batch if q.locks is not None and _storable(q.locks)))
            try:
                async with self.db.fenced() as conn:
                    if len(keys) > 1:  # (one executor's writes lock its id before its record, as a handshake)
                        await _lock_ids(conn, keys)
                    for index, queued in enumerate(batch):
                        try:
                            results.append(await queued.write(conn))
                        except Exception as exc:
                            raise _Failed(index, exc) from exc
            except _Failed as failed:
                _settle(batch[failed.index], error=_as_database_error(failed.error))
                batch = batch[: failed.index] + batch[failed.index + 1 :]
                continue
            except Exception as exc:  # the transaction itself: fenced, the database gone, the commit refused
                for queued in batch:
                    _settle(queued, error=exc)
                return
            except BaseException:  # this lane cancelled (a shutdown): its writes' callers must not wait forever
                interrupted = DatabaseError("the write was interrupted (Relay is stopping): it may not have committed")
                for queued in batch:
                    _settle(queued, error=interrupted)
                raise
            self.batches += 1
            self.writes += len(batch)
            for queued, result in zip(batch, results, strict=True):
                _settle(queued, result=result)
            return


def _storable(key: ExecutorKey) -> bool:
    return not any(has_unstorable(part) for part in (key.org, key.app, key.executor_id))


async def _lock_ids(conn: Conn, keys: list[ExecutorKey]) -> None:
    """Lock the ids of these executors (in key order) as the writes that update them would
    (``FOR NO KEY UPDATE``), before any of their records: a batch of handshakes writes every id
    of its batch, then every record (relay.store.executors). A failure is the transaction's (every
    write of the batch gets it, as Database.connection makes it: the connection lost, say)."""
    await conn.execute(
        """SELECT 1 FROM executor_ids i
           JOIN unnest(%s::text[], %s::text[], %s::text[]) AS k(org, app, executor_id)
             ON i.org = k.org AND i.app = k.app AND i.executor_id = k.executor_id
           ORDER BY i.org COLLATE "C", i.app COLLATE "C", i.executor_id COLLATE "C"
           FOR NO KEY UPDATE OF i""",
        ([k.org for k in keys], [k.app for k in keys], [k.executor_id for k in keys]),
    )


def _settle(queued: _Queued[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    if queued.done.done():
        return
    if error is not None:
        queued.done.set_exception(error)
    else:
        queued.done.set_result(result)
