"""One request and one reply class per message type.

Field names and shapes are those of the open-source SDK ``dbos`` 3.2
(``dbos/_conductor/protocol.py``). A reply field the SDK may leave null
defaults to None; so does a request field the SDK reads with a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relay_protocol.bodies import (
    ForkFromFailureBody,
    ForkWorkflowBody,
    GetStepAggregatesBody,
    GetWorkflowAggregatesBody,
    ListQueuedWorkflowsBody,
    ListQueuesBody,
    ListSchedulesBody,
    ListWorkflowsBody,
    RetentionBody,
    RewindWorkflowBody,
)
from relay_protocol.frames import MessageType, Reply, Request
from relay_protocol.limits import MAX_HOSTNAME_LEN, QUEUE_OR_SCHEDULE_NAME, TEXT, WORKFLOW_ID, Rule, meta
from relay_protocol.outputs import (
    ApplicationVersionOutput,
    EventOutput,
    MetricData,
    NotificationOutput,
    QueueOutput,
    ScheduleOutput,
    StepAggregateOutput,
    StreamEntryOutput,
    WorkflowAggregateOutput,
    WorkflowsOutput,
    WorkflowSteps,
)

# Workflow ids are bounded in bytes, not as names (relay_protocol.limits.WORKFLOW_ID).
_ID = meta(rule=WORKFLOW_ID)
# So are a queue's and a schedule's names (relay_protocol.limits.QUEUE_OR_SCHEDULE_NAME).
_QS = meta(rule=QUEUE_OR_SCHEDULE_NAME)


@dataclass(frozen=True, kw_only=True)
class SuccessReply(Reply):
    """A reply that says only whether the command worked."""

    success: bool


# --- The executor ---


@dataclass(frozen=True, kw_only=True)
class ExecutorInfoRequest(Request):
    """Who are you? The first request on every connection."""

    type = MessageType.EXECUTOR_INFO


@dataclass(frozen=True, kw_only=True)
class ExecutorInfoReply(Reply):
    type = MessageType.EXECUTOR_INFO
    executor_id: str = field(metadata=meta(rule=Rule(min_len=1)))
    application_version: str
    hostname: str | None = field(default=None, metadata=meta(rule=Rule(max_len=MAX_HOSTNAME_LEN)))
    language: str | None = None
    dbos_version: str | None = None
    executor_metadata: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class RecoveryRequest(Request):
    """Recover the pending workflows of these executors on the receiving one."""

    type = MessageType.RECOVERY
    executor_ids: list[str]


@dataclass(frozen=True, kw_only=True)
class RecoveryReply(SuccessReply):
    type = MessageType.RECOVERY


@dataclass(frozen=True, kw_only=True)
class ExistPendingWorkflowsRequest(Request):
    """Has this executor, at this version, workflows still pending?"""

    type = MessageType.EXIST_PENDING_WORKFLOWS
    executor_id: str
    application_version: str


@dataclass(frozen=True, kw_only=True)
class ExistPendingWorkflowsReply(Reply):
    type = MessageType.EXIST_PENDING_WORKFLOWS
    exist: bool


@dataclass(frozen=True, kw_only=True)
class RetentionRequest(Request):
    """Garbage-collect old workflows and time out stale ones (runs in the background)."""

    type = MessageType.RETENTION
    body: RetentionBody


@dataclass(frozen=True, kw_only=True)
class RetentionReply(SuccessReply):
    type = MessageType.RETENTION


@dataclass(frozen=True, kw_only=True)
class GetMetricsRequest(Request):
    """Counts of workflow and step runs between two ISO 8601 times; metric_class "workflow_step_count"."""

    type = MessageType.GET_METRICS
    start_time: str
    end_time: str
    metric_class: str
    application_name: list[str] | None = None


@dataclass(frozen=True, kw_only=True)
class GetMetricsReply(Reply):
    type = MessageType.GET_METRICS
    metrics: list[MetricData]


@dataclass(frozen=True, kw_only=True)
class AlertRequest(Request):
    """Hand an alert to the application's alert handler."""

    type = MessageType.ALERT
    name: str
    message: str = field(metadata=meta(rule=TEXT))
    metadata: dict[str, str] = field(metadata=meta(rule=TEXT))


