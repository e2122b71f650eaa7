"""``GET /v2/orgs/{org}/events``, the console's live updates, against real Relays: what arrives, from
which instance, to which key; and what the new surface costs a hostile or careless client (caps per
key and per instance, heartbeats, a deleted key, a stopping instance). Real sockets throughout.

Two instances on one database: instance 1 with tight caps, instance 2 to make changes through.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
import pytest

from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, off_loop, open_socket
from harness.web import TLS

PER_KEY = 2
PER_INSTANCE = 4
HEARTBEAT_SECS = 0.5
ADMIN = API_KEYS["acme"]


@dataclass
class Pair:
    r1: RelayProcess  # tight caps
    r2: RelayProcess
    database: str


@pytest.fixture(scope="module")
def pair(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    workdir = tmp_path_factory.mktemp("events")
    database = postgres.create_database("relay")
    tight = relay_yaml(free_port())
    tight["server"].update(
        eventPollSecs=0.1,
        eventHeartbeatSecs=HEARTBEAT_SECS,
        maxEventStreamsPerKey=PER_KEY,
        maxEventStreams=PER_INSTANCE,
        maxConcurrentRequests=3,
    )
    relays = [
        RelayProcess(workdir, database, tight, "relay-1"),
        RelayProcess(workdir, database, relay_yaml(free_port()), "relay-2"),
    ]
    try:
        for relay in relays:
            relay.start()
        yield Pair(relays[0], relays[1], database)
    finally:
        for relay in relays:
            relay.stop()


@dataclass
class Stream:
    """One SSE stream read in a thread: its status, its events as (name, data), its comment lines."""

    relay: RelayProcess
    key: str
    org: str = "acme"
    status: int | None = None
    events: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)
    comments: queue.Queue[str] = field(default_factory=queue.Queue)
    ended: threading.Event = field(default_factory=threading.Event)
    ended_at: float | None = None  # time.monotonic() when the stream ended
    _opened: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)

    def open(self) -> Stream:
        threading.Thread(target=self._read, daemon=True).start()
        assert self._opened.wait(10), "no answer to the stream's request"
        return self

    def _read(self) -> None:
        url = f"{self.relay.http}/v2/orgs/{self.org}/events"
        try:
            with httpx.stream(
                "GET", url, headers={"Authorization": f"Bearer {self.key}"}, timeout=30, verify=TLS
            ) as resp:
                self.status = resp.status_code
                self._opened.set()
                if resp.status_code != 200:
                    return
                name = "message"
                for line in resp.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith(":"):
                        self.comments.put(line)
                    elif line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        self.events.put((name, json.loads(line[5:])))
        except httpx.HTTPError:
            pass
        finally:
            self.ended_at = time.monotonic()
            self._opened.set()
            self.ended.set()

    def next(self, wanted: Any, timeout: float = 10) -> dict[str, Any]:
        """The first event (name, data) for which ``wanted(name, data)`` holds, skipping others."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "no such event in time"
            name, data = self.events.get(timeout=remaining)
            if wanted(name, data):
                return {"event": name, **data}

    def drain(self) -> list[tuple[str, Any]]:
        got = []
        while not self.events.empty():
            got.append(self.events.get_nowait())
        return got

    def close(self) -> None:
        self._stop.set()


@pytest.fixture
def streams() -> Iterator[list[Stream]]:
    opened: list[Stream] = []
    yield opened
    for stream in opened:
        stream.close()
    for stream in opened:  # the reader notices at its next line: a heartbeat at the latest
        assert stream.ended.wait(HEARTBEAT_SECS * 4), "a stream still open"


def open_stream(streams: list[Stream], relay: RelayProcess, key: str, org: str = "acme") -> Stream:
    stream = Stream(relay, key, org).open()
    streams.append(stream)
    if stream.status == 200:
        stream.next(lambda name, _: name == "ready")
    return stream


def make_key(relay: RelayProcess, name: str, permissions: list[str], apps: list[str] | None = None) -> str:
    with relay.api() as api:
        body: dict[str, Any] = {"permissions": permissions}
        if apps is not None:
            body["appNames"] = apps
        resp = api.post(f"/tokens/{name}", json=body)
        assert resp.status_code == 201, resp.text
        return str(resp.json()["token"])


