"""The hub: executors' WebSocket connections.

One :class:`ExecutorConnection` per socket runs in the socket's own ASGI task:
it checks the key, asks ``executor_info``, records the executor as HEALTHY,
then reads frames and drives the liveness core until the socket closes or the
executor goes quiet for ``pingWaitSecs``, and finally records DISCONNECTED.

:meth:`Hub.request` sends a request frame to an executor connected here and
awaits the reply with the same ``request_id``; replies are matched by the
connection's reading loop. The rest of Relay asks through
:class:`relay.net.router.Router`, wherever the executor's socket is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from relay.auth import KeyRing, Permission
from relay.config import RelayConfig
from relay.core.ids import ExecutorKey
from relay.core.lifecycle import ExecutorEvent
from relay.core.liveness import LivenessMonitor
from relay.errors import (
    DatabaseError,
    ExecutorGone,
    ExecutorNotConnected,
    ExecutorTimeout,
    Fenced,
    ProtocolError,
)
from relay.net.wire import Frame, executor_info
from relay.net.wsproto import Keepalive
from relay.store.apps import AppStore
from relay.store.executors import ExecutorStore
from relay_protocol import ExecutorInfoReply, ExecutorInfoRequest, Request, decode_frame
from relay_protocol import ProtocolError as WireError

log = logging.getLogger("relay.hub")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

WEBSOCKET_PREFIXES = ("/websocket/", "/conductor/v1alpha1/websocket/")

# Close codes sent after accept (4000-4999 are the application's to define).
CLOSE_BAD_KEY = 4403
CLOSE_HANDSHAKE_TIMEOUT = 4408
CLOSE_BAD_HANDSHAKE = 4400
CLOSE_REPLACED = 4409
CLOSE_NOT_ANSWERING = 4410
CLOSE_SHUTDOWN = 1001


class HubEvents(Protocol):
    """What the durable layer wants to hear from the hub (grace periods, wake-ups)."""

    async def executor_connected(self, key: ExecutorKey, epoch: int, previous_epoch: int | None) -> None: ...

    async def executor_lost(self, key: ExecutorKey, epoch: int) -> None: ...


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


class Hub:
    def __init__(
        self,
        config: RelayConfig,
        keyring: KeyRing,
        apps: AppStore,
        executors: ExecutorStore,
        instance_id: str,
        events: HubEvents,
    ) -> None:
        self.config = config
        self.keyring = keyring
        self.apps = apps
        self.executors = executors
        self.instance_id = instance_id
        self.events = events
        self.connections: dict[ExecutorKey, ExecutorConnection] = {}
        self.pending_handshakes = 0
        self.counters: Counter[str] = Counter()
        self._known_apps: set[tuple[str, str]] = set()

    # -- ASGI entry point -------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = _client(scope)
        route = parse_websocket_path(scope["path"])
        if route is None:
            self.counters["rejected_not_found"] += 1
            await _deny(scope, send, 404, "not_found", f"no executor endpoint at {scope['path']}")
            return
        app, key = route
        grant = self.keyring.lookup(key)
        if grant is None or not grant.allows(Permission.WEBSOCKET_CONNECT, app):
            self.counters["rejected_bad_key"] += 1
            log.warning("refused executor connection from %s for app %r: bad or missing conductor key", client, app)
            await _deny(scope, send, 403, "bad_key", "unknown or missing conductor key")
            return
        if self.pending_handshakes >= self.config.server.max_pending_handshakes:
            self.counters["rejected_busy"] += 1
            log.warning(
                "refused executor connection from %s: %d handshakes already pending", client, self.pending_handshakes
            )
            await _deny(scope, send, 503, "busy", "too many pending handshakes, retry later")
            return
        conn = ExecutorConnection(self, grant.org, app, client, receive, send, scope)
        # The slot is taken here, before any await, so that simultaneous handshakes cannot
        # all pass the check; the connection gives it back once past executor_info.
        self.pending_handshakes += 1
        try:
            await conn.run()
        finally:
            conn.end_handshake()

    # -- used by the connections ------------------------------------------

    async def attach(self, conn: ExecutorConnection, info: ExecutorInfoReply) -> int:
        """Record the executor as connected here; returns the epoch."""
        if (conn.org, conn.app) not in self._known_apps:
            await self.apps.ensure(conn.org, conn.app)
            self._known_apps.add((conn.org, conn.app))
        epoch, previous_epoch = await self.executors.connected(conn.org, conn.app, info, self.instance_id)
        key = ExecutorKey(conn.org, conn.app, info.executor_id)
        previous = self.connections.get(key)
        self.connections[key] = conn
        if previous is not None and previous is not conn:
            log.info("executor %s connected again; closing its older socket", key)
            await previous.close(CLOSE_REPLACED, "replaced by a newer connection")
        await self.events.executor_connected(key, epoch, previous_epoch)
        return epoch

    async def report_lost(self, key: ExecutorKey, epoch: int) -> None:
        """The executor's disconnection is recorded: its grace period starts."""
        await self.events.executor_lost(key, epoch)

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


