"""Executors on DBOS's TypeScript SDK (@dbos-inc/dbos-sdk 5.2, its own conductor client:
harness/ts_app): they connect, die and are recovered by a peer exactly once, are found by the
reconciler, come back after Relay restarts, and the workflow API serves them, each answer checked
against what their system database holds (read here; Relay never reads it).

The TypeScript SDK reads some frames differently from the Python SDK: a filter sent as null is
not always "no filter" there (``was_forked_from: null`` matched no workflow), so these tests run
the same requests as the Python ones against it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, LiteralString

import httpx
import psycopg
import pytest

from harness.executors import Evidence, ExecutorProcess
from harness.relay import RelayProcess, audit_actions
from harness.ts_executor import SDK_VERSION, start_ts_executor
from harness.waiting import assert_eventually
from tests.test_reconciler import reconciling_relay, steps_once
from tests.test_recovery import in_order

StartRelay = Callable[..., RelayProcess]
StartTs = Callable[..., ExecutorProcess]
LEDGER = "/apps/ledger"
SEEDED = {"done-1", "done-1-child", "failed-1", "waiting-1"}


@pytest.fixture
def start_ts(tmp_path: Path, sysdb: str) -> Iterator[StartTs]:
    started: list[ExecutorProcess] = []

    def start(conductor_url: str, **kwargs: Any) -> ExecutorProcess:
        executor = start_ts_executor(tmp_path, kwargs.pop("sysdb", sysdb), conductor_url, **kwargs)
        started.append(executor)
        return executor

    yield start
    for executor in started:
        executor.stop()


def query(url: str, sql: LiteralString, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return list(conn.execute(sql, params).fetchall())


def ms(text: str | None) -> int | None:
    return None if text is None else round(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def ok(resp: httpx.Response, status: int = 200) -> Any:
    assert resp.status_code == status, (resp.status_code, resp.text)
    return resp.json() if resp.content else None


def db_status(sysdb: str, workflow_id: str) -> str | None:
    rows = query(sysdb, "SELECT status FROM dbos.workflow_status WHERE workflow_uuid = %s", workflow_id)
    return str(rows[0][0]) if rows else None


def summaries(workflows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return sorted((w["workflowId"], w["status"], w["workflowName"], ms(w["createdAt"])) for w in workflows)


def db_summaries(sysdb: str, where: LiteralString = "TRUE", *params: Any) -> list[tuple[Any, ...]]:
    sql: LiteralString = "SELECT workflow_uuid, status, name, created_at FROM dbos.workflow_status WHERE "
    return sorted((w, s, n, int(c)) for w, s, n, c in query(sysdb, sql + where, *params))


def seeded(relay: RelayProcess, start_ts: StartTs, sysdb: str) -> ExecutorProcess:
    ts = start_ts(relay.conductor_url, env={"RELAY_TEST_SEED": "1"})
    assert_eventually(lambda: relay.state_of("acme", "ledger", ts.executor_id) == "HEALTHY", 20)
    assert_eventually(lambda: db_status(sysdb, "waiting-1") == "PENDING", 20)
    return ts


def test_a_typescript_executor_is_known_by_its_sdk(start_relay: StartRelay, start_ts: StartTs) -> None:
    relay = start_relay()
    ts = start_ts(relay.conductor_url)
    assert_eventually(lambda: relay.state_of("acme", "ledger", ts.executor_id) == "HEALTHY", 20)
    with relay.api() as api:
        (app,) = [a for a in ok(api.get("/apps")) if a["name"] == "ledger"]
        (executor,) = ok(api.get(f"{LEDGER}/executors"))
    assert (app["status"], app["language"]) == ("AVAILABLE", "typescript")
    assert (executor["executorId"], executor["appVersion"], executor["status"]) == (ts.executor_id, "v1", "HEALTHY")
    assert (executor["language"], executor["dbosVersion"], executor["executorMetadata"]) == (
        "typescript",
        SDK_VERSION,
        {"test": True},
    )


def test_the_workflow_list_search_and_aggregates_are_what_the_system_database_holds(
    start_relay: StartRelay, start_ts: StartTs, sysdb: str
) -> None:
    relay = start_relay()
    seeded(relay, start_ts, sysdb)
    with relay.api() as api:
        listed = ok(api.get(f"{LEDGER}/workflows"))
        assert {w["workflowId"] for w in listed} == SEEDED
        assert summaries(listed) == db_summaries(sysdb)
        assert [ms(w["createdAt"]) for w in listed] == sorted(ms(w["createdAt"]) for w in listed)  # oldest first
        errors = ok(api.get(f"{LEDGER}/workflows", params={"status": "ERROR"}))
        assert summaries(errors) == db_summaries(sysdb, "status = 'ERROR'") and len(errors) == 1
        children = ok(api.get(f"{LEDGER}/workflows", params={"workflowName": "child"}))
        assert [w["workflowId"] for w in children] == ["done-1-child"]
        page = ok(api.get(f"{LEDGER}/workflows", params={"limit": 2, "offset": 1}))
        assert [w["workflowId"] for w in page] == [w["workflowId"] for w in listed[1:3]]
        searched = ok(api.post(f"{LEDGER}/workflows/search", json={"status": ["SUCCESS", "PENDING"]}))
        assert summaries(searched) == db_summaries(sysdb, "status IN ('SUCCESS', 'PENDING')")
        by_parent = ok(api.post(f"{LEDGER}/workflows/search", json={"parentWorkflowId": ["done-1"]}))
        assert [w["workflowId"] for w in by_parent] == ["done-1-child"]
        # An empty list is no filter, as to the Python SDK (the TypeScript SDK made "status IN ()" of
        # it, a syntax error: 502).
        searched = ok(api.post(f"{LEDGER}/workflows/search", json={"status": [], "workflowName": ["parent"]}))
        assert [w["workflowId"] for w in searched] == ["done-1"]

        by_status = ok(api.post(f"{LEDGER}/workflows/aggregates", json={"groupByStatus": True, "selectCount": True}))
        db = query(sysdb, "SELECT status, count(*) FROM dbos.workflow_status GROUP BY status")
        assert {a["group"]["status"]: a["count"] for a in by_status} == dict(db)
        steps = ok(api.post(f"{LEDGER}/steps/aggregates", json={"groupByFunctionName": True, "selectCount": True}))
        db = query(sysdb, "SELECT function_name, count(*) FROM dbos.operation_outputs GROUP BY function_name")
        assert {a["group"]["function_name"]: a["count"] for a in steps} == dict(db)


def test_a_workflow_its_steps_and_the_changes_an_operator_makes(
    start_relay: StartRelay, start_ts: StartTs, sysdb: str
) -> None:
    relay = start_relay()
    seeded(relay, start_ts, sysdb)
    with relay.api() as api:
        done = ok(api.get(f"{LEDGER}/workflows/done-1"))
        assert (done["status"], done["workflowName"], done["output"]) == ("SUCCESS", "parent", "'TOTAL 2 child 2'")
        assert ok(api.get(f"{LEDGER}/workflows/done-1-child"))["parentWorkflowId"] == "done-1"
        assert "failed on purpose with 3" in ok(api.get(f"{LEDGER}/workflows/failed-1"))["error"]
        steps = ok(api.get(f"{LEDGER}/workflows/done-1/steps"))
        db = query(sysdb, """SELECT function_id, function_name, child_workflow_id FROM dbos.operation_outputs
                             WHERE workflow_uuid = 'done-1' ORDER BY function_id""")  # fmt: skip
        assert [(s["stepId"], s["stepName"], s["childWorkflowId"]) for s in steps] == db
        assert "done-1-child" in {s["childWorkflowId"] for s in steps}

        ok(api.post(f"{LEDGER}/workflows/waiting-1/cancel"), 204)
        assert db_status(sysdb, "waiting-1") == "CANCELLED"
        ok(api.post(f"{LEDGER}/workflows/waiting-1/resume", json={}), 204)
        assert_eventually(lambda: db_status(sysdb, "waiting-1") == "PENDING", 20)
        body = ok(
            api.post(f"{LEDGER}/workflows/done-1/fork", json={"newWorkflowId": "done-1-fork", "startStep": 1}), 201
        )
        assert body == {"workflowId": "done-1-fork"}
        assert_eventually(lambda: db_status(sysdb, "done-1-fork") == "SUCCESS", 20)
        forked = ok(api.get(f"{LEDGER}/workflows/done-1-fork"))
        assert (forked["forkedFrom"], forked["output"]) == ("done-1", "'TOTAL 2 child 2'")
        # Fork-from-failure's modes not chosen are left out (the TypeScript SDK counted a null one as
        # chosen and refused every request: "Exactly one of ...", 502).
        body = {"workflowIds": ["failed-1"], "fromLastFailure": True}
        (refork,) = ok(api.post(f"{LEDGER}/workflows/bulk-fork-from-failure", json=body))["workflowIds"]
        assert query(sysdb, "SELECT forked_from FROM dbos.workflow_status WHERE workflow_uuid = %s", refork) == [
            ("failed-1",)
        ]
        # By default from the first step: the TypeScript SDK's is step 0, which a fork from step 1
        # would have copied (with its first run's times) rather than run again.
        drawn = ok(api.post(f"{LEDGER}/workflows/done-1/fork", json={}), 201)["workflowId"]
        assert_eventually(lambda: db_status(sysdb, drawn) == "SUCCESS", 20)
        sql: LiteralString = """SELECT workflow_uuid, started_at_epoch_ms FROM dbos.operation_outputs
                                WHERE function_id = 0 AND workflow_uuid = ANY(%s)"""
        first_steps = dict(query(sysdb, sql, ["done-1", drawn]))
        assert first_steps[drawn] > first_steps["done-1"], first_steps  # run again, not copied


def test_a_dead_typescript_executors_workflows_complete_exactly_once_on_a_typescript_peer(
    start_relay: StartRelay, start_ts: StartTs, evidence_db: str
) -> None:
    """The Python SDK's recovery test (test_recovery.py), on the TypeScript SDK, whose client serves
    ``recovery`` differently: the workflows go back on DBOS's internal queue, for an executor of
    the version to take."""
    relay = start_relay(grace=1.0)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    peer = start_ts(relay.conductor_url, env=env)
    assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 20)
    doomed = start_ts(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "10", "RELAY_TEST_JOB_SLEEP": "8"})
    # Known to Relay before it dies (its client connects as DBOS launches, beside the jobs).
    assert_eventually(lambda: relay.state_of("acme", "ledger", doomed.executor_id) == "HEALTHY", 20)
    doomed.kill()

    evidence = Evidence(evidence_db)
    outcomes = assert_eventually(lambda: (o := evidence.outcomes()) and len(o) >= 10 and o, 40)
    assert set(outcomes) == {f"job-{i}" for i in range(10)}
    assert set(outcomes.values()) == {peer.executor_id}
    assert evidence.outcome_count() == 10
    assert_eventually(lambda: relay.executor("acme", "ledger", doomed.executor_id) is None, 10)
    actions = audit_actions(relay, doomed.executor_id)
    assert in_order(actions, ["executor.dead", "recovery.dispatched", "recovery.succeeded", "executor.deleted"]), (
        actions
    )
    with relay.api() as api:
        recoveries = api.get(f"{LEDGER}/recoveries", params={"executorId": doomed.executor_id}).json()
    assert [r["status"] for r in recoveries] == ["succeeded"]
    assert recoveries[0]["attempts"][-1]["peerExecutorId"] == peer.executor_id


def test_typescript_work_stranded_while_relay_was_down_is_found_and_completed_exactly_once(
    start_relay: StartRelay, start_ts: StartTs, evidence_db: str, relay_db: str, sysdb: str
) -> None:
    """The reconciler lists the stranded work through a TypeScript executor (list_workflows by
    executor id and status): test_reconciler.py's test on the TypeScript SDK."""
    relay = reconciling_relay(start_relay, grace=1.0)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    peer = start_ts(relay.conductor_url, env=env)
    victim = start_ts(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "4", "RELAY_TEST_JOB_SLEEP": "5"})
    assert_eventually(lambda: relay.state_of("acme", "ledger", victim.executor_id) == "HEALTHY", 20)
    evidence = Evidence(evidence_db)
    assert_eventually(lambda: len(evidence.step_runs()) >= 4 or None, 10)

    def first_steps_recorded() -> bool:  # so that a recovery does not run them again
        sql: LiteralString = "SELECT count(*) FROM dbos.operation_outputs WHERE function_name = 'evidence'"
        return query(sysdb, sql)[0][0] >= 4

    assert_eventually(first_steps_recorded, 10)
    assert relay.proc is not None
    relay.proc.kill()  # Relay dies; the victim dies while it is down, and its record is lost with it
    relay.proc.wait()
    victim.kill()
    with psycopg.connect(relay_db, autocommit=True) as conn:
        conn.execute("DELETE FROM executors WHERE executor_id = %s", (victim.executor_id,))
    relay.start()

    outcomes = assert_eventually(lambda: (o := evidence.outcomes()) and len(o) >= 4 and o, 40)
    assert set(outcomes) == {f"job-{i}" for i in range(4)}
    assert set(outcomes.values()) == {peer.executor_id}
    assert set(steps_once(evidence).values()) == {1}
    assert_eventually(lambda: "executor.deleted" in audit_actions(relay, victim.executor_id), 20)
    actions = audit_actions(relay, victim.executor_id)
    for action in ("reconcile.found", "reconcile.recovered", "recovery.succeeded"):
        assert actions.count(action) == 1, (action, actions)