def patch_grace(relay: RelayProcess, secs: float) -> None:
    with relay.api() as api:
        assert api.patch("/apps/ledger", json={"executorTimeoutSecs": secs}).status_code == 200


def test_changes_made_through_another_instance_arrive_as_events(pair: Pair, streams: list[Stream]) -> None:
    stream = open_stream(streams, pair.r1, ADMIN)
    patch_grace(pair.r2, 31)
    entry = stream.next(lambda name, d: name == "audit" and d["action"] == "settings.updated")
    assert entry["app"] == "ledger" and entry["id"] > 0 and entry["at"].endswith("Z")

    async def connect_and_leave() -> str:
        ws = await open_socket(f"ws://127.0.0.1:{pair.r2.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}")
        executor_id = await handshake(ws)
        seen = await off_loop(stream.next, lambda n, d: n == "executor" and d["executorId"] == executor_id)
        assert seen["state"] == "HEALTHY" and seen["relayInstance"] == "relay-2" and seen["app"] == "ledger"
        await ws.close()
        return executor_id

    executor_id = asyncio.run(connect_and_leave())
    left = stream.next(lambda n, d: n == "executor" and d["executorId"] == executor_id)
    assert left["state"] == "DISCONNECTED"


def test_a_stream_carries_only_what_its_key_may_see(pair: Pair, streams: list[Stream]) -> None:
    admin = open_stream(streams, pair.r1, ADMIN)
    elsewhere = open_stream(
        streams, pair.r1, make_key(pair.r1, "ev-other-app", ["application.read", "organization.read"], ["other"])
    )
    app_reader = open_stream(streams, pair.r1, make_key(pair.r1, "ev-app-read", ["application.read"]))
    patch_grace(pair.r2, 32)
    admin.next(lambda n, d: n == "audit" and d["action"] == "settings.updated" and d["app"] == "ledger")
    # An app's audit entries go to whoever may read the app (the console re-reads its pages on them);
    # the token.created entries above are the org's (no app): only with organization.read, and not
    # for a key scoped to apps either.
    time.sleep(3 * 0.1 + HEARTBEAT_SECS)  # several polls after the admin's stream got it
    assert elsewhere.drain() == []
    audited = [e[1] for e in app_reader.drain() if e[0] == "audit"]
    assert [(d["action"], d["app"]) for d in audited] == [("settings.updated", "ledger")], audited

    assert open_stream(streams, pair.r1, API_KEYS["globex"]).status == 403  # another org's key
    assert open_stream(streams, pair.r1, API_KEYS["globex"], org="globex").status == 200  # its own org
    assert open_stream(streams, pair.r1, make_key(pair.r1, "ev-tokens", ["token.read"])).status == 403
    assert open_stream(streams, pair.r1, "not-a-key").status == 401
    resp = httpx.get(f"{pair.r1.http}/v2/orgs/acme/events", timeout=5, verify=TLS)  # no key: refused before the route
    assert resp.status_code == 401 and resp.headers["content-type"] == "application/problem+json"


def test_streams_are_capped_per_key_and_per_instance_and_leave_the_api_answering(
    pair: Pair, streams: list[Stream]
) -> None:
    first = [open_stream(streams, pair.r1, ADMIN) for _ in range(PER_KEY)]
    over = httpx.get(
        f"{pair.r1.http}/v2/orgs/acme/events", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5, verify=TLS
    )
    assert over.status_code == 429 and over.headers["content-type"] == "application/problem+json"
    viewer = make_key(pair.r1, "ev-cap", ["application.read"])
    more = [open_stream(streams, pair.r1, viewer) for _ in range(PER_INSTANCE - PER_KEY)]
    assert all(s.status == 200 for s in first + more)
    third = make_key(pair.r1, "ev-cap-2", ["application.read"])
    full = httpx.get(
        f"{pair.r1.http}/v2/orgs/acme/events", headers={"Authorization": f"Bearer {third}"}, timeout=5, verify=TLS
    )
    assert full.status_code == 503 and full.headers["retry-after"]
    # Open streams are not requests in progress: with more of them than maxConcurrentRequests (3),
    # the API still answers.
    with pair.r1.api() as api:
        for _ in range(5):
            assert api.get("/apps").status_code == 200

    first[0].close()  # a client that leaves frees its place at once
    deadline = time.monotonic() + 5
    while True:
        again = open_stream(streams, pair.r1, ADMIN)
        if again.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert again.status == 200


