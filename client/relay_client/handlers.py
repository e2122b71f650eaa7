"""The executor's answers: one small handler per message type, dispatched through a table.

:meth:`Handlers.answer` takes a frame's text and returns the reply's text.
Every handler calls DBOS's synchronous API, so it runs on a worker thread (the
connection hands it to ``asyncio.to_thread``), never on a thread with a running
event loop. A handler that raises is answered as the SDK answers: the reply of
the request's type, its payload empty (``success: false``, ``output: []`` or
null) and ``error_message`` saying what failed, with the traceback.

Types answered "Unknown message type", as an SDK that lacks them answers
(:data:`UNSERVED`): ``get_workflow_notifications`` and ``get_workflow_streams``
(no public API lists a workflow's messages or its stream keys),
``export_workflow`` (only a lossy, non-importable view could be built) and
``import_workflow`` (no public API writes workflow rows).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import socket
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from dbos import DBOS, SetWorkflowID

from relay_client import _internals, aggregates, convert
from relay_client.errors import LOGGER_NAME
from relay_client.retention import Retention
from relay_protocol import (
    AlertReply,
    AlertRequest,
    BackfillScheduleReply,
    BackfillScheduleRequest,
    CancelReply,
    CancelRequest,
    DeleteReply,
    DeleteRequest,
    ErrorReply,
    ExecutorInfoReply,
    ExecutorInfoRequest,
    ExistPendingWorkflowsReply,
    ExistPendingWorkflowsRequest,
    ForkFromFailureReply,
    ForkFromFailureRequest,
    ForkWorkflowReply,
    ForkWorkflowRequest,
    GetMetricsReply,
    GetMetricsRequest,
    GetQueueReply,
    GetQueueRequest,
    GetScheduleReply,
    GetScheduleRequest,
    GetStepAggregatesReply,
    GetStepAggregatesRequest,
    GetWorkflowAggregatesReply,
    GetWorkflowAggregatesRequest,
    GetWorkflowEventsReply,
    GetWorkflowEventsRequest,
    GetWorkflowReply,
    GetWorkflowRequest,
    ListApplicationVersionsReply,
    ListApplicationVersionsRequest,
    ListQueuedWorkflowsBody,
    ListQueuedWorkflowsReply,
    ListQueuedWorkflowsRequest,
    ListQueuesReply,
    ListQueuesRequest,
    ListSchedulesReply,
    ListSchedulesRequest,
    ListStepsReply,
    ListStepsRequest,
    ListWorkflowsBody,
    ListWorkflowsReply,
    ListWorkflowsRequest,
    MessageType,
    PauseScheduleReply,
    PauseScheduleRequest,
    ProtocolError,
    RecoveryReply,
    RecoveryRequest,
    Reply,
    Request,
    ResumeReply,
    ResumeRequest,
    ResumeScheduleReply,
    ResumeScheduleRequest,
    RetentionReply,
    RetentionRequest,
    RewindWorkflowReply,
    RewindWorkflowRequest,
    SetLatestApplicationVersionReply,
    SetLatestApplicationVersionRequest,
    TriggerScheduleReply,
    TriggerScheduleRequest,
    UnknownMessageType,
    decode_frame,
    parse_request,
    unknown_type_reply,
)

log = logging.getLogger(LOGGER_NAME)

#: Types this client answers "Unknown message type" (see the module's docstring).
UNSERVED = frozenset(
    {
        MessageType.GET_WORKFLOW_NOTIFICATIONS,
        MessageType.GET_WORKFLOW_STREAMS,
        MessageType.EXPORT_WORKFLOW,
        MessageType.IMPORT_WORKFLOW,
    }
)

Rq = TypeVar("Rq", bound=Request)


@dataclass(frozen=True)
class Identity:
    """What ``executor_info`` reports."""

    executor_id: str
    application_version: str
    metadata: dict[str, Any] | None = None
    hostname: str = socket.gethostname()
    dbos_version: str = importlib.metadata.version("dbos")


@dataclass(frozen=True)
class _Route:
    handle: Callable[[Handlers, Any], Reply]
    #: The reply when the handler raised: (request, error message).
    failed: Callable[[Any, str], Reply]
    #: How the error message starts: "Exception encountered when ...".
    context: Callable[[Any], str]


ROUTES: dict[MessageType, _Route] = {}


def route(
    request_type: type[Rq], failed: Callable[[Rq, str], Reply], context: Callable[[Rq], str]
) -> Callable[[Callable[[Handlers, Rq], Reply]], Callable[[Handlers, Rq], Reply]]:
    def register(handle: Callable[[Handlers, Rq], Reply]) -> Callable[[Handlers, Rq], Reply]:
        ROUTES[request_type.type] = _Route(handle, failed, context)
        return handle

    return register


class Handlers:
    """Answers requests for this process's DBOS; ``retention`` runs rounds in the background."""

    def __init__(self, identity: Identity, retention: Retention | None = None) -> None:
        self.identity = identity
        self.retention = retention or Retention()
        #: True once DBOS is shutting down: a handler that then fails is logged at DEBUG, not ERROR.
        self.shutting_down: Callable[[], bool] = lambda: False

    def answer(self, text: str | bytes) -> str | None:
        """The reply to the frame ``text``, or None when it cannot be addressed (no type or request id)."""
        request = self._read(text)
        return request if not isinstance(request, Request) else self.respond(request)

    def refuse(self, text: str | bytes, reason: str) -> str | None:
        """The reply to a request not served (the client is too busy to take it): an error and no
        payload, which Relay reads as a refusal (another executor may be asked), not as an answer
        with an error (a handler that ran and failed); or what :meth:`answer` replies to a frame it
        cannot read."""
        request = self._read(text)
        if not isinstance(request, Request):
            return request
        return _dumps(
            ErrorReply(type=request.type.value, request_id=request.request_id, error_message=reason).to_frame()
        )

    def _read(self, text: str | bytes) -> Request | str | None:
        """The frame's request; or the reply already due (an unknown type, a malformed request); or
        None when it cannot be addressed (no type or request id)."""
        try:
            frame = decode_frame(text)
        except ProtocolError as exc:
            log.warning("Ignoring a malformed frame from Relay: %s", exc)
            return None
        try:
            if frame["type"] in UNSERVED:
                raise UnknownMessageType(frame["type"], frame["request_id"])
            return parse_request(frame)
        except UnknownMessageType as exc:
            log.warning("Unexpected message type: %s", exc.frame_type[:64])
            return _dumps(unknown_type_reply(exc.frame_type, exc.request_id))
        except ProtocolError as exc:
            # The SDK dropped the connection on a request it could not read; an error reply
            # tells Relay the same without a reconnect.
            log.warning("Malformed %s request from Relay: %s", frame["type"][:64], exc)
            return _dumps(
                ErrorReply(type=frame["type"], request_id=frame["request_id"], error_message=str(exc)).to_frame()
            )

    def respond(self, request: Request) -> str:
        """The reply's text: the handler's reply, or its failure reply if it raised or cannot be sent."""
        handler = ROUTES[request.type]
        try:
            return handler.handle(self, request).to_json()
        except Exception:
            message = f"{handler.context(request)}: {traceback.format_exc()}"
            # A handler outlasting the wait before DBOS's destroy fails with DBOS gone: not a fault.
            (log.debug if self.shutting_down() else log.error)(message)
            return handler.failed(request, message).to_json()


