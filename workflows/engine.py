"""Relay's own DBOS application: launching it, starting and messaging its workflows, the repair sweep.

The engine is what the rest of Relay knows of its durable workflows: the
hub's :class:`relay.net.hub.HubEvents` (connections and disconnections) and
the domain's :class:`relay.domain.ports.Durable` (operator actions, adoption).

A disconnection's grace period is started by :class:`workflows.gracestart.GraceStarter`,
which puts the ones that arrive together in one transaction, so a thousand
executors dropping at once (a network split, a load balancer restart) are a
few transactions, not a thousand. Reconnections are queued and handled by a
few workers, not a thousand concurrent demands on the database pool. A failed
start or event is retried until it succeeds.

The repair sweep (:meth:`Engine.repair`), at start-up and every
``repairIntervalSecs``, makes sure that every executor this instance owns
that is not HEALTHY has its workflow running: a grace period for a
DISCONNECTED one, a recovery for a DEAD or RECOVERING one. A workflow can
end without finishing its job (in ERROR, cancelled by an operator with
DBOS's tools, dead-lettered by DBOS), or never have been started (a crash
between two writes); without the sweep its executor would stay where it is
for good.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import sqlalchemy as sa
from dbos import DBOS, DBOSConfig, SetWorkflowID
from dbos._error import DBOSNonExistentWorkflowError
from dbos._serialization import WorkflowInputs

from relay.config import ReconcilerConfig
from relay.core.appfigures import Window
from relay.core.ids import ExecutorKey, grace_id, recovery_id, recovery_run
from relay.core.lifecycle import ExecutorEvent, ExecutorState
from relay.core.requestid import serving
from relay.errors import DatabaseError
from relay.logs import FailureLog
from relay.store.apps import AppStore
from relay.store.db import with_tcp_settings
from relay.store.executors import ExecutorStore, Unfinished
from relay.store.recoveries import RecoveryStore
from workflows import gracestart, ordering
from workflows import services as wf_services
from workflows.appfigures import app_figures
from workflows.appfigures import job_id as figures_job_id
from workflows.appretention import app_retention, round_id
from workflows.dburl import sqlalchemy_url_text
from workflows.grace import RECONNECTED_TOPIC
from workflows.gracestart import GraceStarter
from workflows.reconcile import reconcile, reconcile_id
from workflows.recovery import WAKE_TOPIC, recover
from workflows.retention import job_id, retention
from workflows.services import RETRY_FIRST_SECS, RETRY_MAX_SECS

log = logging.getLogger("relay.durable")

EVENT_WORKERS = 8
DEFAULT_GRACE_SECS = 60.0
# DBOS statuses of a workflow that still runs, or will: it needs no replacement.
LIVE = frozenset({"PENDING", "ENQUEUED", "DELAYED"})
# Waiting on a queue: not taken by a worker yet (DELAYED: not before its due time).
QUEUED = LIVE - {"PENDING"}
# Why a recovery's record ends when its executor reconnects and no run of it is live.
BACK_WITH_NO_RUN = "the executor reconnected; no recovery run was live (it had ended without finishing)"
# Workflow ids looked up in one query by the repair sweep, and deaths by the executors back from them.
SWEEP_BATCH = 200

# DBOS's connections to the system database.
SYS_DB_POOL_SIZE = 10
# DBOS runs its database calls in threads (asyncio.to_thread on its own executor), which it does
# not bound by default: 5,000 sockets closing at once made some 3,000 threads, which queued past
# the pool's 30 s for a connection and ended about 140 grace periods in ERROR. A bounded executor
# makes the calls queue for a thread instead, and a thread never waits long for a connection.
DBOS_THREADS = 2 * SYS_DB_POOL_SIZE

# (kind, executor, epoch, the previous epoch of a reconnect, when it happened: time.time())
_Event = tuple[str, ExecutorKey, int, int | None, float]


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
        # Deaths whose executors are back (reconnected while DEAD or RECOVERING), in arrival order:
        # handled together (:meth:`_drain_back`), as a reconnect storm brings them.
        self._back: dict[tuple[ExecutorKey, int], None] = {}
        self._back_draining: asyncio.Task[None] | None = None
        # For /metrics and the tests: batches of deaths whose executors are back, and the deaths handled.
        self.back_batches = 0
        self.back_handled = 0
        # Apps whose executors connected, with those executors, waiting to wake the app's blocked
        # recoveries together (:meth:`_drain_wakes`).
        self._peers_connected: dict[tuple[str, str], set[str]] = {}
        self._waking: asyncio.Task[None] | None = None
        self.wakeups = 0  # wake-ups sent to blocked recoveries, for /metrics and the tests
        self._workers: list[asyncio.Task[None]] = []
        self._repairing: asyncio.Task[None] | None = None
        # Apps that may have a recovery waiting for a peer or an operator, so that
        # a connect to any other app costs no query. Filled at start-up, by a
        # recovery before it records itself blocked, when another instance records
        # one (its NOTIFY, :meth:`learn_blocked`), and every few seconds from the
        # database (a notification lost); never emptied, as a false "maybe" costs
        # only one query.
        self._maybe_blocked: set[tuple[str, str]] = set()
        self.graces = GraceStarter(database_url, gracestart.grace_queue(instance_id), self._grace_secs)

    @staticmethod
    def recovery_turns() -> tuple[int, int]:
        """Recoveries at work on this instance, and those waiting for a turn (workflows.ordering)."""
        return ordering.TURNS.held, ordering.TURNS.waiting

    def note_blocked(self, org: str, app: str) -> None:
        self._maybe_blocked.add((org, app))

    # -- DBOS -------------------------------------------------------------------------

    def launch(self, services: wf_services.Services) -> None:
        """Start DBOS (blocking: run it in a thread); pending workflows of this instance
        (same executor id) resume at once."""
        wf_services.bind(services)
        config: DBOSConfig = {
            "name": "relay",
            # As SQLAlchemy reads it: database.url may be libpq's key=value pairs, or a URL of several hosts.
            "system_database_url": sqlalchemy_url_text(with_tcp_settings(self.database_url)),
            "application_version": wf_services.WORKFLOWS_VERSION,
            "executor_id": self.instance_id,
            "log_level": "WARNING",
            "sys_db_pool_size": SYS_DB_POOL_SIZE,
            "max_executor_threads": DBOS_THREADS,
            # No round trip before every transaction to test the pooled connection: after the
            # database restarts, the first use of each stale connection fails instead, DBOS
            # retries it (its db_retry), and SQLAlchemy replaces the whole pool at once.
            "db_engine_kwargs": {"pool_pre_ping": False},
        }
        DBOS(config=config)
        gracestart.declare_queue(self.instance_id)
        try:
            DBOS.launch()
        except sa.exc.DBAPIError as exc:  # its schema or its tables refused (a role without CREATE)
            reason = " ".join(str(exc.orig).split())
            raise DatabaseError(f"cannot set up Relay's workflows (DBOS): {reason} ({exc.statement})") from exc
        gracestart.register_queue(self.instance_id)
        self.graces.open()

    def destroy(self) -> None:
        # Workflows still waiting (grace periods, blocked recoveries) stay PENDING and
        # resume at the next start; DBOS logs each one's interruption as an error.
        logging.getLogger("dbos").setLevel(logging.CRITICAL)
        DBOS.destroy(workflow_completion_timeout_sec=0)
        wf_services.bind(None)

    # -- the event queue ---------------------------------------------------------------

    def start_workers(self, retention_interval_secs: float, reconciler: ReconcilerConfig | None = None) -> None:
        """The event workers, the periodic repair sweep (once DBOS has launched), the retention
        schedule and the reconciler's."""
        self._workers = [asyncio.create_task(self._work()) for _ in range(EVENT_WORKERS)]
        self._workers.append(asyncio.create_task(self._schedule_retention(retention_interval_secs)))
        if reconciler is not None and reconciler.enabled:
            self._workers.append(asyncio.create_task(self._schedule_reconcile(reconciler)))
        self._repairing = asyncio.create_task(self._repair_every(wf_services.services().liveness.repair_interval_secs))

    async def _schedule_retention(self, interval: float) -> None:
        """Start this interval's retention job (every instance asks; DBOS runs each id once)."""
        while True:
            workflow_id = job_id(interval)
            try:
                await _start(workflow_id, retention, int(time.time() * 1000))
            except Exception as exc:
                log.warning("cannot start the retention job %s: %s", workflow_id, exc)
            await asyncio.sleep(interval - time.time() % interval + 0.5)

    # -- the apps' data: retention rounds and workflow figures ------------------------------

    def start_app_jobs(self, retention_interval_secs: float, figures_window_secs: float | None) -> None:
        """The schedules of the apps' retention rounds and, unless ``None``, of their workflow figures."""
        self._workers.append(asyncio.create_task(self._schedule_app_retention(retention_interval_secs)))
        if figures_window_secs is not None:
            self._workers.append(asyncio.create_task(self._schedule_app_figures(figures_window_secs)))

    async def _schedule_app_retention(self, interval: float) -> None:
        """Start this interval's round of every app with a retention setting (every instance asks;
        DBOS runs each id once)."""
        while True:
            now = time.time()
            try:
                apps = await self.apps.with_retention()
            except Exception as exc:
                log.warning("cannot list the apps with a retention setting: %s", exc)
                apps = []
            failed: list[str] = []
            for org, app in apps:  # each on its own: one app's failure holds up no other's round
                workflow_id = round_id(org, app, interval, now)
                try:
                    await _start(workflow_id, app_retention, org, app)
                except Exception as exc:
                    failed.append(f"{workflow_id} ({exc})")
            if failed:  # one line for the interval, however many apps failed
                log.warning("cannot start %d retention round(s): %s", len(failed), "; ".join(failed[:10]))
            await asyncio.sleep(interval - time.time() % interval + min(0.5, interval / 10))

    async def _schedule_app_figures(self, window_secs: float) -> None:
        """Start the figures job of each window just after it ends (every instance asks; DBOS runs each
        id once). The pause lets workflows that completed at the window's end commit first."""
        settle = min(2.0, window_secs / 5)
        while True:
            await asyncio.sleep(window_secs - time.time() % window_secs + settle)
            window = Window.last_completed(time.time(), window_secs)
            try:
                await _start(figures_job_id(window), app_figures, window.start_ms, window.secs)
            except Exception as exc:
                log.warning("cannot start the figures job %s: %s", figures_job_id(window), exc)

    async def _schedule_reconcile(self, settings: ReconcilerConfig) -> None:
        """Start this interval's reconciler run for every app with a healthy executor (every
        instance asks; DBOS runs each id once)."""
        interval = settings.interval_secs
        # Not before a whole interval has passed since the start: executors reconnecting after a
        # restart are in the registry again by then, and a short-lived process is left alone.
        await asyncio.sleep(interval)
        while True:
            await asyncio.sleep(interval - time.time() % interval + 0.1)
            try:
                apps = await self.executors.apps_with_healthy()
            except Exception as exc:
                log.warning("cannot list the apps to reconcile: %s", exc)
                continue
            for org, app in apps:
                if settings.skips(org, app):
                    continue
                workflow_id = reconcile_id(org, app, interval)
                try:
                    await _start(workflow_id, reconcile, org, app)
                except Exception as exc:
                    log.warning("cannot start the reconciler run %s: %s", workflow_id, exc)

    async def stop_workers(self) -> None:
        running = (self._repairing, self._back_draining, self._waking)
        tasks = [*self._workers, *(t for t in running if t is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._workers = []
        self._repairing = None
        self._back_draining = None
        self._waking = None
        await self.graces.close()

    async def _work(self) -> None:
        handlers: dict[str, Callable[[ExecutorKey, int, int | None, float], Awaitable[None]]] = {
            "connected": self._reconnected,
        }
        while True:
            kind, key, epoch, previous, at = await self._events.get()
            event = functools.partial(handlers[kind], key, epoch, previous, at)
            await wf_services.until_done(event, f"executor {key}: {kind} event", logger=log)

    # -- HubEvents -----------------------------------------------------------------------

    async def executor_lost(self, key: ExecutorKey, epoch: int, lost_at: float) -> None:
        # Not through the workers: grace periods that begin together start in one transaction.
        self.graces.add(key, epoch, lost_at)

    async def executor_connected(
        self, key: ExecutorKey, epoch: int, grace_epoch: int | None, dead_epoch: int | None = None
    ) -> None:
        self._events.put_nowait(("connected", key, epoch, grace_epoch, time.time()))
        if dead_epoch is not None:
            self._back[(key, dead_epoch)] = None
            if self._back_draining is None:
                self._back_draining = asyncio.get_running_loop().create_task(self._drain_back())

    async def _grace_secs(self, org: str, app: str) -> float:
        """A grace period's length: the app's setting when it starts, counted from the disconnection
        as the hub and the repair sweep give its time (see :func:`workflows.grace.grace_period`)."""
        settings = await self.apps.settings_of(org, app)
        return settings.executor_timeout_secs if settings else DEFAULT_GRACE_SECS

    async def _reconnected(self, key: ExecutorKey, epoch: int, grace_epoch: int | None, _at: float) -> None:
        if grace_epoch is not None:  # it was DISCONNECTED: end that disconnection's grace period
            # Once its start, if still waiting, has been tried: a message to no workflow is dropped.
            await self.graces.attempted(grace_id(key, grace_epoch))
            await _send(grace_id(key, grace_epoch), {"reason": "reconnected", "epoch": epoch}, RECONNECTED_TOPIC)
        if (key.org, key.app) in self._maybe_blocked:
            self._peers_connected.setdefault((key.org, key.app), set()).add(key.executor_id)
            if self._waking is None:
                self._waking = asyncio.get_running_loop().create_task(self._drain_wakes())

    async def _drain_wakes(self) -> None:
        """Wake the blocked recoveries of the apps whose executors connected, once for all the
        executors that connected since the last time: woken once per connection, a reconnect storm
        of an app's N executors that had all died (each one's recovery waiting for a peer) sent
        N x N wake-ups. What failed is tried again after a backoff, with what arrived meanwhile."""
        delay = RETRY_FIRST_SECS
        try:
            while self._peers_connected:
                pending, self._peers_connected = self._peers_connected, {}
                failed = None
                for (org, app), peers in pending.items():
                    try:
                        await self._wake_for_peers(org, app, sorted(peers))
                    except Exception as exc:
                        failed = exc
                        self._peers_connected.setdefault((org, app), set()).update(peers)
                if failed is not None:
                    log.warning("waking the blocked recoveries of %d app(s) failed (%s); retrying in %.1fs",
                                len(self._peers_connected), failed, delay)  # fmt: skip
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_SECS)
                else:
                    delay = RETRY_FIRST_SECS
        finally:
            self._waking = None

    async def _wake_for_peers(self, org: str, app: str, peers: list[str]) -> None:
        message = {"reason": "peer_connected", "peer": peers[0]}
        for rid in await self.recoveries.blocked_in_app(org, app, peers):
            await self.wake_recovery(rid, message)

    async def _drain_back(self) -> None:
        """The deaths whose executors are back, up to SWEEP_BATCH at a time: one read of their runs,
        then their records' writes together (:mod:`relay.store.combiner`: a bad one fails alone).
        What failed is tried again after a backoff (0.2 s doubling to 5 s), behind what arrived
        meanwhile, as an executor event always was."""
        delay = RETRY_FIRST_SECS
        try:
            while self._back:
                deaths = list(self._back)[:SWEEP_BATCH]
                failed = await self._back_from_dead(deaths)
                self.back_batches += 1
                self.back_handled += len(deaths) - len(failed)
                for death in deaths:
                    if death not in failed:
                        self._back.pop(death, None)
                    else:  # last in line
                        self._back[death] = self._back.pop(death)
                if failed:
                    log.warning("%d executor(s) back from the dead: their records could not be ended (%s); "
                                "retrying in %.1fs", len(failed), next(iter(failed.values())), delay)  # fmt: skip
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_SECS)
                else:
                    delay = RETRY_FIRST_SECS
        finally:
            self._back_draining = None

    async def _back_from_dead(self, deaths: list[tuple[ExecutorKey, int]]) -> dict[tuple[ExecutorKey, int], Exception]:
        """These executors reconnected while DEAD or RECOVERING. A live recovery run finds its executor
        back and ends itself; a run that ended without finishing (cancelled, in ERROR, dead-lettered)
        left its record saying it is at work, and no sweep looks at a HEALTHY executor: those records
        end here. Returns the deaths that failed, with their errors."""
        try:
            runs = await self._latest_runs(deaths)
        except Exception as exc:
            return dict.fromkeys(deaths, exc)
        unfinished = [(death, runs[death][0]) for death in deaths if not runs[death][1]]
        outcomes = await asyncio.gather(
            *(
                self.recoveries.end_unfinished(key, epoch, BACK_WITH_NO_RUN, latest)
                for (key, epoch), latest in unfinished
            ),
            return_exceptions=True,
        )
        failed: dict[tuple[ExecutorKey, int], Exception] = {}
        for (death, _), outcome in zip(unfinished, outcomes, strict=True):
            if isinstance(outcome, Exception):
                failed[death] = outcome
            elif isinstance(outcome, BaseException):
                raise outcome
        return failed

    # -- Durable ------------------------------------------------------------------------

    async def start_recovery(self, key: ExecutorKey, epoch: int, trigger: str) -> str:
        """The death's recovery: the run that is live, or else a new run started now; returns its id."""
        rid, live = await self.current_recovery(key, epoch)
        if not live:
            await _start(rid, recover, key.org, key.app, key.executor_id, epoch, trigger, nudgeable_backoff=True)
        return rid

    async def current_recovery(self, key: ExecutorKey, epoch: int) -> tuple[str, bool]:
        """The id of the death's live recovery run and True; or, when no run is live, the id
        the next run takes (run 1's if there was none) and False."""
        latest, live = (await self._latest_runs([(key, epoch)]))[(key, epoch)]
        return (recovery_id(key, epoch, latest), True) if live else (recovery_id(key, epoch, latest + 1), False)

    async def end_grace(self, key: ExecutorKey, epoch: int, reason: str) -> None:
        await _send(grace_id(key, epoch), {"reason": reason}, RECONNECTED_TOPIC)

    async def wake_recovery(self, rid: str, message: dict[str, Any]) -> None:
        await _send(rid, message, WAKE_TOPIC)
        self.wakeups += 1

    async def wake_app(self, org: str, app: str, message: dict[str, Any]) -> None:
        if (org, app) not in self._maybe_blocked:
            return
        for rid in await self.recoveries.blocked_in_app(org, app):
            await self.wake_recovery(rid, message)

    async def refresh_blocked(self) -> None:
        for org, app in await self.recoveries.apps_with_blocked():
            await self.learn_blocked(org, app)

    async def learn_blocked(self, org: str, app: str) -> None:
        """An app has a recovery waiting (read from the database, or announced by the instance that
        recorded it). If this instance did not know yet, a peer of the app that connected here
        meanwhile sent no wake-up: the recoveries the app's executors connected here may take are
        woken now, as their connections would have woken them (:meth:`_wake_for_peers`). Woken
        whatever they wait for, a Python app's executors here woke a TypeScript executor's
        recovery, which only read its peers again and went back to waiting."""
        if (org, app) in self._maybe_blocked:
            return
        self._maybe_blocked.add((org, app))  # first: a peer connecting from now on wakes them itself
        try:
            serving, _ = await self.executors.serving(org, app)
            mine = sorted(executor_id for executor_id, instance in serving if instance == self.instance_id)
            if mine:
                await self._wake_for_peers(org, app, mine)
        except BaseException:
            self._maybe_blocked.discard((org, app))  # not learnt: the next read tries again
            raise

    async def take_over(self, instances: list[str]) -> None:
        """Hand the pending DBOS workflows of ``instances`` to DBOS's recovery (idempotent),
        then repair what is still missing."""
        handles = await asyncio.to_thread(DBOS._recover_pending_workflows, instances)
        log.info("instance %s: recovering %d workflows of %s", self.instance_id, len(handles), instances)
        await self.sweep()

    # -- the repair sweep -------------------------------------------------------------------

    async def sweep(self) -> None:
        """The repair sweep, at once (start-up, shutdown, adoption)."""
        await self.repair()

    async def _repair_every(self, interval: float) -> None:
        me = f"instance {self.instance_id}"
        told = FailureLog(log, f"{me}: the repair sweep failed", f"{me}: the repair sweep works again")
        while True:
            await asyncio.sleep(interval)
            try:
                await self.repair()
                told.worked()
            except DatabaseError as exc:
                told.failed(exc)
            except Exception:
                log.exception("instance %s: the repair sweep failed", self.instance_id)

    async def repair(self) -> None:
        """Every executor this instance owns that is not HEALTHY gets its workflow running (idempotent).

        - DISCONNECTED, and no grace period for that epoch: one is started, its
          deadline the app's grace period after the disconnection (at once if
          that has passed).
        - DISCONNECTED, and its grace period ended without declaring it DEAD (cancelled,
          in ERROR, dead-lettered): once the grace period has passed since the
          disconnection, it is declared DEAD here, as the grace period would have
          (GRACE_EXPIRED, audited), and its recovery is started.
        - DEAD or RECOVERING, no recovery run live and no grace period live (which
          would start it): a new recovery run is started.

        A grace period that waits on another instance's queue moves to this instance's first
        (:meth:`_take_stranded_graces`). Also notes every app with a waiting recovery, for wake-ups.
        """
        await self.refresh_blocked()
        rows = await self.executors.needing_timers(self.instance_id)
        for start in range(0, len(rows), SWEEP_BATCH):
            batch = rows[start : start + SWEEP_BATCH]
            found = await _grace_statuses([grace_id(r.key, r.epoch) for r in batch])
            await self._take_stranded_graces(found)
            graces = {workflow_id: status for workflow_id, (status, _queue) in found.items()}
            deaths = [(r.key, r.epoch) for r in batch if r.state is not ExecutorState.DISCONNECTED]
            runs = await self._latest_runs(deaths)
            for row in batch:
                try:
                    await self._repair_one(
                        row, graces.get(grace_id(row.key, row.epoch)), runs.get((row.key, row.epoch))
                    )
                except DatabaseError as exc:
                    log.warning("executor %s: repair failed (%s); the next sweep tries again", row.key, exc)

    async def _take_stranded_graces(self, found: dict[str, tuple[str, str | None]]) -> None:
        """Grace periods of executors this instance owns that wait on another instance's queue
        (it was adopted: nothing listens there any more) move to this instance's queue."""
        stranded = [
            workflow_id
            for workflow_id, (status, queue) in found.items()
            if status in QUEUED and gracestart.is_grace_queue(queue) and queue != self.graces.queue
        ]
        if not stranded:
            return
        try:
            await DBOS.resume_workflows_async(stranded, queue_name=self.graces.queue)
        except Exception as exc:  # DBOS does not retry this one; they stay where they are until then
            log.warning("instance %s: could not take over %d grace period(s) waiting on another instance's "
                        "queue (%s); the next sweep tries again", self.instance_id, len(stranded), exc)  # fmt: skip
            return
        log.info("instance %s: took over %d grace period(s) waiting on another instance's queue",
                 self.instance_id, len(stranded))  # fmt: skip

    async def _repair_one(self, row: Unfinished, grace: str | None, run: tuple[int, bool] | None) -> None:
        key, epoch = row.key, row.epoch
        if grace in LIVE:
            return  # it will declare the executor dead, or has, and start its recovery
        if row.state is ExecutorState.DISCONNECTED:
            if grace is None:
                # Counted from the disconnection, as the hub's start would have: the time read from
                # the database's clock as an age, so that a skew between the clocks does not move it.
                lost_at = None if row.disconnected_secs is None else time.time() - row.disconnected_secs
                await self.graces.start(key, epoch, lost_at)
            elif row.grace_over:
                # Guarded on state and epoch: when the executor reconnected after the rows were read
                # (which also ends the grace period, SUCCESS), this is a no-op and nothing is logged;
                # so it is when the grace period declared it dead after the rows were read, and then
                # ended (it starts the recovery itself).
                dedupe = f"repair:{grace_id(key, epoch)}:dead"
                if await self.recoveries.declare_dead_now(key, epoch, ExecutorEvent.GRACE_EXPIRED, "relay", dedupe):
                    log.warning("executor %s: its grace period ended (%s) without declaring it dead; declared now",
                                key, grace)  # fmt: skip
                    await self.start_recovery(key, epoch, "repair")
            return
        latest, live = run or (0, False)
        if live or not await self.executors.still_dead(key, epoch):
            # Still dead, read after the run's status: a run that had ended cannot have
            # deleted the record since (one that ended just before the rows were read could).
            return
        log.warning("executor %s is %s with no recovery running (%s); starting run %d",
                    key, row.state.value, f"run {latest} ended" if latest else "none started", latest + 1)  # fmt: skip
        await self.start_recovery(key, epoch, "repair")

    async def _latest_runs(
        self, deaths: list[tuple[ExecutorKey, int]]
    ) -> dict[tuple[ExecutorKey, int], tuple[int, bool]]:
        """For each death: its latest recovery run (0: none yet) and whether that run is live.

        Runs are found among DBOS's workflows and in the recoveries table (a run
        whose DBOS record was garbage-collected still holds its number). A
        workflow found by its id's prefix counts only if its inputs name this
        death: an executor id may hold ``:`` and digits, so run ``n`` of
        executor ``x`` dead at epoch ``E`` has the id of run 1 of executor
        ``x:E`` dead at epoch ``n`` (:mod:`relay.core.ids`).
        """
        if not deaths:
            return {}
        found = await DBOS.list_workflows_async(
            workflow_id_prefix=[recovery_id(key, epoch) for key, epoch in deaths],
            load_input=True,
            load_output=False,
        )
        recorded = await self.recoveries.latest_runs(deaths)
        result: dict[tuple[ExecutorKey, int], tuple[int, bool]] = {}
        for key, epoch in deaths:
            statuses = {
                run: status.status
                for status in found
                if (run := recovery_run(key, epoch, status.workflow_id)) is not None
                and _recovers(status.input, key, epoch)
            }
            latest = max([*statuses, recorded.get((key, epoch), 0)])
            result[(key, epoch)] = (latest, statuses.get(latest) in LIVE)
        return result


