"""Requests to executors, wherever their sockets are.

An executor's socket is on one instance, the one its row names
(``executors.relay_instance``); the workflow or API call that wants to ask it
something may run on another. :meth:`Router.request` asks the local hub when
the socket is here, and otherwise hands the request to the owner through
PostgreSQL: a row in ``relay_rpc`` and a ``NOTIFY`` on the owner's channel.
The owner claims the row (once), sends the frame over its socket, writes the
reply into the row and notifies the requester's channel.

The same listening connection hears :data:`relay.store.recoveries.BLOCKED_CHANNEL`, where a
recovery that begins to wait for a peer announces its app; :attr:`Router.on_blocked` is told.

Notifications are a wake-up, not the record: each side also polls the table
every :data:`POLL_SECS`, so a notification lost to a dropped listening
connection costs a second, not a request. Once claimed, a request is always
answered, unless the database fails: a request the owner cannot read (a message
type of a newer release, during a rolling upgrade) comes back as an error saying
why (:class:`relay.errors.RequestNotServed`). A request the owner has not claimed
within :data:`PICKUP_SECS` (it died, and its lease has not run out yet) is
withdrawn and the owner looked up again. A request whose claimer is gone before
answering (killed: its lease ran out; or started again, not knowing the claim) is
withdrawn too, and the asker answers at once (:meth:`Router._claimer_gone`): it
looks at the claimer's lease every third of a lease, as often as the lease is
renewed, once a request has waited that long. Rows are deleted once read (or after
:data:`KEEP_SECS` if nobody read them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg

from relay.core.ids import ExecutorKey
from relay.core.requestid import current_request_id, serving
from relay.errors import (
    DatabaseError,
    ExecutorBadReply,
    ExecutorGone,
    ExecutorNotConnected,
    ExecutorRequestError,
    ExecutorTimeout,
    RequestLost,
    RequestNotServed,
)
from relay.logs import FailureLog
from relay.net.hub import Hub
from relay.net.wire import Frame, reply_to
from relay.store.db import Database
from relay.store.executors import ExecutorStore
from relay.store.recoveries import BLOCKED_CHANNEL
from relay_protocol import ProtocolError as WireError
from relay_protocol import Reply, Request, clean_text, parse_request

log = logging.getLogger("relay.router")
R = TypeVar("R", bound=Reply)

POLL_SECS = 1.0
# A live owner picks a request up within a notification's round trip, or its next poll.
PICKUP_SECS = 3 * POLL_SECS
KEEP_SECS = 600.0
# A notification that asks this instance to close a socket another instance took over.
CLOSE_NOTE = "close "
# How often a request for an executor that is not connected anywhere looks again.
OWNER_RECHECK_SECS = 0.1

# The error kinds an owner writes back. An asker of an older release reads a kind it does not know
# as "gone" (a 502 all the same, with the owner's message).
UNSERVED = "unserved"
_ERRORS: dict[str, type[ExecutorRequestError]] = {
    "not_connected": ExecutorNotConnected,
    "timeout": ExecutorTimeout,
    "gone": ExecutorGone,
    "too_large": ExecutorBadReply,
    UNSERVED: RequestNotServed,
}


def channel(instance_id: str) -> str:
    """The instance's NOTIFY channel: a valid identifier whatever the instance id."""
    return "relay_rpc_" + hashlib.sha256(instance_id.encode()).hexdigest()[:24]


def _error_kind(exc: ExecutorRequestError) -> str:
    for kind, cls in _ERRORS.items():
        if isinstance(exc, cls):
            return kind
    return "gone"


