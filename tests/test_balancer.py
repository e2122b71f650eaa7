"""The test load balancer (harness/balancer.py) against real sockets."""

from __future__ import annotations

import collections
import logging
import socket
import socketserver
import threading
import time
from types import TracebackType

import pytest

from harness.balancer import TcpBalancer
from harness.proxy import TcpProxy
from harness.waiting import assert_eventually


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        backend = self.server.backend
        try:
            first = self.rfile.readline()
            if first.startswith(b"GET /readyz"):
                while self.rfile.readline() not in (b"\r\n", b""):
                    pass  # read the whole request before answering and closing
                status = b"503 Service Unavailable" if backend.unready else b"200 OK"
                self.wfile.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            line = first
            while line:
                self.wfile.write(backend.name + b":" + line)
                line = self.rfile.readline()
        except OSError:
            pass  # the balancer aborted the connection


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        super().__init__(("127.0.0.1", 0), _Handler)


class Backend:
    """Answers ``GET /readyz`` with 200 (503 while ``unready``); echoes lines prefixed with its name."""

    def __init__(self, name: str) -> None:
        self.name = name.encode()
        self.unready = False
        self._server = _Server(self)
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self.stopped = False

    def stop(self) -> None:
        """Close the listening socket: connecting to the port is refused from now on."""
        if not self.stopped:
            self.stopped = True
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.stop()


