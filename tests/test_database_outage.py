"""What an operator sees while Relay's own PostgreSQL is down and after it is back.

Relay's database is on a server of its own (:class:`harness.pgserver.PostgresServer`), stopped
(a clean fast shutdown, as a failover's switch does) and started again on the same data, with
Relay in its own process and its log read from the file it writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.keys import API_KEYS, CONDUCTOR_KEYS, VIEWER_KEYS
from harness.pgserver import PostgresServer
from harness.ports import free_port
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, open_socket
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.cli.errors import EXIT_UNAVAILABLE
from tests.test_events import Stream

StartRelay = Callable[..., RelayProcess]
WARNING_AT_START = re.compile(r" WARNING relay\.http: GET /v2/orgs/acme/apps: answered 503")
COUNT_AT_END = re.compile(r" INFO relay\.http: requests are served again: (\d+) answered 503 database_unavailable")


@pytest.fixture(scope="module")
def relay_pg() -> Iterator[PostgresServer]:
    server = PostgresServer("relay-outage-db")
    yield server
    server.close()


@pytest.fixture
def start_relay(relay_pg: PostgresServer, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StartRelay]:
    started: list[RelayProcess] = []
    if not relay_pg.running():
        relay_pg.start()
    url = relay_pg.url(relay_pg.create_database("relay"))

    def start(instance_id: str = "relay-1", **liveness: float) -> RelayProcess:
        relay = RelayProcess(tmp_path, url, relay_yaml(free_port(), **liveness), instance_id=instance_id)
        started.append(relay)
        return relay.start()

    yield start
    if not relay_pg.running():
        relay_pg.start()
    for relay in started:
        relay.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(f"--- {relay.instance_id} log ---\n{relay.log()[-8000:]}")


def get(relay: RelayProcess, path: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEYS['acme']}"}
    return httpx.get(relay.http + path, headers=headers, timeout=30, verify=TLS)


def served(relay: RelayProcess) -> bool:
    try:
        return get(relay, "/v2/orgs/acme/apps").status_code == 200
    except httpx.HTTPError:
        return False


def refused_together(relay: RelayProcess, n: int) -> list[httpx.Response]:
    """``n`` requests at once, each refused while the database is away."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: get(relay, "/v2/orgs/acme/apps"), range(n)))


def test_an_outage_logs_one_warning_per_instance_and_one_line_with_the_count_when_requests_are_served_again(
    start_relay: StartRelay, relay_pg: PostgresServer
) -> None:
    first, second = start_relay("relay-1"), start_relay("relay-2")
    assert served(first) and served(second)
    relay_pg.stop()
    with ThreadPoolExecutor(2) as pool:
        on_first = pool.submit(refused_together, first, 3)
        on_second = pool.submit(refused_together, second, 2)
        answers = on_first.result() + on_second.result()
    assert [r.status_code for r in answers] == [503] * 5
    assert {r.json()["error"]["code"] for r in answers} == {"database_unavailable"}
    relay_pg.start()
    for relay, refused in ((first, 3), (second, 2)):
        # Until the database answers again, a request is refused at once: the polls refused count too.
        polls: list[int] = []

        def serves(relay: RelayProcess = relay, polls: list[int] = polls) -> bool:
            answer = get(relay, "/v2/orgs/acme/apps")
            polls.append(answer.status_code)
            return answer.status_code == 200

        assert_eventually(serves, 30, interval=0.2, what=f"{relay.instance_id} serves")
        refused += polls.count(503)
        log = relay.log()
        # One warning, with the database's own words, for the outage's first refusal.
        warnings = [line for line in log.splitlines() if WARNING_AT_START.search(line)]
        assert len(warnings) == 1, warnings
        assert "connection" in warnings[0], warnings[0]
        assert log.count("answered 503") == 2, [line for line in log.splitlines() if "answered 503" in line]
        # One line when the requests are served again, with how many were refused in between.
        counts = [int(m.group(1)) for m in COUNT_AT_END.finditer(log)]
        assert counts == [refused], (relay.instance_id, counts)
        # The instance's request channel (LISTEN) too: lost once, back once, its attempts unlogged.
        assert_eventually(lambda relay=relay: "listening on its request channel again" in relay.log(), 30)
        lost = [line for line in relay.log().splitlines() if "request channel lost" in line]
        assert len(lost) == 1, lost


