"""Executors on DBOS's TypeScript SDK (@dbos-inc/dbos-sdk 5.2, its own conductor client:
harness/ts_app): they connect, die and are recovered by a peer exactly once, are found by the
reconciler, come back after Relay restarts, and the workflow API serves them, each answer checked
against what their system database holds (read here; Relay never reads it). Retention rounds, the
apps' figures (/metrics, Conductor's Metric[]) and the alerts (WorkflowFailure, SlowQueue, and
delivery to a TypeScript app's handler) are checked the same way.

The TypeScript SDK reads some frames differently from the Python SDK: a filter sent as null is
not always "no filter" there (``was_forked_from: null`` matched no workflow), so these tests run
the same requests as the Python ones against it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, LiteralString

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.executors import Evidence, ExecutorProcess, jobs_held
from harness.keys import API_KEYS
from harness.ports import free_port
from harness.relay import RelayProcess, audit_actions, relay_yaml
from harness.ts_executor import SDK_VERSION, start_ts_executor
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.core.times import us_iso
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
    start_relay: StartRelay, start_ts: StartTs, evidence_db: str, tmp_path: Path
) -> None:
    """The Python SDK's recovery test (test_recovery.py), on the TypeScript SDK, whose client serves
    ``recovery`` differently: the workflows go back on DBOS's internal queue, for an executor of
    the version to take."""
    relay = start_relay(grace=1.0)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    peer = start_ts(relay.conductor_url, env=env)
    assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 20)
    # The doomed executor holds its jobs back until Relay knows it (the gate): started as it launched,
    # their 8 s sleep had to outlast its READY and the registry's wait, and ended on it, before it
    # died, when a loaded machine took longer. Their 2 s sleep now has to outlast only its READY.
    jobs = {"RELAY_TEST_JOBS": "10", "RELAY_TEST_JOB_SLEEP": "2"}
    with jobs_held(start_ts, relay.conductor_url, tmp_path, {**env, **jobs}) as held:
        # Known to Relay before it dies (its client connects as DBOS launches, before the jobs).
        held.await_healthy(relay, [peer.executor_id], 20, what="the doomed executor HEALTHY")
    doomed = held.release()
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


def test_a_dead_typescript_executor_waits_for_a_typescript_peer_never_a_python_one(
    start_relay: StartRelay, start_ts: StartTs, start_executor: StartTs, evidence_db: str, tmp_path: Path
) -> None:
    """An app whose executors mix the SDKs (README: run an app's executors in one language). A
    TypeScript executor died beside a healthy Python one of the same version, its only peer: Relay
    asked the Python executor to recover it, which took the workflows (they became its own, so
    nothing of the dead one's was left PENDING for the check) and failed each (``Serialization
    js_superjson is not available``): the recovery succeeded and the work stayed PENDING on a live
    executor that could never run it. Now the recovery waits for a peer of its language and says
    why; the mix is logged as the TypeScript executor connects and shown in the app's
    ``languages``; and a TypeScript peer that connects completes the work, exactly once."""
    relay = start_relay(grace=0.5)
    python = start_executor(relay.conductor_url)
    assert_eventually(lambda: relay.state_of("acme", "ledger", python.executor_id) == "HEALTHY", 20)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    # The doomed executor holds its jobs back until the mix is seen (the gate): started as it
    # launched, their 4 s sleep had to outlast the registry's wait, the log's and the API's, and
    # ended on it, before it died, when a loaded machine took longer. Their 2 s sleep now has to
    # outlast only its READY.
    jobs = {"RELAY_TEST_JOBS": "3", "RELAY_TEST_JOB_SLEEP": "2"}
    with jobs_held(start_ts, relay.conductor_url, tmp_path, {**env, **jobs}) as held:
        held.await_healthy(relay, [python.executor_id], 20, what="the doomed executor HEALTHY")
        warned = assert_eventually(lambda: [line for line in relay.log().splitlines() if "mixes languages" in line], 10)
        mix = f"executor {held.executor_id} runs the typescript SDK, and healthy executors of the app run python."
        assert len(warned) == 1 and mix in warned[0] and "WARNING" in warned[0], warned
        with relay.api() as api:
            assert ok(api.get(LEDGER))["languages"] == ["python", "typescript"]
    doomed = held.release()
    doomed.kill()

    blocked = assert_eventually(
        lambda: (e := relay.executor("acme", "ledger", doomed.executor_id)) and e["blockedReason"] and e, 15
    )
    assert blocked["state"] == "DEAD" and blocked["blockedReason"] == "no_peer_of_its_language", blocked
    with relay.api() as api:
        (waiting,) = ok(api.get(f"{LEDGER}/recoveries", params={"executorId": doomed.executor_id}))
        listed = ok(api.get(f"{LEDGER}/executors/{python.executor_id}/workflows"))
    assert waiting["status"] == "waiting_for_peer", waiting
    assert waiting["error"] == (
        "the app's healthy executors run only another language's SDK (python), which cannot run a typescript"
        " executor's workflows"
    )
    assert "recovery.dispatched" not in audit_actions(relay, doomed.executor_id)
    assert not [w for w in listed if w["workflowName"] == "job"]  # none taken by the Python executor

    # Gone before the TypeScript peer comes: both SDKs take workflows from DBOS's one internal queue,
    # where the peer's recovery puts them, and the Python executor would take some first (README).
    python.kill()
    peer = start_ts(relay.conductor_url, env=env)
    evidence = Evidence(evidence_db)
    outcomes = assert_eventually(lambda: (o := evidence.outcomes()) and len(o) >= 3 and o, 30)
    assert outcomes == {f"job-{i}": peer.executor_id for i in range(3)}
    assert evidence.outcome_count() == 3

    def ended() -> dict[str, Any] | None:
        with relay.api() as api:
            (run,) = ok(api.get(f"{LEDGER}/recoveries", params={"executorId": doomed.executor_id}))
        return run if run["status"] in ("succeeded", "failed") else None

    # Its check may come after the outcomes on a loaded machine (the peer runs them as it takes them).
    done = assert_eventually(ended, 20, what="the recovery's end")
    assert done["status"] == "succeeded" and done["attempts"][-1]["peerExecutorId"] == peer.executor_id


def test_typescript_work_stranded_while_relay_was_down_is_found_and_completed_exactly_once(
    start_relay: StartRelay, start_ts: StartTs, evidence_db: str, relay_db: str, sysdb: str, tmp_path: Path
) -> None:
    """The reconciler lists the stranded work through a TypeScript executor (list_workflows by
    executor id and status): test_reconciler.py's test on the TypeScript SDK."""
    relay = reconciling_relay(start_relay, grace=1.0)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    peer = start_ts(relay.conductor_url, env=env)
    # The victim holds its jobs back until Relay knows it (the gate): started as it launched, their
    # 5 s sleep had to outlast its READY and the registry's wait too, besides their first steps and
    # Relay's death. Now those last two are all it has to outlast.
    jobs = {"RELAY_TEST_JOBS": "4", "RELAY_TEST_JOB_SLEEP": "5"}
    with jobs_held(start_ts, relay.conductor_url, tmp_path, {**env, **jobs}) as held:
        held.await_healthy(relay, [peer.executor_id], 20, what="the victim HEALTHY")
    victim = held.release()
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


# -- retention, the apps' figures and alerts, on a TypeScript executor ---------------------------------
# Each rides on protocol messages (retention, get_workflow_aggregates, get_step_aggregates, alert) that
# the TypeScript SDK reads with its own code (dist/src/conductor/conductor.js); each answer is checked
# against the system database, read here.

FINISHED = ("SUCCESS", "ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED")
# What RELAY_TEST_SEED=1 and RELAY_TEST_HOLD_QUEUE=2 leave unfinished: waiting-1 and blocker-1 PENDING,
# held-0 and held-1 ENQUEUED behind blocker-1 on the queue serial.
UNFINISHED = {"waiting-1": "PENDING", "blocker-1": "PENDING", "held-0": "ENQUEUED", "held-1": "ENQUEUED"}


def statuses(sysdb: str) -> dict[str, str]:
    return {w: s for w, s in query(sysdb, "SELECT workflow_uuid, status FROM dbos.workflow_status")}


def rows_of(sysdb: str, workflow_ids: list[str]) -> dict[str, list[tuple[Any, ...]]]:
    """Every row the system database holds of these workflows, table by table (their payloads are
    in tables of their own in the TypeScript SDK's schema)."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    for table, columns in (
        ("workflow_status", "workflow_uuid, status, created_at"),
        ("workflow_input", "workflow_uuid, inputs"),
        ("workflow_output", "workflow_uuid, output, error"),
        ("operation_outputs", "workflow_uuid, function_id, function_name"),
        ("workflow_events", "workflow_uuid, key"),
    ):
        sql = f"SELECT {columns} FROM dbos.{table} WHERE workflow_uuid = ANY(%s) ORDER BY 1, 2"
        found[table] = query(sysdb, sql, workflow_ids)
    return found


def retention_config(**app: Any) -> dict[str, Any]:
    config = relay_yaml(free_port())
    config["retention"] = {"appsIntervalSecs": 0.5}
    config["metrics"] = {"appFigures": False}
    config["orgs"][0]["apps"][0].update(app)
    return config


def audited(relay: RelayProcess, action: str) -> list[dict[str, Any]]:
    with relay.api() as api:
        return [e for e in ok(api.get("/audit", params={"app": "ledger", "limit": 10000})) if e["action"] == action]


def held_up(relay: RelayProcess, start_ts: StartTs, sysdb: str, **env: str) -> ExecutorProcess:
    """A TypeScript executor with the seed and two workflows held on the queue serial."""
    ts = start_ts(relay.conductor_url, env={"RELAY_TEST_SEED": "1", "RELAY_TEST_HOLD_QUEUE": "2", **env})
    assert_eventually(lambda: relay.state_of("acme", "ledger", ts.executor_id) == "HEALTHY", 20)
    assert_eventually(lambda: {w: s for w, s in statuses(sysdb).items() if w in UNFINISHED} == UNFINISHED, 20)

    # And the two PENDING ones inside their recv (its timeout's sleep recorded): a blocker dequeued
    # but not yet there writes that row later, under a test comparing their rows before and after.
    def receiving() -> set[str]:
        rows = rows_of(sysdb, ["waiting-1", "blocker-1"])["operation_outputs"]
        return {w for w, _, name in rows if name == "DBOS.sleep"}

    assert_eventually(lambda: receiving() == {"waiting-1", "blocker-1"}, 20, what="both waiting in recv")
    return ts


def test_retention_rounds_prune_a_typescript_apps_finished_workflows_and_nothing_else(
    start_relay: StartRelay, start_ts: StartTs, sysdb: str
) -> None:
    """The rows threshold, then the time threshold, applied by a TypeScript executor: the finished
    workflows (and their inputs, outputs, steps, events) go, the unfinished ones keep every row, and
    Relay's check of each round (get_workflow_aggregates) counts what the system database holds."""
    relay = start_relay(retention_config())
    ts = held_up(relay, start_ts, sysdb)
    finished = {w for w, s in statuses(sysdb).items() if s in FINISHED}
    assert finished == {"done-1", "done-1-child", "failed-1"}
    before = rows_of(sysdb, list(UNFINISHED))
    assert before["workflow_input"], "the unfinished workflows' inputs are in their own table"

    # The rows threshold keeps the newest two finished workflows (by completion: the child first).
    with relay.api() as api:
        assert ok(api.patch(LEDGER, json={"gcRowsThreshold": 2}))["gcRowsThreshold"] == 2
    assert_eventually(lambda: {w for w, s in statuses(sysdb).items() if s in FINISHED} == {"done-1", "failed-1"}, 20)

    def checked_rows() -> list[dict[str, Any]]:
        return [e for e in audited(relay, "retention.checked") if e["detail"]["gcRowsThreshold"] == 2]

    # Later rounds count the finished workflows left: the two kept.
    assert_eventually(lambda: [e for e in checked_rows() if e["detail"]["remaining"]["finished"] == 2], 20, 0.2)
    assert all(e["peerExecutorId"] == ts.executor_id for e in audited(relay, "retention.sent"))

    # The time threshold takes the rest; nothing of the unfinished workflows goes.
    with relay.api() as api:
        body = ok(api.patch(LEDGER, json={"gcRowsThreshold": None, "gcTimeThresholdMs": 1500}))
        assert (body["gcRowsThreshold"], body["gcTimeThresholdMs"]) == (None, 1500)
    assert_eventually(lambda: not finished & set(statuses(sysdb)), 20, interval=0.2)
    # Their payloads, steps and events too (the SDK sweeps them once their status rows are gone).
    assert_eventually(lambda: not any(rows_of(sysdb, sorted(finished)).values()), 20, 0.2)

    def checked_empty() -> list[dict[str, Any]]:
        done = [
            e
            for e in audited(relay, "retention.checked")
            if e["detail"]["gcCutoffEpochMs"] is not None and e["detail"]["remaining"]["finishedBeforeCutoff"] == 0
        ]
        return done if len(done) >= 2 else []

    assert_eventually(checked_empty, 20, interval=0.2)
    assert rows_of(sysdb, list(UNFINISHED)) == before
    assert {w: s for w, s in statuses(sysdb).items() if w in UNFINISHED} == UNFINISHED


def test_retention_checks_count_what_a_typescript_executor_left(
    start_relay: StartRelay, start_ts: StartTs, sysdb: str
) -> None:
    """A threshold that deletes nothing: every check of a round must count what the system database
    holds (three finished workflows, none completed before a cutoff a day back), as it does of a
    Python executor's; a count of 0 there would say a round deleted what it did not."""
    day = 24 * 3600 * 1000
    relay = start_relay(retention_config(gcRowsThreshold=100, gcTimeThresholdMs=day, globalTimeoutMs=day))
    held_up(relay, start_ts, sysdb)

    def checked() -> list[dict[str, Any]]:
        found = audited(relay, "retention.checked")
        return found if len(found) >= 2 else []

    entries = assert_eventually(checked, 20, interval=0.2)
    for entry in entries:
        remaining = entry["detail"]["remaining"]
        assert remaining == {"finished": 3, "finishedBeforeCutoff": 0, "unfinishedBeforeTimeout": 0}, entry
    assert {w for w, s in statuses(sysdb).items() if s in FINISHED} == {"done-1", "done-1-child", "failed-1"}


def test_a_global_timeout_cancels_a_typescript_apps_old_unfinished_workflows(
    start_relay: StartRelay, start_ts: StartTs, sysdb: str
) -> None:
    relay = start_relay(retention_config(globalTimeoutMs=1000))
    ts = start_ts(relay.conductor_url, env={"RELAY_TEST_SEED": "1", "RELAY_TEST_HOLD_QUEUE": "2"})
    assert_eventually(lambda: relay.state_of("acme", "ledger", ts.executor_id) == "HEALTHY", 20)
    assert_eventually(lambda: all(statuses(sysdb).get(w) == "CANCELLED" for w in UNFINISHED), 20, interval=0.2)
    # Finished workflows are not the timeout's business.
    assert {w: s for w, s in statuses(sysdb).items() if w not in UNFINISHED} == {
        "done-1": "SUCCESS",
        "done-1-child": "SUCCESS",
        "failed-1": "ERROR",
    }
    sent = audited(relay, "retention.sent")
    assert sent and all(e["detail"]["gcCutoffEpochMs"] is None for e in sent)

    def nothing_left() -> bool:
        return any(
            e["detail"]["remaining"]["unfinishedBeforeTimeout"] == 0 for e in audited(relay, "retention.checked")
        )

    assert_eventually(nothing_left, 20, interval=0.2)


FIGURES_WINDOW = 1.0
PREFIX = "dbos_conductor_v1_"
Figures = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_figures(relay: RelayProcess) -> str:
    resp = httpx.get(f"{relay.http}/metrics", headers={"Authorization": f"Bearer {API_KEYS['acme']}"},
                     params={"scope": "apps"}, timeout=5, verify=TLS)  # fmt: skip
    resp.raise_for_status()
    return resp.text


def served_figures(text: str) -> tuple[int | None, Figures, Figures]:
    """acme/ledger's figures in a scrape: the window's start (ms), its windowed figures, and the
    point-in-time ones."""
    windowed: Figures = {}
    now: Figures = {}
    stamps = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(PREFIX) or s.labels.get("application") != "ledger":
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("org", "application")))
            if s.timestamp is None:
                now[(s.name.removeprefix(PREFIX), labels)] = s.value
            else:
                windowed[(s.name.removeprefix(PREFIX), labels)] = s.value
                stamps.add(round(float(s.timestamp) * 1000))
    assert len(stamps) <= 1, stamps
    return (stamps.pop() if stamps else None), windowed, now


