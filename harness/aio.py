"""What the harness's asyncio servers share."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable

Handle = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def connection_handler(handle: Handle) -> Handle:
    """``handle`` as ``asyncio.start_server``'s callback, ending normally when it is cancelled.

    The harness's servers cancel their connections' handlers when they close. Python 3.11's
    ``start_server`` then calls ``task.exception()`` on each, which raises for a cancelled task
    and prints "Exception in callback ... CancelledError" (3.12 checks for cancellation first).
    """

    @functools.wraps(handle)
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await handle(reader, writer)

    return handler
