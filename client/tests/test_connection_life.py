"""A connection's life around the requests it serves: handlers left running by a lost socket, a
stop while one runs, ids across a fork, TLS options.

Relay is played by a real WebSocket server (websockets' own), scripted per connection, as in
test_connect.py; DBOS is real where the client's hooks into it are what is tested.
"""

from __future__ import annotations

import contextvars
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import app
import pytest
from dbos import DBOS
from harness.certificates import make_certificates
from test_connect import FakeRelay, SlowHandlers, eventually
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import Server, ServerConnection, serve

import relay_client
import relay_protocol as p
from relay_client import _internals, lifecycle
from relay_client import connection as connection_module
from relay_client.connection import SHUTTING_DOWN, Connection
from relay_client.handlers import Handlers, Identity

Script = Callable[[ServerConnection, int], None]


class ScriptedRelay:
    """A WebSocket server that runs ``script(ws, n)`` for its n-th connection (from 0)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.close_codes: list[int | None] = []
        self._server: Server = serve(self._handle, "127.0.0.1", 0)
        self.port: int = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _handle(self, ws: ServerConnection) -> None:
        n = self.connections
        self.connections += 1
        try:
            self.script(ws, n)
        except (ConnectionClosed, TimeoutError):
            pass
        self.close_codes.append(ws.close_code)

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(5)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"


def ask_info(ws: ServerConnection, n: int, timeout: float = 10.0) -> bool:
    """Relay's handshake: executor_info, answered within Relay's handshakeTimeoutSecs (10 s by default)."""
    ws.send(json.dumps({"type": "executor_info", "request_id": f"info-{n}"}))
    try:
        reply = json.loads(ws.recv(timeout=timeout))
    except TimeoutError:
        return False
    return reply.get("request_id") == f"info-{n}"


def read_until_closed(ws: ServerConnection) -> None:
    while True:
        ws.recv()


def test_a_handler_left_running_by_a_lost_connection_still_counts_against_max_concurrent_requests() -> None:
    """client/README.md: "the client only answers, up to max_concurrent_requests at once". A request is
    being served (a slow list_workflows, say) when Relay closes the socket (1012, an instance losing its
    lease); the client reconnects and is asked another request. The first handler's thread is still
    running (a thread cannot be cancelled), but cancelling its task gave back its turn: with
    max_concurrent_requests=1, two handlers run at once."""
    handlers = SlowHandlers(Identity(executor_id="r1", application_version="v1"))

    def script(ws: ServerConnection, n: int) -> None:
        assert ask_info(ws, n)
        ws.send(json.dumps({"type": "executor_info", "request_id": f"flood-{n}"}))
        if n == 0:
            eventually(lambda: handlers.began == 1)
            ws.close(1012, "relay instance lost its lease, reconnect")
            return
        read_until_closed(ws)

    relay = ScriptedRelay(script)
    connection = Connection(relay.url, key="k", app="clienttest", handlers=handlers, max_concurrent_requests=1)
    try:
        connection.start()
        eventually(lambda: relay.connections == 2 and connection.connected, timeout=10)
        time.sleep(1.5)  # the second request, had it a turn, would have begun by now
        assert handlers.began == 1, (
            f"{handlers.began} handlers running at once with max_concurrent_requests=1 "
            "(the lost connection's handler thread still runs, its turn was given back)"
        )
    finally:
        handlers.gate.set()
        connection.stop()
        relay.stop()


def test_handlers_left_running_by_lost_connections_starve_the_next_connections_executor_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Relay's socket drops (a restart, a lease lost: 1012) while the executor is serving slow requests
    (a database that hangs, a big aggregates query), a few times in a row, with the default settings.
    Each drop strands its handlers' threads in the event loop's default executor, min(32, cpus + 4)
    threads shared by every connection, and the next connection's executor_info waits behind them:
    Relay gets no executor_info within its handshakeTimeoutSecs (10 s), closes the socket (4408), and
    the executor can no longer join at all while those handlers run (Relay starts its grace period,
    then recovers the live executor's workflows elsewhere).
    The wait before each reconnection is cut from a second to a tenth: the stranded handlers wait
    for the test's gate, however long the client waits between its connections."""
    monkeypatch.setattr(connection_module, "RECONNECT_SECS", 0.1)
    handlers = SlowHandlers(Identity(executor_id="r2", application_version="v1"))
    answered: list[bool] = []
    attempts = 10  # 4 stranded handlers per drop: 40, more than the largest default executor (32)

    def script(ws: ServerConnection, n: int) -> None:
        ok = ask_info(ws, n)
        answered.append(ok)
        if not ok:
            ws.close(4408, "no executor_info reply")
            return
        if n >= attempts - 1:
            read_until_closed(ws)
            return
        for i in range(4):  # the default max_concurrent_requests
            ws.send(json.dumps({"type": "executor_info", "request_id": f"flood-{n}-{i}"}))
        time.sleep(0.3)
        ws.close(1012, "relay instance lost its lease, reconnect")

    relay = ScriptedRelay(script)
    connection = Connection(relay.url, key="k", app="clienttest", handlers=handlers)
    try:
        connection.start()
        eventually(lambda: len(answered) >= attempts or False in answered, timeout=90)
        assert False not in answered, (
            f"connection {answered.index(False)} got no executor_info reply within 10 s "
            f"({handlers.began} handlers of earlier connections still running); answered: {answered}"
        )
    finally:
        handlers.gate.set()
        connection.stop()
        relay.stop()


