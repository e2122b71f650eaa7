"""DBOS Conductor's API shapes, and their translation from the protocol's replies, in one place.

Field names and types are Conductor's (its OpenAPI document, which ``dbos-mcp``
and ``dbosctl`` read): camelCase, times as ISO 8601 in UTC. The executors'
replies carry times as epoch milliseconds (in strings, in some messages) and
PascalCase keys; nothing else in Relay reads them.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict

from relay.core.times import ms_iso, us_iso, utc
from relay_protocol import (
    ApplicationVersionOutput,
    EventOutput,
    NotificationOutput,
    QueueOutput,
    ScheduleOutput,
    StepAggregateOutput,
    StreamEntryOutput,
    WorkflowAggregateOutput,
    WorkflowsOutput,
    WorkflowSteps,
)


def one_of(*values: str) -> Any:
    """A string field whose schema lists the values it takes (the code passes plain ``str``)."""
    return Field(json_schema_extra={"enum": list(values)})


# The statuses DBOS 3.2 and the TypeScript SDK 5.2 give a workflow: a filter by another is refused
# (``status=FAILED`` found nothing, which an agent read as "no failures").
WORKFLOW_STATUSES = (
    "PENDING",
    "ENQUEUED",
    "DELAYED",
    "SUCCESS",
    "ERROR",
    "CANCELLED",
    "MAX_RECOVERY_ATTEMPTS_EXCEEDED",
)


class Shape(BaseModel):
    """A shape of Conductor's API. Its strings come from executors' replies, which are UTF-8 by the
    time they get here (lone surrogates are replaced where frames arrive: relay.net.wire.clean_frame)."""

    model_config = ConfigDict(extra="forbid")


def _int(value: str | int | None) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def text_iso(value: str | None) -> str | None:
    """A time the SDK keeps as ISO 8601 text in some zone (a schedule's last run, in its cron time
    zone) as ISO 8601 UTC, six fraction digits, as Relay's own times; None if absent or not such a
    time. One without an offset is UTC, as the SDK reads one (its backfill)."""
    if value is None:
        return None
    try:
        return us_iso(datetime.fromisoformat(value))
    except ValueError:
        return None


_RFC3339 = re.compile(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d")


def rfc3339(value: Any) -> Any:
    """Only a date and a time, as RFC 3339 writes them: not a number of seconds, which pydantic
    would otherwise take for a time."""
    if isinstance(value, datetime) or (isinstance(value, str) and _RFC3339.match(value)):
        return value
    raise ValueError("expected an RFC 3339 date-time, such as 2026-01-31T12:00:00Z")


def with_offset(value: datetime) -> datetime:
    """A time that says which instant it is: RFC 3339 requires the offset, and a time without one
    would otherwise be read in the server's own zone (a filter that differs from host to host)."""
    if value.tzinfo is None:
        raise ValueError("a time needs its UTC offset, as RFC 3339 writes it: 2026-01-31T12:00:00Z or +01:00")
    return value


# A time in a query: RFC 3339, offset included.
Rfc3339 = Annotated[datetime, BeforeValidator(rfc3339), AfterValidator(with_offset)]
# A time in a request body (strict otherwise): RFC 3339, any offset, read as the same instant in UTC.
UtcTime = Annotated[datetime, Strict(False), BeforeValidator(rfc3339), AfterValidator(with_offset), AfterValidator(utc)]


class Workflow(Shape):
    workflowId: str
    status: str | None
    workflowName: str | None
    workflowClass: str | None
    workflowConfig: str | None
    user: str | None
    assumedRole: str | None
    roles: str | None
    input: str | None
    output: str | None
    error: str | None
    createdAt: str | None
    updatedAt: str | None
    queueName: str | None
    appVersion: str | None
    executorId: str | None
    timeoutMs: int | None
    deadline: str | None
    deduplicationId: str | None
    priority: int
    queuePartitionKey: str | None
    forkedFrom: str | None
    parentWorkflowId: str | None
    dequeuedAt: str | None
    wasForkedFrom: bool
    delayUntil: str | None
    completedAt: str | None
    attributes: str | None
    scheduleName: str | None
    applicationName: str | None


def workflow(w: WorkflowsOutput) -> Workflow:
    return Workflow(
        workflowId=w.workflow_id,
        status=w.status,
        workflowName=w.workflow_name,
        workflowClass=w.workflow_class_name,
        workflowConfig=w.workflow_config_name,
        user=w.authenticated_user,
        assumedRole=w.assumed_role,
        roles=w.authenticated_roles,
        input=w.input,
        output=w.output,
        error=w.error,
        createdAt=ms_iso(w.created_at),
        updatedAt=ms_iso(w.updated_at),
        queueName=w.queue_name,
        appVersion=w.application_version,
        executorId=w.executor_id,
        timeoutMs=_int(w.workflow_timeout_ms),
        deadline=ms_iso(w.workflow_deadline_epoch_ms),
        deduplicationId=w.deduplication_id,
        priority=_int(w.priority) or 0,
        queuePartitionKey=w.queue_partition_key,
        forkedFrom=w.forked_from,
        parentWorkflowId=w.parent_workflow_id,
        dequeuedAt=ms_iso(w.dequeued_at),
        wasForkedFrom=w.was_forked_from,
        delayUntil=ms_iso(w.delay_until_epoch_ms),
        completedAt=ms_iso(w.completed_at),
        attributes=w.attributes,
        scheduleName=w.schedule_name,
        applicationName=w.application_name,
    )


