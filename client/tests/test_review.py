"""A platform team's review of relay_client (dbos 3.4, many machines): each test fails on the code
as it is, for the reason its docstring gives, and passes once that is fixed.

Relay is played by real WebSocket and TCP servers, DBOS is real (SQLite), as in the client's other
tests; where a wait or a bound is scaled down, it is the client's own setting that is changed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import app
import pytest
from dbos import DBOS, DBOSClient, SetWorkflowID
from harness.certificates import make_certificates
from test_connect import FakeRelay, eventually
from test_connection_life import ScriptedRelay, ask_info, read_until_closed
from websockets.sync.server import ServerConnection

import relay_client
import relay_protocol as p
from relay_client import _internals, aggregates, lifecycle
from relay_client import connection as connection_module
from relay_client.connection import Connection
from relay_client.handlers import Handlers, Identity

# --- wss:// with the system's CAs --------------------------------------------------------------


def test_a_wss_url_connects_trusting_the_systems_cas_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """client/README.md, TLS: "For wss://, the system's CAs are trusted by default." Relay behind TLS
    with a certificate the machine trusts (here: a CA put in the system's trust store as OpenSSL reads
    it, ``SSL_CERT_FILE``), ``connect("wss://...", key=..., app=...)`` with no TLS option: the client
    passes ``ssl=None`` to websockets, which refuses it for a wss:// URI ("ssl=None is incompatible
    with a wss:// URI"). The executor never connects, and the log says only "Unexpected error on the
    connection to Relay", tried again every second or two for ever. (The client's own TLS test reads
    the same failure as "the system's CAs do not know ours".)"""
    ca_file, server_tls = make_certificates(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    assert ssl.create_default_context().cert_store_stats()["x509_ca"] >= 1  # the system's trust store has it
    relay = FakeRelay(tls=server_tls)
    app.launch(tmp_path, relay_client.new_executor_id())
    try:
        with caplog.at_level(logging.WARNING, logger="dbos.relay_client"):
            connection = relay_client.connect(relay.url, key="k", app="clienttest")
            connected = connection.wait_connected(5)
        assert connected, [r.getMessage() for r in caplog.records]
        eventually(lambda: len(relay.infos) == 1)
    finally:
        DBOS.destroy()
        lifecycle.stop_all()
        relay.stop()


# --- A wss:// URL at a port without TLS is a refusal that repeats, not a loss -------------------


class PlainHttp:
    """A plain HTTP server (no TLS) that keeps when each connection came and answers 400 to what it
    reads, as Relay's own server (uvicorn) answers a TLS ClientHello ("Invalid HTTP request received")."""

    def __init__(self) -> None:
        self.tries: list[float] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.tries.append(time.monotonic())
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._sock.close()


