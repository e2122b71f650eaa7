"""Relay's database goes back in time: a failover to an asynchronous replica that had not received
the last seconds, or a restore from a backup, while Relay's instances run.

The database is a server of its own (:class:`harness.pgserver.PostgresServer`). Its state at T0 is
an online base backup (``pg_basebackup``: what a backup, or a replica being built, copies while the
server serves, so nothing at T0 is disturbed); things happen after T0; then the server is stopped and
started again on the copy, on the same address: what was written after T0 is lost, as it is when a
replica that lagged by those seconds is promoted. Relay's instances, executors and their DBOS system
database (on the session's other server) keep running through it and are ahead of their database.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.executors import Evidence, ExecutorProcess, jobs_held
from harness.keys import API_KEYS
from harness.pgserver import PostgresServer
from harness.ports import free_port
from harness.proxy import TcpProxy
from harness.relay import RelayProcess, audit_actions, healthy_instances, relay_yaml
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.auth import KeyGrant, KeyRing, Permission
from relay.config import AlertsConfig, ServerConfig
from relay.core.alerts import Alert
from relay.core.ids import ExecutorKey
from relay.domain.events import EventHub
from relay.errors import DatabaseError
from relay.store.alerts import AlertStore
from relay.store.changes import ChangeStore
from relay.store.db import Database
from relay.store.executors import ExecutorStore, Handshake
from relay_protocol import ExecutorInfoReply
from tests.test_alerts import with_store
from tests.test_events import Stream
from workflows.alerts import AlertLoops

StartExecutor = Callable[..., ExecutorProcess]

# Short liveness settings, so that the whole story takes seconds. The grace period is above the
# socket check, its 2 s of settling and the SDK's 1 s before it reconnects (README: "When Relay's
# database goes back in time"): with 2 s, a live executor was declared DEAD and recovered. Those
# add up to 4 s; the 4 s more are for CI's loaded cores (three workers on two), which may delay the
# check's round, the reconnection and its registry write by seconds, as README's "a few" allows.
GRACE = 8.0
LEASE = 3.0
SOCKET_CHECK = 1.0


@pytest.fixture
def relay_pg() -> Iterator[PostgresServer]:
    server = PostgresServer("relay-restore-db")
    yield server
    server.close()


@pytest.fixture
def relays(request: pytest.FixtureRequest) -> Iterator[list[RelayProcess]]:
    """The test's instances, stopped after it; their logs printed if it failed (the report of the
    call exists only once the test has returned, so a ``finally`` in the test never saw it)."""
    started: list[RelayProcess] = []
    yield started
    for relay in started:
        relay.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for relay in started:
            print(f"--- {relay.instance_id} log ---\n{relay.log()[-12000:]}")


RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) ")
# What the database's absence raises (psycopg, SQLAlchemy under DBOS, Relay's own wrapping), and
# what its going back raises: a job of Relay's started in the lost seconds (a window's app figures,
# every minute on the clock, so a restore may fall on one; a grace period, a recovery, a retention
# round) has lost its row, and DBOS ends it with "Non-existent target workflow ID" as it finishes
# (README: "When Relay's database goes back in time"). Only Relay's own workflows are in its log.
OUTAGE = re.compile(r"OperationalError|AdminShutdown|terminating connection|server closed the connection|"
                    r"connection failed|Connection refused|DatabaseUnreachable|database error|"
                    r"DBOSNonExistentWorkflowError: DBOS Error 5: Non-existent")  # fmt: skip


def unexplained_tracebacks(log: str) -> list[str]:
    """The records at WARNING or above that carry a traceback not raised by the outage itself (a
    workflow of Relay's that failed as the database went is DBOS's ERROR with its frames)."""
    records: list[list[str]] = []
    for line in log.splitlines():
        if RECORD.match(line) or not records:
            records.append([line])
        else:
            records[-1].append(line)
    found = []
    for record in records:
        text = "\n".join(record)
        level = found_level.group(1) if (found_level := RECORD.match(record[0])) else ""
        if "Traceback" in text and level in ("WARNING", "ERROR", "CRITICAL") and not OUTAGE.search(text):
            found.append(text[:3000])
    return found


def registry(relay: RelayProcess) -> dict[str, dict[str, Any]]:
    with relay.api() as api:
        return {e["executorId"]: e for e in api.get("/apps/ledger/executors", params={"limit": 100}).json()}


def two_instances(
    relay_pg: PostgresServer, relays: list[RelayProcess], tmp_path: Path, grace: float
) -> tuple[str, RelayProcess, RelayProcess]:
    """Two instances, not started yet, on a new database of ``relay_pg`` (its URL), stopped after the test."""
    url = relay_pg.url(relay_pg.create_database("relay"))
    settings = {"grace": grace, "instanceLeaseSecs": LEASE, "socketCheckSecs": SOCKET_CHECK}
    r1, r2 = (RelayProcess(tmp_path, url, relay_yaml(free_port(), **settings), f"relay-{n}") for n in (1, 2))
    relays.extend((r1, r2))
    return url, r1, r2


def carried(stream: Stream, got: set[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
    """``got`` with the changes the stream carried since: (event, its action or state, executor id)."""
    for name, data in stream.drain():
        got.add((name, data.get("action") or data.get("state") or "", data.get("executorId") or ""))
    return got


def test_a_failover_that_lost_the_last_seconds_loses_only_what_was_written_in_them(
    relay_pg: PostgresServer, relays: list[RelayProcess], start_executor: StartExecutor, evidence_db: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    url, r1, r2 = two_instances(relay_pg, relays, tmp_path, GRACE)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    r1.start()
    r2.start()
    # The doomed executor holds its jobs back until just before its death (the gate): started as it
    # launched, their 3 s sleep had to outlast the mover's start, the registry's wait and the backup
    # (2.5 to 2.9 s beside a CPU burner), and with a backup 3 s slower they ended on it, before it died.
    jobs = {"RELAY_TEST_JOBS": "3", "RELAY_TEST_JOB_SLEEP": "3"}
    with TcpProxy(("127.0.0.1", r1.port)) as lb:
        peer = start_executor(r2.conductor_url, env=env)
        with jobs_held(start_executor, r1.conductor_url, tmp_path, {**env, **jobs}) as launching:
            mover = start_executor(f"ws://127.0.0.1:{lb.port}/", env=env)
            others = {peer.executor_id: "relay-2", mover.executor_id: "relay-1"}

            before = launching.await_healthy(r1, others, 20, what="the doomed executor HEALTHY too")
            t0 = relay_pg.backup()
            # A sequence logs 32 numbers ahead, so a restore takes it back only if more than that were
            # drawn since: the seconds a failover loses in production hold hundreds of changes, these
            # tens. The numbers of a busy minute, drawn (and burnt, as a rolled back write burns them).
            with psycopg.connect(url) as conn:
                conn.execute(
                    "SELECT nextval('audit_log_id_seq'), nextval('executor_changes') FROM generate_series(1, 100)"
                )
        doomed = launching.release()
        assert before == {**others, doomed.executor_id: "relay-1"}, before

        # After T0: a death and its recovery, a new executor, a reconnection elsewhere, a key, a setting.
        doomed.kill()
        evidence = Evidence(evidence_db)
        assert_eventually(lambda: len(evidence.outcomes()) == 3, 40, what="the dead executor's 3 outcomes")
        assert_eventually(lambda: doomed.executor_id not in registry(r1), 20, what="the recovery's end")
        # The console's live updates, open across the restore on each instance.
        streams = [Stream(relay, API_KEYS["acme"]).open() for relay in (r1, r2)]
        newcomer = start_executor(r2.conductor_url, env=env)
        lb.target = ("127.0.0.1", r2.port)
        lb.cut()
        after = {peer.executor_id: "relay-2", mover.executor_id: "relay-2", newcomer.executor_id: "relay-2"}
        assert_eventually(lambda: healthy_instances(r1) == after, 20)
        with r1.api() as api:
            made = api.post("/tokens/after-t0", json={"permissions": ["application.read"]})
            assert made.status_code == 201, made.text
            late_key = made.json()["token"]
            assert api.patch("/apps/ledger", json={"gcRowsThreshold": 4321}).status_code == 200
        # What the streams carried before the restore is read off them (the setting's change was the
        # last thing done): what they carry next is new.
        for stream in streams:
            stream.next(lambda name, data: name == "audit" and data["action"] == "settings.updated", 15)
            stream.drain()
        with psycopg.connect(url) as conn:
            read = conn.execute(
                "SELECT (SELECT max(id) FROM audit_log), (SELECT max(change_seq) FROM executors)"
            ).fetchone()

        relay_pg.restore(t0)
        with psycopg.connect(url) as conn:
            drawn = conn.execute(
                "SELECT (SELECT last_value FROM audit_log_id_seq), (SELECT last_value FROM executor_changes)"
            ).fetchone()
        assert read is not None and drawn is not None and drawn[0] < read[0] and drawn[1] < read[1], (read, drawn)
        live = {peer.executor_id, mover.executor_id, newcomer.executor_id}

        # The restored registry has the dead executor and the mover HEALTHY on instance 1, and not
        # the newcomer. Instance 1's socket check finds no socket for either and records them
        # lost; instance 2's finds two sockets whose rows are not its own at their epochs and
        # closes them; they reconnect (the SDK waits a second) and the mover's return ends the
        # grace period instance 1 began. Within the socket check, its settling, a reconnection
        # and margins: the registry holds every live executor again, each where its socket is.
        def settled() -> bool:
            seen = registry(r1)
            healthy = {k: v["relayInstance"] for k, v in seen.items() if v["state"] == "HEALTHY"}
            return healthy == after

        assert_eventually(settled, SOCKET_CHECK + 2.0 + 1.0 + 6.0, interval=0.2, what="the registry again")
        # The dead executor is declared DEAD again (its death was lost with the tail) and its
        # recovery sent again: its workflows are done, so nothing runs twice.
        assert_eventually(
            lambda: "executor.deleted" in audit_actions(r1, doomed.executor_id), GRACE + 15, what="recovered again"
        )
        # The streams went on: the death declared again and the newcomer recorded again reached them,
        # though the database drew their numbers again, below those the streams had read before.
        wanted = {("audit", "executor.dead", doomed.executor_id), ("executor", "HEALTHY", newcomer.executor_id)}
        for stream in streams:
            got: set[tuple[str, str, str]] = set()
            assert_eventually(
                lambda stream=stream, got=got: wanted <= carried(stream, got),
                5,
                what=f"the changes after the restore on {stream.relay.instance_id}'s stream",
            )
            assert not stream.ended.is_set()
            stream.close()
        # By then the grace period of anything recorded lost with it is over: none live died.
        for executor_id in live:
            actions = audit_actions(r1, executor_id)
            assert "executor.dead" not in actions and "recovery.dispatched" not in actions, (executor_id, actions)
        # Each workflow's outcome once, by a live executor of the app at the death: the recovery goes
        # to either (rendezvous hashing on random ids), and its frame puts the workflows back on their
        # queue, from which any executor of the app may take them.
        assert evidence.outcome_count() == 3
        assert set(evidence.outcomes().values()) <= {peer.executor_id, mover.executor_id}
        assert registry(r1).keys() == live

        # The instances kept their leases (their epochs come from the clock and the restored rows
        # had them): none fenced, adopted or restarted.
        with psycopg.connect(url) as conn:
            rows = dict(conn.execute("SELECT instance_id, lease_epoch FROM relay_instances").fetchall())
        for relay in (r1, r2):
            assert relay.proc is not None and relay.proc.poll() is None, relay.instance_id
            held = re.search(rf"instance {relay.instance_id} holds its lease \(epoch (\d+)\)", relay.log())
            assert held is not None and rows[relay.instance_id] == int(held.group(1)), (rows, relay.instance_id)
            assert f"instance {relay.instance_id} adopted" not in r1.log() + r2.log()
            assert not unexplained_tracebacks(relay.log()), unexplained_tracebacks(relay.log())

        # What was written after T0 is lost, and only that: the key made then, the setting changed then.
        with httpx.Client(verify=TLS) as client:
            answer = client.get(f"{r1.http}/v2/orgs/acme/apps", headers={"Authorization": f"Bearer {late_key}"})
        assert answer.status_code == 401, answer.text
        with r1.api() as api:
            assert api.get("/apps/ledger").json()["gcRowsThreshold"] is None


async def answering(db: Database) -> None:
    """Until the database answers again after a restart or a restore: the pool's connections died
    with the server, and each is found dead as it is taken."""
    for _ in range(100):
        try:
            await ChangeStore(db).heads()
            return
        except DatabaseError:
            await asyncio.sleep(0.1)
    raise AssertionError("the database did not answer within 10 s of coming back")


async def deaths(db: Database, prefix: str, count: int) -> None:
    """``count`` executors of acme/ledger declared dead, as many audit entries (a burst)."""
    async with db.transaction() as conn:
        await conn.execute(
            """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
               SELECT 'acme', 'ledger', 'executor.dead', %s || g, 'relay', jsonb_build_object('epoch', 1)
               FROM generate_series(1, %s) g""",
            (prefix, count),
        )


# (deaths in the lost seconds, deaths after the restore before the reader's next poll): fewer after
# than lost, and more, which draws the sequence past where the reader had read before it looks. Over
# a page below that point either way: the first poll after the restore reads a page of them in the
# overlap (reaching back to the previous poll, before the restore), and none after.
BURSTS = [(1500, 1200), (1500, 2000)]


@pytest.mark.parametrize(("lost", "after"), BURSTS, ids=["fewer-than-lost", "more-than-lost"])
def test_the_alerts_read_every_death_after_the_audit_log_went_back(
    relay_pg: PostgresServer, lost: int, after: int
) -> None:
    """The audit log's ids are drawn again after a restore, below where each instance's reader had
    read: it read the new entries only again among the last minute's (the overlap kept for entries
    committed late), a page of them per poll, so a burst of more than a page between two polls lost
    the rest. It reads on from the cursor restored with the log, page after page. It knows by the
    server's start, not by the sequence: with more ids drawn again before its next poll than were
    lost, the sequence is past its cursor already, and the entries below were never read."""
    url = relay_pg.url(relay_pg.create_database("relay"))
    rules = [{"kind": "ExecutorDead", "webhook": "http://127.0.0.1:9/", "minIntervalSecs": 0}]

    async def body(db: Database, store: AlertStore) -> set[str]:
        t0 = await asyncio.to_thread(relay_pg.backup)
        started: list[Alert] = []

        async def start(alert: Alert) -> None:
            started.append(alert)

        loops = AlertLoops(store, AlertsConfig(), lambda: True, start=start)
        loops.overlap_secs = 0.2  # the minute, shortened: each poll comes later than that after the entries
        await deaths(db, "lost-", lost)  # the lost seconds: read (up to two pages), then gone
        for _ in range(2):
            await loops.poll_events()
        assert len(started) == lost
        await asyncio.to_thread(relay_pg.restore, t0)
        started.clear()
        await answering(db)
        await deaths(db, "after-", after)
        quiet = 0  # polls in a row that started nothing
        while quiet < 2:
            await asyncio.sleep(0.3)
            before = len(started)
            await loops.poll_events()
            quiet = quiet + 1 if len(started) == before else 0
        return {a.subject["executorId"] for a in started if a.resolves is None}

    alerted = with_store(url, rules, body)
    assert len(alerted) == after and all(e.startswith("after-") for e in alerted), (
        f"{len(alerted)} of {after} deaths alerted"
    )


async def connected(db: Database, prefix: str, count: int) -> None:
    """``count`` executors of acme/ledger connected (a change number each)."""
    executors = ExecutorStore(db)
    for n in range(count):
        key = ExecutorKey("acme", "ledger", f"{prefix}{n}")
        info = ExecutorInfoReply(request_id="r", executor_id=key.executor_id, application_version="v1")
        await executors.connected(Handshake(key, info, "relay-1", "key"))


def test_a_stream_carries_every_change_after_a_restore_that_drew_more_numbers_than_it_lost(
    relay_pg: PostgresServer,
) -> None:
    """After a restore, the audit ids and the executors' change numbers are drawn again; a burst
    between the database's return and the poller's next read (deaths, executors connecting again)
    drew them past where the poller had read, so the sequences were not below it and the new
    entries and changes under that point were never sent. The poller knows by the server's start."""
    url = relay_pg.url(relay_pg.create_database("relay"))
    grant = KeyGrant("key-1", "acme", "ops", frozenset(Permission))

    async def body(db: Database, _store: AlertStore) -> tuple[set[str], set[str]]:
        hub = EventHub(ChangeStore(db), KeyRing([("digest-1", grant)]), ServerConfig())
        stream = hub.open(grant, "digest-1")
        await hub.poll()  # where it starts reading
        t0 = await asyncio.to_thread(relay_pg.backup)
        await deaths(db, "lost-", 100)  # the lost seconds: sent, then gone
        await connected(db, "lost-", 40)
        await hub.poll()
        assert stream.queue.qsize() == 140, stream.queue.qsize()
        while not stream.queue.empty():
            stream.queue.get_nowait()
        await asyncio.to_thread(relay_pg.restore, t0)
        await answering(db)
        await deaths(db, "after-", 150)  # more than were lost, before the poller reads again
        await connected(db, "after-", 60)
        audit: set[str] = set()
        executors: set[str] = set()
        for _ in range(3):
            await hub.poll()
            while not stream.queue.empty():
                change = stream.queue.get_nowait()
                assert change is not None
                (audit if change.kind == "audit" else executors).add(change.data["executorId"])
        return audit, executors

    audit, executors = with_store(url, [], body)
    after = {f"after-{n}" for n in range(1, 151)}
    assert after <= audit, f"{len(after & audit)} of the 150 deaths after the restore sent"
    after = {f"after-{n}" for n in range(60)}
    assert after <= executors, f"{len(after & executors)} of the 60 executors connected after the restore sent"


