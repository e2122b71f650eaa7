"""Operator actions: what the API (and the CLI through it) asks Relay to do.

Each action writes its change and its audit entry in one transaction, then
tells the durable layer (grace periods, recoveries) what changed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from relay.core.failover import OPERATOR_NUDGE
from relay.core.ids import ExecutorKey, printable
from relay.core.lifecycle import ExecutorEvent, ExecutorState
from relay.domain.ports import Durable
from relay.errors import Conflict, NotFound
from relay.logs import about
from relay.store.alerts import AlertStore
from relay.store.apps import AppRecord, AppStore, Conn
from relay.store.audit import AuditEntry, audit_executor, write_audit
from relay.store.db import Database
from relay.store.executors import ExecutorStore
from relay.store.recoveries import RecoveryStore

log = logging.getLogger("relay.recovery")

# What the workflow API's entries say of a change that was made (relay.api.common.audited);
# the apps' entries say it too, for a reader that filters on it.
SUCCEEDED = {"result": "success"}


# How long an operator's recover waits for the run's record before answering with its id.
RECORD_WAIT_SECS = 5.0


class RecoveryRuns(Durable, Protocol):
    """What an operator's recovery needs of the durable layer besides :class:`Durable`."""

    async def current_recovery(self, key: ExecutorKey, epoch: int) -> tuple[str, bool]:
        """The id of the death's live recovery run and True; else the id of its next run and False."""
        ...