def test_a_wss_url_at_a_port_without_tls_is_tried_again_less_and_less_often_not_every_second(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """client/README.md: a try that "will repeat (... an address that is not a WebSocket server, a
    certificate it does not trust) doubles up to 30 s". A ``wss://`` URL at a port that speaks no TLS
    (Relay itself, which serves plain HTTP and answers the ClientHello with a 400; a TLS front end's
    port mistyped) fails the same way at every try, as an untrusted certificate does: but its
    ``ssl.SSLError`` (WRONG_VERSION_NUMBER, an OSError) is taken for a loss, tried again every second
    for ever from every machine of the fleet, and logged as "Connection to Relay lost". Waits in tenths
    of the real ones, jitter at its middle: the fifth wait is at least 4 tenths (doubling), not one."""
    tenth = 0.1
    monkeypatch.setattr(connection_module, "RECONNECT_SECS", tenth)
    monkeypatch.setattr(connection_module, "REFUSED_MAX_SECS", 8 * tenth)
    monkeypatch.setattr(connection_module.random, "uniform", lambda low, high: (low + high) / 2)
    ca_file, _server_tls = make_certificates(tmp_path)
    server = PlainHttp()
    context = ssl.create_default_context(cafile=str(ca_file))  # as connect(ca_file=...) makes it
    identity = Identity(executor_id="e-tls", application_version="v1")
    try:
        with caplog.at_level(logging.WARNING, logger="dbos.relay_client"):
            url = f"wss://127.0.0.1:{server.port}/"
            with Connection(url, key="k", app="clienttest", handlers=Handlers(identity), ssl_context=context) as conn:
                conn.start()
                deadline = time.monotonic() + 10
                while len(server.tries) < 6 and time.monotonic() < deadline:
                    time.sleep(0.02)
        gaps = [b - a for a, b in zip(server.tries, server.tries[1:], strict=False)]
        warned = [r.getMessage() for r in caplog.records]
        assert len(gaps) >= 5, (server.tries, warned)
        assert gaps[4] >= 4 * tenth, (gaps, warned)
    finally:
        server.stop()


# --- DBOS.destroy() in the middle of a retention round ------------------------------------------


@DBOS.workflow()
def quick(i: int) -> int:
    return i


@pytest.fixture
def dbos_with_history(tmp_path: Path) -> Iterator[int]:
    """DBOS launched on SQLite with finished workflows to collect; their count.

    The history is made in memory (/dev/shm: each workflow is three commits, and their fsyncs made
    this fixture 25 s on disk), then the database is moved to disk and DBOS launched on it again, so
    that the round deletes at a disk's pace, as it did."""
    n = 1000  # deleted one a batch: a round of a few seconds
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as made:
        app.launch(Path(made), relay_client.new_executor_id())
        for i in range(n):
            with SetWorkflowID(f"old-{i}"):
                quick(i)
        DBOS.destroy()
        for database in Path(made).glob("sys.sqlite*"):
            shutil.copy(database, tmp_path)
    app.launch(tmp_path, relay_client.new_executor_id())
    try:
        yield n
    finally:
        if _internals.live_instance() is not None:
            DBOS.destroy()
        lifecycle.stop_all()


class FreezingProxy:
    """A TCP proxy in front of ``port`` that can freeze: from then on it forwards nothing either way
    (a Relay stopped by SIGSTOP, a network that drops packets), without closing anything."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.frozen = threading.Event()
        self._open: list[socket.socket] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"ws://127.0.0.1:{self._sock.getsockname()[1]}/"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if self.frozen.is_set():
                    return  # dropped, and nothing more forwarded
                sink.sendall(data)
        except OSError:
            pass

    def stop(self) -> None:
        for sock in [self._sock, *self._open]:
            with contextlib.suppress(OSError):
                sock.close()


def test_dbos_destroy_during_a_retention_round_logs_no_error(
    dbos_with_history: int, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relay sends ``retention`` (answered at once, the round on a thread of its own, as dbos 3.2 did);
    the application shuts down in the middle of the round, while Relay does not answer (frozen, or the
    network gone: the reason a deploy happens, often). dbos 3.2's client ended its connection and gave
    the round up to 10 s *before* DBOS took the system database away, and a round cut short by
    shutdown was a DEBUG line ("Retention interrupted by shutdown"). relay_client stops only after
    DBOS's own destroy has returned: the round goes on against a destroyed DBOS while the client waits
    for Relay's close, fails at its next call ("No DBOS was created yet"), and is logged as an ERROR
    with a traceback ("Exception encountered during enforcing retention policy") at such deploys."""
    monkeypatch.setattr(connection_module, "CLOSE_TIMEOUT_SECS", 1.0)  # the wait for Relay's close, shortened
    total = dbos_with_history
    answered = threading.Event()

    def script(ws: ServerConnection, n: int) -> None:
        assert ask_info(ws, n)
        body = {"gc_cutoff_epoch_ms": int(time.time() * 1000) + 60_000, "gc_rows_threshold": None,
                "gc_batch_size": 1, "timeout_cutoff_epoch_ms": None}  # fmt: skip
        ws.send(json.dumps({"type": "retention", "request_id": "r-1", "body": body}))
        assert json.loads(ws.recv(timeout=10))["success"] is True
        answered.set()
        read_until_closed(ws)

    relay = ScriptedRelay(script)
    proxy = FreezingProxy(relay.port)
    try:
        with caplog.at_level(logging.DEBUG, logger="dbos.relay_client"):
            connection = relay_client.connect(proxy.url, key="k", app="clienttest")
            assert answered.wait(10)
            eventually(lambda: len(DBOS.list_workflows(load_input=False, load_output=False)) < total, timeout=5)
            proxy.frozen.set()
            DBOS.destroy()  # a deploy: the round is still deleting, one workflow a batch
            eventually(lambda: not connection.running, timeout=15)
            for thread in threading.enumerate():  # the round's end, whenever it comes
                if thread.name == "relay-client-retention":
                    thread.join(15)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage()[:300] for r in errors]
    finally:
        proxy.stop()
        relay.stop()


