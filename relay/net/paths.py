"""Request paths as routes should see them: ``/conductor/v2/...`` served as ``/v2/...`` (and the
probes and ``/metrics`` under ``/conductor`` as well), and a percent-encoded ``/`` inside one
segment kept inside it.

ASGI servers decode ``%2F`` before routing, so a workflow id ``a/steps`` sent as
``/workflows/a%2Fsteps`` would be taken for the steps route of workflow ``a``.
This rewrites the path from the raw one, segment by segment, escaping ``%`` and
``/`` inside each segment again; route handlers decode the ids they take
(:data:`relay.api.common.PathId`). A NUL in a path is refused: no name Relay
stores can contain one.
"""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

from relay.net.connection import Receive, Scope, Send
from relay.net.server import Asgi
from relay.problem import problem

CONDUCTOR_PREFIX = "/conductor"
# What is also served under CONDUCTOR_PREFIX: the API, the probes and the scrape paths (the
# contract's REST section), and the audit log at the path of Conductor's audit log page. Not the
# console, its assets or /openapi.json (the API's document is at /conductor/v2/openapi.json).
ALSO_UNDER_CONDUCTOR = frozenset({"/healthz", "/readyz", "/metrics", "/v1/metrics"})


def served_under_conductor(path: str) -> bool:
    """Whether ``path`` (without the prefix) is also served as ``/conductor`` + ``path``: the v2 API,
    and Conductor's audit log page's ``/v1alpha1/api/{org}/audit-logs``."""
    return path.startswith(("/v2/", "/v1alpha1/api/")) or path in ALSO_UNDER_CONDUCTOR


def keep(segment: str) -> str:
    return segment.replace("%", "%25").replace("/", "%2F")


class PathKeeper:
    def __init__(self, app: Asgi) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = bytes(scope.get("raw_path") or scope["path"].encode()).split(b"?", 1)[0]
        if raw.startswith(CONDUCTOR_PREFIX.encode() + b"/") and served_under_conductor(
            raw[len(CONDUCTOR_PREFIX) :].decode("latin-1")
        ):
            raw = raw[len(CONDUCTOR_PREFIX) :]
        segments = [unquote_to_bytes(segment).decode("utf-8", "replace") for segment in raw.split(b"/")]
        if any("\x00" in segment for segment in segments):
            await problem(404, "no such resource")(scope, receive, send)
            return
        path = "/".join(keep(segment) for segment in segments)
        await self.app({**scope, "path": path, "raw_path": raw}, receive, send)
