"""The DBOS Conductor executor protocol, as far as Relay speaks it.

Mirrors ``dbos/_conductor/protocol.py`` of the open-source SDKs (Python dbos
<= 3.2, TypeScript @dbos-inc/dbos-sdk <= 5.2): JSON text frames, every request
with ``type`` and ``request_id``, every reply echoing both and possibly
carrying ``error_message``. Relay sends requests; executors only answer.
"""

from __future__ import annotations

import builtins
import json
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from relay.errors import ProtocolError


class MessageType(StrEnum):
    EXECUTOR_INFO = "executor_info"
    RECOVERY = "recovery"
    CANCEL = "cancel"
    LIST_WORKFLOWS = "list_workflows"
    GET_WORKFLOW = "get_workflow"
    EXIST_PENDING_WORKFLOWS = "exist_pending_workflows"
    LIST_STEPS = "list_steps"
    FORK_WORKFLOW = "fork_workflow"
    REWIND_WORKFLOW = "rewind_workflow"
    LIST_APPLICATION_VERSIONS = "list_application_versions"


@dataclass(frozen=True)
class Request:
    """A request frame; ``fields`` are the type-specific members."""

    type: MessageType
    fields: dict[str, Any] = field(default_factory=dict)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def to_json(self) -> str:
        return json.dumps({"type": self.type.value, "request_id": self.request_id, **self.fields})


@dataclass(frozen=True)
class Reply:
    """A reply frame as received: the envelope plus the whole decoded body."""

    type: str
    request_id: str
    error_message: str | None
    body: dict[str, Any]

    def require(self, name: str, kind: builtins.type | tuple[builtins.type, ...]) -> Any:
        value = self.body.get(name)
        if not isinstance(value, kind):
            raise ProtocolError(f"{self.type} reply: field {name!r} missing or not {_kind_name(kind)}")
        return value

    def optional(self, name: str, kind: builtins.type | tuple[builtins.type, ...]) -> Any:
        value = self.body.get(name)
        if value is not None and not isinstance(value, kind):
            raise ProtocolError(f"{self.type} reply: field {name!r} is not {_kind_name(kind)}")
        return value


def _kind_name(kind: builtins.type | tuple[builtins.type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def parse_reply(text: str) -> Reply:
    """Decode one text frame; raises :class:`ProtocolError` if it is not a reply."""
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(f"malformed JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError(f"a frame must be a JSON object, got {type(body).__name__}")
    msg_type, request_id = body.get("type"), body.get("request_id")
    if not isinstance(msg_type, str) or not isinstance(request_id, str):
        raise ProtocolError("a frame must carry string 'type' and 'request_id'")
    error = body.get("error_message")
    return Reply(
        type=msg_type,
        request_id=request_id,
        error_message=error if isinstance(error, str) else None,
        body=body,
    )


@dataclass(frozen=True)
class ExecutorInfo:
    executor_id: str
    application_version: str
    hostname: str | None
    language: str | None
    dbos_version: str | None
    metadata: dict[str, Any] | None

    @classmethod
    def from_reply(cls, reply: Reply) -> ExecutorInfo:
        if reply.error_message:
            raise ProtocolError(f"executor_info failed: {reply.error_message}")
        executor_id = reply.require("executor_id", str)
        if not executor_id or len(executor_id) > 255:
            raise ProtocolError("executor_info reply: executor_id must be 1 to 255 characters")
        return cls(
            executor_id=executor_id,
            application_version=reply.require("application_version", str),
            hostname=reply.optional("hostname", str),
            language=reply.optional("language", str),
            dbos_version=reply.optional("dbos_version", str),
            metadata=reply.optional("executor_metadata", dict),
        )


def executor_info() -> Request:
    return Request(MessageType.EXECUTOR_INFO)


def recovery(executor_ids: list[str]) -> Request:
    return Request(MessageType.RECOVERY, {"executor_ids": executor_ids})


def exist_pending_workflows(executor_id: str, application_version: str) -> Request:
    return Request(
        MessageType.EXIST_PENDING_WORKFLOWS,
        {"executor_id": executor_id, "application_version": application_version},
    )


def list_workflows(**filters: Any) -> Request:
    """``filters`` are members of the SDK's ListWorkflowsBody (status, executor_id, limit...)."""
    body = {"load_input": False, "load_output": False, "sort_desc": False, **filters}
    return Request(MessageType.LIST_WORKFLOWS, {"body": body})