@dataclass(frozen=True, kw_only=True)
class AlertReply(SuccessReply):
    type = MessageType.ALERT


# --- Commands on workflows ---


@dataclass(frozen=True, kw_only=True)
class CancelRequest(Request):
    """Cancel ``workflow_ids`` if given, else ``workflow_id``."""

    type = MessageType.CANCEL
    workflow_id: str = field(metadata=_ID)
    cancel_children: bool = False
    workflow_ids: list[str] | None = field(default=None, metadata=_ID)


@dataclass(frozen=True, kw_only=True)
class CancelReply(SuccessReply):
    type = MessageType.CANCEL


@dataclass(frozen=True, kw_only=True)
class DeleteRequest(Request):
    """Delete ``workflow_ids`` if given, else ``workflow_id``."""

    type = MessageType.DELETE
    workflow_id: str = field(metadata=_ID)
    delete_children: bool
    workflow_ids: list[str] | None = field(default=None, metadata=_ID)


@dataclass(frozen=True, kw_only=True)
class DeleteReply(SuccessReply):
    type = MessageType.DELETE


@dataclass(frozen=True, kw_only=True)
class ResumeRequest(Request):
    """Resume ``workflow_ids`` if given, else ``workflow_id``, optionally on another queue."""

    type = MessageType.RESUME
    workflow_id: str = field(metadata=_ID)
    workflow_ids: list[str] | None = field(default=None, metadata=_ID)
    queue_name: str | None = field(default=None, metadata=_QS)


@dataclass(frozen=True, kw_only=True)
class ResumeReply(SuccessReply):
    type = MessageType.RESUME


@dataclass(frozen=True, kw_only=True)
class ForkWorkflowRequest(Request):
    """Start a new workflow from a step of an old one."""

    type = MessageType.FORK_WORKFLOW
    body: ForkWorkflowBody


@dataclass(frozen=True, kw_only=True)
class ForkWorkflowReply(Reply):
    type = MessageType.FORK_WORKFLOW
    new_workflow_id: str | None = field(default=None, metadata=_ID)


@dataclass(frozen=True, kw_only=True)
class ForkFromFailureRequest(Request):
    """Fork many workflows at once, each from its failure or a chosen step."""

    type = MessageType.FORK_FROM_FAILURE
    body: ForkFromFailureBody


@dataclass(frozen=True, kw_only=True)
class ForkFromFailureReply(Reply):
    type = MessageType.FORK_FROM_FAILURE
    forked_workflow_ids: list[str] | None = field(default=None, metadata=_ID)


@dataclass(frozen=True, kw_only=True)
class RewindWorkflowRequest(Request):
    """Run a workflow again from a step, under its own id."""

    type = MessageType.REWIND_WORKFLOW
    body: RewindWorkflowBody


@dataclass(frozen=True, kw_only=True)
class RewindWorkflowReply(SuccessReply):
    type = MessageType.REWIND_WORKFLOW


@dataclass(frozen=True, kw_only=True)
class ExportWorkflowRequest(Request):
    """A workflow's rows (and its children's) as a portable blob."""

    type = MessageType.EXPORT_WORKFLOW
    workflow_id: str = field(metadata=_ID)
    export_children: bool


@dataclass(frozen=True, kw_only=True)
class ExportWorkflowReply(Reply):
    """``serialized_workflow``: base64 of a gzipped pickle."""

    type = MessageType.EXPORT_WORKFLOW
    serialized_workflow: str | None = field(default=None, metadata=meta(rule=TEXT))


@dataclass(frozen=True, kw_only=True)
class ImportWorkflowRequest(Request):
    """Write an exported workflow into this executor's database."""

    type = MessageType.IMPORT_WORKFLOW
    serialized_workflow: str = field(metadata=meta(rule=TEXT))