@pytest.fixture
def slow_alerts(tmp_path: Path) -> Iterator[tuple[threading.Event, threading.Event]]:
    """DBOS launched with an alert handler that waits for ``gate``: (began, gate)."""
    began, gate = threading.Event(), threading.Event()
    DBOS(
        config={
            "name": "clienttest",
            "system_database_url": f"sqlite:///{tmp_path / 'sys.sqlite'}",
            "application_version": "v1",
            "executor_id": relay_client.new_executor_id(),
        }
    )

    @DBOS.alert_handler
    def handle(name: str, message: str, metadata: dict[str, str]) -> None:
        began.set()
        gate.wait(60)  # the application's own code: it posts to a chat, pages someone...

    DBOS.launch()
    try:
        yield began, gate
    finally:
        gate.set()
        if _internals.live_instance() is not None:
            DBOS.destroy()
        lifecycle.stop_all()


def test_dbos_destroy_while_a_request_is_served_returns_at_once_and_stops_the_client(
    slow_alerts: tuple[threading.Event, threading.Event],
) -> None:
    """client/README.md: DBOS.destroy is wrapped "to stop the client right after DBOS's own destroy
    returns". Relay hands the executor an alert; the application's alert handler takes its time; the
    application shuts down. The socket is closed at once, but the client's thread then waits in
    asyncio.run's shutdown of the default executor for the handler to finish: stop() waits its whole
    timeout (10 s), DBOS.destroy() with it, and returns with the client still running."""
    began, _gate = slow_alerts

    def script(ws: ServerConnection, n: int) -> None:
        assert ask_info(ws, n)
        ws.send(json.dumps({"type": "alert", "request_id": "alert-1", "name": "ExecutorDead",
                            "message": "gone", "metadata": {}}))  # fmt: skip
        read_until_closed(ws)

    relay = ScriptedRelay(script)
    try:
        connection = relay_client.connect(relay.url, key="k", app="clienttest")
        assert began.wait(10)
        started = time.monotonic()
        DBOS.destroy()
        took = time.monotonic() - started
        eventually(lambda: relay.close_codes == [1000])  # the socket itself is closed promptly
        assert took < 5 and not connection.running, (
            f"DBOS.destroy() took {took:.1f}s; the client's thread running afterwards: {connection.running}"
        )
    finally:
        relay.stop()


