"""Alerts, durably: each delivery is a workflow, and so is each round of the condition rules.

- **Delivery** (``relay.alert.deliver``): one workflow per alert, whose id is
  ``alert:{idempotency key}`` (rule, subject, epoch), so an alert found twice
  (two instances, a scan repeated) is delivered once. It claims the key (the
  repeat interval is applied there), then tries, and after a failure that may
  pass (a 5xx, a timeout, no healthy executor) sleeps durably and tries again,
  with an exponential backoff, up to ``alerts.maxAttempts``. It resumes after
  a restart of Relay; one started by an instance that died is resumed by the
  instance that adopts it. It ends with ``alert.sent`` or ``alert.failed`` in
  the audit log.
- **Events** (ExecutorDead, RecoveryFailed, InstanceAdopted): every instance
  reads the audit log every ``alerts.pollIntervalSecs`` (:class:`AlertLoops`)
  and starts the delivery of each alert it finds; DBOS runs each id once.
- **Conditions** (the other kinds): once per ``alerts.checkIntervalSecs``
  every instance starts the round's job, ``relay-alerts:{interval number}``;
  DBOS runs it once, on whichever instance got there first. A rule asked of
  its app's executors gets a workflow of its own, ``{round id}:rule:{rule id}``,
  which observes the rule, records which subjects hold since when, and starts
  the deliveries of those due at once: an app that does not answer holds up no
  other rule's alerts. The rules read from the registry are observed together
  in the round's own step, and their deliveries started after it. An
  episode held back by the rule's ``minIntervalSecs`` (it began soon after
  the last alert about its subject) is delivered late, by
  ``alert:{idempotency key}:late``, at the first round after the interval in
  which it still holds.

- **Resolutions** (``relay.alert.resolve``): an alerted condition's episode
  that ends is written as ``alert.resolved`` in the audit log, in the
  transaction that ends it; the audit poll starts its resolution,
  ``alert:{the alert's key}:resolved``, which waits for that alert to be
  sent, then is delivered as an alert is. A death's ExecutorDead and
  RecoveryFailed alerts are resolved the same way when the poll reads the
  entry that ends the death (``executor.deleted``, or a final
  ``recovery.failed``: the executor connected again), for the rules whose
  alert of that death was fired, in the poll that reads the end. A rule
  removed while an alert of it is open writes ``alert.resolved`` for it
  (``ended: rule_removed``), delivered to where the removed rule sent it.

Delivery is at least once: an attempt whose answer was lost is made again
with the same body and idempotency key, for the receiver to drop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypedDict

from dbos import DBOS, SetWorkflowID
from dbos._error import DBOSConflictingWorkflowError

from relay.config import AlertsConfig
from relay.core.alerts import (
    CONDITION_KINDS,
    DEATH_KINDS,
    EVENT_KINDS,
    EXECUTOR_KINDS,
    RESOLVED_ACTION,
    Alert,
    AuditFact,
    Kind,
    Observed,
    Rule,
    alerts_for_event,
    condition_alert,
    death_resolutions,
    hold_secs,
    resolution_alert,
)
from relay.core.peers import backoff
from relay.core.times import us_iso
from relay.domain.alerts import cannot_make
from relay.errors import DatabaseError
from relay.logs import FailureLog
from relay.metrics import ALERTS_FAILED, ALERTS_SENT
from relay.store.alerts import AlertStore
from workflows.services import MAX_RECOVERY_ATTEMPTS, database_trouble, dedupe_key, relay_step, services

log = logging.getLogger("relay.alerts")

# Audit entries of the last minute are read again at every poll: an entry's id is drawn before
# its transaction commits, so one with a lower id than the cursor may appear after it. Further
# back when a transaction was open longer at the previous poll (AlertLoops.read_facts).
OVERLAP_SECS = 60.0


class ClaimRecord(TypedDict):
    """The checkpoint of ``relay.alert.claim``: whether to send, and the retry settings to use."""

    send: bool
    reason: str
    max_attempts: int
    retry_initial: float
    retry_max: float


class AttemptRecord(TypedDict):
    """The checkpoint of ``relay.alert.send``."""

    ok: bool
    retry: bool
    error: str | None
    destination: str


@relay_step("relay.alert.claim")
async def claim(alert: dict[str, Any], late: bool = False) -> ClaimRecord:
    svc = services().alerts
    claimed = await svc.store.claim(Alert.from_json(alert), late, DBOS.workflow_id)
    settings = svc.settings
    return {
        "send": claimed.send,
        "reason": claimed.reason,
        "max_attempts": settings.max_attempts,
        "retry_initial": settings.retry_initial_secs,
        "retry_max": settings.retry_max_secs,
    }


def _send_failed(exc: Exception) -> AttemptRecord:
    """An attempt that raised what Relay does not expect (database trouble is not this: the step
    retries it). A value that cannot be encoded or a request that cannot be built would be met again
    at every attempt: failed for good, saying why. Anything else (a socket's odd error, a receiver
    app's) may pass: tried again, within ``alerts.maxAttempts``."""
    if isinstance(exc, ValueError | TypeError):  # UnicodeError is a ValueError
        return {"ok": False, "retry": False, "error": cannot_make(exc), "destination": "?"}
    return {"ok": False, "retry": True, "error": f"{type(exc).__name__}: {exc}"[:500], "destination": "?"}


@relay_step("relay.alert.send", on_error=_send_failed)
async def send(alert: dict[str, Any], attempt: int) -> AttemptRecord:
    outcome, where = await services().alerts.sender.attempt(Alert.from_json(alert), attempt)
    return {"ok": outcome.ok, "retry": outcome.retry, "error": outcome.error, "destination": where}


@relay_step("relay.alert.finish")
async def finish(alert: dict[str, Any], sent: bool, attempts: int, error: str | None, destination: str) -> None:
    record = Alert.from_json(alert)
    # Counted by the run that wrote the outcome: DBOS runs the step again when its checkpoint was not
    # written (a resumed workflow whose first execution, in this process too, got this far).
    if await services().alerts.store.finish(record, sent, attempts, error, destination, dedupe_key()):
        (ALERTS_SENT if sent else ALERTS_FAILED).labels(record.kind).inc()


@DBOS.workflow(name="relay.alert.deliver", max_recovery_attempts=MAX_RECOVERY_ATTEMPTS)
async def deliver(alert: dict[str, Any]) -> str:
    return await _deliver(alert, late=False)


@DBOS.workflow(name="relay.alert.deliver_late", max_recovery_attempts=MAX_RECOVERY_ATTEMPTS)
async def deliver_late(alert: dict[str, Any]) -> str:
    """An alert held back by minIntervalSecs, sent if the interval has passed. A workflow of its own,
    with the arguments ``deliver`` has always had: during a rolling upgrade an instance of 0.2.0
    that recovers a delivery then meets either a shape it knows or a name it does not (which it
    leaves to an instance of this release), never a call it would fail."""
    return await _deliver(alert, late=True)


async def _deliver(alert: dict[str, Any], late: bool) -> str:
    claimed = await claim(alert, late)
    if not claimed["send"]:
        return f"not sent: {claimed['reason']}"
    return await _attempts(alert, claimed)


@relay_step("relay.alert.firing")
async def firing(resolves: str) -> ClaimRecord:
    """Where the delivery of the alert a resolution resolves stands: send the resolution once that
    alert was sent; wait while it is being sent (retrying) or its delivery has yet to claim it
    (``starting``: a death that ended at once), lest the resolution arrive first."""
    svc = services().alerts
    status = await svc.store.status_of(resolves)
    settings = svc.settings
    return {
        "send": status == "sent",
        "reason": status or "never claimed",
        "max_attempts": settings.max_attempts,
        "retry_initial": settings.retry_initial_secs,
        "retry_max": settings.retry_max_secs,
    }


# Where the alert a resolution resolves may stand while the resolution waits for it to be sent.
WAITING = frozenset({"sending", "starting"})


@DBOS.workflow(name="relay.alert.resolve", max_recovery_attempts=MAX_RECOVERY_ATTEMPTS)
async def resolve(alert: dict[str, Any]) -> str:
    """The resolution of an alerted condition whose episode ended (``alert:{its key}:resolved``),
    delivered as an alert is, once the alert it resolves was sent, never before it (its delivery may
    still be retrying when the episode ends). Not sent when that alert's delivery failed: nobody
    was told the condition began. A workflow of its own, which an instance of the previous release
    does not know and leaves to one of this release."""
    waits = 0
    while True:
        state = await firing(alert["resolves"])
        # The alert's own delivery ends within its attempts' backoff; twice that, for the attempts' time.
        if state["reason"] not in WAITING or waits >= 2 * state["max_attempts"]:
            break
        waits += 1
        await DBOS.sleep_async(backoff(waits, state["retry_initial"], state["retry_max"]))
    if not state["send"]:
        return f"not sent: the alert it resolves is {state['reason']}"
    return await _attempts(alert, state)


async def _attempts(alert: dict[str, Any], claimed: ClaimRecord) -> str:
    """Try until sent, refused for good, or out of attempts; durable sleeps in between."""
    attempt = 0
    while True:
        attempt += 1
        outcome = await send(alert, attempt)
        if outcome["ok"]:
            await finish(alert, True, attempt, None, outcome["destination"])
            return "sent"
        if not outcome["retry"] or attempt >= claimed["max_attempts"]:
            await finish(alert, False, attempt, outcome["error"], outcome["destination"])
            return "failed"
        wait = backoff(attempt, claimed["retry_initial"], claimed["retry_max"])
        log.warning("alert %s: attempt %d to %s failed (%s); next in %gs",
                    alert["rule_id"], attempt, outcome["destination"], outcome["error"], wait)  # fmt: skip
        await DBOS.sleep_async(wait)


# -- the condition rules, once per interval --------------------------------------------------


def _rule_json(rule: Rule) -> dict[str, Any]:
    return {"id": rule.id, "org": rule.org, "app": rule.app, "kind": rule.kind.value,
            "params": rule.params, "created_at": rule.created_at}  # fmt: skip


def _rule(data: dict[str, Any]) -> Rule:
    return Rule(data["id"], data["org"], data["app"], Kind(data["kind"]), data["params"], data["created_at"])


@relay_step("relay.alerts.rules")
async def condition_rules() -> list[dict[str, Any]]:
    svc = services().alerts
    rules = await svc.store.rules_of(CONDITION_KINDS)
    return [_rule_json(rule) for rule in rules]


def _evaluation_failed(exc: Exception) -> list[dict[str, Any]]:
    return []  # this round learns nothing about the rule; the next one asks again


async def due_alerts(
    store: AlertStore,
    rule: Rule,
    observed: list[Observed],
    reading: int | None = None,
    over: str | None = None,
    counted_at: float | None = None,
) -> list[tuple[Alert, bool]]:
    """Record which subjects hold (unless a reading newer than ``reading`` was recorded first), and a
    WorkflowFailure rule's count time (``counted_at``) with them; (alert, late) of those due: not yet
    claimed, or held back by minIntervalSecs and free to go out now (late), the episode still holding.
    An alerted episode that ends is resolved, saying why (``over``, or the kind's own reason):
    :meth:`AlertStore.settle`."""
    by_key = {seen.key: seen for seen in observed}
    due = await store.settle(rule, sorted(by_key), hold_secs(rule), reading, over, counted_at)
    alerts = [condition_alert(rule, by_key[key], episode, since) for key, episode, since in due if key in by_key]
    keys = [a.idempotency_key for a in alerts]
    claimed = await store.claimed(keys)
    late = await store.late(sorted(claimed & set(keys))) if claimed else set()
    return [(a, a.idempotency_key in late) for a in alerts if a.idempotency_key not in claimed - late]


def late_workflow_id(alert: Alert) -> str:
    """The late delivery's id: the first one ran (and held the alert back) under ``alert.workflow_id``."""
    return f"{alert.workflow_id}:late"


async def _evaluate(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Observe one rule, record which subjects hold, and return the alerts due (:func:`due_alerts`)."""
    svc = services().alerts
    rule = _rule(data)
    reading = await svc.store.reading()
    seen = await svc.observer.observe_why(rule)
    if seen is None:
        return []
    # On time, an alert as relay.alerts.evaluate has always checkpointed it (an earlier build resuming
    # a round of relay.alerts.check during a rolling upgrade reads those); late, wrapped, which no
    # alert's own members can be mistaken for. relay.alerts.evaluate_rule checkpoints the same shapes.
    return [
        {"late": a.to_json()} if late else a.to_json()
        for a, late in await due_alerts(svc.store, rule, seen.observed, reading, seen.over, seen.counted_at)
    ]


@relay_step("relay.alerts.evaluate", on_error=_evaluation_failed)
async def evaluate(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One rule of a round of ``relay.alerts.check`` (:func:`_evaluate`)."""
    return await _evaluate(data)


@relay_step("relay.alerts.evaluate_rule")
async def evaluate_rule(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The alerts due of one rule of a round (:func:`_evaluate`), in the shapes ``evaluate`` checkpoints.
    It waits for a turn among the rules this instance evaluates at once, and a rule whose evaluation
    by an earlier round still waits for its app is left to the next round. A failed evaluation is
    left to the next round as ``evaluate`` leaves it; database trouble fails the step (tried again)."""
    async with services().alerts.evaluations.turn(data["id"]) as evaluating:
        return await _evaluate_or_skip(data) if evaluating else []


@relay_step("relay.alerts.evaluate_registry")
async def evaluate_registry(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The alerts due of the round's rules read from Relay's registry alone (no executor is asked:
    each is a query or two), one after the other, in one checkpoint. A rule whose evaluation fails
    is left to the next round; database trouble fails the step (tried again)."""
    return [due for data in rules for due in await _evaluate_or_skip(data)]


async def _evaluate_or_skip(data: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`_evaluate`; a rule whose evaluation fails is logged and left to the next round (nothing
    due), database trouble raised (it fails the step, which is tried again)."""
    try:
        return await _evaluate(data)
    except Exception as exc:
        if database_trouble(exc):
            raise
        log.warning("alert rule %s in %s failed: %s: %s", data["id"], DBOS.workflow_id, type(exc).__name__, exc)
        return _evaluation_failed(exc)


def asks_executors(data: dict[str, Any]) -> bool:
    """Whether the rule's condition is asked of its app's executors (which may hang), not read from
    the registry."""
    return Kind(data["kind"]) in EXECUTOR_KINDS


async def _start_deliveries(found: list[dict[str, Any]]) -> int:
    """Start the delivery of each alert due (a plain alert on time, ``{"late": alert}`` late)."""
    for due in found:
        late = set(due) == {"late"}
        data = due["late"] if late else due
        alert = Alert.from_json(data)
        with SetWorkflowID(late_workflow_id(alert) if late else alert.workflow_id):
            await DBOS.start_workflow_async(deliver_late if late else deliver, data)
    return len(found)


@DBOS.workflow(name="relay.alerts.rule", max_recovery_attempts=MAX_RECOVERY_ATTEMPTS)
async def condition_rule(data: dict[str, Any]) -> int:
    """One rule of a round: evaluated (:func:`evaluate_rule`), then the deliveries of its alerts due
    started, whatever the round's other rules are doing."""
    return await _start_deliveries(await evaluate_rule(data))


def rule_workflow_id(round_id: str, rule_id: str) -> str:
    """A rule's workflow in a round: started once however often the round is resumed."""
    return f"{round_id}:rule:{rule_id}"


@DBOS.workflow(name="relay.alerts.round", max_recovery_attempts=MAX_RECOVERY_ATTEMPTS)
async def condition_round() -> int:
    """A round of the condition rules. A rule asked of its app's executors gets a workflow of its own
    (:func:`condition_rule`), whose alerts go out as soon as it is evaluated, not once the slowest
    rule of the round (an app whose executors hang: executorRequestTimeoutSecs a few times over) is.
    The rules read from the registry alone are evaluated together in the round's own step, then their
    deliveries started: they never wait for an executor, and a workflow each would cost five DBOS
    transactions a rule every round. The round does not wait for its rules' workflows: it has nothing
    to do after them, and DBOS resumes each of them on its own. A workflow of its own beside
    ``relay.alerts.check`` (one step per rule, one after the other), whose steps differ: during a
    rolling upgrade an instance of the previous release that recovers this round meets a name it
    does not know (and leaves it to an instance of this release), never checkpoints it would read
    as its own; this release still finishes the rounds of ``relay.alerts.check`` that one started."""
    rules = await condition_rules()
    for data in filter(asks_executors, rules):
        with SetWorkflowID(rule_workflow_id(DBOS.workflow_id or "", data["id"])):
            await DBOS.start_workflow_async(condition_rule, data)
    registry = [data for data in rules if not asks_executors(data)]
    if registry:
        await _start_deliveries(await evaluate_registry(registry))
    return len(rules)


@DBOS.workflow(name="relay.alerts.check", max_recovery_attempts=MAX_RECOVERY_ATTEMPTS)
async def check_conditions() -> int:
    """The round of earlier releases, one rule after the other: kept for the rounds they started
    (this release starts :func:`condition_round`). Its steps must stay as they are."""
    started = 0
    for rule in await condition_rules():
        started += await _start_deliveries(await evaluate(rule))
    return started


def check_id(interval_secs: float, now: float | None = None) -> str:
    """This interval's round of the condition rules: the same id on every instance."""
    return f"relay-alerts:{int((time.time() if now is None else now) // interval_secs)}"


# -- every instance's loops --------------------------------------------------------------------


async def start_delivery(alert: Alert) -> None:
    """Start the delivery of an alert (``relay.alert.deliver``) or of a resolution
    (``relay.alert.resolve``), under its workflow id: DBOS runs each id once."""
    with SetWorkflowID(alert.workflow_id):
        await DBOS.start_workflow_async(deliver if alert.resolves is None else resolve, alert.to_json())


class AlertLoops:
    """Reading the audit log for event rules, and starting each interval's round of the others.

    Both act only while this instance holds its lease: an instance paused past
    it (and adopted) starts nothing when it wakes up before it finds out.
    """

    def __init__(
        self,
        store: AlertStore,
        settings: AlertsConfig,
        lease_held: Callable[[], bool],
        start: Callable[[Alert], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.lease_held = lease_held
        self._start = start or start_delivery
        self._cursor = 0
        self._server: datetime | None = None  # when the database server read at the last poll started
        self.overlap_secs = OVERLAP_SECS
        # When the oldest transaction open at the previous poll began: entries committed since that
        # poll are no older (each is dated its transaction's start), whatever their ids.
        self._open_since: datetime | None = None
        self._started: dict[str, float] = {}  # workflow ids this instance started lately
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._poll_events()), asyncio.create_task(self._schedule_checks())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _poll_events(self) -> None:
        told = FailureLog(log, "reading the audit log for alerts failed", "the audit log is read for alerts again")
        while True:
            try:
                if self.lease_held():
                    await self.poll_events()
                    told.worked()
            except DatabaseError as exc:
                told.failed(exc)
            except Exception:
                log.exception("reading the audit log for alerts failed")
            await asyncio.sleep(self.settings.poll_interval_secs)

    async def read_facts(self, after: int) -> list[AuditFact]:
        """The audit entries that fire event rules after the cursor ``after``, and again those up to it
        that may have been committed since the previous read (the cursor is :meth:`poll_events`')."""
        open_since = await self.store.open_since()  # first: for entries the read below cannot see yet
        facts = await self.store.audit_facts(after, self.overlap_secs, not_before=self._open_since)
        self._open_since = open_since
        return facts

    async def poll_events(self) -> int:
        """Start the delivery of every alert the new audit entries fire; returns how many were started."""
        rules = await self.store.rules_of(EVENT_KINDS)
        removed = await self.store.removed_rules(DEATH_KINDS)
        stored, drawn, server = await self.store.cursor_and_drawn()
        if drawn < self._cursor:
            # The database went back in time: the ids read since its moment are drawn again, for new
            # entries, below this reader's cursor, where only the overlap would find them (a page a
            # poll). The cursor restored with the log is where its entries were read up to.
            log.warning(
                "the audit log went back in time (ids are drawn again from %d, read up to %d: a restore, or a "
                "failover to a replica that lagged); read on from %d",
                drawn, self._cursor, stored,
            )  # fmt: skip
            self._cursor = 0
        elif self._server is not None and server != self._server and stored < self._cursor:
            # Another server start (a restore, a failover, a restart): the ids may have been drawn
            # again, and more of them since than were lost, which the sequence no longer shows. The
            # stored cursor is where the log's entries were read up to; after a plain restart it is
            # this reader's or beyond, and reading on from it sends nothing twice (deliveries are
            # claimed once).
            log.warning(
                "the database server started again (at %s: a restart, a failover or a restore, which may have "
                "gone back in time); the audit log is read for alerts on from %d (read up to %d)",
                us_iso(server), stored, self._cursor,
            )  # fmt: skip
            self._cursor = 0
        self._server = server
        after = max(self._cursor, stored)
        facts = await self.read_facts(after)
        now = time.monotonic()
        made = [(fact, a) for fact in facts for a in self.alerts_for(fact, rules, removed)]
        # A death's end resolves no alert resolved already: its rule was removed while the death went
        # on, and put back (or removed again) since. Its resolution's workflow id is the same, but
        # DBOS forgets a finished workflow after relayWorkflowsDays and retention the resolution's own
        # row after auditDays, and the death may go on longer.
        ends = sorted({a.resolves for fact, a in made if a.resolves is not None and fact.action != RESOLVED_ACTION})
        done = await self.store.resolved(ends) if ends else set()
        wanted = [a for fact, a in made if fact.action == RESOLVED_ACTION or a.resolves not in done]
        if not self.settings.send_resolutions:
            wanted = [a for a in wanted if a.resolves is None]
        # A death's end makes a resolution for each of its app's death rules: only the alerts fired
        # are resolved. The entry that fired one was read before the entry that ends its death (it
        # has the smaller id), by this poll or an earlier one: a delivery claimed or started (it may
        # be another instance's), or one this poll starts. The resolution is started now, in the
        # same poll: an end left to be read again later (in the overlap) was lost when the poll lagged
        # more than the overlap behind the log (a burst of deaths, a restart) or more than a page
        # of entries came between.
        firing = {a.idempotency_key for a in wanted if a.resolves is None} | {
            wid.removeprefix("alert:") for wid in self._started
        }
        ended = sorted({a.resolves for a in wanted if a.resolves is not None and Kind(a.kind) in DEATH_KINDS} - firing)
        fired = firing | (await self.store.fired(ended) if ended else set())
        found = [
            a
            for a in wanted
            if a.workflow_id not in self._started
            and (a.resolves is None or a.resolves in fired or Kind(a.kind) not in DEATH_KINDS)
        ]
        claimed = await self.store.claimed([a.idempotency_key for a in found]) if found else set()
        started = 0
        for alert in found:
            if alert.idempotency_key not in claimed:  # else its delivery runs, or ran, already
                await self._start(alert)
                started += 1
            self._started[alert.workflow_id] = now
        newest = max((fact.id for fact in facts), default=after)
        if newest > after:
            await self.store.advance(newest)
        self._cursor = max(after, newest)
        self._started = {wid: at for wid, at in self._started.items() if now - at < 2 * OVERLAP_SECS}
        return started

    @staticmethod
    def alerts_for(fact: AuditFact, rules: list[Rule], removed: Sequence[Rule] = ()) -> list[Alert]:
        """The alerts an audit entry fires: an event rule's, the resolution of a condition's alert,
        or those of a death's alerts (the entry ends the death). ``removed``: death rules removed
        (their destinations kept, :meth:`AlertStore.removed_rules`), whose alerts of a death that
        ends are resolved too, whenever its end was written: the removal resolved only those of
        deaths it found going on, and a death may be over before its end is written (the executor
        connected again; its run writes the final ``recovery.failed`` when it finds out), or end while
        the removal waits for the rules' rows. One the removal resolved is resolved once: its row
        says so (:meth:`poll_events` leaves its death's end out), and an end read before the removal
        committed makes a resolution of the same id, ``alert:{key}:resolved``, which DBOS runs once."""
        if fact.action == RESOLVED_ACTION:
            resolution = resolution_alert(fact)
            return [] if resolution is None else [resolution]
        return [*alerts_for_event(fact, rules), *death_resolutions(fact, [*rules, *removed])]

    async def _schedule_checks(self) -> None:
        interval = self.settings.check_interval_secs
        told = FailureLog(log, "cannot start the alert checks", "the alert checks start again")
        while True:
            workflow_id = check_id(interval)
            try:
                if self.lease_held():
                    if await self.store.rules_of(CONDITION_KINDS):
                        with SetWorkflowID(workflow_id):
                            await DBOS.start_workflow_async(condition_round)
                    told.worked()
            except DBOSConflictingWorkflowError:
                # An instance of the previous release started this interval's round as relay.alerts.check
                # first (a rolling upgrade): the round runs there, once, as it would here.
                log.debug("the alert check %s was started by an instance of the previous release", workflow_id)
            except Exception as exc:
                told.failed(exc)
            await asyncio.sleep(interval - time.time() % interval + 0.01)