@dataclass(frozen=True, kw_only=True)
class ImportWorkflowReply(SuccessReply):
    type = MessageType.IMPORT_WORKFLOW


# --- Reading workflows ---


@dataclass(frozen=True, kw_only=True)
class ListWorkflowsRequest(Request):
    type = MessageType.LIST_WORKFLOWS
    body: ListWorkflowsBody


@dataclass(frozen=True, kw_only=True)
class ListWorkflowsReply(Reply):
    type = MessageType.LIST_WORKFLOWS
    output: list[WorkflowsOutput]


@dataclass(frozen=True, kw_only=True)
class ListQueuedWorkflowsRequest(Request):
    type = MessageType.LIST_QUEUED_WORKFLOWS
    body: ListQueuedWorkflowsBody


@dataclass(frozen=True, kw_only=True)
class ListQueuedWorkflowsReply(Reply):
    type = MessageType.LIST_QUEUED_WORKFLOWS
    output: list[WorkflowsOutput]


@dataclass(frozen=True, kw_only=True)
class GetWorkflowRequest(Request):
    type = MessageType.GET_WORKFLOW
    workflow_id: str = field(metadata=_ID)
    load_input: bool = True
    load_output: bool = True


@dataclass(frozen=True, kw_only=True)
class GetWorkflowReply(Reply):
    """``output`` is null for a workflow that does not exist."""

    type = MessageType.GET_WORKFLOW
    output: WorkflowsOutput | None = None


@dataclass(frozen=True, kw_only=True)
class ListStepsRequest(Request):
    type = MessageType.LIST_STEPS
    workflow_id: str = field(metadata=_ID)
    load_output: bool = True
    limit: int | None = None
    offset: int | None = None


@dataclass(frozen=True, kw_only=True)
class ListStepsReply(Reply):
    type = MessageType.LIST_STEPS
    output: list[WorkflowSteps] | None = None


@dataclass(frozen=True, kw_only=True)
class GetWorkflowEventsRequest(Request):
    type = MessageType.GET_WORKFLOW_EVENTS
    workflow_id: str = field(metadata=_ID)


@dataclass(frozen=True, kw_only=True)
class GetWorkflowEventsReply(Reply):
    type = MessageType.GET_WORKFLOW_EVENTS
    events: list[EventOutput] | None = None


@dataclass(frozen=True, kw_only=True)
class GetWorkflowNotificationsRequest(Request):
    type = MessageType.GET_WORKFLOW_NOTIFICATIONS
    workflow_id: str = field(metadata=_ID)


@dataclass(frozen=True, kw_only=True)
class GetWorkflowNotificationsReply(Reply):
    type = MessageType.GET_WORKFLOW_NOTIFICATIONS
    notifications: list[NotificationOutput] | None = None


@dataclass(frozen=True, kw_only=True)
class GetWorkflowStreamsRequest(Request):
    type = MessageType.GET_WORKFLOW_STREAMS
    workflow_id: str = field(metadata=_ID)


@dataclass(frozen=True, kw_only=True)
class GetWorkflowStreamsReply(Reply):
    type = MessageType.GET_WORKFLOW_STREAMS
    streams: list[StreamEntryOutput] | None = None


@dataclass(frozen=True, kw_only=True)
class GetWorkflowAggregatesRequest(Request):
    type = MessageType.GET_WORKFLOW_AGGREGATES
    body: GetWorkflowAggregatesBody


@dataclass(frozen=True, kw_only=True)
class GetWorkflowAggregatesReply(Reply):
    type = MessageType.GET_WORKFLOW_AGGREGATES
    output: list[WorkflowAggregateOutput]


@dataclass(frozen=True, kw_only=True)
class GetStepAggregatesRequest(Request):
    type = MessageType.GET_STEP_AGGREGATES
    body: GetStepAggregatesBody


@dataclass(frozen=True, kw_only=True)
class GetStepAggregatesReply(Reply):
    type = MessageType.GET_STEP_AGGREGATES
    output: list[StepAggregateOutput]


# --- Schedules ---


