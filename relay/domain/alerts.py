"""Alerts: managing the rules, observing their conditions, delivering one attempt.

- :class:`AlertRules`: the API's rules, created and deleted with their audit
  entries (``alerting_rule.create``, ``alerting_rule.delete``); relay.yaml's
  are read-only. A rule's webhook must pass the allow-list when it is created,
  and passes it again at every send.
- :class:`ConditionObserver`: for each condition rule, the subjects for which
  its condition holds now, read from Relay's registry (no healthy executor, a
  recovery waiting) or asked of a healthy executor of the app (failed
  workflows, a queue held up: ``get_workflow_aggregates``); ``None`` when it
  cannot be known now (no executor answered), which changes nothing.
- :class:`RuleEvaluations`: how many condition rules this instance evaluates
  at once, and which.
- :class:`AlertSender`: one attempt at delivering an alert, to its rule's
  webhook (signed) or to the alert handler of its receiving app's executors
  (the protocol's ``alert`` message), as the rule says at that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from relay.config import AlertRuleConfig
from relay.core.alerts import Alert, Kind, Observed, Rule, idempotency_header, signature, webhook_body
from relay.core.appfigures import FAILED_STATUSES
from relay.core.ids import owned_by
from relay.core.times import ms_iso, sdk_time
from relay.domain.gateway import ExecutorGateway
from relay.errors import Conflict, ExecutorRequestError, NotFound, TooManyRequests, UnsupportedMessage
from relay.net.webhook import Attempt, WebhookSender, describe
from relay.store.alerts import AlertStore, RuleRecord
from relay.store.apps import AppStore
from relay.store.audit import AuditEntry, write_audit
from relay.store.db import Database
from relay_protocol import (
    AlertReply,
    AlertRequest,
    GetWorkflowAggregatesBody,
    GetWorkflowAggregatesReply,
    GetWorkflowAggregatesRequest,
)

log = logging.getLogger("relay.alerts")

SECRET_PREFIX = "whsec_"
# Queues of DBOS's own (recovered workflows wait on its internal queue): not the app's.
INTERNAL_QUEUE_PREFIX = "_dbos_internal"
# How far before the previous count of a WorkflowFailure rule each count reaches back. An executor
# stamps a failure (completed_at, its database's clock when the status write began) before that
# write commits: a count reading in between does not see it, and a next count reaching back only
# to the previous one's moment found it too old, so neither counted it (on a loaded machine the
# write's lag grows). It also covers a database clock a little behind Relay's.
COMMIT_LAG_SECS = 2.0
# How much further back than the rule's window and one check interval a count reaches to the last
# one, at most. The last count's time is kept in the database: after Relay was down for a day (or no
# executor could answer), a count reaching back the whole gap would measure a day's failures against
# a threshold per windowSecs and page for a rate the rule does not describe. Failures older than
# this, in such a gap, are left uncounted (the log says so).
MAX_CATCH_UP_SECS = 3600.0


@dataclass(frozen=True)
class Created:
    record: RuleRecord
    secret: str | None  # shown once: in the answer to the request that created the rule


class AlertRules:
    def __init__(self, db: Database, store: AlertStore, apps: AppStore, sender: WebhookSender) -> None:
        self.db = db
        self.store = store
        self.apps = apps
        self.sender = sender

    async def refusal(self, org: str, app: str, rule: AlertRuleConfig) -> tuple[str, str] | None:
        """(where, why) a rule cannot be created for ``app``; None if it can. Raises NotFound for no app
        (``app`` or the receiving one)."""
        if not await self.apps.exists(org, app):
            raise NotFound(f"no app {app!r} in org {org!r}")
        if rule.webhook is not None:
            refused = await self.sender.check(rule.webhook)
            return None if refused is None else ("body.webhook", refused)
        receiver = rule.receiver_app or app
        if rule.kind is Kind.UNRESPONSIVE_APPLICATION and receiver == app:
            why = "an app with no executor cannot take an alert about itself: give a webhook or another app"
            return "body.receivingAppName", why
        if not await self.apps.exists(org, receiver):
            raise NotFound(f"no app {receiver!r} in org {org!r} to receive the alerts")
        return None

    async def create(self, org: str, app: str, rule: AlertRuleConfig, actor: str) -> Created:
        secret = None
        if rule.webhook is not None:
            secret = rule.secret or SECRET_PREFIX + secrets.token_urlsafe(32)
        record = {
            "id": str(uuid.uuid4()),
            "org": org,
            "app": app,
            "kind": rule.kind.value,
            "params": rule.params(),
            "min_interval_secs": rule.min_interval_secs,
            "webhook_url": rule.webhook,
            "secret": secret,
            "format": rule.format,
            "receiver_app": None if rule.webhook else (rule.receiver_app or app),
            "created_by": actor,
        }
        async with self.db.transaction() as conn:
            created = await self.store.create(conn, record)
            detail = {"ruleId": created.id, "ruleType": rule.kind.value, **destination_of(created)}
            await write_audit(conn, org, app, AuditEntry("alerting_rule.create", actor, detail=detail))
        return Created(created, None if rule.secret else secret)

    async def delete(self, org: str, app: str, rule_id: str, actor: str) -> None:
        async with self.db.transaction() as conn:
            record = await self.store.get_rule(rule_id)
            if record is None or (record.org, record.app) != (org, app):
                raise NotFound(f"no alerting rule {rule_id!r} for app {app!r}")
            if record.source == "config":
                raise Conflict("defined_in_config", f"rule {rule_id!r} is defined in relay.yaml; change it there")
            await self.store.removing(conn, [rule_id], f"its rule was deleted (by {actor})")
            if not await self.store.delete(conn, rule_id):
                raise NotFound(f"no alerting rule {rule_id!r} for app {app!r}")  # deleted meanwhile
            detail = {"ruleId": rule_id, "ruleType": record.kind.value}
            await write_audit(conn, org, app, AuditEntry("alerting_rule.delete", actor, detail=detail))


def destination_of(record: RuleRecord) -> dict[str, Any]:
    """Where a rule's alerts go, as it may be shown: a webhook's scheme, host and port, never its path or secret."""
    if record.webhook_url is None:
        return {"receiverApp": record.receiver_app}
    return {"webhook": describe(record.webhook_url), "format": record.format, "secretSet": record.secret is not None}


def _sdk_time(unix: float) -> str:
    """A bound of an aggregate the executor parses: in the SDK's form, as the API's filters send it."""
    return sdk_time(datetime.fromtimestamp(unix, UTC))


class Seen(NamedTuple):
    """What an evaluation of a condition rule found (:meth:`ConditionObserver.observe_why`)."""

    observed: list[Observed]  # the subjects the condition holds for now
    # Why the condition holds no longer for a subject it held for (None: the kind's own reason, :func:`why_over`).
    over: str | None = None
    # A WorkflowFailure rule's: when its count was made, kept as the evaluation settles (AlertStore.settle).
    counted_at: float | None = None


class ConditionObserver:
    def __init__(self, store: AlertStore, gateway: ExecutorGateway, check_interval_secs: float = 30.0) -> None:
        self.store = store
        self.gateway = gateway
        self.check_interval_secs = check_interval_secs

    async def observe(self, rule: Rule) -> list[Observed] | None:
        """The subjects the rule's condition holds for now; None when that cannot be known now."""
        seen = await self.observe_why(rule)
        return None if seen is None else seen.observed

    async def observe_why(self, rule: Rule) -> Seen | None:
        """:meth:`observe`, why the condition holds no longer for a subject it held for, and when a
        WorkflowFailure rule's count was made (:class:`Seen`)."""
        if rule.kind is Kind.UNRESPONSIVE_APPLICATION:
            return await self._unresponsive(rule)
        if rule.kind is Kind.RECOVERY_BLOCKED:
            return Seen(await self._blocked(rule))
        try:
            if rule.kind is Kind.WORKFLOW_FAILURE:
                return await self._failures(rule)
            if rule.kind is Kind.SLOW_QUEUE:
                held = await self._slow_queues(rule)
                return None if held is None else Seen(held)
        except (ExecutorRequestError, TooManyRequests) as exc:
            log.debug("alert rule %s of %s/%s cannot be evaluated now: %s", rule.id, rule.org, rule.app, exc)
            return None
        raise ValueError(f"{rule.kind} is not a condition")

    async def _unresponsive(self, rule: Rule) -> Seen:
        had, healthy = await self.store.app_executors(rule.org, rule.app)
        if not had:
            # Never connected (not there yet), or every id it had is forgotten: retention prunes an
            # id not seen for executorIdsDays once its record is gone. An episode that was alerted
            # ends then, and its resolution says so rather than that the app came back.
            why = (f"Relay no longer remembers any executor of app {rule.app} (their ids, not seen for "
                   "retention.executorIdsDays, were pruned), so it stops watching the app until one connects; "
                   "it is not known to be back")  # fmt: skip
            return Seen([], why)
        if healthy > 0:
            return Seen([], f"app {rule.app} has {healthy} healthy executor{'s' if healthy > 1 else ''} again")
        message = f"App {rule.app} has had no healthy executor for {rule.param('forSecs', 60.0):g} s."
        metadata = {"application_name": rule.app, "connected_executor_count": "0"}
        return Seen([Observed({"appName": rule.app}, rule.app, message, metadata)])

    async def _blocked(self, rule: Rule) -> list[Observed]:
        """The deaths whose recovery waits (for the rule's ``reason``, if it names one), and those it
        alerted that are not over yet (:meth:`AlertStore.still_dead`)."""
        wanted = rule.param("reason")
        observed = [
            Observed(
                {"executorId": executor},
                f"{executor}@{epoch}",
                f"Recovery of dead executor {executor} of app {rule.app} has been waiting "
                f"for {rule.param('forSecs', 60.0):g} s: {reason}.",
                {"executor_id": executor, "blocked_reason": reason, "epoch": str(epoch)},
                epoch=str(epoch),
            )
            for executor, epoch, reason in await self.store.blocked(rule.org, rule.app)
            if wanted is None or reason == wanted
        ]
        waiting = {seen.key for seen in observed}
        for executor, epoch in await self.store.still_dead(rule.id, rule.org, rule.app):
            if f"{executor}@{epoch}" not in waiting:  # alerted already: only its episode goes on
                message = f"Dead executor {executor} of app {rule.app} is still being recovered."
                metadata = {"executor_id": executor, "epoch": str(epoch)}
                observed.append(
                    Observed({"executorId": executor}, f"{executor}@{epoch}", message, metadata, str(epoch))
                )
        return observed

    async def _aggregates(self, rule: Rule, body: GetWorkflowAggregatesBody) -> GetWorkflowAggregatesReply | None:
        reply = await self.gateway.ask(
            rule.org, rule.app, lambda: GetWorkflowAggregatesRequest(body=body), GetWorkflowAggregatesReply
        )
        if reply.error_message:
            log.info("alert rule %s: the executor could not aggregate workflows", rule.id)
            return None
        return reply

    async def _failures(self, rule: Rule) -> Seen | None:
        name: str | None = rule.param("workflowName")
        now = time.time()
        # The last count that settled, on whichever instance made it: a window shorter than the time
        # between two counts would leave failures in the gap counted by neither. Never counted (a new
        # rule, or one an earlier release counted): one check interval back.
        since = await self.store.counted_at(rule.id)
        if since is None:
            since = now - self.check_interval_secs
        # At least back to the last count (the loop's interval, and the time a count takes), and a
        # margin before it for a failure stamped before that count and committed after it read.
        configured = float(rule.param("windowSecs", 300.0))
        window = max(configured, now - since + COMMIT_LAG_SECS)
        reach = configured + self.check_interval_secs + MAX_CATCH_UP_SECS
        capped = window > reach
        window = min(window, reach)
        threshold = int(rule.param("count", 1))
        body = GetWorkflowAggregatesBody(
            group_by_name=True,
            select_count=True,
            status=list(FAILED_STATUSES),
            completed_after=_sdk_time(now - window),
            name=[name] if name else None,
            application_name=owned_by(rule.app),
        )
        reply = await self._aggregates(rule, body)
        if reply is None:
            return None
        if capped:  # said once: this count settles, and the next reaches back to it
            log.info("alert rule %s of %s/%s was last counted %.0f s ago: failures before the last %.0f s "
                     "are not counted", rule.id, rule.org, rule.app, now - since, window)  # fmt: skip
        failed = sum(row.count or 0 for row in reply.output)
        if failed < threshold:
            return Seen([], counted_at=now)
        which = f"workflow {name}" if name else "workflows"
        message = f"{failed} {which} of app {rule.app} failed in the last {configured:g} s (threshold {threshold})."
        if window > max(configured, self.check_interval_secs + COMMIT_LAG_SECS) + self.check_interval_secs:
            # A count catching up on a gap (Relay down, no executor answering) counted longer than the
            # window, and says so: the threshold is the rule's, the span is not.
            message = (f"{failed} {which} of app {rule.app} failed in the {window:.0f} s since the rule was last "
                       f"counted (threshold {threshold} in {configured:g} s).")  # fmt: skip
        metadata = {
            "workflow_name": name or "*",
            "failed_workflow_count": str(failed),
            "threshold": str(threshold),
            "period_secs": f"{configured:g}",
        }
        return Seen([Observed({"workflowName": name or "*"}, name or "*", message, metadata)], counted_at=now)

    async def _slow_queues(self, rule: Rule) -> list[Observed] | None:
        name: str | None = rule.param("queueName")
        threshold = float(rule.param("thresholdSecs", 60.0))
        body = GetWorkflowAggregatesBody(
            group_by_queue_name=True,
            select_count=True,
            select_min_created_at=True,
            status=["ENQUEUED"],
            end_time=_sdk_time(time.time() - threshold),
            queue_name=[name] if name else None,
            application_name=owned_by(rule.app),
        )
        reply = await self._aggregates(rule, body)
        if reply is None:
            return None
        held = []
        for row in reply.output:
            queue = row.group.get("queue_name")
            if not queue or queue.startswith(INTERNAL_QUEUE_PREFIX) or not row.count:
                continue
            held.append((queue, int(row.count), row.min_created_at))
        if not held:
            return []
        # One alert per rule, as Conductor sends it: ``queue_name`` is the rule's filter (``*`` for a
        # rule that names no queue), ``stuck_workflow_count`` the workflows of every queue it covers;
        # which queues are held up is Relay's addition (``queues``).
        held.sort()
        stuck = sum(count for _, count, _ in held)
        starts = [at for _, _, at in held if at]
        oldest = (ms_iso(min(starts)) or "") if starts else ""
        queues = ", ".join(queue for queue, _, _ in held)
        which = f"queue {queues}" if len(held) == 1 else f"queues {queues}"
        message = (
            f"{stuck} workflows of app {rule.app} have waited in {which} "
            f"for more than {threshold:g} s (the oldest since {oldest or 'unknown'})."
        )
        metadata = {
            "queue_name": name or "*",
            "stuck_workflow_count": str(stuck),
            "threshold_secs": f"{threshold:g}",
            "oldest_enqueued_at": oldest,
            "queues": queues,
        }
        return [Observed({"queueName": name or "*"}, name or "*", message, metadata)]