class Step(Shape):
    stepId: int
    stepName: str
    output: str | None
    error: str | None
    childWorkflowId: str | None
    startedAt: str | None
    completedAt: str | None


def step(s: WorkflowSteps) -> Step:
    return Step(
        stepId=s.function_id,
        stepName=s.function_name,
        output=s.output,
        error=s.error,
        childWorkflowId=s.child_workflow_id,
        startedAt=ms_iso(s.started_at_epoch_ms),
        completedAt=ms_iso(s.completed_at_epoch_ms),
    )


class Event(Shape):
    key: str
    value: str | None


def event(e: EventOutput) -> Event:
    return Event(key=e.key, value=e.value)


class Notification(Shape):
    topic: str | None
    message: str | None
    createdAt: str | None
    consumed: bool


def notification(n: NotificationOutput) -> Notification:
    return Notification(topic=n.topic, message=n.message, createdAt=ms_iso(n.created_at_epoch_ms), consumed=n.consumed)


class StreamEntry(Shape):
    key: str
    values: list[str]


def stream(s: StreamEntryOutput) -> StreamEntry:
    return StreamEntry(key=s.key, values=list(s.values))


class WorkflowAggregate(Shape):
    group: dict[str, str | None]
    count: int | None = None
    minCreatedAt: str | None = None
    maxQueueWaitMs: int | None = None
    maxTotalLatencyMs: int | None = None


def workflow_aggregate(a: WorkflowAggregateOutput) -> WorkflowAggregate:
    """Served with ``response_model_exclude_none``: the members not selected are left out, not null
    (a null inside ``group`` stays: exclusion does not reach into a dict)."""
    return WorkflowAggregate(
        group=dict(a.group),
        count=a.count,
        minCreatedAt=ms_iso(a.min_created_at),
        maxQueueWaitMs=a.max_queue_wait_ms,
        maxTotalLatencyMs=a.max_total_latency_ms,
    )


class StepAggregate(Shape):
    group: dict[str, str | None]
    count: int | None = None
    maxDurationMs: int | None = None


def step_aggregate(a: StepAggregateOutput) -> StepAggregate:
    return StepAggregate(group=dict(a.group), count=a.count, maxDurationMs=a.max_duration_ms)


class Queue(Shape):
    name: str
    concurrency: int | None
    workerConcurrency: int | None
    rateLimitMax: int | None
    rateLimitPeriodSecs: float | None
    priorityEnabled: bool
    partitionQueue: bool
    pollingIntervalSecs: float
    applicationName: str | None


def queue(q: QueueOutput) -> Queue:
    return Queue(
        name=q.name,
        concurrency=q.concurrency,
        workerConcurrency=q.worker_concurrency,
        rateLimitMax=q.rate_limit_max,
        rateLimitPeriodSecs=q.rate_limit_period_sec,
        priorityEnabled=q.priority_enabled,
        partitionQueue=q.partition_queue,
        pollingIntervalSecs=q.polling_interval_sec,
        applicationName=q.application_name,
    )


class Schedule(Shape):
    scheduleId: str
    scheduleName: str
    workflowName: str
    workflowClass: str | None
    cronExpression: str
    status: str
    context: str | None
    lastFiredAt: str | None
    automaticBackfill: bool
    cronTimezone: str | None
    applicationName: str | None


def schedule(s: ScheduleOutput) -> Schedule:
    return Schedule(
        scheduleId=s.schedule_id,
        scheduleName=s.schedule_name,
        workflowName=s.workflow_name,
        workflowClass=s.workflow_class_name,
        cronExpression=s.schedule,
        status=s.status,
        context=s.context,
        lastFiredAt=text_iso(s.last_fired_at),
        automaticBackfill=s.automatic_backfill,
        cronTimezone=s.cron_timezone,
        applicationName=s.application_name,
    )


class ApplicationVersion(Shape):
    versionId: str
    versionName: str
    versionTimestamp: str | None
    createdAt: str | None


def version(v: ApplicationVersionOutput) -> ApplicationVersion:
    return ApplicationVersion(
        versionId=v.version_id,
        versionName=v.version_name,
        versionTimestamp=ms_iso(v.version_timestamp),
        createdAt=ms_iso(v.created_at),
    )


class WorkflowIdOut(Shape):
    workflowId: str


class WorkflowIdsOut(Shape):
    workflowIds: list[str]


class SerializedWorkflow(Shape):
    serializedWorkflow: str
