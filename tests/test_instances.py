"""Several Relay instances on one PostgreSQL (contract rule 5): routing of requests
between instances, ownership moving with a reconnect, adoption of a dead
instance, and fencing of a paused one. Real processes throughout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from websockets.exceptions import InvalidStatus

from harness.executors import Evidence, ExecutorProcess, jobs_held
from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.proxy import TcpProxy
from harness.relay import RelayProcess, audit_actions, listeners_paused, relay_yaml
from harness.simulated import SimulatedPeer, open_socket
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.config import RetentionConfig
from relay.errors import RequestNotServed
from relay.store.db import Database
from relay.store.executors import ExecutorStore
from relay.store.instances import InstanceStore
from relay.store.lease import Lease
from relay.store.retention import RetentionStore
from tests.prom import AUTH

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


def ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def instances(start_relay: StartRelay, n: int, **settings: Any) -> list[RelayProcess]:
    """``n`` instances on one database, each on its own port."""
    grace = settings.pop("grace", 30)
    return [
        start_relay(relay_yaml(free_port(), grace=grace, **settings), instance_id=f"relay-{i + 1}") for i in range(n)
    ]


def executor(relay: RelayProcess, executor_id: str) -> dict[str, Any] | None:
    return relay.executor("acme", "ledger", executor_id)


def audit(relay: RelayProcess, **params: Any) -> list[dict[str, Any]]:
    with relay.api() as api:
        entries: list[dict[str, Any]] = api.get("/audit", params={"limit": 1000, **params}).json()
    return entries


def relay_workflow(relay: RelayProcess, workflow_id_like: str) -> list[tuple[str, str, str]]:
    """(workflow id, status, executor id) of Relay's own DBOS workflows matching a LIKE pattern."""
    with psycopg.connect(relay.database_url) as conn:
        rows = conn.execute(
            "SELECT workflow_uuid, status, executor_id FROM dbos.workflow_status WHERE workflow_uuid LIKE %s",
            (workflow_id_like,),
        ).fetchall()
    return [(str(w), str(s), str(e)) for w, s, e in rows]


def metric(relay: RelayProcess, name: str) -> float:
    for line in httpx.get(f"{relay.http}/metrics", headers=AUTH, timeout=5, verify=TLS).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_a_recovery_frame_reaches_the_peer_through_the_instance_holding_its_socket(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, tmp_path: Path
) -> None:
    r1, r2, r3 = instances(start_relay, 3, grace=1.0, instanceLeaseSecs=3.0)
    recoveries_log = tmp_path / "peer-recoveries.jsonl"
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    peer = start_executor(r2.conductor_url, env={**env, "RELAY_TEST_RECOVERY_LOG": str(recoveries_log)})
    dead = start_executor(r1.conductor_url, env={**env, "RELAY_TEST_JOBS": "5", "RELAY_TEST_JOB_SLEEP": "2"})
    assert_eventually(lambda: (executor(r3, peer.executor_id) or {}).get("relayInstance") == "relay-2", 10)
    assert_eventually(lambda: (executor(r3, dead.executor_id) or {}).get("relayInstance") == "relay-1", 10)

    # Any instance answers for any executor: instance 3 asks the peer through instance 2.
    with r3.api() as api:
        resp = api.get(f"/apps/ledger/executors/{peer.executor_id}/workflows")
    assert resp.status_code == 200, resp.text
    assert isinstance(resp.json(), list)

    dead.kill()
    evidence = Evidence(evidence_db)
    outcomes = assert_eventually(lambda: len(o := evidence.outcomes()) >= 5 and o, 40, what="5 outcomes")
    assert set(outcomes.values()) == {peer.executor_id}
    assert len(outcomes) == 5

    # The grace period and the recovery ran on instance 1, which owned the dead executor's
    # connection; the frames went out through instance 2, and the peer served them.
    rid = f"recovery:acme:ledger:{dead.executor_id}:%"
    assert_eventually(lambda: [w[1] for w in relay_workflow(r1, rid)] == ["SUCCESS"], 10)
    assert [w[2] for w in relay_workflow(r1, rid)] == ["relay-1"]
    assert [w[2] for w in relay_workflow(r1, f"grace:acme:ledger:{dead.executor_id}:%")] == ["relay-1"]
    served = [json.loads(line) for line in recoveries_log.read_text().splitlines()]
    assert [s["executor_ids"] for s in served] == [[dead.executor_id]]
    assert metric(r2, "relay_requests_relayed_total") >= 2  # the recovery frame and its verification
    assert metric(r3, "relay_requests_relayed_total") == 0

    actions = audit_actions(r2, dead.executor_id)
    assert actions.count("executor.deleted") == 1
    assert actions.count("recovery.succeeded") == 1
    assert executor(r2, dead.executor_id) is None
    with r3.api() as api:
        (recovery,) = api.get("/apps/ledger/recoveries", params={}).json()
    assert recovery["status"] == "succeeded"
    assert [a["peerExecutorId"] for a in recovery["attempts"]] == [peer.executor_id]


