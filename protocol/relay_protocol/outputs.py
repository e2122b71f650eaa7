"""What replies carry: workflows, steps, schedules, versions, queues, aggregates.

Everything here is passed through to the API's callers, never stored by
Relay, so its strings are checked for type only (the class's ``default_rule``
is :data:`~relay_protocol.limits.TEXT`): one workflow with a long id, which
DBOS does not bound, must not make a whole listing unreadable.

The SDK renders many values as strings. In :class:`WorkflowsOutput` and
:class:`WorkflowSteps` times, timeouts and priorities are decimal strings
(epoch milliseconds for times); inputs, outputs and errors are Python's
``str()`` of the deserialized value, not JSON. They stay strings here:
turning them into something else is the receiver's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from relay_protocol.limits import TEXT, Rule, meta

_TEXT = meta(rule=TEXT)


@dataclass(frozen=True, kw_only=True)
class WorkflowsOutput:
    """One workflow's status, with the SDK's PascalCase keys."""

    default_rule: ClassVar[Rule] = TEXT

    workflow_id: str = field(metadata=meta("WorkflowUUID"))
    status: str | None = field(default=None, metadata=meta("Status"))
    workflow_name: str | None = field(default=None, metadata=meta("WorkflowName"))
    workflow_class_name: str | None = field(default=None, metadata=meta("WorkflowClassName"))
    workflow_config_name: str | None = field(default=None, metadata=meta("WorkflowConfigName"))
    authenticated_user: str | None = field(default=None, metadata=meta("AuthenticatedUser"))
    assumed_role: str | None = field(default=None, metadata=meta("AssumedRole"))
    #: Python's str() of the list of roles, e.g. "['admin']".
    authenticated_roles: str | None = field(default=None, metadata=meta("AuthenticatedRoles", rule=TEXT))
    input: str | None = field(default=None, metadata=meta("Input", rule=TEXT))
    output: str | None = field(default=None, metadata=meta("Output", rule=TEXT))
    error: str | None = field(default=None, metadata=meta("Error", rule=TEXT))
    created_at: str | None = field(default=None, metadata=meta("CreatedAt"))
    updated_at: str | None = field(default=None, metadata=meta("UpdatedAt"))
    queue_name: str | None = field(default=None, metadata=meta("QueueName"))
    application_version: str | None = field(default=None, metadata=meta("ApplicationVersion"))
    executor_id: str | None = field(default=None, metadata=meta("ExecutorID"))
    workflow_timeout_ms: str | None = field(default=None, metadata=meta("WorkflowTimeoutMS"))
    workflow_deadline_epoch_ms: str | None = field(default=None, metadata=meta("WorkflowDeadlineEpochMS"))
    deduplication_id: str | None = field(default=None, metadata=meta("DeduplicationID"))
    priority: str | None = field(default=None, metadata=meta("Priority"))
    queue_partition_key: str | None = field(default=None, metadata=meta("QueuePartitionKey"))
    forked_from: str | None = field(default=None, metadata=meta("ForkedFrom"))
    was_forked_from: bool = field(metadata=meta("WasForkedFrom"))
    parent_workflow_id: str | None = field(default=None, metadata=meta("ParentWorkflowID"))
    dequeued_at: str | None = field(default=None, metadata=meta("DequeuedAt"))
    delay_until_epoch_ms: str | None = field(default=None, metadata=meta("DelayUntilEpochMS"))
    completed_at: str | None = field(default=None, metadata=meta("CompletedAt"))
    #: The attributes as a JSON object in a string.
    attributes: str | None = field(default=None, metadata=meta("Attributes", rule=TEXT))
    schedule_name: str | None = field(default=None, metadata=meta("ScheduleName"))
    application_name: str | None = field(default=None, metadata=meta("ApplicationName"))


@dataclass(frozen=True, kw_only=True)
class WorkflowSteps:
    """One step of a workflow; times are epoch milliseconds as strings."""

    default_rule: ClassVar[Rule] = TEXT

    function_id: int
    function_name: str
    output: str | None = field(default=None, metadata=_TEXT)
    error: str | None = field(default=None, metadata=_TEXT)
    child_workflow_id: str | None = None
    started_at_epoch_ms: str | None = None
    completed_at_epoch_ms: str | None = None


@dataclass(frozen=True, kw_only=True)
class MetricData:
    """How many times a workflow or step (``metric_type``) named ``metric_name`` ran in the range."""

    default_rule: ClassVar[Rule] = TEXT

    metric_type: str
    metric_name: str
    value: int


@dataclass(frozen=True, kw_only=True)
class ScheduleOutput:
    """A cron schedule. ``last_fired_at`` is ISO 8601; ``context`` is Python's str() of it."""

    default_rule: ClassVar[Rule] = TEXT

    schedule_id: str
    schedule_name: str
    workflow_name: str
    workflow_class_name: str | None = None
    schedule: str
    status: str
    context: str | None = field(default=None, metadata=_TEXT)
    last_fired_at: str | None = None
    automatic_backfill: bool
    cron_timezone: str | None = None
    queue_name: str | None = None
    application_name: str | None = None


@dataclass(frozen=True, kw_only=True)
class ApplicationVersionOutput:
    """Times here are integers of epoch milliseconds, unlike in WorkflowsOutput."""

    default_rule: ClassVar[Rule] = TEXT

    version_id: str
    version_name: str
    version_timestamp: int
    created_at: int


@dataclass(frozen=True, kw_only=True)
class NotificationOutput:
    default_rule: ClassVar[Rule] = TEXT

    topic: str | None = None
    message: str = field(metadata=_TEXT)
    created_at_epoch_ms: int
    consumed: bool


@dataclass(frozen=True, kw_only=True)
class StreamEntryOutput:
    default_rule: ClassVar[Rule] = TEXT

    key: str
    values: list[str] = field(metadata=_TEXT)


@dataclass(frozen=True, kw_only=True)
class EventOutput:
    default_rule: ClassVar[Rule] = TEXT

    key: str
    value: str = field(metadata=_TEXT)


@dataclass(frozen=True, kw_only=True)
class WorkflowAggregateOutput:
    """``group`` maps each group-by column (and ``time_bucket``) to its value as a string."""

    default_rule: ClassVar[Rule] = TEXT

    group: dict[str, str | None]
    count: int | None = None
    min_created_at: int | None = None
    max_queue_wait_ms: int | None = None
    max_total_latency_ms: int | None = None


@dataclass(frozen=True, kw_only=True)
class StepAggregateOutput:
    default_rule: ClassVar[Rule] = TEXT

    group: dict[str, str | None]
    count: int | None = None
    max_duration_ms: int | None = None


@dataclass(frozen=True, kw_only=True)
class QueueOutput:
    """A queue's limits; a null limit is no limit."""

    default_rule: ClassVar[Rule] = TEXT

    name: str
    concurrency: int | None = None
    worker_concurrency: int | None = None
    rate_limit_max: int | None = None
    rate_limit_period_sec: float | None = None
    priority_enabled: bool
    partition_queue: bool
    polling_interval_sec: float
    application_name: str | None = None
    partition_concurrency: int | None = None
    partition_worker_concurrency: int | None = None
    partition_rate_limit_max: int | None = None
    partition_rate_limit_period_sec: float | None = None
