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
- Its locks' order. A write may name the key of the rows it locks (``locks`` of
  :meth:`WriteCombiner.run`: an executor's, in :mod:`relay.store.executors`), and a batch
  runs its writes in the order of their keys, not in the order they were queued: as every
  transaction that locks several keys' rows does, so that such a transaction and this one
  wait for each other, and neither holds a row the other waits for (a deadlock, which
  PostgreSQL breaks by failing one). Writes of one key keep the order they were queued in;
  writes that lock no key's row (an audit entry of its own) come after the others, holding
  what they lock for the shortest time and taking nothing a keyed write could wait for. A
  batch of several keys first calls the writes' locker (``lock_keys``) once, with their keys
  in order: what the store that owns the keys must lock before any write of them
  (:func:`relay.store.executors.lock_ids`). Keys of several types (which do not compare) run
  type by type, each type's in its order, the types by name: one order for every batch. If a
  type's keys do not compare among themselves, that type's writes of the batch fail (all of
  them: :class:`TypeError`), before the transaction; the other types' writes run, and the lane
  goes on with the next writes.
- Its failure. A write whose statement fails (a NUL in a text, a deadlock) aborts
  the transaction; the others are rolled back with it and run again in the next
  transaction without it, and that write alone gets the error. A bad row never
  fails the others. (No savepoint per write: the failure is rare, and the common
  case pays nothing for it.) A connection lost under a write's statement is the
  transaction's failure, not the write's: every write of the batch gets
  :class:`ConnectionLost`, as :meth:`Database.connection` makes it, which also has
  the pool's idle connections checked (a restart of PostgreSQL broke them too).

A write must touch nothing but the connection: it may run more than once
before its transaction commits. Its result is delivered only after the commit.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import psycopg

from relay.core.requestid import shared_task
from relay.errors import DatabaseError

if TYPE_CHECKING:
    from relay.store.db import Database

T = TypeVar("T")
Conn = psycopg.AsyncConnection[dict[str, Any]]
Write = Callable[[Conn], Awaitable[T]]
# Locks the rows of these keys (two or more, distinct, in order) in the caller's transaction.
KeyLocker = Callable[[Conn, list[Any]], Awaitable[None]]


@dataclass
class _Queued(Generic[T]):
    write: Write[T]
    done: asyncio.Future[T]
    locks: Hashable | None = None
    lock_keys: KeyLocker | None = None


def _lock_order(queued: _Queued[Any]) -> tuple[Any, ...]:
    """Where a write runs in its batch: by the key whose rows it locks (keys compare as their
    store orders them); a write that locks none, after."""
    return (1,) if queued.locks is None else (0, queued.locks)


def _in_lock_order(batch: list[_Queued[Any]]) -> tuple[list[_Queued[Any]], list[_Queued[Any]]]:
    """(the batch's writes in the order they run: :func:`_lock_order`; those whose keys cannot be
    ordered, which do not run). Stable: one key's writes in the order queued."""
    try:
        return sorted(batch, key=_lock_order), []
    except Exception:  # keys that do not compare (TypeError), or whose comparison fails
        pass
    by_type: dict[tuple[str, str], list[_Queued[Any]]] = {}
    for queued in batch:
        if queued.locks is not None:
            kind = type(queued.locks)
            by_type.setdefault((kind.__module__, kind.__qualname__), []).append(queued)
    ordered: list[_Queued[Any]] = []
    refused: list[_Queued[Any]] = []
    for _, of_type in sorted(by_type.items(), key=lambda item: item[0]):
        try:
            ordered += sorted(of_type, key=_lock_order)
        except Exception:
            refused += of_type
    return ordered + [q for q in batch if q.locks is None], refused


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

    async def run(self, write: Write[T], *, locks: Hashable | None = None, lock_keys: KeyLocker | None = None) -> T:
        """``write``'s result once its transaction has committed; its error if it failed, or
        the batch's (:class:`Fenced`, the database unreachable) if the transaction did.

        ``locks``: the key whose rows ``write`` locks (an executor's: its record, its id, its
        recoveries), which places it in its batch (in key order: keys that compare as their store
        locks them); None for a write that locks no key's row. ``lock_keys``, with ``locks``: what
        locks several such keys' rows, in order, before any write of them runs."""
        if locks is not None and lock_keys is None:
            raise ValueError("a write that locks a key's rows needs the locker of its keys")
        if locks is not None:
            hash(locks)  # TypeError, here: an unhashable key would fail its whole batch
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(write, done, locks, lock_keys))
        running = len(self._running)
        if running < self.base_lanes or (running < self.lanes and len(self._queue) > self.max_batch):
            self._running.add(shared_task(self._drain()))
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
        batch, refused = _in_lock_order(batch)
        for queued in refused:
            error = TypeError(
                f"the key {queued.locks!r} of a combined write does not order with the other keys of its "
                f"type in its batch ({type(queued.locks).__qualname__}): the write was not run"
            )
            _settle(queued, error=error)
        while batch:
            results: list[Any] = []
            try:
                async with self.db.fenced() as conn:
                    for lock_keys, keys in _keys_by_locker(batch).items():
                        if len(keys) > 1:  # (one key's writes lock its rows themselves, in their order)
                            await lock_keys(conn, keys)
                    for index, queued in enumerate(batch):
                        try:
                            results.append(await queued.write(conn))
                        except Exception as exc:
                            if isinstance(exc, psycopg.Error) and conn.broken:
                                # The connection lost under it: the transaction's failure, which
                                # Database.connection makes ConnectionLost (and has the pool checked).
                                raise
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


def _keys_by_locker(batch: list[_Queued[Any]]) -> dict[KeyLocker, list[Any]]:
    """The distinct keys of a batch (sorted: the batch is), per locker. A locker's failure is the
    transaction's: every write of the batch gets it, as Database.connection makes it (the
    connection lost, say)."""
    keys: dict[KeyLocker, dict[Any, None]] = {}
    for queued in batch:
        if queued.locks is not None and queued.lock_keys is not None:
            keys.setdefault(queued.lock_keys, {})[queued.locks] = None
    return {lock_keys: list(of) for lock_keys, of in keys.items()}


def _settle(queued: _Queued[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    if queued.done.done():
        return
    if error is not None:
        queued.done.set_exception(error)
    else:
        queued.done.set_result(result)
