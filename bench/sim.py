"""Simulated executors for the load benchmarks: many in one process, each on its own socket.

They speak the conductor protocol as the DBOS SDK does, and nothing more: they answer
``executor_info`` (harness.simulated.handshake), answer ``recovery`` with success and
``exist_pending_workflows`` with ``exist: false`` (they hold no workflows), and answer any
other request with an error. With ``reconnect`` on, one whose socket closes under it
connects again with the same ``executor_id`` after ``reconnect_delay`` seconds, as the
SDK does after a network blip; ``kill()`` ends one as if its process died.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from bench.common import BenchError
from harness.simulated import handshake

SDK_RECONNECT_SECS = 1.0  # the DBOS SDK's pause before it reconnects
OPEN_ATTEMPTS = 3
CONNECT_ERRORS = (OSError, TimeoutError, WebSocketException)


async def open_socket(url: str, executor_id: str | None = None) -> tuple[ClientConnection, str]:
    ws = await connect(url, ping_interval=None, proxy=None, max_size=None, open_timeout=60)
    try:
        async with asyncio.timeout(60):
            return ws, await handshake(ws, executor_id)
    except BaseException:
        ws.transport.abort()
        raise


@dataclass
class SimExecutor:
    """A protocol-correct executor on one socket: it recovers whatever it is asked to."""

    executor_id: str
    ws: ClientConnection
    recoveries: list[tuple[float, list[str]]] = field(default_factory=list)
    others: Counter[str] = field(default_factory=Counter)
    task: asyncio.Task[None] | None = None
    url: str | None = None  # reconnect here when the socket closes (None: never reconnect)
    reconnect_delay: float = SDK_RECONNECT_SECS
    killed: bool = False
    reconnects: list[float] = field(default_factory=list)  # when each reconnect's handshake was answered
    reconnect_errors: Counter[str] = field(default_factory=Counter)

    def kill(self) -> None:
        """As if the process died: the socket is aborted (no close frame) and never reopened."""
        self.killed = True
        self.ws.transport.abort()

    async def serve(self) -> None:
        while True:
            with contextlib.suppress(ConnectionClosed):
                async for frame in self.ws:
                    await self.ws.send(json.dumps(self.answer(json.loads(frame))))
            if self.url is None or self.killed or not await self.reconnect(self.url):
                return

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        kind = request.get("type")
        reply: dict[str, Any] = {"type": kind, "request_id": request.get("request_id")}
        if kind == "recovery":
            self.recoveries.append((time.time(), [str(e) for e in request.get("executor_ids") or []]))
            reply["success"] = True
        elif kind == "exist_pending_workflows":
            reply["exist"] = False
        else:
            self.others[str(kind)] += 1
            reply["error_message"] = f"{kind} is not supported by the simulated executor"
        return reply

    async def reconnect(self, url: str) -> bool:
        """Connect again with the same id until it works or the executor is killed."""
        while not self.killed:
            await asyncio.sleep(self.reconnect_delay)
            try:
                ws, _ = await open_socket(url, self.executor_id)
            except CONNECT_ERRORS as exc:
                self.reconnect_errors[type(exc).__name__] += 1
                continue
            if self.killed:
                ws.transport.abort()
                return False
            self.ws = ws
            self.reconnects.append(time.time())
            return True
        return False


async def open_fleet(url: str, n: int, concurrency: int, reconnect: bool = False) -> list[SimExecutor]:
    """``n`` simulated executors, ``concurrency`` handshakes at a time; each that fails is tried again."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> SimExecutor:
        async with gate:
            for attempt in range(OPEN_ATTEMPTS):
                try:
                    ws, executor_id = await open_socket(url)
                    break
                except CONNECT_ERRORS as exc:
                    if attempt == OPEN_ATTEMPTS - 1:
                        raise BenchError(
                            f"a simulated executor could not connect: {type(exc).__name__}: {exc}"
                        ) from exc
                    await asyncio.sleep(SDK_RECONNECT_SECS)
        sim = SimExecutor(executor_id, ws, url=url if reconnect else None)
        sim.task = asyncio.create_task(sim.serve())
        return sim

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def kill_all(fleet: list[SimExecutor]) -> None:
    for sim in fleet:
        sim.kill()
    await asyncio.gather(*(s.task for s in fleet if s.task is not None), return_exceptions=True)
