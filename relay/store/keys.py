"""Keys as grants: relay.yaml's bootstrap keys (and, with the tokens API, the database's)."""

from __future__ import annotations

from relay.auth import CONDUCTOR, ROLES, KeyGrant, Permission
from relay.config import KeyConfig, RelayConfig


def _grant(org: str, kind: str, key: KeyConfig, default: frozenset[Permission]) -> tuple[str, KeyGrant]:
    permissions = frozenset(key.permissions) if key.permissions is not None else default
    apps = frozenset(key.apps) if key.apps is not None else None
    return key.sha256, KeyGrant(f"config:{org}:{kind}:{key.name}", org, key.name, permissions, apps)


def grants_from_config(config: RelayConfig) -> list[tuple[str, KeyGrant]]:
    """relay.yaml's keys: a conductor key may connect executors; an API key has its role's permissions."""
    grants = []
    for org in config.orgs:
        grants += [_grant(org.name, "conductor", key, CONDUCTOR) for key in org.conductor_keys]
        grants += [_grant(org.name, "api", key, ROLES[key.role]) for key in org.api_keys]
    return grants
