"""The REST API as the operator commands call it: one HTTP client, errors turned into exit codes.

Every operator command takes ``--url``, ``--key``, ``--org`` and ``--json``
(:func:`api_command`). Without ``--org``, the org is the key's own, asked of
``GET /v2/whoami``. An error answer (a problem+json body, RFC 9457) becomes one
line, ``relay: <status> <title>: <detail>``, and the exit code of
:mod:`relay.cli.errors`; a 5xx's line ends with the request's id (``(request id ...)``), which
the instance's log lines about it carry (each request sends an id of its own, ``X-Request-Id``).
httpx's transport errors become "cannot reach Relay" (exit 5, try again), except a TLS
certificate the client does not trust (exit 1: a retry meets the same one).
"""

from __future__ import annotations

import base64
import functools
import re
import ssl
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, unquote

import click
import httpx
from click.core import ParameterSource

from relay.cli.errors import EXIT_UNAVAILABLE, EXIT_USAGE, CliError, exit_code_for, keep_secret
from relay.cli.output import json_text, visible
from relay.core.requestid import HEADER, new_request_id

DEFAULT_URL = "http://127.0.0.1:8080"
# The workflow API's own deadline is 25 s (server.executorRequestDeadlineSecs); leave it room.
TIMEOUT_SECS = 60.0
# A URL's user information: after a scheme's "//" (or a "//" that starts a word), a user (no "/", "["
# or ":") and a password after a ":", up to the last @ before any ? or #. The password is taken to
# the last @ (as httpx takes it) and past a /, which belong in it only percent-encoded but are typed
# there anyway: "//u:p@ss@host" showed as "//u:***@ss@host", and "//u:s3cr/et@host" whole. What
# follows a host's "/" or its port is no user's: "https://h//docs/x@y" (a path with an @) showed as
# "https://***@y", and "//h:8080/x@y" as "//h:***@y".
_USERINFO = re.compile(
    r"(?:(?<![\w+.-])(?P<scheme>[A-Za-z][\w+.-]*:)|(?<![^\s'\"(<=]))"  # a scheme, or a word's start
    r"//(?P<userinfo>[^/?#\[\]\s:]*"  # the user
    r"(?::(?!\d+(?:[/?#\s]|$))[^?#\s]*)?)@"  # the password, when it is not a port
)


def segment(value: str) -> str:
    """A path segment, percent-encoded whole: ``/``, ``?``, ``#`` and ``%`` included, and a ``.`` or
    ``..`` (which a URL resolves: ``.../workflows/..`` is the app's own path). An empty one is
    refused (exit 2): the path would end in ``/``, another route's."""
    if not value:
        raise CliError("an empty name or id: give the app, workflow, executor or key by name", EXIT_USAGE)
    if value in (".", ".."):
        return value.replace(".", "%2E")
    return quote(value, safe="")


# What an answer that no Relay gives (a page for a 404, JSON of another shape) says to check.
_NOT_RELAY = "is --url (or RELAY_URL) Relay's address, with its path prefix behind a proxy?"


def _is_json(resp: httpx.Response) -> bool:
    try:
        resp.json()
    except ValueError:
        return False
    return True