# Condition rules an instance evaluates at once: each may wait for an app's executors
# (executorRequestTimeoutSecs, a few times over when several are tried), and the database and the
# executors take a round's rules a few at a time rather than all at once.
EVALUATIONS_AT_ONCE = 8


class RuleEvaluations:
    """The turns of the condition rules' evaluations on this instance: :data:`EVALUATIONS_AT_ONCE` at a
    time, and one at a time per rule. A rule whose app hangs is still being evaluated by an earlier
    round when the next rounds come (every ``checkIntervalSecs``): those learn nothing about it rather
    than pile up behind it, each holding a turn that the other rules wait for."""

    def __init__(self, at_once: int = EVALUATIONS_AT_ONCE) -> None:
        self._turns = asyncio.Semaphore(at_once)
        self._busy: set[str] = set()

    @contextlib.asynccontextmanager
    async def turn(self, rule_id: str) -> AsyncIterator[bool]:
        """Yields once the rule may be evaluated (True), or at once False if it is being evaluated."""
        if rule_id in self._busy:
            yield False
            return
        self._busy.add(rule_id)
        try:
            async with self._turns:
                yield True
        finally:
            self._busy.discard(rule_id)


def cannot_make(exc: BaseException) -> str:
    """An attempt's error when Relay could not make the request (not tried again: it would fail alike)."""
    return f"Relay could not make the delivery ({type(exc).__name__}: {exc}); not tried again"[:500]


