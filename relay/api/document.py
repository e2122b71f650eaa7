"""What the OpenAPI document says beyond what FastAPI reads from the routes.

- Every operation answers its errors, whatever their status, as RFC 9457 problem details
  (:mod:`relay.problem`) with the media type ``application/problem+json``: documented once, as
  the ``default`` response of every operation, as Conductor's own document does. This replaces
  FastAPI's 422 ``HTTPValidationError``, which is not what Relay sends.
- The API under ``/v2`` (and ``/metrics``) takes a bearer key: the ``bearer`` security scheme,
  so that a client of the document (the ``/docs`` page, a fuzzer) knows where the key goes.
- Every response has the request's id in ``X-Request-Id`` (:mod:`relay.core.requestid`), set
  below the routes: documented on each response, so that a fuzzer checks it is there.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from relay.core.requestid import HEADER, MAX_LENGTH
from relay.problem import PROBLEM_JSON


class ErrorDetail(BaseModel):
    location: str
    message: str


class LegacyError(BaseModel):
    """What Relay's errors were before they were problem details (deprecated, to go at 1.0)."""

    code: str
    message: str


class Problem(BaseModel):
    """An error: RFC 9457 problem details. Extension members may follow (``maxBytes`` on a 413).
    ``requestId`` is the request's id, as its ``X-Request-Id`` header gives it: the instance's log
    lines about the request carry it."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    errors: list[ErrorDetail] | None = None
    error: LegacyError | None = None
    requestId: str | None = None  # the document's member, camelCase as the API's


PROBLEMS: dict[int | str, dict[str, Any]] = {
    "default": {"model": Problem, "description": "An error, as RFC 9457 problem details (application/problem+json)"}
}

BEARER = {
    "type": "http",
    "scheme": "bearer",
    "description": "A Relay API key: one of relay.yaml's apiKeys, or one made with POST /v2/orgs/{org}/tokens/{name}.",
}


REQUEST_ID = {
    "description": (
        "The request's id: the client's own X-Request-Id if it sent one of 1 to 128 visible ASCII"
        " characters, else a new one. The instance's log lines about the request carry it."
    ),
    "required": True,
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_LENGTH},
}


def finish(document: dict[str, Any]) -> dict[str, Any]:
    """The document FastAPI generated, with its problem responses and security scheme as Relay has them."""
    for path, operations in document.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)  # FastAPI's own; a 422 is a problem like any other error
            default = responses.get("default", {})
            if "application/json" in default.get("content", {}):
                default["content"] = {PROBLEM_JSON: default["content"]["application/json"]}
            if path.startswith("/v2/") or path == "/metrics":
                operation["security"] = [{"bearer": []}]
            for response in responses.values():
                response.setdefault("headers", {})[HEADER] = {"$ref": "#/components/headers/RequestId"}
    document.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = BEARER
    document["components"].setdefault("headers", {})["RequestId"] = REQUEST_ID
    schemas = document["components"].get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    return document
