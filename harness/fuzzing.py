"""A scriptable executor for protocol fuzzing: it sends exactly the frames it is given.

A frame is written as a *draft*: a JSON-like tree whose leaves may be
:class:`Raw` (JSON text put in verbatim: ``NaN``, an integer of thousands of
digits, nesting too deep to build as Python objects), :class:`Repeat` (a long
string that prints short) or :data:`ECHO` (the ``request_id`` of the request
being answered, known only once Relay has sent it). A whole frame may also be
:class:`Text` (any text), :class:`Binary`, or a draft :class:`AsBinary`,
:class:`Cut` short, or :class:`Sized` to a byte count. :func:`render` turns a
draft into the text or bytes that go on the wire.

:class:`FuzzingExecutor` is one socket to Relay: it receives Relay's requests,
sends rendered frames, and says how the socket ended (:class:`Ending`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from harness.keys import CONDUCTOR_KEYS


class Echo:
    """Stands for the request id of the request being answered; see :func:`render`."""

    def __repr__(self) -> str:
        return "ECHO"


ECHO = Echo()


class _Short:
    """Printed by its short ``repr``, by hypothesis too (it prints dataclasses field by field)."""

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


@dataclass(frozen=True)
class Raw(_Short):
    """JSON text written as is: ``Raw("NaN")``, ``Raw("1" * 5000)``, ``Raw("[" * 10**5)``."""

    text: str

    def __repr__(self) -> str:
        return f"Raw({_short(self.text)})"


@dataclass(frozen=True)
class Repeat(_Short):
    """``length`` characters of ``unit`` over and over: a long string that prints short."""

    unit: str
    length: int

    def text(self) -> str:
        return (self.unit * (self.length // len(self.unit) + 1))[: self.length]

    def __repr__(self) -> str:
        return f"Repeat({self.unit!r}, {self.length})"


@dataclass(frozen=True)
class Text(_Short):
    """A text frame holding any text at all, JSON or not (no lone surrogates: they cannot be sent)."""

    text: str

    def __repr__(self) -> str:
        return f"Text({_short(self.text)})"


@dataclass(frozen=True)
class Binary(_Short):
    """A binary frame."""

    data: bytes

    def __repr__(self) -> str:
        return f"Binary({self.data[:60]!r}{'' if len(self.data) <= 60 else f'...<{len(self.data)} bytes>'})"


@dataclass(frozen=True)
class AsBinary:
    """Draft ``frame`` rendered, then sent as a binary frame of its UTF-8 bytes."""

    frame: Any


@dataclass(frozen=True)
class Cut:
    """Draft ``frame`` rendered, then cut to its first ``keep`` fraction (broken JSON)."""

    frame: Any
    keep: float


@dataclass(frozen=True)
class Sized:
    """Draft object ``frame`` padded with an unknown key to exactly ``size`` bytes of UTF-8,
    or left as it is if it is larger already."""

    frame: Mapping[str, Any]
    size: int


def _short(text: str) -> str:
    return repr(text) if len(text) <= 60 else f"{text[:40]!r}...<{len(text)} chars>"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _string(text: str, ascii_only: bool) -> str:
    # A lone surrogate cannot be sent as UTF-8: it can only travel as a \\udXXX escape.
    return json.dumps(text, ensure_ascii=ascii_only or _SURROGATE.search(text) is not None)


def render_json(value: Any, request_id: str, ascii_only: bool = False) -> str:
    """The JSON text of draft ``value``, :data:`ECHO` standing for ``request_id``."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Echo):
        return _string(request_id, ascii_only)
    if isinstance(value, Repeat):
        return _string(value.text(), ascii_only)
    if isinstance(value, str):
        return _string(value, ascii_only)
    if isinstance(value, Mapping):
        items = (f"{_string(str(k), ascii_only)}: {render_json(v, request_id, ascii_only)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render_json(v, request_id, ascii_only) for v in value) + "]"
    return json.dumps(value)  # None, bool, int, float (a huge integer is a Raw: str() refuses it)


def render(frame: Any, request_id: str) -> str | bytes:
    """What goes on the wire for ``frame``: see the module's docstring."""
    if isinstance(frame, Text):
        return frame.text
    if isinstance(frame, Binary):
        return frame.data
    if isinstance(frame, AsBinary):
        return render_json(frame.frame, request_id, ascii_only=True).encode()
    if isinstance(frame, Cut):
        text = render_json(frame.frame, request_id)
        return text[: int(len(text) * frame.keep)]
    if isinstance(frame, Sized):
        padded = {**frame.frame, "~pad": ""}
        missing = frame.size - wire_size(render_json(padded, request_id))
        if missing > 0:
            padded["~pad"] = Repeat("x", missing)
        return render_json(padded, request_id)
    return render_json(frame, request_id)


def wire_size(data: str | bytes) -> int:
    """The payload length of a frame, as a server's size limit counts it."""
    return len(data.encode()) if isinstance(data, str) else len(data)


@dataclass(frozen=True)
class Ending:
    """How a fuzzing socket stands after an example: still open, or closed with ``code``."""

    open: bool
    code: int | None = None

    def __str__(self) -> str:
        return "open" if self.open else f"closed {self.code}"


# How long a closing handshake may take once begun (websockets' own close_timeout is 10 s).
CLOSING_SECS = 10.0


def websocket_url(port: int, org: str = "acme", app: str = "ledger") -> str:
    return f"ws://127.0.0.1:{port}/websocket/{app}/{CONDUCTOR_KEYS[org]}"


class FuzzingExecutor:
    """One socket to Relay with the valid conductor key, driven frame by frame by a test."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.passed_over: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, url: str) -> FuzzingExecutor:
        # No keepalive of its own (Relay pings; the library answers), no size limit on what
        # Relay sends, no compression (Relay does not offer it).
        ws = await connect(url, ping_interval=None, open_timeout=10, max_size=None, compression=None)
        return cls(ws)

    async def next_request(self, message_type: str, timeout: float) -> dict[str, Any]:
        """Relay's next request of ``message_type``, decoded (requests of other types are kept
        in :attr:`passed_over`); fails if none comes within ``timeout``."""
        async with asyncio.timeout(timeout):
            while True:
                text = await self.ws.recv()
                frame = json.loads(text)
                assert isinstance(frame, dict) and isinstance(frame.get("request_id"), str), f"not a request: {text!r}"
                if frame.get("type") == message_type:
                    return frame
                self.passed_over.append(frame)

    async def send(self, frames: Sequence[str | bytes]) -> int:
        """Send each rendered frame; returns how many went out before the socket was closed."""
        for sent, data in enumerate(frames):
            try:
                await self.ws.send(data)
            except ConnectionClosed:
                return sent
        return len(frames)

    async def ending(self, timeout: float) -> Ending:
        """Waits up to ``timeout`` for Relay to close the socket; an open socket is reported open.
        One already closing is waited for until it is closed (and has its close code)."""
        if self.ws.state is not State.CLOSED:
            try:
                await asyncio.wait_for(asyncio.shield(self.ws.wait_closed()), timeout)
            except TimeoutError:
                if self.ws.state is State.OPEN:
                    return Ending(open=True)
                await asyncio.wait_for(self.ws.wait_closed(), CLOSING_SECS)
        return Ending(open=False, code=self.ws.close_code)

    def is_open(self) -> bool:
        return self.ws.state is State.OPEN

    async def close(self) -> None:
        await self.ws.close()
