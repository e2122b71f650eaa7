"""What Relay must do with the frames a fuzzing executor sends.

The oracle reads each frame as Relay's documented behaviour says it will (``expect_handshake``,
``expect_answer``), with relay_protocol itself deciding what is a well-formed reply.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from harness.fuzzing import Ending, wire_size
from relay_protocol import ExecutorInfoReply, ListWorkflowsReply, ProtocolError, decode_frame, parse_reply

MAX_FRAME_BYTES = 2**20  # Relay's maxFrameBytes in the fuzz config: a larger frame closes the socket (1009)

CLOSE_BAD_HANDSHAKE = 4400
CLOSE_HANDSHAKE_TIMEOUT = 4408
CLOSE_TOO_BIG = 1009
# A frame too big is refused while the executor is still sending it: the server closes the TCP
# connection with unread data in it, which resets it, and the close frame may be lost on the way.
CLOSE_LOST = 1006


@dataclass(frozen=True)
class Expected:
    """How an example must end: the socket open (``close`` None) or closed with ``close``;
    for a handshake, the executor it accepted; for a request, the API's status and the reply."""

    close: int | None = None
    accepted: ExecutorInfoReply | None = None
    status: int | None = None
    reply: ListWorkflowsReply | None = None


def frame_of(data: str | bytes) -> dict[str, Any] | None:
    """The frame Relay reads from ``data``; None for a binary or malformed one, which is never a reply."""
    if isinstance(data, bytes):
        return None
    try:
        return decode_frame(data)
    except ProtocolError:
        return None


def too_big(data: str | bytes) -> bool:
    return wire_size(data) > MAX_FRAME_BYTES


def outcomes(wire: Sequence[str | bytes], oracle: Callable[[Sequence[str | bytes]], Expected]) -> list[Expected]:
    """What Relay may make of frames sent back to back. A frame too big is refused as soon as its
    header is read, and the server (uvicorn) then drops the frames read in the same chunk before
    it: any prefix of the frames before it may have been seen."""
    big = next((i for i, data in enumerate(wire) if too_big(data)), None)
    if big is None:
        return [oracle(wire)]
    return [oracle([*wire[:seen], wire[big]]) for seen in range(big + 1)]


def expect_handshake(wire: Sequence[str | bytes], request_id: str) -> Expected:
    """During the handshake a frame too big closes the socket (1009); a binary or malformed one,
    or a bad reply to ``executor_info``, ends it (4400); a reply to another request is passed
    over; no reply at all ends it at the handshake timeout (4408)."""
    for data in wire:
        if too_big(data):
            return Expected(close=CLOSE_TOO_BIG)
        frame = frame_of(data)
        if frame is None:
            return Expected(close=CLOSE_BAD_HANDSHAKE)
        if frame["request_id"] != request_id:
            continue
        try:
            info = parse_reply(frame, ExecutorInfoReply, request_id=request_id)
        except ProtocolError:
            return Expected(close=CLOSE_BAD_HANDSHAKE)
        if info.error_message:
            return Expected(close=CLOSE_BAD_HANDSHAKE)
        return Expected(accepted=info)
    return Expected(close=CLOSE_HANDSHAKE_TIMEOUT)


def expect_answer(wire: Sequence[str | bytes], request_id: str) -> Expected:
    """After the handshake a frame too big closes the socket (1009), failing a request still out
    (502); binary and malformed frames and replies to other requests are ignored; the first
    reply to the request decides: a well-formed one without an error is 200, anything else 502;
    none at all is 504 at the timeout."""
    status: int | None = None
    answer: ListWorkflowsReply | None = None
    for data in wire:
        if too_big(data):
            return Expected(close=CLOSE_TOO_BIG, status=status or 502, reply=answer)
        frame = None if status is not None else frame_of(data)
        if frame is None or frame["request_id"] != request_id:
            continue
        try:
            answer = parse_reply(frame, ListWorkflowsReply, request_id=request_id)
        except ProtocolError:
            status = 502
            continue
        status = 502 if answer.error_message else 200
        answer = answer if status == 200 else None
    return Expected(status=status or 504, reply=answer)


def ends_as(ending: Ending, close: int | None) -> bool:
    """Whether the socket ended as expected: open for None, else closed with ``close``."""
    if close is None:
        return ending.open
    return not ending.open and (ending.code == close or (close == CLOSE_TOO_BIG and ending.code == CLOSE_LOST))


def same_json(stored: Any, sent: Any) -> bool:
    """Whether JSON value ``stored`` (read back from jsonb) is ``sent``: jsonb keeps numbers as
    numeric, so a float may come back as an integer of the same value."""
    if isinstance(sent, dict):
        return (
            isinstance(stored, dict)
            and stored.keys() == sent.keys()
            and all(same_json(stored[k], v) for k, v in sent.items())
        )
    if isinstance(sent, list):
        return isinstance(stored, list) and len(stored) == len(sent) and all(map(same_json, stored, sent))
    if isinstance(sent, bool) or sent is None or isinstance(sent, str):
        return type(stored) is type(sent) and stored == sent
    if isinstance(stored, bool) or not isinstance(stored, (int, float)):
        return False
    if isinstance(sent, int) and isinstance(stored, int):
        return stored == sent
    return math.isclose(float(stored), float(sent), rel_tol=1e-15, abs_tol=1e-300)


# Relay's own lines are "<date> <time> LEVEL logger: message"; DBOS's are "... [   LEVEL] (...)".
LOG_PROBLEM = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (ERROR|CRITICAL) |\[\s*(ERROR|CRITICAL)\]|Traceback|Exception in ASGI"
)

SURROGATE = re.compile("[\ud800-\udfff]")
