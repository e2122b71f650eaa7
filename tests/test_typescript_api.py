"""Every route of the workflow API answered through an executor, with a TypeScript executor
(@dbos-inc/dbos-sdk 5.2, harness/ts_app) the app's only one: each answer checked against what its
system database holds (read here; Relay never reads it), and against what the same route answers
for a Python executor (tests/test_workflow_api.py) where the two SDKs' shapes can agree.

One world for the module: one Relay, one TypeScript executor that seeded the fixtures
(RELAY_TEST_SEED and RELAY_TEST_RICH: done-1, its child, failed-1, waiting-1, rich-1, the queue
``serial`` and the paused schedule ``every-hour``). Reads come first; the changes after them make
workflows of their own or say which fixture they change.

What the TypeScript SDK answers differently from the Python SDK, and Relay serves as it is: values
(inputs, outputs, events, messages, stream values, a schedule's context) are shown as Node.js's
``util.inspect`` shows them (``'hello'``, ``[ 1 ]``); errors as JSON of the serialized Error; steps
are numbered from 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, LiteralString

import httpx
import psycopg
import pytest

from harness.executors import ExecutorProcess
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.ts_executor import start_ts_executor
from harness.waiting import assert_eventually

LEDGER = "/apps/ledger"


@dataclass
class World:
    sysdb: str
    relay: RelayProcess
    ts: ExecutorProcess

    def api(self) -> httpx.Client:
        return self.relay.api("acme")


def query(url: str, sql: LiteralString, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return list(conn.execute(sql, params).fetchall())


@pytest.fixture(scope="module")
def world(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir: Path = tmp_path_factory.mktemp("typescript-api")
    relay_db = postgres.create_database("relay")
    sysdb = postgres.create_database("sys")
    relay = RelayProcess(workdir, relay_db, relay_yaml(free_port()), "relay-1")
    ts: ExecutorProcess | None = None
    try:
        relay.start()
        seed = {"RELAY_TEST_SEED": "1", "RELAY_TEST_RICH": "1"}
        ts = started = start_ts_executor(workdir, sysdb, relay.conductor_url, env=seed)
        assert_eventually(lambda: relay.state_of("acme", "ledger", started.executor_id) == "HEALTHY", 30)
        # The seed is complete once rich-1 has its message and the schedule is paused.
        assert_eventually(lambda: db_status(sysdb, "rich-1") == "SUCCESS", 30)
        sql: LiteralString = "SELECT status FROM dbos.workflow_schedules WHERE schedule_name = 'every-hour'"
        assert_eventually(lambda: query(sysdb, sql) == [("PAUSED",)], 30)
        yield World(sysdb, relay, ts)
    finally:
        if ts is not None:
            ts.stop()
        relay.stop()


@pytest.fixture(autouse=True)
def logs_on_failure(request: pytest.FixtureRequest, world: World) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(f"--- relay log ---\n{world.relay.log()[-6000:]}")


def ms(text: str | None) -> int | None:
    return None if text is None else round(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def ok(resp: httpx.Response, status: int = 200) -> Any:
    assert resp.status_code == status, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    return resp.json() if resp.content else None


def problem(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    assert resp.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = resp.json()
    assert body["status"] == status and body["detail"]
    return body


def db_status(sysdb: str, workflow_id: str) -> str | None:
    rows = query(sysdb, "SELECT status FROM dbos.workflow_status WHERE workflow_uuid = %s", workflow_id)
    return str(rows[0][0]) if rows else None


def shown(stored: str) -> str:
    """A value the TypeScript SDK stored (SuperJSON) as its conductor client shows it (util.inspect),
    for the strings and numbers these tests use."""
    value = json.loads(stored)["json"]
    return f"'{value}'" if isinstance(value, str) else str(value)


WORKFLOW_COLUMNS: LiteralString = """workflow_uuid, status, name, queue_name, executor_id, application_version,
    parent_workflow_id, forked_from, created_at, updated_at, completed_at, priority"""


def summary(w: dict[str, Any]) -> tuple[Any, ...]:
    return (
        w["workflowId"], w["status"], w["workflowName"], w["queueName"], w["executorId"], w["appVersion"],
        w["parentWorkflowId"], w["forkedFrom"], ms(w["createdAt"]), ms(w["updatedAt"]), ms(w["completedAt"]),
        w["priority"],
    )  # fmt: skip


def db_workflow(sysdb: str, workflow_id: str) -> tuple[Any, ...]:
    sql: LiteralString = "SELECT " + WORKFLOW_COLUMNS + " FROM dbos.workflow_status WHERE workflow_uuid = %s"
    ((*row,),) = query(sysdb, sql, workflow_id)
    return tuple(int(v) if i in (8, 9, 10) and v is not None else v for i, v in enumerate(row))


def fork(world: World, source: str, new_id: str, settle: str | None = "SUCCESS", **body: Any) -> str:
    with world.api() as api:
        got = ok(api.post(f"{LEDGER}/workflows/{source}/fork", json={"newWorkflowId": new_id, **body}), 201)
    assert got == {"workflowId": new_id}
    if settle is not None:
        assert_eventually(lambda: db_status(world.sysdb, new_id) == settle, 20, what=f"{new_id} {settle}")
    return new_id


# -- reads --------------------------------------------------------------------------------------


def test_a_workflow_by_id_with_and_without_its_input_and_output(world: World) -> None:
    with world.api() as api:
        for workflow_id in ("rich-1", "done-1", "done-1-child", "failed-1", "waiting-1"):
            got = ok(api.get(f"{LEDGER}/workflows/{workflow_id}"))
            assert summary(got) == db_workflow(world.sysdb, workflow_id)
        rich = ok(api.get(f"{LEDGER}/workflows/rich-1"))
        ((output,),) = query(world.sysdb, "SELECT output FROM dbos.workflow_output WHERE workflow_uuid = 'rich-1'")
        assert (rich["input"], rich["output"], rich["error"]) == ("[ 1 ]", shown(output), None)
        assert rich["output"] == "'RICH 21 hello'"
        failed = ok(api.get(f"{LEDGER}/workflows/failed-1"))
        assert failed["output"] is None and json.loads(failed["error"])["message"] == "failed on purpose with 3"
        bare = ok(api.get(f"{LEDGER}/workflows/rich-1", params={"loadInput": "false", "loadOutput": "false"}))
        assert (bare["input"], bare["output"]) == (None, None)
        assert summary(bare) == summary(rich)
        assert "no-such-workflow" in problem(api.get(f"{LEDGER}/workflows/no-such-workflow"), 404)["detail"]


def test_the_steps_of_a_workflow_page_by_page(world: World) -> None:
    db = query(
        world.sysdb,
        """SELECT function_id, function_name, output, child_workflow_id, started_at_epoch_ms, completed_at_epoch_ms
           FROM dbos.operation_outputs WHERE workflow_uuid = 'rich-1' ORDER BY function_id""",
    )
    assert [r[0] for r in db] == list(range(len(db))) and len(db) >= 10  # numbered from 0

    def row(s: dict[str, Any]) -> tuple[Any, ...]:
        return (s["stepId"], s["stepName"], s["output"], s["childWorkflowId"], ms(s["startedAt"]), ms(s["completedAt"]))

    expected = [(i, n, shown(o) if o and n != "DBOS.sleep" else o, c, s, e) for i, n, o, c, s, e in db]
    with world.api() as api:
        steps = ok(api.get(f"{LEDGER}/workflows/rich-1/steps"))
        assert [row(s) for s in steps if s["stepName"] != "DBOS.sleep"] == [r for r in expected if r[1] != "DBOS.sleep"]
        assert [(s["stepName"], s["output"]) for s in steps[:2]] == [("add", "1"), ("add", "3")]
        page = ok(api.get(f"{LEDGER}/workflows/rich-1/steps", params={"limit": 3, "offset": 2}))
        assert [s["stepId"] for s in page] == [2, 3, 4]
        assert page == steps[2:5]
        bare = ok(api.get(f"{LEDGER}/workflows/rich-1/steps", params={"loadOutput": "false"}))
        assert [s["output"] for s in bare] == [None] * len(db)
        assert ok(api.get(f"{LEDGER}/workflows/rich-1/steps", params={"offset": 1000})) == []
        child = ok(api.get(f"{LEDGER}/workflows/done-1/steps"))
        assert "done-1-child" in {s["childWorkflowId"] for s in child}
        for what in ("steps", "events", "notifications", "streams"):
            assert "no-such-workflow" in problem(api.get(f"{LEDGER}/workflows/no-such-workflow/{what}"), 404)["detail"]


def test_events_notifications_and_streams_of_a_workflow(world: World) -> None:
    with world.api() as api:
        events = ok(api.get(f"{LEDGER}/workflows/rich-1/events"))
        notifications = ok(api.get(f"{LEDGER}/workflows/rich-1/notifications"))
        streams = ok(api.get(f"{LEDGER}/workflows/rich-1/streams"))
        for route in ("events", "notifications", "streams"):  # a workflow with none: [] (it exists)
            assert ok(api.get(f"{LEDGER}/workflows/done-1-child/{route}")) == []
    db_events = query(world.sysdb, "SELECT key, value FROM dbos.workflow_events WHERE workflow_uuid = 'rich-1'")
    assert events == [{"key": k, "value": shown(v)} for k, v in db_events]
    assert events == [{"key": "progress", "value": "'step 21'"}]
    db_notes = query(
        world.sysdb,
        """SELECT topic, message, created_at_epoch_ms, consumed FROM dbos.notifications
           WHERE destination_uuid = 'rich-1' ORDER BY created_at_epoch_ms""",
    )
    assert [(n["topic"], n["message"], ms(n["createdAt"]), n["consumed"]) for n in notifications] == [
        (topic, shown(message), int(at), consumed) for topic, message, at, consumed in db_notes
    ]
    assert [(n["topic"], n["message"], n["consumed"]) for n in notifications] == [("go", "'hello'", True)]
    db_streams = query(
        world.sysdb, """SELECT key, value FROM dbos.streams WHERE workflow_uuid = 'rich-1' ORDER BY key, "offset" """
    )
    assert streams == [{"key": "log", "values": [shown(v) for _, v in db_streams]}]
    assert streams == [{"key": "log", "values": ["'first'", "'second'"]}]


def test_queues_as_the_system_database_declares_them(world: World) -> None:
    db = query(
        world.sysdb,
        """SELECT name, concurrency, worker_concurrency, rate_limit_max, rate_limit_period_sec, priority_enabled,
                  partition_queue, polling_interval_sec, application_name FROM dbos.queues ORDER BY name""",
    )
    fields = ("name", "concurrency", "workerConcurrency", "rateLimitMax", "rateLimitPeriodSecs", "priorityEnabled",
              "partitionQueue", "pollingIntervalSecs", "applicationName")  # fmt: skip
    with world.api() as api:
        queues = ok(api.get(f"{LEDGER}/queues"))
        assert [tuple(q[f] for f in fields) for q in queues] == db
        assert [set(q) for q in queues] == [set(fields)]  # Conductor's Queue, nothing more (no partition_*)
        serial = ok(api.get(f"{LEDGER}/queues/serial"))
        assert serial == queues[0] and (serial["name"], serial["concurrency"]) == ("serial", 1)
        assert "no-such-queue" in problem(api.get(f"{LEDGER}/queues/no-such-queue"), 404)["detail"]


def test_schedules_as_the_system_database_holds_them(world: World) -> None:
    ((schedule_id, workflow_name, cron, status, backfill, tz, app, context),) = query(
        world.sysdb,
        """SELECT schedule_id, workflow_name, schedule, status, automatic_backfill, cron_timezone, application_name,
                  context FROM dbos.workflow_schedules WHERE schedule_name = 'every-hour'""",
    )
    with world.api() as api:
        (listed,) = ok(api.get(f"{LEDGER}/schedules"))
        assert {k: listed[k] for k in ("scheduleId", "scheduleName", "workflowName", "cronExpression", "status",
                                       "automaticBackfill", "cronTimezone", "applicationName")} == {
            "scheduleId": schedule_id, "scheduleName": "every-hour", "workflowName": workflow_name,
            "cronExpression": cron, "status": status, "automaticBackfill": backfill, "cronTimezone": tz,
            "applicationName": app,
        }  # fmt: skip
        assert (workflow_name, cron, status) == ("tick", "0 * * * *", "PAUSED")
        assert listed["context"] == shown(context) == "'ctx'"
        assert ok(api.get(f"{LEDGER}/schedules/every-hour")) == listed
        without = ok(api.get(f"{LEDGER}/schedules/every-hour", params={"loadContext": "false"}))
        assert without == {**listed, "context": None}
        assert ok(api.get(f"{LEDGER}/schedules", params={"loadContext": "false"})) == [without]
        assert ok(api.get(f"{LEDGER}/schedules", params={"workflowName": "tick"})) == [listed]
        assert ok(api.get(f"{LEDGER}/schedules", params={"scheduleNamePrefix": "every"})) == [listed]
        assert ok(api.get(f"{LEDGER}/schedules", params={"workflowName": "job"})) == []
        assert "no-such-schedule" in problem(api.get(f"{LEDGER}/schedules/no-such-schedule"), 404)["detail"]


def versions_in_db(sysdb: str) -> dict[str, tuple[str, int, int]]:
    rows = query(sysdb, "SELECT version_name, version_id, version_timestamp, created_at FROM dbos.application_versions")
    return {name: (vid, int(stamp), int(created)) for name, vid, stamp, created in rows}


def test_versions_and_setting_the_latest(world: World) -> None:
    with world.api() as api:
        versions = ok(api.get(f"{LEDGER}/versions"))
        assert {
            v["versionName"]: (v["versionId"], ms(v["versionTimestamp"]), ms(v["createdAt"])) for v in versions
        } == versions_in_db(world.sysdb)
        assert [v["versionName"] for v in versions] == ["v1"]
        before = versions_in_db(world.sysdb)["v1"][1]
        ok(api.patch(f"{LEDGER}/versions/latest", json={"versionName": "v1"}), 204)
        after = versions_in_db(world.sysdb)["v1"][1]
        assert after > before
        assert ms(ok(api.get(f"{LEDGER}/versions"))[0]["versionTimestamp"]) == after
        assert "v9" in problem(api.patch(f"{LEDGER}/versions/latest", json={"versionName": "v9"}), 404)["detail"]


# -- changes ------------------------------------------------------------------------------------


def test_pause_resume_trigger_and_backfill_a_schedule(world: World) -> None:
    def schedule_status() -> str:
        sql: LiteralString = "SELECT status FROM dbos.workflow_schedules WHERE schedule_name = 'every-hour'"
        return str(query(world.sysdb, sql)[0][0])

    with world.api() as api:
        ok(api.post(f"{LEDGER}/schedules/every-hour/resume"), 204)
        assert schedule_status() == "ACTIVE" == ok(api.get(f"{LEDGER}/schedules/every-hour"))["status"]
        ok(api.post(f"{LEDGER}/schedules/every-hour/pause"), 204)
        assert schedule_status() == "PAUSED"
        triggered = ok(api.post(f"{LEDGER}/schedules/every-hour/trigger"), 201)["workflowId"]
        sql: LiteralString = "SELECT name, schedule_name FROM dbos.workflow_status WHERE workflow_uuid = %s"
        assert query(world.sysdb, sql, triggered) == [("tick", "every-hour")]
        assert_eventually(lambda: db_status(world.sysdb, triggered) == "SUCCESS", 20)

        window = {"startTime": "2026-01-01T10:30:00Z", "endTime": "2026-01-01T13:00:00Z"}
        first = ok(api.post(f"{LEDGER}/schedules/every-hour/backfill", json=window))["workflowIds"]
        assert len(first) == 2  # 11:00 and 12:00, as a Python executor's
        in_db: LiteralString = "SELECT workflow_uuid FROM dbos.workflow_status WHERE workflow_uuid = ANY(%s) ORDER BY 1"
        assert [r[0] for r in query(world.sysdb, in_db, first)] == sorted(first)
        ticks = query(world.sysdb, "SELECT count(*) FROM dbos.workflow_status WHERE name = 'tick'")
        assert ok(api.post(f"{LEDGER}/schedules/every-hour/backfill", json=window))["workflowIds"] == first
        assert query(world.sysdb, "SELECT count(*) FROM dbos.workflow_status WHERE name = 'tick'") == ticks
        for action in ("pause", "resume", "trigger"):
            problem(api.post(f"{LEDGER}/schedules/no-such-schedule/{action}"), 404)
        problem(api.post(f"{LEDGER}/schedules/no-such-schedule/backfill", json=window), 404)


def test_fork_onto_a_version_and_a_queue_and_onto_an_id_taken(world: World) -> None:
    fork(world, "done-1", "fork-q", startStep=1, appVersion="v1", queueName="serial")
    sql: LiteralString = """SELECT forked_from, queue_name, application_version FROM dbos.workflow_status
                            WHERE workflow_uuid = 'fork-q'"""
    assert query(world.sysdb, sql) == [("done-1", "serial", "v1")]
    with world.api() as api:
        forked = ok(api.get(f"{LEDGER}/workflows/fork-q"))
        assert summary(forked) == db_workflow(world.sysdb, "fork-q")
        assert (forked["output"], ms(forked["dequeuedAt"]) is not None) == ("'TOTAL 2 child 2'", True)
        # An id a workflow has already: the SDK's "duplicate key" is a 409, as the Python SDK's is, and
        # the workflow there is left as it was.
        before = db_workflow(world.sysdb, "rich-1")
        body = problem(api.post(f"{LEDGER}/workflows/done-1/fork", json={"newWorkflowId": "rich-1"}), 409)
        assert body["error"]["code"] == "conflict"
        assert body["detail"] == "a workflow with id rich-1 already exists"  # not "duplicate key value ..."
        assert db_workflow(world.sysdb, "rich-1") == before
        missing = problem(api.post(f"{LEDGER}/workflows/no-such-workflow/fork", json={}), 404)
        assert "no-such-workflow" in missing["detail"]
        assert "v9" in problem(api.post(f"{LEDGER}/workflows/done-1/fork", json={"appVersion": "v9"}), 404)["detail"]


def test_export_then_import_brings_a_deleted_workflow_back(world: World) -> None:
    fork(world, "done-1", "exported-1", startStep=0)
    rows: LiteralString = """SELECT w.workflow_uuid, w.status, w.name, w.created_at, w.forked_from,
        w.parent_workflow_id,
        (SELECT count(*) FROM dbos.operation_outputs o WHERE o.workflow_uuid = w.workflow_uuid),
        (SELECT array_agg(key) FROM dbos.workflow_events e WHERE e.workflow_uuid = w.workflow_uuid)
        FROM dbos.workflow_status w WHERE workflow_uuid IN ('exported-1', 'exported-1-child') ORDER BY 1"""
    before = query(world.sysdb, rows)
    assert len(before) == 2
    with world.api() as api:
        exported = ok(api.get(f"{LEDGER}/workflows/exported-1/export", params={"exportChildren": "true"}))
        assert set(exported) == {"serializedWorkflow"} and exported["serializedWorkflow"]
        ok(api.delete(f"{LEDGER}/workflows/exported-1", params={"deleteChildren": "true"}), 204)
        assert query(world.sysdb, rows) == []
        imported = api.post(f"{LEDGER}/workflows/import", json=exported)
        assert (imported.status_code, imported.content) == (201, b"")
        assert query(world.sysdb, rows) == before
        assert ok(api.get(f"{LEDGER}/workflows/exported-1"))["output"] == "'TOTAL 2 child 2'"
        # Imported again: the executor refuses (the workflow is there): a 409, as for a Python executor.
        body = problem(api.post(f"{LEDGER}/workflows/import", json=exported), 409)
        assert body["error"]["code"] == "conflict" and "duplicate key" in body["detail"]
        assert "no-such-workflow" in problem(api.get(f"{LEDGER}/workflows/no-such-workflow/export"), 404)["detail"]


def test_cancel_resume_and_delete_one_and_in_bulk(world: World) -> None:
    """Forks of rich-1 from its recv (step 9) wait for a message that never comes: PENDING."""
    ids = [fork(world, "rich-1", f"bulk-{n}", startStep=9, settle="PENDING") for n in range(3)]
    with world.api() as api:
        ok(api.post(f"{LEDGER}/workflows/{ids[0]}/cancel"), 204)
        assert db_status(world.sysdb, ids[0]) == "CANCELLED"
        ok(api.post(f"{LEDGER}/workflows/{ids[0]}/resume", json={}), 204)
        assert_eventually(lambda: db_status(world.sysdb, ids[0]) == "PENDING", 20)
        ok(api.post(f"{LEDGER}/workflows/bulk-cancel", json={"workflowIds": ids}), 204)
        assert [db_status(world.sysdb, i) for i in ids] == ["CANCELLED"] * 3
        # One id no workflow has: nothing is done, and the id is named.
        body = {"workflowIds": [*ids, "no-such-workflow"]}
        assert "no-such-workflow" in problem(api.post(f"{LEDGER}/workflows/bulk-resume", json=body), 404)["detail"]
        assert [db_status(world.sysdb, i) for i in ids] == ["CANCELLED"] * 3
        ok(api.post(f"{LEDGER}/workflows/bulk-resume", json={"workflowIds": ids}), 204)
        assert_eventually(lambda: [db_status(world.sysdb, i) for i in ids] == ["PENDING"] * 3, 20)
        problem(api.post(f"{LEDGER}/workflows/rich-1/resume", json={}), 409)  # finished: fork it instead
        ok(api.delete(f"{LEDGER}/workflows/{ids[0]}"), 204)
        assert db_status(world.sysdb, ids[0]) is None
        ok(api.post(f"{LEDGER}/workflows/bulk-delete", json={"workflowIds": ids[1:]}), 204)
        assert [db_status(world.sysdb, i) for i in ids] == [None] * 3
        for route in ("cancel", "resume"):
            problem(api.post(f"{LEDGER}/workflows/no-such-workflow/{route}", json={}), 404)
        problem(api.delete(f"{LEDGER}/workflows/no-such-workflow"), 404)


def test_bulk_fork_from_failure_each_way(world: World) -> None:
    sql: LiteralString = "SELECT name, forked_from, status FROM dbos.workflow_status WHERE workflow_uuid = %s"
    with world.api() as api:
        for how in ({"fromLastFailure": True}, {"fromLastStep": True}, {"fromStep": 0}, {"fromStepName": "add"}):
            body = {"workflowIds": ["failed-1"], **how}
            (forked,) = ok(api.post(f"{LEDGER}/workflows/bulk-fork-from-failure", json=body))["workflowIds"]
            assert_eventually(lambda: db_status(world.sysdb, forked) == "ERROR", 20)  # noqa: B023
            assert query(world.sysdb, sql, forked) == [("failing", "failed-1", "ERROR")], how
        body = {"workflowIds": ["no-such-workflow"], "fromLastFailure": True}
        resp = api.post(f"{LEDGER}/workflows/bulk-fork-from-failure", json=body)
        assert "no-such-workflow" in problem(resp, 404)["detail"]


def test_step_aggregates_by_name_and_status(world: World) -> None:
    """The app's metrics (/metrics, GET .../metrics) come from Relay's figures windows, which
    tests/test_typescript_sdk.py checks against a TypeScript executor's system database."""
    with world.api() as api:
        body = {"groupByFunctionName": True, "groupByStatus": True, "selectCount": True, "selectMaxDurationMs": True}
        served = ok(api.post(f"{LEDGER}/steps/aggregates", json=body))
        db = query(
            world.sysdb,
            """SELECT function_name, CASE WHEN error IS NULL THEN 'SUCCESS' ELSE 'ERROR' END, count(*),
                      max(completed_at_epoch_ms - started_at_epoch_ms) FROM dbos.operation_outputs GROUP BY 1, 2""",
        )
        by_group = {
            (a["group"]["function_name"], a["group"]["status"]): (a["count"], a["maxDurationMs"]) for a in served
        }
        assert by_group == {(n, s): (c, int(d)) for n, s, c, d in db}


