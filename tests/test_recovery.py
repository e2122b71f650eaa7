"""Grace period, DEAD, recovery and failover, end to end: a real Relay, real
PostgreSQL, real DBOS 3.2 executors sharing one system database."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.executors import Evidence, ExecutorProcess, jobs_held
from harness.keys import CONDUCTOR_KEYS
from harness.proxy import TcpProxy
from harness.relay import RelayProcess, audit_actions
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.core.peers import Peer, order_peers
from tests.prom import AUTH, sample

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


def ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def all_outcomes(evidence: Evidence, n: int) -> dict[str, str] | None:
    outcomes = evidence.outcomes()
    return outcomes if len(outcomes) >= n else None


def metrics_text(relay: RelayProcess) -> str:
    return httpx.get(f"{relay.http}/metrics", headers=AUTH, timeout=5, verify=TLS).text


def in_order(actions: list[str], expected: list[str]) -> bool:
    """``expected`` appears in ``actions`` as a subsequence."""
    it = iter(actions)
    return all(any(a == e for a in it) for e in expected)


def test_dead_executor_workflows_complete_exactly_once_on_a_peer(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    relay = start_relay(grace=1.0)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    a2 = start_executor(relay.conductor_url, env=env)
    a3 = start_executor(relay.conductor_url, env=env)
    b1 = start_executor(relay.conductor_url, app="billing", version="b1", env=env)
    for ex in (a2, a3):
        assert_eventually(lambda ex=ex: relay.state_of("acme", "ledger", ex.executor_id) == "HEALTHY", 10)
    assert_eventually(lambda: relay.state_of("acme", "billing", b1.executor_id) == "HEALTHY", 10)
    # A1 starts 20 workflows that sleep 4 s between two steps, and dies at once.
    a1 = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "20", "RELAY_TEST_JOB_SLEEP": "4"})
    a1_killed = time.time()  # (before: its socket may be closed, and recorded, before kill() returns)
    a1.kill()

    evidence = Evidence(evidence_db)
    outcomes = assert_eventually(lambda: all_outcomes(evidence, 20), 40)
    assert set(outcomes) == {f"job-{i}" for i in range(20)}
    assert set(outcomes.values()) <= {a2.executor_id, a3.executor_id}
    assert b1.executor_id not in {e for _, _, e in evidence.step_runs()}
    # Deleted once recovered, and the audit log tells the story in order.
    assert_eventually(lambda: relay.executor("acme", "ledger", a1.executor_id) is None, 10)
    actions = audit_actions(relay, a1.executor_id)
    assert in_order(actions, ["executor.dead", "recovery.dispatched", "recovery.succeeded", "executor.deleted"])
    assert actions.count("executor.deleted") == 1
    with relay.api() as api:
        recoveries = api.get("/apps/ledger/recoveries", params={"executorId": a1.executor_id}).json()
    assert len(recoveries) == 1
    assert recoveries[0]["status"] == "succeeded"
    assert recoveries[0]["attempts"][-1]["outcome"] == "succeeded"
    assert recoveries[0]["attempts"][-1]["peerExecutorId"] in {a2.executor_id, a3.executor_id}
    # The recovery histograms hold this one death, as the audit log's timestamps measure it.
    with relay.api() as api:
        audit = api.get("/audit", params={"executorId": a1.executor_id}).json()
    at = {e["action"]: ts(e["at"]).timestamp() for e in audit}
    # The success's stages are observed once the write that deleted the record has committed: awaited,
    # not read the moment the record is gone.
    last = ("dispatched_to_reply", "reply_to_verified", "dead_to_deleted")
    text = assert_eventually(
        lambda: (t := metrics_text(relay)) and all(sample(t, f"relay_recovery_{s}_seconds_count") for s in last) and t,
        10,
        what="the success's stages observed",
    )
    for stage, seconds in (
        ("dead_to_dispatched", at["recovery.dispatched"] - at["executor.dead"]),
        ("dead_to_deleted", at["executor.deleted"] - at["executor.dead"]),
    ):
        assert sample(text, f"relay_recovery_{stage}_seconds_count") == 1, stage
        assert sample(text, f"relay_recovery_{stage}_seconds_sum") == pytest.approx(seconds, abs=0.002), stage
    assert sample(text, "relay_recovery_disconnect_to_dead_seconds_count") == 1
    grace = sample(text, "relay_recovery_disconnect_to_dead_seconds_sum")
    assert grace is not None and 1.0 <= grace < at["executor.dead"] - a1_killed
    for stage in ("dispatched_to_reply", "reply_to_verified"):
        assert sample(text, f"relay_recovery_{stage}_seconds_count") == 1, stage
    replied = sum(
        sample(text, f"relay_recovery_{s}_seconds_sum") or 0 for s in ("dispatched_to_reply", "reply_to_verified")
    )
    assert replied <= at["recovery.succeeded"] - at["recovery.dispatched"] + 0.002

    # A run this release starts takes the merged steps: three checkpoints for a clean recovery. DBOS
    # writes the last one once its step has returned, after the step's write deleted the record:
    # awaited, not read at once.
    def steps() -> list[str]:
        with psycopg.connect(relay.database_url) as conn:
            return [r[0] for r in conn.execute(
                "SELECT function_name FROM dbos.operation_outputs WHERE workflow_uuid = %s ORDER BY function_id",
                (recoveries[0]["recoveryId"],),
            )]  # fmt: skip

    merged = ["relay.open_and_gather", "relay.dispatch_and_recover", "relay.verify_and_succeed"]
    assert_eventually(lambda: steps() == merged, 10, what=f"the run's steps {merged}")


def ranked_before(dead: str, other: str) -> str:
    """An executor id that the peer choice tries before ``other`` for ``dead``."""
    while True:
        candidate = str(uuid.uuid4())
        if order_peers(dead, [Peer(candidate, "v1"), Peer(other, "v1")])[0].executor_id == candidate:
            return candidate


@pytest.mark.parametrize("misbehaviour", ["close", "silent"])
def test_a_failing_peer_causes_failover_to_the_next_after_backoff(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, misbehaviour: str
) -> None:
    relay = start_relay(grace=0.5, recoveryAckTimeoutSecs=1.5, failoverBackoffInitialSecs=0.7)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    a2 = start_executor(relay.conductor_url, env=env)
    a1 = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "5", "RELAY_TEST_JOB_SLEEP": "3"})
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, ranked_before(a1.executor_id, a2.executor_id), misbehaviour) as bad:
        assert_eventually(lambda: relay.state_of("acme", "ledger", bad.executor_id) == "HEALTHY", 5)
        a1.kill()
        outcomes = assert_eventually(lambda: all_outcomes(Evidence(evidence_db), 5), 40)
        assert bad.recovery_requests == 1
    assert set(outcomes.values()) == {a2.executor_id}
    assert_eventually(lambda: relay.executor("acme", "ledger", a1.executor_id) is None, 10)
    with relay.api() as api:
        audit = api.get("/audit", params={"executorId": a1.executor_id}).json()
    actions = [(e["action"], e["peerExecutorId"]) for e in audit]
    assert in_order(actions, [
        ("executor.dead", None),
        ("recovery.dispatched", bad.executor_id),
        ("recovery.failed", bad.executor_id),
        ("recovery.failover", a2.executor_id),
        ("recovery.dispatched", a2.executor_id),
        ("recovery.succeeded", a2.executor_id),
        ("executor.deleted", a2.executor_id),
    ])  # fmt: skip
    failed = next(e for e in audit if e["action"] == "recovery.failed")
    failover = next(e for e in audit if e["action"] == "recovery.failover")
    assert failover["detail"]["fromPeer"] == bad.executor_id and failover["detail"]["attempt"] == 2
    assert (ts(failover["at"]) - ts(failed["at"])).total_seconds() >= 0.7 - 0.05
    with relay.api() as api:
        recovery = api.get("/apps/ledger/recoveries", params={"executorId": a1.executor_id}).json()[0]
    assert [a["outcome"] for a in recovery["attempts"]] == ["failed", "succeeded"]
    assert recovery["attempts"][0]["error"]
    # Relay's log tells the death and its recovery too, not only the audit log: it said connected
    # and DISCONNECTED, and then nothing of DEAD, the peer asked, the failure or the success.
    rid, dead = recovery["recoveryId"], f"acme/ledger/{a1.executor_id}"
    assert_logged(relay, f"executor {dead} is DEAD (epoch ", "no connection for its grace period")
    assert_logged(relay, f"recovery {rid} of executor {dead}: attempt 1 sent to peer {bad.executor_id}")
    assert_logged(relay, f"recovery {rid} of executor {dead}: attempt 1 on peer {bad.executor_id} failed: ")
    assert_logged(relay, f"recovery {rid} of executor {dead}: attempt 2 sent to peer {a2.executor_id}")
    # Logged once the write that deleted the record has committed: awaited, not read the moment it is gone.
    success = f"recovery {rid} of executor {dead} succeeded: recovered by peer {a2.executor_id}"
    assert_eventually(lambda: logged(relay, success), 10, what=f"a line like {success!r} in the log")


def logged(relay: RelayProcess, *parts: str) -> bool:
    """A line of Relay's log holds each of ``parts``, in order."""
    return re.search(".*".join(re.escape(p) for p in parts), relay.log()) is not None


