"""What every route shares: the context, authentication, errors and time formats."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar
from urllib.parse import unquote

from fastapi import Depends, Query, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from starlette.routing import Match
from starlette.types import Scope

from relay.api.context import ApiContext
from relay.api.refusals import mark_audited
from relay.auth import KeyGrant, Permission, unauthorized
from relay.errors import UnsendableRequest
from relay.net.guard import bearer_key
from relay.problem import problem as problem  # RFC 9457 problem details, for the routes
from relay.store.audit import AuditAction, AuditEntry
from relay_protocol import (
    MAX_APP_DEFINED_NAME_BYTES,
    MAX_NAME_LEN,
    MAX_QUEUE_OR_SCHEDULE_NAME_BYTES,
    MAX_WORKFLOW_ID_BYTES,
    Reply,
    clean_text,
)
from relay_protocol.limits import has_unstorable, utf8_length

# Every list is paged: ``limit`` (default and maximum here) and ``offset``.
DEFAULT_PAGE = 100
MAX_PAGE = 1000
# An offset is a PostgreSQL bigint, in Relay's database and in the executors'; the document bounds
# it (and other large integers) at the largest integer every JSON client reads exactly.
MAX_SAFE_INTEGER = 2**53 - 1
MAX_OFFSET = MAX_SAFE_INTEGER
INT32_MAX = 2**31 - 1

# A name the protocol carries to an executor (a version, an executor id...): at most
# MAX_NAME_LEN characters, and no NUL, which PostgreSQL cannot store.
NO_NUL = r"^[^\x00]*$"


def storable(text: str) -> str:
    """``text``, if PostgreSQL can store it: no NUL (the document's pattern says so) and no lone
    surrogate (which JSON's ``\\udc00`` can make, and no pattern can say)."""
    if has_unstorable(text):
        raise ValueError("contains NUL or a lone surrogate, which PostgreSQL cannot store")
    return text


Name = Annotated[str, Field(max_length=MAX_NAME_LEN, pattern=NO_NUL), AfterValidator(storable)]
NonEmptyName = Annotated[Name, Field(min_length=1)]
# The same in a query string.
QueryName = Annotated[str, Query(max_length=MAX_NAME_LEN, pattern=NO_NUL), AfterValidator(storable)]


def bytes_bound(what: str, bound: int) -> AfterValidator:
    """A check that a text is within ``bound`` bytes of UTF-8, the protocol's bound on ``what``."""

    def sized(text: str) -> str:
        size = utf8_length(text)
        if size > bound:
            raise ValueError(f"{what} is at most {bound} bytes in UTF-8; this one is {size}")
        return text

    return AfterValidator(sized)


# A workflow id: DBOS bounds none, and its store is bounded in bytes (relay_protocol.limits), so the
# id is too, not at MAX_NAME_LEN. The document's maxLength, in characters, is the bytes' bound:
# no longer id can fit (a JSON schema cannot count bytes; the description says it).
WorkflowId = Annotated[
    str,
    Field(
        max_length=MAX_WORKFLOW_ID_BYTES,
        pattern=NO_NUL,
        description=f"A workflow id: at most {MAX_WORKFLOW_ID_BYTES} bytes in UTF-8.",
    ),
    AfterValidator(storable),
    bytes_bound("a workflow id", MAX_WORKFLOW_ID_BYTES),
]
NonEmptyWorkflowId = Annotated[WorkflowId, Field(min_length=1)]
# The same in a query string (an audit entry's target may be a workflow id).
QueryWorkflowId = Annotated[
    str,
    Query(max_length=MAX_WORKFLOW_ID_BYTES, pattern=NO_NUL),
    AfterValidator(storable),
    bytes_bound("a workflow id", MAX_WORKFLOW_ID_BYTES),
]
# A queue's or a schedule's name: bounded in bytes as a workflow id is, and for the same reasons
# (relay_protocol.limits.MAX_QUEUE_OR_SCHEDULE_NAME_BYTES).
QueueOrScheduleName = Annotated[
    str,
    Field(
        max_length=MAX_QUEUE_OR_SCHEDULE_NAME_BYTES,
        pattern=NO_NUL,
        description=f"A queue's or a schedule's name: at most {MAX_QUEUE_OR_SCHEDULE_NAME_BYTES} bytes in UTF-8.",
    ),
    AfterValidator(storable),
    bytes_bound("a queue's or a schedule's name", MAX_QUEUE_OR_SCHEDULE_NAME_BYTES),
]
# The same in a query string (a schedule's name's prefix).
QueryQueueOrScheduleName = Annotated[
    str,
    Query(
        max_length=MAX_QUEUE_OR_SCHEDULE_NAME_BYTES,
        pattern=NO_NUL,
        description=f"At most {MAX_QUEUE_OR_SCHEDULE_NAME_BYTES} bytes in UTF-8.",
    ),
    AfterValidator(storable),
    bytes_bound("a queue's or a schedule's name", MAX_QUEUE_OR_SCHEDULE_NAME_BYTES),
]
# A workflow's or a step's name, a user, a partition key: names an app gives, which DBOS stores as
# given, bounded in bytes as a workflow id is (relay_protocol.limits.MAX_APP_DEFINED_NAME_BYTES).
AppDefinedName = Annotated[
    str,
    Field(
        max_length=MAX_APP_DEFINED_NAME_BYTES,
        pattern=NO_NUL,
        description=f"A name the app gives: at most {MAX_APP_DEFINED_NAME_BYTES} bytes in UTF-8.",
    ),
    AfterValidator(storable),
    bytes_bound("a name the app gives", MAX_APP_DEFINED_NAME_BYTES),
]
# The same in a query string (a workflow's name).
QueryAppDefinedName = Annotated[
    str,
    Query(
        max_length=MAX_APP_DEFINED_NAME_BYTES,
        pattern=NO_NUL,
        description=f"At most {MAX_APP_DEFINED_NAME_BYTES} bytes in UTF-8.",
    ),
    AfterValidator(storable),
    bytes_bound("a name the app gives", MAX_APP_DEFINED_NAME_BYTES),
]


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, locations: Sequence[str] = ()) -> None:
        """``locations``: of a 422, where the request went wrong (``query.status``, ``body``), each an
        entry of its ``errors``."""
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.locations = tuple(locations)


def error_response(status: int, code: str, message: str, **extra: Any) -> Response:
    """An RFC 9457 problem (``type``, ``title``, ``status``, ``detail``), carrying also the
    ``{"error": {"code", "message"}}`` member that Relay's errors had before 0.3 (deprecated)."""
    return problem(status, message, error={"code": code, "message": message}, **extra)


class DecodedRoute(APIRoute):
    """A route whose path parameters are decoded once, when the route matches.

    :class:`relay.net.paths.PathKeeper` keeps ``%`` and ``/`` escaped inside each path segment so
    that routing sees the segments the client sent; every parameter (an org, an app, a key's
    name, a workflow id) is decoded here, before the permission checks and the handlers read it.
    Decoding some parameters and not others made a key named ``team/ops`` impossible to delete
    and an app named ``100%`` unreachable.
    """

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        params = child.get("path_params")
        if match is not Match.NONE and params:
            child["path_params"] = {k: unquote(v) if isinstance(v, str) else v for k, v in params.items()}
        return match, child


# A path parameter that may hold any character, '/' included (decoded by DecodedRoute).
PathId = str


def context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.context
    return ctx


# The dependencies below are ``async def``, though they never wait: FastAPI runs a plain ``def``
# dependency in a worker thread, a thread hop per dependency per request.


async def _context(request: Request) -> ApiContext:
    return context(request)


def authenticated(request: Request) -> KeyGrant:
    """The bearer key's grant; 401 without a valid key."""
    key = bearer_key(request.headers.get("authorization", ""))
    grant = context(request).keyring.lookup(key)
    if grant is None:
        raise ApiError(401, "unauthorized", unauthorized(key))
    return grant


def permitted(request: Request, org: str, permission: Permission) -> KeyGrant:
    """The key's grant, if it may do ``permission`` in ``org`` (and in the path's app, if any)."""
    grant = authenticated(request)
    if grant.org != org:
        raise ApiError(403, "forbidden", f"this API key has no access to org {org!r}")
    app = request.path_params.get("app")
    if not grant.allows(permission, app):
        where = f" on app {app!r}" if app is not None and permission in grant.permissions else ""
        raise ApiError(403, "forbidden", f"this API key lacks the permission {permission.value}{where}")
    return grant


async def caller(request: Request, org: str) -> KeyGrant:
    return permitted(request, org, Permission.APPLICATION_READ)


async def admin(request: Request, org: str) -> KeyGrant:
    return permitted(request, org, Permission.APPLICATION_WRITE)


def _given(value: Any) -> Any:
    if value is None:
        raise ValueError("leave it out rather than null")
    return value


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def _not_null(schema: dict[str, Any]) -> None:
    """T's document without its null, and no default."""
    _no_default(schema)
    variants = schema.pop("anyOf", [])
    for variant in variants:
        if variant != {"type": "null"}:
            schema.update(variant)


# An optional member of a body that, when given, is not null: ``Annotated[T | None, Given] = given()``
# is Optional[T] in Python and plain T, not required, in the document. (Not ``T | SkipJsonSchema[None]``:
# a union, whose refusals name each branch: "x.constrained-float: ...; x.none: Input should be None".)
Given = BeforeValidator(_given)


def optional() -> Any:
    return Field(default=None, json_schema_extra=_no_default)


def given() -> Any:
    return Field(default=None, json_schema_extra=_not_null)


def _json_integer(value: Any) -> Any:
    """JSON Schema's integer: 3, or 3.0; not "3", nor true (a body is strict)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# After the field's constraints: ``Annotated[int, Field(ge=0), JsonInteger]`` (the other way round,
# pydantic cannot write the constraints in the document as JSON Schema).
JsonInteger = BeforeValidator(_json_integer)


class Body(BaseModel):
    """A request body: members the document does not list are refused, and JSON types are taken
    as they are (``0`` is not ``false``, ``"5"`` is not ``5``)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ConductorBody(Body):
    """The body of one of Conductor's operations. Conductor's document lists a ``$schema`` member (the
    URL of the body's JSON Schema) in each of its bodies, and its answers carry one: a client that
    sends back what it read sends it. It is taken, if a string (not null, as the document's type
    says), and ignored."""

    json_schema_url: Annotated[str | None, Given] = Field(
        default=None, alias="$schema", description="ignored", json_schema_extra=_not_null
    )


@dataclass(frozen=True)
class Paging:
    limit: int
    offset: int


def paging(default: int) -> Callable[[int, int], Awaitable[Paging]]:
    """The dependency that reads ``limit`` (``default`` when not given) and ``offset``."""

    async def page(
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = default,
        offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    ) -> Paging:
        return Paging(limit, offset)

    return page


Page = Annotated[Paging, Depends(paging(DEFAULT_PAGE))]
# The lists Conductor answers whole (apps, executors, keys, alerting rules): its document gives them
# no parameters, so its clients send no ``limit`` and cannot page (dbosctl's ``app list``, ``app
# executors`` and ``api-key list``). Without one they get the most a page holds, as a workflow
# search without one does, not Relay's usual first 100.
WholePage = Annotated[Paging, Depends(paging(MAX_PAGE))]
Ctx = Annotated[ApiContext, Depends(_context)]
Caller = Annotated[KeyGrant, Depends(caller)]
Admin = Annotated[KeyGrant, Depends(admin)]


def actor(grant: KeyGrant) -> str:
    return f"api:{grant.name}"


def not_the_apps(app: str, owner: str | None) -> bool:
    """Whether a workflow, queue or schedule the SDK found is another app's (None: DBOS's rows of no app)."""
    return owner is not None and owner != app


R = TypeVar("R", bound=Reply)
# How the SDK words "there is no such thing" in its error replies.
_NOT_FOUND = re.compile(r"non-existent|not found|does not exist|has no step named", re.IGNORECASE)
# And "that is there already": PostgreSQL's, through the SDK, importing a workflow that exists or
# forking onto an id a workflow has (the Python SDK passes on its "Key (...) already exists", the
# TypeScript SDK only "duplicate key value violates unique constraint ...").
_EXISTS = re.compile(r"already exists|duplicate key value violates unique constraint", re.IGNORECASE)
# PostgreSQL's DETAIL line naming the workflow id taken, said the way Conductor says it.
_KEY_EXISTS = re.compile(r"Key \(workflow_uuid\)=\((.*)\) already exists")


def answered(reply: R, *, success: bool = False) -> R:
    """``reply``, if the executor did what was asked; an :class:`ApiError` if it says it failed
    (404 when what the request names does not exist, 409 when what it would create exists already,
    502 otherwise). With ``success``, the reply's ``success`` must be true too."""
    if reply.error_message:
        # Read whole: the first lines of a bulk action's error name every workflow, and the
        # exception that says what went wrong comes last.
        lines = reply.error_message.splitlines()
        missing = [line for line in lines if _NOT_FOUND.search(line)]
        if missing:
            raise ApiError(404, "not_found", clean_text(missing[-1].strip(), 1000))
        exists = [line for line in lines if _EXISTS.search(line)]
        if exists:
            taken = _KEY_EXISTS.search(exists[-1])
            said = f"a workflow with id {taken[1]} already exists" if taken else exists[-1].strip()
            raise ApiError(409, "conflict", clean_text(said, 1000))
        raise ApiError(502, "executor_error", sdk_error(reply.error_message))
    if success and not getattr(reply, "success", True):
        raise ApiError(502, "executor_error", f"the executor answered {reply.type.value} with success: false")
    return reply


def sdk_error(text: str) -> str:
    """What the SDK's error reply says, without its traceback: what it was doing, and the exception
    (``Exception encountered when ...: Traceback ... <ExceptionClass>: <message>``)."""
    lines = [line.strip() for line in clean_text(text, 20_000).splitlines() if line.strip()]
    if not lines:
        return "the executor reported an error"
    context = lines[0].removesuffix("Traceback (most recent call last):").rstrip(": ")
    last = lines[-1]
    return context if last == lines[0] else f"{context}: {last}"[:2000]


@asynccontextmanager
async def audited(
    ctx: ApiContext, org: str, app: str, action: AuditAction, who: str, detail: dict[str, Any]
) -> AsyncIterator[None]:
    """Audit a change made through an executor, with its result, whether it worked or not."""
    try:
        yield
    except UnsendableRequest:
        raise  # refused before it was tried: audited as the refusal it is (relay.api.refusals), a 422
    except Exception as exc:
        failed = {**detail, "result": "failure", "error": clean_text(str(exc), 500)}
        await ctx.audit.write(org, app, AuditEntry(action, who, detail=failed))
        mark_audited(exc)  # not audited again as a refusal, whatever the API answers
        raise
    await ctx.audit.write(org, app, AuditEntry(action, who, detail={**detail, "result": "success"}))
