"""Replies from executors, read with :mod:`relay_protocol` and turned into Relay's errors.

The protocol module knows nothing of Relay; this is the boundary where its
:class:`relay_protocol.ProtocolError` becomes one of Relay's own errors.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from relay.errors import ExecutorBadReply, ExecutorRefused, ProtocolError, UnsupportedMessage
from relay_protocol import (
    ErrorOnlyReply,
    ExecutorInfoReply,
    Reply,
    Request,
    clean_text,
    is_unknown_type_reply,
    parse_reply,
)
from relay_protocol import ProtocolError as WireError

R = TypeVar("R", bound=Reply)
Frame = dict[str, Any]

# How much of an executor's error message Relay keeps (in logs, audit entries, API answers).
ERROR_TEXT_LEN = 2000

_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8_json(value: Any) -> Any:
    """Lone surrogates (which JSON's ``\\udc00`` escapes can make) replaced by U+FFFD: what Relay
    passes on as JSON must be UTF-8. Frames are cleaned where they arrive (see :func:`clean_frame`).

    A copy made with a stack of its own, not by recursion: a frame may nest as deeply as the JSON
    decoder took it (close to the interpreter's recursion limit), and a recursive copy, two frames
    a level, failed on one nested half as deep."""
    pending: list[tuple[dict[Any, Any] | list[Any], dict[Any, Any] | list[Any]]] = []

    def copy(item: Any) -> Any:
        if isinstance(item, str):
            return item if item.isascii() else _SURROGATE.sub("\ufffd", item)
        if isinstance(item, (dict, list)):
            empty: dict[Any, Any] | list[Any] = {} if isinstance(item, dict) else []
            pending.append((item, empty))
            return empty
        return item

    result = copy(value)
    while pending:
        source, target = pending.pop()
        if isinstance(source, dict):
            assert isinstance(target, dict)
            for k, v in source.items():
                target[copy(k)] = copy(v)
        else:
            assert isinstance(target, list)
            target.extend(copy(v) for v in source)
    return result


def clean_frame(text: str, frame: Frame) -> Frame:
    """``frame``, decoded from ``text``, with any lone surrogate replaced. Only an escape can make
    one (a WebSocket text frame is valid UTF-8), so a text without ``\\u`` is returned as is."""
    return utf8_json(frame) if "\\u" in text else frame


def executor_info(frame: Frame, request_id: str) -> ExecutorInfoReply:
    """The handshake's reply; :class:`ProtocolError` if it is not a usable one."""
    try:
        info = parse_reply(frame, ExecutorInfoReply, request_id=request_id)
    except ErrorOnlyReply as exc:
        raise ProtocolError(f"executor_info failed: {clean_text(exc.reply.error_message, 200)}") from exc
    except WireError as exc:
        raise ProtocolError(str(exc)) from exc
    if info.error_message:
        raise ProtocolError(f"executor_info failed: {clean_text(info.error_message, 200)}")
    return info


def reply_to(request: Request, frame: Frame, expected: type[R], who: str) -> R:
    """``expected``, read from ``frame``, the answer of ``who`` to ``request``.

    Raises :class:`UnsupportedMessage` when the executor's SDK does not know
    the message, :class:`ExecutorRefused` for an answer that is only an error,
    :class:`ExecutorBadReply` for one of the wrong shape. A reply that has its
    payload and an ``error_message`` too is returned: the caller decides.
    """
    what = request.type.value
    try:
        return parse_reply(frame, expected, request_id=request.request_id)
    except ErrorOnlyReply as exc:
        error = clean_text(exc.reply.error_message, ERROR_TEXT_LEN)
        if is_unknown_type_reply(exc.reply):
            raise UnsupportedMessage(f"{who} does not know the message {what} (its SDK answers: {error})") from exc
        raise ExecutorRefused(f"{what}: {error}") from exc
    except WireError as exc:
        raise ExecutorBadReply(f"{who} sent a bad {what} reply: {clean_text(str(exc), ERROR_TEXT_LEN)}") from exc