def db_figures(sysdb: str, start_ms: int) -> Figures:
    """What the windowed figures of the window starting at ``start_ms`` must be, from the system database."""
    end_ms = start_ms + round(FIGURES_WINDOW * 1000)
    found: Figures = {}

    def put(family: str, value: float, **labels: str) -> None:
        found[(family, tuple(sorted(labels.items())))] = value

    ws: LiteralString = "FROM dbos.workflow_status WHERE"
    for name, queue, n in query(sysdb, f"""SELECT name, coalesce(queue_name, ''), count(*) {ws}
            created_at >= %s AND created_at < %s GROUP BY 1, 2""", start_ms, end_ms):  # fmt: skip
        put("workflow_started_rate", n / FIGURES_WINDOW, workflow_name=name, queue_name=queue)
    for name, queue, n in query(sysdb, f"""SELECT name, queue_name, count(*) {ws} queue_name IS NOT NULL
            AND started_at_epoch_ms >= %s AND started_at_epoch_ms < %s GROUP BY 1, 2""", start_ms, end_ms):  # fmt: skip
        put("workflow_dequeued_rate", n / FIGURES_WINDOW, workflow_name=name, queue_name=queue)
    failed = "workflow_failed_rate"
    rates = {"SUCCESS": "workflow_success_rate", "ERROR": failed, "MAX_RECOVERY_ATTEMPTS_EXCEEDED": failed,
             "CANCELLED": "workflow_cancelled_rate"}  # fmt: skip
    for status, name, queue, n, wait, latency in query(sysdb, f"""SELECT status, name, coalesce(queue_name, ''),
            count(*), max(started_at_epoch_ms - created_at), max(completed_at - created_at) {ws}
            completed_at >= %s AND completed_at < %s GROUP BY 1, 2, 3""", start_ms, end_ms):  # fmt: skip
        put(rates[status], n / FIGURES_WINDOW, workflow_name=name, queue_name=queue)
        if status == "SUCCESS":
            put("workflow_max_total_latency_seconds", latency / 1000, workflow_name=name, queue_name=queue)
            if wait is not None:
                put("workflow_max_queue_wait_seconds", max(0, wait) / 1000, workflow_name=name, queue_name=queue)
    steps: LiteralString = """SELECT function_name, error IS NOT NULL, count(*),
            max(completed_at_epoch_ms - started_at_epoch_ms) FROM dbos.operation_outputs
            WHERE completed_at_epoch_ms >= %s AND completed_at_epoch_ms < %s GROUP BY 1, 2"""
    for step, erred, n, longest in query(sysdb, steps, start_ms, end_ms):
        put("step_failed_rate" if erred else "step_success_rate", n / FIGURES_WINDOW, step_name=step)
        if not erred:
            put("step_max_duration_seconds", max(0, longest) / 1000, step_name=step)
    return found


