"""Keys managed at run time (Conductor's tokens API), and every instance's view of them.

Creating, renaming and deleting a key each write the change and its audit
entry in one transaction. Every instance reloads the key ring when the keys
change (it polls a fingerprint every :data:`REFRESH_SECS`), so a deleted key
is refused everywhere within a second or two, and the sockets it opened are
closed: those executors then go through their grace period like any other
lost connection. So are the sockets of a key whose secret was rotated or whose
permissions or apps were narrowed in relay.yaml.

A key that may write keys acts only on keys within its own powers: it creates,
renames and deletes keys whose permissions it holds and, if it is scoped to
apps, keys scoped to some of its apps; it lists only those, if it is scoped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

from relay.auth import KeyGrant, KeyRing, Permission, hash_key, new_secret
from relay.errors import Conflict, DatabaseError, Forbidden, NotFound
from relay.logs import FailureLog
from relay.net.hub import Hub
from relay.store.audit import AuditEntry, write_audit
from relay.store.db import Database
from relay.store.keys import Conn, KeyStore, TokenRecord

log = logging.getLogger("relay.tokens")

REFRESH_SECS = 1.0


@dataclass(frozen=True)
class Created:
    record: TokenRecord
    secret: str  # shown once, never stored


class Tokens:
    def __init__(self, db: Database, keys: KeyStore, keyring: KeyRing, hub: Hub) -> None:
        self.db = db
        self.keys = keys
        self.keyring = keyring
        self.hub = hub
        self._fingerprint = ""
        self._task: asyncio.Task[None] | None = None

    async def create(
        self, org: str, name: str, apps: list[str] | None, permissions: list[Permission] | None, creator: KeyGrant
    ) -> Created:
        """A new key with at most the creator's powers over the API: its permissions and apps may not
        exceed the creator's (a key that may create keys cannot mint a stronger one). As with DBOS
        Conductor, no permissions given means ``websocket.connect`` (a key for executors), which any
        key that may write keys may give; no apps means every app (the creator's, if it has a list)."""
        wanted = frozenset(permissions) if permissions is not None else frozenset({Permission.WEBSOCKET_CONNECT})
        grantable = creator.permissions | {Permission.WEBSOCKET_CONNECT}
        if not wanted <= grantable:
            missing = ", ".join(sorted(p.value for p in wanted - grantable))
            raise Conflict("permission_not_held", f"a key cannot grant what it does not have: {missing}")
        if creator.apps is not None:
            if apps is None:
                apps = sorted(creator.apps)
            elif not set(apps) <= creator.apps:
                raise Conflict("app_not_held", "a key scoped to apps can only create keys for those apps")
        secret = new_secret()
        async with self.db.transaction() as conn:
            record = await self.keys.create(
                conn, org, name, hash_key(secret), sorted(wanted), apps, f"api:{creator.name}"
            )
            if record is None:
                raise Conflict("name_taken", f"org {org!r} already has a key named {name!r}")
            detail = {"tokenName": name, "permissions": [p.value for p in record.permissions], "appNames": apps}
            await write_audit(conn, org, None, AuditEntry("token.created", f"api:{creator.name}", detail=detail))
        await self.refresh()
        return Created(record, secret)

    async def rename(self, org: str, name: str, new_name: str, caller: KeyGrant) -> TokenRecord:
        actor = f"api:{caller.name}"
        async with self.db.transaction() as conn:
            record = await self._own(conn, org, name, caller)
            if not await self.keys.rename(conn, record.id, new_name):
                raise Conflict("name_taken", f"org {org!r} already has a key named {new_name!r}")
            detail = {"tokenName": name, "newName": new_name}
            await write_audit(conn, org, None, AuditEntry("token.renamed", actor, detail=detail))
        await self.refresh()
        return dataclasses.replace(record, name=new_name)

    async def delete(self, org: str, name: str, caller: KeyGrant) -> None:
        actor = f"api:{caller.name}"
        async with self.db.transaction() as conn:
            record = await self._own(conn, org, name, caller)
            await self.keys.delete(conn, record.id)
            await write_audit(conn, org, None, AuditEntry("token.deleted", actor, detail={"tokenName": name}))
        await self.refresh()

    async def _own(self, conn: Conn, org: str, name: str, caller: KeyGrant) -> TokenRecord:
        """The key named ``name``, if ``caller`` may rename or delete it: it exists, is within the
        caller's powers (the caller could have created it) and is managed here, not in relay.yaml.
        Without the second rule a key scoped to one app could delete the org's admin keys."""
        record = await self.keys.get(conn, org, name)
        if record is None or not listed_for(caller, record):
            # A key the caller may not list is one it cannot tell from a missing one: a 403 would
            # tell a key scoped to apps which names its org's other keys have.
            raise NotFound(f"no key named {name!r} in org {org!r}")
        beyond = beyond_powers(caller, record)
        if beyond:
            raise Forbidden(f"key {name!r} {beyond}: this API key cannot change it")
        if record.source == "config":
            raise Conflict("defined_in_config", f"key {name!r} is defined in relay.yaml; change it there")
        return record

    # -- every instance's key ring ------------------------------------------------

    async def refresh(self) -> None:
        """Reload the key ring if the keys changed; close the sockets it no longer admits (their key
        deleted, its secret rotated, or its permissions or apps narrowed)."""
        fingerprint = await self.keys.fingerprint()
        if fingerprint == self._fingerprint:
            return
        self.keyring.replace(await self.keys.grants())
        self._fingerprint = fingerprint
        await self.hub.close_unadmitted()

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        told = FailureLog(log, "cannot reload the keys", "the keys are reloaded again")
        while True:
            await asyncio.sleep(REFRESH_SECS)
            try:
                await self.refresh()
                told.worked()
            except DatabaseError as exc:
                told.failed(exc)
            except Exception:  # a bug: logged, and the next round tries again (a dead watcher misses every revocation)
                log.exception("cannot reload the keys")


def listed_for(caller: KeyGrant, record: TokenRecord) -> bool:
    """Whether ``GET /tokens`` shows the key ``record`` to ``caller``: every key to a caller that
    reaches every app, the keys scoped to some of its apps to one scoped to apps (as
    :meth:`relay.store.keys.KeyStore.list_tokens` filters)."""
    return caller.apps is None or (record.apps is not None and set(record.apps) <= caller.apps)


def beyond_powers(caller: KeyGrant, record: TokenRecord) -> str | None:
    """How the key ``record`` exceeds ``caller``'s powers, or None if it does not: the rule of
    :meth:`Tokens.create` (its permissions held by the caller, ``websocket.connect`` aside; if the
    caller is scoped to apps, scoped to some of them)."""
    extra = set(record.permissions) - caller.permissions - {Permission.WEBSOCKET_CONNECT}
    if extra:
        return "has permissions this API key lacks: " + ", ".join(sorted(p.value for p in extra))
    if caller.apps is not None:
        if record.apps is None:
            return "reaches every app, and this API key is scoped to apps"
        if not set(record.apps) <= caller.apps:
            return "reaches apps outside this API key's scope"
    return None
