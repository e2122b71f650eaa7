"""What Relay must do with the frames a fuzzing executor sends, and the Relay bugs known to
break it.

The oracle reads each frame as Relay's documented behaviour says it will (``expect_handshake``,
``expect_answer``), with relay_protocol itself deciding what is a well-formed reply. The known
bugs are those the xfail tests of test_fuzz_frames.py report; the fuzzing passes over them in
exactly the forms described here so that it goes on finding other problems.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
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

# --- Known Relay bugs ------------------------------------------------------------------------
#
# Each has an xfail test in test_fuzz_frames.py. Passed over in exactly these forms: their log
# lines, and the API's 500 for a reply that carries what sets them off.
_ASGI_TRACEBACK = r".* ERROR uvicorn\.error: Exception in ASGI application\nTraceback \(most recent call last\):\n"
KNOWN_BUGS = [
    # test_a_failed_handshake_logs_no_error
    re.compile(
        r".* ERROR asyncio: Future exception was never retrieved\n"
        r"future: <Future finished exception=ExecutorGone\("
        r"'executor acme/ledger from 127\.0\.0\.1:\d+ disconnected'\)>\n"
        r"relay\.errors\.ExecutorGone: executor acme/ledger from 127\.0\.0\.1:\d+ disconnected\n"
    ),
    # test_a_listed_workflow_with_a_lone_surrogate_is_no_500
    re.compile(
        _ASGI_TRACEBACK + r"(?:  .*\n)+"
        r"pydantic_core\._pydantic_core\.PydanticSerializationError: Error serializing to JSON: "
        r"UnicodeEncodeError: 'utf-8' codec can't encode "
        r"(?:character '\\ud[89a-f][0-9a-f]{2}' in position \d+|characters in position \d+-\d+): "
        r"surrogates not allowed\n"
    ),
    # test_a_listed_workflow_created_far_in_the_future_is_no_500
    re.compile(
        _ASGI_TRACEBACK + r"(?:  .*\n)+"
        r'  File "[^"\n]*relay/api/common\.py", line \d+, in epoch_ms_iso\n(?:  .*\n)+'
        r"OSError: \[Errno 75\] Value too large for defined data type\n"
    ),
]
SURROGATE = re.compile("[\ud800-\udfff]")


def known_listing_bug(answer: ListWorkflowsReply) -> str | None:
    """The known Relay bug that makes the API answer 500 to a listing with this reply, if any."""
    for w in answer.output:
        shown = (w.workflow_id, w.status, w.workflow_name, w.queue_name, w.application_version, w.executor_id)
        if any(value is not None and SURROGATE.search(value) for value in shown):
            return "a lone surrogate in a listed workflow"
        if any(_fromtimestamp_fails(value) for value in (w.created_at, w.updated_at)):
            return "a listed workflow's time out of the platform's range"
    return None


def _fromtimestamp_fails(epoch_ms: str | None) -> bool:
    """Whether Relay's reading of a time (relay.api.common.epoch_ms_iso) meets an OSError, which
    it does not catch."""
    try:
        seconds = int(str(epoch_ms)) / 1000
    except (ValueError, OverflowError):
        return False
    try:
        datetime.fromtimestamp(seconds, UTC)
    except OSError:
        return True
    except (ValueError, OverflowError):
        return False
    return False
