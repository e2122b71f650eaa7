"""The composition root: builds one Relay instance, starts it, stops it, serves it.

The only module under ``relay/`` that imports ``workflows/``: it hands the
workflows their services (:class:`workflows.services.Services`) and hands the
rest of Relay the workflow engine through the narrow protocols it needs
(:class:`relay.net.hub.HubEvents`, :class:`relay.domain.ports.Durable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from psycopg.conninfo import conninfo_to_dict

from relay import __version__
from relay.api import ApiContext, build_api
from relay.api.refusals import RefusalAudit
from relay.appmetrics import AppFiguresCollector
from relay.auth import KeyRing
from relay.config import RelayConfig
from relay.domain.adoption import Adopter
from relay.domain.alerts import AlertRules, AlertSender, ConditionObserver
from relay.domain.events import EventHub
from relay.domain.firstrun import FirstKeys, ensure_first_keys
from relay.domain.frames import CoalescingAsk
from relay.domain.gateway import ExecutorGateway, GatewayLimits
from relay.domain.operator import Operator
from relay.domain.tokens import Tokens
from relay.errors import DatabaseError, RelayError, StartupError
from relay.metrics import Metrics, add_app_figures, add_collectors
from relay.net.guard import BodyLimit, HttpGuard
from relay.net.hub import Hub
from relay.net.paths import PathKeeper
from relay.net.router import Router
from relay.net.server import RelayApp, uvicorn_config
from relay.net.webhook import WebhookSender
from relay.store.alerts import AlertStore
from relay.store.appfigures import AppFiguresStore
from relay.store.appretention import AppRetentionStore
from relay.store.apps import AppStore
from relay.store.audit import AuditStore
from relay.store.changes import ChangeStore
from relay.store.configsync import sync_config
from relay.store.db import Database
from relay.store.executors import ExecutorStore
from relay.store.instances import InstanceStore
from relay.store.keys import KeyStore, grants_from_config
from relay.store.lease import Lease
from relay.store.probe import DatabaseProbe
from relay.store.recoveries import RecoveryStore
from relay.store.retention import RetentionStore
from workflows.alerts import AlertLoops
from workflows.engine import Engine
from workflows.services import AlertServices, Services

# The collector's young generation is collected after this many new objects instead of
# Python's 700: a burst of handshakes or closes allocates that many in well under a millisecond.
GC_THRESHOLDS = (5_000, 10, 10)

log = logging.getLogger("relay")

EXIT_FENCED = 3


Announce = Callable[[FirstKeys], None]


class StopWatch:
    """The step a stop is at. One that lasts over :attr:`every` seconds is logged while it lasts,
    so that a stop that its process manager kills after its timeout still says where it was."""

    every = 1.0

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.step, self.since = "closing its streams and sockets", time.monotonic()

    def at(self, step: str) -> None:
        self.step, self.since = step, time.monotonic()

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            took = time.monotonic() - self.since
            if took >= self.every:
                log.warning("instance %s: stopping: %s for %.1f s", self.instance_id, self.step, took)


# How long a stop waits for the combined writes in flight before it records its executors lost.
WRITES_SETTLE_SECS = 1.0

# How long a stop waits for DBOS's own (usually well under a second): DBOS 3.2 can hang in it when a
# queue worker hands a workflow it just dequeued to DBOS's event loop after DBOS stopped that loop;
# the wait for that worker then lasts DBOS's 10 s join timeout. Nothing is lost by not waiting: the
# process is exiting, and what DBOS was starting is durable (it resumes at the next start).
DBOS_STOP_SECS = 2.0


async def run_for_at_most(fn: Callable[[], None], secs: float) -> bool:
    """Run ``fn`` in a daemon thread of its own and wait for it at most ``secs`` seconds: True if
    it returned (its exception is raised here), False if it is still running. Being a daemon, a
    thread still running does not hold up the process's exit, as an executor's thread would."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            fn()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name=f"relay-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.shield(done), secs)
    except TimeoutError:
        return False
    return True


