"""A TCP proxy between executors and Relay that the test controls.

``cut()`` drops every connection open through it (both sides), as a network
failure would; new connections are accepted as before. ``partition()`` also
refuses new ones until ``heal()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType

from harness.aio import connection_handler


class TcpProxy:
    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self.host = host
        self.port = 0
        self.partitioned = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._pairs = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def open_pairs(self) -> int:
        return self._pairs

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(connection_handler(self._handle), self.host, 0), self._loop
        ).result()
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.cut()
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        asyncio.run_coroutine_threadsafe(self._finish_pairs(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def cut(self) -> None:
        async def drop() -> None:
            for writer in list(self._writers):
                writer.transport.abort()

        asyncio.run_coroutine_threadsafe(drop(), self._loop).result()

    async def _finish_pairs(self) -> None:
        """Let every connection's task end before the loop stops (no task destroyed pending)."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def partition(self) -> None:
        self.partitioned = True
        self.cut()

    def heal(self) -> None:
        self.partitioned = False

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            await self._serve(client_r, client_w)
        finally:  # also when cancelled at close while connecting to the target
            client_w.transport.abort()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.partitioned:
            return
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            return
        if self.partitioned:  # cut while it connected: the cut did not see this pair
            server_w.transport.abort()
            return
        self._writers |= {client_w, server_w}
        self._pairs += 1
        try:
            await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w))
        finally:
            self._pairs -= 1
            for w in (client_w, server_w):
                self._writers.discard(w)
                w.transport.abort()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
