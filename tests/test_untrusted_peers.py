"""Peers are not trusted: a lie is caught by another executor, a bad reply is a failed attempt.

A real Relay and real DBOS 3.2 executors, with a simulated peer (harness/simulated.py)
ranked first for the dead executor, so that the recovery asks it before the honest one.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from harness.executors import Evidence, ExecutorProcess, HeldJobs, jobs_held
from harness.keys import CONDUCTOR_KEYS
from harness.relay import RelayProcess
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from relay.core.peers import Peer, order_peers

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]
JOBS = 5


def ranked_before(dead: str, other: str, prefix: str = "") -> str:
    """An executor id that the peer choice tries before ``other`` for ``dead``."""
    while True:
        candidate = f"{prefix}{uuid.uuid4()}"
        if order_peers(dead, [Peer(candidate, "v1"), Peer(other, "v1")])[0].executor_id == candidate:
            return candidate


def peer_url(relay: RelayProcess) -> str:
    return f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"


def all_outcomes(evidence: Evidence, n: int) -> dict[str, str] | None:
    outcomes = evidence.outcomes()
    return outcomes if len(outcomes) >= n else None


def audit_of(relay: RelayProcess, executor_id: str) -> list[dict[str, Any]]:
    with relay.api() as api:
        entries: list[dict[str, Any]] = api.get("/audit", params={"executorId": executor_id}).json()
    return entries


def in_order(actions: list[Any], expected: list[Any]) -> bool:
    it = iter(actions)
    return all(any(a == e for a in it) for e in expected)


def workflow_status(relay_db: str, workflow_id: str) -> str | None:
    with psycopg.connect(relay_db) as conn:
        row = conn.execute(
            "SELECT status FROM dbos.workflow_status WHERE workflow_uuid = %s", (workflow_id,)
        ).fetchone()
    return None if row is None else str(row[0])


def recovered_by(relay: RelayProcess, relay_db: str, evidence_db: str, victim: str, good: str) -> dict[str, Any]:
    """The victim's workflows finished exactly once on ``good``, its record deleted after ``good``'s
    recovery, and its recovery workflow ended in SUCCESS; returns the recovery."""
    outcomes = assert_eventually(lambda: all_outcomes(Evidence(evidence_db), JOBS), 60)
    assert set(outcomes.values()) == {good}
    assert Evidence(evidence_db).outcome_count() == JOBS
    assert_eventually(lambda: relay.executor("acme", "ledger", victim) is None, 20)
    deleted = [e for e in audit_of(relay, victim) if e["action"] == "executor.deleted"]
    assert [e["peerExecutorId"] for e in deleted] == [good]
    with relay.api() as api:
        (recovery,) = api.get("/apps/ledger/recoveries", params={"executorId": victim}).json()
    assert recovery["status"] == "succeeded"
    # DBOS records the run's end after its last step's write deleted the record: awaited.
    assert_eventually(
        lambda: workflow_status(relay_db, recovery["recoveryId"]) == "SUCCESS", 10, what="the recovery's SUCCESS"
    )
    return dict(recovery)


def test_a_lying_peer_is_caught_by_an_honest_executor_and_the_recovery_fails_over(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, relay_db: str
) -> None:
    relay = start_relay(grace=0.5, recoveryAckTimeoutSecs=3.0, failoverBackoffInitialSecs=0.3)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    honest = start_executor(relay.conductor_url, env=env)
    victim = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": str(JOBS), "RELAY_TEST_JOB_SLEEP": "3"})
    with SimulatedPeer(peer_url(relay), ranked_before(victim.executor_id, honest.executor_id), "lie") as liar:
        for ex in (honest.executor_id, liar.executor_id):
            assert_eventually(lambda ex=ex: relay.state_of("acme", "ledger", ex) == "HEALTHY", 10)
        victim.kill()
        recovery = recovered_by(relay, relay_db, evidence_db, victim.executor_id, honest.executor_id)
        assert liar.recovery_requests == 1
    # The liar's "success" was checked with the honest executor, which saw the workflows still PENDING.
    audit = audit_of(relay, victim.executor_id)
    assert in_order([(e["action"], e["peerExecutorId"]) for e in audit], [
        ("executor.dead", None),
        ("recovery.dispatched", liar.executor_id),
        ("recovery.failed", liar.executor_id),
        ("recovery.failover", honest.executor_id),
        ("recovery.dispatched", honest.executor_id),
        ("recovery.succeeded", honest.executor_id),
        ("executor.deleted", honest.executor_id),
    ])  # fmt: skip
    failed = next(e for e in audit if e["action"] == "recovery.failed")
    assert "still PENDING" in failed["detail"]["error"] and honest.executor_id in failed["detail"]["error"]
    assert [a["outcome"] for a in recovery["attempts"]] == ["failed", "succeeded"]


def test_a_nul_byte_in_a_peers_error_is_a_failed_attempt_and_the_next_peer_recovers(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, relay_db: str
) -> None:
    relay = start_relay(grace=0.5, recoveryAckTimeoutSecs=3.0, failoverBackoffInitialSecs=0.3)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    good = start_executor(relay.conductor_url, env=env)
    victim = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": str(JOBS), "RELAY_TEST_JOB_SLEEP": "3"})
    replies = {"recovery": {"success": False, "error_message": "disk\x00full"}}
    bad_id = ranked_before(victim.executor_id, good.executor_id)
    with SimulatedPeer(peer_url(relay), bad_id, "answer", replies=replies) as bad:
        assert_eventually(lambda: relay.state_of("acme", "ledger", bad.executor_id) == "HEALTHY", 10)
        victim.kill()
        recovery = recovered_by(relay, relay_db, evidence_db, victim.executor_id, good.executor_id)
    first, second = recovery["attempts"]
    assert (first["peerExecutorId"], first["outcome"]) == (bad_id, "failed")
    assert "disk\ufffdfull" in first["error"]
    assert (second["peerExecutorId"], second["outcome"]) == (good.executor_id, "succeeded")


@contextmanager
def latest_version_setup(
    tmp_path: Path, start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> Iterator[tuple[RelayProcess, ExecutorProcess, HeldJobs]]:
    """Relay, a v1 victim with jobs, and a v2 executor; the app recovers onto the latest version.
    The victim starts first: v2 is then the newer version by the system database's timestamps.
    The victim holds its jobs back until it is killed (the gate): started as it launched, their 3 s
    sleep had to outlast v2's start and the bad peer's, and ended on the victim when a loaded machine
    took longer. Their 1 s sleep now has to outlast only the moment from READY to the kill."""
    relay = start_relay(grace=0.5, recoveryAckTimeoutSecs=3.0, failoverBackoffInitialSecs=0.3)
    with relay.api() as api:
        assert api.patch("/apps/ledger", json={"recoverToLatestVersion": True}).status_code == 200
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    jobs = {"RELAY_TEST_JOBS": str(JOBS), "RELAY_TEST_JOB_SLEEP": "1"}
    with jobs_held(start_executor, relay.conductor_url, tmp_path, {**env, **jobs}) as victim:
        victim.await_healthy(relay, [], 30, what="the victim HEALTHY, its jobs held back")
        good = start_executor(relay.conductor_url, version="v2", env=env)
        yield relay, good, victim


def test_a_wrongly_typed_version_list_is_skipped_and_the_recovery_goes_on(
    tmp_path: Path, start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, relay_db: str
) -> None:
    with latest_version_setup(tmp_path, start_relay, start_executor, evidence_db) as (relay, good, victim):
        # Sorted first by id (asked first for the versions) and ranked first (dispatched to first).
        bad_id = ranked_before(victim.executor_id, good.executor_id, prefix="0-")
        replies = {"list_application_versions": {"output": 5}}
        with SimulatedPeer(peer_url(relay), bad_id, "answer", version="v2", replies=replies) as bad:
            assert_eventually(lambda: relay.state_of("acme", "ledger", bad.executor_id) == "HEALTHY", 10)
            victim.release().kill()  # its jobs are started (PENDING) as it dies
            recovery = recovered_by(relay, relay_db, evidence_db, victim.executor_id, good.executor_id)
            assert bad.requests["list_application_versions"] >= 1
    assert [(a["peerExecutorId"], a["outcome"]) for a in recovery["attempts"]] == [
        (bad_id, "failed"),
        (good.executor_id, "succeeded"),
    ]
    assert set(Evidence(evidence_db).outcome_versions().values()) == {"v2"}


def test_a_workflow_id_that_cannot_be_stored_fails_the_attempt_and_is_not_carried_to_the_next(
    tmp_path: Path, start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, relay_db: str
) -> None:
    with latest_version_setup(tmp_path, start_relay, start_executor, evidence_db) as (relay, good, victim):
        bad_id = ranked_before(victim.executor_id, good.executor_id)
        listing = {"output": [{"WorkflowUUID": "job-\x00", "Status": "PENDING", "WasForkedFrom": False}]}
        with SimulatedPeer(peer_url(relay), bad_id, "answer", version="v2", replies={"list_workflows": listing}) as bad:
            assert_eventually(lambda: relay.state_of("acme", "ledger", bad.executor_id) == "HEALTHY", 10)
            victim.release().kill()  # its jobs are started (PENDING) as it dies
            recovery = recovered_by(relay, relay_db, evidence_db, victim.executor_id, good.executor_id)
    first = recovery["attempts"][0]
    assert (first["peerExecutorId"], first["outcome"]) == (bad_id, "failed")
    assert recovery["attempts"][-1]["outcome"] == "succeeded"


def test_a_peer_that_never_answers_does_not_hold_the_nothing_pending_check_for_its_ack_timeout(
    start_relay: StartRelay,
) -> None:
    """A blocked recovery (only peers of a newer version, moving onto it not allowed) asks a few
    peers whether the dead executor left anything PENDING, while it holds a turn. A peer that hangs,
    ranked first, must not hold that check for ``recoveryAckTimeoutSecs``: the peers are asked at
    once, within a short bound, and the one that lists nothing lets the recovery succeed."""
    ack = 60.0
    relay = start_relay(grace=0.5, recoveryAckTimeoutSecs=ack)
    victim_id, empty_id = str(uuid.uuid4()), str(uuid.uuid4())
    silent_id = ranked_before(victim_id, empty_id)  # asked first, one after another as before
    url = peer_url(relay)
    with (
        SimulatedPeer(url, silent_id, "silent", version="v2", others="silent"),
        SimulatedPeer(url, empty_id, "silent", version="v2", replies={"list_workflows": {"output": []}}) as empty,
    ):
        with SimulatedPeer(url, victim_id, "silent"):
            for ex in (silent_id, empty_id, victim_id):
                assert_eventually(lambda ex=ex: relay.state_of("acme", "ledger", ex) == "HEALTHY", 10)
        # The victim's socket is gone: dead after the grace period, its recovery blocked on the version.
        assert_eventually(lambda: "executor.dead" in [e["action"] for e in audit_of(relay, victim_id)], 15)
        # Waited for up to the ack timeout, so that a check held by the silent peer fails below, not here.
        succeeded = assert_eventually(
            lambda: next((e for e in audit_of(relay, victim_id) if e["action"] == "recovery.succeeded"), None),
            ack + 10,
        )
        assert empty.requests["list_workflows"] >= 1
    audit = audit_of(relay, victim_id)
    dead = next(e for e in audit if e["action"] == "executor.dead")
    took = (datetime.fromisoformat(succeeded["at"]) - datetime.fromisoformat(dead["at"])).total_seconds()
    assert took < ack / 2, f"the recovery took {took:.1f}s: the silent peer held the check (ack timeout {ack:g}s)"
    assert succeeded["detail"]["nothingPending"] is True and succeeded["peerExecutorId"] == empty_id
    actions = [e["action"] for e in audit]
    assert "recovery.dispatched" not in actions and "executor.deleted" in actions, actions