@dataclass(frozen=True, kw_only=True)
class ListSchedulesRequest(Request):
    type = MessageType.LIST_SCHEDULES
    body: ListSchedulesBody


@dataclass(frozen=True, kw_only=True)
class ListSchedulesReply(Reply):
    type = MessageType.LIST_SCHEDULES
    output: list[ScheduleOutput]


@dataclass(frozen=True, kw_only=True)
class GetScheduleRequest(Request):
    type = MessageType.GET_SCHEDULE
    schedule_name: str = field(metadata=_QS)
    load_context: bool = True


@dataclass(frozen=True, kw_only=True)
class GetScheduleReply(Reply):
    type = MessageType.GET_SCHEDULE
    output: ScheduleOutput | None = None


@dataclass(frozen=True, kw_only=True)
class PauseScheduleRequest(Request):
    type = MessageType.PAUSE_SCHEDULE
    schedule_name: str = field(metadata=_QS)


@dataclass(frozen=True, kw_only=True)
class PauseScheduleReply(SuccessReply):
    type = MessageType.PAUSE_SCHEDULE


@dataclass(frozen=True, kw_only=True)
class ResumeScheduleRequest(Request):
    type = MessageType.RESUME_SCHEDULE
    schedule_name: str = field(metadata=_QS)


@dataclass(frozen=True, kw_only=True)
class ResumeScheduleReply(SuccessReply):
    type = MessageType.RESUME_SCHEDULE


@dataclass(frozen=True, kw_only=True)
class BackfillScheduleRequest(Request):
    """Enqueue the runs the schedule would have made between two ISO 8601 times."""

    type = MessageType.BACKFILL_SCHEDULE
    schedule_name: str = field(metadata=_QS)
    start: str
    end: str


@dataclass(frozen=True, kw_only=True)
class BackfillScheduleReply(Reply):
    type = MessageType.BACKFILL_SCHEDULE
    workflow_ids: list[str] = field(metadata=_ID)


@dataclass(frozen=True, kw_only=True)
class TriggerScheduleRequest(Request):
    """Run the schedule's workflow once, now."""

    type = MessageType.TRIGGER_SCHEDULE
    schedule_name: str = field(metadata=_QS)


@dataclass(frozen=True, kw_only=True)
class TriggerScheduleReply(Reply):
    type = MessageType.TRIGGER_SCHEDULE
    workflow_id: str | None = field(default=None, metadata=_ID)


# --- Application versions ---


@dataclass(frozen=True, kw_only=True)
class ListApplicationVersionsRequest(Request):
    type = MessageType.LIST_APPLICATION_VERSIONS


@dataclass(frozen=True, kw_only=True)
class ListApplicationVersionsReply(Reply):
    type = MessageType.LIST_APPLICATION_VERSIONS
    output: list[ApplicationVersionOutput]


@dataclass(frozen=True, kw_only=True)
class SetLatestApplicationVersionRequest(Request):
    """Make this version the latest (its timestamp becomes now)."""

    type = MessageType.SET_LATEST_APPLICATION_VERSION
    version_name: str


@dataclass(frozen=True, kw_only=True)
class SetLatestApplicationVersionReply(SuccessReply):
    type = MessageType.SET_LATEST_APPLICATION_VERSION


# --- Queues ---


@dataclass(frozen=True, kw_only=True)
class ListQueuesRequest(Request):
    """A server predating the filter sends no body."""

    type = MessageType.LIST_QUEUES
    body: ListQueuesBody = field(default_factory=ListQueuesBody)


@dataclass(frozen=True, kw_only=True)
class ListQueuesReply(Reply):
    type = MessageType.LIST_QUEUES
    output: list[QueueOutput]


@dataclass(frozen=True, kw_only=True)
class GetQueueRequest(Request):
    type = MessageType.GET_QUEUE
    name: str = field(metadata=_QS)


@dataclass(frozen=True, kw_only=True)
class GetQueueReply(Reply):
    type = MessageType.GET_QUEUE
    output: QueueOutput | None = None