def assert_logged(relay: RelayProcess, *parts: str) -> None:
    assert logged(relay, *parts), f"no line like {parts} in the log: {relay.log()[-3000:]}"


def test_no_healthy_peer_waits_then_a_new_peer_gets_it_as_it_connects(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    relay = start_relay(grace=0.5)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    a1 = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "3", "RELAY_TEST_JOB_SLEEP": "3"})
    a1.kill()

    def blocked() -> dict[str, str] | None:
        record = relay.executor("acme", "ledger", a1.executor_id)
        return record if record and record["blockedReason"] == "no_healthy_peer" else None

    record = assert_eventually(blocked, 10)
    assert record["state"] == "DEAD"
    with relay.api() as api:
        recovery = api.get("/apps/ledger/recoveries", params={"executorId": a1.executor_id}).json()[0]
    assert recovery["status"] == "waiting_for_peer"
    a2 = start_executor(relay.conductor_url, env=env)
    assert_eventually(lambda: "recovery.dispatched" in audit_actions(relay, a1.executor_id), 5)
    peer = relay.executor("acme", "ledger", a2.executor_id)
    with relay.api() as api:
        audit = api.get("/audit", params={"executorId": a1.executor_id}).json()
    dispatched = next(e for e in audit if e["action"] == "recovery.dispatched")
    assert peer is not None and dispatched["peerExecutorId"] == a2.executor_id
    # Woken by the peer's handshake, not by the 30 s re-check (BLOCKED_RECHECK_SECS): well under a
    # second on a quiet machine; the 2 s the chaos checker allows a loaded one on top.
    assert (ts(dispatched["at"]) - ts(peer["connectedAt"])).total_seconds() < 1.0 + 2.0
    outcomes = assert_eventually(lambda: all_outcomes(Evidence(evidence_db), 3), 30)
    assert set(outcomes.values()) == {a2.executor_id}
    assert "recovery.waiting_for_peer" in audit_actions(relay, a1.executor_id)
    assert_logged(relay, f"recovery {recovery['recoveryId']} of executor acme/ledger/{a1.executor_id}: "
                  "waiting_for_peer (no_healthy_peer)")  # fmt: skip