def _dumps(frame: dict[str, Any]) -> str:
    return json.dumps(frame)


def _ids(workflow_id: str, workflow_ids: list[str] | None) -> list[str]:
    return workflow_ids or [workflow_id]


# --- The executor ---


@route(
    ExecutorInfoRequest,
    lambda r, e: ExecutorInfoReply(
        request_id=r.request_id, executor_id="unknown", application_version="", error_message=e
    ),
    lambda r: "Exception encountered when reporting executor info",
)
def executor_info(h: Handlers, r: ExecutorInfoRequest) -> Reply:
    me = h.identity
    return ExecutorInfoReply(
        request_id=r.request_id,
        executor_id=me.executor_id,
        application_version=me.application_version,
        hostname=me.hostname,
        language="python",
        dbos_version=me.dbos_version,
        executor_metadata=me.metadata,
    )


@route(
    RecoveryRequest,
    lambda r, e: RecoveryReply(request_id=r.request_id, success=False, error_message=e),
    lambda r: "Exception encountered when recovering workflows",
)
def recovery(h: Handlers, r: RecoveryRequest) -> Reply:
    recovered = _internals.recover_pending_workflows(list(r.executor_ids))
    log.info("Recovered %d workflows of executors %s", recovered, r.executor_ids)
    return RecoveryReply(request_id=r.request_id, success=True)


