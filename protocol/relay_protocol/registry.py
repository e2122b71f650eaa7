"""Which class each message type decodes to, and parsing by type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from relay_protocol import messages as m
from relay_protocol.codec import field_specs, json_kind
from relay_protocol.errors import ErrorOnlyReply, ProtocolError, UnknownMessageType
from relay_protocol.frames import ErrorReply, MessageType, Reply, Request, is_unknown_type_reply

R = TypeVar("R", bound=Reply)

_PAIRS: tuple[tuple[type[Request], type[Reply]], ...] = (
    (m.ExecutorInfoRequest, m.ExecutorInfoReply),
    (m.RecoveryRequest, m.RecoveryReply),
    (m.CancelRequest, m.CancelReply),
    (m.DeleteRequest, m.DeleteReply),
    (m.ListWorkflowsRequest, m.ListWorkflowsReply),
    (m.ListQueuedWorkflowsRequest, m.ListQueuedWorkflowsReply),
    (m.ResumeRequest, m.ResumeReply),
    (m.GetWorkflowRequest, m.GetWorkflowReply),
    (m.ExistPendingWorkflowsRequest, m.ExistPendingWorkflowsReply),
    (m.ListStepsRequest, m.ListStepsReply),
    (m.ForkWorkflowRequest, m.ForkWorkflowReply),
    (m.RetentionRequest, m.RetentionReply),
    (m.GetMetricsRequest, m.GetMetricsReply),
    (m.AlertRequest, m.AlertReply),
    (m.ExportWorkflowRequest, m.ExportWorkflowReply),
    (m.ImportWorkflowRequest, m.ImportWorkflowReply),
    (m.ListSchedulesRequest, m.ListSchedulesReply),
    (m.GetScheduleRequest, m.GetScheduleReply),
    (m.PauseScheduleRequest, m.PauseScheduleReply),
    (m.ResumeScheduleRequest, m.ResumeScheduleReply),
    (m.BackfillScheduleRequest, m.BackfillScheduleReply),
    (m.TriggerScheduleRequest, m.TriggerScheduleReply),
    (m.ListApplicationVersionsRequest, m.ListApplicationVersionsReply),
    (m.SetLatestApplicationVersionRequest, m.SetLatestApplicationVersionReply),
    (m.GetWorkflowEventsRequest, m.GetWorkflowEventsReply),
    (m.GetWorkflowNotificationsRequest, m.GetWorkflowNotificationsReply),
    (m.GetWorkflowStreamsRequest, m.GetWorkflowStreamsReply),
    (m.GetWorkflowAggregatesRequest, m.GetWorkflowAggregatesReply),
    (m.GetStepAggregatesRequest, m.GetStepAggregatesReply),
    (m.ForkFromFailureRequest, m.ForkFromFailureReply),
    (m.ListQueuesRequest, m.ListQueuesReply),
    (m.GetQueueRequest, m.GetQueueReply),
    (m.RewindWorkflowRequest, m.RewindWorkflowReply),
)

REQUESTS: dict[MessageType, type[Request]] = {request.type: request for request, _ in _PAIRS}
REPLIES: dict[MessageType, type[Reply]] = {reply.type: reply for _, reply in _PAIRS}


def parse_request(frame: Mapping[str, Any]) -> Request:
    """The request in ``frame`` (from :func:`~relay_protocol.decode_frame`), by its type.

    A type that is not a :class:`MessageType` raises :class:`UnknownMessageType`,
    to be answered with :func:`~relay_protocol.unknown_type_reply`.
    """
    if not isinstance(frame, Mapping):
        raise ProtocolError(f"request: expected a JSON object, got {json_kind(frame)}")
    frame_type, request_id = frame.get("type"), frame.get("request_id")
    if not isinstance(frame_type, str):
        raise ProtocolError(f"request: type: expected str, got {json_kind(frame_type)}", path="type")
    try:
        message_type = MessageType(frame_type)
    except ValueError:
        raise UnknownMessageType(frame_type, request_id if isinstance(request_id, str) else "") from None
    return REQUESTS[message_type].from_frame(frame)


def parse_reply(frame: Mapping[str, Any], expected: type[R], *, request_id: str | None = None) -> R:
    """The reply in ``frame``, which must be of ``expected``'s type (and answer ``request_id``, if given).

    A reply that carries only an error where a payload was expected, and any
    reply saying the type is unknown, raise :class:`ErrorOnlyReply`.
    """
    context = expected.describe()
    if not isinstance(frame, Mapping):
        raise ProtocolError(f"{context}: expected a JSON object, got {json_kind(frame)}")
    if frame.get("type") != expected.type.value:
        raise ProtocolError(
            f"{context}: type: expected {expected.type.value!r}, got {repr(frame.get('type'))[:80]}", path="type"
        )
    if request_id is not None and frame.get("request_id") != request_id:
        raise ProtocolError(
            f"{context}: request_id: expected {request_id!r}, got {repr(frame.get('request_id'))[:80]}",
            path="request_id",
        )
    if isinstance(frame.get("error_message"), str) and (
        is_unknown_type_reply(frame) or _lacks_payload(frame, expected)
    ):
        raise ErrorOnlyReply(ErrorReply.from_frame(frame))
    return expected.from_frame(frame)


def _lacks_payload(frame: Mapping[str, Any], expected: type[Reply]) -> bool:
    return any(spec.required and spec.wire not in frame for spec in field_specs(expected))
