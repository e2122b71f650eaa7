"""Live updates for the console: what changed, pushed to the streams of ``GET /v2/orgs/{org}/events``.

One poller per instance, running only while a stream is open on it, reads
what changed since its last look (new audit entries, changed executors: see
:mod:`relay.store.changes`), so changes made through any instance reach every
console. Each change goes to the streams whose key may see it: its org, one of
its apps if the key is scoped to apps; an audit entry of an app goes to whoever
may read the app (the console re-reads the app's pages on it: an app team's key,
limited to its apps, has no ``organization.read``), one of no app (keys, the
instances) only with ``organization.read``.

Streams are bounded: a key may hold ``server.maxEventStreamsPerKey`` on one
instance and all keys together ``server.maxEventStreams``. A stream that does
not keep up (1,000 changes still wait for it when the next poll comes) is ended, and so is every stream of a key
that was deleted or changed (its secret rotated, its permissions or apps
changed in relay.yaml); a console then starts a new one, with what its key
may see now, and reads its page again.

When the database goes back in time (a restore, a failover to a replica that
had not received the last seconds), its sequences go back with it, and the
numbers drawn since are drawn again, below where the poller has read: it would
skip every change until the sequences passed that point again. A restore and a
failover are each another start of the database server: the poller sees the
server's start time differ from its last read (or, for a copy made otherwise, a
sequence below the highest number it read) and reads on from there: the audit
entries dated after its last read before (all written since the database came
back), and every executor again (each change carries the executor's whole
record, so one sent again changes nothing in a console). The sequences alone do
not tell: numbers drawn between the server's return and the poller's next read
(a burst of deaths, the executors connecting again) may pass where it had read.
After a plain restart nothing went back: the audit log is read on from where it
was, and only the executors are sent again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from relay.auth import KeyGrant, KeyRing, Permission
from relay.config import ServerConfig
from relay.core.tail import Tail
from relay.core.times import us_iso
from relay.errors import DatabaseError, StreamsExhausted, TooManyRequests
from relay.store.changes import ChangeStore, Heads

log = logging.getLogger("relay.events")

# Changes still waiting for one stream when the next poll comes; beyond it the stream is ended. One
# poll's changes (up to a BATCH of each table, and the late numbers found) are all put on the queue
# at once, before the stream can send any: a burst larger than this ends no reader that keeps up.
QUEUE_SIZE = 1000
BATCH = 1000  # rows read per table per poll
GAP_WAIT_SECS = 5.0  # how long a number jumped over is awaited (relay.core.tail)


@dataclass(frozen=True)
class Change:
    kind: str  # "executor" or "audit"
    org: str
    app: str | None
    data: dict[str, Any]


END = None  # put on a stream's queue to end it


@dataclass(eq=False)
class Stream:
    grant: KeyGrant  # what it was opened with: it ends when the key ring's grant for its key differs
    digest: str  # the key's SHA-256: the stream ends when the key is no longer valid
    # Unbounded itself: held to QUEUE_SIZE and one poll's changes by EventHub.poll.
    queue: asyncio.Queue[Change | None] = field(default_factory=asyncio.Queue)
    ended: str | None = None  # why the stream was ended, if it was

    def wants(self, change: Change) -> bool:
        grant = self.grant
        if change.org != grant.org:
            return False
        if change.kind == "audit" and change.app is None and Permission.ORGANIZATION_READ not in grant.permissions:
            return False
        if grant.apps is None:
            return True
        return change.app is not None and change.app in grant.apps

    def end(self, reason: str) -> None:
        if self.ended is not None:
            return
        self.ended = reason
        while not self.queue.empty():  # what is left unsent no longer matters: the end mark goes next
            self.queue.get_nowait()
        self.queue.put_nowait(END)


class EventHub:
    def __init__(self, changes: ChangeStore, keyring: KeyRing, server: ServerConfig) -> None:
        self.changes = changes
        self.keyring = keyring
        self.poll_secs = server.event_poll_secs
        self.heartbeat_secs = server.event_heartbeat_secs
        self.max_per_key = server.max_event_streams_per_key
        self.max_streams = server.max_event_streams
        self.streams: set[Stream] = set()
        self._per_key: Counter[str] = Counter()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._audit: Tail | None = None
        self._executors: Tail | None = None
        # The database's time at the last poll that read it, or the date of the newest audit entry
        # that poll read if later: no entry read is dated after it (see _went_back).
        self._read_at: datetime | None = None
        self._server: datetime | None = None  # when the server read at the last poll started
        self._executors_drawn = 0  # the last executor change number drawn at the last poll

    # -- streams -------------------------------------------------------------------------

    def open(self, grant: KeyGrant, digest: str) -> Stream:
        """A new stream for this key; :class:`TooManyRequests` past the key's share,
        :class:`StreamsExhausted` past the instance's."""
        if self._per_key[grant.key_id] >= self.max_per_key:
            raise TooManyRequests(f"this key already has {self.max_per_key} event streams open on this instance")
        if len(self.streams) >= self.max_streams:
            raise StreamsExhausted(f"this instance already serves {self.max_streams} event streams")
        stream = Stream(grant, digest)
        self.streams.add(stream)
        self._per_key[grant.key_id] += 1
        self._wake.set()
        return stream

    def close(self, stream: Stream) -> None:
        if stream in self.streams:
            self.streams.discard(stream)
            self._per_key[stream.grant.key_id] -= 1
            if self._per_key[stream.grant.key_id] <= 0:
                del self._per_key[stream.grant.key_id]

    # -- the poller ------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        for stream in list(self.streams):
            stream.end("shutdown")
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        failed, since = 0, 0.0  # reads failed in a row (the database away), and since when
        while True:
            if not self.streams:
                self._audit = self._executors = None  # nobody listens: nothing to read until somebody does
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.poll()
            except DatabaseError as exc:
                # One warning for a run of failures, not one per poll for as long as an outage lasts.
                if not failed:
                    since = time.monotonic()
                    log.warning("cannot read what changed for the event streams (trying again every %g s, "
                                "quietly): %s", self.poll_secs, exc)  # fmt: skip
                else:
                    log.debug("cannot read what changed for the event streams: %s", exc)
                failed += 1
            else:
                if failed:
                    log.info("the event streams read what changed again after %d failed reads in %.1f s",
                             failed, time.monotonic() - since)  # fmt: skip
                failed = 0
            await asyncio.sleep(self.poll_secs)

    async def poll(self) -> None:
        """One look at what changed; each change to the streams that may see it."""
        self._drop_revoked()
        heads = await self.changes.heads()
        if self._audit is None or self._executors is None or self._read_at is None:
            self._audit = Tail(heads.audit, GAP_WAIT_SECS)
            self._executors = Tail(heads.executors, GAP_WAIT_SECS)
            self._read_at, self._server, self._executors_drawn = heads.at, heads.server_started, heads.executors_drawn
            return
        if (
            heads.server_started != self._server
            or heads.audit_drawn < self._audit.top
            or heads.executors_drawn < self._executors.top
        ):
            await self._went_back(heads, self._read_at)
        self._read_at, self._server, self._executors_drawn = heads.at, heads.server_started, heads.executors_drawn
        now = time.monotonic()
        changes: list[Change] = []
        rows = await self.changes.executors_after(self._executors.top, self._executors.gaps, BATCH)
        by_seq = {int(r["change_seq"]): r for r in rows}
        for seq in self._executors.seen(by_seq, now):
            changes.append(executor_change(by_seq[seq]))
        rows = await self.changes.audit_after(self._audit.top, self._audit.gaps, BATCH)
        by_id = {int(r["id"]): r for r in rows}
        # An entry committed between the look at the heads and this read is dated after the heads'
        # time: a restart before the next poll would send it again, found after the last read.
        self._read_at = max([heads.at, *(r["at"] for r in rows)])
        for entry_id in self._audit.seen(by_id, now):
            changes.append(audit_change(by_id[entry_id]))
        for stream in list(self.streams):
            if stream.ended is not None:
                continue
            if stream.queue.qsize() >= QUEUE_SIZE:  # what earlier polls gave it is still waiting
                stream.end("overflow")
                continue
            for change in changes:
                if stream.wants(change):
                    stream.queue.put_nowait(change)

    async def _went_back(self, heads: Heads, read_at: datetime) -> None:
        """Another server answers than at the last read, or a sequence is below numbers already read
        from it: the database may have gone back in time. The audit log is read on from the newest
        entry dated before the last read (``read_at``), what the streams were given being from
        before and what was written since the database came back after, or from where it was if
        that is lower (a plain restart: nothing is read twice). The executors are all read again:
        their numbers do not tell which changed since."""
        assert self._audit is not None and self._executors is not None
        read_audit, read_executors = self._audit.top, self._executors.top
        audit = min(read_audit, await self.changes.audit_dated(read_at))
        if audit < read_audit:
            self._audit = Tail(audit, GAP_WAIT_SECS)
        # A number drawn before the last read was committed, or given up, before the server went
        # away: one jumped over is a row changed again. One drawn since may still be committing.
        self._executors = Tail(0, GAP_WAIT_SECS, drawn=min(self._executors_drawn, heads.executors_drawn))
        if heads.audit_drawn < read_audit or heads.executors_drawn < read_executors:
            log.warning("the database went back in time (a restore, or a failover to a replica that lagged): its "
                        "numbers are drawn again (audit entries from %d, read up to %d; executor changes from %d, "
                        "read up to %d); the event streams go on with the audit entries written since it came "
                        "back and every executor's record",
                        heads.audit_drawn, read_audit, heads.executors_drawn, read_executors)  # fmt: skip
        else:
            log.warning("the database server started again (at %s: a restart, a failover or a restore, which may have "
                        "gone back in time); the event streams go on from audit entry %d (read up to %d) and every "
                        "executor's record", us_iso(heads.server_started), audit, read_audit)  # fmt: skip

    def _drop_revoked(self) -> None:
        for stream in list(self.streams):
            grant = self.keyring.grant_of_digest(stream.digest)
            if grant is None:
                stream.end("key deleted")
            elif _powers(grant) != _powers(stream.grant):
                # Narrowed, the stream would go on with what its key may no longer see; widened, it
                # would miss what it may see now. A rename alone leaves it be.
                stream.end("key changed")


def _powers(grant: KeyGrant) -> tuple[object, ...]:
    return grant.key_id, grant.org, grant.permissions, grant.apps


def executor_change(row: dict[str, Any]) -> Change:
    data = {
        "app": row["app"],
        "executorId": row["executor_id"],
        "state": row["state"],
        "blockedReason": row["blocked_reason"],
        "relayInstance": row["relay_instance"],
    }
    return Change("executor", str(row["org"]), str(row["app"]), data)


def audit_change(row: dict[str, Any]) -> Change:
    data = {
        "id": int(row["id"]),
        "at": us_iso(row["at"]),
        "app": row["app"],
        "action": row["action"],
        "executorId": row["executor_id"],
        "peerExecutorId": row["peer_executor_id"],
    }
    return Change("audit", str(row["org"]), row["app"], data)
