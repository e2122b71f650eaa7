"""Grace period, DEAD, recovery and failover, end to end: a real Relay, real
PostgreSQL, real DBOS 3.2 executors sharing one system database."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from tests.support.harness import (
    Evidence,
    ExecutorProcess,
    RelayProcess,
    assert_eventually,
    audit_actions,
)

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


def ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def all_outcomes(evidence: Evidence, n: int) -> dict[str, str] | None:
    outcomes = evidence.outcomes()
    return outcomes if len(outcomes) >= n else None


def in_order(actions: list[str], expected: list[str]) -> bool:
    """``expected`` appears in ``actions`` as a subsequence."""
    it = iter(actions)
    return all(any(a == e for a in it) for e in expected)


def test_dead_executor_workflows_complete_exactly_once_on_a_peer(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    relay = start_relay(grace=1.0)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    a1 = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "20", "RELAY_TEST_JOB_SLEEP": "3"})
    a2 = start_executor(relay.conductor_url, env=env)
    a3 = start_executor(relay.conductor_url, env=env)
    b1 = start_executor(relay.conductor_url, app="billing", version="b1", env=env)
    for ex in (a1, a2, a3):
        assert_eventually(lambda ex=ex: relay.state_of("acme", "ledger", ex.executor_id) == "HEALTHY", 10)
    assert_eventually(lambda: relay.state_of("acme", "billing", b1.executor_id) == "HEALTHY", 10)
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
