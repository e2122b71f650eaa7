"""A TCP load balancer that puts several Relay instances behind one port.

Tests and the chaos harness use it the way production puts a load balancer in
front of a Relay cluster: executors connect to ``127.0.0.1:<port>`` over
WebSocket and the balancer just copies bytes to one of the backends.

- Each new client connection goes to the next backend in round-robin order,
  skipping backends marked down; if connecting to it fails (refused, or not
  established within ``check_timeout``) the next one is tried, and if none
  works the client connection is aborted.
- Unless ``health_path`` is ``None``, a background task does a raw
  ``GET <health_path>`` on every backend each ``check_interval`` seconds.
  Only a ``200`` answer within ``check_timeout`` counts as up; a refused
  connection, a timeout (e.g. a SIGSTOPped process, whose kernel still accepts
  connections but never answers) or any other status marks it down. All
  backends count as up until the first check says otherwise.
- As with a default HAProxy, connections already open to a backend that goes
  down are left alone; ``cut()`` aborts them (all, or one backend's) when a
  test wants a network failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from types import TracebackType

from harness.aio import connection_handler


@dataclass(eq=False)
class _Pair:
    """One client connection and the backend connection it was given."""

    backend: int
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter

    def abort(self) -> None:
        self.client.transport.abort()
        self.server.transport.abort()


class TcpBalancer:
    def __init__(
        self,
        backends: list[tuple[str, int]],
        host: str = "127.0.0.1",
        health_path: str | None = "/readyz",
        check_interval: float = 0.25,
        check_timeout: float = 0.5,
        port: int = 0,
        reuse_port: bool = False,
    ) -> None:
        if not backends:
            raise ValueError("TcpBalancer needs at least one backend")
        self.backends = list(backends)
        self.host = host
        self.port = port
        # Several balancer processes may listen on one port (SO_REUSEPORT; the kernel spreads
        # new connections over them), as a benchmark does when one process cannot hold enough
        # sockets under its open-file limit.
        self.reuse_port = reuse_port
        self.health_path = health_path
        self.check_interval = check_interval
        self.check_timeout = check_timeout
        # Mutated only on the balancer's loop; other threads read copies.
        self._up = [True] * len(self.backends)
        self._connections = [0] * len(self.backends)
        self._open = [0] * len(self.backends)
        self._pairs: set[_Pair] = set()
        self._next = 0
        self._closing = False
        self._handlers: set[asyncio.Task[None]] = set()
        self._checker: asyncio.Task[None] | None = None
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def up(self) -> list[bool]:
        """Current health of each backend (a copy)."""
        return list(self._up)

    @property
    def connections(self) -> list[int]:
        """How many client connections were sent to each backend in total (a copy)."""
        return list(self._connections)

    def open_pairs(self, backend_index: int | None = None) -> int:
        """Client connections currently open through the balancer (to one backend, or to all)."""
        if backend_index is None:
            return sum(self._open)
        return self._open[backend_index]

    def __enter__(self) -> TcpBalancer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop.close()

    def cut(self, backend_index: int | None = None) -> None:
        """Abort the open pairs (both sides), all of them or only those to one backend."""
        if backend_index is not None and not 0 <= backend_index < len(self.backends):
            raise IndexError(f"no backend {backend_index}")
        if not self._thread.is_alive():
            return

        async def drop() -> None:
            self._drop(backend_index)

        asyncio.run_coroutine_threadsafe(drop(), self._loop).result()

    # Everything below runs on the balancer's loop.

    async def _start(self) -> None:
        self._server = await asyncio.start_server(
            connection_handler(self._handle), self.host, self.port, reuse_port=self.reuse_port
        )
        self.port = self._server.sockets[0].getsockname()[1]
        if self.health_path is not None:
            self._checker = asyncio.create_task(self._check_forever(self.health_path))

    async def _shutdown(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        self._drop(None)
        tasks = [*self._handlers, *([self._checker] if self._checker is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Let the aborted transports' connection_lost callbacks close their sockets.
        for _ in range(3):
            await asyncio.sleep(0)

    def _drop(self, backend_index: int | None) -> None:
        for pair in list(self._pairs):
            if backend_index is None or pair.backend == backend_index:
                self._release(pair)

    def _release(self, pair: _Pair) -> None:
        if pair in self._pairs:
            self._pairs.discard(pair)
            self._open[pair.backend] -= 1
        pair.abort()

    async def _connect(self) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter] | None:
        count = len(self.backends)
        start = self._next
        for step in range(count):
            index = (start + step) % count
            if not self._up[index]:
                continue
            self._next = (index + 1) % count
            try:
                async with asyncio.timeout(self.check_timeout):
                    reader, writer = await asyncio.open_connection(*self.backends[index])
            except (OSError, TimeoutError):
                continue
            return index, reader, writer
        return None

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._closing or task is None:
            client_w.transport.abort()
            return
        self._handlers.add(task)
        try:
            connected = await self._connect()
            if connected is None:
                client_w.transport.abort()
                return
            index, server_r, server_w = connected
            pair = _Pair(index, client_w, server_w)
            self._pairs.add(pair)
            self._open[index] += 1
            self._connections[index] += 1
            try:
                await asyncio.gather(self._pipe(client_r, server_w, pair), self._pipe(server_r, client_w, pair))
            finally:
                self._release(pair)
        finally:
            client_w.transport.abort()
            self._handlers.discard(task)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pair: _Pair) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        pair.abort()

    async def _check_forever(self, path: str) -> None:
        request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            # In parallel, so that one backend that never answers does not delay the others' checks.
            results = await asyncio.gather(*(self._probe(backend, request) for backend in self.backends))
            for index, healthy in enumerate(results):
                self._up[index] = healthy
            await asyncio.sleep(max(0.0, started + self.check_interval - loop.time()))

    async def _probe(self, backend: tuple[str, int], request: bytes) -> bool:
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.check_timeout):
                reader, writer = await asyncio.open_connection(*backend)
                writer.write(request)
                await writer.drain()
                status_line = await reader.readline()
        except (OSError, TimeoutError, ValueError):
            return False
        finally:
            if writer is not None:
                writer.transport.abort()
        parts = status_line.split()
        return len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1] == b"200"