class Runtime:
    def __init__(
        self, config: RelayConfig, database_url: str, instance_id: str, announce: Announce | None = None
    ) -> None:
        self.config = config
        # Told what the first start found or made (the command line prints it), when no org is configured.
        self.announce = announce
        self.instance_id = instance_id
        self.database_url = database_url
        # Why the start-up failed: a database that cannot be reached, or another step (relay serve
        # says so in one line, exit 1).
        self.startup_error: RelayError | None = None
        self.db = Database(database_url)
        self.apps = AppStore(self.db)
        self.executors = ExecutorStore(self.db)
        self.recoveries = RecoveryStore(self.db, self.executors)
        self.audit = AuditStore(self.db)
        self.keys = KeyStore(self.db)
        self.keyring = KeyRing(grants_from_config(config))
        self.engine = Engine(database_url, instance_id, self.executors, self.recoveries, self.apps)
        self.lease = Lease(self.db, instance_id, config.liveness.instance_lease_secs)
        self.lease.on_fenced = self._fenced
        self.probe = DatabaseProbe(self.db.conninfo, db=self.db)
        self.hub = Hub(config, self.keyring, self.apps, self.executors, instance_id, self.engine, self.lease)
        self.router = Router(
            self.db,
            self.executors,
            self.hub,
            instance_id,
            config.server.max_relayed_reply_bytes,
            lease_secs=config.liveness.instance_lease_secs,
        )
        self.hub.elsewhere = self.router
        self.tokens = Tokens(self.db, self.keys, self.keyring, self.hub)
        server = config.server
        limits = GatewayLimits(
            server.executor_request_timeout_secs,
            server.executor_request_deadline_secs,
            server.max_executor_requests_per_app,
        )
        self.gateway = ExecutorGateway(self.executors, self.router, limits)
        self.instances = InstanceStore(self.db, self.executors)
        self.adopter = Adopter(self.instances, self.lease, self.engine)
        self.operator = Operator(self.db, self.apps, self.executors, self.recoveries, self.engine)
        self.reconciled: Counter[tuple[str, str, str]] = Counter()
        self.retention_rounds: Counter[tuple[str, str, str]] = Counter()
        self.events = EventHub(ChangeStore(self.db), self.keyring, server)
        # Recovery frames to one peer coalesced (relay.domain.frames): what the workflows ask through.
        self.ask = CoalescingAsk(self.router.ask)
        self.metrics = Metrics(
            self.hub,
            self.lease,
            self.router,
            self.executors,
            lambda: self.adopter.adopted,
            self.reconciled,
            self.ask.frames,
            lambda: (self.engine.graces.batches, self.engine.graces.started),
            self.engine.recovery_turns,
            self.probe.answers,
            lambda: (self.engine.back_batches, self.engine.back_handled),
            lambda: self.engine.wakeups,
            self.retention_rounds,
        )
        # The recovery pipeline (observed by the recovery store) and the apps' figures (README "Metrics").
        self.figures = AppFiguresStore(self.db)
        self.app_retention = AppRetentionStore(self.db)
        add_collectors(self.metrics, self.recoveries.pipeline.collectors())
        add_app_figures(self.metrics, AppFiguresCollector(self.figures, config.metrics.app_figures_window_secs))
        self.alert_store = AlertStore(self.db)
        self.webhooks = WebhookSender(config.alerts.policy(), config.alerts.timeout_secs, f"relay/{__version__}")
        self.alert_rules = AlertRules(self.db, self.alert_store, self.apps, self.webhooks)
        self.alert_loops = AlertLoops(self.alert_store, config.alerts, lambda: self.lease.held)

    def api_context(self) -> ApiContext:
        return ApiContext(
            config=self.config,
            instance_id=self.instance_id,
            version=__version__,
            db=self.db,
            keyring=self.keyring,
            apps=self.apps,
            executors=self.executors,
            recoveries=self.recoveries,
            audit=self.audit,
            router=self.router,
            gateway=self.gateway,
            operator=self.operator,
            keys=self.keys,
            instances=self.instances,
            tokens=self.tokens,
            lease=self.lease,
            probe=self.probe,
            events=self.events,
            metrics=self.metrics.render,
            figures=self.figures,
            alert_rules=self.alert_rules,
        )

    def _services(self, loop: asyncio.AbstractEventLoop) -> Services:
        return Services(
            executors=self.executors,
            recoveries=self.recoveries,
            apps=self.apps,
            audit=self.audit,
            ask=self.ask,
            liveness=self.config.liveness,
            retention=RetentionStore(self.db),
            retention_settings=self.config.retention,
            note_blocked=self.engine.note_blocked,
            loop=loop,
            app_retention=self.app_retention,
            figures=self.figures,
            executor_timeout_secs=self.config.server.executor_request_timeout_secs,
            alerts=AlertServices(
                self.alert_store,
                ConditionObserver(self.alert_store, self.gateway, self.config.alerts.check_interval_secs),
                AlertSender(self.alert_store, self.gateway, self.webhooks),
                self.config.alerts,
            ),
            reconciler=self.config.reconciler,
            instance_id=self.instance_id,
            reconciled=self.reconciled,
            retention_rounds=self.retention_rounds,
        )

    async def _warn_unleased(self) -> None:
        """Instances of 0.2.0 (no lease) that hold executors or workflows: nobody adopts them, so
        their executors and the grace periods and recoveries they began wait for an instance with
        their id. Said once per start, for each."""
        for other in await self.instances.unleased():
            log.warning(
                "instance %s has no lease (Relay 0.2.0, which predates leases) and holds %d executor "
                "record(s), %d of them HEALTHY, and %d pending workflow(s): no instance adopts it. While it "
                "runs, this is a rolling upgrade's normal state; once it has stopped, start this release "
                "with RELAY_INSTANCE_ID=%s to take its executors, grace periods and recoveries over",
                other.instance,
                other.executors,
                other.healthy,
                other.pending_workflows,
                other.instance,
            )

    async def start(self) -> None:
        await self.db.open()
        await self.db.migrate()
        await sync_config(self.db, self.config)  # apps, rules and keys: whole, in one transaction
        first = await ensure_first_keys(self.keys, self.config)
        if first is not None and self.announce is not None:
            self.announce(first)  # at once: a start that fails later must not lose the secrets it made
        await self.tokens.refresh()
        await self.lease.acquire()
        self.lease.start()
        # Sockets do not survive a restart: whatever this instance held before is gone.
        stale = await self.executors.instance_lost(self.instance_id)
        if stale:
            log.info("marked %d executors of a previous run of instance %s DISCONNECTED", stale, self.instance_id)
        await self._warn_unleased()
        # DBOS resumes this instance's pending workflows (grace periods, recoveries)
        # as it launches; then every DISCONNECTED executor gets its grace period.
        self.router.start()
        await asyncio.to_thread(self.engine.launch, self._services(asyncio.get_running_loop()))
        self.engine.start_workers(self.config.retention.interval_secs, self.config.reconciler)
        self.router.on_blocked = self.engine.learn_blocked
        metrics = self.config.metrics
        self.engine.start_app_jobs(
            self.config.retention.apps_interval_secs,
            metrics.app_figures_window_secs if metrics.app_figures else None,
        )
        self.alert_loops.start()
        await self.adopter.resume_adopted()
        await self.engine.sweep()
        self.adopter.start()
        self.tokens.start()
        self.events.start()
        self.hub.start()
        # What start-up built (modules, DBOS, SQLAlchemy, pydantic models) lives as long as the
        # process: keep it out of the collector's full passes, which otherwise walk all of it
        # again and again while thousands of executors connect at once.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)

    async def stop(self) -> None:
        clock = StopWatch(self.instance_id)
        watching = asyncio.create_task(clock.watch())
        try:
            await self._stop(clock)
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)

    async def _stop(self, clock: StopWatch) -> None:
        await self.events.stop()
        await self.hub.stop()
        await self.tokens.stop()
        await self.adopter.stop()
        await self.hub.close_all()
        try:
            clock.at("recording its executors' disconnection")
            # First the disconnections still being written (sockets closed just before the stop,
            # their handlers cancelled by uvicorn): they lock the same rows in another order. The
            # batched ones (ExecutorStore.lost) and the combined writes, within one budget.
            budget = time.monotonic() + WRITES_SETTLE_SECS
            await self.executors.settled(WRITES_SETTLE_SECS)
            await self.db.writes.settled(max(0.0, budget - time.monotonic()))
            await self.executors.instance_lost(self.instance_id)
            clock.at("the repair sweep")
            await self.engine.sweep()
        finally:
            try:
                clock.at("stopping its workers and starting the grace periods")
                await self.alert_loops.stop()
                await self.engine.stop_workers()
                clock.at("stopping the router")
                await self.router.stop()
                clock.at("stopping DBOS")
                if not await run_for_at_most(self.engine.destroy, DBOS_STOP_SECS):
                    log.warning("instance %s: DBOS did not stop within %g s; the stop goes on without it",
                                self.instance_id, DBOS_STOP_SECS)  # fmt: skip
            finally:
                self.webhooks.close()  # no delivery step runs any more: its DNS threads may go
                try:
                    clock.at("giving up its lease")
                    await self.lease.stop()  # last: the lease covers every write above
                finally:
                    clock.at("closing its database pool")
                    await self.probe.close()
                    await self.db.close()

    def _fenced(self) -> None:
        """Another instance adopted this one's lease (it was paused or cut off past it).

        Whatever this process still believes it owns belongs to the adopter now;
        every fenced write already fails. It stops at once, without the graceful
        shutdown's writes, and its process manager starts it again with a new
        lease epoch.
        """
        log.critical("instance %s: lease taken over by another instance; exiting (code %d)",
                     self.instance_id, EXIT_FENCED)  # fmt: skip
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(EXIT_FENCED)

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        try:
            await self.start()
        except (DatabaseError, StartupError) as exc:
            self.startup_error = exc  # for serve(): uvicorn would log a traceback and exit 3
            raise
        except Exception as exc:  # a bug, or a failure no step foresaw: its traceback to the log
            log.exception("instance %s: the start-up failed", self.instance_id)
            self.startup_error = StartupError(f"the start-up failed: {self._one_line(exc)}")
            raise
        try:
            yield
        finally:
            try:
                # The refused attempts answered just before the stop: their entries need the pool.
                refusals: RefusalAudit | None = getattr(app.state, "refusals", None)
                if refusals is not None:
                    await refusals.settled()
            finally:
                await self.stop()

    def _one_line(self, exc: BaseException) -> str:
        """``exc`` on one line for relay serve's error line, without the database's password (an
        error may quote the URL)."""
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
        password = str(conninfo_to_dict(self.database_url).get("password") or "")
        return text.replace(password, "***") if password else text

    def asgi(self) -> RelayApp:
        # The guard looks each key up when a request comes, in the key ring of that moment.
        # An exported workflow (its children included) comes back through import: a larger body.
        limits = (BodyLimit("/v2/orgs/*/apps/*/workflows/import", self.config.server.max_import_bytes),)
        api = HttpGuard(
            build_api(self.api_context(), self.lifespan),
            self.config.server,
            lambda key: self.keyring.lookup(key),
            limits,
        )
        return RelayApp(self.hub, PathKeeper(api))


