"""Frames: strict JSON decoding, the message type enum and the request and reply bases.

Every frame is a JSON object with a string ``type`` and ``request_id``. The
server sends requests; the executor answers each with a reply of the same
type and request id, which may carry ``error_message``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Self

from relay_protocol.codec import check_string, decode, encode, json_kind
from relay_protocol.errors import ProtocolError
from relay_protocol.limits import MAX_INT_DIGITS, NAME, TEXT, meta

#: The ``error_message`` of the SDK's reply to a type it does not know.
UNKNOWN_TYPE_ERROR = "Unknown message type"


class MessageType(StrEnum):
    """Every message type of the executor protocol, as on the wire."""

    EXECUTOR_INFO = "executor_info"
    RECOVERY = "recovery"
    CANCEL = "cancel"
    DELETE = "delete"
    LIST_WORKFLOWS = "list_workflows"
    LIST_QUEUED_WORKFLOWS = "list_queued_workflows"
    RESUME = "resume"
    GET_WORKFLOW = "get_workflow"
    EXIST_PENDING_WORKFLOWS = "exist_pending_workflows"
    LIST_STEPS = "list_steps"
    FORK_WORKFLOW = "fork_workflow"
    RETENTION = "retention"
    GET_METRICS = "get_metrics"
    ALERT = "alert"
    EXPORT_WORKFLOW = "export_workflow"
    IMPORT_WORKFLOW = "import_workflow"
    LIST_SCHEDULES = "list_schedules"
    GET_SCHEDULE = "get_schedule"
    PAUSE_SCHEDULE = "pause_schedule"
    RESUME_SCHEDULE = "resume_schedule"
    BACKFILL_SCHEDULE = "backfill_schedule"
    TRIGGER_SCHEDULE = "trigger_schedule"
    LIST_APPLICATION_VERSIONS = "list_application_versions"
    SET_LATEST_APPLICATION_VERSION = "set_latest_application_version"
    GET_WORKFLOW_EVENTS = "get_workflow_events"
    GET_WORKFLOW_NOTIFICATIONS = "get_workflow_notifications"
    GET_WORKFLOW_STREAMS = "get_workflow_streams"
    GET_WORKFLOW_AGGREGATES = "get_workflow_aggregates"
    GET_STEP_AGGREGATES = "get_step_aggregates"
    FORK_FROM_FAILURE = "fork_from_failure"
    LIST_QUEUES = "list_queues"
    GET_QUEUE = "get_queue"
    REWIND_WORKFLOW = "rewind_workflow"


def decode_frame(text: str | bytes) -> dict[str, Any]:
    """One frame as a JSON object, or a :class:`ProtocolError`.

    Strict where :func:`json.loads` is lenient: no NaN or Infinity (nor a
    number too large to be finite), no integer of more than
    :data:`~relay_protocol.limits.MAX_INT_DIGITS` digits, bytes must be UTF-8.
    ``type`` and ``request_id`` must be names (see :data:`~relay_protocol.limits.NAME`).
    """
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"frame is not UTF-8: {exc}") from None
    try:
        frame = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("frame: JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or int() refusing a huge integer
        raise ProtocolError(f"frame is not valid JSON: {exc}") from None
    if not isinstance(frame, dict):
        raise ProtocolError(f"frame: expected a JSON object, got {json_kind(frame)}")
    for key in ("type", "request_id"):
        if key not in frame:
            raise ProtocolError(f"frame: {key}: required field missing", path=key)
        check_string(frame[key], NAME, "frame", key)
    return frame


def _refuse_constant(name: str) -> float:
    raise ProtocolError(f"frame: {name} is not JSON")


def _finite_float(literal: str) -> float:
    number = float(literal)
    if not math.isfinite(number):
        raise ProtocolError(f"frame: number {literal[:40]} is out of range")
    return number


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise ProtocolError(f"frame: integer of more than {MAX_INT_DIGITS} digits")
    return int(literal)


def _new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, kw_only=True)
class Message:
    """A request or reply of one :class:`MessageType`; the subclass sets ``type``."""

    type: ClassVar[MessageType]
    direction: ClassVar[str]
    request_id: str

    @classmethod
    def describe(cls) -> str:
        """``"list_workflows reply"``: how error messages name this class."""
        return f"{cls.type.value} {cls.direction}"

    def to_frame(self) -> dict[str, Any]:
        """The frame as a JSON object; optional fields left unset are sent as null, as the SDK does."""
        return {"type": self.type.value, **encode(self, self.describe())}

    def to_json(self) -> str:
        return json.dumps(self.to_frame())

    @classmethod
    def from_frame(cls, frame: Mapping[str, Any]) -> Self:
        """The message in ``frame``, checked field by field; keys it does not know are ignored."""
        context = cls.describe()
        if not isinstance(frame, Mapping):
            raise ProtocolError(f"{context}: expected a JSON object, got {json_kind(frame)}")
        frame_type = frame.get("type")
        if frame_type != cls.type.value:
            raise ProtocolError(f"{context}: type: expected {cls.type.value!r}, got {_show(frame_type)}", path="type")
        if "request_id" not in frame:
            raise ProtocolError(f"{context}: request_id: required field missing", path="request_id")
        return decode(cls, frame, context)

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        return cls.from_frame(decode_frame(text))


@dataclass(frozen=True, kw_only=True)
class Request(Message):
    """Sent by the server. ``request_id`` defaults to a fresh random one."""

    direction = "request"
    request_id: str = field(default_factory=_new_request_id)


@dataclass(frozen=True, kw_only=True)
class Reply(Message):
    """Sent by the executor, echoing the request's ``type`` and ``request_id``."""

    direction = "reply"
    error_message: str | None = field(default=None, metadata=meta(rule=TEXT))

    def to_frame(self) -> dict[str, Any]:
        frame = super().to_frame()
        frame["error_message"] = frame.pop("error_message")  # last, as the SDK sends it
        return frame


@dataclass(frozen=True, kw_only=True)
class ErrorReply:
    """A reply with nothing but an error, the SDK's ``BaseResponse``.

    The SDK sends it for a type it does not know (``error_message`` is
    :data:`UNKNOWN_TYPE_ERROR`) and for a data command it refuses in
    metadata-only mode (``"<type> is not allowed in conductor metadata-only mode"``).
    """

    type: str
    request_id: str
    error_message: str = field(metadata=meta(rule=TEXT))

    def to_frame(self) -> dict[str, Any]:
        return encode(self, f"{self.type[:64]} reply")

    @classmethod
    def from_frame(cls, frame: Mapping[str, Any]) -> ErrorReply:
        frame_type = frame.get("type") if isinstance(frame, Mapping) else None
        return decode(cls, frame, f"{str(frame_type)[:64]} reply")


def unknown_type_reply(frame_type: str, request_id: str) -> dict[str, Any]:
    """Exactly the SDK's reply to a request of a type it does not know."""
    return {"type": frame_type, "request_id": request_id, "error_message": UNKNOWN_TYPE_ERROR}


def is_unknown_type_reply(reply: Mapping[str, Any] | Reply | ErrorReply) -> bool:
    """Whether ``reply`` (a frame or a parsed reply) is the SDK's answer to a type it does not know."""
    error = reply.get("error_message") if isinstance(reply, Mapping) else reply.error_message
    return error == UNKNOWN_TYPE_ERROR


def _show(value: object) -> str:
    return repr(value)[:80]
