"""Keys: generated, hashed, and looked up by hash.

Keys are stored and compared only as SHA-256 hex digests and never logged.
The lookup table is built from relay.yaml at start-up (the database holds a
copy for other instances and for audit), so a handshake costs no query.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Literal

from relay.config import RelayConfig

KeyKind = Literal["conductor", "api"]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh random key and its SHA-256 hex digest."""
    key = secrets.token_urlsafe(32)
    return key, hash_key(key)


@dataclass(frozen=True)
class KeyGrant:
    org: str
    kind: KeyKind
    name: str
    role: Literal["admin", "viewer"] | None


class KeyRing:
    def __init__(self, config: RelayConfig) -> None:
        self._grants: dict[str, KeyGrant] = {}
        for org in config.orgs:
            for ck in org.conductor_keys:
                self._grants[ck.sha256] = KeyGrant(org.name, "conductor", ck.name, None)
            for ak in org.api_keys:
                self._grants[ak.sha256] = KeyGrant(org.name, "api", ak.name, ak.role)

    def lookup(self, key: str, kind: KeyKind) -> KeyGrant | None:
        if not key:
            return None
        # Looking up the digest of the presented key, never the key itself:
        # timing reveals at most something about a hash, not about a key.
        grant = self._grants.get(hash_key(key))
        if grant is None or grant.kind != kind:
            return None
        return grant