class RacedChanges(ChangeStore):
    """The real reads, with ``racing`` deaths committed between a poll's look at the heads and its
    read of the audit log, as deaths written while the poll runs are: dated after the heads' time."""

    racing = 0

    async def audit_after(self, after: int, gaps: list[int], limit: int) -> list[dict[str, Any]]:
        if self.racing:
            await deaths(self.db, "racing-", self.racing)
            self.racing = 0
        return await super().audit_after(after, gaps, limit)


def test_a_plain_restart_of_the_database_sends_no_entry_twice_and_loses_none(relay_pg: PostgresServer) -> None:
    """A restart is another server start too, and the poller reads on as after a restore: the audit
    log from where it had read (nothing went back, so nothing is sent twice), every executor again.
    Deaths committed while the last poll before the restart ran, after its look at the heads, are
    dated after that poll's time: they were sent again, found after the last read."""
    url = relay_pg.url(relay_pg.create_database("relay"))
    grant = KeyGrant("key-1", "acme", "ops", frozenset(Permission))

    async def body(db: Database, _store: AlertStore) -> tuple[list[str], set[str]]:
        changes = RacedChanges(db)
        hub = EventHub(changes, KeyRing([("digest-1", grant)]), ServerConfig())
        stream = hub.open(grant, "digest-1")
        await hub.poll()
        await deaths(db, "before-", 5)
        await connected(db, "before-", 3)
        changes.racing = 2
        await hub.poll()
        assert stream.queue.qsize() == 10, stream.queue.qsize()
        while not stream.queue.empty():
            stream.queue.get_nowait()
        await asyncio.to_thread(relay_pg.restart)
        await answering(db)
        await deaths(db, "after-", 5)
        audit: list[str] = []
        executors: set[str] = set()
        for _ in range(2):
            await hub.poll()
            while not stream.queue.empty():
                change = stream.queue.get_nowait()
                assert change is not None
                if change.kind == "audit":
                    audit.append(change.data["executorId"])
                else:
                    executors.add(change.data["executorId"])
        return audit, executors

    audit, executors = with_store(url, [], body)
    assert sorted(audit) == [f"after-{n}" for n in range(1, 6)], audit
    assert executors == {f"before-{n}" for n in range(3)}, executors  # sent again: a console shows each as it is


