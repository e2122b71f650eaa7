"""The REST API (contract section 7): JSON, camelCase, bearer API keys.

One module per resource; :func:`build_api` puts them together. Errors always
have the shape ``{"error": {"code": "...", "message": "..."}}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relay import __version__
from relay.api import (
    alerts,
    apps,
    audit,
    events,
    executors,
    metrics,
    ops,
    org,
    queues,
    recoveries,
    schedules,
    tokens,
    versions,
    workflows,
)
from relay.api.common import ApiError, error_response
from relay.api.context import ApiContext
from relay.api.document import PROBLEMS, finish
from relay.api.refusals import RefusalAudit, was_audited
from relay.core.outage import RefusalRun
from relay.errors import (
    Conflict,
    DatabaseError,
    ExecutorRequestError,
    Forbidden,
    NoHealthyExecutor,
    NotFound,
    RequestNotServed,
    StreamsExhausted,
    TooManyRequests,
    UnsendableRequest,
    UnsupportedMessage,
)
from relay.problem import internal_error
from relay.store.audit import requested_from
from relay.store.db import hastily

log = logging.getLogger("relay.http")

# Seconds a client is asked to wait after a 503 database_unavailable.
DATABASE_RETRY_AFTER = "2"

Lifespan = Callable[[Any], AbstractAsyncContextManager[None]]


def build_api(ctx: ApiContext | None, lifespan: Lifespan | None = None) -> FastAPI:
    """The HTTP API; ``ctx`` is what its handlers reach (None only to read the route table)."""
    # FastAPI's /docs and /redoc load scripts from a CDN: /docs is Relay's own (relay.api.ops), and no /redoc.
    api = FastAPI(title="Relay", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    api.state.context = ctx
    modules = (
        ops,
        org,
        events,
        apps,
        executors,
        recoveries,
        audit,
        tokens,
        workflows,
        queues,
        schedules,
        versions,
        metrics,
        alerts,
    )
    for module in modules:
        api.include_router(module.router, responses=PROBLEMS)
    api.include_router(org.caller_router, responses=PROBLEMS)
    api.include_router(audit.v1alpha1_router, responses=PROBLEMS)
    generate = api.openapi

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            api.openapi_schema = finish(generate())
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]  # FastAPI's way to amend its document
    refusals = api.state.refusals = RefusalAudit()

    def refused(
        request: Request, exc: Exception, status: int, code: str, message: str, locations: Sequence[str] = ()
    ) -> Response:
        """The answer to a refusal (403, 422), audited first if it is one of an audited change. A 422
        has ``errors``, as the validation's own do (conductor-api.md: "Validation failures add an
        `errors` array locating each individual problem"): one per location given, else one for the
        whole request."""
        if not was_audited(exc):
            refusals.refused(request, status, code, message)
        if status != 422:
            return error_response(status, code, message)
        errors = [{"location": where, "message": message} for where in locations or ("request",)]
        return error_response(status, code, message, errors=errors)

    outage = RefusalRun()  # the run of 503 database_unavailable answers under way, if any

    def answered() -> int:
        return ctx.db.answered if ctx is not None else 0

    def served() -> None:
        ended = outage.serve(time.monotonic(), answered())
        if ended is not None:
            log.info(
                "requests are served again: %d answered 503 database_unavailable in %.1f s (the first logged)",
                ended.refused,
                ended.secs,
            )

    api.add_middleware(ServedWatch, served=served)
    api.add_middleware(SourceAddress)
    api.add_middleware(HeadAsGet, api=api)

    @api.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return refused(request, exc, exc.status, exc.code, exc.message, exc.locations)

    @api.exception_handler(NoHealthyExecutor)
    async def _no_executor(_: Request, exc: NoHealthyExecutor) -> Response:
        return error_response(503, "no_healthy_executor", str(exc))

    @api.exception_handler(UnsupportedMessage)
    async def _unsupported(_: Request, exc: UnsupportedMessage) -> Response:
        return error_response(501, "not_supported_by_executor", str(exc))

    @api.exception_handler(RequestNotServed)
    async def _not_served(_: Request, exc: RequestNotServed) -> Response:
        # Not "no executor answered" nor "gone": the instance holding the socket failed, the executor is
        # still connected (not asked; or, RequestLost, asked by an instance that died before answering).
        return error_response(502, "request_not_served", str(exc))

    @api.exception_handler(ExecutorRequestError)
    async def _no_answer(_: Request, exc: ExecutorRequestError) -> Response:
        return error_response(502, "no_executor_answered", str(exc))

    @api.exception_handler(UnsendableRequest)
    async def _unsendable(request: Request, exc: UnsendableRequest) -> Response:
        return refused(request, exc, 422, "invalid_request", str(exc))

    @api.exception_handler(TooManyRequests)
    async def _too_many(_: Request, exc: TooManyRequests) -> Response:
        return error_response(429, "too_many_requests", str(exc), headers={"Retry-After": "1"})

    @api.exception_handler(StreamsExhausted)
    async def _streams(_: Request, exc: StreamsExhausted) -> Response:
        return error_response(503, "too_many_streams", str(exc), headers={"Retry-After": "5"})

    @api.exception_handler(Forbidden)
    async def _forbidden(request: Request, exc: Forbidden) -> Response:
        return refused(request, exc, 403, "forbidden", str(exc))

    @api.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound) -> Response:
        return error_response(404, "not_found", str(exc))

    @api.exception_handler(Conflict)
    async def _conflict(_: Request, exc: Conflict) -> Response:
        return error_response(409, exc.code, str(exc))

    @api.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = [{"location": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in exc.errors()]
        detail = "; ".join(f"{e['location']}: {e['message']}" for e in errors)
        refusals.refused(request, 422, "invalid_request", detail)
        return error_response(422, "invalid_request", detail, errors=errors)

    @api.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # RFC 9110: with the methods the resource has, from every route of its path
            headers["Allow"] = ", ".join(allowed_methods(api, request.scope))
        return error_response(exc.status_code, "http_error", str(exc.detail), headers=headers or None)

    @api.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        # Starlette's last resort (ServerErrorMiddleware), which answered text/plain "Internal Server
        # Error": it sends this answer and raises the exception again, for RelayApp
        # (relay.net.server) to log, once, with the request's method, path and id.
        return internal_error()

    @api.exception_handler(DatabaseError)
    async def _db(request: Request, exc: DatabaseError) -> Response:
        cause = exc.__cause__
        if isinstance(cause, psycopg.DataError):
            # PostgreSQL (or psycopg) refused a value of the request: out of range, not valid for its
            # type. The client's to correct, the same at every try: not an outage. Only the primary
            # message, which names the problem; the rest of the text can quote the statement.
            reason = cause.diag.message_primary or (str(cause).splitlines() or ["not valid"])[0]
            return refused(request, exc, 422, "invalid_request", f"a value of the request was refused: {reason}")
        # The database's own words (a host and port, a constraint, a table) are for the operator,
        # in the log; the caller learns which kind of trouble it is and that it may try again.
        # One warning for a run of them (an outage answers every request so), the rest counted
        # until a request is served again (relay.core.outage): a line then says how many.
        now = time.monotonic()
        started = float(request.scope.get("state", {}).get(STARTED, now))
        if (unseen := outage.ended_unseen(started, ctx.db.recovered_at if ctx is not None else None)) is not None:
            log.info(
                "Relay's database answered again after %d requests answered 503 database_unavailable in %.1f s"
                " (no request was served since)",
                unseen.refused,
                unseen.secs,
            )
        if outage.refuse(now, answered()):
            log.warning(
                "%s %s: answered 503 database_unavailable: %s (the next ones are counted, not logged,"
                " until a request is served again)",
                request.method,
                request.url.path,
                exc,
            )
        else:
            log.debug("%s %s: answered 503 database_unavailable: %s", request.method, request.url.path, exc)
        unreachable = not isinstance(cause, psycopg.Error) or isinstance(cause, psycopg.OperationalError)
        detail = "Relay's database is unreachable" if unreachable else "a statement of Relay's database failed"
        # The pool tries to reconnect about once a second (relay.store.db): a retry soon may succeed.
        return error_response(
            503,
            "database_unavailable",
            f"{detail}; the instance's log says why",
            headers={"Retry-After": DATABASE_RETRY_AFTER},
        )

    return api


# Where ServedWatch notes when a request began (time.monotonic()), in the scope's state.
STARTED = "relay_started"


class ServedWatch:
    """Calls ``served`` at each HTTP response other than a 503, which may end a run of refusals, and
    notes when each request began (:data:`STARTED`). Each request is served :func:`hastily`: while
    the database is known unreachable, it is answered 503 at once, not after the pool's 10 s."""

    def __init__(self, app: ASGIApp, served: Callable[[], None]) -> None:
        self.app = app
        self.served = served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        scope.setdefault("state", {})[STARTED] = time.monotonic()

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] != 503:
                self.served()
            await send(message)

        with hastily():
            await self.app(scope, receive, watched)