# The parameters of workflows.recovery.recover that name its death, Relay 0.2.0's as this release's
# (``nudgeable_backoff`` came after, passed by keyword).
_RECOVER_PARAMS = ("org", "app", "executor_id", "epoch", "trigger")


def _recovers(inputs: WorkflowInputs | None, key: ExecutorKey, epoch: int) -> bool:
    """Whether a ``relay.recover`` workflow's inputs name this death (org and app are in its id,
    escaped: only the executor and the epoch can be another's). Inputs that cannot be read leave
    it to the id: a run of this death, as earlier releases took it."""
    if not isinstance(inputs, dict):
        return True
    named = dict(zip(_RECOVER_PARAMS, inputs.get("args") or (), strict=False)) | dict(inputs.get("kwargs") or {})
    if "executor_id" not in named or "epoch" not in named:
        return True
    return bool(named["executor_id"] == key.executor_id and named["epoch"] == epoch)


async def _grace_statuses(workflow_ids: list[str]) -> dict[str, tuple[str, str | None]]:
    """The DBOS status and queue of each of these workflows that exists."""
    if not workflow_ids:
        return {}
    found = await DBOS.list_workflows_async(workflow_ids=workflow_ids, load_input=False, load_output=False)
    return {status.workflow_id: (status.status, status.queue_name) for status in found}


async def _send(workflow_id: str, message: dict[str, Any], topic: str) -> None:
    try:
        await DBOS.send_async(workflow_id, message, topic)
    except DBOSNonExistentWorkflowError:
        log.debug("no workflow %s to tell %s", workflow_id, topic)


async def _start(workflow_id: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    # A workflow id names the disconnection or death (and run) it is for: starting
    # it twice (a retry, the repair sweep, two instances at once) finds the first
    # one. It runs as a task on Relay's loop, which DBOS makes in the caller's context: not under
    # the id of the HTTP request that started it (an operator's recovery), whose lines it would
    # carry for as long as it runs, though it outlives the request and its frames serve others.
    with SetWorkflowID(workflow_id), serving(None):
        await DBOS.start_workflow_async(fn, *args, **kwargs)