# --- Step figures of an app with a queue backlog -----------------------------------------------


def test_step_aggregates_of_a_window_are_answered_whatever_the_queue_backlog_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relay asks one executor of every app, every minute, for ``get_step_aggregates`` of the minute
    just ended (workflows/appfigures.py): the app's ``dbos_conductor_v1_*`` figures. client/README.md:
    it is "computed from the steps of the workflows that can hold a step in the range; more than 5,000
    such workflows is an error". A workflow ENQUEUED before the window and never started holds no step
    at all, yet every in-flight workflow counts: an app with a queue backlog of more than 5,000 (a
    common sight) gets an error instead of its figures, every minute, from every executor (Relay then
    stores no figures for the app at all). dbos 3.2 answered with one query whatever the backlog.
    The bound scaled down here to 5 (the client's own setting), the backlog to 6."""
    monkeypatch.setattr(aggregates, "MAX_STEP_WORKFLOWS", 5)
    sysdb = f"sqlite:///{tmp_path / 'sys.sqlite'}"
    app.launch(tmp_path, relay_client.new_executor_id())
    client = DBOSClient(system_database_url=sysdb, application_name="clienttest")
    try:
        for i in range(6):  # a backlog on a queue no executor of this version serves yet
            client.enqueue({"queue_name": "backlog", "workflow_name": "adder", "workflow_id": f"queued-{i}"}, i)
        # The window starts on a whole second: SQLite keeps a workflow's times to the second.
        time.sleep(1 - time.time() % 1 + 0.01)
        window_start = datetime.fromtimestamp(int(time.time()), UTC)
        with SetWorkflowID("ran-in-window"):
            assert app.adder(1) == 5  # two steps, completed in the window
        time.sleep(0.05)
        window_end = datetime.now(UTC)
        assert {w.status for w in DBOS.list_workflows(workflow_id_prefix="queued-")} == {"ENQUEUED"}
        handlers = Handlers(Identity(executor_id="e-figures", application_version="v1"))
        body = p.GetStepAggregatesBody(
            group_by_function_name=True, group_by_status=True, select_count=True, select_max_duration_ms=True,
            completed_after=window_start.isoformat(), completed_before=window_end.isoformat(),
        )  # fmt: skip
        text = handlers.answer(p.GetStepAggregatesRequest(body=body).to_json())
        assert text is not None
        reply = json.loads(text)
        assert reply.get("error_message") is None, reply["error_message"][:300]
        counts = {(o["group"]["function_name"], o["group"]["status"]): o["count"] for o in reply["output"]}
        assert counts.get(("add", "SUCCESS")) == 2, counts
    finally:
        client.destroy()
        DBOS.destroy()
        lifecycle.stop_all()


# --- Metadata that cannot be sent --------------------------------------------------------------


def test_metadata_that_cannot_be_sent_is_refused_by_connect_not_at_every_handshake(tmp_path: Path) -> None:
    """client/README.md: ``metadata`` "is the executor metadata Relay shows", and connect() refuses at
    once, naming the part at fault, what would fail the same way at every try (a bad URL). Metadata
    with a value JSON cannot carry (a ``datetime``, the launch time, say) is taken; then every
    handshake's ``executor_info`` fails (an ERROR with a traceback each time), Relay refuses the
    executor (4400, "bad executor_info reply"), and the executor never joins: its workflows have no
    one to recover them, and nothing told the application at start."""
    relay = FakeRelay()
    app.launch(tmp_path, relay_client.new_executor_id())
    try:
        with pytest.raises((ValueError, TypeError), match="metadata"):
            connection = relay_client.connect(
                relay.url, key="k", app="clienttest", metadata={"launched": datetime.now(UTC)}
            )
            eventually(lambda: len(relay.infos) >= 1)
            connection.stop()
            pytest.fail(f"connect() took the metadata; Relay was told {relay.infos[0]}")
    finally:
        DBOS.destroy()
        lifecycle.stop_all()
        relay.stop()