def test_a_draining_client_refuses_requests_and_stays_connected() -> None:
    """client/README.md, "Stopping with DBOS": before DBOS's own destroy the client is drained: a
    request is then answered with an error and no payload (a refusal: Relay asks another executor),
    and the socket stays open (the executor is still alive to Relay while DBOS waits for its
    workflows)."""
    drained, replies = threading.Event(), []

    def script(ws: ServerConnection, n: int) -> None:
        assert ask_info(ws, n)
        assert drained.wait(10)
        ws.send(p.ListWorkflowsRequest(request_id="r-1", body=p.ListWorkflowsBody()).to_json())
        replies.append(json.loads(ws.recv(timeout=10)))
        read_until_closed(ws)

    relay = ScriptedRelay(script)
    identity = Identity(executor_id="d1", application_version="v1")
    try:
        with Connection(relay.url, key="k", app="clienttest", handlers=Handlers(identity)) as connection:
            connection.start()
            assert connection.wait_connected(5)
            connection.drain()
            drained.set()
            eventually(lambda: len(replies) == 1)
            assert connection.connected and relay.close_codes == []
        assert replies[0]["request_id"] == "r-1" and replies[0]["error_message"] == SHUTTING_DOWN, replies
        assert "output" not in replies[0], replies
    finally:
        relay.stop()


def test_stop_while_a_request_is_served_lets_the_application_connect_again(
    slow_alerts: tuple[threading.Event, threading.Event],
) -> None:
    """client/README.md: connect() refuses "when a connection of this process is running" and says to
    stop() it first. An application stops its connection (to move to another Relay URL, say) while an
    alert is being handled: stop() returns after its timeout with the thread still alive, and the next
    connect() is refused as "already connected" until the application's handler returns."""
    began, _gate = slow_alerts

    def script(ws: ServerConnection, n: int) -> None:
        assert ask_info(ws, n)
        if n == 0:
            ws.send(json.dumps({"type": "alert", "request_id": "alert-1", "name": "ExecutorDead",
                                "message": "gone", "metadata": {}}))  # fmt: skip
        read_until_closed(ws)

    relay = ScriptedRelay(script)
    try:
        first = relay_client.connect(relay.url, key="k", app="clienttest")
        assert began.wait(10)
        first.stop(timeout=2)
        second = relay_client.connect(relay.url, key="k", app="clienttest")  # ConnectRefused: already connected
        assert second.wait_connected(5)
        second.stop()
    finally:
        relay.stop()


FORKED = """
import os, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import app
from dbos import DBOS
import relay_client

# The config's id drawn once, at import, in the process that then forks its workers (gunicorn
# --preload, a multiprocessing pool with the fork start method): each worker launches DBOS and connects.
executor_id = relay_client.new_executor_id()
children = []
for n in range(2):
    pid = os.fork()
    if pid == 0:
        app.launch(Path(tempfile.mkdtemp()), executor_id)
        try:
            connection = relay_client.connect(sys.argv[1], key="k", app="clienttest")
            connection.wait_connected(5)
            print(f"CONNECTED pid={os.getpid()} executor_id={executor_id}", flush=True)
            time.sleep(1)
        except relay_client.ConnectRefused as exc:
            print(f"REFUSED pid={os.getpid()}: {exc}", flush=True)
        DBOS.destroy()
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""


def test_workers_forked_after_new_executor_id_do_not_connect_under_one_id() -> None:
    """client/README.md: connect() refuses an id that "was not issued by new_executor_id() in this
    process", because Relay recovers a dead executor's workflows by its id. A process that draws the id
    and then forks (gunicorn --preload) hands the same id to every worker, and every worker's connect()
    accepts it (the set of issued ids is copied by fork): two live processes are one executor to Relay,
    which closes one's socket whenever the other connects (4409), and takes both for dead when one dies."""
    relay = FakeRelay()
    try:
        result = subprocess.run(
            [sys.executable, "-c", FORKED, relay.url, str(Path(app.__file__).parent)],
            capture_output=True, text=True, timeout=90, cwd=Path(app.__file__).parent,
        )  # fmt: skip
        lines = result.stdout.splitlines()
        connected = [line for line in lines if line.startswith("CONNECTED")]
        assert len(lines) == 2, result.stdout + result.stderr[-3000:]
        ids = [info["executor_id"] for info in relay.infos]
        assert len(connected) <= 1, f"{connected}; Relay was told executor ids {ids} by {len(relay.infos)} sockets"
    finally:
        relay.stop()


