"""uvicorn's sans-I/O WebSocket protocol, opened up for Relay's liveness core.

ASGI has no message for WebSocket pings, yet Relay must ping executors and
know when it last heard from them (contract section 4). This subclass records
the loop time of every byte received and lends the connection a ``send_ping``
through the ASGI scope's ``extensions["relay.keepalive"]``. uvicorn's own
keepalive is turned off (``ws_ping_interval=None``); the hub runs it instead.
"""

from __future__ import annotations

import os
from typing import Protocol

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request
from websockets.protocol import State


class Keepalive(Protocol):
    """What the hub sees of a connection's transport."""

    last_heard: float

    def send_ping(self) -> bool: ...


class RelayWebSocketProtocol(WebSocketsSansIOProtocol):
    last_heard: float = 0.0

    def data_received(self, data: bytes) -> None:
        self.last_heard = self.loop.time()
        super().data_received(data)

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"]["relay.keepalive"] = self

    def send_ping(self) -> bool:
        """Send a ping frame; False when the connection is no longer open."""
        if self.transport.is_closing() or self.conn.state is not State.OPEN:
            return False
        self.conn.send_ping(os.urandom(4))
        self.transport.write(b"".join(self.conn.data_to_send()))
        return True


__all__ = ["Keepalive", "RelayWebSocketProtocol"]
