"""A hand-written executor for protocol fuzzing: it says what the test tells it to.

Integration tests of behaviour use the real SDK (executor_app.py); this one
exists to send what a real client never would.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from websockets.asyncio.client import ClientConnection, connect

T = TypeVar("T")


def info_reply(request_id: str, executor_id: str, version: str = "v1") -> str:
    return json.dumps(
        {
            "type": "executor_info",
            "request_id": request_id,
            "executor_id": executor_id,
            "application_version": version,
            "hostname": "simulated",
            "language": "python",
            "dbos_version": "3.2.0",
            "executor_metadata": None,
        }
    )


async def open_socket(url: str, **kwargs: Any) -> ClientConnection:
    return await connect(url, ping_interval=None, open_timeout=10, **kwargs)


async def handshake(ws: ClientConnection, executor_id: str | None = None) -> str:
    """Answer Relay's executor_info; returns the executor id used."""
    request = json.loads(await ws.recv())
    assert request["type"] == "executor_info", request
    executor_id = executor_id or str(uuid.uuid4())
    await ws.send(info_reply(request["request_id"], executor_id))
    return executor_id


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking check (HTTP to Relay, polling) without starving this loop's pongs."""
    return await asyncio.to_thread(fn, *args, **kwargs)