def test_a_wss_url_in_capitals_takes_a_ca_file(tmp_path: Path) -> None:
    """check_url() accepts "WSS://" (the scheme is case-insensitive, urlsplit lowers it, and websockets
    connects over TLS), but _tls() tests url.startswith("wss://"): given a ca_file, connect() refuses
    the URL as "for wss:// URLs, not WSS://"."""
    ca_file, _server = make_certificates(tmp_path)
    executor_id = relay_client.new_executor_id()
    app.launch(tmp_path, executor_id)
    try:
        relay_client.connect("WSS://127.0.0.1:9/", key="k", app="clienttest", ca_file=str(ca_file)).stop(timeout=2)
    finally:
        DBOS.destroy()
        lifecycle.stop_all()


HANDLER_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("handler_var", default="unset")


class ContextHandlers(Handlers):
    """Handlers that set a context variable while answering, keeping what each request found."""

    def __init__(self, identity: Identity) -> None:
        super().__init__(identity)
        self.found: list[str] = []

    def answer(self, text: str | bytes) -> str | None:
        if "again-" in str(text):
            self.found.append(HANDLER_VAR.get())
            HANDLER_VAR.set(f"left by {json.loads(text)['request_id']}")
        return super().answer(text)


def test_a_handler_does_not_see_what_an_earlier_one_left_in_its_context() -> None:
    """Requests are served on the connection's own threads (``max_concurrent_requests`` of them),
    which serve one request after another: each request runs in a fresh copy of the client's
    context, as ``asyncio.to_thread`` gave it, not in what the thread's previous request left
    there (DBOS keeps the workflow a call runs under in context variables)."""
    handlers = ContextHandlers(Identity(executor_id="c1", application_version="v1"))

    def script(ws: ServerConnection, n: int) -> None:
        assert ask_info(ws, n)
        for k in range(3):
            ws.send(json.dumps({"type": "executor_info", "request_id": f"again-{k}"}))
            assert json.loads(ws.recv(timeout=10))["request_id"] == f"again-{k}"
        read_until_closed(ws)

    relay = ScriptedRelay(script)
    connection = Connection(relay.url, key="k", app="clienttest", handlers=handlers, max_concurrent_requests=1)
    try:
        connection.start()
        eventually(lambda: len(handlers.found) == 3, timeout=10)
        assert handlers.found == ["unset"] * 3, handlers.found
    finally:
        connection.stop()
        relay.stop()


def test_a_frame_over_max_frame_bytes_is_not_buffered_the_socket_is_closed_and_the_client_reconnects(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """client/README.md: a frame larger than ``max_frame_bytes`` (100 MiB by default, as client-ts's) is
    not read. Relay (or, without TLS, anyone between) announces a 2 GiB frame and sends its first
    bytes: the client closes the socket (1009) at the header, says why, and connects again at once;
    unbounded, it would wait to buffer all 2 GiB and never come back."""
    oversize = b"\x81\x7f" + (2 * 1024**3).to_bytes(8, "big") + b"x" * 4096  # a text frame of 2 GiB: its header

    def script(ws: ServerConnection, n: int) -> None:
        assert ask_info(ws, n)
        if n == 0:
            ws.socket.sendall(oversize)  # under websockets: only a raw socket can announce 2 GiB cheaply
        read_until_closed(ws)

    relay = ScriptedRelay(script)
    connection = Connection(relay.url, key="k", app="clienttest", handlers=Handlers(Identity("f1", "v1")))
    try:
        with caplog.at_level(logging.WARNING, logger="dbos.relay_client"):
            connection.start()
            eventually(lambda: relay.connections == 2 and connection.connected, timeout=5)
        warned = [r.getMessage() for r in caplog.records]
        assert any("larger than max_frame_bytes (104857600 bytes)" in line and "1009" in line for line in warned), (
            warned
        )
        with pytest.raises(ValueError, match="max_frame_bytes must be a whole number"):
            Connection(
                relay.url, key="k", app="clienttest", handlers=Handlers(Identity("f2", "v1")), max_frame_bytes=None
            )  # type: ignore[arg-type]
    finally:
        connection.stop()
        relay.stop()