@route(
    ExistPendingWorkflowsRequest,
    lambda r, e: ExistPendingWorkflowsReply(request_id=r.request_id, exist=False, error_message=e),
    lambda r: "Exception encountered when checking for pending workflows",
)
def exist_pending_workflows(h: Handlers, r: ExistPendingWorkflowsRequest) -> Reply:
    pending = DBOS.list_workflows(
        status="PENDING", executor_id=r.executor_id, app_version=r.application_version,
        limit=1, load_input=False, load_output=False,
    )  # fmt: skip
    return ExistPendingWorkflowsReply(request_id=r.request_id, exist=len(pending) > 0)


@route(
    RetentionRequest,
    lambda r, e: RetentionReply(request_id=r.request_id, success=False, error_message=e),
    lambda r: "Exception encountered when enforcing retention policy",
)
def retention(h: Handlers, r: RetentionRequest) -> Reply:
    h.retention.start(r.body)  # a round still running means this one is skipped, as the SDK did
    return RetentionReply(request_id=r.request_id, success=True)


@route(
    AlertRequest,
    lambda r, e: AlertReply(request_id=r.request_id, success=False, error_message=e),
    lambda r: "Exception encountered when processing alert",
)
def alert(h: Handlers, r: AlertRequest) -> Reply:
    instance = _internals.live_instance()
    handler = _internals.alert_handler(instance) if instance is not None else None
    if handler is None:
        log.info("Alert: %s | Message: %s | Metadata: %s", r.name, r.message, r.metadata)
    else:
        handler(r.name, r.message, dict(r.metadata))
    return AlertReply(request_id=r.request_id, success=True)


@route(
    GetMetricsRequest,
    lambda r, e: GetMetricsReply(request_id=r.request_id, metrics=[], error_message=e),
    lambda r: "Exception encountered when getting metrics",
)
def get_metrics(h: Handlers, r: GetMetricsRequest) -> Reply:
    if r.metric_class != "workflow_step_count":
        return GetMetricsReply(
            request_id=r.request_id, metrics=[], error_message=f"Unexpected metric class: {r.metric_class}"
        )
    metrics = aggregates.workflow_step_counts(r.start_time, r.end_time, r.application_name)
    return GetMetricsReply(request_id=r.request_id, metrics=metrics)


# --- Commands on workflows ---


@route(
    CancelRequest,
    lambda r, e: CancelReply(request_id=r.request_id, success=False, error_message=e),
    lambda r: f"Exception encountered when cancelling workflow(s) {_ids(r.workflow_id, r.workflow_ids)}",
)
def cancel(h: Handlers, r: CancelRequest) -> Reply:
    DBOS.cancel_workflows(_ids(r.workflow_id, r.workflow_ids), cancel_children=r.cancel_children)
    return CancelReply(request_id=r.request_id, success=True)


@route(
    DeleteRequest,
    lambda r, e: DeleteReply(request_id=r.request_id, success=False, error_message=e),
    lambda r: f"Exception encountered when deleting workflow(s) {_ids(r.workflow_id, r.workflow_ids)}",
)
def delete(h: Handlers, r: DeleteRequest) -> Reply:
    DBOS.delete_workflows(_ids(r.workflow_id, r.workflow_ids), delete_children=r.delete_children)
    return DeleteReply(request_id=r.request_id, success=True)


@route(
    ResumeRequest,
    lambda r, e: ResumeReply(request_id=r.request_id, success=False, error_message=e),
    lambda r: f"Exception encountered when resuming workflow(s) {_ids(r.workflow_id, r.workflow_ids)}",
)
def resume(h: Handlers, r: ResumeRequest) -> Reply:
    DBOS.resume_workflows(_ids(r.workflow_id, r.workflow_ids), queue_name=r.queue_name)
    return ResumeReply(request_id=r.request_id, success=True)


@route(
    ForkWorkflowRequest,
    lambda r, e: ForkWorkflowReply(request_id=r.request_id, new_workflow_id=None, error_message=e),
    lambda r: (
        f"Exception encountered when forking workflow {r.body.workflow_id} to new workflow "
        f"{r.body.new_workflow_id} on step {r.body.start_step}, app version {r.body.application_version}"
    ),
)
def fork_workflow(h: Handlers, r: ForkWorkflowRequest) -> Reply:
    b = r.body
    with SetWorkflowID(b.new_workflow_id or str(uuid.uuid4())):
        handle = DBOS.fork_workflow(
            b.workflow_id, b.start_step, application_version=b.application_version,
            queue_name=b.queue_name, queue_partition_key=b.queue_partition_key,
        )  # fmt: skip
    return ForkWorkflowReply(request_id=r.request_id, new_workflow_id=handle.workflow_id)