class Operator:
    def __init__(
        self, db: Database, apps: AppStore, executors: ExecutorStore, recoveries: RecoveryStore, durable: RecoveryRuns
    ) -> None:
        self.db = db
        self.apps = apps
        self.executors = executors
        self.recoveries = recoveries
        self.durable = durable

    async def register_app(self, org: str, app: str, actor: str, changes: dict[str, Any] | None = None) -> bool:
        """Register an app ahead of its executors, with ``changes`` to its settings (as
        :meth:`update_settings`), in one transaction; False if it was registered already. Two
        transactions left an app with none of the settings asked for when the second failed, and
        answered 404 to the PUT that had just made it when a DELETE came between them."""
        async with self.db.transaction() as conn:
            created = await self.apps.register(conn, org, app)
            if not created and changes and await self.apps.lock_listed(conn, org, app) is None:
                # The insert found the app, and a DELETE ordered first removed it since: made again,
                # as a PUT after the DELETE makes it. Unlocked, the settings' update found no row,
                # and the PUT answered 404, as neither order would.
                created = await self.apps.register(conn, org, app)
            if created:
                await write_audit(conn, org, app, AuditEntry("application.create", actor, detail=SUCCEEDED))
            if changes:
                await self._change_settings(conn, org, app, changes, actor)
        if changes:
            await self.durable.wake_app(org, app, {"reason": "settings_updated"})
        return created

    async def delete_app(self, org: str, app: str, actor: str) -> None:
        """Forget an app; refused while the registry holds any executor of it, and for an app that
        relay.yaml lists (its executors would register it again with default settings, and its
        rules from the file would be gone until the next start)."""
        async with self.db.transaction() as conn:
            # The app's row first, then its rules (by id): the order of every path that locks both.
            # Read unlocked, relay.yaml's sync could list the app after the check, and it was deleted.
            listed = await self.apps.lock_listed(conn, org, app)
            if listed is None:
                raise NotFound(f"no app {app!r} in org {org!r}")
            if listed:
                raise Conflict("defined_in_config", f"app {app!r} is listed in relay.yaml; take it out there first")
            # Its alert rules go with it: the alerts they left open are resolved (rolled back with the
            # rest if the app cannot be deleted).
            rules = await AlertStore.app_rule_ids(conn, org, app)
            if rules:
                await AlertStore.removing(conn, rules, f"its app {app} was deleted (by {actor})")
            if not await self.apps.delete(conn, org, app):
                raise Conflict("app_has_executors", f"app {app!r} still has executors in the registry")
            await write_audit(conn, org, app, AuditEntry("application.delete", actor, detail=SUCCEEDED))

    async def update_settings(self, org: str, app: str, changes: dict[str, Any], actor: str) -> AppRecord:
        """Change an app's settings (snake_case column names); a running grace period keeps its value."""
        async with self.db.transaction() as conn:
            after = await self._change_settings(conn, org, app, changes, actor)
        # A recovery waiting for an operator may now be allowed to go on.
        await self.durable.wake_app(org, app, {"reason": "settings_updated"})
        return after

    async def _change_settings(self, conn: Conn, org: str, app: str, changes: dict[str, Any], actor: str) -> AppRecord:
        before = await self.apps.get(org, app, conn)
        if before is None:
            raise NotFound(f"no app {app!r} in org {org!r}")
        if not await self.apps.update(conn, org, app, changes):
            # Deleted since it was read: the update waited for the deletion, then found no row.
            raise NotFound(f"no app {app!r} in org {org!r}")
        after = await self.apps.get(org, app, conn)
        assert after is not None
        detail = {"before": before.settings(), "after": after.settings()}
        await write_audit(conn, org, app, AuditEntry("settings.updated", actor, detail=detail))
        return after

    async def recover(self, key: ExecutorKey, actor: str, to_latest_version: bool) -> tuple[str, bool]:
        """An operator's recovery: skips the rest of a grace period, nudges a running recovery, or
        starts a new run of one that ended without finishing; returns the run's id, and whether
        this began it (False: a run was live already, and is woken to try again now).

        Refused for a HEALTHY executor: recovering it would re-run the workflows it is running.
        """
        rec = await self.executors.get(key)
        if rec is None:
            raise NotFound(f"no executor {key.executor_id!r} in {key.org}/{key.app}")
        if rec.state is ExecutorState.HEALTHY:
            raise Conflict(
                "executor_healthy", "the executor is connected; recovering it would re-run workflows it is running"
            )
        rid, live = await self.durable.current_recovery(key, rec.epoch)
        async with self.db.fenced() as conn:
            if rec.state is ExecutorState.DISCONNECTED:
                event = ExecutorEvent.DECLARED_DEAD
                if not await self.executors.apply(key, event, epoch=rec.epoch, expected=rec.state, conn=conn):
                    raise Conflict("state_changed", "the executor's state changed meanwhile; look again")
                dead = f"manual:{key}:{rec.epoch}:dead"
                await audit_executor(conn, key, "executor.dead", dead, detail={"epoch": rec.epoch}, actor=actor)
            detail = {"recoveryId": rid, "toLatestVersion": to_latest_version, "newRun": not live}
            await audit_executor(conn, key, "recovery.manual_requested", None, detail=detail, actor=actor)
        if rec.state is ExecutorState.DISCONNECTED:
            log.info(
                "executor %s is DEAD (epoch %d): declared by %s", key, rec.epoch, printable(actor), extra=about(key)
            )
        log.info(
            "recovery %s of executor %s requested by %s", rid, key, printable(actor), extra=about(key, recoveryId=rid)
        )
        if not live:
            # The id named above, unless another start (the repair sweep, the grace period's
            # deadline) took it first: then it is that one's run, and it is live.
            await self.durable.start_recovery(key, rec.epoch, "operator")
        if rec.state is ExecutorState.DISCONNECTED:
            await self.durable.end_grace(key, rec.epoch, "operator recovery")
        # A new run reads the message when it first waits (an operator's permission to move
        # onto the latest version reaches it so); a run in its backoff stops waiting.
        await self.durable.wake_recovery(rid, {"reason": OPERATOR_NUDGE, "toLatestVersion": to_latest_version})
        await self._until_recorded(rid)
        return rid, not live

    async def _until_recorded(self, rid: str) -> None:
        """Wait (up to RECORD_WAIT_SECS) for the run's record, which its workflow's first step
        writes: the id handed to the operator then reads as a recovery at once, not 404 while
        the workflow starts (seen under load in CI). Past the wait the id is answered anyway."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RECORD_WAIT_SECS
        while True:  # polled: the record is written in another task's transaction
            if await self.recoveries.recorded(rid) or loop.time() >= deadline:
                return
            await asyncio.sleep(0.02)
