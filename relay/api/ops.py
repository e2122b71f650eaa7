"""What operators and their tools poll: health, readiness, metrics; the console, the API browser and
the API's document where Conductor's clients look for it.

The probes are open and say nothing but their status (who may reach them is
not known). ``/metrics`` names every org and app, so it needs a key with
``metric.read`` unless ``server.publicMetrics`` opens it.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from relay.api.common import ApiError, Ctx, DecodedRoute, problem
from relay.appmetrics import SCOPES, ScrapeView
from relay.auth import Permission
from relay.net.guard import bearer_key
from relay.net.paths import served_under_conductor

router = APIRouter(route_class=DecodedRoute)
STATIC = Path(__file__).resolve().parents[1] / "static"
CONSOLE = STATIC / "console.html"
# The console's scripts (ES modules) and styles are files of their own, so that no inline code
# needs allowing; they reach nothing but this origin.
CONSOLE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "x-frame-options": "DENY",
}
STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
STATIC_NAME = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9]+)$")

# /docs: Swagger UI, vendored in static/swagger/ (its README says from where), started by
# static/docs.js. It needs nothing from another origin, no inline script and no eval; the icons
# of its stylesheet are data: URIs.
DOCS = STATIC / "docs.html"
SWAGGER = STATIC / "swagger"
SWAGGER_FILES = frozenset({"swagger-ui-bundle.js", "swagger-ui.css"})
DOCS_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "x-frame-options": "DENY",
}


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def console() -> HTMLResponse:
    """The operator console: a single page that reads the API with the key the operator types in."""
    return HTMLResponse(CONSOLE.read_text(encoding="utf-8"), headers=CONSOLE_HEADERS)


@router.get("/static/{name}", include_in_schema=False)
async def static(name: str) -> Response:
    """The console's own files: a flat folder, by name, of the types listed."""
    match = STATIC_NAME.match(name)
    path = STATIC / name
    if match is None or match.group(1) not in STATIC_TYPES or not path.is_file():
        return problem(404, f"no static file {name!r}")
    return Response(path.read_bytes(), media_type=STATIC_TYPES[match.group(1)])


@router.get("/docs", response_class=HTMLResponse, include_in_schema=False)
async def docs() -> HTMLResponse:
    """The API browser: Swagger UI on /openapi.json. Trying a call needs a key ("Authorize")."""
    return HTMLResponse(DOCS.read_text(encoding="utf-8"), headers=DOCS_HEADERS)


@router.get("/static/swagger/{name}", include_in_schema=False)
async def swagger(name: str) -> Response:
    """Swagger UI's two files, by name, and nothing else of that folder."""
    if name not in SWAGGER_FILES:
        return problem(404, f"no static file {name!r}")
    return Response(_swagger_file(name), media_type=STATIC_TYPES[Path(name).suffix])


@functools.cache
def _swagger_file(name: str) -> bytes:
    return (SWAGGER / name).read_bytes()


# /openapi.json is FastAPI's. Conductor serves its document also in YAML (self-hosted), and at
# /conductor/v2/openapi.json (managed: relay.net.paths serves that path as /v2/openapi.json), with
# its servers entry at /conductor so that a client made from it calls the API under that prefix.
# All open, as /openapi.json (relay.net.guard.OPEN_PATHS). No OpenAPI 3.0 downgrade
# (/openapi-3.0.json): Relay has no way to check one against the 3.0 schema.
#
# Relay served below a path prefix by a proxy that strips it: the proxy names the prefix in
# X-Forwarded-Prefix (Traefik's StripPrefix sends it; nginx, haproxy: a header set), or the ASGI
# server in the scope's root_path. The servers entry of /v2/openapi.json starts with it: clients
# made from the document (schemathesis, generated clients) take the entry's path from the host's
# root, and called the host's /conductor/v2/..., not Relay's. (/openapi.json names no server: the
# API browser, static/docs.js, puts the page's prefix in front of its calls itself.)
FORWARDED_PREFIX = "x-forwarded-prefix"
# Path segments of RFC 3986 characters (no comma: one prefix, not a list), none "." or "..".
PREFIX = re.compile(r"(?:/(?!\.{1,2}(?:/|$))[A-Za-z0-9._~!$&'()*+;=:@%-]+)*/?")