# -- a TypeScript and a Python executor of one app (last: it adds an executor to the module's app) -------


def test_a_python_executor_beside_it_does_not_turn_a_typescript_workflows_reads_into_502s(world: World) -> None:
    """The Python SDK cannot read the values the TypeScript SDK stores (SuperJSON): asked for
    rich-1's events, messages or streams it fails ("Serialization js_superjson is not available").
    Relay asks the app's executors in turn, so every other request went to it and was a 502; it now
    moves on to another executor, as from one that does not know the message."""
    python = ExecutorProcess(world.relay.workdir, world.sysdb, world.relay.conductor_url, module="harness.workflow_app")
    try:
        assert_eventually(lambda: world.relay.state_of("acme", "ledger", python.executor_id) == "HEALTHY", 30)
        expected = {
            "events": [{"key": "progress", "value": "'step 21'"}],
            "streams": [{"key": "log", "values": ["'first'", "'second'"]}],
        }
        with world.api() as api:
            for _ in range(4):  # taken in turn: each executor is asked first at least once
                for route, answer in expected.items():
                    assert ok(api.get(f"{LEDGER}/workflows/rich-1/{route}")) == answer
                notes = ok(api.get(f"{LEDGER}/workflows/rich-1/notifications"))
                assert [(n["topic"], n["message"]) for n in notes] == [("go", "'hello'")]
    finally:
        python.stop()