@route(
    ForkFromFailureRequest,
    lambda r, e: ForkFromFailureReply(request_id=r.request_id, forked_workflow_ids=None, error_message=e),
    lambda r: "Exception encountered when bulk forking workflows",
)
def fork_from_failure(h: Handlers, r: ForkFromFailureRequest) -> Reply:
    b = r.body
    modes = [b.from_last_failure, b.from_last_step, b.from_step is not None, b.from_step_name is not None]
    if sum(modes) != 1:
        raise ValueError(
            "Exactly one of from_last_failure, from_last_step, from_step, or from_step_name must be specified"
        )
    # Every start step first, so that a workflow that cannot be forked stops the batch before any fork.
    starts = [
        (workflow_id, _start_step(workflow_id, b.from_step, b.from_step_name, b.from_last_failure))
        for workflow_id in b.workflow_ids
    ]
    forked = []
    for workflow_id, start in starts:
        with SetWorkflowID(str(uuid.uuid4())):
            handle = DBOS.fork_workflow(
                workflow_id, start, application_version=b.application_version,
                queue_name=b.queue_name, queue_partition_key=b.queue_partition_key,
            )  # fmt: skip
        forked.append(handle.workflow_id)
    return ForkFromFailureReply(request_id=r.request_id, forked_workflow_ids=forked)


def _start_step(workflow_id: str, from_step: int | None, from_step_name: str | None, from_last_failure: bool) -> int:
    """The step a workflow is forked from: the given one, the last of a name, the last failed, or the last."""
    if from_step is not None:
        return from_step
    # Errors are read with outputs: load them only to find the last failure.
    steps = DBOS.list_workflow_steps(workflow_id, load_output=from_last_failure)
    if from_step_name is not None:
        named = [s["function_id"] for s in steps if s["function_name"] == from_step_name]
        if not named:
            raise ValueError(f"Workflow {workflow_id} has no step named {from_step_name!r}")
        return max(named)
    failed = [s["function_id"] for s in steps if s["error"] is not None] if from_last_failure else []
    return max(failed or [s["function_id"] for s in steps] or [1])


@route(
    RewindWorkflowRequest,
    lambda r, e: RewindWorkflowReply(request_id=r.request_id, success=False, error_message=e),
    lambda r: "Exception encountered when rewinding workflow",
)
def rewind_workflow(h: Handlers, r: RewindWorkflowRequest) -> Reply:
    b = r.body
    DBOS.rewind_workflow(
        b.workflow_id, start_step=b.start_step or 1, application_version=b.application_version,
        queue_name=b.queue_name, queue_partition_key=b.queue_partition_key,
    )  # fmt: skip
    return RewindWorkflowReply(request_id=r.request_id, success=True)


# --- Reading workflows ---


def _list(body: ListWorkflowsBody | ListQueuedWorkflowsBody, queues_only: bool) -> list[Any]:
    statuses = DBOS.list_workflows(
        workflow_ids=body.workflow_uuids, status=body.status, start_time=body.start_time, end_time=body.end_time,
        completed_after=body.completed_after, completed_before=body.completed_before,
        dequeued_after=body.dequeued_after, dequeued_before=body.dequeued_before, name=body.workflow_name,
        app_version=body.application_version, forked_from=body.forked_from,
        parent_workflow_id=body.parent_workflow_id, user=body.authenticated_user, queue_name=body.queue_name,
        limit=body.limit, offset=body.offset, sort_desc=body.sort_desc, workflow_id_prefix=body.workflow_id_prefix,
        load_input=body.load_input, load_output=body.load_output, executor_id=body.executor_id,
        queues_only=queues_only, was_forked_from=body.was_forked_from, has_parent=body.has_parent,
        attributes=body.attributes, schedule_name=body.schedule_name, application_name=body.application_name,
    )  # fmt: skip
    return [convert.workflow_output(s) for s in statuses]


