"""Alerts: the kinds of rule, what fires them, and what a delivery carries (pure).

Two families of rule:

- **events**, read from the audit log (``executor.dead``, ``recovery.failed``,
  ``relay.instance_adopted``): :func:`alerts_for_event` turns one entry into the
  alerts of the rules it matches;
- **conditions**, observed on a schedule (no healthy executor, a recovery
  blocked, failed workflows, a queue held up): an observation is a set of
  :class:`Observed` subjects; one that holds for the rule's ``forSecs`` fires
  once per *episode* (the stretch of time it keeps holding).

Every alert has an idempotency key, ``{rule}:{subject}:{epoch}``: the epoch
is the executor's connection epoch for a death, the lease epoch for an
adoption, the episode for a condition. Its delivery workflow is named after
it, so an alert found twice (two instances, a repeated scan) is delivered
once, and a second death of the same executor (a new epoch) is a new alert.

A condition's episode that was alerted and ends (``alert.resolved`` in the
audit log, written when it ends) is followed by its **resolution**
(:func:`resolution_alert`): the same rule, kind and subject, the key
``{the alert's key}:resolved``, and a message saying why it ended. So is a
death's ``ExecutorDead`` and ``RecoveryFailed`` alert, once the death is over
(:func:`death_resolutions`): its recovery succeeded (``executor.deleted``), or
the executor connected again (a final ``recovery.failed``). An alert whose rule is
removed while it is open is resolved then (``metadata.ended``: ``rule_removed``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Final
from urllib.parse import quote


class Kind(StrEnum):
    WORKFLOW_FAILURE = "WorkflowFailure"
    SLOW_QUEUE = "SlowQueue"
    UNRESPONSIVE_APPLICATION = "UnresponsiveApplication"
    EXECUTOR_DEAD = "ExecutorDead"
    RECOVERY_BLOCKED = "RecoveryBlocked"
    RECOVERY_FAILED = "RecoveryFailed"
    INSTANCE_ADOPTED = "InstanceAdopted"


# The audit actions that fire event rules.
EVENT_ACTIONS = {
    "executor.dead": Kind.EXECUTOR_DEAD,
    "recovery.failed": Kind.RECOVERY_FAILED,
    "relay.instance_adopted": Kind.INSTANCE_ADOPTED,
}
# The audit action written when an alerted condition's episode ends, or a rule is removed while its
# alert is open: its resolution is delivered.
RESOLVED_ACTION: Final = "alert.resolved"
# ``metadata.ended`` of a resolution whose alert's rule was removed while the alert was open.
RULE_REMOVED = "rule_removed"
EVENT_KINDS = frozenset(EVENT_ACTIONS.values())
CONDITION_KINDS = frozenset(Kind) - EVENT_KINDS
# Conditions asked of the app's executors (the others are read from Relay's registry).
EXECUTOR_KINDS = frozenset({Kind.WORKFLOW_FAILURE, Kind.SLOW_QUEUE})


@dataclass(frozen=True)
class Rule:
    """What evaluating a rule needs (never its destination)."""

    id: str
    org: str
    app: str
    kind: Kind
    params: dict[str, Any]
    created_at: float  # Unix time: events before it do not fire it

    def param(self, name: str, default: Any = None) -> Any:
        value = self.params.get(name)
        return default if value is None else value


@dataclass(frozen=True)
class Alert:
    """One alert to deliver: the workflow's input, a plain dict (:meth:`to_json`)."""

    rule_id: str
    kind: str
    org: str
    app: str
    subject: dict[str, str]  # executorId, workflowName, queueName, instance...
    subject_key: str  # the subject as one string (with the death's epoch for RecoveryBlocked)
    epoch: str
    message: str
    at: str  # ISO 8601 UTC: when it happened (an event), since when it holds (a condition), or ended
    metadata: dict[str, str] = field(default_factory=dict)
    resolves: str | None = None  # a resolution: the idempotency key of the alert whose condition ended

    @property
    def idempotency_key(self) -> str:
        if self.resolves is not None:
            return f"{self.resolves}:resolved"
        return f"{self.rule_id}:{self.subject_key}:{self.epoch}"

    @property
    def workflow_id(self) -> str:
        return f"alert:{self.idempotency_key}"

    def to_json(self) -> dict[str, Any]:
        """The workflow's input. A firing alert's has the members it always had: an instance of the
        previous release that recovers its delivery (a rolling upgrade) reads it as its own."""
        data = asdict(self)
        if self.resolves is None:
            del data["resolves"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Alert:
        return cls(**data)

    def payload(self) -> dict[str, Any]:
        """The JSON body of a webhook: the subject's ids at the top level, beside the alert's own
        members; a resolution adds ``status: resolved`` and the key of the alert it resolves (a
        firing alert's body is the one it always was, byte for byte, signature included)."""
        resolution = {} if self.resolves is None else {"status": "resolved", "resolves": self.resolves}
        return {
            "kind": self.kind,
            "org": self.org,
            "app": self.app,
            **self.subject,
            "message": self.message,
            "at": self.at,
            "idempotencyKey": self.idempotency_key,
            "ruleId": self.rule_id,
            "epoch": self.epoch,
            "metadata": self.metadata,
            **resolution,
        }

    def sdk_metadata(self) -> dict[str, str]:
        """The ``metadata`` of the protocol's ``alert`` message (strings only): Conductor's keys for
        its kinds, then Relay's own."""
        return {
            **self.metadata,
            "org": self.org,
            "application_name": self.app,
            **{_snake(k): v for k, v in self.subject.items()},
            "at": self.at,
            "idempotency_key": self.idempotency_key,
            "rule_id": self.rule_id,
        }


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


def webhook_body(alert: Alert, fmt: str) -> bytes:
    """The bytes POSTed, the same at every attempt (so is their signature)."""
    payload = slack_payload(alert) if fmt == "slack" else alert.payload()
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def slack_payload(alert: Alert) -> dict[str, Any]:
    """A body Slack's incoming webhooks accept: ``text`` (the fallback) and ``blocks``. Every string
    put into mrkdwn is :func:`slack_text`: an executor's ids and names are shown, never read by
    Slack as a mention, a broadcast or a link. Each mrkdwn text object is ``verbatim``: without it
    Slack turns plain text into links and mentions itself (api.slack.com/reference/block-kit/
    composition-objects#text: URLs and conversation names linked, "certain mentions" parsed), so an
    error message's ``@channel`` or ``https://...`` would notify or link; it still shows Relay's own
    code spans."""
    title = f"{'Resolved: ' if alert.resolves else ''}{alert.kind}: {alert.org}/{alert.app}"
    facts = " · ".join(f"{k}: `{slack_text(v)}`" for k, v in alert.subject.items())
    context = f"{facts} · at {slack_text(alert.at)} · idempotencyKey `{slack_text(alert.idempotency_key)}`"
    return {
        "text": f"{slack_text(title)}: {slack_text(alert.message)}",
        "blocks": [
            {"type": "header", "text": {"type": "plain_text", "text": title[:150]}},
            {"type": "section", "text": _mrkdwn(_cut(slack_text(alert.message), 2900))},
            {"type": "context", "elements": [_mrkdwn(context)]},
        ],
    }


def _mrkdwn(text: str) -> dict[str, Any]:
    return {"type": "mrkdwn", "text": text, "verbatim": True}


# Slack reads "<...>" as a mention, a broadcast (<!channel>) or a link, and "&" starts an entity; a
# backtick opens or closes a code span, which Slack gives no escape for: shown as a look-alike.
_SLACK_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", "`": "\N{MODIFIER LETTER GRAVE ACCENT}"})


def slack_text(text: str) -> str:
    """``text`` as Slack's mrkdwn shows it and reads nothing in it (api.slack.com/reference/surfaces/
    formatting#escaping): ``&``, ``<``, ``>`` escaped, a backtick shown as U+02CB (a look-alike)."""
    return text.translate(_SLACK_ESCAPES)


def _cut(text: str, limit: int) -> str:
    """Escaped text cut to ``limit`` characters, never inside an entity (``&amp;``) it ends with."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    amp = cut.rfind("&", max(0, limit - 4))
    return cut[:amp] if amp >= 0 and ";" not in cut[amp:] else cut


# Kept as they are in X-Relay-Idempotency-Key: printable ASCII but "%" (the other characters are
# percent-encoded), so that a key of them is the header as it always was.
_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def idempotency_header(key: str) -> str:
    """``X-Relay-Idempotency-Key``: the key with every character but printable ASCII, and ``%``,
    percent-encoded as UTF-8 (RFC 3986), so that any key can be sent in a header and
    ``urllib.parse.unquote`` of the header is the body's ``idempotencyKey``."""
    return quote(key, safe=_HEADER_SAFE)


MIN_SECRET, MAX_SECRET = 16, 256
# A webhook's secret is an HMAC key that its receiver is given too, from a file, an environment
# variable or a form: places that drop a trailing newline or cannot hold a NUL or a tab. The signature
# stays a valid header whatever the key, but computed with a control character the receiver does not
# have, every delivery is refused by it as forged, and nothing in Relay says why.
SECRET_RULE = (
    f"a webhook secret is {MIN_SECRET} to {MAX_SECRET} characters, none of them a control character "
    "(a newline, a carriage return, a tab, NUL)"
)
# The control characters (Unicode's Cc: C0, DEL and C1), as the OpenAPI document's pattern says them.
SECRET_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"


def valid_secret(secret: str) -> bool:
    return MIN_SECRET <= len(secret) <= MAX_SECRET and re.fullmatch(SECRET_PATTERN, secret) is not None


def signature(secret: str, body: bytes) -> str:
    """``X-Relay-Signature``: ``sha256=`` and the hex HMAC-SHA256 of the body under the rule's secret."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


# -- delivery ------------------------------------------------------------------------------

# Statuses worth another attempt: the receiver is down, busy or timed out; any other 4xx says
# the request itself is refused (a wrong URL, a bad signature) and will be refused again.
RETRY_STATUSES = frozenset({408, 425, 429})


def retryable_status(status: int) -> bool:
    return status >= 500 or status in RETRY_STATUSES


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditFact:
    """An audit entry that may fire an event rule, with what its rule needs to know."""

    id: int
    at: str
    at_unix: float
    org: str
    app: str | None
    action: str
    executor_id: str | None
    detail: dict[str, Any]
    failed_attempts: int = 0  # recovery.failed: failed attempts of that death so far, over all its runs
    # recovery.failed, executor.deleted: the epoch of the death the entry's recovery (recoveryId) is for
    recovery_epoch: int | None = None
    peer: str | None = None  # the entry's peer executor (executor.deleted: the one that recovered)


def alerts_for_event(fact: AuditFact, rules: list[Rule]) -> list[Alert]:
    kind = EVENT_ACTIONS.get(fact.action)
    alerts = []
    for rule in rules:
        if rule.kind is not kind or rule.org != fact.org or fact.at_unix < rule.created_at:
            continue
        if kind is not Kind.INSTANCE_ADOPTED and rule.app != fact.app:
            continue  # an adoption concerns the whole org (its entry names no app)
        if kind is Kind.INSTANCE_ADOPTED and fact.detail.get("released"):
            continue  # a lease given up by a clean stop (a rolling restart): expected, not a loss
        alert = _event_alert(rule, fact)
        if alert is not None:
            alerts.append(alert)
    return alerts


def _event_alert(rule: Rule, fact: AuditFact) -> Alert | None:
    detail, executor = fact.detail, fact.executor_id or ""
    base = {"rule_id": rule.id, "kind": rule.kind.value, "org": rule.org, "app": rule.app, "at": fact.at}
    if rule.kind is Kind.EXECUTOR_DEAD:
        epoch = str(detail.get("epoch", f"audit-{fact.id}"))
        message = f"Executor {executor} of app {fact.app} was declared dead: no connection for its grace period."
        return Alert(
            **base,
            subject={"executorId": executor},
            subject_key=executor,
            epoch=epoch,
            message=message,
            metadata={"executor_id": executor, "epoch": epoch},
        )
    if rule.kind is Kind.RECOVERY_FAILED:
        threshold = int(rule.param("attempts", 3))
        if detail.get("final") or fact.failed_attempts < threshold:
            return None
        epoch = str(fact.recovery_epoch) if fact.recovery_epoch is not None else str(detail.get("recoveryId"))
        message = (
            f"Recovery of executor {executor} of app {fact.app} failed {fact.failed_attempts} times "
            f"(last error: {str(detail.get('error', 'unknown'))[:300]})."
        )
        return Alert(
            **base,
            subject={"executorId": executor},
            subject_key=executor,
            epoch=epoch,
            message=message,
            metadata={
                "executor_id": executor,
                "failed_attempts": str(fact.failed_attempts),
                "threshold": str(threshold),
                "recovery_id": str(detail.get("recoveryId", "")),
            },
        )
    instance = str(detail.get("instance", ""))
    adopter = str(detail.get("adoptedBy", ""))
    epoch = str(detail.get("leaseEpoch", f"audit-{fact.id}"))
    message = (
        f"Relay instance {instance} stopped renewing its lease and was adopted by {adopter}; "
        f"{detail.get('executors', 0)} of org {fact.org}'s executors were on it."
    )
    return Alert(
        **base,
        subject={"instance": instance},
        subject_key=instance,
        epoch=epoch,
        message=message,
        metadata={"instance": instance, "adopted_by": adopter, "lease_epoch": epoch},
    )


# -- conditions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observed:
    """A subject for which a condition rule's condition holds now."""

    subject: dict[str, str]
    key: str  # the subject as one string: the condition's row
    message: str
    metadata: dict[str, str] = field(default_factory=dict)
    epoch: str | None = None  # the alert's epoch when the subject has one (a death's); else the episode

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Observed:
        return cls(**data)


def hold_secs(rule: Rule) -> float:
    """How long a condition must hold before it fires (the workflow-level ones carry their own window)."""
    if rule.kind in (Kind.UNRESPONSIVE_APPLICATION, Kind.RECOVERY_BLOCKED):
        return float(rule.param("forSecs", 60.0))
    return 0.0


def subject_of(kind: Kind, key: str) -> dict[str, str]:
    """A condition's subject (the ids a webhook's body carries) from its row's key; a death's alert's
    (ExecutorDead, RecoveryFailed) from its executor's id."""
    if kind in DEATH_KINDS:
        return {"executorId": key}
    if kind is Kind.RECOVERY_BLOCKED:
        return {"executorId": key.rpartition("@")[0]}  # "{executor}@{epoch of its death}"
    name = {Kind.UNRESPONSIVE_APPLICATION: "appName", Kind.WORKFLOW_FAILURE: "workflowName"}.get(kind, "queueName")
    return {name: key}


def why_over(rule: Rule, key: str) -> str:
    """Why a condition no longer holds for the subject ``key``, as its resolution says it (an
    UnresponsiveApplication's own reasons come from the observer, which reads them)."""
    if rule.kind is Kind.RECOVERY_BLOCKED:
        executor = key.rpartition("@")[0]
        return f"dead executor {executor} no longer waits: its workflows were recovered, or it connected again"
    if rule.kind is Kind.WORKFLOW_FAILURE:
        return (f"fewer than {int(rule.param('count', 1))} workflows failed in the last "
                f"{float(rule.param('windowSecs', 300.0)):g} s")  # fmt: skip
    if rule.kind is Kind.SLOW_QUEUE:
        return f"no workflow has waited in {key if key != '*' else 'its queues'} for more than " + (
            f"{float(rule.param('thresholdSecs', 60.0)):g} s"
        )
    return f"app {rule.app} has a healthy executor again"


def resolution_alert(fact: AuditFact) -> Alert | None:
    """The resolution an ``alert.resolved`` entry calls for: the alert it resolves, ended, and why."""
    detail = fact.detail
    try:
        kind, resolves, key = Kind(detail["kind"]), str(detail["resolves"]), str(detail["subjectKey"])
    except (KeyError, ValueError):
        return None
    reason = str(detail.get("reason", "its condition no longer holds"))
    more = {"ended": str(detail["ended"])} if detail.get("ended") else None  # its rule removed
    rule_id, epoch = str(detail.get("ruleId", "")), str(detail.get("epoch", ""))
    return _resolution(fact, rule_id, kind, key, epoch, resolves, reason, more)


def _resolution(
    fact: AuditFact, rule_id: str, kind: Kind, key: str, epoch: str, resolves: str, reason: str,
    more: dict[str, str] | None = None,
) -> Alert:  # fmt: skip
    """A resolution: the alert ``resolves`` of ``rule_id`` about ``key``, over at ``fact``, and why."""
    subject = subject_of(kind, key)
    what = ", ".join(f"{k} {v}" for k, v in subject.items())
    # A rule removed while its alert was open: the incident is no longer watched, not known to be over.
    over = "is no longer watched" if (more or {}).get("ended") == RULE_REMOVED else "is over"
    return Alert(
        rule_id=rule_id,
        kind=kind.value,
        org=fact.org,
        app=fact.app or "",
        subject=subject,
        subject_key=key,
        epoch=epoch,
        message=f"Resolved: {kind.value} of app {fact.app} ({what}) {over}: {reason}.",
        at=fact.at,
        metadata={"status": "resolved", "resolves": resolves, "reason": reason, **(more or {})},
        resolves=resolves,
    )


# The audit actions that may end a death: its record deleted after a verified recovery (or none was
# needed), a run's final ``recovery.failed`` (the executor connected again), or a verified recovery
# whose executor connected again before its record was deleted (``recordKept``).
DEATH_END_ACTIONS = frozenset({"executor.deleted", "recovery.failed", "recovery.succeeded"})
# The event kinds whose alert is about one death (its key's epoch is the death's): resolved when it ends.
DEATH_KINDS = frozenset({Kind.EXECUTOR_DEAD, Kind.RECOVERY_FAILED})


def death_over(fact: AuditFact) -> tuple[str, dict[str, str]] | None:
    """(why, metadata) if the entry ends a death (the epoch it is for is ``fact.recovery_epoch``)."""
    if fact.action not in DEATH_END_ACTIONS or fact.recovery_epoch is None or not fact.executor_id:
        return None
    detail = fact.detail
    verifier = str(detail.get("verifiedBy") or "")
    if fact.action == "recovery.failed":
        if not detail.get("final"):
            return None  # an attempt failed: the death goes on
        why = f"executor {fact.executor_id} connected again ({str(detail.get('error', 'its recovery ended'))[:300]})"
        return why, {"ended": "connected_again"}
    if fact.action == "recovery.succeeded" and not detail.get("recordKept"):
        return None  # its executor.deleted, written with it, ends the death
    if detail.get("nothingPending"):
        why = f"it left no PENDING workflow ({verifier or 'a peer'} listed none): nothing to recover, record deleted"
        return why, {"ended": "nothing_pending", "verified_by": verifier}
    peer = fact.peer or ""
    why = f"its workflows were recovered by peer {peer or '?'}" + (f", verified by {verifier}" if verifier else "")
    more = {"ended": "recovered", "recovered_by": peer, "verified_by": verifier}
    if detail.get("recordKept"):
        why += f", and executor {fact.executor_id} connected again meanwhile (its record kept)"
    else:
        why += ", and its record deleted"
    return why, {k: v for k, v in more.items() if v}


def death_resolutions(fact: AuditFact, rules: list[Rule]) -> list[Alert]:
    """The resolutions a death's end calls for: one for the alert each ExecutorDead and
    RecoveryFailed rule of the app fired for that death (its key is the death's: rule, executor,
    epoch), whether or not that rule fired one (the delivery checks: :meth:`AlertStore.fired`)."""
    over = death_over(fact)
    if over is None:
        return []
    reason, more = over
    executor, epoch = str(fact.executor_id), str(fact.recovery_epoch)
    return [
        _resolution(fact, rule.id, rule.kind, executor, epoch, f"{rule.id}:{executor}:{epoch}", reason, more)
        for rule in rules
        if rule.kind in DEATH_KINDS and rule.org == fact.org and rule.app == fact.app
    ]


def condition_alert(rule: Rule, seen: Observed, episode: int, since: str) -> Alert:
    return Alert(
        rule_id=rule.id,
        kind=rule.kind.value,
        org=rule.org,
        app=rule.app,
        subject=seen.subject,
        subject_key=seen.key,
        epoch=seen.epoch if seen.epoch is not None else str(episode),
        message=seen.message,
        at=since,
        metadata=seen.metadata,
    )


# -- rule parameters -------------------------------------------------------------------------

# Each kind's parameters (relay.yaml's and the API's names) and their defaults; None: not set.
PARAMS: dict[Kind, dict[str, Any]] = {
    Kind.WORKFLOW_FAILURE: {"workflowName": None, "count": 1, "windowSecs": 300.0},
    Kind.SLOW_QUEUE: {"queueName": None, "thresholdSecs": 60.0},
    Kind.UNRESPONSIVE_APPLICATION: {"forSecs": 60.0},
    Kind.EXECUTOR_DEAD: {},
    Kind.RECOVERY_BLOCKED: {"reason": None, "forSecs": 60.0},
    Kind.RECOVERY_FAILED: {"attempts": 3},
    Kind.INSTANCE_ADOPTED: {},
}
# Conductor's names in an alert's metadata (docs/production/alerting.md), accepted in ``ruleMetadata``.
CONDUCTOR_PARAMS = {
    Kind.WORKFLOW_FAILURE: {"workflow_name": "workflowName", "threshold": "count", "period_secs": "windowSecs"},
    Kind.SLOW_QUEUE: {"queue_name": "queueName", "threshold_secs": "thresholdSecs"},
}