class ExecutorConnection:
    def __init__(self, hub: Hub, org: str, app: str, client: str, receive: Receive, send: Send, scope: Scope) -> None:
        self.hub = hub
        self.org = org
        self.app = app
        self.client = client
        self._receive = receive
        self._send = send
        self._keepalive: Keepalive | None = scope.get("extensions", {}).get("relay.keepalive")
        self._loop = asyncio.get_running_loop()
        self._waiting: dict[str, asyncio.Future[Frame]] = {}
        self._closed = False
        self._handshaking = True  # holds one of the hub's pending_handshakes
        self.key: ExecutorKey | None = None
        self.epoch = 0

    @property
    def name(self) -> str:
        """How log lines name this connection: the executor id once known."""
        return str(self.key) if self.key else f"{self.org}/{self.app} from {self.client}"

    async def run(self) -> None:
        first = await self._receive()
        if first["type"] != "websocket.connect":
            return
        await self._send({"type": "websocket.accept"})
        try:
            info = await self._handshake()
        finally:
            self.end_handshake()
        if info is None:
            self._fail_waiting()
            return
        self.key = ExecutorKey(self.org, self.app, info.executor_id)
        try:
            self.epoch = await self.hub.attach(self, info)
        except Fenced as exc:
            log.warning("executor %s: refused, this instance does not hold its lease: %s", self.name, exc)
            await self.close(1011, "relay instance not holding its lease")
            return
        except DatabaseError as exc:
            log.error("executor %s: cannot record its connection: %s", self.name, exc)
            await self.close(1011, "relay database unavailable")
            return
        self.hub.counters["handshakes"] += 1
        log.info("executor %s connected (version %s, epoch %d)", self.name, info.application_version, self.epoch)
        try:
            await self._serve()
        finally:
            self.hub.detach(self)
            self._fail_waiting()
            await self._record_lost()

    def end_handshake(self) -> None:
        """Give back the pending-handshake slot taken for this connection (once)."""
        if self._handshaking:
            self._handshaking = False
            self.hub.pending_handshakes -= 1

    async def request(self, request: Request, timeout: float) -> Frame:
        """Send ``request`` and return the reply's frame (read it with :func:`relay.net.wire.reply_to`)."""
        if self._closed:
            raise ExecutorGone(f"executor {self.name} is disconnected")
        future: asyncio.Future[Frame] = self._loop.create_future()
        self._waiting[request.request_id] = future
        try:
            await self._send({"type": "websocket.send", "text": request.to_json()})
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise ExecutorTimeout(
                f"executor {self.name} did not answer {request.type.value} within {timeout:g}s"
            ) from None
        finally:
            self._waiting.pop(request.request_id, None)

    async def close(self, code: int, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._send({"type": "websocket.close", "code": code, "reason": reason})
        except Exception as exc:  # the socket may already be gone; closing is best effort
            log.debug("executor %s: close failed: %s", self.name, exc)

    # -- internals ---------------------------------------------------------

    async def _handshake(self) -> ExecutorInfoReply | None:
        timeout = self.hub.config.server.handshake_timeout_secs
        request = ExecutorInfoRequest()
        future: asyncio.Future[Frame] = self._loop.create_future()
        self._waiting[request.request_id] = future
        await self._send({"type": "websocket.send", "text": request.to_json()})
        deadline = self._loop.time() + timeout
        while not future.done():
            message = await self._next_message(deadline)
            if message is None:
                self.hub.counters["rejected_handshake_timeout"] += 1
                log.warning("executor %s: no executor_info reply within %gs; closing", self.name, timeout)
                await self.close(CLOSE_HANDSHAKE_TIMEOUT, "no executor_info reply")
                return None
            if message["type"] == "websocket.disconnect":
                log.info("executor %s: closed before the handshake ended", self.name)
                self._closed = True
                return None
            if not self._dispatch(message):
                # Nothing but the executor_info reply is expected yet: a frame that is not
                # even a reply ends the handshake at once rather than at its timeout.
                await self._refuse_handshake("its first frame is not a reply")
                return None
        try:
            return executor_info(future.result(), request.request_id)
        except ProtocolError as exc:
            await self._refuse_handshake(str(exc))
            return None

    async def _refuse_handshake(self, why: str) -> None:
        self.hub.counters["rejected_bad_handshake"] += 1
        log.warning("executor %s: bad executor_info reply: %s; closing", self.name, why)
        await self.close(CLOSE_BAD_HANDSHAKE, "bad executor_info reply")
        self._fail_waiting()

    async def _serve(self) -> None:
        liveness = self.hub.config.liveness
        monitor = LivenessMonitor(liveness.ping_interval_secs, liveness.ping_wait_secs, self._loop.time())
        while not self._closed:
            if self._keepalive is not None:
                monitor.heard(self._keepalive.last_heard)
            decision = monitor.poll(self._loop.time())
            if decision.disconnect:
                self.hub.counters["disconnected_silent"] += 1
                log.warning("executor %s: nothing heard for %gs; disconnecting", self.name, liveness.ping_wait_secs)
                await self.close(CLOSE_NOT_ANSWERING, "no pong within pingWaitSecs")
                return
            if decision.send_ping and self._keepalive is not None:
                self._keepalive.send_ping()
            message = await self._next_message(decision.wake_at)
            if message is None:
                continue
            if message["type"] == "websocket.disconnect":
                self._closed = True
                code = message.get("code")
                if code == 1009:
                    log.warning(
                        "executor %s: frame over %d bytes; connection closed",
                        self.name,
                        self.hub.config.server.max_frame_bytes,
                    )
                else:
                    log.info("executor %s: socket closed (code %s)", self.name, code)
                return
            self._dispatch(message)

    async def _next_message(self, deadline: float) -> Message | None:
        """The next ASGI message, or None once the loop clock reaches ``deadline``."""
        try:
            async with asyncio.timeout_at(deadline):
                return await self._receive()
        except TimeoutError:
            return None

    def _dispatch(self, message: Message) -> bool:
        """Hand a reply to the request awaiting it; False for a frame that is not a reply at all."""
        if message["type"] != "websocket.receive":
            return True
        text = message.get("text")
        if text is None:
            self.hub.counters["frames_binary"] += 1
            log.warning("executor %s: ignored a binary frame (%d bytes)", self.name, len(message.get("bytes") or b""))
            return False
        try:
            frame = decode_frame(text)
        except WireError as exc:
            self.hub.counters["frames_malformed"] += 1
            log.warning("executor %s: ignored a malformed frame: %s", self.name, exc)
            return False
        future = self._waiting.get(frame["request_id"])
        if future is None or future.done():
            self.hub.counters["frames_unexpected"] += 1
            log.warning(
                "executor %s: ignored a %s reply with unknown request_id %s",
                self.name,
                json.dumps(frame["type"])[:80],
                json.dumps(frame["request_id"])[:80],
            )
            return True
        future.set_result(frame)
        return True

    def _fail_waiting(self) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ExecutorGone(f"executor {self.name} disconnected"))
        self._waiting.clear()

    async def _record_lost(self) -> None:
        assert self.key is not None
        try:
            changed = await self.hub.executors.apply(
                self.key, ExecutorEvent.LOST, epoch=self.epoch, instance=self.hub.instance_id
            )
        except Fenced as exc:
            # Another instance adopted this one: the executor's row is the adopter's now.
            log.warning("executor %s: disconnection not recorded, this instance is fenced: %s", self.name, exc)
            return
        except DatabaseError as exc:
            # The row stays HEALTHY with this instance as owner; the next start of
            # this instance (or its adopter) marks it DISCONNECTED.
            log.error("executor %s: cannot record its disconnection: %s", self.name, exc)
            return
        if changed:
            log.info("executor %s is DISCONNECTED", self.name)
            await self.hub.report_lost(self.key, self.epoch)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown"


async def _deny(scope: Scope, send: Send, status: int, code: str, message: str) -> None:
    """Refuse a WebSocket handshake with an HTTP status and a JSON reason."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    if "websocket.http.response" in scope.get("extensions", {}):
        await send(
            {
                "type": "websocket.http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 4000 + status, "reason": message})