# The cold restore's grace period: every executor reconnects to an instance started again (the SDK
# retries each second) well within it; the deaths it waits out are those of the story.
COLD_GRACE = 4.0
COLD_SLEEP = 8.0  # the dead executors' jobs: asleep (durably) until both are dead


def test_a_restore_with_every_instance_stopped_recovers_the_dead_and_keeps_the_live(
    relay_pg: PostgresServer, relays: list[RelayProcess], start_executor: StartExecutor, evidence_db: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    """Every instance stopped, the database restored from a backup taken while a grace period and a
    recovery were in flight, the instances started again: the live executor is HEALTHY where
    its socket is, the dead ones recovered with each workflow's outcome once, the grace period
    and the recovery of the backup harmless, and a key made after it refused."""
    url, r1, r2 = two_instances(relay_pg, relays, tmp_path, COLD_GRACE)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    # Each executor holds a recovery request until the backup is taken (the gate): the recovery is in
    # flight at the backup. It goes to either executor left (rendezvous hashing on random ids): to the
    # live one, or to the one killed next, at whose death it fails and is sent again, to the live one;
    # in flight either way. Each took 3 s over it before, and the recovery ended before the backup
    # when the ghost's death, its noticing and the backup took longer than that.
    held = tmp_path / "recovery-gate"
    peers = {**env, "RELAY_TEST_RECOVERY_GATE": str(held)}
    jobs = {**peers, "RELAY_TEST_JOBS": "2", "RELAY_TEST_JOB_SLEEP": str(COLD_SLEEP)}
    # The ghost holds its jobs back until just before its death (the gate): started as it launched,
    # their sleep had to outlast the three executors' start, the dying one's grace period and its
    # recovery's dispatch, 4.3 s of the 8 beside a CPU burner and more as the starts spread out.
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(RelayProcess.start, (r1, r2)))
        starting = [
            pool.submit(start_executor, r1.conductor_url, env=peers),
            pool.submit(start_executor, r1.conductor_url, env={**jobs, "RELAY_TEST_JOB_PREFIX": "dying"}),
        ]
        with jobs_held(
            start_executor, r2.conductor_url, tmp_path, {**jobs, "RELAY_TEST_JOB_PREFIX": "ghost"}
        ) as ghosting:
            live, dying = (f.result() for f in starting)
            owners = {live.executor_id: "relay-1"}
            known = {**owners, dying.executor_id: "relay-1"}

            everyone = ghosting.await_healthy(r1, known, 20, what="the ghost HEALTHY too")
            # At the backup: one executor's recovery in flight (its jobs asleep on a peer), another's grace.
            dying.kill()
            assert_eventually(
                lambda: "recovery.dispatched" in audit_actions(r1, dying.executor_id),
                COLD_GRACE + 10,
                what="a recovery",
            )
    ghost = ghosting.release()
    assert everyone == {**known, ghost.executor_id: "relay-2"}, everyone
    ghost.kill()
    assert_eventually(lambda: r1.state_of("acme", "ledger", ghost.executor_id) == "DISCONNECTED", 5)
    try:
        t0 = relay_pg.backup()
    finally:
        held.touch()
    with psycopg.connect(url) as conn:
        states = dict(conn.execute("SELECT executor_id, state FROM executors").fetchall())
        running = conn.execute(
            "SELECT count(*) FROM dbos.workflow_status WHERE status = 'PENDING' AND name LIKE '%%recover%%'"
        ).fetchone()
    assert states.get(ghost.executor_id) == "DISCONNECTED" and states.get(dying.executor_id) in (
        "DEAD",
        "RECOVERING",
    ), states
    with r1.api() as api:
        made = api.post("/tokens/after-t0", json={"permissions": ["application.read"]})
        assert made.status_code == 201, made.text
        late_key = made.json()["token"]

    # Every instance stopped; the database restored; the instances started again.
    for relay in (r1, r2):
        relay.stop()
    relay_pg.restore(t0)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(RelayProcess.start, (r1, r2)))

    # The live executor connects again, where it connected before, and stays HEALTHY.
    assert_eventually(
        lambda: healthy_instances(r1) == owners,
        COLD_GRACE + 10,
        what="the live executor HEALTHY again",
    )
    # The dead: the recovery in flight at the backup and the grace period then go on; each executor
    # is recovered and deleted, and each of its workflows has its outcome once, by the live executor.
    evidence = Evidence(evidence_db)
    assert_eventually(lambda: len(evidence.outcomes()) == 4, COLD_SLEEP + 20, what="the dead executors' 4 outcomes")
    assert_eventually(
        lambda: registry(r1).keys() == owners.keys(), COLD_GRACE + 15, what="the dead executors recovered"
    )
    assert evidence.outcome_count() == 4
    assert set(evidence.outcomes().values()) <= set(owners), (evidence.outcomes(), running)
    for executor_id in owners:
        actions = audit_actions(r1, executor_id)
        assert "executor.dead" not in actions and "recovery.dispatched" not in actions, (executor_id, actions)
    for relay in (r1, r2):
        assert not unexplained_tracebacks(relay.log()), unexplained_tracebacks(relay.log())
    with httpx.Client(verify=TLS) as client:
        answer = client.get(f"{r1.http}/v2/orgs/acme/apps", headers={"Authorization": f"Bearer {late_key}"})
    assert answer.status_code == 401, answer.text
