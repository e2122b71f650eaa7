"""Keys (Conductor's "tokens"): relay.yaml's bootstrap keys and the ones the tokens API creates.

Every key has a permanent id (a rename keeps it; executors are bound to it),
a name unique in its org, the SHA-256 of its secret (the secret itself is
never stored), Conductor's permissions and an optional list of apps. The
in-memory :class:`relay.auth.KeyRing` is loaded from here. ``source`` says where
a key came from: ``config`` (relay.yaml), ``api`` (the tokens API) or
``generated`` (the first start with no configured org, :mod:`relay.domain.firstrun`).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from relay.auth import CONDUCTOR, ROLES, KeyGrant, Permission
from relay.config import KeyConfig, RelayConfig
from relay.store.audit import AuditEntry, write_audit
from relay.store.db import Database

Conn = psycopg.AsyncConnection[dict[str, Any]]
# Held while an instance writes relay.yaml's keys or decides whether to make the first keys (any
# fixed number other than the migrations' lock): instances starting together on one database take
# turns, and make the first keys once.
KEYS_LOCK_KEY = 7_215_420_113_002
FIRST_RUN_ACTOR = "relay:first-run"
# Who removes a key that relay.yaml no longer has (its audit entry's actor).
CONFIG_ACTOR = "relay.yaml"

log = logging.getLogger("relay.keys")


@dataclass(frozen=True)
class NewKey:
    name: str
    sha256: str
    permissions: list[Permission]


@dataclass(frozen=True)
class TokenRecord:
    id: str
    org: str
    name: str
    permissions: list[Permission]
    apps: list[str] | None
    source: str
    created_at: datetime
    created_by: str | None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TokenRecord:
        return cls(
            id=row["id"],
            org=row["org"],
            name=row["name"],
            permissions=sorted(Permission(p) for p in row["permissions"] if p in Permission._value2member_map_),
            apps=row["apps"],
            source=row["source"],
            created_at=row["created_at"],
            created_by=row["created_by"],
        )

    def grant(self) -> KeyGrant:
        return KeyGrant(self.id, self.org, self.name, frozenset(self.permissions), _apps(self.apps))


def _config_rows(config: RelayConfig) -> list[tuple[str, str, str, str, list[str], list[str] | None]]:
    """(id, org, name, sha256, permissions, apps) of relay.yaml's keys."""

    def row(org: str, kind: str, key: KeyConfig, default: frozenset[Permission]) -> Any:
        permissions = sorted(key.permissions) if key.permissions is not None else sorted(default)
        return (f"config:{org}:{kind}:{key.name}", org, key.name, key.sha256, permissions, key.apps)

    rows = []
    for org in config.orgs:
        rows += [row(org.name, "conductor", key, CONDUCTOR) for key in org.conductor_keys]
        rows += [row(org.name, "api", key, ROLES[key.role]) for key in org.api_keys]
    return rows


def _apps(apps: list[str] | None) -> frozenset[str] | None:
    return frozenset(apps) if apps is not None else None


def grants_from_config(config: RelayConfig) -> list[tuple[str, KeyGrant]]:
    """relay.yaml's keys as grants (before the database is reached)."""
    return [
        # ``apps: []`` is a key for no app, as the database's copy of it reads (TokenRecord.grant).
        (sha, KeyGrant(key_id, org, name, frozenset(Permission(p) for p in perms), _apps(apps)))
        for key_id, org, name, sha, perms, apps in _config_rows(config)
    ]


_COLUMNS = "id, org, name, permissions, apps, source, created_at, created_by"


class KeyStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def sync_config(self, config: RelayConfig, conn: Conn | None = None) -> None:
        """Make relay.yaml's keys in the database match the file (keys removed from it stop working),
        in ``conn``'s transaction if given (:func:`relay.store.configsync.sync_config`)."""
        rows = _config_rows(config)
        async with self.db.transaction(conn) as conn:
            # Two instances inserting the same key at once collide on its secret's unique index
            # (ON CONFLICT covers the id only): one of them failed to start.
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (KEYS_LOCK_KEY,))
            cur = await conn.execute(
                "DELETE FROM tokens WHERE source = 'config' AND NOT (id = ANY(%s)) RETURNING org, name",
                ([r[0] for r in rows],),
            )
            # Every instance shares the keys: one started with another relay.yaml (or none) takes the
            # file's keys from all of them, so it says so, in the log and in the audit log.
            for removed in await cur.fetchall():
                org, name = str(removed["org"]), str(removed["name"])
                log.warning("key %r of org %r is not in this instance's relay.yaml: it no longer works, on any "
                            "instance (give every instance the same relay.yaml)", name, org)  # fmt: skip
                detail = {"tokenName": name, "source": "config", "reason": "not in the relay.yaml of this instance"}
                await write_audit(conn, org, None, AuditEntry("token.deleted", CONFIG_ACTOR, detail=detail))
            for row in rows:
                # A key moved from relay.yaml into the API (or the other way) keeps one row per secret.
                await conn.execute("DELETE FROM tokens WHERE sha256 = %s AND id <> %s", (row[3], row[0]))
                await conn.execute(
                    """INSERT INTO tokens (id, org, name, sha256, permissions, apps, source)
                       VALUES (%s, %s, %s, %s, %s, %s, 'config')
                       ON CONFLICT (id) DO UPDATE SET sha256 = EXCLUDED.sha256,
                           permissions = EXCLUDED.permissions, apps = EXCLUDED.apps""",
                    row,
                )

    async def create_first_keys(self, org: str, keys: list[NewKey]) -> bool:
        """If the database holds no key at all, make ``org`` and ``keys`` (source ``generated``) and
        return True. Under an advisory lock, so that of several instances starting together on one
        empty database exactly one makes them and the others find them."""
        async with self.db.transaction() as conn:
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (KEYS_LOCK_KEY,))
            cur = await conn.execute("SELECT 1 FROM tokens LIMIT 1")
            if await cur.fetchone() is not None:
                return False
            await conn.execute("INSERT INTO orgs (name) VALUES (%s) ON CONFLICT DO NOTHING", (org,))
            for key in keys:
                permissions = [p.value for p in key.permissions]
                await conn.execute(
                    """INSERT INTO tokens (id, org, name, sha256, permissions, apps, source, created_by)
                       VALUES (%s, %s, %s, %s, %s, NULL, 'generated', %s)""",
                    (str(uuid.uuid4()), org, key.name, key.sha256, permissions, FIRST_RUN_ACTOR),
                )
                detail = {"tokenName": key.name, "permissions": permissions, "appNames": None}
                await write_audit(conn, org, None, AuditEntry("token.created", FIRST_RUN_ACTOR, detail=detail))
        return True

    async def generated(self) -> list[TokenRecord]:
        """The keys the first start made that still exist."""
        async with self.db.connection() as conn:
            cur = await conn.execute(f"SELECT {_COLUMNS} FROM tokens WHERE source = 'generated' ORDER BY org, name")
            return [TokenRecord.from_row(r) for r in await cur.fetchall()]

    async def grants(self) -> list[tuple[str, KeyGrant]]:
        """Every key, as (sha256, grant), for the key ring."""
        async with self.db.connection() as conn:
            cur = await conn.execute(f"SELECT sha256, {_COLUMNS} FROM tokens")
            return [(str(r["sha256"]), TokenRecord.from_row(r).grant()) for r in await cur.fetchall()]

    async def fingerprint(self) -> str:
        """Changes whenever a key is added, removed or changed: a cheap poll for the key ring."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT count(*) || ':' || coalesce(md5(string_agg(id || sha256 || name || permissions::text
                          || coalesce(apps::text, '*'), ',' ORDER BY id)), '') AS f FROM tokens"""
            )
            row = await cur.fetchone()
        return str(row["f"]) if row else ""

    async def list_tokens(
        self, org: str, limit: int, offset: int, within: frozenset[str] | None = None
    ) -> list[TokenRecord]:
        """A page of the org's keys; with ``within``, only the keys scoped to some of those apps
        (what a key scoped to them may see). Filtered here, so that the pages stay whole."""
        scope = sorted(within) if within is not None else None
        async with self.db.connection() as conn:
            cur = await conn.execute(
                f"""SELECT {_COLUMNS} FROM tokens
                    WHERE org = %s AND (%s::text[] IS NULL OR (apps IS NOT NULL AND apps <@ %s::text[]))
                    ORDER BY name, id LIMIT %s OFFSET %s""",
                (org, scope, scope, limit, offset),
            )
            return [TokenRecord.from_row(r) for r in await cur.fetchall()]

    async def record(self, key_id: str) -> TokenRecord | None:
        """The key with this id, whatever its name now; None once it is gone."""
        async with self.db.connection() as conn:
            cur = await conn.execute(f"SELECT {_COLUMNS} FROM tokens WHERE id = %s", (key_id,))
            row = await cur.fetchone()
            return TokenRecord.from_row(row) if row else None

    @staticmethod
    async def get(conn: Conn, org: str, name: str) -> TokenRecord | None:
        cur = await conn.execute(
            f"SELECT {_COLUMNS} FROM tokens WHERE org = %s AND name = %s ORDER BY source = 'config' LIMIT 1",
            (org, name),
        )
        row = await cur.fetchone()
        return TokenRecord.from_row(row) if row else None

    @staticmethod
    async def create(
        conn: Conn,
        org: str,
        name: str,
        sha256: str,
        permissions: list[Permission],
        apps: list[str] | None,
        created_by: str,
    ) -> TokenRecord | None:
        """A new key; None if the org already has a key of that name."""
        cur = await conn.execute(
            f"""INSERT INTO tokens (id, org, name, sha256, permissions, apps, source, created_by)
                SELECT %s, %s, %s, %s, %s, %s, 'api', %s
                WHERE NOT EXISTS (SELECT 1 FROM tokens WHERE org = %s AND name = %s)
                ON CONFLICT DO NOTHING RETURNING {_COLUMNS}""",
            (str(uuid.uuid4()), org, name, sha256, [p.value for p in permissions], apps, created_by, org, name),
        )
        row = await cur.fetchone()
        return TokenRecord.from_row(row) if row else None

    @staticmethod
    async def rename(conn: Conn, key_id: str, new_name: str) -> bool:
        cur = await conn.execute(
            """UPDATE tokens SET name = %s WHERE id = %s AND NOT EXISTS (
                   SELECT 1 FROM tokens t WHERE t.org = tokens.org AND t.name = %s)""",
            (new_name, key_id, new_name),
        )
        return cur.rowcount == 1

    @staticmethod
    async def delete(conn: Conn, key_id: str) -> bool:
        cur = await conn.execute("DELETE FROM tokens WHERE id = %s", (key_id,))
        return cur.rowcount == 1
