"""The repair sweep and recovery runs, end to end: a real Relay, real PostgreSQL, real DBOS
3.2 executors.

A grace period or a recovery workflow can end without finishing its job. The tests make it
so the ways it happens in production, without touching Relay's own tables:

- an operator cancels the workflow with DBOS's own tools (``DBOSClient.cancel_workflow``
  against Relay's database, what ``dbos workflow cancel`` does);
- Relay is killed and the workflow's DBOS status says ERROR when it comes back (what DBOS
  writes when a workflow raises, here written directly since Relay's workflows no longer
  let an executor's reply raise).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg
from dbos import DBOSClient

from harness.executors import Evidence, ExecutorProcess, jobs_held
from harness.keys import CONDUCTOR_KEYS
from harness.relay import RelayProcess, audit_actions
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]
JOBS = 3


def ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def dbos_status(relay_db: str, workflow_id: str) -> str | None:
    with psycopg.connect(relay_db) as conn:
        row = conn.execute(
            "SELECT status FROM dbos.workflow_status WHERE workflow_uuid = %s", (workflow_id,)
        ).fetchone()
    return None if row is None else str(row[0])


def cancel(relay_db: str, workflow_id: str) -> None:
    """What an operator does with DBOS's tools: cancel one of Relay's workflows."""
    client = DBOSClient(system_database_url=relay_db)
    try:
        client.cancel_workflow(workflow_id)
    finally:
        client.destroy()
    assert dbos_status(relay_db, workflow_id) == "CANCELLED"


def recoveries(relay: RelayProcess, executor_id: str) -> list[dict[str, Any]]:
    with relay.api() as api:
        runs: list[dict[str, Any]] = api.get("/apps/ledger/recoveries", params={"executorId": executor_id}).json()
    return runs


def doomed(relay: RelayProcess, start_executor: StartExecutor, evidence_db: str, known: set[str]) -> ExecutorProcess:
    """A victim with jobs in flight, HEALTHY beside the executors ``known``. Its jobs are held back
    until Relay knows it (the gate): started as it launched, their 3 s sleep had to outlast its start
    and the registry's wait, and on a loaded machine they ended on it before its death. Started at
    the gate, and seen asleep (their first step's evidence: a peer's recovery then replays the sleep
    they began, not a new one), 2 s is longer than the test takes to kill it (reading READY, then the
    evidence, under CI's load)."""
    env = {"RELAY_TEST_EVIDENCE": evidence_db, "RELAY_TEST_JOBS": str(JOBS), "RELAY_TEST_JOB_SLEEP": "2"}
    with jobs_held(start_executor, relay.conductor_url, relay.workdir, env) as held:
        held.await_healthy(relay, known, 30, what="the victim HEALTHY, its jobs held")
        victim = held.release()  # its jobs started (PENDING): READY comes after them

    def asleep() -> bool:
        runs = Evidence(evidence_db).step_runs()
        return len({w for w, step, e in runs if step == "start" and e == victim.executor_id}) == JOBS

    assert_eventually(asleep, 10, what="its jobs asleep")
    return victim


def blocked_victim(relay: RelayProcess, start_executor: StartExecutor, evidence_db: str) -> tuple[ExecutorProcess, str]:
    """A victim with jobs, killed with no peer: DEAD, its first recovery run waiting for a peer."""
    victim = doomed(relay, start_executor, evidence_db, set())
    victim.kill()
    assert_eventually(
        lambda: (relay.executor("acme", "ledger", victim.executor_id) or {}).get("blockedReason") == "no_healthy_peer",
        10,
    )
    (run,) = recoveries(relay, victim.executor_id)
    assert run["status"] == "waiting_for_peer" and run["run"] == 1
    return victim, str(run["recoveryId"])


def recovered_by_run_2(
    relay: RelayProcess, relay_db: str, evidence_db: str, victim: str, peer: str, first: str, trigger: str
) -> None:
    """The victim's workflows finish exactly once on ``peer``, through a second recovery run."""
    outcomes = assert_eventually(lambda: (o := Evidence(evidence_db).outcomes()) and len(o) >= JOBS and o, 40)
    assert set(outcomes.values()) == {peer}
    assert Evidence(evidence_db).outcome_count() == JOBS
    assert_eventually(lambda: relay.executor("acme", "ledger", victim) is None, 20)
    runs = recoveries(relay, victim)
    assert [(r["recoveryId"], r["run"]) for r in runs] == [(first, 1), (f"{first}:2", 2)]  # newest last
    assert [r["status"] for r in runs] == ["failed", "succeeded"]
    assert "ended without finishing" in runs[0]["error"]
    assert runs[1]["trigger"] == trigger
    with relay.api() as api:  # each run can be read by its id, old form and new
        for run in runs:
            assert api.get(f"/apps/ledger/recoveries/{run['recoveryId']}").json() == run
    # DBOS records the run's end after its last step's write deleted the record: awaited.
    assert_eventually(lambda: dbos_status(relay_db, f"{first}:2") == "SUCCESS", 10, what="run 2 ended in SUCCESS")
    actions = audit_actions(relay, victim)
    for action in ("executor.dead", "recovery.restarted", "recovery.succeeded", "executor.deleted"):
        assert actions.count(action) == 1, (action, actions)


def test_a_cancelled_recovery_is_followed_by_a_new_run_within_the_repair_interval(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, relay_db: str
) -> None:
    interval = 1.0
    relay = start_relay(grace=0.5, repairIntervalSecs=interval)
    victim, first = blocked_victim(relay, start_executor, evidence_db)
    cancel(relay_db, first)
    cancelled = time.time()
    # The next sweep starts run 2, which waits for a peer in its turn.
    runs = assert_eventually(lambda: (r := recoveries(relay, victim.executor_id)) and len(r) == 2 and r, interval + 4)
    # Within a repair interval, and the 2 s the chaos checker allows a loaded machine (chaos/dbrules.py).
    assert ts(runs[1]["createdAt"]).timestamp() - cancelled <= interval + 2.0
    assert runs[1]["recoveryId"] == f"{first}:2"
    assert_eventually(lambda: recoveries(relay, victim.executor_id)[1]["status"] == "waiting_for_peer", 5)
    peer = start_executor(relay.conductor_url, env={"RELAY_TEST_EVIDENCE": evidence_db})
    recovered_by_run_2(relay, relay_db, evidence_db, victim.executor_id, peer.executor_id, first, "repair")
    assert dbos_status(relay_db, first) == "CANCELLED"


def test_a_recovery_found_in_error_after_a_restart_is_followed_by_a_new_run_at_start_up(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, relay_db: str
) -> None:
    # An hour between sweeps: only the start-up sweep can do it.
    relay = start_relay(grace=0.5, repairIntervalSecs=3600)
    victim, first = blocked_victim(relay, start_executor, evidence_db)
    assert relay.proc is not None
    relay.proc.kill()
    relay.proc.wait()
    with psycopg.connect(relay_db, autocommit=True) as conn:
        conn.execute("UPDATE dbos.workflow_status SET status = 'ERROR' WHERE workflow_uuid = %s", (first,))
    relay.start()
    peer = start_executor(relay.conductor_url, env={"RELAY_TEST_EVIDENCE": evidence_db})
    recovered_by_run_2(relay, relay_db, evidence_db, victim.executor_id, peer.executor_id, first, "repair")
    assert dbos_status(relay_db, first) == "ERROR"


def test_a_cancelled_grace_period_still_ends_in_dead_at_its_deadline_and_a_recovery(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, relay_db: str
) -> None:
    grace, interval = 2.0, 0.5
    relay = start_relay(grace=grace, repairIntervalSecs=interval)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    peer = start_executor(relay.conductor_url, env=env)
    assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 10)
    victim = doomed(relay, start_executor, evidence_db, {peer.executor_id})
    victim.kill()
    record = assert_eventually(
        lambda: (r := relay.executor("acme", "ledger", victim.executor_id)) and r["state"] == "DISCONNECTED" and r, 5
    )

    def grace_period() -> str | None:
        # Started just after the record says DISCONNECTED (disconnections' grace periods are enqueued
        # together, after the registry's write).
        with psycopg.connect(relay_db) as conn:
            (found,) = conn.execute(
                "SELECT workflow_uuid FROM dbos.workflow_status WHERE workflow_uuid LIKE %s",
                (f"grace:acme:ledger:{victim.executor_id}:%",),
            ).fetchone() or (None,)
        return None if found is None else str(found)

    grace_id = assert_eventually(grace_period, 5, what="the grace period's workflow")
    cancel(relay_db, grace_id)
    outcomes = assert_eventually(lambda: (o := Evidence(evidence_db).outcomes()) and len(o) >= JOBS and o, 40)
    assert set(outcomes.values()) == {peer.executor_id}
    assert_eventually(lambda: relay.executor("acme", "ledger", victim.executor_id) is None, 20)
    with relay.api() as api:
        audit = api.get("/audit", params={"executorId": victim.executor_id}).json()
    (dead,) = [e for e in audit if e["action"] == "executor.dead"]
    waited = (ts(dead["at"]) - ts(record["disconnectedAt"])).total_seconds()
    # Not before its deadline; soon after: a repair interval, and 2 s for a loaded machine (as above).
    assert grace - 0.1 <= waited <= grace + interval + 2.0, waited
    (run,) = recoveries(relay, victim.executor_id)
    assert run["status"] == "succeeded" and run["trigger"] == "repair"


