"""One Relay instance on one port: executors' WebSockets and the HTTP API, served by uvicorn."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import uvicorn

from relay.config import RelayConfig
from relay.net.connection import Receive, Scope, Send
from relay.net.httpproto import RelayHttpProtocol
from relay.net.wsproto import RelayWebSocketProtocol

Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


class RelayApp:
    """The ASGI application: WebSocket scopes go to the hub, the rest to the API."""

    def __init__(self, websockets: Asgi, http: Asgi) -> None:
        self.websockets = websockets
        self.http = http

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self.websockets(scope, receive, send)
        else:
            await self.http(scope, receive, send)


def uvicorn_config(app: RelayApp, config: RelayConfig) -> uvicorn.Config:
    class HttpProtocol(RelayHttpProtocol):
        header_timeout_secs = config.server.header_timeout_secs
        stream_stall_secs = 3 * config.server.event_heartbeat_secs + 2

    return uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        # httptools, as uvicorn would pick by itself, with a deadline for request headers.
        http=HttpProtocol,
        ws=RelayWebSocketProtocol,
        ws_max_size=config.server.max_frame_bytes,
        # The hub runs keepalive itself, through RelayWebSocketProtocol.
        ws_ping_interval=None,
        ws_ping_timeout=None,
        ws_per_message_deflate=False,
        lifespan="on",
        backlog=4096,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=config.server.keep_alive_secs,
        log_config=None,
        access_log=False,
        # Relay logs the peer address as the socket sees it; a proxy's X-Forwarded-For
        # would only cost a middleware layer on every handshake.
        proxy_headers=False,
        server_header=False,
    )


def public_urls(config: RelayConfig) -> tuple[str, str]:
    """The executors' and the console's URLs, as `relay serve` prints them (`relay init` writes the same)."""
    host = config.server.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    if ":" in host:
        # An IPv6 address in a URL is bracketed (RFC 3986), its zone's % escaped (RFC 6874):
        # ws://::1:8080/ is read by no client as host ::1 and port 8080.
        host = f"[{host.replace('%', '%25')}]"
    base = f"{host}:{config.server.port}"
    return f"ws://{base}/", f"http://{base}/"


def default_instance_id(config: RelayConfig) -> str:
    return f"{socket.gethostname()}:{config.server.port}"
