"""What Relay's workflows reach outside DBOS, and the step decorator that reaches it.

The workflows get a narrow, typed set of services (:class:`Services`), bound
once when DBOS launches. The stores and the router belong to Relay's event
loop (the database pool, the hub's sockets); DBOS runs a workflow on Relay's
loop when Relay started it and on its own background loop when it recovered
it. :func:`relay_step` makes every step body run on Relay's loop, so a step
simply awaits the stores: the hop between loops lives here, once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ParamSpec, Protocol, TypeVar, overload

import psycopg
from dbos import DBOS

from relay.config import AlertsConfig, LivenessConfig, ReconcilerConfig, RetentionConfig
from relay.core.ids import ExecutorKey
from relay.domain.alerts import AlertSender, ConditionObserver, RuleEvaluations
from relay.errors import DatabaseError, ExecutorRequestError, NoAnswer, NoHealthyExecutor, UnsupportedMessage
from relay.store.alerts import AlertStore
from relay.store.appfigures import AppFiguresStore
from relay.store.appretention import AppRetentionStore
from relay.store.apps import AppStore
from relay.store.audit import AuditStore
from relay.store.db import patiently
from relay.store.executors import ExecutorStore
from relay.store.recoveries import RecoveryStore
from relay.store.retention import RetentionStore
from relay_protocol import Reply, Request

T = TypeVar("T")
P = ParamSpec("P")

log = logging.getLogger("relay.workflows")

RETRY_FIRST_SECS, RETRY_MAX_SECS = 0.2, 5.0


async def until_done(
    call: Callable[[], Awaitable[T]],
    what: str,
    errors: type[Exception] | tuple[type[Exception], ...] = Exception,
    logger: logging.Logger = log,
) -> T:
    """``call()``, tried again after ``errors`` with a backoff doubling from 0.2 s up to 5 s, until
    it returns (for work that must happen once the database answers: an executor event, a read
    before a workflow's first step)."""
    delay = RETRY_FIRST_SECS
    while True:
        try:
            return await call()
        except errors as exc:
            logger.warning("%s failed (%s); retrying in %.1fs", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_SECS)


# Every Relay instance must register its workflows under the same application
# version, or one instance could not recover another's. Change it only when a
# workflow changes in a way that cannot replay an older run's history.
WORKFLOWS_VERSION = "relay-workflows-1"

# DBOS moves a workflow it has recovered more than ``max_recovery_attempts`` times
# (default 100) to MAX_RECOVERY_ATTEMPTS_EXCEEDED: a dead letter, never run again.
# Relay's grace periods and waiting recoveries are meant to be resumed at every
# restart of Relay, however many there are, so their limit is out of reach (DBOS
# takes any int, or None for no limit; a number keeps the setting explicit).
MAX_RECOVERY_ATTEMPTS = 1_000_000_000


R = TypeVar("R", bound=Reply)


class Ask(Protocol):
    """Ask an executor, wherever its socket is, and read its reply (:meth:`relay.net.router.Router.ask`)."""

    def __call__(
        self, key: ExecutorKey, request: Request, expected: type[R], timeout: float, *, await_connection: bool = ...
    ) -> Awaitable[R]: ...


@dataclass(frozen=True)
class AlertServices:
    """What the alert workflows reach (workflows/alerts.py)."""

    store: AlertStore
    observer: ConditionObserver
    sender: AlertSender
    settings: AlertsConfig
    evaluations: RuleEvaluations = field(default_factory=RuleEvaluations)


@dataclass(frozen=True)
class Services:
    executors: ExecutorStore
    recoveries: RecoveryStore
    apps: AppStore
    audit: AuditStore
    ask: Ask
    liveness: LivenessConfig
    retention: RetentionStore
    retention_settings: RetentionConfig
    # A recovery about to wait tells the engine its app may have one waiting (for wake-ups).
    note_blocked: Callable[[str, str], None]
    loop: asyncio.AbstractEventLoop
    # The apps' data: retention rounds and workflow figures, asked of their executors, each of
    # which gets this long to answer (server.executorRequestTimeoutSecs).
    app_retention: AppRetentionStore
    figures: AppFiguresStore
    executor_timeout_secs: float
    alerts: AlertServices
    reconciler: ReconcilerConfig
    instance_id: str
    # (org, app, what) -> how many, for /metrics: the reconciler's runs and finds on this instance.
    reconciled: Counter[tuple[str, str, str]]
    # (org, app, result) -> how many, for /metrics: the apps' retention rounds on this instance,
    # "dispatched" or "skipped" (each skip counts, though only a new reason is audited).
    retention_rounds: Counter[tuple[str, str, str]] = field(default_factory=Counter)

    async def on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on Relay's loop, from whichever loop the caller runs on."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))


_bound: Services | None = None


def bind(services: Services | None) -> None:
    global _bound
    _bound = services


def services() -> Services:
    if _bound is None:
        raise RuntimeError("Relay's workflows run only inside a started Relay")
    return _bound


# A step waits this long for a connection of Relay's pool before it fails (and is retried).
STEP_CONNECTION_WAIT_SECS = 60.0


def database_trouble(exc: BaseException) -> bool:
    """Worth retrying: PostgreSQL unreachable or busy, the lease not held. Not a statement
    refused for the data in it (NUL in a text, say), which fails the same way every time."""
    return isinstance(exc, DatabaseError) and not isinstance(exc.__cause__, psycopg.DataError)


@overload
def relay_step(name: str) -> Callable[[Callable[P, Coroutine[Any, Any, T]]], Callable[P, Coroutine[Any, Any, T]]]: ...


@overload
def relay_step(
    name: str, *, on_error: Callable[[Exception], T]
) -> Callable[[Callable[P, Coroutine[Any, Any, T]]], Callable[P, Coroutine[Any, Any, T]]]: ...


def relay_step(
    name: str, *, on_error: Callable[[Exception], Any] | None = None
) -> Callable[[Callable[P, Coroutine[Any, Any, Any]]], Callable[P, Coroutine[Any, Any, Any]]]:
    """A DBOS step whose body runs on Relay's loop and that outlives a database outage.

    Retries: without them, one failed query would end the workflow in ERROR
    and strand its executor (about an hour of retries in all). Only database
    trouble is retried. A step that talks to executors gives ``on_error``:
    any other exception of its body (a reply Relay did not expect, a bug in
    reading one) becomes ``on_error(exc)``, its result, so that what an
    executor sends can fail an attempt but never end the workflow in ERROR.
    The body sees the step's DBOS context (``DBOS.workflow_id``,
    ``DBOS.step_id``): the hop copies the context along.
    """

    def decorate(fn: Callable[P, Coroutine[Any, Any, Any]]) -> Callable[P, Coroutine[Any, Any, Any]]:
        @functools.wraps(fn)
        async def on_relay_loop(*args: P.args, **kwargs: P.kwargs) -> Any:
            svc = services()
            try:
                return await svc.on_loop(patiently(fn(*args, **kwargs), STEP_CONNECTION_WAIT_SECS))
            except Exception as exc:
                if on_error is None or database_trouble(exc):
                    raise
                log.warning("step %s of %s failed: %s: %s", name, DBOS.workflow_id, type(exc).__name__, exc)
                return on_error(exc)

        step: Callable[P, Coroutine[Any, Any, Any]] = DBOS.step(
            name=name,
            retries_allowed=True,
            interval_seconds=0.5,
            backoff_rate=1.5,
            max_attempts=20,
            should_retry=database_trouble,
        )(on_relay_loop)
        return step

    return decorate


def dedupe_key() -> str:
    """An audit entry's dedupe key inside a step: the same when the step runs again after a crash."""
    return f"{DBOS.workflow_id}:{DBOS.step_id}"


# Executors of an app that a background job (the app's figures, its retention round, the reconciler)
# asks before it gives up until its next round: an error that three executors give is the app's (its
# SDK, its system database), not one executor's, and walking every executor of a fleet of thousands
# sent one request to each, every minute (issue 15's idle CPU at 15,000 executors).
ASK_APP_TRIES = 3
# How old a read of the app's healthy executors may be (a job's requests come a few at once).
ASK_APP_PEERS_MAX_AGE_SECS = 1.0


async def first_answer(org: str, app: str, ask: Callable[[str], Awaitable[T]], spread: str = "") -> tuple[str, T]:
    """What ``ask(executor_id)`` returns for one healthy executor of the app, and which one.

    Executors are asked in turn (from one picked by ``spread``, so that rounds spread over
    them) until ``ask`` returns, at most :data:`ASK_APP_TRIES` of them; ``ask`` raises
    :class:`ExecutorRequestError` for an executor that failed (named in :class:`NoAnswer`'s
    message). One whose SDK does not know the message (:class:`UnsupportedMessage`) leaves out
    the others of its application version (the same build, the same SDK), which are not counted
    as tried; any other failure makes the app's next read of its healthy executors a fresh one. Raises
    :class:`NoHealthyExecutor` when the app has none, :class:`NoAnswer` when none answered.
    """
    healthy = await services().executors.healthy_peers(org, app, ASK_APP_PEERS_MAX_AGE_SECS)
    if not healthy:
        raise NoHealthyExecutor(f"app {app!r} has no healthy executor connected")
    start = zlib.crc32(spread.encode()) % len(healthy)
    problems: list[str] = []
    unsupported: set[str] = set()
    for peer in healthy[start:] + healthy[:start]:
        if len(problems) >= ASK_APP_TRIES:
            break
        if peer.application_version in unsupported:
            continue
        try:
            return peer.executor_id, await ask(peer.executor_id)
        except ExecutorRequestError as exc:
            if isinstance(exc, UnsupportedMessage):
                unsupported.add(peer.application_version)
            else:  # it may have left since the read: the next caller reads again
                services().executors.forget_healthy(org, app)
            text = str(exc)
            problems.append(text if peer.executor_id in text else f"{peer.executor_id}: {text}")
    raise NoAnswer(f"no executor of app {app!r} answered ({len(problems)} asked): " + "; ".join(problems))


async def ask_app(
    org: str, app: str, make: Callable[[], Request], expected: type[R], spread: str = ""
) -> tuple[str, R]:
    """The reply of one healthy executor of the app to ``make()``, and which one gave it: the first
    that answers without an error, each asked within ``executor_timeout_secs``
    (:func:`first_answer`)."""
    svc = services()

    async def one(executor_id: str) -> R:
        request = make()
        reply = await svc.ask(ExecutorKey(org, app, executor_id), request, expected, svc.executor_timeout_secs)
        if reply.error_message:
            raise ExecutorRequestError(f"{request.type.value}: {reply.error_message[:300]}")
        return reply

    return await first_answer(org, app, one, spread)
