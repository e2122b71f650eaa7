"""The hub: executors' WebSocket connections on this instance.

The hub checks each new socket's key and app, hands it to an
:class:`relay.net.connection.ExecutorConnection`, records its executor as
connected (taking the id over from an older socket, wherever that is), and
keeps the sockets and the rows it owns in step. While this instance does not
hold its lease, it holds no executor: it refuses handshakes and closes the
sockets it has (:meth:`Hub.let_go`).

:meth:`Hub.request` sends a request frame to an executor connected here and
awaits the reply with the same ``request_id``; replies are matched by the
connection's reading loop. The rest of Relay asks through
:class:`relay.net.router.Router`, wherever the executor's socket is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import string
import time
from collections import Counter
from typing import Protocol

from relay.auth import KeyRing, Permission, hash_key
from relay.config import RelayConfig
from relay.core.ids import APP_NAME_RULE, MAX_APP_NAME, ExecutorKey, printable, valid_app_name
from relay.core.lifecycle import ExecutorEvent, ExecutorState
from relay.core.requestid import HEADER_BYTES, request_id_of_scope, shared_task
from relay.core.times import utc_seconds
from relay.core.window import CountedWindow
from relay.errors import DatabaseError, ExecutorNotConnected
from relay.logs import FailureLog
from relay.net.connection import (
    CLOSE_KEY_REVOKED,
    CLOSE_REPLACED,
    CLOSE_SHUTDOWN,
    KEY_REVOKED_REASON,
    ExecutorConnection,
    Receive,
    Scope,
    Send,
)
from relay.net.wire import Frame
from relay.store.apps import AppSettings, AppStore
from relay.store.executors import ExecutorStore, Handshake
from relay.store.lease import Lease
from relay_protocol import ExecutorInfoReply, Request

log = logging.getLogger("relay.hub")
# How long an app's executorTimeoutSecs read for the "is DISCONNECTED" line is used again.
GRACE_NOTE_SECS = 1.0
# A connecting executor is checked against the languages of its app's healthy executors in a read
# of them begun up to this long before: a reconnect storm of thousands reads them once in this time,
# not once each; short, so that an executor that connected just before is in it.
LANGUAGES_READ_SECS = 1.0

WEBSOCKET_PREFIXES = ("/websocket/", "/conductor/v1alpha1/websocket/")


# A record in one of these states when its executor connects again: that death's recovery is over.
DEATH_STATES = frozenset({ExecutorState.DEAD, ExecutorState.RECOVERING})


class HubEvents(Protocol):
    """What the durable layer wants to hear from the hub (grace periods, wake-ups)."""

    async def executor_connected(
        self, key: ExecutorKey, epoch: int, grace_epoch: int | None, dead_epoch: int | None = None
    ) -> None:
        """``grace_epoch``: the epoch of the disconnection this connection ends, when the record was
        DISCONNECTED (its grace period waits for word of the reconnect); None otherwise (a new executor,
        one taken over from another socket, or one already DEAD, whose grace period is over).
        ``dead_epoch``: the epoch of the death it ends, when the record was DEAD or RECOVERING (its
        recovery is over)."""
        ...

    async def executor_lost(self, key: ExecutorKey, epoch: int, lost_at: float) -> None: ...


class Elsewhere(Protocol):
    """Closing a socket that another instance holds (:class:`relay.net.router.Router`)."""

    async def close_remote(self, instance: str, key: ExecutorKey, epoch: int) -> None: ...


def parse_websocket_path(path: str) -> tuple[str, str] | None:
    """``(app, key)`` from an executor URL path, or None if it is not one.

    A missing key comes back as ``""`` so that it is refused as a bad key.
    """
    for prefix in WEBSOCKET_PREFIXES:
        if path.startswith(prefix):
            parts = path[len(prefix) :].split("/")
            if len(parts) == 1:
                parts.append("")
            if len(parts) != 2 or not parts[0]:
                return None
            return parts[0], parts[1]
    return None


def carried_app_name(app: str) -> bool:
    """Whether ``app`` is a name worth looking up: one of 1 to 256 printable characters, as every
    app an older Relay made over a socket or through the API has. The stricter rule for a new app
    (:func:`valid_app_name`) does not apply to an app that exists: one an older Relay made under a
    name it breaks keeps its executors."""
    return 0 < len(app) <= MAX_APP_NAME and app.isprintable()


# RFC 3986's unreserved characters (letters, digits, "-._~"), which no client escapes in a URL.
_UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")


def named_as_sent(scope: Scope) -> bool:
    """Whether the app's name in the socket's path is the one its executor gave. The DBOS SDKs put
    the name in their URL as it is, and the server decodes the path: an executor of ``100%41``
    reaches Relay as ``100A``. Its raw path still has ``%41``, an escape of a character no client
    escapes; an escape of another (``%20``, ``%C3%A9``) is how a client sends that character (the
    SDK's own for a name with non-ASCII characters, relay_client's for any), and the decoded name
    is the one it gave. A name sent with such an escape makes no new app (nor does one with ``%``,
    by the rule); an app of the decoded name that exists is joined, as before."""
    raw = bytes(scope.get("raw_path") or scope["path"].encode()).split(b"?", 1)[0]
    route = parse_websocket_path(raw.decode("latin-1"))
    return route is not None and not any(chr(int(h, 16)) in _UNRESERVED for h in _ESCAPE.findall(route[0]))


def makes_new_app(app: str, scope: Scope) -> bool:
    """Whether a socket to ``app`` may register it, if it is missing (and apps register themselves)."""
    return valid_app_name(app) and named_as_sent(scope)


# The kinds of relay_hub_events_total, each exported from the start (0 until it happens), so that an
# alert on its increase sees the first one: sockets refused before the handshake (rejected_*, by
# reason), handshakes recorded and refused after executor_info, silent sockets closed, frames ignored,
# sockets let go when the lease was lost. README's metrics table lists them.
HUB_EVENT_KINDS = (
    "handshakes",
    "rejected_not_found",
    "rejected_bad_app",
    "rejected_bad_key",
    "rejected_not_ready",
    "rejected_busy",
    "rejected_key_sockets",
    "rejected_unknown_app",
    "rejected_bad_handshake",
    "rejected_handshake_timeout",
    "rejected_identity_taken",
    "disconnected_silent",
    "frames_binary",
    "frames_malformed",
    "frames_unexpected",
    "let_go_lease_lost",
)
# A socket check leaves alone what changed in the last moments: a handshake being recorded.
SETTLED_SECS = 2.0
# A refused handshake is logged once a minute per reason, host and app: an executor with a deleted
# key tries again every second for as long as it runs.
REFUSAL_LOG_EVERY_SECS = 60.0
REFUSAL_LOG_KEYS = 10_000


class RefusalLog:
    """When to log a refused handshake: the first of each (reason, host, app), then once per
    ``every`` seconds with the number refused in between (the metrics count every one)."""

    def __init__(self, every: float = REFUSAL_LOG_EVERY_SECS) -> None:
        self._window: CountedWindow[tuple[str, str, str]] = CountedWindow(1, every, REFUSAL_LOG_KEYS)

    def due(self, reason: str, host: str, app: str) -> int | None:
        """None: not now; else how many were refused since the last line (0 for the first)."""
        passed = self._window.admit((reason, host, app), time.monotonic())
        return None if passed is None else passed.held


def _since(count: int) -> str:
    return f" ({count} more refused since the last such line)" if count else ""


class Hub:
    def __init__(
        self,
        config: RelayConfig,
        keyring: KeyRing,
        apps: AppStore,
        executors: ExecutorStore,
        instance_id: str,
        events: HubEvents,
        lease: Lease,
    ) -> None:
        self.config = config
        self.keyring = keyring
        self.apps = apps
        self.executors = executors
        self.instance_id = instance_id
        self.events = events
        self.lease = lease
        self.elsewhere: Elsewhere | None = None  # set by the composition root (the router)
        self.connections: dict[ExecutorKey, ExecutorConnection] = {}
        self.pending_handshakes = 0
        self.sockets_by_key: Counter[str] = Counter()
        self.counters: Counter[str] = Counter(dict.fromkeys(HUB_EVENT_KINDS, 0))
        self._checker: asyncio.Task[None] | None = None
        self._lease_watch: asyncio.Task[None] | None = None
        # Set when a disconnection could not be recorded (the database is out): the socket check
        # then runs every pingIntervalSecs until it gets through, not every socketCheckSecs.
        self._unrecorded = asyncio.Event()
        self._refusals = RefusalLog()
        # The apps' executorTimeoutSecs for the "is DISCONNECTED" line (grace_note): when each was read
        # (the loop's clock) and its value, and the reads under way.
        self._grace_secs: dict[tuple[str, str], tuple[float, float]] = {}
        self._grace_reads: dict[tuple[str, str], asyncio.Task[AppSettings | None]] = {}
        self._language_checks: set[asyncio.Task[None]] = set()  # held until done (the loop keeps weak ones)
        # Per app, the languages of its healthy executors: when the read began (the loop's clock) and
        # the read. A storm of handshakes to an app of thousands shares one read and one set of its
        # languages a second, where each handshake would otherwise go through every executor's.
        self._languages: dict[tuple[str, str], tuple[float, asyncio.Task[frozenset[str]]]] = {}

    # -- ASGI entry point -------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = _client(scope)
        host = client.rsplit(":", 1)[0]
        route = parse_websocket_path(scope["path"])
        if route is None:
            self.counters["rejected_not_found"] += 1
            await _deny(scope, send, 404, "not_found", "no executor endpoint at this path")
            return
        app, key = route
        # The key first: a caller without a valid key for this app learns nothing of its name, not
        # even whether it is one an app may have. The name is checked after the key and the slots.
        # The digest is kept by the connection: the key ring may be reloaded during the handshake,
        # and the socket is admitted only if its key is still valid once the executor is recorded.
        digest = hash_key(key)
        grant = self.keyring.grant_of_digest(digest) if key else None
        if grant is None or not grant.allows(Permission.WEBSOCKET_CONNECT, app):
            self.counters["rejected_bad_key"] += 1
            shown = printable(app)  # bounded: the name is not checked yet, and it keys the log's window
            if (since := self._refusals.due("bad_key", host, shown)) is not None:
                log.warning("refused executor connection from %s for app %s: bad or missing conductor key%s",
                            client, shown, _since(since))  # fmt: skip
            await _deny(scope, send, 403, "bad_key", "unknown or missing conductor key, or not for this app")
            return
        if not self.lease.held:
            # Cut off from the database or paused past its lease: the handshake's fenced write would
            # fail, and another instance may be adopting this one. The SDK tries again, through the
            # load balancer, which has taken this instance out (its /readyz fails the same way).
            self.counters["rejected_not_ready"] += 1
            await _deny(scope, send, 503, "not_ready", "this relay instance is not ready, retry later")
            return
        if self.pending_handshakes >= self.config.server.max_pending_handshakes:
            self.counters["rejected_busy"] += 1
            if (since := self._refusals.due("busy", host, "")) is not None:
                log.warning("refused executor connection from %s: %d handshakes already pending%s",
                            client, self.pending_handshakes, _since(since))  # fmt: skip
            await _deny(scope, send, 503, "busy", "too many pending handshakes, retry later")
            return
        if self.sockets_by_key[grant.key_id] >= self.config.server.max_sockets_per_key:
            self.counters["rejected_key_sockets"] += 1
            if (since := self._refusals.due("key_sockets", host, grant.key_id)) is not None:
                held = self.sockets_by_key[grant.key_id]
                log.warning("refused executor connection from %s: key %s already holds %d sockets%s",
                            client, printable(grant.name), held, _since(since))  # fmt: skip
            await _deny(scope, send, 429, "too_many_sockets", "this key holds too many sockets, retry later")
            return
        new = makes_new_app(app, scope)
        if not await self._app_allowed(grant.org, app, new):
            if not new:
                self.counters["rejected_bad_app"] += 1
                await _deny(scope, send, 400, "bad_app", f"no such app, and {APP_NAME_RULE}")
                return
            self.counters["rejected_unknown_app"] += 1
            await _deny(scope, send, 404, "unknown_app", "no such app, and apps are not registered automatically")
            return
        conn = ExecutorConnection(self, grant, digest, app, client, receive, send, scope, may_register=new)
        # The slots are taken here, before any await, so that simultaneous handshakes cannot
        # all pass the checks; the connection gives the handshake's back once past executor_info.
        self.pending_handshakes += 1
        self.sockets_by_key[grant.key_id] += 1
        try:
            await conn.run()
        except asyncio.CancelledError:
            # uvicorn cancels the handlers that outlast its graceful shutdown: sockets that closed
            # just before it, their disconnections still being written behind a busy database.
            # Ending normally spares a logged traceback per socket; what the handler left undone
            # is done by others: Runtime.stop marks DISCONNECTED every executor this instance
            # still holds, and the repair sweep starts the grace period a DISCONNECTED one lacks.
            log.debug("executor connection from %s: handler cancelled by the shutdown", client)
            if conn.key is not None:
                self.disconnection_unrecorded()
        finally:
            conn.end_handshake()
            self.sockets_by_key[grant.key_id] -= 1
            if self.sockets_by_key[grant.key_id] <= 0:
                del self.sockets_by_key[grant.key_id]

    async def _app_allowed(self, org: str, app: str, new: bool) -> bool:
        """Whether executors may connect to ``app``: any app of a name a new app may have (``new``,
        :func:`makes_new_app`) when apps register themselves; else only one registered now, asked of
        the database at every handshake (one lookup by primary key), so that an app deleted through
        the API, on any instance, is refused at once on all of them. An app an older Relay made under
        a name the rule refuses keeps its executors, and such a name makes no new app."""
        if self.config.auto_register_apps and new:
            return True
        return carried_app_name(app) and await self.apps.exists(org, app)

    # -- used by the connections ------------------------------------------

    def unrecorded(self, conn: ExecutorConnection, exc: DatabaseError) -> None:
        """Log that a handshake could not be recorded (the database away): once a minute per app,
        with how many since. While the lease holds, every executor that reconnects meets it, each
        second, for as long as the outage lasts."""
        if (since := self._refusals.due("database", "", f"{conn.org}/{conn.app}")) is not None:
            log.error("executor %s: cannot record its connection: %s%s", conn.name, exc, _since(since))

    async def attach(self, conn: ExecutorConnection, info: ExecutorInfoReply) -> int:
        """Record the executor as connected here; returns the epoch.

        A newer socket of the same executor takes over: the older one is closed,
        here or on the instance that holds it.
        """
        key = ExecutorKey(conn.org, conn.app, info.executor_id)
        # An app missing (never seen, or deleted since) is registered in the transaction that records
        # the executor, if apps register themselves and its name is one a new app may have; else
        # AppGone refuses the handshake.
        register = self.config.auto_register_apps and conn.may_register
        handshake = Handshake(key, info, self.instance_id, conn.grant.key_id, register, conn.client)
        result = await self.executors.connected(handshake)
        previous = self.connections.get(key)
        self.connections[key] = conn
        if previous is not None and previous is not conn:
            log.info("executor %s connected again; closing its older socket", key)
            await previous.close(CLOSE_REPLACED, "replaced by a newer connection")
        elsewhere = result.previous_instance
        if result.previous_state is ExecutorState.HEALTHY and elsewhere not in (None, self.instance_id):
            assert elsewhere is not None and result.previous_epoch is not None
            await self._close_elsewhere(elsewhere, key, result.previous_epoch)
        # (The previous state is read in the upsert's snapshot: a disconnection committed in the
        # instant before the row is locked is missed, and its grace period waits its time out, then
        # finds the executor reconnected, as the epoch guard on declaring it dead does.)
        ended = result.previous_epoch if result.previous_state is ExecutorState.DISCONNECTED else None
        dead = result.previous_epoch if result.previous_state in DEATH_STATES else None
        await self.events.executor_connected(key, result.epoch, ended, dead)
        if info.language:  # not awaited: the handshake is not held up for it
            check = asyncio.get_running_loop().create_task(self._warn_if_languages_mix(key, info.language))
            self._language_checks.add(check)
            check.add_done_callback(self._language_checks.discard)
        return result.epoch

    async def _warn_if_languages_mix(self, key: ExecutorKey, language: str) -> None:
        """Log a WARNING if the app has healthy executors of another language than ``language``, the
        connecting executor's: neither SDK runs the other's workflows, and both take workflows from
        DBOS's one internal queue, so such an app loses work whatever Relay does (README). Once a
        minute per app at most, with how many connections since: a reconnect storm warns once."""
        try:
            languages = await self._languages_of(key.org, key.app)
        except DatabaseError as exc:
            log.debug("executor %s: the languages of its app's executors cannot be read now: %s", key, exc)
            return
        others = sorted(languages - {language})
        if not others:
            return
        if (since := self._refusals.due("languages", "", f"{key.org}/{key.app}")) is None:
            return
        more = f" ({since} more such connections since the last such line)" if since else ""
        log.warning(
            "app %s of org %s mixes languages: executor %s runs the %s SDK, and healthy executors of the app run %s. "
            "Neither SDK runs the other's workflows, and both take workflows from DBOS's one internal queue: "
            "recovered, forked or resumed work may be taken by an executor that cannot run it and stay PENDING. "
            "Relay recovers a dead executor only onto peers of its language. Run an app's executors in one "
            "language (README, \"Executors on the TypeScript SDK\")%s",
            key.app, key.org, printable(key.executor_id), printable(language, 40),
            ", ".join(printable(o, 40) for o in others), more,
        )  # fmt: skip

    async def _languages_of(self, org: str, app: str) -> frozenset[str]:
        """The languages of the app's healthy executors, from a read begun up to
        :data:`LANGUAGES_READ_SECS` before (or one under way), shared by every caller meanwhile."""
        loop = asyncio.get_running_loop()
        held = self._languages.get((org, app))
        if held is None or loop.time() - held[0] > LANGUAGES_READ_SECS:
            read = shared_task(self.executors.healthy_languages(org, app))
            held = (loop.time(), read)
            self._languages[(org, app)] = held

            def forget_failed(task: asyncio.Task[frozenset[str]]) -> None:
                if (task.cancelled() or task.exception() is not None) and self._languages.get((org, app)) == held:
                    del self._languages[(org, app)]

            read.add_done_callback(forget_failed)
        return await asyncio.shield(held[1])

    async def _close_elsewhere(self, instance: str, key: ExecutorKey, epoch: int) -> None:
        if self.elsewhere is None:
            return
        try:
            await self.elsewhere.close_remote(instance, key, epoch)
        except DatabaseError as exc:  # that instance's socket check closes it anyway
            log.warning("executor %s: could not ask instance %s to close its older socket: %s", key, instance, exc)

    async def grace_note(self, key: ExecutorKey, lost_at: float) -> str:
        """What the "is DISCONNECTED" line adds: when the executor is declared DEAD unless it
        reconnects, ``lost_at`` plus the app's ``executorTimeoutSecs``, as its grace period counts it
        (workflows.grace); "" when the setting cannot be read now (the line is not held up for it).
        The setting is read once per app per :data:`GRACE_NOTE_SECS`, by whichever disconnection
        comes first: a thousand sockets of an app closing at once cost one read, not a thousand."""
        app = (key.org, key.app)
        cached = self._grace_secs.get(app)
        loop = asyncio.get_running_loop()
        if cached is None or loop.time() - cached[0] > GRACE_NOTE_SECS:
            reading = self._grace_reads.get(app)
            if reading is None:
                reading = loop.create_task(self.apps.settings_of(*app))
                self._grace_reads[app] = reading
                reading.add_done_callback(lambda _: self._grace_reads.pop(app, None))
            try:
                settings = await asyncio.shield(reading)
            except DatabaseError:
                return ""
            if settings is None:
                return ""
            cached = (loop.time(), settings.executor_timeout_secs)
            self._grace_secs[app] = cached
        secs = cached[1]
        at = utc_seconds(lost_at + secs)
        shown = f"{secs:.3f}".rstrip("0").rstrip(".")  # 60, 0.5, 1209600: the setting, not 1.2096e+06
        return f": declared DEAD at {at} unless it reconnects (grace period {shown} s)"

    async def report_lost(self, key: ExecutorKey, epoch: int, lost_at: float) -> None:
        """The executor's disconnection is recorded: its grace period starts, counted from
        ``lost_at`` (``time.time()`` when the socket was found gone)."""
        await self.events.executor_lost(key, epoch, lost_at)

    def detach(self, conn: ExecutorConnection) -> None:
        if conn.key is not None and self.connections.get(conn.key) is conn:
            del self.connections[conn.key]

    # -- used by the rest of Relay ------------------------------------------

    async def request(self, key: ExecutorKey, request: Request, timeout: float) -> Frame:
        """Send ``request`` to an executor connected to this instance and await its reply.

        The rest of Relay goes through :class:`relay.net.router.Router`, which finds
        the instance holding the executor's socket.
        """
        conn = self.connections.get(key)
        if conn is None:
            raise ExecutorNotConnected(f"executor {key} has no socket on this Relay instance")
        return await conn.request(request, timeout)

    async def close_all(self) -> None:
        await asyncio.gather(
            *(c.close(CLOSE_SHUTDOWN, "relay shutting down") for c in list(self.connections.values())),
            return_exceptions=True,
        )

    def admits(self, conn: ExecutorConnection) -> bool:
        """Whether the key ring still lets ``conn``'s key connect to its app: the same key (its secret
        and its id) with ``websocket.connect``, on that app."""
        grant = self.keyring.grant_of_digest(conn.digest)
        return (
            grant is not None
            and grant.key_id == conn.grant.key_id
            and grant.org == conn.org
            and grant.allows(Permission.WEBSOCKET_CONNECT, conn.app)
        )

    async def close_unadmitted(self) -> int:
        """Close every socket here that the key ring, just reloaded, no longer admits (its key deleted,
        its secret rotated, or its permissions or apps narrowed); returns how many. A socket still in
        its handshake is checked once its executor is recorded (:meth:`ExecutorConnection.run`)."""
        doomed = [c for c in self.connections.values() if not self.admits(c)]
        for conn in doomed:
            log.info("executor %s: its key was deleted or changed; closing its socket", conn.name)
        await asyncio.gather(*(c.close(CLOSE_KEY_REVOKED, KEY_REVOKED_REASON) for c in doomed))
        if doomed:
            keys = Counter(printable(c.grant.name) for c in doomed)
            log.warning(
                "closed %d executor sockets whose key was deleted, rotated or narrowed (%s)",
                len(doomed),
                ", ".join(f"{name}: {n}" for name, n in sorted(keys.items())),
            )
        return len(doomed)

    async def close_stale(self, key: ExecutorKey, epoch: int) -> bool:
        """Another instance took the executor over: close the socket here if it is that older connection."""
        conn = self.connections.get(key)
        if conn is None or conn.epoch > epoch:
            return False
        log.info("executor %s connected through another instance; closing its socket here", key)
        await conn.close(CLOSE_REPLACED, "replaced by a newer connection")
        return True

    # -- keeping sockets and rows in step ------------------------------------------

    def start(self) -> None:
        self._checker = asyncio.create_task(self._check_forever())
        self._lease_watch = asyncio.create_task(self._watch_lease())

    async def stop(self) -> None:
        tasks = [t for t in (self._checker, self._lease_watch) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._checker = self._lease_watch = None

    async def _watch_lease(self) -> None:
        """Let the executors go whenever the lease is not held (:meth:`let_go`): at the moment it
        runs out, and again every renewal period while it stays out (a handshake that was recorded
        just before it ran out may still join)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                left = self.lease.held_until() - loop.time()
                if left > 0:
                    await asyncio.sleep(left)  # a renewal meanwhile moves the end on: looked at again then
                    continue
                if self.connections:
                    await self.let_go()
            except asyncio.CancelledError:
                raise
            except Exception:  # never die: an instance that stopped watching would hold executors again
                log.exception("instance %s: watching the lease failed; watching on", self.instance_id)
            await asyncio.sleep(self.lease.renew_every)

    async def let_go(self) -> int:
        """Close every socket here, this instance no longer holding its lease; returns how many.

        It has had no renewal confirmed for a whole lease (a network cut from the database, a
        pause): another instance may adopt it from now on, and would declare its executors DEAD
        at the end of their grace period, recovering their work while they still run it over
        their sockets here. Closed with 1012 (service restart), the SDK reconnects through the
        load balancer to a live instance, and that connection ends the adopter's grace period.
        Their disconnections are not written (:meth:`ExecutorConnection._record_lost`): the
        database is out of reach, and the executors are the adopter's if it adopts. A lease
        renewed in time instead finds its rows without sockets at the socket check, which
        records them lost then. A database blip shorter than the lease closes nothing.
        """
        doomed = list(self.connections.values())
        if not doomed:
            return 0
        self.counters["let_go_lease_lost"] += len(doomed)
        log.warning("instance %s: its lease is not held (no renewal confirmed for %g s); closing its %d "
                    "executor sockets so that they reconnect to a live instance",
                    self.instance_id, self.lease.lease_secs, len(doomed))  # fmt: skip
        await asyncio.gather(*(c.let_go() for c in doomed))
        return len(doomed)

    def disconnection_unrecorded(self) -> None:
        """A socket closed and its disconnection failed to record: the executor's row stays HEALTHY
        until a socket check records it. That check comes within pingIntervalSecs, and again until
        the database answers, so that the executor is not HEALTHY much longer than pingWaitSecs after
        the database returns, whatever socketCheckSecs is."""
        self._unrecorded.set()

    async def _check_forever(self) -> None:
        liveness = self.config.liveness
        me = f"instance {self.instance_id}"
        told = FailureLog(log, f"{me}: socket check failed", f"{me}: the socket check works again")
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._unrecorded.wait(), liveness.socket_check_secs)
            retrying = self._unrecorded.is_set()
            if retrying:
                await asyncio.sleep(liveness.ping_interval_secs)  # not at once: the database may still be out
            self._unrecorded.clear()  # a disconnection lost during the check sets it again
            try:
                await self.check_sockets()
                told.worked()
            except DatabaseError as exc:
                if retrying:
                    self._unrecorded.set()
                told.failed(exc)

    async def check_sockets(self) -> tuple[int, int]:
        """Compare this instance's sockets with the rows it owns.

        A HEALTHY row with no socket here (its disconnection was lost to a
        database error) is recorded as lost, and its grace period starts; a
        socket whose row moved on (another connection took the executor over,
        perhaps through another instance) is closed. Returns (recorded, closed).
        """
        owned = await self.executors.healthy_of_instance(self.instance_id, SETTLED_SECS)
        recorded = closed = 0
        for key, epoch in owned.items():
            conn = self.connections.get(key)
            if conn is not None and conn.epoch == epoch:
                continue
            if await self.executors.apply(key, ExecutorEvent.LOST, epoch=epoch, instance=self.instance_id):
                log.warning("executor %s: no socket here; its disconnection is recorded now", key)
                recorded += 1
                await self.report_lost(key, epoch, time.time())
        for key, conn in list(self.connections.items()):
            if conn.attached_for() > SETTLED_SECS and owned.get(key) != conn.epoch:
                if await self.executors.owns(key, conn.epoch, self.instance_id):
                    continue  # connected within the last moments of the query: fine
                closed += 1
                await conn.close(CLOSE_REPLACED, "replaced by a newer connection")
        return recorded, closed


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown"


async def _deny(scope: Scope, send: Send, status: int, code: str, message: str) -> None:
    """Refuse a WebSocket handshake with an HTTP status and a JSON reason."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    if "websocket.http.response" in scope.get("extensions", {}):
        # Its request id, as every HTTP answer has (relay.net.server): the client's if sane.
        request_id = request_id_of_scope(scope)
        await send(
            {
                "type": "websocket.http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (HEADER_BYTES, request_id.encode()),
                ],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 4000 + status, "reason": message})