class Api:
    """One server and one key; :meth:`org_path` builds paths under ``/v2/orgs/{org}``."""

    def __init__(
        self, url: str, key: str | None, org: str | None, as_json: bool, timeout: float = TIMEOUT_SECS
    ) -> None:
        self._key = checked_key(key)
        keep_secret(self._key)
        # Every path starts with /v2: a base given with it (.../conductor/v2, the form Conductor's
        # clients take) means the same server.
        self.url = url.rstrip("/").removesuffix("/v2")
        self.shown_url = without_password(self.url)
        for secret in url_secrets(self.url):
            keep_secret(secret)
        try:
            parsed = httpx.URL(self.url)
        except httpx.InvalidURL as exc:
            # httpx's words quote the part it could not read, which is the password's when a / in
            # it ends the host early ("Invalid port: 's3cr'").
            why = "a password's / ? # @ and : are percent-encoded" if _USERINFO.search(self.url) else str(exc)
            raise CliError(f"not a URL: {self.shown_url!r} ({why})", EXIT_USAGE) from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise CliError(f"not an http(s) URL: {self.shown_url!r} (like {DEFAULT_URL})", EXIT_USAGE)
        if parsed.userinfo:
            # HTTP sends a URL's user and password as Basic authentication in the Authorization
            # header, where the API key goes: the key was never sent, and Relay answered 401.
            raise CliError(
                f"the URL {self.shown_url!r} carries a user or password, which would be sent in place of"
                " the API key: give Relay's address without them (the key goes in --key or RELAY_API_KEY)",
                EXIT_USAGE,
            )
        self.as_json = as_json
        self._org = org
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self._key}", "User-Agent": "relay-cli"},
            timeout=timeout,
            event_hooks={"request": [_with_request_id]},
        )

    def close(self) -> None:
        self._http.close()

    @property
    def org(self) -> str:
        if self._org is None:
            me = self.call("GET", "/v2/whoami")
            if not (isinstance(me, dict) and isinstance(me.get("org"), str)):
                # A server that answers JSON to anything (another service's API) is not Relay: said as
                # such, not as an internal error ("KeyError: 'org'") that names nothing to check.
                raise CliError(
                    f"GET /v2/whoami: the answer has no org, which Relay's always has: {_NOT_RELAY}", EXIT_USAGE
                )
            self._org = me["org"]
        return self._org

    def org_path(self, *parts: str) -> str:
        return "/".join(["/v2/orgs", segment(self.org), *(segment(p) for p in parts)])

    def call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
    ) -> Any:
        """The answer's JSON (None for an empty answer, as a 204 is); a :class:`CliError` otherwise."""
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            resp = self._http.request(method, path, params=clean, json=body)
        except httpx.TimeoutException as exc:
            raise CliError(
                f"Relay at {self.shown_url} did not answer in time ({self._reason(exc)})", EXIT_UNAVAILABLE
            ) from exc
        except httpx.LocalProtocolError as exc:
            # Not Relay's fault, and no better later: this request cannot be sent as it is.
            raise CliError(f"cannot send the request to Relay at {self.shown_url}: {self._reason(exc)}") from exc
        except httpx.ConnectError as exc:
            if untrusted_certificate(exc):  # no better later either: a retry meets the same certificate
                raise CliError(
                    f"Relay at {self.shown_url}: its TLS certificate is not trusted ({self._reason(exc)}); give "
                    "its CA with SSL_CERT_FILE"
                ) from exc
            raise CliError(f"cannot reach Relay at {self.shown_url}: {self._reason(exc)}", EXIT_UNAVAILABLE) from exc
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach Relay at {self.shown_url}: {self._reason(exc)}", EXIT_UNAVAILABLE) from exc
        if resp.is_error:
            if resp.status_code == 404 and not _is_json(resp):
                # Relay answers every 404 under /v2 with problem details. A page instead is another
                # server's (a web server, a proxy's path with no Relay behind it): exit 3 said "no such
                # app" to a script, and the line was the page's markup with no word of what to check.
                what = (
                    f"{resp.status_code} {resp.reason_phrase}: {method} {path} answered by a server that is not Relay"
                )
                raise CliError(f"{what} (a page, not problem details): {_NOT_RELAY}", EXIT_USAGE)
            raise CliError(describe_error(resp), exit_code_for(resp.status_code))
        if resp.is_redirect:  # Relay's API redirects nothing it serves: not an answer to take for success
            where = without_password(resp.headers.get("location", ""))
            raise CliError(f"{resp.status_code} {resp.reason_phrase}: {method} {path} is not a route of the API"
                           f" (redirected to {where!r})")  # fmt: skip
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError as exc:
            raise CliError(f"{method} {path}: the answer is not JSON: {resp.text[:200]!r}; {_NOT_RELAY}") from exc

    def _reason(self, exc: httpx.HTTPError) -> str:
        """An httpx error's message for the error line, without the key: h11 quotes a header it refuses."""
        if isinstance(exc, httpx.LocalProtocolError):
            return f"{type(exc).__name__}: not a valid HTTP request"
        text = str(exc) or type(exc).__name__
        return visible(text.replace(self._key, "***"))


