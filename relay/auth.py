"""Keys: generated, hashed, looked up by hash, and what each one may do.

Keys are stored and compared only as SHA-256 hex digests and never logged.
Each key has permissions from DBOS Conductor's catalogue and, optionally, the
list of apps it may touch. The lookup table is in memory, so a handshake or
an API call costs no query for its key.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class Permission(StrEnum):
    ORGANIZATION_READ = "organization.read"
    ORGANIZATION_WRITE = "organization.write"
    APPLICATION_READ = "application.read"
    APPLICATION_WRITE = "application.write"
    METRIC_READ = "metric.read"
    TOKEN_READ = "token.read"
    TOKEN_WRITE = "token.write"
    WEBSOCKET_CONNECT = "websocket.connect"


P = Permission
# relay.yaml's roles and conductor keys, as permission sets. An operator's admin key may do
# everything but connect executors: executors get keys of their own.
ADMIN = frozenset(Permission) - {P.WEBSOCKET_CONNECT}
VIEWER = frozenset({P.ORGANIZATION_READ, P.APPLICATION_READ, P.METRIC_READ, P.TOKEN_READ})
CONDUCTOR = frozenset({P.WEBSOCKET_CONNECT})
ROLES = {"admin": ADMIN, "viewer": VIEWER}


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh random key and its SHA-256 hex digest."""
    key = secrets.token_urlsafe(32)
    return key, hash_key(key)


# Keys Relay hands out (the tokens API, the first start, ``relay init``) start so: recognisable in a leak.
SECRET_PREFIX = "relay_"


def new_secret() -> str:
    return SECRET_PREFIX + new_key()[0]


def unauthorized(key: str) -> str:
    """The detail of a 401 for the bearer key a request sent (``""``: none). Conductor's clients show
    it (dbosctl prints the problem's title and detail, then its own "run `dbosctl login`"), and Relay
    has keys and no logins: it says what was wrong with what was sent and what to send instead."""
    sent = "no API key was sent as a bearer token" if not key else "the API key sent is not a key of this Relay"
    return f"{sent}: send a Relay API key as Authorization: Bearer <apiKey> (Relay has no user logins)"


@dataclass(frozen=True)
class KeyGrant:
    """What one key may do. ``key_id`` never changes (a rename keeps it); ``apps`` None means every app."""

    key_id: str
    org: str
    name: str
    permissions: frozenset[Permission]
    apps: frozenset[str] | None = None

    def allows(self, permission: Permission, app: str | None = None) -> bool:
        if permission not in self.permissions:
            return False
        return app is None or self.apps is None or app in self.apps


class KeyRing:
    """Grants by key hash, replaced whole when the keys change (:meth:`replace`)."""

    def __init__(self, grants: Iterable[tuple[str, KeyGrant]] = ()) -> None:
        self._grants: dict[str, KeyGrant] = dict(grants)

    def replace(self, grants: Iterable[tuple[str, KeyGrant]]) -> None:
        self._grants = dict(grants)

    def lookup(self, key: str) -> KeyGrant | None:
        if not key:
            return None
        # Looking up the digest of the presented key, never the key itself:
        # timing reveals at most something about a hash, not about a key.
        return self._grants.get(hash_key(key))

    def grant_of_digest(self, digest: str) -> KeyGrant | None:
        """The grant of the key whose SHA-256 is ``digest``, if it is still valid."""
        return self._grants.get(digest)

    def items(self) -> list[tuple[str, KeyGrant]]:
        return list(self._grants.items())

    def __len__(self) -> int:
        return len(self._grants)
