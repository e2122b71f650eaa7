"""The id of the HTTP request being served: in its answer, its problem details and its log lines.

On-call holding an error the CLI or a client showed finds the log lines of that request by its id.
A client may send its own (``X-Request-Id``, as proxies and tracing tools do); an id that is not
sane (empty, longer than :data:`MAX_LENGTH`, or with a character other than visible ASCII) is
replaced by a new one, not refused and not echoed: it is written into headers and log lines.
The id is a context variable, as :func:`relay.store.audit.requested_from`'s address is: the lines
logged while the request is served (and by the tasks it starts, which copy the context) carry it;
the tasks that outlive it or serve others too do not (:func:`shared_task`, and the DBOS workflows
:mod:`workflows.engine` starts, an operator's recovery among them).
"""

from __future__ import annotations

import asyncio
import contextvars
import re
import uuid
from collections.abc import Coroutine, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")

HEADER = "X-Request-Id"
MAX_LENGTH = 128
# Visible ASCII, no space: nothing a header, a log line or a terminal reads otherwise than it is.
_SANE = re.compile(rf"[!-~]{{1,{MAX_LENGTH}}}")

_current: ContextVar[str | None] = ContextVar("relay_request_id", default=None)


def new_request_id() -> str:
    return str(uuid.uuid4())


def request_id_of(sent: str | None) -> str:
    """The id of a request whose ``X-Request-Id`` was ``sent``: the client's if sane, else a new one."""
    if sent is not None and _SANE.fullmatch(sent):
        return sent
    return new_request_id()


# The header as an ASGI scope and an answer's headers hold it.
HEADER_BYTES = HEADER.lower().encode()


def request_id_of_scope(scope: Mapping[str, Any]) -> str:
    """The id of the request an ASGI ``scope`` is (its ``X-Request-Id`` if sane, :func:`request_id_of`)."""
    sent = next((value for name, value in scope.get("headers", []) if name == HEADER_BYTES), None)
    return request_id_of(sent.decode("latin-1") if sent is not None else None)


def current_request_id() -> str | None:
    """The id of the request being served, or None outside any (a workflow, a timer, DBOS's threads)."""
    return _current.get()


@contextmanager
def serving(request_id: str | None) -> Iterator[None]:
    """Within this block, the request being served is ``request_id``."""
    token = _current.set(request_id)
    try:
        yield
    finally:
        _current.reset(token)


def shared_task(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task that a request may start but that serves more than it (a batch of writes, the pool's
    reconnection, which starts the next attempt in turn): its lines carry no request's id, where a
    task would otherwise carry the id of whichever request came first, for as long as it runs. The
    rest of the context is the starter's, as ``create_task`` gives it."""
    context = contextvars.copy_context()
    context.run(_current.set, None)
    return asyncio.get_running_loop().create_task(coro, context=context)
