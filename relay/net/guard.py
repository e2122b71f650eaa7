"""What an HTTP request may cost Relay before a route sees it.

An ASGI middleware in front of the API (:mod:`relay.runtime` puts it there;
WebSocket scopes go to the hub and never reach it). FastAPI reads and parses a
request's body before its dependencies check the key, so without this anybody
could make Relay parse 64 MiB of JSON to be told 401. For every HTTP request,
in this order, each refusal sent at once and without reading the body:

1. under ``/v2/`` (and ``/conductor/v2/``), a bearer key that names no key at
   all: 401. Which permission the key needs stays the route's business
   (:mod:`relay.api.common`).
2. a ``Content-Length`` over the route's body limit: 413. A body without one
   (chunked) is counted as it is read; once past the limit it is read no
   further and answered 413.
3. a body not complete ``server.bodyTimeoutSecs`` after the headers: 408, the
   connection closed (a request slot is not held by a client that never sends it).
4. ``server.maxConcurrentRequests`` requests already in progress: 503 with
   ``Retry-After``. The probes (``/healthz``, ``/readyz``) are not counted, so
   that a load balancer still sees an overloaded instance alive, nor the
   console's event streams (``/v2/orgs/{org}/events``), which last as long as
   a console is open and have caps of their own (:mod:`relay.domain.events`).

Every response gets ``X-Content-Type-Options: nosniff`` and
``Referrer-Policy: no-referrer``. Refusals are problem details (RFC 9457).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import Response

from relay.auth import KeyGrant, unauthorized
from relay.config import ServerConfig
from relay.net.connection import Message, Receive, Scope, Send
from relay.net.httpproto import EVENT_STREAM
from relay.net.server import Asgi
from relay.problem import problem

log = logging.getLogger("relay.http")

Lookup = Callable[[str], KeyGrant | None]

API_PREFIXES = ("/v2/", "/conductor/v2/")
# Under the API's prefix, yet open: the API's document, where managed Conductor serves it.
OPEN_PATHS = frozenset({"/v2/openapi.json", "/conductor/v2/openapi.json"})
PROBES = frozenset({"/healthz", "/readyz"})
SECURITY_HEADERS = ((b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"))


@dataclass(frozen=True)
class BodyLimit:
    """Requests to ``pattern`` may have bodies up to ``max_bytes``.

    ``*`` stands for one path segment, and a pattern covers the paths under it
    too: ``/v2/orgs/*/apps/*/workflows/import``. Written without ``/conductor``;
    the same path under that prefix matches as well.
    """

    pattern: str
    max_bytes: int

    def matches(self, path: str) -> bool:
        wanted = self.pattern.strip("/").split("/")
        parts = path.strip("/").split("/")
        if len(parts) < len(wanted):
            return False
        return all(w == p or (w == "*" and p != "") for w, p in zip(wanted, parts, strict=False))


# Routes whose bodies may exceed server.maxRequestBodyBytes (a workflow import, say).
BODY_LIMITS: tuple[BodyLimit, ...] = ()


def body_limit(path: str, default: int, table: tuple[BodyLimit, ...] = BODY_LIMITS) -> int:
    """The body limit of the route at ``path``: that of its most specific pattern, else ``default``."""
    if path.startswith("/conductor/"):
        path = path.removeprefix("/conductor")
    matching = [entry for entry in table if entry.matches(path)]
    if not matching:
        return default
    return max(matching, key=lambda entry: len(entry.pattern.strip("/").split("/"))).max_bytes


def bearer_key(authorization: str) -> str:
    """The key of an ``Authorization: Bearer <key>`` header; ``""`` for any other header."""
    scheme, _, key = authorization.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def is_api(path: str) -> bool:
    return path.startswith(API_PREFIXES) or path in ("/v2", "/conductor/v2")


class HttpGuard:
    """The ASGI middleware; ``lookup`` is called per request, since keys change at run time."""

    def __init__(
        self, app: Asgi, server: ServerConfig, lookup: Lookup, body_limits: tuple[BodyLimit, ...] = BODY_LIMITS
    ) -> None:
        self.app = app
        self.lookup = lookup
        self.max_body_bytes = server.max_request_body_bytes
        self.max_in_progress = server.max_concurrent_requests
        self.body_timeout_secs = server.body_timeout_secs
        self.body_limits = body_limits
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the lifespan
            await self.app(scope, receive, send)
            return
        send = with_security_headers(send)
        path: str = scope["path"]
        headers = _Headers(scope)
        limit = body_limit(path, self.max_body_bytes, self.body_limits)
        refusal = self._refusal(path, headers, limit)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        exchange = _Exchange(scope, receive, send, limit, self.body_timeout_secs if headers.has_body else None)
        if path in PROBES or EVENT_STREAM.match(path):
            await exchange.run(self.app)
            return
        if self.in_progress >= self.max_in_progress:
            log.debug("refused %s %s: %d requests in progress", scope["method"], path, self.in_progress)
            busy = problem(503, "too many requests in progress; retry later", headers={"retry-after": "1"})
            await _closing(busy, headers)(scope, receive, send)
            return
        self.in_progress += 1  # counted before any await: simultaneous requests cannot all pass the check
        try:
            await exchange.run(self.app)
        finally:
            self.in_progress -= 1

    def _refusal(self, path: str, headers: _Headers, limit: int) -> Response | None:
        """The answer to a request refused on its headers alone, or None to let it through."""
        key = bearer_key(headers.get(b"authorization"))
        if is_api(path) and path not in OPEN_PATHS and self.lookup(key) is None:
            response = problem(401, unauthorized(key), headers={"www-authenticate": "Bearer"})
            return _closing(response, headers)
        length = headers.get(b"content-length")
        if length:
            if not length.isdigit():
                return _closing(problem(400, "Content-Length is not a number"), headers)
            if int(length) > limit:
                return _closing(too_large(limit), headers)
        return None


def too_large(limit: int) -> Response:
    return problem(413, f"the request body is larger than this route accepts ({limit} bytes)", maxBytes=limit)


def with_security_headers(send: Send) -> Send:
    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            present = {name.lower() for name, _ in headers}
            headers.extend(header for header in SECURITY_HEADERS if header[0] not in present)
            message = {**message, "headers": headers}
        await send(message)

    return send_with_headers


class _Headers:
    def __init__(self, scope: Scope) -> None:
        self._headers: list[tuple[bytes, bytes]] = scope["headers"]

    def get(self, name: bytes) -> str:
        for key, value in self._headers:
            if key == name:
                return value.decode("latin-1")
        return ""

    @property
    def has_body(self) -> bool:
        return self.get(b"content-length") not in ("", "0") or bool(self.get(b"transfer-encoding"))


def _closing(response: Response, headers: _Headers) -> Response:
    """``response``, closing the connection after it if the request has a body nobody will read.

    Otherwise uvicorn would keep the connection and read the whole body only to drop it.
    """
    if headers.has_body:
        response.headers["connection"] = "close"
    return response


class _Exchange:
    """One request's ``receive`` and ``send`` as the app sees them: the body counted against its limit."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, limit: int, body_timeout: float | None) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.limit = limit
        self.received = 0
        self.over_limit = False
        self.response_started = False
        self.answered = False  # the guard sent 413 or 408 in the app's place
        # Until the body's last part comes, each read waits only as long as the body has left.
        self.body_timeout = body_timeout
        self.body_deadline = None if body_timeout is None else asyncio.get_running_loop().time() + body_timeout

    async def run(self, app: Asgi) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except Exception:
            if not self.answered:
                raise
            # The app was told the client left; whatever it made of that, the answer was sent.
            log.debug("after a 413 for %s, the app raised", self.scope["path"], exc_info=True)

    async def receive(self) -> Message:
        if self.over_limit:
            return {"type": "http.disconnect"}
        if self.body_deadline is None:
            message = await self._receive()
        else:
            try:
                async with asyncio.timeout(max(0.0, self.body_deadline - asyncio.get_running_loop().time())):
                    message = await self._receive()
            except TimeoutError:
                return await self._body_too_slow()
        if message["type"] == "http.request":
            if not message.get("more_body", False):
                self.body_deadline = None  # the whole body is in: later reads wait for a disconnect
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.over_limit = True
                if not self.response_started:
                    self.answered = True
                    response = too_large(self.limit)
                    response.headers["connection"] = "close"
                    await response(self.scope, self._receive, self._send)
                return {"type": "http.disconnect"}
        return message

    async def _body_too_slow(self) -> Message:
        self.over_limit = True  # read no further
        log.debug("%s %s: no whole body within %gs", self.scope["method"], self.scope["path"], self.body_timeout)
        if not self.response_started:
            self.answered = True
            response = problem(408, f"the request body was not complete within {self.body_timeout:g}s")
            response.headers["connection"] = "close"
            await response(self.scope, self._receive, self._send)
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)