def test_a_typescript_executor_comes_back_after_relay_restarts_and_is_declared_dead_when_paused(
    start_relay: StartRelay, start_ts: StartTs
) -> None:
    """The SDK's client reconnects a second after its socket drops, under the same executor id; a
    paused one stops answering Relay's pings and is declared dead after its grace period."""
    relay = start_relay(grace=1.0)
    ts = start_ts(relay.conductor_url)
    assert_eventually(lambda: relay.state_of("acme", "ledger", ts.executor_id) == "HEALTHY", 20)
    before = relay.executor("acme", "ledger", ts.executor_id)
    assert before is not None
    assert relay.proc is not None
    relay.proc.kill()
    relay.proc.wait()
    relay.start()

    def connected_again() -> bool:
        record = relay.executor("acme", "ledger", ts.executor_id)
        return bool(record and record["state"] == "HEALTHY" and record["connectedAt"] > before["connectedAt"])

    assert_eventually(connected_again, 20, what="the same executor id connected again")
    ts.proc.send_signal(signal.SIGSTOP)
    try:
        # pingWaitSecs 1 and the grace period 1 s (relay_yaml): a loaded machine gets slack.
        assert_eventually(lambda: relay.state_of("acme", "ledger", ts.executor_id) in ("DEAD", "RECOVERING", None), 15)
    finally:
        ts.proc.send_signal(signal.SIGCONT)