def test_a_reconnect_through_another_instance_moves_ownership_and_ends_the_old_grace_period(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    r1, r2 = instances(start_relay, 2, grace=6.0, instanceLeaseSecs=3.0)
    with TcpProxy(("127.0.0.1", r1.port)) as proxy:
        ex = start_executor(f"ws://127.0.0.1:{proxy.port}/")
        assert_eventually(lambda: (executor(r2, ex.executor_id) or {}).get("relayInstance") == "relay-1", 10)
        proxy.partition()
        first = assert_eventually(
            lambda: (rec := executor(r2, ex.executor_id)) and rec["state"] == "DISCONNECTED" and rec, 10
        )
        grace = f"grace:acme:ledger:{ex.executor_id}:%"
        assert_eventually(lambda: [w[1] for w in relay_workflow(r1, grace)] == ["PENDING"], 5)
        # The network heals, but the load balancer now sends the executor to instance 2.
        proxy.target = ("127.0.0.1", r2.port)
        proxy.heal()
        back = assert_eventually(
            lambda: (rec := executor(r1, ex.executor_id)) and rec["state"] == "HEALTHY" and rec, 10
        )
        assert back["relayInstance"] == "relay-2"
        # Instance 1's grace period was told through the database, long before its deadline.
        assert_eventually(lambda: [w[1] for w in relay_workflow(r1, grace)] == ["SUCCESS"], 3)
        # Ended before its deadline: timed by its own end, not by when this test saw it (later).
        with psycopg.connect(r1.database_url) as conn:
            row = conn.execute("SELECT updated_at FROM dbos.workflow_status WHERE workflow_uuid LIKE %s", (grace,))
            (ended_ms,) = row.fetchone() or (None,)
        assert ended_ms is not None and ended_ms / 1000 < ts(first["disconnectedAt"]) + 6.0
        time.sleep(max(0.0, ts(first["disconnectedAt"]) + 7.0 - time.time()))
        assert executor(r1, ex.executor_id)["state"] == "HEALTHY"  # type: ignore[index]
        assert "executor.dead" not in audit_actions(r1, ex.executor_id)


def test_a_killed_instance_is_adopted_and_its_executors_die_at_their_deadlines(
    tmp_path: Path, start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    lease, grace = 2.0, 5.0
    r1, r2, r3 = instances(start_relay, 3, grace=grace, instanceLeaseSecs=lease)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    # The doomed executor holds its jobs back until just before its death (the gate): started as it
    # launched, their 6 s sleep had to outlast the next executor's start and the registry's waits, and
    # ended on it, before it died, when a loaded machine took longer. Their 1 s sleep now has to outlast
    # only the moment from READY to the kill.
    jobs = {"RELAY_TEST_JOBS": "4", "RELAY_TEST_JOB_SLEEP": "1"}
    peer = start_executor(r2.conductor_url, env=env)
    with jobs_held(start_executor, r1.conductor_url, tmp_path, {**env, **jobs}) as held:
        # Connected only to instance 1: once it is gone, this one cannot reconnect anywhere.
        stranded = start_executor(r1.conductor_url, env=env)
        known = {peer.executor_id: "relay-2", stranded.executor_id: "relay-1"}
        everyone = held.await_healthy(r3, known, 10, what="the doomed executor on relay-1 too")
    doomed = held.release()
    assert everyone == {**known, doomed.executor_id: "relay-1"}, everyone

    doomed.kill()
    disconnected = assert_eventually(
        lambda: (rec := executor(r2, doomed.executor_id)) and rec["state"] == "DISCONNECTED" and rec, 10
    )
    deadline = ts(disconnected["disconnectedAt"]) + grace
    assert_eventually(lambda: relay_workflow(r1, f"grace:acme:ledger:{doomed.executor_id}:%"), 5)
    assert r1.proc is not None
    r1.proc.kill()  # kill -9 while it runs the grace period
    killed_at = time.time()
    r1.proc.wait()

    adopted = assert_eventually(lambda: [e for e in audit(r2) if e["action"] == "relay.instance_adopted"], 15)
    assert len(adopted) == 1
    assert adopted[0]["detail"]["instance"] == "relay-1"
    adopter = adopted[0]["detail"]["adoptedBy"]
    assert adopter in ("relay-2", "relay-3")
    assert adopted[0]["detail"]["executors"] == 2
    # The lease, a scan interval (lease / 3), and the 2 s the chaos checker allows a loaded machine.
    assert ts(adopted[0]["at"]) - killed_at < lease + lease / 3 + 2.0

    # The dead instance's grace period resumed on the adopter, with its original deadline.
    dead = assert_eventually(
        lambda: [e for e in audit(r2, executorId=doomed.executor_id) if e["action"] == "executor.dead"], 15
    )
    assert deadline - 0.2 <= ts(dead[0]["at"]) <= deadline + lease
    # The one that never reconnected got its grace period from the adopter.
    rec = assert_eventually(lambda: executor(r2, stranded.executor_id), 5)
    assert rec["relayInstance"] == adopter
    stranded_dead = assert_eventually(
        lambda: [e for e in audit(r2, executorId=stranded.executor_id) if e["action"] == "executor.dead"], 20
    )
    assert ts(stranded_dead[0]["at"]) >= ts(adopted[0]["at"]) + grace - 0.2

    # And the doomed executor's workflows ran to completion on the peer, exactly once.
    evidence = Evidence(evidence_db)
    outcomes = assert_eventually(lambda: len(o := evidence.outcomes()) >= 4 and o, 30, what="4 outcomes")
    # Any live executor of the version may take the recovered workflows off DBOS's queue.
    assert set(outcomes.values()) <= {peer.executor_id, stranded.executor_id}
    assert len(outcomes) == evidence.outcome_count() == 4
    # The recovered workflows may end on the peer before Relay has verified the recovery and deleted
    # the record: awaited, not read at once.
    assert_eventually(
        lambda: audit_actions(r2, doomed.executor_id).count("executor.deleted") == 1, 10, what="doomed deleted once"
    )
    # Each grace period ran on the adopter: the dead instance's queue has no listener, and the
    # adopter's repair sweep moved them onto its own. DBOS records a grace period's end after its
    # executor.dead (stranded's may be moments old): awaited.
    for ex in (doomed, stranded):
        assert_eventually(
            lambda ex=ex: (
                [w[1:] for w in relay_workflow(r2, f"grace:acme:ledger:{ex.executor_id}:%")] == [("SUCCESS", adopter)]
            ),
            10,
            what=f"{ex.executor_id}'s grace period ended on the adopter",
        )
    assert metric(r2 if adopter == "relay-2" else r3, "relay_instances_adopted_total") == 1


def test_a_takeover_cut_short_is_carried_to_the_next_adopter_and_forgotten_once_done(
    start_relay: StartRelay,
) -> None:
    """An adopter that commits its adoption and dies before handing the dead instance's workflows
    back to DBOS passes that instance on to its own adopter, which takes them over; from then on no
    adoption carries it, and retention forgets both instances (growth review: an adoption carried
    every instance ever adopted, and their rows were never deleted)."""
    lease = 2.0
    (r1,) = instances(start_relay, 1, grace=120.0, instanceLeaseSecs=lease)
    url = f"ws://127.0.0.1:{r1.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "left-behind", "answer"):
        assert_eventually(lambda: r1.state_of("acme", "ledger", "left-behind") == "HEALTHY", 10)
    # Its grace period runs on relay-1: a DBOS workflow PENDING under relay-1's executor id.
    grace = "grace:acme:ledger:left-behind:%"
    assert_eventually(lambda: [w[1:] for w in relay_workflow(r1, grace)] == [("PENDING", "relay-1")], 15)
    assert r1.proc is not None
    r1.proc.kill()
    r1.proc.wait()

    async def adopt_and_die() -> None:
        """relay-b adopts relay-1 and dies at once: its takeover never begins."""
        db = Database(r1.database_url)
        await db.open()
        b = Lease(db, "relay-b", lease)
        try:
            store = InstanceStore(db, ExecutorStore(db))
            await b.acquire()
            expired: list[tuple[str, int]] = []
            deadline = time.monotonic() + 15
            while not (expired := await store.expired("relay-b")):
                assert time.monotonic() < deadline, "relay-1's lease never expired"
                await asyncio.sleep(0.1)
            assert [i for i, _ in expired] == ["relay-1"]
            assert await store.adopt("relay-b", *expired[0]) is not None
            # Old enough for retention, but relay-1 still has its grace period to be taken over.
            await _adopted_long_ago(db)
            await RetentionStore(db).prune(SHORT_RETENTION)
            assert await _instance_ids(db) == ["relay-1", "relay-b"]
        finally:
            await b._drop()  # its connection goes as a crash's would: no lease.stop(), the lease runs out
            await db.close()

    asyncio.run(adopt_and_die())
    r2 = start_relay(relay_yaml(free_port(), grace=120.0, instanceLeaseSecs=lease), instance_id="relay-2")

    def adoptions_of(instance: str) -> list[dict[str, Any]]:
        return [e for e in audit(r2) if e["action"] == "relay.instance_adopted" and e["detail"]["instance"] == instance]

    adopted = assert_eventually(lambda: adoptions_of("relay-b"), 20)
    assert adopted[0]["detail"]["adoptedBy"] == "relay-2"
    assert adopted[0]["detail"]["inherited"] == ["relay-1"]
    # relay-2 took relay-1's grace period over: it runs there, and the executor's return ends it.
    assert_eventually(lambda: [w[1:] for w in relay_workflow(r2, grace)] == [("PENDING", "relay-2")], 15)
    with SimulatedPeer(f"ws://127.0.0.1:{r2.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}", "left-behind", "answer"):
        assert_eventually(lambda: [w[1:] for w in relay_workflow(r2, grace)] == [("SUCCESS", "relay-2")], 15)

    async def forget() -> list[str]:
        db = Database(r2.database_url)
        await db.open()
        try:
            deadline = time.monotonic() + 15
            while await InstanceStore(db, ExecutorStore(db)).adopted_by("relay-2"):
                assert time.monotonic() < deadline, "relay-2 still has instances to take over"
                await asyncio.sleep(0.1)
            await _adopted_long_ago(db)
            await RetentionStore(db).prune(SHORT_RETENTION)
            return await _instance_ids(db)
        finally:
            await db.close()

    assert asyncio.run(forget()) == ["relay-2"]
    with r2.api() as api:
        assert [i["instanceId"] for i in api.get("/instances").json()] == ["relay-2"]


SHORT_RETENTION = RetentionConfig(
    audit_days=1e-5, recoveries_days=1e-5, relay_workflows_days=1e-5, executor_ids_days=1e-5, app_metrics_days=1e-5
)


async def _adopted_long_ago(db: Database) -> None:
    """Wait until every adoption is older than SHORT_RETENTION's age, by the database's clock."""
    deadline = time.monotonic() + 15
    while True:
        async with db.connection() as conn:
            cur = await conn.execute(
                """SELECT coalesce(bool_and(adopted_at < now() - make_interval(secs => %s * 86400)), true) AS old
                   FROM relay_instances WHERE adopted_by IS NOT NULL""",
                (SHORT_RETENTION.executor_ids_days,),
            )
            row = await cur.fetchone()
        if row is not None and row["old"]:
            return
        assert time.monotonic() < deadline, "the adoptions never grew older than retention's age"
        await asyncio.sleep(0.1)


async def _instance_ids(db: Database) -> list[str]:
    async with db.connection() as conn:
        cur = await conn.execute("SELECT instance_id FROM relay_instances ORDER BY instance_id")
        return [str(r["instance_id"]) for r in await cur.fetchall()]


def registry_snapshot(url: str) -> tuple[list[tuple[Any, ...]], int]:
    """Every executor row, and the last audit id: what a write by Relay would change."""
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT * FROM executors ORDER BY org, app, executor_id").fetchall()
        last = conn.execute("SELECT coalesce(max(id), 0) FROM audit_log").fetchone()
    assert last is not None
    return rows, int(last[0])


def test_a_paused_instance_resumed_after_adoption_makes_no_write_and_exits(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    lease = 1.5
    r1, r2 = instances(start_relay, 2, grace=60.0, instanceLeaseSecs=lease, pingWaitSecs=1.0)
    held = start_executor(r1.conductor_url)
    assert_eventually(lambda: (executor(r2, held.executor_id) or {}).get("relayInstance") == "relay-1", 10)
    r1.signal(signal.SIGSTOP)
    adopted = assert_eventually(lambda: [e for e in audit(r2) if e["action"] == "relay.instance_adopted"], 10)
    assert adopted[0]["detail"]["adoptedBy"] == "relay-2"
    rec = executor(r2, held.executor_id)
    assert rec is not None and rec["state"] == "DISCONNECTED" and rec["relayInstance"] == "relay-2"

    # Work waits for the paused instance: a new executor's handshake sits in its socket
    # backlog, and its liveness check will find the held executor silent.
    newcomer = start_executor(r1.conductor_url)
    time.sleep(0.5)
    before = registry_snapshot(r2.database_url)
    r1.signal(signal.SIGCONT)
    assert r1.proc is not None
    assert r1.proc.wait(15) == 3
    assert "lease taken over by another instance; exiting" in r1.log()
    time.sleep(0.5)
    assert registry_snapshot(r2.database_url) == before
    assert executor(r2, newcomer.executor_id) is None
    # The survivor still owns the held executor's timer.
    rec = executor(r2, held.executor_id)
    assert rec is not None and rec["relayInstance"] == "relay-2"


def lonely_on_instance_1(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> tuple[RelayProcess, ExecutorProcess]:
    """Instance 2 of two, and one executor with two jobs, on instance 1, which instance 2 has seen.

    A long lease: an instance does not look for blocked recoveries in the database during the
    test (it does every third of a lease once it has held one whole), so instance 2 can know of
    one blocked on instance 1 only from instance 1's notification."""
    r1, r2 = instances(start_relay, 2, grace=1.0, instanceLeaseSecs=60)
    env = {"RELAY_TEST_EVIDENCE": evidence_db, "RELAY_TEST_JOBS": "2", "RELAY_TEST_JOB_SLEEP": "1"}
    lonely = start_executor(r1.conductor_url, env=env)
    assert_eventually(lambda: executor(r2, lonely.executor_id), 10)
    return r2, lonely


def assert_recovered_by(evidence_db: str, peer: ExecutorProcess) -> None:
    outcomes = assert_eventually(lambda: len(o := Evidence(evidence_db).outcomes()) >= 2 and o, 20)
    assert set(outcomes.values()) == {peer.executor_id}


def test_a_peer_joining_another_instance_wakes_a_blocked_recovery_at_once(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    r2, lonely = lonely_on_instance_1(start_relay, start_executor, evidence_db)
    lonely.kill()
    blocked = assert_eventually(
        lambda: (rec := executor(r2, lonely.executor_id)) and rec["blockedReason"] == "no_healthy_peer" and rec, 15
    )
    assert blocked["relayInstance"] == "relay-1"  # its recovery waits on instance 1
    peer = start_executor(r2.conductor_url, env={"RELAY_TEST_EVIDENCE": evidence_db})
    joined = time.time()
    assert_eventually(lambda: "executor.deleted" in audit_actions(r2, lonely.executor_id), 20)
    # Well before the blocked recovery's own periodic re-check (30 s).
    assert time.time() - joined < 10
    assert_recovered_by(evidence_db, peer)


def test_an_instance_that_learns_of_a_blocked_recovery_after_its_peer_connected_wakes_it(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    r2, lonely = lonely_on_instance_1(start_relay, start_executor, evidence_db)
    # The instances' listening connections stop reading: the notification that the recovery
    # waits is held in PostgreSQL until they resume, so instance 2 learns of it only after
    # the peer has connected there (and its connection found nothing to wake).
    with listeners_paused(r2.database_url, 2):
        lonely.kill()
        assert_eventually(
            lambda: (executor(r2, lonely.executor_id) or {}).get("blockedReason") == "no_healthy_peer", 15
        )
        peer = start_executor(r2.conductor_url, env={"RELAY_TEST_EVIDENCE": evidence_db})
        assert_eventually(lambda: (executor(r2, peer.executor_id) or {}).get("relayInstance") == "relay-2", 10)
        time.sleep(1.0)  # its connection is handled, and woke nothing
        with r2.api() as api:
            (recovery,) = api.get("/apps/ledger/recoveries").json()
        assert recovery["status"] == "waiting_for_peer"
    resumed = time.time()
    assert_eventually(lambda: "executor.deleted" in audit_actions(r2, lonely.executor_id), 20)
    # The notification woke it, not the 30 s re-check (the recovery is done in this time too: as
    # above, 10 s leaves a loaded machine room for it and is still far from the re-check).
    assert time.time() - resumed < 10
    assert_recovered_by(evidence_db, peer)


def test_a_request_to_a_frozen_instance_is_withdrawn_and_sent_where_the_peer_reconnected(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    r1, r2 = instances(start_relay, 2, grace=0.5, instanceLeaseSecs=8.0, recoveryAckTimeoutSecs=30)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    with TcpProxy(("127.0.0.1", r1.port)) as proxy:
        peer = start_executor(f"ws://127.0.0.1:{proxy.port}/", env=env)
        doomed = start_executor(r2.conductor_url, env={**env, "RELAY_TEST_JOBS": "2", "RELAY_TEST_JOB_SLEEP": "3"})
        assert_eventually(lambda: (executor(r2, peer.executor_id) or {}).get("relayInstance") == "relay-1", 10)
        assert_eventually(lambda: executor(r2, doomed.executor_id), 10)
        # Instance 1 freezes with the peer's socket; its lease still has seconds to run, so
        # the recovery on instance 2 sends the frame its way, and nobody picks it up.
        r1.signal(signal.SIGSTOP)
        doomed.kill()
        killed = time.time()
        time.sleep(1.5)
        # The peer's connection breaks; through the load balancer it reaches instance 2.
        proxy.target = ("127.0.0.1", r2.port)
        proxy.cut()
        assert_eventually(lambda: (executor(r2, peer.executor_id) or {}).get("relayInstance") == "relay-2", 10)
        assert_eventually(lambda: "executor.deleted" in audit_actions(r2, doomed.executor_id), 20)
        took = time.time() - killed
        with r2.api() as api:
            (recovery,) = api.get("/apps/ledger/recoveries").json()
        # One attempt, answered once the request was withdrawn from instance 1 and sent through
        # instance 2: not a 30 s acknowledgement timeout and a failover.
        assert [(a["peerExecutorId"], a["outcome"]) for a in recovery["attempts"]] == [(peer.executor_id, "succeeded")]
        assert took < 12
        r1.signal(signal.SIGCONT)
    evidence = Evidence(evidence_db)
    outcomes = assert_eventually(lambda: len(o := evidence.outcomes()) >= 2 and o, 20)
    assert set(outcomes.values()) == {peer.executor_id}


def test_an_instance_cut_off_from_the_database_does_not_get_its_live_executors_declared_dead(
    start_executor: StartExecutor, tmp_path: Path
) -> None:
    """Instance 1 loses its database (a network cut) but not its executors. Its lease runs out and
    instance 2 adopts it; the executor's socket on instance 1 is open and answering all along, so
    the executor's connection was never gone (the contract: an executor is declared dead "when its
    connection has been gone longer than the application's grace period"). Instance 1, which knows
    its lease is lost, should let its executors go (close their sockets) so that they reconnect
    through the load balancer to a live instance, rather than hold them until the adopter's grace
    period declares them DEAD and recovers their workflows while they still run."""
    from harness.pgserver import PostgresServer

    lease, grace = 1.5, 2.0
    server = PostgresServer("relay-cut")
    started: list[RelayProcess] = []
    try:
        database = server.create_database("relay")
        with TcpProxy(("127.0.0.1", server.port)) as pg, TcpProxy(("127.0.0.1", 1)) as lb:
            config = relay_yaml(free_port(), grace=grace, instanceLeaseSecs=lease)
            r1 = RelayProcess(tmp_path, server.url(database, pg.port), config, "relay-1")
            started.append(r1.start())
            config = relay_yaml(free_port(), grace=grace, instanceLeaseSecs=lease)
            r2 = RelayProcess(tmp_path, server.url(database), config, "relay-2")
            started.append(r2.start())
            lb.target = ("127.0.0.1", r1.port)
            ex = start_executor(f"ws://127.0.0.1:{lb.port}/")
            assert_eventually(lambda: (executor(r2, ex.executor_id) or {}).get("relayInstance") == "relay-1", 10)
            # The load balancer's health check (/readyz) takes instance 1 out once its lease is lost.
            lb.target = ("127.0.0.1", r2.port)
            pg.partition()
            assert_eventually(lambda: [e for e in audit(r2) if e["action"] == "relay.instance_adopted"], 15)
            time.sleep(grace + 2.0)  # past the adopter's grace period, and a margin
            assert "executor.dead" not in audit_actions(r2, ex.executor_id)
            rec = executor(r2, ex.executor_id)
            assert rec is not None and rec["state"] == "HEALTHY" and rec["relayInstance"] == "relay-2", rec
            assert "closing its 1 executor sockets so that they reconnect to a live instance" in r1.log()
            pg.heal()
            # Back on the database, instance 1 finds itself adopted and exits, as a paused one does.
            assert r1.proc is not None and r1.proc.wait(10) == 3
    finally:
        for relay in started:
            relay.stop()
        server.close()


def test_a_relayed_request_the_owner_cannot_read_is_answered_with_an_error_not_left_to_time_out(
    start_relay: StartRelay,
) -> None:
    """A request handed to the instance holding the socket that this instance cannot read (a
    message type of a newer Relay, during a rolling upgrade; a row it cannot parse) is claimed and
    then dropped (``Router._serve`` logs it and returns): the asking instance hears nothing and
    waits out its whole timeout (5 s an executor, 25 s a workflow API request) for a 502 saying
    the executor did not answer, which is false. The owner should write the error back at once."""
    from relay.net.router import channel

    relay = start_relay(relay_yaml(free_port()), instance_id="relay-1")
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        row = conn.execute(
            """WITH r AS (
                   INSERT INTO relay_rpc (target_instance, requester_instance, org, app, executor_id,
                                          request, timeout_secs, request_id)
                   VALUES ('relay-1', 'relay-2', 'acme', 'ledger', 'ex-1', %s, 20, 'on-call-7') RETURNING id)
               SELECT id, pg_notify(%s, id::text) FROM r""",
            (json.dumps({"type": "a_message_of_a_newer_release", "request_id": "q-1"}), channel("relay-1")),
        ).fetchone()
        assert row is not None
        rpc_id = row[0]

        def state() -> tuple[Any, Any, Any]:
            got = conn.execute(
                "SELECT picked_at, answered_at, error_kind FROM relay_rpc WHERE id = %s", (rpc_id,)
            ).fetchone()
            assert got is not None
            return got[0], got[1], got[2]

        assert_eventually(lambda: state()[0] is not None, 5, what="the owner claims the request")
        # Answered at once, well within the asker's timeout (20 s).
        assert_eventually(lambda: state()[1] is not None, 2.0, what="the claimed request answered")
        assert state()[2] == "unserved"
        error = conn.execute("SELECT error FROM relay_rpc WHERE id = %s", (rpc_id,)).fetchone()
        assert error is not None and "could not serve it: unknown message type" in error[0], error
    # The owner's line about it carries the id of the HTTP request it served, which the asker's have.
    (line,) = [line for line in relay.log().splitlines() if f"cannot serve relayed request {rpc_id}:" in line]
    assert line.endswith(" [req=on-call-7]"), line


def test_an_asker_reads_an_unserved_request_as_a_502_that_says_why_and_an_unknown_kind_as_gone() -> None:
    """The asker's side of the test above: ``unserved`` is a :class:`RequestNotServed` (the API's
    502, with the owner's reason); a kind of a newer release still fails at once, as ``gone``."""
    from relay.core.ids import ExecutorKey
    from relay.errors import ExecutorGone
    from relay.net.router import Router

    key = ExecutorKey("acme", "ledger", "ex-1")
    why = "instance relay-1, holding the socket of executor acme/ledger/ex-1, could not serve it: unknown message type"
    with pytest.raises(RequestNotServed, match="could not serve it: unknown message type"):
        Router._reply_of(key, "relay-1", {"error_kind": "unserved", "error": why, "reply": None})
    with pytest.raises(ExecutorGone, match="asked through instance relay-1"):
        Router._reply_of(key, "relay-1", {"error_kind": "a_kind_of_a_newer_release", "error": why, "reply": None})


@pytest.mark.parametrize("then", ["killed", "restarted"])
def test_a_routed_request_whose_claiming_instance_is_killed_is_answered_at_once_not_at_its_timeout(
    start_relay: StartRelay, then: str
) -> None:
    """Instance 2 asks an executor whose socket instance 1 holds; instance 1 claims the request,
    sends the frame (the executor never answers) and is killed (-9) before answering, and maybe
    started again at once by its process manager (a new process, which knows nothing of the
    claim, renewing the same lease). Nobody will ever write the answer: the asker should notice
    that the claimer is gone (its lease ran out, or it started again) and answer at once, not
    wait out its whole timeout (60 s here) for a false "did not answer"."""
    lease = 4.0
    r1, r2 = instances(start_relay, 2, instanceLeaseSecs=lease, recoveryAckTimeoutSecs=60)
    url = f"ws://127.0.0.1:{r1.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with (
        SimulatedPeer(url, "hangs-1", on_recovery="silent", others="silent") as hangs,
        psycopg.connect(r2.database_url, autocommit=True) as conn,
    ):
        assert_eventually(lambda: (executor(r2, "hangs-1") or {}).get("relayInstance") == "relay-1", 10)

        # This test's request, told from the app figures' own asks of the same silent executor.
        ours = """SELECT count(*) FROM relay_rpc WHERE requester_instance = 'relay-2'
                  AND executor_id = 'hangs-1' AND request::jsonb->>'type' = 'list_workflows'"""

        def claimed() -> bool:
            row = conn.execute(ours + " AND picked_at IS NOT NULL").fetchone()
            return row is not None and row[0] == 1 and hangs.requests["list_workflows"] == 1

        def ask() -> tuple[httpx.Response, float]:
            with r2.api() as api:
                resp = api.get("/apps/ledger/executors/hangs-1/workflows", timeout=90)
            return resp, time.time()

        pool = ThreadPoolExecutor(1)
        try:
            answer = pool.submit(ask)
            assert_eventually(claimed, 10, what="instance 1 claims the request and sends the frame")
            # A live claimer is waited for, past several looks at its lease.
            time.sleep(lease * 2 / 3)
            assert not answer.done(), answer.result()[0].text
            assert r1.proc is not None
            killed = time.time()
            r1.proc.kill()
            r1.proc.wait()
            if then == "restarted":
                r1.start()
            try:
                resp, answered = answer.result(timeout=lease + 10)
            except TimeoutError:
                pytest.fail(f"no answer {lease + 10:g}s after the claimer was {then} (the ask's timeout is 60 s)")
            took = answered - killed
        finally:
            pool.shutdown(wait=False)
        # The claimer's lease runs out within ``lease`` (unless renewed by the new process, which
        # started after the claim); the asker looks every third of it.
        assert took < lease + 4, took
        assert resp.status_code == 409, resp.text
        assert "executor_not_connected" in resp.text and "relay-1" in resp.text, resp.text
        # Withdrawn by the asker: nothing left for a revived claimer to answer, and sent once.
        row = conn.execute(ours).fetchone()
        assert row is not None and row[0] == 0
        assert hangs.requests["list_workflows"] == 1


@contextlib.contextmanager
def an_owner_that_cannot_serve(database_url: str, executor_id: str) -> Iterator[list[str | None]]:
    """An instance ``relay-9`` (live lease) holding the socket of ``executor_id``, played through the
    database: it claims each request relayed to it and writes back ``unserved``, as an instance of
    another release does with a message type it cannot read. Yields the HTTP request ids of the
    requests it claimed, as their rows carried them."""
    from relay.net.router import channel

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            """INSERT INTO relay_instances (instance_id, lease_epoch, lease_expires_at, started_at, renewed_at)
               VALUES ('relay-9', 1, now() + interval '1 hour', now(), now())"""
        )
        conn.execute(
            """INSERT INTO executors (org, app, executor_id, state, application_version, connected_at,
                                      relay_instance)
               VALUES ('acme', 'ledger', %s, 'HEALTHY', 'v1', now(), 'relay-9')""",
            (executor_id,),
        )
    stop = threading.Event()
    request_ids: list[str | None] = []

    def serve() -> None:
        why = f"instance relay-9, holding the socket of executor {executor_id}, could not serve it: unknown type"
        with psycopg.connect(database_url, autocommit=True) as conn:
            while not stop.wait(0.05):
                claimed = conn.execute(
                    """UPDATE relay_rpc SET picked_at = now(), answered_at = now(), error_kind = 'unserved',
                              error = %s
                       WHERE target_instance = 'relay-9' AND picked_at IS NULL
                       RETURNING id, requester_instance, request_id""",
                    (why,),
                ).fetchall()
                for rpc_id, requester, request_id in claimed:
                    request_ids.append(request_id)
                    conn.execute("SELECT pg_notify(%s, %s)", (channel(requester), str(rpc_id)))

    owner = threading.Thread(target=serve, daemon=True)
    owner.start()
    try:
        yield request_ids
    finally:
        stop.set()
        owner.join(5)


def test_a_request_the_owner_claimed_but_could_not_serve_is_answered_request_not_served(
    start_relay: StartRelay,
) -> None:
    """The owner claimed the request and wrote back why it could not serve it: the executor was not
    asked and has not left. The API said 502 ``executor_gone`` (an executor's workflows) or
    ``no_executor_answered`` (the workflow API); both are false: it answers ``request_not_served``."""
    relay = start_relay(relay_yaml(free_port()), instance_id="relay-1")
    with an_owner_that_cannot_serve(relay.database_url, "ex-elsewhere") as claimed, relay.api() as api:
        for path in ("/apps/ledger/executors/ex-elsewhere/workflows", "/apps/ledger/workflows"):
            resp = api.get(path, headers={"X-Request-Id": f"on-call{path}"})
            assert resp.status_code == 502, (path, resp.text)
            # The request handed to the owner carried the HTTP request's id, for the owner's lines.
            assert claimed[-1] == resp.json()["requestId"] == f"on-call{path}", (claimed, resp.text)
            assert resp.json()["error"]["code"] == "request_not_served", (path, resp.text)
            assert "could not serve it: unknown type" in resp.json()["detail"], (path, resp.text)


def test_an_instance_lets_its_executors_go_only_past_its_lease_and_admits_them_again_once_renewed(
    start_executor: StartExecutor, tmp_path: Path
) -> None:
    """A database blip of a third of the lease closes nothing (a failed renewal is tried again
    soon, so up to about two thirds are absorbed: ``test_lease``). A cut past the lease closes the
    executors' sockets and refuses handshakes (503) while the lease is not held, writing nothing;
    the lease renewed (nobody adopted it), the instance admits them again and nobody dies."""
    from harness.pgserver import PostgresServer

    # 3 s: after a blip of a third, the renewal has more than half a second to connect again on
    # a loaded machine (with 1.5 s, a quarter: CI once lost the lease to it).
    lease = 3.0
    server = PostgresServer("relay-blip")
    try:
        database = server.create_database("relay")
        with TcpProxy(("127.0.0.1", server.port)) as pg:
            config = relay_yaml(free_port(), grace=30.0, instanceLeaseSecs=lease)
            r1 = RelayProcess(tmp_path, server.url(database, pg.port), config, "relay-1").start()
            try:
                ex = start_executor(r1.conductor_url)
                first = assert_eventually(
                    lambda: (r := executor(r1, ex.executor_id)) and r["state"] == "HEALTHY" and r, 10
                )
                pg.partition()
                time.sleep(lease / 3)
                pg.heal()
                time.sleep(lease)
                rec = executor(r1, ex.executor_id)
                assert rec is not None and rec["connectedAt"] == first["connectedAt"], "a blip closed the socket"
                assert "executor sockets so that they reconnect" not in r1.log()

                pg.partition()
                assert_eventually(lambda: "closing its 1 executor sockets" in r1.log(), lease + 3, what="let go")

                async def handshake() -> int:
                    url = f"ws://127.0.0.1:{r1.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
                    with pytest.raises(InvalidStatus) as info:
                        await open_socket(url)
                    return info.value.response.status_code

                assert asyncio.run(handshake()) == 503
                pg.heal()
                again = assert_eventually(
                    lambda: (
                        (r := executor(r1, ex.executor_id))
                        and r["state"] == "HEALTHY"
                        and r["connectedAt"] != first["connectedAt"]
                        and r
                    ),
                    10,
                    what="the executor admitted again",
                )
                assert again["relayInstance"] == "relay-1"
                assert "executor.dead" not in audit_actions(r1, ex.executor_id)
                assert r1.proc is not None and r1.proc.poll() is None
            finally:
                r1.stop()
    finally:
        server.close()


def test_a_request_lost_with_its_instance_is_not_read_as_one_no_executor_was_asked(
    start_relay: StartRelay,
) -> None:
    """The workflow API's verdict when its executors' instances fail it. e2's instance cannot serve
    the request (none asked); e1's instance takes it and is killed before answering, while e1
    connects again elsewhere. e1 may have had the request, so the read is "no executor answered",
    not ``request_not_served`` (which says no executor was asked, and invites a retry). Every
    executor unserved is ``request_not_served``:
    ``test_a_request_the_owner_claimed_but_could_not_serve_is_answered_request_not_served``."""
    # e1 must be connected again before relay-1's lease runs out (at least two thirds of it after
    # the kill): 9 s leaves six for it on a loaded machine.
    lease = 9.0

    def config() -> dict[str, Any]:
        doc = relay_yaml(free_port(), grace=30, instanceLeaseSecs=lease)
        doc["server"].update(executorRequestTimeoutSecs=60, executorRequestDeadlineSecs=90)
        return doc

    r1, r2 = (start_relay(config(), instance_id=f"relay-{i}") for i in (1, 2))
    with (
        SimulatedPeer(
            f"ws://127.0.0.1:{r1.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}",
            "e1",
            on_recovery="silent",
            others="silent",
        ),  # fmt: skip
        an_owner_that_cannot_serve(r2.database_url, "e2"),
        psycopg.connect(r2.database_url, autocommit=True) as conn,
    ):
        assert_eventually(lambda: (executor(r2, "e1") or {}).get("relayInstance") == "relay-1", 10)

        def claimed() -> bool:
            row = conn.execute(
                """SELECT count(*) FROM relay_rpc WHERE requester_instance = 'relay-2' AND executor_id = 'e1'
                   AND request::jsonb->>'type' = 'list_queues' AND picked_at IS NOT NULL"""
            ).fetchone()
            return row is not None and row[0] == 1

        def ask() -> httpx.Response:
            with r2.api() as api:
                return api.get("/apps/ledger/queues", timeout=120)

        pool = ThreadPoolExecutor(1)
        try:
            answer = pool.submit(ask)
            assert_eventually(claimed, 10, what="instance 1 claims the request for e1")
            assert r1.proc is not None
            r1.proc.kill()
            r1.proc.wait()
            url2 = f"ws://127.0.0.1:{r2.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
            with SimulatedPeer(url2, "e1", on_recovery="silent"):
                assert_eventually(lambda: (executor(r2, "e1") or {}).get("relayInstance") == "relay-2", 10)
                try:
                    resp = answer.result(timeout=lease + 15)
                except TimeoutError:
                    pytest.fail(f"no answer {lease + 15:g}s after the claimer was killed (its timeout is 60 s)")
        finally:
            pool.shutdown(wait=False)
    assert resp.status_code == 502, resp.text
    problem = resp.json()
    assert problem["error"]["code"] == "no_executor_answered", resp.text
    assert "may have had it" in problem["detail"] and "could not serve it" in problem["detail"], resp.text


def test_an_app_served_by_no_instance_holding_its_lease_is_a_503_that_says_why(start_relay: StartRelay) -> None:
    """A HEALTHY executor whose instance's lease ran out (the instance stalled, or lost its
    database) is not asked: its socket dies with the instance. The 503 says so, and a warning does,
    rather than only that the app has no healthy executor, which the registry contradicts; with
    none HEALTHY it counts them by state."""
    relay = start_relay()
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with relay.api() as api:
        resp = api.get("/apps/ledger/queues")
        assert resp.status_code == 503 and resp.json()["detail"].endswith("connected (none has connected)"), resp.text
        with SimulatedPeer(url, "served-1", on_recovery="silent", replies={"list_queues": {"output": []}}):
            assert_eventually(lambda: (executor(relay, "served-1") or {}).get("state") == "HEALTHY", 10)
            assert api.get("/apps/ledger/queues").json() == []

            def lapsed() -> str | None:
                # The instance renews every 5 s, and reads which executors serve an app at most
                # once a second: its lease is made to run out again until a request sees it so.
                with psycopg.connect(relay.database_url, autocommit=True) as conn:
                    conn.execute(
                        "UPDATE relay_instances SET lease_expires_at = now() - interval '2 s' WHERE instance_id = %s",
                        (relay.instance_id,),
                    )
                resp = api.get("/apps/ledger/queues")
                return str(resp.json()["detail"]) if resp.status_code == 503 else None

            detail = assert_eventually(lapsed, 15)
            expected = "app 'ledger' has no healthy executor connected (HEALTHY 1 held by relay-1, whose lease ran out "
            assert detail.startswith(expected), detail
            assert "app acme/ledger not served: its executors are HEALTHY 1 held by relay-1" in relay.log()
            # Its next renewal, and the app is served again.
            assert_eventually(lambda: api.get("/apps/ledger/queues").status_code == 200, 15)
        assert_eventually(lambda: "connected (1 DISCONNECTED)" in api.get("/apps/ledger/queues").text, 10)
