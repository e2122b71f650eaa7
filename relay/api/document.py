"""What the OpenAPI document says beyond what FastAPI reads from the routes.

- Every operation answers its errors, whatever their status, as RFC 9457 problem details
  (:mod:`relay.problem`) with the media type ``application/problem+json``: documented once, as
  the ``default`` response of every operation, as Conductor's own document does. This replaces
  FastAPI's 422 ``HTTPValidationError``, which is not what Relay sends.
- The API under ``/v2`` (and ``/metrics``) takes a bearer key: the ``bearer`` security scheme,
  so that a client of the document (the ``/docs`` page, a fuzzer) knows where the key goes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from relay.problem import PROBLEM_JSON


class ErrorDetail(BaseModel):
    location: str
    message: str


class LegacyError(BaseModel):
    """What Relay's errors were before they were problem details (deprecated, to go at 1.0)."""

    code: str
    message: str


class Problem(BaseModel):
    """An error: RFC 9457 problem details. Extension members may follow (``maxBytes`` on a 413)."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    errors: list[ErrorDetail] | None = None
    error: LegacyError | None = None


PROBLEMS: dict[int | str, dict[str, Any]] = {
    "default": {"model": Problem, "description": "An error, as RFC 9457 problem details (application/problem+json)"}
}

BEARER = {
    "type": "http",
    "scheme": "bearer",
    "description": "A Relay API key: one of relay.yaml's apiKeys, or one made with POST /v2/orgs/{org}/tokens/{name}.",
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
    document.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = BEARER
    schemas = document["components"].get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    return document