def test_a_typescript_apps_figures_are_what_its_system_database_holds(
    start_relay: StartRelay, start_ts: StartTs, sysdb: str
) -> None:
    """/metrics' dbos_conductor_v1_* figures of a TypeScript app (from get_workflow_aggregates and
    get_step_aggregates answered by its SDK), window by window, against its system database."""
    config = relay_yaml(free_port())
    config["metrics"] = {"appFiguresWindowSecs": FIGURES_WINDOW}
    relay = start_relay(config)
    ts = held_up(relay, start_ts, sysdb)
    # Work while the executor is HEALTHY, so that the windows it falls in are computed: forks (through
    # DBOS's internal queue) of the seed's success (a step, a child, an event) and of its failure.
    with relay.api() as api:
        for n in range(3):
            ok(api.post(f"{LEDGER}/workflows/done-1/fork", json={"newWorkflowId": f"again-{n}"}), 201)
        ok(api.post(f"{LEDGER}/workflows/failed-1/fork", json={"newWorkflowId": "again-failed"}), 201)
    forks = ["again-0", "again-1", "again-2", "again-failed"]
    assert_eventually(lambda: all(db_status(sysdb, w) in ("SUCCESS", "ERROR") for w in forks), 20)
    done = max(int(c) for (c,) in query(sysdb, "SELECT completed_at FROM dbos.workflow_status "
                                               "WHERE workflow_uuid = ANY(%s)", forks))  # fmt: skip

    # Every window served from now until the one in which the last fork completed, each against the
    # database (a window in which nothing happened has no windowed series).
    width = round(FIGURES_WINDOW * 1000)
    checked: dict[int, Figures] = {}

    def windows_up_to_the_forks() -> bool:
        start_ms, windowed, _ = served_figures(scrape_figures(relay))
        if start_ms is not None:
            checked.setdefault(start_ms, windowed)
        return done - done % width in checked

    assert_eventually(windows_up_to_the_forks, 15, interval=0.1)
    for start_ms, windowed in checked.items():
        assert windowed == pytest.approx(db_figures(sysdb, start_ms)), start_ms
    last = checked[done - done % width]
    assert any(family == "workflow_success_rate" for family, _ in last), last

    # Conductor's Metric[] of those windows: workflows created and steps completed, by name, as the
    # SDK's get_metrics counts them.
    since = datetime.fromtimestamp(min(checked) / 1000, UTC).isoformat()
    until = datetime.fromtimestamp(max(checked) / 1000 + FIGURES_WINDOW, UTC).isoformat()
    with relay.api() as api:
        metrics = ok(api.get(f"{LEDGER}/metrics", params={"startTime": since, "endTime": until}))
    for start_ms in checked:
        bucket = us_iso(datetime.fromtimestamp(start_ms / 1000, UTC))
        served = {(m["metricType"], m["metricName"]): m["value"] for m in metrics if m["timeBucket"] == bucket}
        end_ms = start_ms + width
        workflows = query(sysdb, """SELECT name, count(*) FROM dbos.workflow_status
                                    WHERE created_at >= %s AND created_at < %s GROUP BY 1""",
                          start_ms, end_ms)  # fmt: skip
        steps = query(sysdb, """SELECT function_name, count(*) FROM dbos.operation_outputs
                                WHERE completed_at_epoch_ms >= %s AND completed_at_epoch_ms < %s GROUP BY 1""",
                      start_ms, end_ms)  # fmt: skip
        expected = {("workflow_count", n): c for n, c in workflows} | {("step_count", n): c for n, c in steps}
        assert {k: v for k, v in served.items() if k[0] != "recovery_count"} == expected, (bucket, served, expected)

    # Point-in-time: what the system database holds now (nothing changes any more).
    def created(workflow_id: str) -> float:
        return int(
            query(sysdb, "SELECT created_at FROM dbos.workflow_status WHERE workflow_uuid = %s", workflow_id)[0][0]
        )

    held = (("queue_name", "serial"), ("workflow_name", "quick"))
    expected_now = {
        ("workflow_enqueued_count", held): 2,
        ("workflow_oldest_enqueued_timestamp_seconds", held): created("held-0") / 1000,
        ("workflow_pending_count", (("workflow_name", "waiting"),)): 1,
        ("workflow_oldest_pending_timestamp_seconds", (("workflow_name", "waiting"),)): created("waiting-1") / 1000,
        ("workflow_pending_count", (("workflow_name", "blocker"),)): 1,
        ("workflow_oldest_pending_timestamp_seconds", (("workflow_name", "blocker"),)): created("blocker-1") / 1000,
        ("executor_count", (("application_version", "v1"), ("status", "HEALTHY"))): 1,
    }
    assert_eventually(lambda: served_figures(scrape_figures(relay))[2] == pytest.approx(expected_now), 5)
    assert relay.state_of("acme", "ledger", ts.executor_id) == "HEALTHY"