def test_an_operator_recovery_after_the_run_ended_starts_run_2(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, relay_db: str
) -> None:
    relay = start_relay(grace=0.5, repairIntervalSecs=3600)
    victim, first = blocked_victim(relay, start_executor, evidence_db)
    path = f"/apps/ledger/executors/{victim.executor_id}/recover"
    with relay.api() as api:  # the run is live: it is woken, no new run
        resp = api.post(path)
        assert resp.status_code == 202 and resp.json() == {"recoveryId": first, "newRun": False}
    assert len(recoveries(relay, victim.executor_id)) == 1
    cancel(relay_db, first)
    peer = start_executor(relay.conductor_url, env={"RELAY_TEST_EVIDENCE": evidence_db})
    assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 10)
    time.sleep(1.0)
    assert relay.state_of("acme", "ledger", victim.executor_id) == "DEAD", "nothing runs for it"
    with relay.api() as api:
        resp = api.post(path)
        assert resp.status_code == 202, resp.text
        assert resp.json() == {"recoveryId": f"{first}:2", "newRun": True}
    recovered_by_run_2(relay, relay_db, evidence_db, victim.executor_id, peer.executor_id, first, "operator")
    with relay.api() as api:
        audit = api.get("/audit", params={"executorId": victim.executor_id}).json()
    requests = [e["detail"] for e in audit if e["action"] == "recovery.manual_requested"]
    assert [(d["recoveryId"], d["newRun"]) for d in requests] == [(first, False), (f"{first}:2", True)]