class SourceAddress:
    """The audit entries a request's key makes record the address it came from (Conductor's
    ``sourceIp``): the client's, as uvicorn gives it. Relay reads no ``X-Forwarded-For``
    (``proxy_headers`` is off, relay.net.server): behind a proxy, it is the proxy's address."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        with requested_from(client[0] if client else None):
            await self.app(scope, receive, send)


METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(api: FastAPI, scope: Scope) -> list[str]:
    """The methods some route of ``api`` serves at the scope's path (several routes may share one);
    HEAD wherever GET is (:class:`HeadAsGet`)."""
    served = {method for method in METHODS if _routed(api, scope, method)}
    if "GET" in served:
        served.add("HEAD")
    return [method for method in METHODS if method in served]


def _routed(api: FastAPI, scope: Scope, method: str) -> bool:
    return any(route.matches({**scope, "method": method})[0] is Match.FULL for route in api.router.routes)


class HeadAsGet:
    """HEAD answered as GET, without the body, wherever GET is served and no route has HEAD of its own.

    RFC 9110 (9.3.2): a server that answers GET answers HEAD the same, headers and status, without
    the content. Load balancers and uptime monitors check with HEAD (HAProxy's ``option httpchk
    HEAD /readyz``). Starlette's routes add HEAD to every GET; FastAPI's do not (fastapi#1773), and
    ``methods=["GET", "HEAD"]`` on a route would put a second operation, under the GET's operationId,
    in the API's document. Routed as the GET, the request passes the GET's dependencies: its key is
    checked as the GET's is. The body is dropped here, not only by uvicorn, and the response ends at
    its first part: a HEAD of the event stream, whose body never ends, is answered at once, and the
    stream sees its reader gone (``http.disconnect``) and closes.
    """

    def __init__(self, app: ASGIApp, api: FastAPI) -> None:
        self.app = app
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD" or _routed(self.api, scope, "HEAD"):
            await self.app(scope, receive, send)
            return
        if not _routed(self.api, scope, "GET"):
            await self.app(scope, receive, send)  # a 404, or a 405 naming the methods there are
            return
        ended = False

        async def headers_only(message: Message) -> None:
            nonlocal ended
            if ended:
                return
            if message["type"] == "http.response.body":
                ended = True
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        async def until_ended() -> Message:
            if ended:
                return {"type": "http.disconnect"}
            return await receive()

        await self.app({**scope, "method": "GET"}, until_ended, headers_only)


__all__ = ["ApiContext", "AsyncIterator", "build_api"]
