"""Sending a webhook: one POST, to an address the allow-list allows, and nothing more.

- The host name is resolved at send time and every address it resolves to is
  checked (:class:`relay.core.destinations.DestinationPolicy`); the request
  then goes to those checked addresses in the order they came, the next one
  tried when one cannot be connected to (refused, unreachable, no answer), with
  the name in the ``Host`` header and as the TLS server name (certificates are
  verified against it). A name that resolves elsewhere a moment later (DNS
  rebinding) changes nothing: no second lookup is made, and no address that was
  not checked is ever connected to.
- An internationalised host name (``bücher.example``) is resolved, sent and
  verified as its IDNA form (``xn--bcher-kva.example``), as a browser does.
- Names are resolved on the sender's own few threads, never on the event loop's
  default executor: that is DBOS's, bounded, and a lookup that a name server
  leaves unanswered keeps its thread after the delivery has given up on it. A
  slow name server then delays other webhooks only, not Relay's DBOS work.
- Redirects are not followed (a 3xx is a failed delivery); proxies from the
  environment are not used; the whole attempt is bounded by a timeout.
- Only the status line is read: the response body is never read or logged.
- Errors name the host, never the URL: its path or query may hold a secret (a
  Slack webhook's token does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from relay.config import RelayConfig, ascii_host, webhook_problem
from relay.core.alerts import retryable_status
from relay.core.destinations import Address, DestinationPolicy

# httpx logs every request's URL at INFO (httpcore its details at DEBUG), and a webhook's URL may
# hold a secret: neither logs below WARNING, whatever Relay's log level.
for _library in ("httpx", "httpcore"):
    logging.getLogger(_library).setLevel(logging.WARNING)

Resolver = Callable[[str, int], Awaitable[list[Address]]]
GetAddrInfo = Callable[..., list[tuple[Any, ...]]]

# Threads that resolve webhook host names (and so lookups at a time). A name server that never
# answers holds one for glibc's timeout x attempts (5 s x 2 by default): a few are enough.
LOOKUP_THREADS = 4
log = logging.getLogger(__name__)


class Unresolved(Exception):
    """The webhook's host name did not resolve (DNS may be back at the next attempt)."""


@dataclass(frozen=True)
class Attempt:
    """What one POST came to: sent, or why not and whether another try may do better."""

    ok: bool
    retry: bool = False
    error: str | None = None
    status: int | None = None


@dataclass(frozen=True)
class Destination:
    """Where a webhook goes: its host as sent (IDNA for an internationalised name), its port, and
    the addresses the name resolved to."""

    host: str
    port: int
    addresses: list[Address]


def describe(url: str) -> str:
    """What may be shown of a webhook: its scheme, host and port (never its path, query or user)."""
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(an invalid URL)"
    host = parts.hostname or ""
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}{port}"