def test_a_grace_period_the_repair_sweep_restarts_counts_from_the_disconnection(
    start_relay: StartRelay, start_executor: StartExecutor, relay_db: str
) -> None:
    """A DISCONNECTED executor whose grace period is missing (Relay crashed before it started it;
    here deleted with DBOS's tools while Relay is down) gets one from the start-up sweep, whose
    deadline is still the disconnection's plus the grace period, not the restart's."""
    grace = 4.0
    relay = start_relay(grace=grace, repairIntervalSecs=3600)  # only the start-up sweep
    victim = start_executor(relay.conductor_url)
    assert_eventually(lambda: relay.state_of("acme", "ledger", victim.executor_id) == "HEALTHY", 10)
    victim.kill()
    record = assert_eventually(
        lambda: (r := relay.executor("acme", "ledger", victim.executor_id)) and r["state"] == "DISCONNECTED" and r, 5
    )
    assert relay.proc is not None
    relay.proc.kill()
    relay.proc.wait()
    with psycopg.connect(relay_db) as conn:
        (epoch,) = conn.execute(
            "SELECT epoch FROM executors WHERE executor_id = %s", (victim.executor_id,)
        ).fetchone() or (0,)
    client = DBOSClient(system_database_url=relay_db)
    try:
        client.delete_workflows([f"grace:acme:ledger:{victim.executor_id}:{epoch}"])
    finally:
        client.destroy()
    assert dbos_status(relay_db, f"grace:acme:ledger:{victim.executor_id}:{epoch}") is None
    # Back after the deadline has passed: the executor is declared dead at once.
    time.sleep(max(0.0, ts(record["disconnectedAt"]).timestamp() + grace - time.time()))
    relay.start()
    ready = time.time()
    assert_eventually(lambda: relay.state_of("acme", "ledger", victim.executor_id) in ("DEAD", "RECOVERING"), 10)
    with relay.api() as api:
        audit = api.get("/audit", params={"executorId": victim.executor_id}).json()
    (dead,) = [e for e in audit if e["action"] == "executor.dead"]
    # (A grace period counted from the start-up sweep would end about ``grace`` after it.)
    assert ts(dead["at"]).timestamp() - ready < grace / 2, "a new grace period was counted from the restart"


def test_a_cancelled_recoverys_record_stops_waiting_once_its_executor_is_back(
    start_relay: StartRelay, relay_db: str
) -> None:
    """A recovery run cancelled with DBOS's tools while it waits for a peer, then its executor
    reconnects (the same id, after a network blip) before any sweep starts a run 2: the record must
    not go on saying ``waiting_for_peer`` for an executor that is back and no run that is live."""
    relay = start_relay(grace=0.3, repairIntervalSecs=3600)  # only the start-up sweep
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    executor_id = str(uuid.uuid4())
    with SimulatedPeer(url, executor_id, "close"):
        assert_eventually(lambda: relay.state_of("acme", "ledger", executor_id) == "HEALTHY", 5)
    assert_eventually(
        lambda: (relay.executor("acme", "ledger", executor_id) or {}).get("blockedReason") == "no_healthy_peer", 10
    )
    (run,) = recoveries(relay, executor_id)
    assert run["status"] == "waiting_for_peer"
    cancel(relay_db, run["recoveryId"])
    with SimulatedPeer(url, executor_id, "close"):
        assert_eventually(lambda: relay.state_of("acme", "ledger", executor_id) == "HEALTHY", 5)
        ended = assert_eventually(lambda: (r := recoveries(relay, executor_id)[0])["status"] == "failed" and r, 10)
    assert "reconnected" in ended["error"], ended
    assert dbos_status(relay_db, run["recoveryId"]) == "CANCELLED"
    assert audit_actions(relay, executor_id).count("recovery.failed") == 1