class AlertSender:
    """One attempt at delivering an alert, where its rule says now."""

    def __init__(self, store: AlertStore, gateway: ExecutorGateway, webhooks: WebhookSender) -> None:
        self.store = store
        self.gateway = gateway
        self.webhooks = webhooks

    async def attempt(self, alert: Alert, attempt: int) -> tuple[Attempt, str]:
        """The attempt's outcome, and where it went (as it may be shown)."""
        record = await self.store.get_rule(alert.rule_id)
        if record is None and alert.resolves is not None:
            # A resolution of an alert the rule left open when it was removed: to where the alert went.
            record = await self.store.removed_rule(alert.rule_id)
        if record is None:
            return Attempt(False, error="its rule was deleted"), "(deleted rule)"
        where = destination_of(record)
        if record.webhook_url is not None:
            try:
                body = webhook_body(alert, record.format)
                headers = {
                    "X-Relay-Event": alert.kind,
                    "X-Relay-Idempotency-Key": idempotency_header(alert.idempotency_key),
                    "X-Relay-Delivery-Attempt": str(attempt),
                }
                if record.secret:
                    headers["X-Relay-Signature"] = signature(record.secret, body)
            except Exception as exc:  # a request that cannot be made now cannot be made at the next attempt
                log.exception("alert %s: the delivery to %s could not be made", alert.rule_id, where["webhook"])
                return Attempt(False, error=cannot_make(exc)), where["webhook"]
            # Sending's own failures (the network, the receiver) are the sender's to judge: retried.
            return await self.webhooks.post(record.webhook_url, body, headers), where["webhook"]
        receiver = record.receiver_app or record.app
        return await self._to_app(alert, record.org, receiver), f"app {receiver}"

    async def _to_app(self, alert: Alert, org: str, receiver: str) -> Attempt:
        def request() -> AlertRequest:
            return AlertRequest(name=alert.kind, message=alert.message, metadata=alert.sdk_metadata())

        try:
            reply = await self.gateway.ask(org, receiver, request, AlertReply)
        except UnsupportedMessage:
            return Attempt(False, error=f"the executors of app {receiver} do not take alerts (an older SDK)")
        except (ExecutorRequestError, TooManyRequests) as exc:
            return Attempt(False, retry=True, error=f"app {receiver}: {exc}"[:500])
        if not reply.success:
            lines = (reply.error_message or "").strip().splitlines()
            why = lines[-1] if lines else "no reason given"
            return Attempt(False, retry=True, error=f"app {receiver}'s alert handler failed: {why}"[:500])
        return Attempt(True)