def untrusted_certificate(exc: BaseException) -> bool:
    """Whether ``exc`` comes of a TLS certificate that failed verification (an unknown CA, another
    host's name, an expired one): a refusal that repeats, as relay_client has it, not an outage."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def checked_key(key: str | None) -> str:
    """The key as given, without the spaces or line end around it (a file edited on Windows ends in \\r).

    A key is printable ASCII: any other character is refused here (exit 2) rather than by
    httpx's header check, and never printed, since the error lines end up in CI logs.
    """
    key = (key or "").strip()
    if not key:
        raise CliError("no API key: give --key or set RELAY_API_KEY", EXIT_USAGE)
    if not (key.isascii() and key.isprintable()):
        raise CliError("the API key is not printable ASCII (check --key or RELAY_API_KEY)", EXIT_USAGE)
    return key


def without_password(url: str) -> str:
    """``url`` (or a message) as the error lines show it: a URL's password (``//user:pass@host``) as
    ``***``, and user information with no password (``//token@host``, often a token) too."""

    def masked(match: re.Match[str]) -> str:
        user, sep, _ = match["userinfo"].partition(":")
        scheme = match["scheme"] or ""
        return f"{scheme}//{user}:***@" if sep else f"{scheme}//***@"

    return _USERINFO.sub(masked, url)


def url_secrets(url: str) -> list[str]:
    """A URL's password (or its user, where it has none: a token, as :func:`without_password` takes
    it), as typed and percent-decoded (its form in httpx's and a server's words), and
    ``user:password`` in base64, as HTTP Basic authentication sends it: the forms an error could quote."""
    found = _USERINFO.search(url)
    if found is None:
        return []
    user, sep, password = found["userinfo"].partition(":")
    secret = password if sep else user
    basic = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
    return [secret, unquote(secret), basic] if secret else []


def _with_request_id(request: httpx.Request) -> None:
    request.headers[HEADER] = new_request_id()


def describe_error(resp: httpx.Response) -> str:
    """``<status> <title>: <detail>`` from a problem+json body, or from whatever body came; for a
    5xx, with the request's id: the one Relay answered, else (a proxy's 502) the one sent."""
    title, detail = resp.reason_phrase, ""
    try:
        problem = resp.json()
    except ValueError:
        detail = " ".join(resp.text.split())[:300]
    else:
        if isinstance(problem, dict):
            title = str(problem.get("title") or title)
            detail = str(problem.get("detail") or "")
    title, detail = visible(title), visible(detail)  # a detail may quote an executor's error
    hint = " (is the key right? give --key or set RELAY_API_KEY)" if resp.status_code == 401 else ""
    if resp.status_code >= 500:
        request_id = resp.headers.get(HEADER) or resp.request.headers.get(HEADER)
        hint = f" (request id {visible(request_id)})" if request_id else ""
    return f"{resp.status_code} {title}: {detail}{hint}" if detail else f"{resp.status_code} {title}{hint}"


def print_json(data: Any) -> None:
    """The API's JSON, as it came, indented (see :func:`json_text`)."""
    click.echo(json_text(data))


def refuse_group_options(ctx: click.Context) -> None:
    """Refuse (exit 2) the options given to a group that lists when run alone (``relay apps``) and
    is run with a command: its command has options of its own, and takes none of the group's.
    Dropped, ``relay apps --url X delete APP --yes`` deleted the app on RELAY_URL's Relay, not on X's."""
    given = [
        p.opts[0]
        for p in ctx.command.params
        if p.name is not None and ctx.get_parameter_source(p.name) is ParameterSource.COMMANDLINE
    ]
    if given:
        verb = "goes" if len(given) == 1 else "go"
        where = f"{ctx.command_path} {ctx.invoked_subcommand} {given[0]} ..."
        raise click.UsageError(f"{', '.join(given)} {verb} after the command ({where})", ctx)


def api_command(func: Callable[..., int | None]) -> Callable[..., int]:
    """Give a command the options every operator command shares, and an :class:`Api` as first argument."""

    @click.option("--json", "as_json", is_flag=True, help="Print the API's JSON instead of a table.")
    @click.option(
        "--timeout",
        envvar="RELAY_TIMEOUT",
        show_envvar=True,
        type=click.FloatRange(min=0.1, max=3600, clamp=False),
        default=TIMEOUT_SECS,
        show_default=True,
        help="Seconds to wait for Relay to connect and answer each request (exit 5 past it).",
    )
    @click.option(
        "--org", envvar="RELAY_ORG", show_envvar=True, help="The org (default: the org of the key, from /v2/whoami)."
    )
    @click.option("--key", envvar="RELAY_API_KEY", show_envvar=True, help="An API key of the org.")
    @click.option(
        "--url", envvar="RELAY_URL", show_envvar=True, default=DEFAULT_URL, show_default=True, help="Relay's address."
    )
    @functools.wraps(func)
    def run(url: str, key: str | None, org: str | None, as_json: bool, timeout: float, **kwargs: Any) -> int:
        ctx = click.get_current_context()
        if ctx.invoked_subcommand is not None:
            refuse_group_options(ctx)
            return 0  # a group that does its own work only when run alone (``relay apps``): its command does it
        api = Api(url, key, org, as_json, timeout)
        try:
            return func(api, **kwargs) or 0
        finally:
            api.close()

    return run
