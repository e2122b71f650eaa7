"""uvicorn's sans-I/O WebSocket protocol, opened up for Relay's liveness core.

ASGI has no message for WebSocket pings, yet Relay must ping executors and
know when it last heard from them (contract section 4). This subclass records
the loop time of every byte received and lends the connection a ``send_ping``
through the ASGI scope's ``extensions["relay.keepalive"]``. uvicorn's own
keepalive is turned off (``ws_ping_interval=None``); the hub runs it instead.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Protocol

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request
from websockets.protocol import State


class Keepalive(Protocol):
    """What the hub sees of a connection's transport."""

    last_heard: float
    shutting_down: bool  # the server is stopping: uvicorn closes every socket

    def send_ping(self) -> bool: ...

    def abort(self) -> None: ...


class RedactKeys(logging.Filter):
    """Hide the conductor key in an executor URL path (uvicorn logs request paths)."""

    _key_in_path = re.compile(r"(/websocket/[^/\s\"]+/)[^\s\"?]+")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            record.msg = record.getMessage()
            record.args = None
        record.msg = self._key_in_path.sub(r"\1***", str(record.msg))
        return True


ws_log = logging.getLogger("relay.ws")
ws_log.addFilter(RedactKeys())


class RelayWebSocketProtocol(WebSocketsSansIOProtocol):
    last_heard: float = 0.0
    shutting_down: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn logs every handshake with its path, which holds the key.
        self.logger = ws_log
        self.conn.logger = ws_log

    def data_received(self, data: bytes) -> None:
        self.last_heard = self.loop.time()
        super().data_received(data)

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"]["relay.keepalive"] = self

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            # A refusal with a body is a complete answer; uvicorn would call it unfinished.
            self.handshake_complete = True

    def shutdown(self) -> None:
        """uvicorn is stopping: it closes this socket (1012), and the instance records the
        disconnection of all its executors at once (``Runtime.stop``)."""
        self.shutting_down = True
        super().shutdown()

    def send_ping(self) -> bool:
        """Send a ping frame; False when the connection is no longer open."""
        if self.transport.is_closing() or self.conn.state is not State.OPEN:
            return False
        self.conn.send_ping(os.urandom(4))
        self.transport.write(b"".join(self.conn.data_to_send()))
        return True

    def abort(self) -> None:
        """Drop the connection at once, unsent data and all (a peer that stopped reading)."""
        self.transport.abort()


__all__ = ["Keepalive", "RelayWebSocketProtocol"]