class Router:
    def __init__(
        self,
        db: Database,
        executors: ExecutorStore,
        hub: Hub,
        instance_id: str,
        max_reply_bytes: int = 64 << 20,
        lease_secs: float = 15.0,
    ) -> None:
        self.db = db
        # How often an asker looks whether the instance that claimed its request is still alive:
        # a dead one's lease runs out within ``lease_secs``, and a live one renews it this often.
        self.claimer_check_secs = lease_secs / 3
        self.max_reply_bytes = max_reply_bytes
        self.executors = executors
        self.hub = hub
        self.instance_id = instance_id
        self.channel = channel(instance_id)
        self._replies: dict[int, asyncio.Future[None]] = {}
        self._serving: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self.relayed = 0  # requests this instance sent to its executors for other instances
        # Told (org, app) when a recovery of that app, on any instance, begins to wait; set once
        # the durable layer can wake recoveries (before that, its start-up reads them all).
        self.on_blocked: Callable[[str, str], Awaitable[None]] | None = None

    # -- asking ----------------------------------------------------------------

    async def ask(
        self,
        key: ExecutorKey,
        request: Request,
        expected: type[R],
        timeout: float,
        *,
        await_connection: bool = False,
        owner: str | None = None,
    ) -> R:
        """:meth:`request`, with the reply read as ``expected`` (see :func:`relay.net.wire.reply_to`)."""
        frame = await self.request(key, request, timeout, await_connection=await_connection, owner=owner)
        return reply_to(request, frame, expected, f"executor {key}")

    async def request(
        self,
        key: ExecutorKey,
        request: Request,
        timeout: float,
        *,
        await_connection: bool = False,
        owner: str | None = None,
    ) -> Frame:
        """Send ``request`` to the executor wherever it is connected, and await its reply.

        With ``await_connection``, an executor not connected anywhere right now
        (one reconnecting after a restart of an instance) is waited for, within
        ``timeout``. ``owner``: the instance the caller just read as holding its socket
        (:meth:`ExecutorStore.serving`), which saves looking it up once; looked up after that.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        problem = "is not connected to any live Relay instance"
        hint = owner
        while True:
            owner = hint if hint is not None else await self.executors.owner(key)
            hint = None  # looked up from the second round on
            if owner == self.instance_id and key in self.hub.connections:
                return await self.hub.request(key, request, max(deadline - loop.time(), 0.001))
            if owner is not None and owner != self.instance_id:
                reply = await self._remote(owner, key, request, deadline)
                if reply is not None:
                    return reply
                # The owner never picked the request up (it died, its lease not yet out): look again.
                problem = f"is on instance {owner}, which did not pick the request up"
            if not await_connection or loop.time() >= deadline:
                raise ExecutorNotConnected(f"executor {key} {problem}")
            await asyncio.sleep(OWNER_RECHECK_SECS)

    async def _remote(self, owner: str, key: ExecutorKey, request: Request, deadline: float) -> Frame | None:
        """The reply through ``owner``; None if it did not pick the request up within
        :data:`PICKUP_SECS` (the request is withdrawn, so it cannot act on it later)."""
        loop = asyncio.get_running_loop()
        pickup_by = loop.time() + PICKUP_SECS
        timeout = max(deadline - loop.time(), 0.001)
        rpc_id = await self._post(owner, key, request, timeout)
        check_claimer_at = loop.time() + self.claimer_check_secs
        woken: asyncio.Future[None] = loop.create_future()
        self._replies[rpc_id] = woken
        taken = picked = False
        try:
            while True:
                answer = await self._take_answer(rpc_id)
                if answer is not None:
                    taken = True
                    return self._reply_of(key, owner, answer)
                if not picked and loop.time() >= pickup_by:
                    if await self._withdraw(rpc_id):
                        taken = True
                        log.warning("instance %s did not pick up a %s for %s within %gs",
                                    owner, request.type.value, key, PICKUP_SECS)  # fmt: skip
                        return None
                    picked = True
                if loop.time() >= check_claimer_at:
                    if await self._withdraw_from_gone_claimer(rpc_id):
                        taken = True
                        raise await self._claimer_gone(key, owner, request)
                    check_claimer_at = loop.time() + self.claimer_check_secs
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise ExecutorTimeout(
                        f"executor {key} (on instance {owner}) did not answer {request.type.value} within {timeout:g}s"
                    )
                wait = min(remaining, POLL_SECS, max(check_claimer_at - loop.time(), 0.001))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(woken), wait)
                if woken.done():
                    woken = loop.create_future()
                    self._replies[rpc_id] = woken
        finally:
            self._replies.pop(rpc_id, None)
            if not taken:  # timed out or cancelled: nobody will read it
                with contextlib.suppress(DatabaseError):
                    async with self.db.connection() as conn:
                        await conn.execute("DELETE FROM relay_rpc WHERE id = %s", (rpc_id,))

    async def _post(self, owner: str, key: ExecutorKey, request: Request, timeout: float) -> int:
        """The request's row for ``owner``, and its id."""
        async with self.db.connection() as conn:
            # One statement, one round trip: the row, and the owner's wake-up when it commits.
            cur = await conn.execute(
                """WITH r AS (
                       INSERT INTO relay_rpc (target_instance, requester_instance, org, app, executor_id,
                                              request, timeout_secs, request_id)
                       VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING id)
                   SELECT id, pg_notify(%s, id::text) FROM r""",
                (owner, self.instance_id, key.org, key.app, key.executor_id, json.dumps(request.to_frame()), timeout,
                 current_request_id(), channel(owner)),
            )  # fmt: skip
            row = await cur.fetchone()
        assert row is not None
        return int(row["id"])

    async def _take_answer(self, rpc_id: int) -> dict[str, Any] | None:
        """The reply (or error) once written, deleting the row in the same statement."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """DELETE FROM relay_rpc WHERE id = %s AND answered_at IS NOT NULL
                   RETURNING reply, error_kind, error""",
                (rpc_id,),
            )
            return await cur.fetchone()

    async def _withdraw(self, rpc_id: int) -> bool:
        """Delete the request if its owner has not claimed it yet; False if it has."""
        async with self.db.connection() as conn:
            cur = await conn.execute("DELETE FROM relay_rpc WHERE id = %s AND picked_at IS NULL", (rpc_id,))
            return cur.rowcount == 1

    async def _withdraw_from_gone_claimer(self, rpc_id: int) -> bool:
        """Delete the claimed, unanswered request if the instance that claimed it is gone: its lease
        ran out (killed, or cut off from the database), or it started again since the claim (a new
        process does not know it). A reply written first keeps the row (read at the next look); one
        written after finds no row: the asker hears one answer, whichever comes first."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """DELETE FROM relay_rpc r USING relay_instances i
                   WHERE r.id = %s AND i.instance_id = r.target_instance
                     AND r.picked_at IS NOT NULL AND r.answered_at IS NULL
                     AND (i.lease_expires_at < now() OR i.started_at > r.picked_at)""",
                (rpc_id,),
            )
            return cur.rowcount == 1

    async def _claimer_gone(self, key: ExecutorKey, owner: str, request: Request) -> ExecutorRequestError:
        """The error for a request whose claimer died before answering (the executor may have had the
        frame: it is not sent again). Not connected, if the executor's row says no live instance
        holds it now; otherwise lost (:class:`RequestLost`)."""
        log.warning("instance %s, which claimed a %s for %s, is gone before answering",
                    owner, request.type.value, key)  # fmt: skip
        why = f"instance {owner}, which took the {request.type.value} for executor {key}, is gone before answering"
        if await self.executors.owner(key) is None:
            return ExecutorNotConnected(f"executor {key} is not connected to any live Relay instance ({why})")
        return RequestLost(f"{why}; the executor may have had it")

    @staticmethod
    def _reply_of(key: ExecutorKey, owner: str, answer: dict[str, Any]) -> Frame:
        if answer["error_kind"] is not None:
            cls = _ERRORS.get(str(answer["error_kind"]), ExecutorGone)
            raise cls(f"{answer['error']} (asked through instance {owner})")
        reply: Frame = json.loads(answer["reply"])
        return reply

    # -- serving -----------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._listen()), asyncio.create_task(self._poll())]

    async def stop(self) -> None:
        for task in [*self._tasks, *self._serving]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._serving, return_exceptions=True)
        self._tasks = []

    async def _listen(self) -> None:
        """LISTEN on this instance's channel; reconnects after a failure."""
        delay = 0.2
        failed = 0  # attempts failed in a row: the first is a warning, the others are not (an outage)
        while True:
            try:
                # Keepalives find a lost host under this idle connection (db.TCP_SETTINGS).
                async with await psycopg.AsyncConnection.connect(self.db.conninfo, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {self.channel}")
                    await conn.execute(f"LISTEN {BLOCKED_CHANNEL}")
                    self.db.note_answered()  # the database's return, noticed with no request made
                    delay = 0.2
                    if failed:
                        log.info("instance %s: listening on its request channel again, after %d failed %s",
                                 self.instance_id, failed, "attempt" if failed == 1 else "attempts")  # fmt: skip
                        failed = 0
                    # Whatever arrived while not listening is found by a poll right away.
                    self._spawn(self._serve_unpicked())
                    async for note in conn.notifies():
                        if note.channel == BLOCKED_CHANNEL:
                            self._on_blocked(note.payload)
                        else:
                            self._on_notify(note.payload)
            except psycopg.Error as exc:
                self.db.note_unreachable(exc)
                if not failed:
                    log.warning("instance %s: request channel lost (%s); listening again in %.1fs (tried on "
                                "quietly until it is back)", self.instance_id, exc, delay)  # fmt: skip
                else:
                    log.debug("instance %s: listening failed again (%s)", self.instance_id, exc)
                failed += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def close_remote(self, instance: str, key: ExecutorKey, epoch: int) -> None:
        """Ask ``instance`` to close its socket of ``key`` if it is the connection of ``epoch`` or older
        (the executor reconnected through this instance). Best effort: that instance's socket check
        closes it anyway."""
        note = json.dumps({"org": key.org, "app": key.app, "executor_id": key.executor_id, "epoch": epoch})
        async with self.db.connection() as conn:
            await conn.execute("SELECT pg_notify(%s, %s)", (channel(instance), CLOSE_NOTE + note))

    def _on_notify(self, payload: str) -> None:
        if payload.startswith(CLOSE_NOTE):
            self._spawn(self._close_stale(payload[len(CLOSE_NOTE) :]))
            return
        try:
            rpc_id = int(payload)
        except ValueError:
            log.warning("instance %s: ignored a notification %r", self.instance_id, payload[:80])
            return
        woken = self._replies.get(rpc_id)
        if woken is not None:
            if not woken.done():
                woken.set_result(None)
            return
        self._spawn(self._serve(rpc_id))

    def _on_blocked(self, payload: str) -> None:
        if self.on_blocked is None:
            return
        try:
            data = json.loads(payload)
            org, app = str(data["org"]), str(data["app"])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("instance %s: ignored a blocked-recovery notification: %s", self.instance_id, exc)
            return
        self._spawn(self._tell_blocked(self.on_blocked, org, app))

    async def _tell_blocked(self, on_blocked: Callable[[str, str], Awaitable[None]], org: str, app: str) -> None:
        try:
            await on_blocked(org, app)
        except DatabaseError as exc:  # the periodic look at blocked recoveries tries again
            log.warning("instance %s: waking recoveries of %s/%s failed: %s", self.instance_id, org, app, exc)
        except Exception:
            log.exception("instance %s: waking recoveries of %s/%s failed", self.instance_id, org, app)

    async def _close_stale(self, note: str) -> None:
        try:
            data = json.loads(note)
            key = ExecutorKey(str(data["org"]), str(data["app"]), str(data["executor_id"]))
            await self.hub.close_stale(key, int(data["epoch"]))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("instance %s: ignored a close notification: %s", self.instance_id, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _poll(self) -> None:
        me = f"instance {self.instance_id}"
        told = FailureLog(log, f"{me}: polling relayed requests failed", f"{me}: polling relayed requests works again")
        while True:
            await asyncio.sleep(POLL_SECS)
            try:
                await self._serve_unpicked()
                async with self.db.connection() as conn:
                    await conn.execute(
                        "DELETE FROM relay_rpc WHERE created_at < now() - make_interval(secs => %s)", (KEEP_SECS,)
                    )
                told.worked()
            except DatabaseError as exc:
                told.failed(exc)

    async def _serve_unpicked(self) -> None:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                "SELECT id FROM relay_rpc WHERE target_instance = %s AND picked_at IS NULL", (self.instance_id,)
            )
            ids = [int(r["id"]) for r in await cur.fetchall()]
        for rpc_id in ids:
            self._spawn(self._serve(rpc_id))

    async def _serve(self, rpc_id: int) -> None:
        """Claim a request addressed to this instance, send it to the executor, write back the reply.

        Once claimed, the request is answered whatever happens short of the database failing: a
        request this instance cannot read (a message type of a newer release, during a rolling
        upgrade) or any other failure is written back as an ``unserved`` error, so that the asker
        fails at once with the reason rather than waiting out its timeout for a false "did not
        answer". (The database failing, the asker times out: there is no other way to tell it.)
        """
        try:
            row = await self._claim(rpc_id)
            if row is None:
                return  # another notification or poll claimed it, or the requester withdrew it
            # The lines logged about it carry the id of the HTTP request it serves, as the asker's do.
            with serving(row["request_id"]):
                await self._serve_claimed(rpc_id, row)
        except DatabaseError as exc:
            log.warning("instance %s: relayed request %d failed: %s", self.instance_id, rpc_id, exc)
        except Exception:
            log.exception("instance %s: relayed request %d failed", self.instance_id, rpc_id)

    async def _serve_claimed(self, rpc_id: int, row: dict[str, Any]) -> None:
        key = ExecutorKey(row["org"], row["app"], row["executor_id"])
        try:
            text, kind, error = await self._answer(key, row)
        except DatabaseError:
            raise  # nothing can be written back
        except Exception as exc:
            if isinstance(exc, (WireError, ValueError, KeyError, TypeError)):  # a request it cannot read
                log.warning("instance %s: cannot serve relayed request %d: %s", self.instance_id, rpc_id, exc)
            else:
                log.exception("instance %s: relayed request %d failed", self.instance_id, rpc_id)
            text, kind = None, UNSERVED
            # Cleaned (a NUL, which PostgreSQL refuses, would leave the asker waiting after all) and bounded.
            why = f"instance {self.instance_id}, holding the socket of executor {key}, could not serve it: {exc}"
            error = clean_text(why, 2000)
        async with self.db.connection() as conn:
            await conn.execute(
                """WITH u AS (
                       UPDATE relay_rpc SET reply = %s, error_kind = %s, error = %s, answered_at = now()
                       WHERE id = %s RETURNING id)
                   SELECT pg_notify(%s, id::text) FROM u""",
                (text, kind, error, rpc_id, channel(str(row["requester_instance"]))),
            )
        log.debug("instance %s: answered request %d to %s for %s", self.instance_id, rpc_id, key,
                  row["requester_instance"])  # fmt: skip

    async def _claim(self, rpc_id: int) -> dict[str, Any] | None:
        """The request's row, claimed for this instance; None if it is not there to claim."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """UPDATE relay_rpc SET picked_at = now()
                   WHERE id = %s AND target_instance = %s AND picked_at IS NULL
                   RETURNING org, app, executor_id, request, requester_instance, timeout_secs, request_id,
                             GREATEST(timeout_secs - EXTRACT(EPOCH FROM now() - created_at), 0.001) AS left""",
                (rpc_id, self.instance_id),
            )
            return await cur.fetchone()

    async def _answer(self, key: ExecutorKey, row: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
        """Ask the executor the claimed request: (the reply's text, or an error kind and message)."""
        request = parse_request(json.loads(row["request"]))
        try:
            text = json.dumps(await self.hub.request(key, request, float(row["left"])))
        except ExecutorRequestError as exc:
            return None, _error_kind(exc), str(exc)
        self.relayed += 1
        if len(text) > self.max_reply_bytes:
            # A reply travels through the database once; beyond this, ask for less (a page).
            return None, "too_large", f"the reply of executor {key} is over {self.max_reply_bytes} bytes"
        return text, None, None