def sample(exposition: str, name: str) -> float | None:
    """The value of an unlabelled series of a Prometheus text exposition, or None if it is absent."""
    found = re.search(rf"^{name} (\S+)$", exposition, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_a_database_503_says_when_to_try_again(start_relay: StartRelay, relay_pg: PostgresServer) -> None:
    relay = start_relay()
    relay_pg.stop()
    refused = get(relay, "/v2/orgs/acme/apps")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "database_unavailable"
    # As the other 503s that pass (too many requests, too many streams) say, for clients that honour it.
    assert refused.headers.get("retry-after", "").isdigit(), dict(refused.headers)


def test_metrics_answer_through_an_outage_and_say_the_database_is_down(
    start_relay: StartRelay, relay_pg: PostgresServer
) -> None:
    relay = start_relay()
    before = get(relay, "/metrics")
    assert before.status_code == 200 and sample(before.text, "relay_database_up") == 1.0
    relay_pg.stop()
    assert_eventually(lambda: not served(relay), 30, interval=0.2, what="the API refuses")
    scrape_started = time.monotonic()
    during = get(relay, "/metrics")
    took = time.monotonic() - scrape_started
    # A scrape answered, within Prometheus's default scrape_timeout (10 s), not a gap: the instance's
    # own figures, and the database's absence in a gauge of its own.
    assert during.status_code == 200, during.text
    assert took < 10.0, took
    assert sample(during.text, "relay_database_up") == 0.0
    assert sample(during.text, "relay_lease_held") is not None
    assert sample(during.text, "relay_connections") is not None
    relay_pg.start()
    assert_eventually(
        lambda: sample(get(relay, "/metrics").text, "relay_database_up") == 1.0, 30, interval=0.2, what="up again"
    )


def relay_cli(relay: RelayProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env |= {"RELAY_URL": relay.http, "RELAY_API_KEY": API_KEYS["acme"]}
    return subprocess.run([sys.executable, "-m", "relay", *args], capture_output=True, text=True, env=env, timeout=60)


def test_the_cli_says_in_one_line_that_relays_database_is_unreachable_and_exits_unavailable(
    start_relay: StartRelay, relay_pg: PostgresServer
) -> None:
    relay = start_relay()
    relay_pg.stop()
    assert_eventually(lambda: not served(relay), 30, interval=0.2, what="the API refuses")
    for args in (("apps",), ("audit",)):
        done = relay_cli(relay, *args)
        assert done.returncode == EXIT_UNAVAILABLE, (args, done.returncode, done.stderr)
        assert "Traceback" not in done.stderr and done.stdout == "", (args, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "database is unreachable" in lines[0], (args, done.stderr)
    relay_pg.start()
    assert_eventually(lambda: served(relay), 30, interval=0.2, what="served again")
    assert relay_cli(relay, "apps").returncode == 0


def test_a_stop_after_the_database_dropped_relays_connections_gives_up_the_lease_without_a_traceback(
    start_relay: StartRelay, relay_pg: PostgresServer
) -> None:
    """A failover, or a restart of PostgreSQL between two renewals, leaves the lease's connection
    closed by the server. The stop's release of the lease met it, failed, and the lease was left to
    run out (its executors' recovery waited for that; peers took it for an instance that died) with
    a traceback and an "Application shutdown failed" in the log."""
    relay = start_relay(instanceLeaseSecs=60.0)  # renewed every 20 s: none between the cut and the stop
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute(
            """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                WHERE datname = current_database() AND pid <> pg_backend_pid()"""
        )
    relay.signal(signal.SIGTERM)
    assert relay.proc is not None and relay.proc.wait(60) == 0
    stop = relay.log().split("Waiting for application shutdown", 1)[1]  # (DBOS logs its workflows' failures)
    assert "Traceback" not in stop and "shutdown failed" not in stop, stop[-4000:]
    with psycopg.connect(relay.database_url) as conn:
        row = conn.execute("SELECT released_at FROM relay_instances WHERE instance_id = 'relay-1'").fetchone()
    assert row is not None and row[0] is not None, "the lease was not given up"


def test_after_the_database_dropped_relays_connections_at_most_one_request_is_refused(
    start_relay: StartRelay,
) -> None:
    """A failover (or a restart) whose database is back at once: each idle connection of the pool
    was closed by the server, and each was given to a request, which failed (a 503 per connection,
    up to the pool's 16, though the database answered). The first that fails has the rest checked."""
    relay = start_relay()
    with ThreadPoolExecutor(8) as pool:  # the pool grows to hold several idle connections
        assert {r.status_code for r in pool.map(lambda _: get(relay, "/v2/orgs/acme/audit"), range(16))} == {200}
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute(
            """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                WHERE datname = current_database() AND pid <> pg_backend_pid()"""
        )
    codes = [get(relay, "/v2/orgs/acme/apps").status_code for _ in range(16)]
    assert set(codes) <= {200, 503} and codes.count(503) <= 1, codes


def test_an_event_stream_open_through_an_outage_carries_the_changes_after_it_and_the_log_says_so_twice(
    start_relay: StartRelay, relay_pg: PostgresServer
) -> None:
    relay = start_relay()
    stream = Stream(relay, API_KEYS["acme"]).open()
    try:
        assert stream.status == 200
        stream.next(lambda name, _: name == "ready")
        relay_pg.stop()
        poller_warning = "cannot read what changed for the event streams"
        assert_eventually(lambda: poller_warning in relay.log(), 30, interval=0.2, what="the poller's warning")
        relay_pg.start()
        assert_eventually(lambda: served(relay), 30, interval=0.2, what="served again")
        with relay.api() as api:
            assert api.post("/tokens/after-outage", json={"permissions": ["token.read"]}).status_code == 201
        # The same stream, open all along, carries the change made after the outage.
        assert not stream.ended.is_set()
        stream.next(lambda name, data: name == "audit" and data["action"] == "token.created", timeout=30)
        log = relay.log()
        assert log.count(poller_warning) == 1, [line for line in log.splitlines() if poller_warning in line]
        again = re.findall(r"INFO relay\.events: the event streams read what changed again after (\d+) failed", log)
        assert len(again) == 1 and int(again[0]) >= 1, again
    finally:
        stream.close()


def test_handshakes_that_cannot_be_recorded_log_one_error_per_app(
    start_relay: StartRelay, relay_pg: PostgresServer
) -> None:
    """While the lease still holds, each executor that connects during an outage is refused once its
    record could not be written (the pool's 10 s): one ERROR each, every second, for every executor
    of a fleet reconnecting. One line per app a minute now, the next saying how many since."""
    relay = start_relay(instanceLeaseSecs=60.0)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    relay_pg.stop()

    async def refused(executor_id: str) -> int | None:
        ws = await open_socket(url)
        await handshake(ws, executor_id)
        await asyncio.wait_for(ws.wait_closed(), 40)
        return ws.close_code

    async def all_of_them() -> list[int | None]:
        return await asyncio.gather(*(refused(f"unrecorded-{i}") for i in range(4)))

    assert asyncio.run(all_of_them()) == [1011] * 4  # each refused: its record could not be written
    lines = [line for line in relay.log().splitlines() if "cannot record its connection" in line]
    assert len(lines) == 1, lines


def test_a_second_outage_is_warned_of_though_no_request_was_served_between_the_two(
    start_relay: StartRelay, relay_pg: PostgresServer
) -> None:
    """Wrong: a run of 503 database_unavailable ends only when a request is answered otherwise
    (relay.api ServedWatch): the database's return alone does not end it. When no request comes
    between two outages (the console was closed during the first; no load balancer probes the
    instance), the second outage, hours or weeks later, is counted into the first's run: its first
    503 is logged at DEBUG, and the log has no warning at all for it, though the CHANGELOG says a
    run logs "one warning (the first, with the database's words)"."""
    relay = start_relay()
    assert served(relay)
    relay_pg.stop()
    assert get(relay, "/v2/orgs/acme/apps").status_code == 503
    relay_pg.start()
    # The database is back and Relay uses it again (its request channel listens), no request made.
    assert_eventually(lambda: "listening on its request channel again" in relay.log(), 60)
    relay_pg.stop()
    second = get(relay, "/v2/orgs/acme/apps")
    assert second.status_code == 503 and second.json()["error"]["code"] == "database_unavailable"
    relay_pg.start()
    warnings = [line for line in relay.log().splitlines() if WARNING_AT_START.search(line)]
    assert len(warnings) == 2, f"one warning for two outages: {warnings}"


# The loops that work on the database every few seconds: what each says when it begins to fail,
# and when it works again.
LOOPS = {
    "the keys' reload": ("cannot reload the keys", "the keys are reloaded again"),
    "the router's poll": ("polling relayed requests failed", "polling relayed requests works again"),
    "the socket check": ("socket check failed", "the socket check works again"),
    "the alerts' reads": ("reading the audit log for alerts failed", "the audit log is read for alerts again"),
    "the repair sweep": ("the repair sweep failed", "the repair sweep works again"),
}


def timed_get(relay: RelayProcess, path: str = "/v2/orgs/acme/apps") -> tuple[httpx.Response, float]:
    began = time.monotonic()
    response = get(relay, path) if not path.startswith("POST ") else post(relay, path.removeprefix("POST "))
    return response, time.monotonic() - began


def post(relay: RelayProcess, path: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEYS['acme']}"}
    return httpx.post(relay.http + path, headers=headers, json={}, timeout=30, verify=TLS)


# A route of each family: Relay's own records, and the routes that go to an executor of the app (the
# workflows, queues, schedules and versions of Conductor's API), which first read which executors
# serve it. That read, shared by the requests that come together, is a task of its own: it waited
# for the pool's 10 s (`relay workflows list` failed after 11 s where `relay apps` took 1).
REFUSED_AT_ONCE = (
    "/v2/orgs/acme/apps",
    "/v2/orgs/acme/audit",
    "/v2/orgs/acme/apps/ledger/workflows",
    "POST /v2/orgs/acme/apps/ledger/workflows/search",
    "/v2/orgs/acme/apps/ledger/workflows/wf-1",
    "/v2/orgs/acme/apps/ledger/workflows/wf-1/steps",
    "/v2/orgs/acme/apps/ledger/queues",
    "/v2/orgs/acme/apps/ledger/schedules",
    "/v2/orgs/acme/apps/ledger/versions",
)


def test_through_an_outage_requests_are_refused_at_once_each_loop_logs_twice_and_a_stop_awaits_refusal_audits(
    start_relay: StartRelay, relay_pg: PostgresServer
) -> None:
    """Three gaps, one Relay and one outage of about 30 s. (1) Each request was answered 503 only
    after the pool's 10 s wait for a connection, though Relay knew its database was away. (2) The
    loops above wrote their warning at every round, about every 10 s, for the whole outage. (3) A
    clean stop dropped the refusal-audit entries still being written."""
    relay = start_relay(socketCheckSecs=2.0, repairIntervalSecs=3.0)
    assert served(relay)
    relay_pg.stop()
    # Relay knows at once: its request channel's connection was closed.
    assert_eventually(lambda: "request channel lost" in relay.log(), 10, interval=0.1, what="the outage noticed")
    refusals: list[float] = []
    outage_began = time.monotonic()
    while time.monotonic() - outage_began < 30:
        path = REFUSED_AT_ONCE[len(refusals) % len(REFUSED_AT_ONCE)]
        refused, took = timed_get(relay, path)
        assert took < 2.5, (path, took)
        assert refused.status_code == 503, (path, refused.text)
        assert refused.headers["content-type"] == "application/problem+json", refused.headers
        assert refused.json()["error"]["code"] == "database_unavailable"
        assert refused.headers.get("retry-after") == "2", dict(refused.headers)
        refusals.append(took)
        time.sleep(0.5)
    # Not the pool's 10 s: one attempt to connect, refused at once (more on a loaded machine).
    assert statistics.median(refusals) < 0.5 and max(refusals) < 2.5, refusals

    relay_pg.start()  # (pg_ctl -w: it accepts connections)
    # Served from the first request on, not refused until the instance notices the database's return.
    after = [timed_get(relay) for _ in range(20)]
    assert [r.status_code for r, _ in after] == [200] * 20, [(r.status_code, r.text[:200]) for r, _ in after]
    assert max(took for _, took in after) < 5.0, [took for _, took in after]  # (the pool reconnects)

    for _, working in LOOPS.values():
        assert_eventually(lambda working=working: working in relay.log(), 30, interval=0.2, what=working)
    log = relay.log()
    # DBOS's warnings (Relay's own workflows run on DBOS) as Relay's are, one line each: DBOS puts a
    # traceback in the text of some ("Exception polling schedules: Traceback (most recent call
    # last): ...", some 9,000 characters of SQLAlchemy's frames); the line says what was raised.
    polls = [line for line in log.splitlines() if " WARNING dbos: Exception polling schedules: " in line]
    assert polls, "DBOS's scheduler did not warn"
    for line in polls:
        assert "Traceback" not in line and "  File " not in line and len(line) < 2000, line
        assert "dbos: Exception polling schedules: sqlalchemy.exc.OperationalError: " in line, line
        assert "connection failed" in line or "Connection refused" in line, line
    # No warning's traceback on lines of its own either (DBOS's step retries attach theirs). An error's
    # is kept: a workflow of Relay's that failed as the database went (a retention round's, in one
    # full run) is DBOS's ERROR with Relay's frames, which whoever reads it needs.
    record = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) ")
    level, warned_tracebacks = "", []
    for line in log.splitlines():
        if found := record.match(line):
            level = found.group(1)
        elif line.startswith(("Traceback", "  File ")) and level != "ERROR":
            warned_tracebacks.append(line)
    assert not warned_tracebacks, log[-4000:]
    for loop, (failing, working) in LOOPS.items():
        warned = [line for line in log.splitlines() if failing in line]
        assert len(warned) == 1 and " WARNING " in warned[0], (loop, warned)
        ended = [line for line in log.splitlines() if working in line]
        assert len(ended) == 1 and " INFO " in ended[0], (loop, ended)

    # A refused change (a viewer's key creating a key: 403) whose audit entry waits for a lock on the
    # audit log, then a clean stop: the stop waits for the entry (bounded), so it is written.
    with psycopg.connect(relay.database_url, autocommit=True) as locker:
        locker.execute("BEGIN")
        locker.execute("LOCK TABLE audit_log IN SHARE MODE")  # INSERTs wait; reads do not
        headers = {"Authorization": f"Bearer {VIEWER_KEYS['acme']}"}
        denied = httpx.post(
            relay.http + "/v2/orgs/acme/tokens/refused-at-stop", headers=headers, json={}, timeout=10, verify=TLS
        )
        assert denied.status_code == 403, denied.text
        assert_eventually(lambda: waiting_on_a_lock(locker), 10, interval=0.05, what="the entry's INSERT waits")
        relay.signal(signal.SIGTERM)
        assert relay.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            relay.proc.wait(1.5)  # a stop that does not wait for the entry is over by then
        locker.execute("COMMIT")
    assert relay.proc.wait(60) == 0
    with psycopg.connect(relay.database_url) as conn:
        rows = conn.execute(
            "SELECT detail->>'result', detail->>'status' FROM audit_log"
            " WHERE action = 'token.created' AND detail->>'tokenName' = 'refused-at-stop'"
        ).fetchall()
    assert rows == [("failure", "403")], rows


def waiting_on_a_lock(conn: psycopg.Connection[Any]) -> bool:
    """Whether a write to the audit log waits for the lock ``conn`` holds on it."""
    waiting = "SELECT count(*) FROM pg_locks WHERE relation = 'audit_log'::regclass AND NOT granted"
    row = conn.execute(waiting).fetchone()
    return row is not None and row[0] >= 1
