"""One Relay instance on one port: executors' WebSockets and the HTTP API."""

from __future__ import annotations

import logging
import signal
import socket

import uvicorn

from relay.api import build_api
from relay.config import RelayConfig
from relay.hub import Receive, Scope, Send
from relay.runtime import Runtime
from relay.wsproto import RelayWebSocketProtocol


class RelayApp:
    """The ASGI application: WebSocket scopes go to the hub, the rest to the API."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.api = build_api(runtime)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self.runtime.hub(scope, receive, send)
        else:
            await self.api(scope, receive, send)


def uvicorn_config(app: RelayApp, config: RelayConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        ws=RelayWebSocketProtocol,
        ws_max_size=config.server.max_frame_bytes,
        # The hub runs keepalive itself, through RelayWebSocketProtocol.
        ws_ping_interval=None,
        ws_ping_timeout=None,
        ws_per_message_deflate=False,
        lifespan="on",
        backlog=4096,
        timeout_graceful_shutdown=5,
        log_config=None,
        access_log=False,
        # Relay logs the peer address as the socket sees it; a proxy's X-Forwarded-For
        # would only cost a middleware layer on every handshake.
        proxy_headers=False,
        server_header=False,
    )


def public_urls(config: RelayConfig) -> tuple[str, str]:
    host = config.server.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    base = f"{host}:{config.server.port}"
    return f"ws://{base}/", f"http://{base}/"


def default_instance_id(config: RelayConfig) -> str:
    return f"{socket.gethostname()}:{config.server.port}"


class _Stopped(Exception):
    """SIGTERM, re-raised by uvicorn once it has shut down gracefully."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped


def serve(config: RelayConfig, database_url: str, instance_id: str) -> None:
    """Run until SIGINT or SIGTERM; returns after a graceful shutdown."""
    runtime = Runtime(config, database_url, instance_id)
    server = uvicorn.Server(uvicorn_config(RelayApp(runtime), config))
    logging.getLogger("relay").info("relay instance %s starting", instance_id)
    # uvicorn re-raises the signal that stopped it once it is done; turn that
    # into a return so the caller can still stop the embedded database.
    signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        server.run()
    except (KeyboardInterrupt, _Stopped):
        pass
    if not server.started:
        raise SystemExit(1)
