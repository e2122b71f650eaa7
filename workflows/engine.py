"""Relay's own DBOS application: launching it, starting and messaging its workflows, the sweep.

The engine is what the rest of Relay knows of its durable workflows: the
hub's :class:`relay.net.hub.HubEvents` (connections and disconnections) and
the domain's :class:`relay.domain.ports.Durable` (operator actions, adoption).

Hub events are queued and handled by a few workers, so a thousand executors
dropping at once (a network split, a load balancer restart) is a queue to
work through, not a thousand concurrent demands on the database pool. A
failed event is retried until it succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dbos import DBOS, DBOSConfig, SetWorkflowID
from dbos._error import DBOSNonExistentWorkflowError

from relay.core.ids import ExecutorKey, grace_id, recovery_id
from relay.store.apps import AppStore
from relay.store.executors import ExecutorStore
from relay.store.recoveries import RecoveryStore
from workflows import services as wf_services
from workflows.grace import RECONNECTED_TOPIC, grace_period
from workflows.recovery import WAKE_TOPIC, recover
from workflows.retention import job_id, retention

log = logging.getLogger("relay.durable")

EVENT_WORKERS = 8
DEFAULT_GRACE_SECS = 60.0

_Event = tuple[str, ExecutorKey, int, int | None]


class Engine:
    def __init__(
        self,
        database_url: str,
        instance_id: str,
        executors: ExecutorStore,
        recoveries: RecoveryStore,
        apps: AppStore,
    ) -> None:
        self.database_url = database_url
        self.instance_id = instance_id
        self.executors = executors
        self.recoveries = recoveries
        self.apps = apps
        self._events: asyncio.Queue[_Event] = asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []
        # Apps that may have a recovery waiting for a peer or an operator, so that
        # a connect to any other app costs no query. Filled at start-up, by a
        # recovery before it records itself blocked, and every few seconds from
        # the database (a recovery blocked on another instance); never emptied,
        # as a false "maybe" costs only one query.
        self._maybe_blocked: set[tuple[str, str]] = set()

    def note_blocked(self, org: str, app: str) -> None:
        self._maybe_blocked.add((org, app))

    # -- DBOS -------------------------------------------------------------------------

    def launch(self, services: wf_services.Services) -> None:
        """Start DBOS (blocking: run it in a thread); pending workflows of this instance
        (same executor id) resume at once."""
        wf_services.bind(services)
        config: DBOSConfig = {
            "name": "relay",
            "system_database_url": self.database_url,
            "application_version": wf_services.WORKFLOWS_VERSION,
            "executor_id": self.instance_id,
            "log_level": "WARNING",
            "sys_db_pool_size": 10,
        }
        DBOS(config=config)
        DBOS.launch()

    def destroy(self) -> None:
        # Workflows still waiting (grace periods, blocked recoveries) stay PENDING and
        # resume at the next start; DBOS logs each one's interruption as an error.
        logging.getLogger("dbos").setLevel(logging.CRITICAL)
        DBOS.destroy(workflow_completion_timeout_sec=0)
        wf_services.bind(None)

    # -- the event queue ---------------------------------------------------------------

    def start_workers(self, retention_interval_secs: float) -> None:
        self._workers = [asyncio.create_task(self._work()) for _ in range(EVENT_WORKERS)]
        self._workers.append(asyncio.create_task(self._schedule_retention(retention_interval_secs)))

    async def _schedule_retention(self, interval: float) -> None:
        """Start this interval's retention job (every instance asks; DBOS runs each id once)."""
        while True:
            workflow_id = job_id(interval)
            try:
                await _start(workflow_id, retention, int(time.time() * 1000))
            except Exception as exc:
                log.warning("cannot start the retention job %s: %s", workflow_id, exc)
            await asyncio.sleep(interval - time.time() % interval + 0.5)

    async def stop_workers(self) -> None:
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    async def _work(self) -> None:
        handlers: dict[str, Callable[[ExecutorKey, int, int | None], Awaitable[None]]] = {
            "lost": self._start_grace,
            "connected": self._reconnected,
        }
        while True:
            kind, key, epoch, previous = await self._events.get()
            delay = 0.2
            while True:
                try:
                    await handlers[kind](key, epoch, previous)
                    break
                except Exception as exc:
                    log.warning("executor %s: %s event failed (%s); retrying in %.1fs", key, kind, exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

    # -- HubEvents -----------------------------------------------------------------------

    async def executor_lost(self, key: ExecutorKey, epoch: int) -> None:
        self._events.put_nowait(("lost", key, epoch, None))

    async def executor_connected(self, key: ExecutorKey, epoch: int, previous_epoch: int | None) -> None:
        self._events.put_nowait(("connected", key, epoch, previous_epoch))

    async def _start_grace(self, key: ExecutorKey, epoch: int, _previous: int | None = None) -> None:
        """Start the grace period; its length is the app's setting at this moment."""
        app = await self.apps.get(key.org, key.app)
        timeout = app.executor_timeout_secs if app else DEFAULT_GRACE_SECS
        await _start(grace_id(key, epoch), grace_period, key.org, key.app, key.executor_id, epoch, timeout)

    async def _reconnected(self, key: ExecutorKey, epoch: int, previous: int | None) -> None:
        if previous is not None:  # the same executor was here before: end that disconnection's grace period
            await _send(grace_id(key, previous), {"reason": "reconnected", "epoch": epoch}, RECONNECTED_TOPIC)
        await self.wake_app(key.org, key.app, {"reason": "peer_connected", "peer": key.executor_id})

    # -- Durable ------------------------------------------------------------------------

    async def start_recovery(self, key: ExecutorKey, epoch: int, trigger: str) -> str:
        rid = recovery_id(key, epoch)
        await _start(rid, recover, key.org, key.app, key.executor_id, epoch, trigger)
        return rid

    async def end_grace(self, key: ExecutorKey, epoch: int, reason: str) -> None:
        await _send(grace_id(key, epoch), {"reason": reason}, RECONNECTED_TOPIC)

    async def wake_recovery(self, rid: str, message: dict[str, Any]) -> None:
        await _send(rid, message, WAKE_TOPIC)

    async def wake_app(self, org: str, app: str, message: dict[str, Any]) -> None:
        if (org, app) not in self._maybe_blocked:
            return
        for rid in await self.recoveries.blocked_in_app(org, app):
            await self.wake_recovery(rid, message)

    async def refresh_blocked(self) -> None:
        self._maybe_blocked.update(await self.recoveries.apps_with_blocked())

    async def take_over(self, instances: list[str]) -> None:
        """Hand the pending DBOS workflows of ``instances`` to DBOS's recovery (idempotent),
        then start the grace periods still missing."""
        handles = await asyncio.to_thread(DBOS._recover_pending_workflows, instances)
        log.info("instance %s: recovering %d workflows of %s", self.instance_id, len(handles), instances)
        await self.sweep()

    async def sweep(self) -> None:
        """Every DISCONNECTED executor this instance owns gets its grace period (idempotent);
        every app with a waiting recovery is noted for wake-ups."""
        await self.refresh_blocked()
        for key, epoch in await self.executors.disconnected_of_instance(self.instance_id):
            # Most already have theirs (resumed by DBOS, or recovered from an adopted instance).
            if await DBOS.get_workflow_status_async(grace_id(key, epoch)) is None:
                await self._start_grace(key, epoch)


async def _send(workflow_id: str, message: dict[str, Any], topic: str) -> None:
    try:
        await DBOS.send_async(workflow_id, message, topic)
    except DBOSNonExistentWorkflowError:
        log.debug("no workflow %s to tell %s", workflow_id, topic)


async def _start(workflow_id: str, fn: Any, *args: Any) -> None:
    # A workflow id names the disconnection or death it is for: starting it
    # twice (a retry, the start-up sweep) finds the first one. It runs as a
    # task on Relay's loop.
    with SetWorkflowID(workflow_id):
        await DBOS.start_workflow_async(fn, *args)