def test_an_idle_stream_gets_heartbeats(pair: Pair, streams: list[Stream]) -> None:
    stream = open_stream(streams, pair.r1, ADMIN)
    start = time.monotonic()
    assert stream.comments.get(timeout=HEARTBEAT_SECS * 4) == ": heartbeat"
    assert stream.comments.get(timeout=HEARTBEAT_SECS * 4) == ": heartbeat"
    assert time.monotonic() - start < HEARTBEAT_SECS * 4


def test_deleting_a_key_ends_its_streams(pair: Pair, streams: list[Stream]) -> None:
    key = make_key(pair.r1, "ev-doomed", ["application.read"])
    stream = open_stream(streams, pair.r1, key)
    with pair.r2.api() as api:  # deleted through the other instance
        assert api.delete("/tokens/ev-doomed").status_code == 204
    end = stream.next(lambda n, _: n == "end", timeout=10)
    assert end["reason"] == "key deleted"
    assert stream.ended.wait(5), "the stream was not closed"
    assert open_stream(streams, pair.r1, key).status == 401


def test_narrowing_a_key_ends_its_streams(pair: Pair, streams: list[Stream]) -> None:
    """A stream sends what the key it was opened with may see: a key narrowed since (in relay.yaml,
    whose sync rewrites the key's row as done here) ended its streams only if it was deleted."""
    key = make_key(pair.r1, "ev-narrowed", ["application.read", "organization.read"])
    stream = open_stream(streams, pair.r1, key)
    with psycopg.connect(pair.database) as conn:
        conn.execute("UPDATE tokens SET apps = ARRAY['other'] WHERE org = 'acme' AND name = 'ev-narrowed'")
    end = stream.next(lambda n, _: n == "end", timeout=10)
    assert end["reason"] == "key changed"
    assert stream.ended.wait(5), "the stream was not closed"


def test_a_burst_larger_than_a_streams_queue_reaches_a_reader_that_keeps_up(pair: Pair, streams: list[Stream]) -> None:
    """A mass failure writes thousands of audit entries and executor changes at once, and one poll
    reads up to 1,000 of each. The poll put them all on each stream's queue in one go, before the
    stream could send any, and a queue holds 1,000: every stream, however fast its reader, was ended
    as too slow ("overflow"), and every console reconnected and read its page again, at each poll of
    the burst. A reader is cut off when 1,000 changes still wait for it, not because one poll found
    more than that."""
    burst = 1000
    with pair.r2.api() as api:
        assert api.put("/apps/burst").status_code == 204
    with psycopg.connect(pair.database) as conn:
        # Executors of an instance that never ran here (nobody adopts them or asks them anything).
        conn.execute(
            """INSERT INTO executors (org, app, executor_id, state, application_version, connected_at, relay_instance)
               SELECT 'acme', 'burst', 'burst-' || n, 'HEALTHY', 'v1', now(), 'relay-seeded'
               FROM generate_series(1, %s) AS n""",
            (burst,),
        )
    stream = open_stream(streams, pair.r1, ADMIN)
    with psycopg.connect(pair.database) as conn:  # one transaction: one poll finds them all
        changed = conn.execute(
            """UPDATE executors SET state = 'DISCONNECTED', disconnected_at = now()
               WHERE org = 'acme' AND app = 'burst' RETURNING executor_id"""
        ).fetchall()
        cur = conn.execute(
            """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
               SELECT 'acme', 'burst', 'executor.disconnected', 'burst-' || n, 'relay', '{}'::jsonb
               FROM generate_series(1, %s) AS n RETURNING id""",
            (burst,),
        )
        ids = {int(row[0]) for row in cur.fetchall()}
    assert len(changed) == burst
    deadline = time.monotonic() + 30
    seen: set[int] = set()
    disconnected: set[str] = set()
    while not (ids <= seen and len(disconnected) == burst):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"{len(ids - seen)} entries, {burst - len(disconnected)} executors never arrived"
        name, data = stream.events.get(timeout=remaining)
        assert name != "end", f"the stream was ended: {data}"
        if name == "audit":
            seen.add(data["id"])
        elif name == "executor" and data["app"] == "burst" and data["state"] == "DISCONNECTED":
            disconnected.add(data["executorId"])


