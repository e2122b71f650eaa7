"""Relay's workflows are never dead-lettered by DBOS, however often Relay restarts.

DBOS moves a workflow it has recovered more than ``max_recovery_attempts`` times to
MAX_RECOVERY_ATTEMPTS_EXCEEDED, and every restart of Relay recovers every waiting grace
period and recovery once.
"""

from __future__ import annotations

import psycopg
from dbos._dbos import _get_or_create_dbos_registry
from dbos._registrations import get_func_info

from harness.executors import Evidence
from harness.waiting import assert_eventually
from tests.test_repair import JOBS, StartExecutor, StartRelay, blocked_victim, dbos_status, recoveries
from workflows import grace as _grace  # noqa: F401 - registers the workflows with DBOS
from workflows import recovery as _recovery  # noqa: F401


def test_relays_workflows_are_never_dead_lettered_by_dbos() -> None:
    registry = _get_or_create_dbos_registry()
    for name in ("relay.grace_period", "relay.recover"):
        info = get_func_info(registry.workflow_info_map[name])
        assert info is not None
        assert info.max_recovery_attempts is None or info.max_recovery_attempts >= 1_000_000, name


def test_a_waiting_recovery_resumed_after_many_restarts_is_not_dead_lettered(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, relay_db: str
) -> None:
    relay = start_relay(grace=0.5, repairIntervalSecs=3600)
    victim, first = blocked_victim(relay, start_executor, evidence_db)
    assert relay.proc is not None
    relay.proc.kill()
    relay.proc.wait()
    # What 5,000 restarts of Relay leave in DBOS's counter (each one resumes the waiting run).
    with psycopg.connect(relay_db, autocommit=True) as conn:
        conn.execute("UPDATE dbos.workflow_status SET recovery_attempts = 5000 WHERE workflow_uuid = %s", (first,))
    relay.start()
    # DBOS's startup recovery puts the queued run back as ENQUEUED, and the queue takes it again
    # (PENDING); a dead-lettered run would be MAX_RECOVERY_ATTEMPTS_EXCEEDED from the start.
    assert_eventually(lambda: dbos_status(relay_db, first) == "PENDING", 20)
    peer = start_executor(relay.conductor_url, env={"RELAY_TEST_EVIDENCE": evidence_db})
    outcomes = assert_eventually(lambda: (o := Evidence(evidence_db).outcomes()) and len(o) >= JOBS and o, 40)
    assert set(outcomes.values()) == {peer.executor_id}
    assert_eventually(lambda: relay.executor("acme", "ledger", victim.executor_id) is None, 20)
    assert [r["recoveryId"] for r in recoveries(relay, victim.executor_id)] == [first]  # the same run finished
    # DBOS records the run's end once its last step has returned, after the step's write deleted the
    # record: awaited, not read at once.
    assert_eventually(lambda: dbos_status(relay_db, first) == "SUCCESS", 10, what="the same run ended in SUCCESS")