def served_prefix(request: Request) -> str:
    """The path prefix Relay is served below, without its final ``/`` ("" at the host's root)."""
    given = request.headers.getlist(FORWARDED_PREFIX)
    if not given:
        return str(request.scope.get("root_path") or "").rstrip("/")
    if len(given) > 1 or not PREFIX.fullmatch(given[0]) or given[0][:1] not in ("", "/"):
        raise ApiError(
            400,
            "invalid_request",
            "X-Forwarded-Prefix must be one path below which Relay is served, such as /relay "
            f"(segments of URL path characters, none '.' or '..'): got {', '.join(given)[:200]!r}",
        )
    return given[0].rstrip("/")


@router.get("/openapi.yaml", include_in_schema=False)
async def openapi_yaml(request: Request) -> Response:
    """The API's document in YAML: made once, as FastAPI makes the JSON one once."""
    api: FastAPI = request.app
    text: str | None = getattr(api.state, "openapi_yaml", None)
    if text is None:
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        text = yaml.dump(api.openapi(), Dumper=dumper, sort_keys=False, allow_unicode=True)
        api.state.openapi_yaml = text
    return Response(text, media_type="application/yaml")


@router.get("/v2/openapi.json", include_in_schema=False)
async def openapi_under_conductor(request: Request) -> JSONResponse:
    """The API's document where managed Conductor serves it (``/conductor/v2/openapi.json``)."""
    api: FastAPI = request.app
    document = api.openapi()
    # Only the paths also served under /conductor, where this document's servers entry points.
    paths = {path: item for path, item in document.get("paths", {}).items() if served_under_conductor(path)}
    servers = [{"url": f"{served_prefix(request)}/conductor"}]
    # The document differs by the header: a cache (a CDN, a proxy's) must not give one request's
    # prefix, which a client may have sent itself, to requests with another, or none.
    return JSONResponse({**document, "paths": paths, "servers": servers}, headers={"Vary": "X-Forwarded-Prefix"})


# The probes answer HEAD as every GET route does (relay.api.HeadAsGet): load balancers check with it.
@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(ctx: Ctx) -> Response:
    """Ready: this instance holds its lease and the database answers, within 1.5 s however busy
    the pool is (the probe has a connection of its own: :mod:`relay.store.probe`).

    Why not is not said here (anybody may ask): the log has the failed renewals,
    and ``relay_lease_held`` in ``/metrics``.
    """
    if not ctx.lease.held or not await ctx.probe.answers():
        return problem(503, "not ready")
    return JSONResponse({"status": "ready"})


EXPOSITION = {"schema": {"type": "string"}}


# Conductor's scrape path (its documentation's Prometheus jobs use ``metrics_path: /v1/metrics``).
@router.get("/v1/metrics", response_class=Response, include_in_schema=False)
@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text, or OpenMetrics to Accept: application/openmetrics-text",
            "content": {"text/plain": EXPOSITION, "application/openmetrics-text": EXPOSITION},
        }
    },
)
async def metrics(request: Request, ctx: Ctx) -> Response:
    """Relay's own figures of this instance, and the apps' figures (``dbos_conductor_v1_*``): of the
    series labelled with an org or app, those of the key's org and apps (every org's with
    ``publicMetrics``); the instance-wide ones whatever the key.

    Query filters, each repeatable: Conductor's ``applications``, ``workflow_names`` and ``metrics``
    (family names), and ``scope``: ``instance`` (Relay's own), ``apps`` (the apps') or ``all``.
    """
    orgs: frozenset[str] | None = None
    apps: frozenset[str] | None = None
    if not ctx.config.server.public_metrics:
        grant = ctx.keyring.lookup(bearer_key(request.headers.get("authorization", "")))
        if grant is None:
            return problem(
                401,
                "a key with metric.read is required: Authorization: Bearer <key>",
                headers={"www-authenticate": "Bearer"},
            )
        if not grant.allows(Permission.METRIC_READ):
            return problem(403, "this key lacks the permission metric.read")
        orgs, apps = frozenset({grant.org}), grant.apps
    query = request.query_params
    scope = query.get("scope", "all")
    if scope not in SCOPES:
        message = f"scope must be one of {', '.join(SCOPES)}"
        return problem(422, message, errors=[{"location": "query.scope", "message": message}])

    def given(name: str) -> frozenset[str] | None:
        values = query.getlist(name)
        return frozenset(values) if values else None

    view = ScrapeView(orgs, apps, given("applications"), given("workflow_names"), given("metrics"), scope)
    body, content_type = await ctx.metrics(view, request.headers.get("accept", ""))
    return Response(body, media_type=content_type)
