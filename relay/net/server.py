"""One Relay instance on one port: executors' WebSockets and the HTTP API, served by uvicorn."""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable

import uvicorn

from relay.config import RelayConfig
from relay.core.requestid import HEADER_BYTES, request_id_of_scope, serving
from relay.net.connection import Message, Receive, Scope, Send
from relay.net.httpproto import RelayHttpProtocol
from relay.net.wsproto import RelayWebSocketProtocol
from relay.problem import internal_error

Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("relay.http")

# The message that begins an answer with headers (a refused WebSocket handshake's: relay.net.hub).
_ANSWER_STARTS = ("http.response.start",)


class RelayApp:
    """The ASGI application: WebSocket scopes go to the hub, the rest to the API.

    Every HTTP request is served with its request id (:mod:`relay.core.requestid`) in force, from
    here, before the guard's refusals (a 401, a 413, a 503), and answered with it in its
    ``X-Request-Id`` header. A WebSocket scope goes to the hub as it came: its refusal's answer
    gets an id where it is made (relay.net.hub), and an accepted executor connection is not served
    under one: it lasts for hours, and the lines about the executor are no longer about its
    handshake (nor are the recoveries its disconnection starts).

    An exception out of the HTTP app is a defect of Relay's: it is logged here, once, at ERROR with
    the request's method, path, id and traceback, and answered 500 with a problem (the API's own
    last resort answers the same, relay.api). It goes no further: uvicorn would log it again,
    without the id, and close the connection after an answer that was whole."""

    def __init__(self, websockets: Asgi, http: Asgi) -> None:
        self.websockets = websockets
        self.http = http

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # Its refusal's answer gets the id where it is made (relay.net.hub's _deny): a wrapper here
            # would stay on every frame of an accepted executor's socket, and in its memory, for hours.
            await self.websockets(scope, receive, send)
            return
        if scope["type"] != "http":  # the lifespan
            await self.http(scope, receive, send)
            return
        request_id = request_id_of_scope(scope)
        answered = (HEADER_BYTES, request_id.encode())

        status: int | None = None  # of the answer, once begun
        whole = False  # the answer's body has ended

        async def with_request_id(message: Message) -> None:
            nonlocal status, whole
            if message["type"] in _ANSWER_STARTS:
                headers = [header for header in message.get("headers", []) if header[0].lower() != HEADER_BYTES]
                message = {**message, "headers": [*headers, answered]}
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                whole = True
            await send(message)

        with serving(request_id):
            try:
                await self.http(scope, receive, with_request_id)
            except Exception:
                if status is None:
                    outcome = "answered 500"
                elif whole:
                    outcome = f"answered {status}"
                else:
                    # uvicorn closes the connection (and says so): the client sees the answer cut short.
                    outcome = f"its answer ({status}) cut short"
                log.exception("%s %s: an internal error, %s", scope["method"], scope["path"], outcome)
                if status is None:
                    await internal_error()(scope, receive, with_request_id)


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
