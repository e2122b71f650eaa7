"""The conductor and API keys the harness configures Relay with, and their hashes."""

from __future__ import annotations

import hashlib

CONDUCTOR_KEYS = {"acme": "ck-acme-secret", "globex": "ck-globex-secret"}
API_KEYS = {"acme": "api-acme-secret", "globex": "api-globex-secret"}
VIEWER_KEYS = {"acme": "api-acme-viewer"}


def sha(key: str) -> str:
    """The SHA-256 hex digest of a key, as Relay's configuration names keys."""
    return hashlib.sha256(key.encode()).hexdigest()