def test_a_reader_that_takes_nothing_is_cut_off_and_frees_its_place(pair: Pair, streams: list[Stream]) -> None:
    """A console that stops reading (a frozen tab, a laptop gone to sleep, a stalled network path)
    during a mass failure: Relay's writes to it wait for ever once the socket's buffers are full. Its
    stream was ended as too slow, but the write still waited, the connection stayed open and the
    stream kept its place among the key's (``maxEventStreamsPerKey``) and the instance's streams
    until the client went away, if ever: the key's other consoles were refused (429). A stream
    whose writes wait longer than three heartbeats and 2 s (when a console takes a silent stream
    for lost) is closed."""
    key = make_key(pair.r1, "ev-stuck", ["application.read"])
    stuck = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    stuck.connect(("127.0.0.1", pair.r1.port))
    stuck.sendall(f"GET /v2/orgs/acme/events HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    try:
        reader = open_stream(streams, pair.r1, key)  # the key's second and last place
        assert reader.status == 200
        assert open_stream(streams, pair.r1, key).status == 429
        deadline = time.monotonic() + 60
        freed = False
        with psycopg.connect(pair.database, autocommit=True) as conn:
            while not freed:
                assert time.monotonic() < deadline, "the stream that reads nothing still holds its place"
                # About 200 KB of events a round; nothing is read from the stuck socket.
                conn.execute(
                    """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
                       SELECT 'acme', 'ledger', 'executor.dead', 'stuck-' || g, 'relay', '{}'::jsonb
                       FROM generate_series(1, 1000) AS g"""
                )
                time.sleep(0.2)
                again = open_stream(streams, pair.r1, key)
                freed = again.status == 200
        # Closed by Relay: what the socket holds is read to its end.
        stuck.settimeout(30)
        try:
            while stuck.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass  # cut off (a reset), not closed in good order: what was buffered for it is dropped
        assert reader.ended_at is None, "the reader that keeps up was cut off too"
        assert "closed the event stream to" in pair.r1.log()
    finally:
        stuck.close()


# Relay's own times (six fraction digits) and the executors' epoch milliseconds (three): one width
# per field, so that the strings sort as the times do.
RELAYS_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
TIME_KEY = re.compile(r"^at$|At$|_time$|^emitTime$|^timeBucket$")


def times_in(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """The time-like members of a JSON answer, as (where, value), at any depth."""
    if isinstance(value, dict):
        for key, member in value.items():
            if TIME_KEY.search(key) and member is not None:
                yield f"{path}.{key}", member
            else:
                yield from times_in(member, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from times_in(item, f"{path}[{i}]")


def test_every_time_served_has_six_fraction_digits_even_on_a_whole_second(pair: Pair, streams: list[Stream]) -> None:
    """A PostgreSQL time on a whole second (one in a million, or a bucket) was served as ``...:27Z``
    beside ``...:27.080000Z``, which sorts after it. Here every kind of Relay's own times is put on a
    whole second and read back through the API and the event stream."""
    stream = open_stream(streams, pair.r1, ADMIN)

    async def connect_and_leave() -> str:
        ws = await open_socket(f"ws://127.0.0.1:{pair.r2.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}")
        executor_id = await handshake(ws)
        await ws.close()
        return executor_id

    executor_id = asyncio.run(connect_and_leave())
    with pair.r1.api() as api:
        made = api.post("/apps/ledger/alerting-rules", json={"ruleType": "ExecutorDead", "receivingAppName": "ledger"})
        assert made.status_code == 201, made.text
        rule = made.json()["id"]
    second = "date_trunc('second', now())"
    with psycopg.connect(pair.database, autocommit=True) as conn:
        conn.execute(f"""UPDATE executors SET connected_at = {second}, disconnected_at = {second}
                         WHERE org = 'acme' AND executor_id = %s""", (executor_id,))  # fmt: skip
        conn.execute(f"UPDATE executor_ids SET first_seen_at = {second} WHERE executor_id = %s", (executor_id,))
        conn.execute(f"UPDATE apps SET created_at = {second} WHERE org = 'acme'")
        conn.execute(f"UPDATE tokens SET created_at = {second} WHERE org = 'acme'")
        conn.execute(f"UPDATE relay_instances SET started_at = {second}")
        conn.execute(f"UPDATE alert_rules SET created_at = {second}, last_fired_at = {second} WHERE id = %s", (rule,))
        conn.execute(f"""INSERT INTO app_metric_counts VALUES
                         ('acme', 'ledger', {second}, 60, 'workflow_count', 'time-widths', 1)""")  # fmt: skip
        conn.execute(f"""INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger,
                                                 status, created_at, updated_at)
                         VALUES ('time-widths', 'acme', 'ledger', 'time-widths-gone', 'v1', 1, 'operator',
                                 'failed', {second}, {second})""")  # fmt: skip
        conn.execute(f"""INSERT INTO recovery_attempts (recovery_id, attempt, peer_executor_id, mode, outcome, at)
                         VALUES ('time-widths', 1, 'peer', 'workflows', 'failed', {second})""")  # fmt: skip
        entry = conn.execute(
            f"""INSERT INTO audit_log (at, org, app, action, executor_id, actor, detail)
                VALUES ({second}, 'acme', 'ledger', 'recovery.dispatched', 'time-widths-gone', 'relay',
                        '{{"recoveryId": "time-widths", "attempt": 1}}') RETURNING id"""
        ).fetchone()
    assert entry is not None
    event = stream.next(lambda n, d: n == "audit" and d["id"] == entry[0])
    answers: dict[str, Any] = {"events/audit": event}
    with pair.r1.api() as api:
        for path in (
            "/apps",
            "/apps/ledger/executors",
            "/apps/ledger/alerting-rules",
            "/apps/ledger/recoveries?executorId=time-widths-gone",
            "/apps/ledger/metrics?startTime=2000-01-01T00:00:00Z&endTime=2100-01-01T00:00:00Z",
            "/tokens",
            "/instances",
            "/audit?sortDesc=true",
            "/audit-logs",
        ):
            resp = api.get(path)
            assert resp.status_code == 200, (path, resp.text)
            answers[path] = resp.json()
        assert api.delete(f"/apps/ledger/alerting-rules/{rule}").status_code == 204
    found = {path: dict(times_in(answer)) for path, answer in answers.items()}
    wrong = {path + where: value for path, got in found.items() for where, value in got.items()
             if not RELAYS_TIME.fullmatch(value)}  # fmt: skip
    assert not wrong, wrong
    # Each answer was read with a whole second among its times: the case that was served short.
    assert all(any(value.endswith(".000000Z") for value in got.values()) for got in found.values()), found


def test_a_stopping_instance_closes_its_streams_at_once(pair: Pair, streams: list[Stream]) -> None:
    """The module's last test: it stops instance 2."""
    stream = open_stream(streams, pair.r2, ADMIN)
    start = time.monotonic()
    pair.r2.stop()
    assert stream.ended.wait(5) and stream.ended_at is not None
    assert pair.r2.proc is not None and pair.r2.proc.returncode == 0
    # uvicorn waits up to 5 s for responses in progress; a stream is not left to run that out. Timed
    # to the stream's end, not to the process's exit (DBOS's own stop, which a loaded machine slows).
    ended = stream.ended_at - start
    assert ended < 3, f"the stream ended {ended:.1f}s after the stop began"