@route(
    ListWorkflowsRequest,
    lambda r, e: ListWorkflowsReply(request_id=r.request_id, output=[], error_message=e),
    lambda r: "Exception encountered when listing workflows",
)
def list_workflows(h: Handlers, r: ListWorkflowsRequest) -> Reply:
    return ListWorkflowsReply(request_id=r.request_id, output=_list(r.body, r.body.queues_only))


@route(
    ListQueuedWorkflowsRequest,
    lambda r, e: ListQueuedWorkflowsReply(request_id=r.request_id, output=[], error_message=e),
    lambda r: "Exception encountered when listing queued workflows",
)
def list_queued_workflows(h: Handlers, r: ListQueuedWorkflowsRequest) -> Reply:
    return ListQueuedWorkflowsReply(request_id=r.request_id, output=_list(r.body, True))


@route(
    GetWorkflowRequest,
    lambda r, e: GetWorkflowReply(request_id=r.request_id, output=None, error_message=e),
    lambda r: f"Exception encountered when getting workflow {r.workflow_id}",
)
def get_workflow(h: Handlers, r: GetWorkflowRequest) -> Reply:
    found = DBOS.list_workflows(workflow_ids=[r.workflow_id], load_input=r.load_input, load_output=r.load_output)
    return GetWorkflowReply(request_id=r.request_id, output=convert.workflow_output(found[0]) if found else None)


@route(
    ListStepsRequest,
    lambda r, e: ListStepsReply(request_id=r.request_id, output=None, error_message=e),
    lambda r: f"Exception encountered when getting workflow {r.workflow_id}",
)
def list_steps(h: Handlers, r: ListStepsRequest) -> Reply:
    steps = DBOS.list_workflow_steps(r.workflow_id, load_output=r.load_output, limit=r.limit, offset=r.offset)
    return ListStepsReply(request_id=r.request_id, output=[convert.step_output(s) for s in steps])


@route(
    GetWorkflowEventsRequest,
    lambda r, e: GetWorkflowEventsReply(request_id=r.request_id, events=None, error_message=e),
    lambda r: f"Exception encountered when getting events for workflow {r.workflow_id}",
)
def get_workflow_events(h: Handlers, r: GetWorkflowEventsRequest) -> Reply:
    events = convert.event_outputs(DBOS.get_all_events(r.workflow_id))
    return GetWorkflowEventsReply(request_id=r.request_id, events=events)


@route(
    GetWorkflowAggregatesRequest,
    lambda r, e: GetWorkflowAggregatesReply(request_id=r.request_id, output=[], error_message=e),
    lambda r: "Exception encountered when getting workflow aggregates",
)
def get_workflow_aggregates(h: Handlers, r: GetWorkflowAggregatesRequest) -> Reply:
    return GetWorkflowAggregatesReply(request_id=r.request_id, output=aggregates.workflow_aggregates(r.body))


@route(
    GetStepAggregatesRequest,
    lambda r, e: GetStepAggregatesReply(request_id=r.request_id, output=[], error_message=e),
    lambda r: "Exception encountered when getting step aggregates",
)
def get_step_aggregates(h: Handlers, r: GetStepAggregatesRequest) -> Reply:
    return GetStepAggregatesReply(request_id=r.request_id, output=aggregates.step_aggregates(r.body))


# --- Schedules ---


@route(
    ListSchedulesRequest,
    lambda r, e: ListSchedulesReply(request_id=r.request_id, output=[], error_message=e),
    lambda r: "Exception encountered when listing schedules",
)
def list_schedules(h: Handlers, r: ListSchedulesRequest) -> Reply:
    b = r.body
    schedules = DBOS.list_schedules(
        status=b.status, workflow_name=b.workflow_name, schedule_name_prefix=b.schedule_name_prefix,
        application_name=b.application_name,
    )  # fmt: skip
    return ListSchedulesReply(
        request_id=r.request_id, output=[convert.schedule_output(s, b.load_context) for s in schedules]
    )


@route(
    GetScheduleRequest,
    lambda r, e: GetScheduleReply(request_id=r.request_id, output=None, error_message=e),
    lambda r: f"Exception encountered when getting schedule '{r.schedule_name}'",
)
def get_schedule(h: Handlers, r: GetScheduleRequest) -> Reply:
    schedule = DBOS.get_schedule(r.schedule_name)
    output = convert.schedule_output(schedule, r.load_context) if schedule is not None else None
    return GetScheduleReply(request_id=r.request_id, output=output)