def alert_relay(start_relay: StartRelay, rules: list[dict[str, Any]]) -> RelayProcess:
    """A Relay whose ledger has ``rules``, evaluated every half second, and an app notifier."""
    config = relay_yaml(free_port())
    config["alerts"] = {"allowedDestinations": ["127.0.0.1"], "pollIntervalSecs": 0.2, "checkIntervalSecs": 0.5,
                        "retryInitialSecs": 0.3, "retryMaxSecs": 1.0, "timeoutSecs": 2.0}  # fmt: skip
    config["metrics"] = {"appFigures": False}
    config["orgs"][0]["apps"][0]["alerts"] = rules
    config["orgs"][0]["apps"].append({"name": "notifier"})
    return start_relay(config)


def received(evidence_db: str, name: str) -> list[dict[str, Any]]:
    """What the receiving app's alert handler wrote (harness/ts_app's, as harness/alert_app.py's)."""
    try:
        rows = query(evidence_db, "SELECT message, metadata, executor_id FROM alerts_received WHERE name = %s", name)
    except psycopg.errors.UndefinedTable:
        return []
    return [{"message": m, "metadata": md, "executorId": e} for m, md, e in rows]


def test_a_typescript_apps_failed_workflow_and_held_queue_alert_a_typescript_receiver(
    start_relay: StartRelay, start_ts: StartTs, sysdb: str, evidence_db: str
) -> None:
    """WorkflowFailure and SlowQueue rules on a TypeScript app (get_workflow_aggregates answered by
    its SDK), delivered through the ``alert`` message to another TypeScript app's handler
    (DBOS.setAlertHandler), once each."""
    rules = [
        {"kind": "WorkflowFailure", "workflowName": "failing", "count": 2, "windowSecs": 120,
         "receiverApp": "notifier"},
        {"kind": "SlowQueue", "queueName": "serial", "thresholdSecs": 1, "receiverApp": "notifier"},
    ]  # fmt: skip
    relay = alert_relay(start_relay, rules)
    notifier = start_ts(relay.conductor_url, app="notifier", version="n1", env={"RELAY_TEST_ALERTS": evidence_db})
    assert_eventually(lambda: relay.state_of("acme", "notifier", notifier.executor_id) == "HEALTHY", 20)
    # failed-1 (the seed's) and failed-run-0: two failures of `failing`.
    ledger = held_up(relay, start_ts, sysdb, RELAY_TEST_FAILURES="1")
    assert query(sysdb, "SELECT count(*) FROM dbos.workflow_status WHERE name = 'failing' AND status = 'ERROR'") == [
        (2,)
    ]

    (failure,) = assert_eventually(lambda: received(evidence_db, "WorkflowFailure"), 20, what="WorkflowFailure")
    assert failure["executorId"] == notifier.executor_id
    metadata = failure["metadata"]
    assert (metadata["workflow_name"], metadata["failed_workflow_count"], metadata["threshold"]) == (
        "failing",
        "2",
        "2",
    )
    assert (metadata["application_name"], metadata["org"]) == ("ledger", "acme") and metadata["idempotency_key"]
    assert failure["message"].startswith("2 workflow failing of app ledger failed"), failure
    (slow,) = assert_eventually(lambda: received(evidence_db, "SlowQueue"), 20, what="SlowQueue")
    assert slow["metadata"]["queue_name"] == "serial" and slow["executorId"] == notifier.executor_id
    # The blocker, enqueued first, counts too if the round saw it before the queue started it.
    assert 1 <= int(slow["metadata"]["stuck_workflow_count"]) <= 3, slow
    sql: LiteralString = """SELECT workflow_uuid, created_at FROM dbos.workflow_status
                            WHERE queue_name = 'serial' OR workflow_uuid = 'blocker-1'"""
    created = {w: int(c) for w, c in query(sysdb, sql)}
    oldest = ms(slow["metadata"]["oldest_enqueued_at"])
    assert oldest is not None and created["blocker-1"] <= oldest <= created["held-0"], (slow, created)

    # A condition that keeps holding is one alert, however many rounds see it.
    assert_eventually(lambda: len(audited_all(relay, "alert.sent")) >= 2, 10)
    time.sleep(1.5)
    assert len(received(evidence_db, "WorkflowFailure")) == len(received(evidence_db, "SlowQueue")) == 1
    assert {e["detail"]["destination"] for e in audited_all(relay, "alert.sent")} == {"app notifier"}
    assert relay.state_of("acme", "ledger", ledger.executor_id) == "HEALTHY"