class Client:
    """One connection through the balancer; ``ask`` sends a line and returns the echo."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=2)

    def ask(self, text: str = "hi") -> str:
        self.sock.sendall(text.encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed by the balancer")
            data += chunk
        return data.decode()

    def backend(self) -> str:
        return self.ask().split(":")[0]

    def is_cut(self) -> bool:
        try:
            self.sock.settimeout(0.05)
            return self.sock.recv(4096) == b""
        except TimeoutError:
            return False
        except ConnectionError:
            return True
        finally:
            self.sock.settimeout(2)

    def close(self) -> None:
        self.sock.close()


def balance(*backends: Backend | tuple[str, int], health_path: str | None = "/readyz") -> TcpBalancer:
    """A balancer with frequent health checks, so the whole file runs in seconds. Each check (and
    connection) waits up to a second: the backends answer from threads of this process, and under
    CI's load a 0.2 s wait marked every backend down at once, and a client's connection was aborted."""
    addresses = [b.address if isinstance(b, Backend) else b for b in backends]
    return TcpBalancer(addresses, health_path=health_path, check_interval=0.05, check_timeout=1.0)


def served_by(port: int, count: int) -> list[str]:
    names = []
    for _ in range(count):
        client = Client(port)
        try:
            names.append(client.backend())
        finally:
            client.close()
    return names


def test_round_robin_spreads_connections_evenly() -> None:
    with Backend("b0") as b0, Backend("b1") as b1, Backend("b2") as b2:
        with balance(b0, b1, b2) as balancer:
            names = served_by(balancer.port, 6)
            assert collections.Counter(names) == {"b0": 2, "b1": 2, "b2": 2}
            assert names[:3] == ["b0", "b1", "b2"]
            assert balancer.connections == [2, 2, 2]
            assert_eventually(lambda: balancer.open_pairs() == 0, 5, what="pairs closed")
        assert not balancer._thread.is_alive()


@pytest.mark.parametrize("health_path", ["/readyz", None])
def test_stopped_backend_is_skipped(health_path: str | None) -> None:
    with Backend("b0") as b0, Backend("b1") as b1, Backend("b2") as b2:
        with balance(b0, b1, b2, health_path=health_path) as balancer:
            b1.stop()
            names = served_by(balancer.port, 6)
            assert set(names) == {"b0", "b2"}
            assert balancer.connections[1] == 0
            if health_path is None:
                assert balancer.up == [True, True, True]
            else:
                assert_eventually(lambda: balancer.up == [True, False, True], 5, what="b1 marked down")


def test_all_backends_unreachable_aborts_client() -> None:
    with Backend("b0") as b0:
        with balance(b0, health_path=None) as balancer:
            b0.stop()
            client = Client(balancer.port)
            try:
                with pytest.raises(ConnectionError):
                    client.ask()
            finally:
                client.close()
            assert balancer.connections == [0]


def test_unready_backend_is_skipped_until_ready_again() -> None:
    with Backend("b0") as b0, Backend("b1") as b1, Backend("b2") as b2:
        with balance(b0, b1, b2) as balancer:
            # A connection already open to b1 survives b1 going down.
            clients = [Client(balancer.port) for _ in range(3)]
            try:
                assert [c.backend() for c in clients] == ["b0", "b1", "b2"]
                b1.unready = True
                assert_eventually(lambda: balancer.up == [True, False, True], 5, what="b1 marked down")
                assert set(served_by(balancer.port, 4)) == {"b0", "b2"}
                assert clients[1].ask("still") == "b1:still\n"
                assert balancer.open_pairs(1) == 1

                b1.unready = False
                assert_eventually(lambda: all(balancer.up), 5, what="b1 marked up again")
                assert "b1" in served_by(balancer.port, 3)
            finally:
                for client in clients:
                    client.close()


def test_backend_that_never_answers_is_marked_down() -> None:
    # Like a SIGSTOPped server: the kernel completes the handshake, nobody ever answers.
    with Backend("b0") as b0, socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        with balance(b0, silent.getsockname()) as balancer:
            assert_eventually(lambda: balancer.up == [True, False], 5, what="silent backend marked down")
            assert set(served_by(balancer.port, 4)) == {"b0"}
            assert balancer.connections == [4, 0]
            assert balancer.up == [True, False]


def test_cut_aborts_only_pairs_to_that_backend() -> None:
    with Backend("b0") as b0, Backend("b1") as b1, Backend("b2") as b2:
        with balance(b0, b1, b2) as balancer:
            clients = [Client(balancer.port) for _ in range(6)]
            try:
                names = [c.backend() for c in clients]
                assert collections.Counter(names) == {"b0": 2, "b1": 2, "b2": 2}
                assert balancer.open_pairs() == 6

                balancer.cut(1)
                assert balancer.open_pairs(1) == 0
                assert balancer.open_pairs() == 4
                for client, name in zip(clients, names, strict=True):
                    if name == "b1":
                        assert_eventually(client.is_cut, 5, what="pair to b1 aborted")
                    else:
                        assert not client.is_cut()
                        assert client.ask("after") == f"{name}:after\n"
                # New connections may go to b1 again: it is still up.
                assert "b1" in served_by(balancer.port, 3)

                balancer.cut()
                assert balancer.open_pairs() == 0
                for client in clients:
                    assert_eventually(client.is_cut, 5, what="every pair aborted")
            finally:
                for client in clients:
                    client.close()


def asyncio_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]


def test_closing_the_balancer_with_pairs_open_reports_no_error(caplog: pytest.LogCaptureFixture) -> None:
    # Closing cancels the connections' handlers. On Python 3.11, asyncio.start_server's callback
    # reported a handler that ended cancelled as "Exception in callback ... CancelledError".
    caplog.set_level(logging.ERROR, logger="asyncio")
    with Backend("b0") as b0:
        with balance(b0) as balancer:
            clients = [Client(balancer.port) for _ in range(4)]
            assert [c.backend() for c in clients] == ["b0"] * 4
        for client in clients:
            assert_eventually(client.is_cut, 5, what="every pair closed")
            client.close()
    assert asyncio_errors(caplog) == []


def test_closing_the_proxy_while_it_connects_reports_no_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    # A target whose accept queue is full: the proxy's connection to it waits until the close.
    with socket.socket() as target:
        target.bind(("127.0.0.1", 0))
        target.listen(0)
        fillers = []
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(target.getsockname())
            fillers.append(filler)
        try:
            with TcpProxy(target.getsockname()) as proxy, socket.create_connection(("127.0.0.1", proxy.port)):
                time.sleep(0.2)
                assert proxy.open_pairs == 0  # still connecting
        finally:
            for filler in fillers:
                filler.close()
    assert asyncio_errors(caplog) == []
