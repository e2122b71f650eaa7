"""Sending a webhook: one POST, to an address the allow-list allows, and nothing more.

- The host name is resolved at send time and every address it resolves to is
  checked (:class:`relay.core.destinations.DestinationPolicy`); the request
  then goes to the first of those checked addresses, with the name in the
  ``Host`` header and as the TLS server name (certificates are verified
  against it). A name that resolves elsewhere a moment later (DNS rebinding)
  changes nothing: no second lookup is made.
- Redirects are not followed (a 3xx is a failed delivery); proxies from the
  environment are not used; the whole attempt is bounded by a timeout.
- Only the status line is read: the response body is never read or logged.
- Errors name the host, never the URL: its path or query may hold a secret (a
  Slack webhook's token does).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx

from relay.config import webhook_problem
from relay.core.alerts import retryable_status
from relay.core.destinations import Address, DestinationPolicy

# httpx logs every request's URL at INFO (httpcore its details at DEBUG), and a webhook's URL may
# hold a secret: neither logs below WARNING, whatever Relay's log level.
for _library in ("httpx", "httpcore"):
    logging.getLogger(_library).setLevel(logging.WARNING)

Resolver = Callable[[str, int], Awaitable[list[Address]]]


async def resolve(host: str, port: int) -> list[Address]:
    """Every address ``host`` resolves to (an address resolves to itself)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[Address] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in found:
            found.append(address)
    return found


class Unresolved(Exception):
    """The webhook's host name did not resolve (DNS may be back at the next attempt)."""


@dataclass(frozen=True)
class Attempt:
    """What one POST came to: sent, or why not and whether another try may do better."""

    ok: bool
    retry: bool = False
    error: str | None = None
    status: int | None = None


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
        self, policy: DestinationPolicy, timeout_secs: float, user_agent: str, resolver: Resolver = resolve
    ) -> None:
        self.policy = policy
        self.timeout = timeout_secs
        self.user_agent = user_agent
        self.resolver = resolver

    async def _addresses(self, url: str) -> tuple[list[Address], str | None]:
        """The checked addresses of the URL's host, or why it may not be sent to. Raises
        :class:`Unresolved` when the name cannot be resolved (which may pass)."""
        problem = webhook_problem(url)
        if problem:
            return [], problem
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = await self.resolver(host, port)
        except (OSError, UnicodeError) as exc:
            raise Unresolved(f"{host} cannot be resolved ({type(exc).__name__})") from exc
        return addresses, self.policy.check(host, addresses)

    async def check(self, url: str) -> str | None:
        """Why a webhook may not be sent to now (a rule is refused for it), or None."""
        try:
            async with asyncio.timeout(self.timeout):
                return (await self._addresses(url))[1]
        except Unresolved as exc:
            return str(exc)
        except TimeoutError:
            return f"{describe(url)}: resolving its host timed out"

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Attempt:
        host = describe(url)
        try:
            async with asyncio.timeout(self.timeout):
                addresses, refused = await self._addresses(url)
                if refused is not None:
                    return Attempt(False, error=refused)
                status = await self._send(url, addresses[0], body, headers)
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

    async def _send(self, url: str, address: Address, body: bytes, headers: Mapping[str, str]) -> int:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        literal = f"[{address}]" if address.version == 6 else str(address)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{literal}:{port}" if userinfo else f"{literal}:{port}"
        pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
        default_port = port == (443 if parts.scheme == "https" else 80)
        host_header = (f"[{host}]" if ":" in host else host) + ("" if default_port else f":{port}")
        extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
        async with (
            httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=self.timeout) as client,
            client.stream(
                "POST",
                pinned,
                content=body,
                headers={
                    **headers,
                    "Host": host_header,
                    "Content-Type": "application/json",
                    "User-Agent": self.user_agent,
                },
                extensions=extensions,
            ) as response,
        ):
            return response.status_code


def _without(text: str, url: str) -> str:
    """An error's text with the URL (and its path) taken out."""
    parts = urlsplit(url)
    for secret in (url, parts.path, parts.query):
        if secret and secret != "/":
            text = text.replace(secret, "...")
    return text