class WebhookSender:
    def __init__(
        self,
        policy: DestinationPolicy,
        timeout_secs: float,
        user_agent: str,
        resolver: Resolver | None = None,
        getaddrinfo: GetAddrInfo | None = None,
    ) -> None:
        """``resolver`` (host, port -> addresses) replaces the lookup altogether; without it the
        name is resolved with ``getaddrinfo`` (``socket.getaddrinfo`` by default) on the sender's
        own threads."""
        self.policy = policy
        self.timeout = timeout_secs
        self.user_agent = user_agent
        self.resolver = resolver or self.resolve
        self.getaddrinfo = getaddrinfo or socket.getaddrinfo
        self._lookups = concurrent.futures.ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="webhook-dns")
        # A lookup holds its slot until its thread is done with it, not until its caller gives up:
        # the lookups waiting for a thread wait here, within their delivery's timeout.
        self._slots = asyncio.Semaphore(LOOKUP_THREADS)
        # Made once (loading the CA bundle takes a noticeable fraction of a second, out of each
        # delivery's timeout); as httpx makes it for a client that does not trust the environment.
        self._tls = httpx.create_ssl_context(trust_env=False)

    def close(self) -> None:
        """Stop resolving. A lookup still running keeps its thread until the name server answers
        or the resolver gives up; Relay's stop does not wait for it."""
        self._lookups.shutdown(wait=False, cancel_futures=True)

    async def resolve(self, host: str, port: int) -> list[Address]:
        """Every address ``host`` resolves to (an address resolves to itself)."""
        loop = asyncio.get_running_loop()

        def free(_: concurrent.futures.Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(self._slots.release)

        await self._slots.acquire()
        try:
            lookup = self._lookups.submit(self.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        except RuntimeError as exc:  # closed: Relay is stopping
            self._slots.release()
            raise OSError("the webhook sender is closed") from exc
        lookup.add_done_callback(free)
        infos = await asyncio.wrap_future(lookup)
        found: list[Address] = []
        for info in infos:
            address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            if address not in found:
                found.append(address)
        return found

    async def _destination(self, url: str) -> tuple[Destination | None, str | None]:
        """Where the URL's host resolves, or why it may not be sent to. Raises :class:`Unresolved`
        when the name cannot be resolved (which may pass)."""
        problem = webhook_problem(url)
        if problem:
            return None, problem
        parts = urlsplit(url)
        try:
            host = ascii_host(parts.hostname or "")
        except ValueError as exc:
            return None, f"{describe(url)}: the host name is not a valid internationalised name ({exc})"
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = await self.resolver(host, port)
        except (OSError, UnicodeError) as exc:
            raise Unresolved(f"{host} cannot be resolved ({type(exc).__name__})") from exc
        return Destination(host, port, addresses), self.policy.check(host, addresses)

    async def refusal(self, url: str) -> str | None:
        """Why the policy refuses the URL's destination now, or None; raises :class:`Unresolved` or
        TimeoutError when its host cannot be resolved now (which may pass)."""
        async with asyncio.timeout(self.timeout):
            return (await self._destination(url))[1]

    async def check(self, url: str) -> str | None:
        """Why a webhook may not be sent to now (a rule is refused for it), or None."""
        try:
            async with asyncio.timeout(self.timeout):
                return (await self._destination(url))[1]
        except Unresolved as exc:
            return str(exc)
        except TimeoutError:
            return f"{describe(url)}: resolving its host timed out"

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Attempt:
        host = describe(url)
        ends = asyncio.get_running_loop().time() + self.timeout
        try:
            async with asyncio.timeout_at(ends):
                destination, refused = await self._destination(url)
                if destination is None or refused is not None:
                    return Attempt(False, error=refused)
                status = await self._send_to_any(url, destination, body, headers, ends)
        except Unresolved as exc:
            return Attempt(False, retry=True, error=str(exc))
        except TimeoutError:
            return Attempt(False, retry=True, error=f"{host}: no answer within {self.timeout:g}s")
        except httpx.HTTPError as exc:
            return Attempt(False, retry=True, error=f"{host}: {type(exc).__name__} {_without(str(exc), url)}"[:500])
        if 200 <= status < 300:
            return Attempt(True, status=status)
        if 300 <= status < 400:
            return Attempt(False, error=f"{host} answered {status}, a redirect (not followed)", status=status)
        return Attempt(False, retry=retryable_status(status), error=f"{host} answered {status}", status=status)

    async def _send_to_any(
        self, url: str, destination: Destination, body: bytes, headers: Mapping[str, str], ends: float
    ) -> int:
        """The status of the POST to the first of the (checked) addresses that takes the connection.
        Each address may take an equal share of the time left for connecting, so one that drops
        connections silently does not use up the delivery's timeout; the last error is raised."""
        loop = asyncio.get_running_loop()
        addresses = destination.addresses
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False, verify=self._tls) as client:
            for n, address in enumerate(addresses):
                connect = max((ends - loop.time()) / (len(addresses) - n), 0.001)
                try:
                    return await self._send(client, url, destination, address, body, headers, connect)
                except (httpx.ConnectError, httpx.ConnectTimeout):
                    if n == len(addresses) - 1:
                        raise
        raise AssertionError("a destination has at least one address (the policy refuses none)")

    async def _send(
        self,
        client: httpx.AsyncClient,
        url: str,
        destination: Destination,
        address: Address,
        body: bytes,
        headers: Mapping[str, str],
        connect_secs: float,
    ) -> int:
        parts = urlsplit(url)
        host, port = destination.host, destination.port
        literal = f"[{address}]" if address.version == 6 else str(address)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{literal}:{port}" if userinfo else f"{literal}:{port}"
        pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
        default_port = port == (443 if parts.scheme == "https" else 80)
        host_header = (f"[{host}]" if ":" in host else host) + ("" if default_port else f":{port}")
        extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
        async with client.stream(
            "POST",
            pinned,
            content=body,
            headers={
                **headers,
                "Host": host_header,
                "Content-Type": "application/json",
                "User-Agent": self.user_agent,
            },
            timeout=httpx.Timeout(self.timeout, connect=connect_secs),
            extensions=extensions,
        ) as response:
            return response.status_code


def _without(text: str, url: str) -> str:
    """An error's text with the URL (and its path) taken out."""
    parts = urlsplit(url)
    for secret in (url, parts.path, parts.query):
        if secret and secret != "/":
            text = text.replace(secret, "...")
    return text


def config_refusals(config: RelayConfig) -> list[str]:
    """What relay.yaml's webhooks the allow-list refuses, resolved now as a rule made through the API
    is: one a line, by where it is in the file. A literal address is refused by the file's own
    validation; a name (``localhost``) only here. A name that cannot be resolved now is logged and
    left to the sends (a name server away at start must not keep Relay from starting)."""
    sender = WebhookSender(config.alerts.policy(), config.alerts.timeout_secs, "relay")

    async def one(where: str, url: str) -> str | None:
        try:
            why = await sender.refusal(url)
        except (Unresolved, TimeoutError) as exc:
            log.warning("%s cannot be checked now (%s); each send checks it", where, exc or "timed out")
            return None
        return f"{where}: {why}" if why else None

    async def check() -> list[str]:
        found = [
            (f"orgs.{org.name}.apps.{app.name}.alerts.{n}.webhook", rule.webhook)
            for org in config.orgs
            for app in org.apps
            for n, rule in enumerate(app.alerts)
            if rule.webhook
        ]
        return [why for why in await asyncio.gather(*(one(where, url) for where, url in found)) if why]

    try:
        return asyncio.run(check())
    finally:
        sender.close()