class _QuietStartupFailure(logging.Filter):
    """Drops uvicorn's errors (the start-up's traceback, "Application startup failed") once the
    runtime has recorded why its start-up failed: relay serve reports that."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__()
        self.runtime = runtime

    def filter(self, record: logging.LogRecord) -> bool:
        return self.runtime.startup_error is None or record.levelno < logging.ERROR


class _Stopped(Exception):
    """SIGTERM, re-raised by uvicorn once it has shut down gracefully."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped


def serve(
    config: RelayConfig,
    database_url: str,
    instance_id: str,
    announce: Announce | None = None,
    sockets: list[socket.socket] | None = None,
) -> None:
    """Run until SIGINT or SIGTERM; returns after a graceful shutdown. ``sockets``: listening already,
    by the caller, before anything touched the database (``relay serve``); without them uvicorn
    binds server.host and server.port itself, once the start-up is done."""
    runtime = Runtime(config, database_url, instance_id, announce)
    server = uvicorn.Server(uvicorn_config(runtime.asgi(), config))
    log.info("relay instance %s starting", instance_id)
    # uvicorn re-raises the signal that stopped it once it is done; turn that
    # into a return so the caller can still stop the embedded database.
    signal.signal(signal.SIGTERM, _raise_stopped)
    # A start-up that fails (a database it cannot reach, DBOS's schema it may not create) is one
    # line of relay serve's and exit 1, not uvicorn's traceback of it and its exit 3 (the code of
    # an instance whose lease was adopted).
    quiet = _QuietStartupFailure(runtime)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(quiet)
    try:
        server.run(sockets=sockets)
    except (KeyboardInterrupt, _Stopped):
        pass
    except SystemExit:
        if runtime.startup_error is not None:
            raise runtime.startup_error from None
        raise
    finally:
        uvicorn_log.removeFilter(quiet)
    if not server.started:
        raise SystemExit(1)
