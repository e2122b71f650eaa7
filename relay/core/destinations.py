"""Where Relay may send a webhook: the allow-list of destinations (pure).

A key holder who may create alert rules chooses a URL, and Relay, from inside
the operator's network, sends to it. Without a limit that is a way to reach
internal services (a database's HTTP port, a cloud's metadata address). So a
destination is allowed when:

- its host name is listed (``hooks.internal``, or ``*.example.com`` for any name under it; an
  internationalised name is compared in its IDNA form), or
- the address it resolves to is in a listed network (``10.1.2.3``, ``10.0.0.0/8``, ``::1``), or
- the address is public (``allow_public``, the default), which excludes private, loopback,
  link-local (the metadata address 169.254.169.254 among them), shared, reserved and
  multicast addresses.

An IPv6 address that carries an IPv4 address is judged by it too: IPv4-mapped
(``::ffff:10.0.0.1``), IPv4-compatible (``::7f00:1``, deprecated but still
reaching 127.0.0.1 on some stacks), IPv4-translated (``::ffff:0:7f00:1``) and
NAT64 (``64:ff9b::a00:1``, which a NAT64 gateway turns into 10.0.0.1) are the
IPv4 address (``::`` and ``::1`` stay the unspecified and loopback addresses); a 6to4 (``2002:a00:1::1``) or Teredo
address, reached through the IPv4 address it embeds, is public only if that is.
The local-use NAT64 prefix (``64:ff9b:1::/48``) embeds its IPv4 address where
the network chooses, so it is never public: only a listed network allows it.

The caller resolves the name and asks about *every* address it got (a name may
resolve to a public and a private address); :mod:`relay.net.webhook` then
connects to an address it checked, so the name cannot resolve to something
else between the check and the connection (DNS rebinding).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


ToAscii = Callable[[str], str]


def ascii_only(host: str) -> str:
    """``host`` if it is ASCII; an internationalised name needs a converter to its IDNA form
    (:func:`relay.config.ascii_host`: the core imports nothing beyond the standard library)."""
    if not host.isascii():
        raise ValueError("an internationalised host name needs its IDNA form (xn--...)")
    return host


def parse_entry(entry: str, to_ascii: ToAscii = ascii_only) -> Network | str:
    """One entry of ``alerts.allowedDestinations``: a network (an address is a /32 or /128) or a
    host name (lower case, in its IDNA form by ``to_ascii``; ``*.`` in front for any name under a
    domain). Raises ValueError."""
    text = entry.strip()
    if not text:
        raise ValueError("an empty entry")
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        pass
    name = text.lower().rstrip(".")
    under = "*." if name.startswith("*.") else ""
    try:
        name = under + to_ascii(name.removeprefix("*."))
    except ValueError as exc:
        raise ValueError(f"{entry!r} is not a valid internationalised host name ({exc})") from exc
    labels = name.removeprefix("*.").split(".")
    if not all(label and len(label) <= 63 and label.replace("-", "").isalnum() for label in labels):
        raise ValueError(f"{entry!r} is neither an address, a network (10.0.0.0/8) nor a host name (*.example.com)")
    return name


NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: the IPv4 address is the last 32 bits
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # RFC 4291 (deprecated): ::a.b.c.d
IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")  # RFC 2765 (SIIT): ::ffff:0:a.b.c.d
LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215: where it is, the network decides


def _unmapped(address: Address) -> Address:
    """An IPv4 address written as IPv6 (``::ffff:10.0.0.1``, ``::10.0.0.1``, ``::ffff:0:10.0.0.1``,
    or ``64:ff9b::a00:1`` through NAT64) is judged as the IPv4 address it is."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        compatible = address in IPV4_COMPATIBLE and int(address) > 1  # not :: (unspecified), ::1 (loopback)
        if compatible or address in IPV4_TRANSLATED or address in NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def _embedded(address: Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address is reached through: a 6to4 router, a Teredo server and client."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    if address.sixtofour is not None:
        return [address.sixtofour]
    return list(address.teredo or ())


def is_public(address: Address) -> bool:
    address = _unmapped(address)
    if address in LOCAL_NAT64:
        return False
    return address.is_global and not address.is_multicast and all(is_public(v4) for v4 in _embedded(address))


@dataclass(frozen=True)
class DestinationPolicy:
    networks: tuple[Network, ...] = ()
    hosts: tuple[str, ...] = ()
    allow_public: bool = True

    @classmethod
    def from_entries(
        cls, entries: Iterable[str], allow_public: bool = True, to_ascii: ToAscii = ascii_only
    ) -> DestinationPolicy:
        parsed = [parse_entry(e, to_ascii) for e in entries]
        return cls(
            tuple(p for p in parsed if not isinstance(p, str)),
            tuple(p for p in parsed if isinstance(p, str)),
            allow_public,
        )

    def host_listed(self, host: str) -> bool:
        name = host.lower().rstrip(".")
        return any(name == h or (h.startswith("*.") and name.endswith(h[1:])) for h in self.hosts)

    def refusal(self, host: str, address: Address) -> str | None:
        """Why ``address`` (which ``host`` resolved to) may not be sent to; None if it may."""
        if self.host_listed(host):
            return None
        plain = _unmapped(address)
        if any(a in network for a in {address, plain} for network in self.networks if network.version == a.version):
            return None
        if self.allow_public and is_public(plain):
            return None
        what = "a public address" if is_public(plain) else _kind(plain)
        where = f"{plain} is" if host.strip("[]") == str(address) else f"{host} resolves to {plain},"
        return f"{where} {what}, which alerts.allowedDestinations does not list"

    def check(self, host: str, addresses: Iterable[Address]) -> str | None:
        """Why this destination is refused (the first address refused), or None if every one is allowed."""
        found = list(addresses)
        if not found:
            return f"{host} resolves to no address"
        for address in found:
            reason = self.refusal(host, address)
            if reason is not None:
                return reason
        return None


def _kind(address: Address) -> str:
    if address in LOCAL_NAT64:
        return "a local-use NAT64 address"
    inside = [v4 for v4 in _embedded(address) if not is_public(v4)]
    if inside:
        return f"an address reached through {inside[0]}, {_kind(inside[0])}"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address (cloud metadata services live there)"
    if address.is_private:
        return "a private address"
    if address.is_multicast:
        return "a multicast address"
    return "a reserved address"
