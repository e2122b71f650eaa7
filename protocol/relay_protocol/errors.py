"""The exceptions of relay_protocol.

Each is a ValueError, so code that guards ``json.loads`` with ``except ValueError``
keeps catching what goes wrong::

    ValueError
    └── ProtocolError          a frame or message is malformed; says what and where
        ├── UnknownMessageType a request of a type this side does not know (answer it
        │                      with unknown_type_reply)
        └── ErrorOnlyReply     the executor answered with nothing but an error: a type it
                               does not know, or a command it refuses
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relay_protocol.frames import ErrorReply


class ProtocolError(ValueError):
    """Anything malformed. ``path`` is the field path inside the frame (``output[3].Status``), if known."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class UnknownMessageType(ProtocolError):
    """A request whose ``type`` is not a :class:`~relay_protocol.MessageType`."""

    def __init__(self, frame_type: str, request_id: str) -> None:
        super().__init__(f"unknown message type {frame_type[:64]!r}", path="type")
        self.frame_type = frame_type
        self.request_id = request_id


class ErrorOnlyReply(ProtocolError):
    """A reply carrying only ``error_message`` where a payload was expected.

    The SDK answers so for a type it does not know (:func:`~relay_protocol.is_unknown_type_reply`
    tells) and for a data command refused in metadata-only mode.
    """

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.type} reply: the executor answered with an error only: {reply.error_message[:200]}")
        self.reply = reply