def test_only_newer_peers_wait_for_the_operator_then_move_onto_the_new_version(
    tmp_path: Path, start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    relay = start_relay(grace=0.5)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    # a1 first: v2, registered after v1, is the newer version by the system database's timestamps.
    # a1 holds its jobs back until v2 is up (the gate): started as a1 launched, they ended on a1,
    # before it died, when v2 took longer than their 3 s sleep to start (a loaded machine).
    jobs = {"RELAY_TEST_JOBS": "4", "RELAY_TEST_JOB_SLEEP": "3"}
    with jobs_held(start_executor, relay.conductor_url, tmp_path, {**env, **jobs}) as held:
        held.await_healthy(relay, [], 30, what="a1 HEALTHY, its jobs held back")
        v2 = start_executor(relay.conductor_url, version="v2", env=env)
        assert_eventually(lambda: relay.state_of("acme", "ledger", v2.executor_id) == "HEALTHY", 10)
    a1 = held.release()
    a1.kill()

    def blocked() -> dict[str, str] | None:
        record = relay.executor("acme", "ledger", a1.executor_id)
        return record if record and record["blockedReason"] == "version_upgrade_not_allowed" else None

    assert_eventually(blocked, 10)
    with relay.api() as api:
        assert api.get("/apps/ledger/recoveries").json()[0]["status"] == "awaiting_operator"
    metrics = httpx.get(f"{relay.http}/metrics", headers=AUTH, verify=TLS).text
    blocked = sample(metrics, "relay_executors_blocked", org="acme", app="ledger", reason="version_upgrade_not_allowed")
    assert blocked == 1
    time.sleep(1.0)
    assert Evidence(evidence_db).outcomes() == {}, "nothing may move before the operator allows it"
    with relay.api() as api:
        resp = api.patch("/apps/ledger", json={"recoverToLatestVersion": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["recoverToLatestVersion"] is True
    outcomes = assert_eventually(lambda: all_outcomes(Evidence(evidence_db), 4), 40)
    assert set(outcomes.values()) == {v2.executor_id}
    assert set(Evidence(evidence_db).outcome_versions().values()) == {"v2"}
    assert_eventually(lambda: relay.executor("acme", "ledger", a1.executor_id) is None, 10)
    actions = audit_actions(relay, a1.executor_id)
    assert actions.count("recovery.workflow_moved") == 4
    assert in_order(actions, ["recovery.awaiting_operator", "recovery.dispatched", "recovery.workflow_moved",
                              "recovery.succeeded", "executor.deleted"])  # fmt: skip
    with relay.api() as api:
        settings = [e for e in api.get("/audit").json() if e["action"] == "settings.updated"]
    assert settings and settings[0]["detail"]["after"]["recoverToLatestVersion"] is True


def test_relay_killed_during_a_grace_period_declares_dead_at_the_original_deadline(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    grace = 4.0
    relay = start_relay(grace=grace)
    a1 = start_executor(relay.conductor_url)
    assert_eventually(lambda: relay.state_of("acme", "ledger", a1.executor_id) == "HEALTHY", 10)
    a1.kill()
    assert_eventually(lambda: relay.state_of("acme", "ledger", a1.executor_id) == "DISCONNECTED", 2)
    time.sleep(2.0)
    assert relay.proc is not None
    relay.proc.kill()  # kill -9, in the middle of the grace period
    relay.proc.wait()
    relay.start()
    back = time.time()  # Relay is ready again
    record = assert_eventually(lambda: (r := relay.executor("acme", "ledger", a1.executor_id)) and r["deadAt"] and r,
                               grace + 5)  # fmt: skip
    disconnected = ts(record["disconnectedAt"])
    waited = (ts(record["deadAt"]) - disconnected).total_seconds()
    # Declared at the original deadline, or at once if Relay was down past it (a slow restart);
    # not lost (never DEAD), and not reset by the restart: that would be at least 2 s later (the
    # time from the disconnection to the restart plus the grace period), more than the 1.5 s a
    # loaded machine is allowed for DBOS to resume the timer at start-up.
    due = max(grace, back - disconnected.timestamp())
    assert grace - 0.1 <= waited <= due + 1.5, (waited, due)
    assert audit_actions(relay, a1.executor_id).count("executor.dead") == 1


def test_relay_killed_between_dispatch_and_delete_finishes_once(
    tmp_path: Path, start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    # The grace period outlasts the SDK's one-second reconnect after Relay restarts.
    relay = start_relay(grace=2.0)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    # The only peer holds a recovery request until Relay is dead (the gate): the window in which it
    # dies. It took 3 s over it before, and the workflows finished before Relay's death when noticing
    # the dispatch and the kill took longer than that (a loaded machine).
    held = tmp_path / "recovery-gate"
    a2 = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_RECOVERY_GATE": str(held)})
    a1 = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "6", "RELAY_TEST_JOB_SLEEP": "3"})
    a1.kill()
    try:
        assert_eventually(lambda: "recovery.dispatched" in audit_actions(relay, a1.executor_id), 10, interval=0.02)
        assert relay.proc is not None
        relay.proc.kill()
        relay.proc.wait()
        assert Evidence(evidence_db).outcomes() == {}
    finally:
        held.touch()
    relay.start()
    outcomes = assert_eventually(lambda: all_outcomes(Evidence(evidence_db), 6), 60)
    assert set(outcomes.values()) == {a2.executor_id}
    assert_eventually(lambda: relay.executor("acme", "ledger", a1.executor_id) is None, 30)
    actions = audit_actions(relay, a1.executor_id)
    for action in ("executor.dead", "recovery.dispatched", "recovery.succeeded", "executor.deleted"):
        assert actions.count(action) == 1, (action, actions)
    assert "recovery.failed" not in actions
    # The restarted process observed the stages it recorded, not the dispatch its predecessor recorded.
    # The deletion is observed once its write has committed: awaited, not read the moment the record is gone.
    text = assert_eventually(
        lambda: (t := metrics_text(relay)) and sample(t, "relay_recovery_dead_to_deleted_seconds_count") and t,
        10,
        what="the deletion observed",
    )
    assert not sample(text, "relay_recovery_dead_to_dispatched_seconds_count")
    assert sample(text, "relay_recovery_dead_to_deleted_seconds_count") == 1


def test_reconnect_just_before_the_deadline_leaves_it_healthy_and_untouched(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    # Healed 3 s before the deadline: the SDK, retrying every second, is back a second or two
    # before it, with room for a loaded machine's slow handshake.
    grace, heal_before = 6.0, 3.0
    relay = start_relay(grace=grace)
    with TcpProxy(("127.0.0.1", relay.port)) as proxy:
        a1 = start_executor(f"ws://127.0.0.1:{proxy.port}/", sleepers=2)
        peer = start_executor(relay.conductor_url)
        assert_eventually(lambda: relay.state_of("acme", "ledger", a1.executor_id) == "HEALTHY", 10)
        assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 10)
        with relay.api() as api:
            before = api.get(f"/apps/ledger/executors/{a1.executor_id}/workflows", params={"status": "PENDING"}).json()
        cut = time.monotonic()
        proxy.partition()
        gone = assert_eventually(
            lambda: (r := relay.executor("acme", "ledger", a1.executor_id)) and r["state"] == "DISCONNECTED" and r,
            grace - heal_before,
        )
        time.sleep(max(0.0, grace - heal_before - (time.monotonic() - cut)))
        proxy.heal()
        back = assert_eventually(
            lambda: (r := relay.executor("acme", "ledger", a1.executor_id)) and r["state"] == "HEALTHY" and r,
            heal_before,
        )
        # Back before the deadline, by Relay's own record of both (not by when this test saw them).
        assert ts(back["connectedAt"]) < ts(gone["disconnectedAt"]) + timedelta(seconds=grace), (gone, back)
        time.sleep(max(0.0, ts(gone["disconnectedAt"]).timestamp() + grace + 1.0 - time.time()))
        assert relay.state_of("acme", "ledger", a1.executor_id) == "HEALTHY"
        with relay.api() as api:
            after = api.get(f"/apps/ledger/executors/{a1.executor_id}/workflows", params={"status": "PENDING"}).json()
    assert {w["workflowId"] for w in after} == {w["workflowId"] for w in before}
    assert {w["executorId"] for w in after} == {a1.executor_id}
    actions = audit_actions(relay, a1.executor_id)
    assert "executor.dead" not in actions and "recovery.dispatched" not in actions


def test_operator_recovery_skips_the_grace_period(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    relay = start_relay(grace=600)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    a2 = start_executor(relay.conductor_url, env=env)
    a1 = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "3", "RELAY_TEST_JOB_SLEEP": "4"})
    path = f"/apps/ledger/executors/{a1.executor_id}/recover"
    with relay.api() as api:
        resp = api.post(path)
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "executor_healthy"
    with relay.api("acme", key="api-acme-viewer") as api:
        assert api.post(path).status_code == 403
    a1.kill()
    assert_eventually(lambda: relay.state_of("acme", "ledger", a1.executor_id) == "DISCONNECTED", 2)
    with relay.api() as api:
        assert api.post("/apps/ledger/executors/nobody/recover").status_code == 404
        assert api.post(path, json={"toLatestVersion": "maybe"}).status_code == 422
        resp = api.post(path, json={"toLatestVersion": False})
        assert resp.status_code == 202, resp.text
        recovery_id = resp.json()["recoveryId"]
    outcomes = assert_eventually(lambda: all_outcomes(Evidence(evidence_db), 3), 30)
    assert set(outcomes.values()) == {a2.executor_id}
    with relay.api() as api:
        recovery = assert_eventually(
            lambda: (r := api.get(f"/apps/ledger/recoveries/{recovery_id}").json())["status"] == "succeeded" and r, 10
        )
        assert recovery["trigger"] == "operator"
        audit = api.get("/audit", params={"executorId": a1.executor_id}).json()
    dead = next(e for e in audit if e["action"] == "executor.dead")
    assert dead["actor"] == "api:ops"
    assert_logged(relay, f"executor acme/ledger/{a1.executor_id} is DEAD (epoch ", "declared by api:ops")
    assert_logged(relay, f"recovery {recovery_id} of executor acme/ledger/{a1.executor_id} requested by api:ops")
    assert in_order([e["action"] for e in audit], ["executor.dead", "recovery.manual_requested",
                                                   "recovery.succeeded", "executor.deleted"])  # fmt: skip


def test_an_operators_recover_ends_a_failed_attempts_backoff_at_once(start_relay: StartRelay) -> None:
    """An attempt fails and the recovery backs off for a minute; the operator's recover wakes it
    and the next attempt begins within seconds, not after the backoff."""
    relay = start_relay(grace=0.3, failoverBackoffInitialSecs=60, failoverBackoffMaxSecs=60)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    refusal = {"recovery": {"success": False}}
    with SimulatedPeer(url, str(uuid.uuid4()), "answer", replies=refusal) as bad:
        assert_eventually(lambda: relay.state_of("acme", "ledger", bad.executor_id) == "HEALTHY", 5)
        dead = str(uuid.uuid4())
        with SimulatedPeer(url, dead, "close"):
            assert_eventually(lambda: relay.state_of("acme", "ledger", dead) == "HEALTHY", 5)
        assert_eventually(lambda: "recovery.failed" in audit_actions(relay, dead), 15)
        assert bad.recovery_requests == 1
        with relay.api() as api:
            (recovery,) = api.get("/apps/ledger/recoveries", params={"executorId": dead}).json()
            resp = api.post(f"/apps/ledger/executors/{dead}/recover")
        assert resp.status_code == 202, resp.text
        assert resp.json()["recoveryId"] == recovery["recoveryId"]  # the run in its backoff, nudged
        assert_eventually(lambda: bad.recovery_requests == 2, 15)
    with relay.api() as api:
        audit = api.get("/audit", params={"executorId": dead}).json()
    failed = next(e for e in audit if e["action"] == "recovery.failed")
    again = [e for e in audit if e["action"] == "recovery.dispatched"][1]
    assert (ts(again["at"]) - ts(failed["at"])).total_seconds() < 20  # the backoff was 60 s


def test_patch_validates_and_audits(start_relay: StartRelay) -> None:
    relay = start_relay()
    with relay.api() as api:
        for body in ({"executorTimeoutSecs": -1}, {"executorTimeoutSecs": "soon"}, {}, {"bogus": 1},
                     {"recoverToLatestVersion": "yes please"}):  # fmt: skip
            resp = api.patch("/apps/ledger", json=body)
            assert resp.status_code == 422, (body, resp.text)
            assert resp.json()["error"]["code"] == "invalid_request"
        assert api.patch("/apps/nope", json={"executorTimeoutSecs": 5}).status_code == 404
        resp = api.patch("/apps/ledger", json={"executorTimeoutSecs": 12.5})
        # Relay's gracePeriodSecs is the one set; Conductor's executorTimeoutSecs an integer, rounded up.
        assert resp.status_code == 200, resp.text
        assert (resp.json()["gracePeriodSecs"], resp.json()["executorTimeoutSecs"]) == (12.5, 13)
        assert api.get("/apps/ledger").json()["gracePeriodSecs"] == 12.5
    # The five invalid bodies are audited as refused attempts (422; written off the answer's path), the
    # change once; the unknown app not.
    audit = assert_eventually(lambda: _six_entries(relay), 10, what="the refusals audited")
    refused = [e for e in audit if e["detail"].get("result") == "failure"]
    done = [e for e in audit if e not in refused]
    assert [(e["action"], e["detail"]["status"]) for e in refused] == [("settings.updated", 422)] * 5
    assert [e["action"] for e in done] == ["settings.updated"]
    assert done[0]["detail"]["before"]["executorTimeoutSecs"] == 30.0
    assert done[0]["actor"] == "api:ops"
    with relay.api() as api:
        assert api.get("/audit", params={"since": "2999-01-01T00:00:00Z"}).json() == []
        assert len(api.get("/audit", params={"limit": 1}).json()) == 1
        assert api.get("/audit", params={"limit": 0}).status_code == 422
        assert api.get("/audit", params={"app": "nope"}).json() == []
    with relay.api("acme", key="api-acme-viewer") as api:
        assert api.patch("/apps/ledger", json={"executorTimeoutSecs": 5}).status_code == 403


def _six_entries(relay: RelayProcess) -> list[dict[str, Any]] | None:
    with relay.api() as api:
        audit: list[dict[str, Any]] = api.get("/audit", params={"app": "ledger"}).json()
    return audit if len(audit) >= 6 else None


def test_an_executor_back_from_the_dead_is_watched_again(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """Found by the chaos harness: paused past its grace period, recovered and deleted, the
    executor resumes under the same id and dies for good; its new disconnection needs a new
    grace period, not the finished one of its first life."""
    relay = start_relay(grace=1.0, pingIntervalSecs=0.2, pingWaitSecs=1.0)
    peer = start_executor(relay.conductor_url)
    a1 = start_executor(relay.conductor_url)
    # Both registered before the pause (a1 paused in its handshake would never have been recorded).
    for executor in (peer, a1):
        assert_eventually(lambda e=executor: relay.state_of("acme", "ledger", e.executor_id) == "HEALTHY", 10)
    a1.pause()
    assert_eventually(lambda: "executor.deleted" in audit_actions(relay, a1.executor_id), 15)
    a1.resume()
    assert_eventually(lambda: relay.state_of("acme", "ledger", a1.executor_id) == "HEALTHY", 10)
    a1.kill()
    assert_eventually(lambda: audit_actions(relay, a1.executor_id).count("executor.deleted") == 2, 15)
    actions = audit_actions(relay, a1.executor_id)
    assert actions.count("executor.dead") == 2
    with relay.api() as api:
        recoveries = api.get("/apps/ledger/recoveries", params={"executorId": a1.executor_id}).json()
    assert [r["status"] for r in recoveries] == ["succeeded", "succeeded"]


def test_recover_to_latest_never_moves_work_onto_an_older_version(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    """Review (core): ``recoverToLatestVersion`` recovers onto the *latest* version (contract rule 3).
    A dead executor on v2, the newest version of the app, with peers only on the older v1 (a partial
    rollback), has no peer on the latest version: its work must not be moved back onto v1's code."""
    relay = start_relay(grace=0.5)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    with relay.api() as api:
        assert api.patch("/apps/ledger", json={"recoverToLatestVersion": True}).status_code == 200
    v1 = start_executor(relay.conductor_url, version="v1", env=env)
    assert_eventually(lambda: relay.state_of("acme", "ledger", v1.executor_id) == "HEALTHY", 10)
    time.sleep(0.5)  # v2 is registered after v1: the newer version by the system database's timestamps
    a2 = start_executor(relay.conductor_url, version="v2",
                        env={**env, "RELAY_TEST_JOBS": "3", "RELAY_TEST_JOB_SLEEP": "3"})  # fmt: skip
    assert_eventually(lambda: relay.state_of("acme", "ledger", a2.executor_id) == "HEALTHY", 10)
    a2.kill()
    assert_eventually(lambda: (relay.executor("acme", "ledger", a2.executor_id) or {}).get("state") == "DEAD"
                      or "recovery.dispatched" in audit_actions(relay, a2.executor_id), 10)  # fmt: skip
    time.sleep(4.0)
    actions = audit_actions(relay, a2.executor_id)
    assert "recovery.workflow_moved" not in actions, actions
    assert Evidence(evidence_db).outcome_versions() == {}, "v2's workflows were moved onto the older v1"


def test_an_operator_recovery_names_this_executors_run_not_another_executors(start_relay: StartRelay) -> None:
    """Review (core): an executor id may contain colons and digits (relay/core/ids.py says so). The
    run 1 id of executor ``x:{E}`` dead at epoch F, ``recovery:acme:ledger:x:{E}:{F}``, is also the id
    that run F of executor ``x``'s death at epoch E would have: Relay takes the one for the other."""
    relay = start_relay(grace=0.3)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"

    def dies_alone(executor_id: str) -> int:
        with SimulatedPeer(url, executor_id, "close"):
            # (The second one may be asked to recover the first and close at once.)
            assert_eventually(lambda: relay.state_of("acme", "ledger", executor_id) is not None, 5)
        assert_eventually(
            lambda: (relay.executor("acme", "ledger", executor_id) or {}).get("blockedReason") == "no_healthy_peer", 10
        )
        with psycopg.connect(relay.database_url) as conn:
            row = conn.execute("SELECT epoch FROM executors WHERE executor_id = %s", (executor_id,)).fetchone()
        assert row is not None
        return int(row[0])

    x = f"x-{uuid.uuid4()}"
    epoch = dies_alone(x)
    dies_alone(f"{x}:{epoch}")
    with relay.api() as api:
        (own,) = api.get("/apps/ledger/recoveries", params={"executorId": x}).json()
        assert own["run"] == 1 and own["status"] in ("dispatching", "waiting_for_peer")  # live
        resp = api.post(f"/apps/ledger/executors/{x}/recover")
        assert resp.status_code == 202, resp.text
        audit = api.get("/audit", params={"executorId": x}).json()
    requested = next(e for e in audit if e["action"] == "recovery.manual_requested")
    assert resp.json()["recoveryId"] == own["recoveryId"], (resp.json(), requested["detail"])


def test_a_blocked_recoverys_why_follows_the_peers_when_its_reason_stays(start_relay: StartRelay) -> None:
    """Blocked with no peer at all (no note), then woken by a peer on another version that cannot
    name the latest one: the reason is still no_healthy_peer, so no new block is recorded, but the
    recovery's error now says why none of the healthy peers will do."""
    relay = start_relay(grace=0.3)
    with relay.api() as api:
        assert api.patch("/apps/ledger", json={"recoverToLatestVersion": True}).status_code == 200
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    dead = str(uuid.uuid4())
    with SimulatedPeer(url, dead, "close", version="v1"):
        assert_eventually(lambda: relay.state_of("acme", "ledger", dead) == "HEALTHY", 5)

    def recovery() -> dict[str, Any]:  # its one run, once it has begun
        with relay.api() as api:
            found = api.get("/apps/ledger/recoveries", params={"executorId": dead}).json()
        assert len(found) <= 1, found
        return dict(found[0]) if found else {}

    assert_eventually(lambda: recovery().get("status") == "waiting_for_peer", 10)
    assert recovery()["error"] is None  # no peer at all: the reason says it all
    with SimulatedPeer(url, str(uuid.uuid4()), "close", version="v2") as peer:
        why = assert_eventually(lambda: recovery()["error"], 10)
        assert why.startswith("healthy peers run other versions (v2), but the latest version is not known"), why
        assert peer.executor_id in why
        assert relay.executor("acme", "ledger", dead)["blockedReason"] == "no_healthy_peer"


def test_a_dead_executor_with_a_healthy_peer_says_why_none_will_do(start_relay: StartRelay) -> None:
    """Review (core): ``blockedReason: no_healthy_peer`` alone would tell the operator that the app has
    no healthy executor to recover onto. With recoverToLatestVersion on and a healthy peer on another
    version that cannot name the latest version (it answers list_application_versions with an error),
    the reason stays one of the contract's two (section 2), and the recovery's error and its audit
    entry say why: healthy peers exist, on other versions, and none could name the latest one."""
    relay = start_relay(grace=0.3)
    with relay.api() as api:
        assert api.patch("/apps/ledger", json={"recoverToLatestVersion": True}).status_code == 200
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, str(uuid.uuid4()), "close", version="v2") as peer:
        assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 5)
        dead = str(uuid.uuid4())
        with SimulatedPeer(url, dead, "close", version="v1"):
            assert_eventually(lambda: relay.state_of("acme", "ledger", dead) == "HEALTHY", 5)
        record = assert_eventually(lambda: (r := relay.executor("acme", "ledger", dead)) and r["blockedReason"] and r,
                                   10)  # fmt: skip
        assert relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY"
        assert record["blockedReason"] == "no_healthy_peer", record
        with relay.api() as api:
            (recovery,) = api.get("/apps/ledger/recoveries", params={"executorId": dead}).json()
            audit = api.get("/audit", params={"executorId": dead}).json()
    (waiting,) = [e for e in audit if e["action"] == "recovery.waiting_for_peer"]
    for why in (recovery["error"], waiting["detail"]["error"]):
        assert why.startswith("healthy peers run other versions (v2), but the latest version is not known"), why
        assert f"{peer.executor_id}: list_application_versions: not supported by the simulated peer" in why, why
