"""RFC 9457 problem details: how Relay's HTTP errors are written.

``{"type": "about:blank", "title": <reason phrase>, "status": n, "detail": "..."}``
as ``application/problem+json``; extension members (``errors`` on a 422, say)
are passed as keyword arguments; ``requestId`` is the id of the request being
served (:mod:`relay.core.requestid`, also in the ``X-Request-Id`` header), which
on-call finds in the log. Used below the routes (the request guard) as well as
by them, so it depends on nothing but Starlette.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from starlette.responses import Response

from relay.core.requestid import current_request_id

PROBLEM_JSON = "application/problem+json"

# The detail of a 500: an exception Relay did not expect, a defect of its own. The client can do
# nothing about it but report it; the request id leads whoever runs Relay to the traceback.
INTERNAL_ERROR = (
    "an internal error of Relay's, not the request's fault: give the requestId to whoever runs Relay,"
    " whose log has what failed"
)


def problem(status: int, detail: str, *, headers: Mapping[str, str] | None = None, **extra: Any) -> Response:
    """An error response in the problem details format; ``extra`` adds members to the body."""
    body = {"type": "about:blank", "title": _title(status), "status": status, "detail": detail, **extra}
    if (request_id := current_request_id()) is not None:
        body["requestId"] = request_id
    return Response(
        json.dumps(body, separators=(",", ":")).encode(), status_code=status, headers=headers, media_type=PROBLEM_JSON
    )


def internal_error() -> Response:
    """The answer to a request whose serving raised an exception Relay did not expect."""
    return problem(500, INTERNAL_ERROR)


def _title(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
