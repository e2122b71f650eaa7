"""``GET /v2/orgs/{org}/events``: what changes, as server-sent events, for the console.

The console reads it with ``fetch`` (so that it can send its key in the
``Authorization`` header, which ``EventSource`` cannot) and reads again the page
it shows when a change concerns it. Events::

    event: ready         {"heartbeatSecs"}: the stream is open: read the page now (changes from here on are sent)
    event: executor      {"app", "executorId", "state", "blockedReason", "relayInstance"}
    event: audit         {"id", "at", "app", "action", "executorId", "peerExecutorId"}
    event: end           {"reason"}: the stream ends (shutdown, a slow reader, the key deleted or changed)

and a comment line (``: heartbeat``) every ``server.eventHeartbeatSecs`` when
nothing happens. A deleted executor shows as the audit entry ``executor.deleted``.
Needs ``application.read``; audit events of no app (keys, instances) only with ``organization.read``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from relay.api.common import Caller, Ctx, DecodedRoute
from relay.auth import hash_key
from relay.domain.events import END, Change, EventHub, Stream
from relay.net.guard import bearer_key

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}", tags=["events"])

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),  # a reverse proxy that buffers would hold events back
]


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class EventStreamResponse(Response):
    """Sends the stream's changes until the client leaves or the stream is ended."""

    def __init__(self, hub: EventHub, stream: Stream) -> None:
        super().__init__()
        self.hub = hub
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            pump = asyncio.create_task(self._pump(send))
            watch = asyncio.create_task(_until_disconnect(receive))
            done, pending = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if pump in done and pump.exception() is None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while a write was under way
            pass
        finally:
            self.hub.close(self.stream)

    async def _pump(self, send: Send) -> None:
        stream = self.stream
        # The heartbeat's interval: a reader that hears nothing for a few of them knows the stream is lost.
        ready = sse("ready", {"heartbeatSecs": self.hub.heartbeat_secs})
        await send({"type": "http.response.body", "body": ready, "more_body": True})
        while True:
            try:
                first = await asyncio.wait_for(stream.queue.get(), self.hub.heartbeat_secs)
            except TimeoutError:
                await send({"type": "http.response.body", "body": b": heartbeat\n\n", "more_body": True})
                continue
            batch: list[Change | None] = [first]
            while not stream.queue.empty() and len(batch) < 500:
                batch.append(stream.queue.get_nowait())
            body = b""
            for change in batch:
                if change is END:
                    body += sse("end", {"reason": stream.ended or "ended"})
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    return
                assert change is not None
                body += sse(change.kind, change.data)
            await send({"type": "http.response.body", "body": body, "more_body": True})


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@router.get(
    "/events",
    response_class=Response,
    responses={
        200: {
            "description": "A stream that does not end by itself: `ready`, then `executor` and `audit` events",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    },
)
async def events(org: str, request: Request, ctx: Ctx, who: Caller) -> Response:
    """Server-sent events: executors that change state and new audit entries (see the module)."""
    digest = hash_key(bearer_key(request.headers.get("authorization", "")))
    return EventStreamResponse(ctx.events, ctx.events.open(who, digest))