@route(
    PauseScheduleRequest,
    lambda r, e: PauseScheduleReply(request_id=r.request_id, success=False, error_message=e),
    lambda r: f"Exception encountered when pausing schedule '{r.schedule_name}'",
)
def pause_schedule(h: Handlers, r: PauseScheduleRequest) -> Reply:
    DBOS.pause_schedule(r.schedule_name)
    return PauseScheduleReply(request_id=r.request_id, success=True)


@route(
    ResumeScheduleRequest,
    lambda r, e: ResumeScheduleReply(request_id=r.request_id, success=False, error_message=e),
    lambda r: f"Exception encountered when resuming schedule '{r.schedule_name}'",
)
def resume_schedule(h: Handlers, r: ResumeScheduleRequest) -> Reply:
    DBOS.resume_schedule(r.schedule_name)
    return ResumeScheduleReply(request_id=r.request_id, success=True)


def _utc(iso: str) -> datetime:
    """An ISO 8601 time; a naive one is UTC, as the SDK read backfill bounds."""
    at = datetime.fromisoformat(iso)
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


@route(
    BackfillScheduleRequest,
    lambda r, e: BackfillScheduleReply(request_id=r.request_id, workflow_ids=[], error_message=e),
    lambda r: f"Exception encountered when backfilling schedule '{r.schedule_name}'",
)
def backfill_schedule(h: Handlers, r: BackfillScheduleRequest) -> Reply:
    handles = DBOS.backfill_schedule(r.schedule_name, _utc(r.start), _utc(r.end))
    return BackfillScheduleReply(request_id=r.request_id, workflow_ids=[handle.workflow_id for handle in handles])


@route(
    TriggerScheduleRequest,
    lambda r, e: TriggerScheduleReply(request_id=r.request_id, workflow_id=None, error_message=e),
    lambda r: f"Exception encountered when triggering schedule '{r.schedule_name}'",
)
def trigger_schedule(h: Handlers, r: TriggerScheduleRequest) -> Reply:
    return TriggerScheduleReply(request_id=r.request_id, workflow_id=DBOS.trigger_schedule(r.schedule_name).workflow_id)


# --- Application versions ---


@route(
    ListApplicationVersionsRequest,
    lambda r, e: ListApplicationVersionsReply(request_id=r.request_id, output=[], error_message=e),
    lambda r: "Exception encountered when listing application versions",
)
def list_application_versions(h: Handlers, r: ListApplicationVersionsRequest) -> Reply:
    versions = [convert.version_output(v) for v in DBOS.list_application_versions()]
    return ListApplicationVersionsReply(request_id=r.request_id, output=versions)


@route(
    SetLatestApplicationVersionRequest,
    lambda r, e: SetLatestApplicationVersionReply(request_id=r.request_id, success=False, error_message=e),
    lambda r: f"Exception encountered when setting latest application version '{r.version_name}'",
)
def set_latest_application_version(h: Handlers, r: SetLatestApplicationVersionRequest) -> Reply:
    DBOS.set_latest_application_version(r.version_name)
    return SetLatestApplicationVersionReply(request_id=r.request_id, success=True)


# --- Queues ---


@route(
    ListQueuesRequest,
    lambda r, e: ListQueuesReply(request_id=r.request_id, output=[], error_message=e),
    lambda r: "Exception encountered when listing queues",
)
def list_queues(h: Handlers, r: ListQueuesRequest) -> Reply:
    queues = DBOS.list_queues(application_name=r.body.application_name)
    return ListQueuesReply(request_id=r.request_id, output=[convert.queue_output(q) for q in queues])


@route(
    GetQueueRequest,
    lambda r, e: GetQueueReply(request_id=r.request_id, output=None, error_message=e),
    lambda r: f"Exception encountered when getting queue '{r.name}'",
)
def get_queue(h: Handlers, r: GetQueueRequest) -> Reply:
    queue = DBOS.retrieve_queue(r.name)
    return GetQueueReply(request_id=r.request_id, output=convert.queue_output(queue) if queue is not None else None)


# Every type is either served or answered unknown, never both or neither.
assert set(ROUTES).isdisjoint(UNSERVED) and set(ROUTES) | UNSERVED == set(MessageType), sorted(
    set(MessageType) - set(ROUTES) - UNSERVED
)
