"""One executor's WebSocket: the handshake, its requests and replies, its liveness.

Each :class:`ExecutorConnection` runs in the socket's own ASGI task: it asks
``executor_info``, has the hub record the executor as HEALTHY, then reads
frames and drives the liveness core until the socket closes or the executor
goes quiet for ``pingWaitSecs``, and finally records the disconnection.
Replies are matched to the requests awaiting them by ``request_id``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from relay.auth import KeyGrant
from relay.core.ids import ExecutorKey, printable
from relay.core.liveness import LivenessMonitor
from relay.errors import DatabaseError, ExecutorGone, ExecutorTimeout, Fenced, ProtocolError
from relay.logs import about
from relay.net.wire import Frame, clean_frame, executor_info
from relay.net.wsproto import Keepalive
from relay.store.executors import AppGone, IdentityTaken
from relay_protocol import ExecutorInfoReply, ExecutorInfoRequest, Request, decode_frame
from relay_protocol import ProtocolError as WireError

if TYPE_CHECKING:
    from relay.net.hub import Hub

log = logging.getLogger("relay.hub")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Close codes sent after accept (4000-4999 are the application's to define).
CLOSE_BAD_HANDSHAKE = 4400
CLOSE_BAD_KEY = 4403
CLOSE_UNKNOWN_APP = 4404
CLOSE_HANDSHAKE_TIMEOUT = 4408
CLOSE_REPLACED = 4409
CLOSE_NOT_ANSWERING = 4410
CLOSE_KEY_REVOKED = 4401
CLOSE_SHUTDOWN = 1001
# This instance lost its lease: the SDK reconnects, through the load balancer, to a live instance.
CLOSE_LEASE_LOST = 1012
KEY_REVOKED_REASON = "the key of this connection was deleted or changed"


# How long closing a socket may take before the connection is dropped (a peer that stopped reading).
CLOSE_TIMEOUT_SECS = 5.0


class ExecutorConnection:
    def __init__(
        self,
        hub: Hub,
        grant: KeyGrant,
        digest: str,
        app: str,
        client: str,
        receive: Receive,
        send: Send,
        scope: Scope,
        may_register: bool = False,
    ) -> None:
        self.hub = hub
        self.grant = grant
        self.digest = digest  # the SHA-256 of its key: the hub checks that the key stays valid
        self.org = grant.org
        self.app = app
        # Whether its handshake may register the app, if missing: the hub's makes_new_app, which
        # reads the raw path as well as the name.
        self.may_register = may_register
        self.client = client
        self._receive = receive
        self._send = send
        self._keepalive: Keepalive | None = scope.get("extensions", {}).get("relay.keepalive")
        self._loop = asyncio.get_running_loop()
        self._waiting: dict[str, asyncio.Future[Frame]] = {}
        self._closed = False
        self._let_go = False  # closed because this instance lost its lease: its disconnection is not written
        self._handshaking = True  # holds one of the hub's pending_handshakes
        self.key: ExecutorKey | None = None
        self.epoch = 0
        self.attached_at: float | None = None  # loop time its record was written

    @property
    def name(self) -> str:
        """How log lines name this connection: the executor id once known."""
        return str(self.key) if self.key else printable(f"{self.org}/{self.app} from {self.client}")

    def end_handshake(self) -> None:
        """Give back the pending-handshake slot the hub took for this connection (once)."""
        if self._handshaking:
            self._handshaking = False
            self.hub.pending_handshakes -= 1

    def attached_for(self) -> float:
        return 0.0 if self.attached_at is None else self._loop.time() - self.attached_at

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
            return
        self.key = ExecutorKey(self.org, self.app, info.executor_id)
        try:
            self.epoch = await self.hub.attach(self, info)
        except IdentityTaken as exc:
            self.hub.counters["rejected_identity_taken"] += 1
            log.warning("executor %s: refused: %s", self.name, exc)
            await self.close(CLOSE_BAD_KEY, "this executor id belongs to another key")
            return
        except AppGone as exc:
            # Deleted through the API during the handshake, with autoRegisterApps off: the SDK's next
            # attempt is refused with the 404 of an unknown app.
            self.hub.counters["rejected_unknown_app"] += 1
            log.warning("executor %s: refused: %s (deleted during its handshake)", self.name, exc)
            await self.close(CLOSE_UNKNOWN_APP, "no such app: it was deleted")
            return
        except Fenced as exc:
            log.warning("executor %s: refused, this instance does not hold its lease: %s", self.name, exc)
            await self.close(1011, "relay instance not holding its lease")
            return
        except DatabaseError as exc:
            self.hub.unrecorded(self, exc)
            await self.close(1011, "relay database unavailable")
            return
        self.attached_at = self._loop.time()
        self.hub.counters["handshakes"] += 1
        log.info(
            "executor %s connected (version %s, epoch %d)",
            self.name,
            printable(info.application_version),
            self.epoch,
            extra=about(self.key),
        )
        try:
            if not self.hub.admits(self):
                # Its key was deleted or changed during the handshake, after the hub's check and
                # before the hub held the socket, where a reload of the key ring closes it: closed
                # now, it is lost like any socket whose key is revoked (its grace period starts).
                log.warning("executor %s: its key was deleted or changed during its handshake; closing", self.name)
                await self.close(CLOSE_KEY_REVOKED, KEY_REVOKED_REASON)
            await self._serve()
        finally:
            self.hub.detach(self)
            self._fail_waiting()
            await self._record_lost()

    async def request(self, request: Request, timeout: float) -> Frame:
        """Send ``request`` and return the reply's frame (read it with :func:`relay.net.wire.reply_to`)."""
        if self._closed:
            raise ExecutorGone(f"executor {self.name} is disconnected")
        future: asyncio.Future[Frame] = self._loop.create_future()
        self._waiting[request.request_id] = future
        deadline = self._loop.time() + timeout
        try:
            try:
                # A peer that stops reading fills its socket's buffer, and a send then waits
                # for room: bounded by the request's own timeout, and the socket dropped.
                async with asyncio.timeout_at(deadline):
                    await self._send({"type": "websocket.send", "text": request.to_json()})
            except TimeoutError:
                self._abort()
                what = f"executor {self.name} did not take {request.type.value} within {timeout:g}s"
                raise ExecutorTimeout(what) from None
            except OSError as exc:
                # The socket closed under the send (uvicorn's ClientDisconnected), before the hub
                # saw it go: the executor is gone, like one that disconnects while asked.
                raise ExecutorGone(f"executor {self.name} disconnected: {type(exc).__name__}") from exc
            async with asyncio.timeout_at(deadline):
                return await future
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
            async with asyncio.timeout(CLOSE_TIMEOUT_SECS):
                await self._send({"type": "websocket.close", "code": code, "reason": reason})
        except TimeoutError:
            self._abort()
        except Exception as exc:  # the socket may already be gone; closing is best effort
            log.debug("executor %s: close failed: %s", self.name, exc)

    async def let_go(self) -> None:
        """Close the socket because this instance lost its lease (:meth:`relay.net.hub.Hub.let_go`)."""
        self._let_go = True
        await self.close(CLOSE_LEASE_LOST, "relay instance lost its lease, reconnect")

    def _abort(self) -> None:
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.abort()

    # -- internals ---------------------------------------------------------

    async def _handshake(self) -> ExecutorInfoReply | None:
        timeout = self.hub.config.server.handshake_timeout_secs
        request = ExecutorInfoRequest()
        future: asyncio.Future[Frame] = self._loop.create_future()
        self._waiting[request.request_id] = future
        await self._send({"type": "websocket.send", "text": request.to_json()})
        deadline = self._loop.time() + timeout
        try:
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
        finally:
            # Answered or not, the request is over: its future, and the reply it holds, would
            # otherwise stay in _waiting for as long as the executor stays connected. Nothing
            # else waits yet (requests are sent only once the executor is attached).
            self._waiting.pop(request.request_id, None)

    async def _refuse_handshake(self, why: str) -> None:
        self.hub.counters["rejected_bad_handshake"] += 1
        log.warning("executor %s: bad executor_info reply: %s; closing", self.name, why)
        await self.close(CLOSE_BAD_HANDSHAKE, "bad executor_info reply")

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
            frame = clean_frame(text, decode_frame(text))
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
        if self._keepalive is not None and self._keepalive.shutting_down:
            # The instance is stopping: Runtime.stop marks every executor it held DISCONNECTED in
            # one statement and starts their grace periods. One write per socket here made a
            # shutdown with thousands of executors outlast uvicorn's graceful window.
            log.debug("executor %s: socket closed by the shutdown", self.name)
            return
        if self._let_go:
            # The database is out of reach, and if another instance adopts this one the executor is
            # the adopter's: nothing is written now, and no grace period starts here. If this instance
            # holds its lease again instead, its socket check records the disconnection then (unless the
            # executor has reconnected meanwhile).
            log.info("executor %s: let go, this instance lost its lease; disconnection not recorded", self.name)
            self.hub.disconnection_unrecorded()
            return
        lost_at = time.time()
        try:
            changed = await self.hub.executors.lost(self.key, self.epoch, self.hub.instance_id)
        except Fenced as exc:
            # Another instance adopted this one: the executor's row is the adopter's now.
            log.warning("executor %s: disconnection not recorded, this instance is fenced: %s", self.name, exc)
            return
        except DatabaseError as exc:
            # The row stays HEALTHY with this instance as owner, and no socket: the hub's
            # socket check records the disconnection, retried until the database answers.
            log.error("executor %s: cannot record its disconnection yet: %s", self.name, exc)
            self.hub.disconnection_unrecorded()
            return
        if changed:
            # Its grace period starts first; the line then says when it ends, which on-call wants.
            await self.hub.report_lost(self.key, self.epoch, lost_at)
            note = await self.hub.grace_note(self.key, lost_at)
            log.info("executor %s is DISCONNECTED%s", self.name, note, extra=about(self.key))