def audited_all(relay: RelayProcess, action: str) -> list[dict[str, Any]]:
    with relay.api() as api:
        return [e for e in ok(api.get("/audit", params={"limit": 10000})) if e["action"] == action]


def test_an_alert_a_typescript_handler_throws_on_is_delivered_again(
    start_relay: StartRelay, start_ts: StartTs, sysdb: str, evidence_db: str
) -> None:
    """The TypeScript SDK answers ``alert`` with ``success: false`` when the handler throws: Relay
    tries again (alerts.retryInitialSecs), and the handler gets the alert once it takes it."""
    relay = alert_relay(
        start_relay, [{"kind": "WorkflowFailure", "workflowName": "failing", "receiverApp": "notifier"}]
    )
    env = {"RELAY_TEST_ALERTS": evidence_db, "RELAY_TEST_ALERTS_FAIL": "2"}
    notifier = start_ts(relay.conductor_url, app="notifier", version="n1", env=env)
    assert_eventually(lambda: relay.state_of("acme", "notifier", notifier.executor_id) == "HEALTHY", 20)
    seeded(relay, start_ts, sysdb)
    (failure,) = assert_eventually(lambda: received(evidence_db, "WorkflowFailure"), 20, what="WorkflowFailure")
    assert failure["metadata"]["failed_workflow_count"] == "1"
    (sent,) = assert_eventually(lambda: audited_all(relay, "alert.sent"), 10)
    assert sent["detail"]["attempts"] == 3, sent
    assert not audited_all(relay, "alert.failed")
