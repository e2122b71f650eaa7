"""uvicorn's HTTP protocol (httptools) with a deadline and a size limit on request headers.

uvicorn waits for request headers as long as a client cares to send them: a
client that sends ``GET / HTTP/1.1\\r\\nHost: x\\r\\n`` and then nothing holds a
connection forever (slowloris), and one that sends an endless header makes it
grow without bound. This subclass closes a connection whose request headers
are not complete ``header_timeout_secs`` after it opened (with 408 if the client
had begun a request), or after the request began on a kept-alive connection
(408), and answers 431 to headers over :data:`MAX_HEADER_BYTES`; a request that
cannot be parsed is answered 400 as those are, a problem with its request id. An idle
kept-alive connection is uvicorn's (``timeout_keep_alive``: ``server.keepAliveSecs``).

At shutdown, uvicorn lets requests in progress finish before the application's
own shutdown; an event stream (the console's live updates) never finishes by
itself, so its connection is closed (the console opens a new stream elsewhere).
An event stream whose reader takes nothing (its socket's buffers full) for
``stream_stall_secs`` is cut off: otherwise the write waits for as long as the
client stays connected, and the stream keeps its place among its key's and the
instance's (``server.maxEventStreamsPerKey``, ``server.maxEventStreams``).

The deadline ends with the headers: a WebSocket handshake is handed over to
:class:`relay.net.wsproto.RelayWebSocketProtocol` once they are read, and a
request body is the guard's business (:mod:`relay.net.guard`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from relay.core.requestid import HEADER, new_request_id, serving
from relay.problem import PROBLEM_JSON, problem

log = logging.getLogger("relay.http")

# Request line and headers together; uvicorn's h11 protocol allows 16 KiB, nginx 32 KiB.
MAX_HEADER_BYTES = 64 * 1024
# The console's event streams (relay/api/events.py), under /v2 or /conductor/v2.
EVENT_STREAM = re.compile(r"^(/conductor)?/v2/orgs/[^/]+/events$")


class RelayHttpProtocol(HttpToolsProtocol):
    header_timeout_secs = 10.0
    stream_stall_secs = 47.0  # three heartbeats and 2 s: when a console takes a silent stream for lost

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._stall_deadline: asyncio.TimerHandle | None = None
        self._in_headers = False  # a request has begun and its headers are not complete
        self._header_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        self._cancel_stall_deadline()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        cycle = self.cycle
        if cycle is not None and self._stall_deadline is None and EVENT_STREAM.match(cycle.scope["path"]):
            self._stall_deadline = self.loop.call_later(self.stream_stall_secs, self._stream_stalled)

    def resume_writing(self) -> None:
        self._cancel_stall_deadline()
        super().resume_writing()

    def data_received(self, data: bytes) -> None:
        already_in_headers = self._in_headers
        super().data_received(data)
        if self._in_headers and already_in_headers:
            # Only chunks wholly inside the headers are counted: one that began the request
            # may also hold the end of the previous one. The bound stays finite either way.
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                log.debug("closed a connection from %s: request headers over %d bytes", self.client, MAX_HEADER_BYTES)
                self._refuse(431, f"request headers over {MAX_HEADER_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._header_bytes = 0
        if self._header_deadline is None and not self._responding():
            self._arm_header_deadline()  # a request after an earlier one: its own deadline

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._cancel_header_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A request pipelined behind this response, its headers still coming: its deadline
        # starts now (a 408 in the middle of the response before it would garble that).
        if self._in_headers and self._header_deadline is None and not self.transport.is_closing():
            self._arm_header_deadline()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to bytes httptools cannot parse (a bad request line, a header without a
        # colon, a bad chunk): text/plain, without X-Request-Id. Relay's answers are problems.
        self._refuse(400, "not a valid HTTP/1.1 request: its request line, a header or its chunked body is malformed")

    def shutdown(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and EVENT_STREAM.match(cycle.scope["path"]):
            self.transport.close()  # the stream's receive() now answers http.disconnect
            return
        super().shutdown()

    # -- internals ---------------------------------------------------------

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_secs, self._headers_too_slow)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _cancel_stall_deadline(self) -> None:
        if self._stall_deadline is not None:
            self._stall_deadline.cancel()
            self._stall_deadline = None

    def _stream_stalled(self) -> None:
        self._stall_deadline = None
        log.info("closed the event stream to %s: it took nothing for %gs", self.client, self.stream_stall_secs)
        # Not close(), which would wait to send what the buffer holds, to a reader that takes nothing.
        self.transport.abort()

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing():
            return
        log.debug("closed a connection from %s: no request headers within %gs", self.client, self.header_timeout_secs)
        if self._in_headers:
            self._refuse(408, f"request headers not complete within {self.header_timeout_secs:g}s")
        else:
            self.transport.close()  # idle: nothing was asked, nothing to answer

    def _refuse(self, status: int, detail: str) -> None:
        """Answer with a problem (RFC 9457) and close the connection: the request was not read whole."""
        request_id = new_request_id()  # the headers did not come whole: none of the client's is read
        with serving(request_id):
            response = problem(status, detail)
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: {PROBLEM_JSON}\r\n"
            f"content-length: {len(response.body)}\r\n{HEADER.lower()}: {request_id}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + bytes(response.body))
        self.transport.close()
