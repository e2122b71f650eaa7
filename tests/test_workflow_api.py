"""Conductor's v2 workflow API, served through the app's executors: every route against real
DBOS 3.2 executors (harness/workflow_app.py), each answer checked against what the executors'
system database holds (read here directly; Relay never reads it).

One world for the module: two Relay instances on one database, and two executors of the app
``ledger`` (versions v1 and v2, the first one seeding the fixtures) connected to instance 1.
Instance 1 has the default limits; instance 2 tight ones (1 s per executor, 2 requests in
flight per app), so the serving tests (503, failover, 502, 501, 429) ask instance 2, with
simulated executors of apps of their own. Reads come first in the file; the changes after
them make workflows of their own (forks) or say which fixture they change.
"""

from __future__ import annotations

import base64
import json
import pickle
import random
import re
import string
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, LiteralString
from urllib.parse import quote

import httpx
import psycopg
import pytest
from dbos import DBOSClient, EnqueueOptions

from harness.executors import ExecutorProcess
from harness.keys import API_KEYS, CONDUCTOR_KEYS, VIEWER_KEYS
from harness.long_names import LONG_STEP_NAME, LONG_WORKFLOW_NAME
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from harness.web import TLS
from relay_protocol import MAX_APP_DEFINED_NAME_BYTES, MAX_QUEUE_OR_SCHEDULE_NAME_BYTES, MAX_WORKFLOW_ID_BYTES
from tests.prom import scrape

APP_MODULE = "harness.workflow_app"
LEDGER = "/apps/ledger"
ODD_IDS = ["odd/steps", "odd?x=1", "odd#frag"]
# Instance 2's limits (see the module's docstring).
PER_EXECUTOR_SECS = 1.0
DEADLINE_SECS = 5.0
IN_FLIGHT_CAP = 2
SLACK_SECS = 1.5


@dataclass
class World:
    postgres: Postgres
    workdir: Path
    sysdb: str
    r1: RelayProcess
    r2: RelayProcess
    seeder: ExecutorProcess  # v1: created the fixtures
    other: ExecutorProcess  # v2

    def api(self, relay: RelayProcess | None = None) -> httpx.Client:
        return (relay or self.r1).api("acme")


def healthy(relay: RelayProcess, app: str, executor_id: str) -> bool:
    return relay.state_of("acme", app, executor_id) == "HEALTHY"


@pytest.fixture(scope="module")
def world(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("workflow-api")
    relay_db = postgres.create_database("relay")
    sysdb = postgres.create_database("sys")
    tight = relay_yaml(free_port())
    tight["server"].update(
        executorRequestTimeoutSecs=PER_EXECUTOR_SECS,
        executorRequestDeadlineSecs=DEADLINE_SECS,
        maxExecutorRequestsPerApp=IN_FLIGHT_CAP,
    )
    relays = [
        RelayProcess(workdir, relay_db, relay_yaml(free_port()), "relay-1"),
        RelayProcess(workdir, relay_db, tight, "relay-2"),
    ]
    executors: list[ExecutorProcess] = []
    try:
        r1, r2 = (relay.start() for relay in relays)
        seed = {"RELAY_TEST_SEED": "1"}
        executors.append(ExecutorProcess(workdir, sysdb, r1.conductor_url, module=APP_MODULE, env=seed))
        executors.append(ExecutorProcess(workdir, sysdb, r1.conductor_url, module=APP_MODULE, version="v2"))
        for executor in executors:
            assert_eventually(lambda: healthy(r2, "ledger", executor.executor_id), 10)  # noqa: B023
        # The reads want a database that holds still: the queued jobs run soon after seeding, and the
        # schedule is paused (in the database, as DBOS pauses one) lest it start a run on the hour.
        assert_eventually(lambda: not query(sysdb, "SELECT 1 FROM dbos.workflow_status WHERE status = 'ENQUEUED'"), 20)
        with psycopg.connect(sysdb) as conn:
            conn.execute("UPDATE dbos.workflow_schedules SET status = 'PAUSED'")
        yield World(postgres, workdir, sysdb, r1, r2, *executors)
    finally:
        for executor in executors:
            executor.stop()
        for relay in relays:
            relay.stop()


@pytest.fixture(autouse=True)
def logs_on_failure(request: pytest.FixtureRequest, world: World) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for relay in (world.r1, world.r2):
            print(f"--- {relay.instance_id} log ---\n{relay.log()[-6000:]}")


# -- reading the system database, and the API's answers -------------------------------------------


def query(url: str, sql: LiteralString, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return list(conn.execute(sql, params).fetchall())


def ms(text: str | None) -> int | None:
    """An API time (ISO 8601, UTC) as the epoch milliseconds the system database holds."""
    return None if text is None else round(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def iso(epoch_ms: float) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def unpickled(value: str) -> str:
    """A value DBOS stored (serialization py_pickle), as the executor shows it."""
    return str(pickle.loads(base64.b64decode(value)))


def ok(resp: httpx.Response, status: int = 200) -> Any:
    assert resp.status_code == status, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    return resp.json() if resp.content else None


def problem(resp: httpx.Response, status: int) -> dict[str, Any]:
    """An RFC 9457 problem with this status, as Conductor answers errors."""
    assert resp.status_code == status, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    assert resp.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = resp.json()
    assert body["status"] == status
    assert body["title"] and isinstance(body["title"], str)
    assert body["detail"] and isinstance(body["detail"], str)
    return body


# What a workflow is in both: the API's item and the row of dbos.workflow_status.
WORKFLOW_COLUMNS: LiteralString = """workflow_uuid, status, name, queue_name, executor_id, application_version,
    parent_workflow_id, forked_from, created_at, completed_at"""


def summary(w: dict[str, Any]) -> tuple[Any, ...]:
    return (
        w["workflowId"], w["status"], w["workflowName"], w["queueName"], w["executorId"], w["appVersion"],
        w["parentWorkflowId"], w["forkedFrom"], ms(w["createdAt"]), ms(w["completedAt"]),
    )  # fmt: skip


def db_workflows(world: World, where: LiteralString = "TRUE", *params: Any) -> list[tuple[Any, ...]]:
    return query(world.sysdb, "SELECT " + WORKFLOW_COLUMNS + " FROM dbos.workflow_status WHERE " + where, *params)


def db_status(world: World, workflow_id: str) -> str | None:
    rows = query(world.sysdb, "SELECT status FROM dbos.workflow_status WHERE workflow_uuid = %s", workflow_id)
    return str(rows[0][0]) if rows else None


def created_times(world: World, desc: bool = False) -> list[int]:
    rows = query(world.sysdb, "SELECT created_at FROM dbos.workflow_status ORDER BY created_at")
    times = [int(r[0]) for r in rows]
    return times[::-1] if desc else times


def audit(world: World, app: str, action: str, **detail: Any) -> list[dict[str, Any]]:
    """The app's audit entries for ``action`` whose detail has these members."""
    with world.api() as api:
        entries: list[dict[str, Any]] = ok(api.get("/audit", params={"app": app, "limit": 10_000}))
    return [e for e in entries if e["action"] == action and all(e["detail"].get(k) == v for k, v in detail.items())]


def audited_once(world: World, app: str, action: str, result: str = "success", **detail: Any) -> dict[str, Any]:
    """The one entry for ``action`` with this result and detail, by the admin key."""
    (entry,) = audit(world, app, action, result=result, **detail)
    assert (entry["actor"], entry["app"]) == ("api:ops", app)
    return entry


def fork(world: World, source: str, new_id: str, start_step: int, settle: str | None = "SUCCESS") -> str:
    """Fork through the API; wait until the fork is in ``settle`` (None: do not wait)."""
    with world.api() as api:
        body = ok(api.post(f"{LEDGER}/workflows/{quote(source, safe='')}/fork",
                           json={"newWorkflowId": new_id, "startStep": start_step}), 201)  # fmt: skip
    assert body == {"workflowId": new_id}
    if settle is not None:
        assert_eventually(lambda: db_status(world, new_id) == settle, 20, what=f"{new_id} {settle}")
    return new_id


# -- apps and executors, in Conductor's shapes ----------------------------------------------------


def test_apps_and_executors_in_conductors_shapes(world: World) -> None:
    with world.api() as api:
        apps = {a["name"]: a for a in ok(api.get("/apps"))}
        ledger = apps["ledger"]
        assert {k: ledger[k] for k in ("name", "status", "language", "executorTimeoutSecs")} == {
            "name": "ledger",
            "status": "AVAILABLE",
            "language": "python",
            "executorTimeoutSecs": 30,
        }
        assert ok(api.get(LEDGER)) == ledger
        executors = {e["executorId"]: e for e in ok(api.get(f"{LEDGER}/executors"))}
    assert set(executors) == {world.seeder.executor_id, world.other.executor_id}
    assert {e["executorId"]: e["appVersion"] for e in executors.values()} == {
        world.seeder.executor_id: "v1",
        world.other.executor_id: "v2",
    }
    for e in executors.values():
        assert (e["status"], e["state"], e["relayInstance"]) == ("HEALTHY", "HEALTHY", "relay-1")
        assert (e["language"], e["dbosVersion"], e["executorMetadata"]) == ("python", "3.2.0", None)
        assert e["hostname"]
        assert ms(e["createdAt"]) is not None and ms(e["updatedAt"]) is not None
        assert ms(e["updatedAt"]) >= ms(e["createdAt"])  # type: ignore[operator]


# -- workflows: lists and searches ----------------------------------------------------------------


def test_the_workflow_list_is_what_the_system_database_holds(world: World) -> None:
    with world.api() as api:
        listed = ok(api.get(f"{LEDGER}/workflows"))
        assert sorted(map(summary, listed)) == sorted(db_workflows(world))
        assert [ms(w["createdAt"]) for w in listed] == created_times(world)  # oldest first
        # Inputs and outputs only when asked.
        assert all(w["input"] is None and w["output"] is None for w in listed)
        loaded = {w["workflowId"]: w for w in ok(api.get(f"{LEDGER}/workflows", params={"loadInput": "true"}))}
        assert loaded["done-1"]["input"] == "{'args': (1, 30.0), 'kwargs': {}}"
        assert loaded["done-1"]["output"] is None
        loaded = {w["workflowId"]: w for w in ok(api.get(f"{LEDGER}/workflows", params={"loadOutput": "true"}))}
        assert loaded["done-1"]["output"] == "TOTAL 2 2 hello"
        assert loaded["done-1"]["input"] is None
        assert "failed on purpose with 3" in loaded["failed-1"]["error"]

        errors = ok(api.get(f"{LEDGER}/workflows", params={"status": "ERROR"}))
        assert sorted(map(summary, errors)) == sorted(db_workflows(world, "status = 'ERROR'"))
        assert [w["workflowId"] for w in errors] == ["failed-1"]
        children = ok(api.get(f"{LEDGER}/workflows", params={"workflowName": "child"}))
        assert sorted(map(summary, children)) == sorted(db_workflows(world, "name = 'child'"))
        assert len(children) == 2
        # status and workflowName repeat (any of the values), as the search's lists; one value of
        # any other parameter (not the last one of two, taken silently).
        either = ok(api.get(f"{LEDGER}/workflows", params=[("status", "SUCCESS"), ("status", "ERROR")]))
        assert sorted(map(summary, either)) == sorted(db_workflows(world, "status IN ('SUCCESS', 'ERROR')"))
        assert {w["status"] for w in either} == {"SUCCESS", "ERROR"}
        named = ok(api.get(f"{LEDGER}/workflows", params=[("workflowName", "child"), ("workflowName", "parent")]))
        assert sorted(map(summary, named)) == sorted(db_workflows(world, "name IN ('child', 'parent')"))
        for twice in ([("limit", "3"), ("limit", "4")], [("sortDesc", "true"), ("sortDesc", "false")]):
            assert twice[0][0] in problem(api.get(f"{LEDGER}/workflows", params=twice), 422)["detail"]

        page = ok(api.get(f"{LEDGER}/workflows", params={"limit": 3, "offset": 2}))
        assert [ms(w["createdAt"]) for w in page] == created_times(world)[2:5]
        newest = ok(api.get(f"{LEDGER}/workflows", params={"sortDesc": "true", "limit": 4}))
        assert [ms(w["createdAt"]) for w in newest] == created_times(world, desc=True)[:4]


def test_each_search_filter_finds_what_the_system_database_finds(world: World) -> None:
    seeder, other = world.seeder.executor_id, world.other.executor_id
    (done_at,), (failed_at,) = (
        query(world.sysdb, "SELECT created_at FROM dbos.workflow_status WHERE workflow_uuid = %s", w)[0]
        for w in ("done-1", "failed-1")
    )
    narrowing: list[tuple[dict[str, Any], LiteralString, tuple[Any, ...]]] = [
        ({"workflowIds": ["done-1", "failed-1", "no-such"]}, "workflow_uuid = ANY(%s)", (["done-1", "failed-1"],)),
        ({"status": ["ERROR", "PENDING"]}, "status = ANY(%s)", (["ERROR", "PENDING"],)),
        ({"workflowName": ["parent", "failing"]}, "name = ANY(%s)", (["parent", "failing"],)),
        ({"queueName": ["serial"]}, "queue_name = 'serial'", ()),
        ({"parentWorkflowId": ["done-1"]}, "parent_workflow_id = 'done-1'", ()),
        ({"workflowIdPrefix": ["odd"]}, "workflow_uuid LIKE 'odd%%'", ()),
        # Half a millisecond out on each side: the SDK compares whole milliseconds, bounds included.
        (
            {"startTime": iso(done_at - 0.5), "endTime": iso(failed_at + 0.5)},
            "created_at BETWEEN %s AND %s",
            (done_at, failed_at),
        ),
        ({"status": ["SUCCESS"], "workflowName": ["odd"]}, "status = 'SUCCESS' AND name = 'odd'", ()),
    ]
    # The seeder (v1) ran every workflow so far, the v2 executor none: all, or nothing.
    whole: list[tuple[dict[str, Any], LiteralString, tuple[Any, ...], bool]] = [
        ({"executorId": [seeder]}, "executor_id = %s", (seeder,), True),
        ({"executorId": [other]}, "executor_id = %s", (other,), False),
        ({"appVersion": ["v1"]}, "application_version = 'v1'", (), True),
        ({"appVersion": ["v2"]}, "application_version = 'v2'", (), False),
    ]
    everything = sorted(db_workflows(world))
    with world.api() as api:
        for body, where, params in narrowing:
            found = ok(api.post(f"{LEDGER}/workflows/search", json=body))
            expected = sorted(db_workflows(world, where, *params))
            assert sorted(map(summary, found)) == expected, body
            assert expected and expected != everything, f"{body} selects nothing or everything"
        for body, where, params, selects_all in whole:
            found = ok(api.post(f"{LEDGER}/workflows/search", json=body))
            assert sorted(map(summary, found)) == sorted(db_workflows(world, where, *params)), body
            assert sorted(map(summary, found)) == (everything if selects_all else []), body
        assert sorted(map(summary, ok(api.post(f"{LEDGER}/workflows/search")))) == everything  # no body
        page = ok(api.post(f"{LEDGER}/workflows/search", json={"sortDesc": True, "limit": 3, "offset": 1}))
        assert [ms(w["createdAt"]) for w in page] == created_times(world, desc=True)[1:4]
        asc = ok(api.post(f"{LEDGER}/workflows/search", json={"limit": 2, "offset": 3}))
        assert [ms(w["createdAt"]) for w in asc] == created_times(world)[3:5]
        # Unknown members are refused, as Conductor's additionalProperties: false has it.
        problem(api.post(f"{LEDGER}/workflows/search", json={"workflowID": ["done-1"]}), 422)


def test_workflow_and_step_aggregates_count_what_the_system_database_holds(world: World) -> None:
    with world.api() as api:
        by_status = ok(api.post(f"{LEDGER}/workflows/aggregates", json={"groupByStatus": True, "selectCount": True}))
        db = query(world.sysdb, "SELECT status, count(*) FROM dbos.workflow_status GROUP BY status")
        assert {a["group"]["status"]: a["count"] for a in by_status} == dict(db)
        # Only the members selected.
        assert all(set(a) == {"group", "count"} for a in by_status)

        body = {"groupByWorkflowName": True, "groupByAppVersion": True, "selectCount": True, "selectMinCreatedAt": True}
        by_name = ok(api.post(f"{LEDGER}/workflows/aggregates", json=body))
        db = query(
            world.sysdb,
            "SELECT name, application_version, count(*), min(created_at) FROM dbos.workflow_status GROUP BY 1, 2",
        )
        assert {
            (a["group"]["name"], a["group"]["application_version"]): (a["count"], ms(a["minCreatedAt"]))
            for a in by_name
        } == {(n, v): (c, m) for n, v, c, m in db}

        filtered = ok(
            api.post(
                f"{LEDGER}/workflows/aggregates",
                json={"groupByStatus": True, "selectCount": True, "workflowName": ["child"]},
            )
        )
        assert [(a["group"], a["count"]) for a in filtered] == [({"status": "SUCCESS"}, 2)]

        steps = ok(api.post(f"{LEDGER}/steps/aggregates", json={"groupByFunctionName": True, "selectCount": True}))
        db = query(world.sysdb, "SELECT function_name, count(*) FROM dbos.operation_outputs GROUP BY 1")
        assert {a["group"]["function_name"]: a["count"] for a in steps} == dict(db)
        adds = ok(
            api.post(
                f"{LEDGER}/steps/aggregates",
                json={"groupByStatus": True, "selectCount": True, "selectMaxDurationMs": True, "stepName": ["add"]},
            )
        )
        (longest,) = query(
            world.sysdb,
            """SELECT max(completed_at_epoch_ms - started_at_epoch_ms) FROM dbos.operation_outputs
               WHERE function_name = 'add'""",
        )[0]
        assert [(a["group"], a["count"], a["maxDurationMs"]) for a in adds] == [
            ({"status": "SUCCESS"}, query(world.sysdb, "SELECT count(*) FROM dbos.operation_outputs "
                                                       "WHERE function_name = 'add'")[0][0], longest)
        ]  # fmt: skip


# -- one workflow ---------------------------------------------------------------------------------


def test_a_workflow_by_id_and_404_for_an_unknown_one(world: World) -> None:
    with world.api() as api:
        for workflow_id in ("done-1", "done-1-child", "failed-1", "waiting-1"):
            got = ok(api.get(f"{LEDGER}/workflows/{workflow_id}"))
            assert [summary(got)] == db_workflows(world, "workflow_uuid = %s", workflow_id)
            assert ms(got["updatedAt"]) is not None
        assert ok(api.get(f"{LEDGER}/workflows/done-1-child"))["parentWorkflowId"] == "done-1"
        # Conductor's getWorkflow takes no loadInput/loadOutput: a workflow comes with its input, output, error.
        done = ok(api.get(f"{LEDGER}/workflows/done-1"))
        assert (done["input"], done["output"]) == ("{'args': (1, 30.0), 'kwargs': {}}", "TOTAL 2 2 hello")
        assert "failed on purpose with 3" in ok(api.get(f"{LEDGER}/workflows/failed-1"))["error"]
        bare = ok(api.get(f"{LEDGER}/workflows/done-1", params={"loadInput": "false", "loadOutput": "false"}))
        assert (bare["input"], bare["output"]) == (None, None)  # Relay's own: leave them out when asked to
        body = problem(api.get(f"{LEDGER}/workflows/no-such-workflow"), 404)
        assert "no-such-workflow" in body["detail"]


def test_the_steps_of_a_workflow_page_by_page(world: World) -> None:
    db = query(
        world.sysdb,
        """SELECT function_id, function_name, child_workflow_id, started_at_epoch_ms, completed_at_epoch_ms
           FROM dbos.operation_outputs WHERE workflow_uuid = 'done-1' ORDER BY function_id""",
    )
    assert len(db) >= 6

    def row(s: dict[str, Any]) -> tuple[Any, ...]:
        return (s["stepId"], s["stepName"], s["childWorkflowId"], ms(s["startedAt"]), ms(s["completedAt"]))

    with world.api() as api:
        steps = ok(api.get(f"{LEDGER}/workflows/done-1/steps"))
        assert [row(s) for s in steps] == db
        assert {s["childWorkflowId"] for s in steps} >= {"done-1-child"}
        page = ok(api.get(f"{LEDGER}/workflows/done-1/steps", params={"limit": 3, "offset": 2}))
        assert [row(s) for s in page] == db[2:5]
        # Conductor's listWorkflowSteps takes no loadOutput: steps come with their outputs.
        assert [(s["stepName"], s["output"]) for s in steps[:2]] == [("add", "2"), ("shout", "TOTAL 2")]
        bare = ok(api.get(f"{LEDGER}/workflows/done-1/steps", params={"loadOutput": "false"}))
        assert [s["output"] for s in bare] == [None] * len(db)
        # The SDK answers [] for a workflow it has never heard of; Relay looks, and says so.
        assert ok(api.get(f"{LEDGER}/workflows/done-1/steps", params={"offset": 1000})) == []  # it exists
        for what in ("steps", "events", "notifications", "streams"):
            assert "no-such-workflow" in problem(api.get(f"{LEDGER}/workflows/no-such-workflow/{what}"), 404)["detail"]


def test_events_notifications_and_streams_of_a_workflow(world: World) -> None:
    with world.api() as api:
        events = ok(api.get(f"{LEDGER}/workflows/done-1/events"))
        notifications = ok(api.get(f"{LEDGER}/workflows/done-1/notifications"))
        streams = ok(api.get(f"{LEDGER}/workflows/done-1/streams"))
        for route in ("events", "notifications", "streams"):  # a workflow with none: [] (it exists)
            assert ok(api.get(f"{LEDGER}/workflows/done-1-child/{route}")) == []
    db_events = query(world.sysdb, "SELECT key, value FROM dbos.workflow_events WHERE workflow_uuid = 'done-1'")
    assert events == [{"key": k, "value": unpickled(v)} for k, v in db_events]
    assert events == [{"key": "progress", "value": "step 2"}]

    db_notes = query(
        world.sysdb,
        """SELECT topic, message, created_at_epoch_ms, consumed FROM dbos.notifications
           WHERE destination_uuid = 'done-1' ORDER BY created_at_epoch_ms""",
    )
    assert [(n["topic"], n["message"], ms(n["createdAt"]), n["consumed"]) for n in notifications] == [
        (topic, unpickled(message), at, consumed) for topic, message, at, consumed in db_notes
    ]
    assert [(n["topic"], n["message"], n["consumed"]) for n in notifications] == [("go", "hello", True)]

    db_streams = query(
        world.sysdb, """SELECT key, value FROM dbos.streams WHERE workflow_uuid = 'done-1' ORDER BY key, "offset" """
    )
    assert streams == [{"key": "log", "values": [unpickled(v) for _, v in db_streams]}]
    assert streams == [{"key": "log", "values": ["first", "second"]}]


@pytest.mark.parametrize("workflow_id", ODD_IDS)
def test_a_percent_encoded_id_names_one_workflow(world: World, workflow_id: str) -> None:
    encoded = quote(workflow_id, safe="")
    with world.api() as api:
        got = ok(api.get(f"{LEDGER}/workflows/{encoded}"))
        assert [summary(got)] == db_workflows(world, "workflow_uuid = %s", workflow_id)
        steps = ok(api.get(f"{LEDGER}/workflows/{encoded}/steps"))
        db = query(
            world.sysdb,
            "SELECT function_id, function_name FROM dbos.operation_outputs WHERE workflow_uuid = %s",
            workflow_id,
        )
        assert [(s["stepId"], s["stepName"]) for s in steps] == db == [(1, "shout")]
        assert ok(api.get(f"{LEDGER}/workflows/{encoded}/events")) == []
        # The unencoded path is another workflow (``odd``, which does not exist), or its steps.
        assert api.get(f"{LEDGER}/workflows/odd").status_code == 404
        if workflow_id == "odd/steps":  # the steps of "odd", which does not exist
            assert api.get(f"{LEDGER}/workflows/{workflow_id}").status_code == 404


# -- queues, schedules, versions: reads ---------------------------------------------------------


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
        assert [set(q) for q in queues] == [set(fields)]  # Conductor's Queue, nothing more
        serial = ok(api.get(f"{LEDGER}/queues/serial"))
        assert serial == queues[0]
        assert (serial["name"], serial["concurrency"]) == ("serial", 1)
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
        assert (workflow_name, cron) == ("tick", "0 * * * *")
        # With its context unasked, as Conductor serves an app not in private mode (dbos-mcp asks nothing).
        assert listed["context"] == unpickled(context) == "ctx"
        assert ok(api.get(f"{LEDGER}/schedules/every-hour")) == listed
        without = ok(api.get(f"{LEDGER}/schedules/every-hour", params={"loadContext": "false"}))
        assert without == {**listed, "context": None}
        assert ok(api.get(f"{LEDGER}/schedules", params={"loadContext": "false"})) == [without]
        assert ok(api.get(f"{LEDGER}/schedules", params={"workflowName": "tick"})) == [listed]
        assert ok(api.get(f"{LEDGER}/schedules", params={"scheduleNamePrefix": "every"})) == [listed]
        assert ok(api.get(f"{LEDGER}/schedules", params={"workflowName": "job"})) == []
        assert "no-such-schedule" in problem(api.get(f"{LEDGER}/schedules/no-such-schedule"), 404)["detail"]


def test_a_schedules_last_run_is_served_in_utc(world: World) -> None:
    """The SDK keeps it as text in the schedule's cron time zone; Relay serves every time in UTC, with six
    fraction digits even on a whole second (a cron time mostly is), as Relay's own times."""
    sql: LiteralString = "UPDATE dbos.workflow_schedules SET last_fired_at = %s WHERE schedule_name = 'every-hour'"
    ((before,),) = query(world.sysdb, "SELECT last_fired_at FROM dbos.workflow_schedules")
    try:
        with world.api() as api:
            for stored, served in (
                ("2026-01-01T09:00:00-05:00", "2026-01-01T14:00:00.000000Z"),  # America/New_York's 9:00
                ("2026-07-01T09:00:00.250000+02:00", "2026-07-01T07:00:00.250000Z"),
                ("2026-01-01T09:00:00", "2026-01-01T09:00:00.000000Z"),  # no offset: UTC, as the SDK reads it
            ):
                with psycopg.connect(world.sysdb) as conn:
                    conn.execute(sql, (stored,))
                assert ok(api.get(f"{LEDGER}/schedules/every-hour"))["lastFiredAt"] == served, stored
                assert [s["lastFiredAt"] for s in ok(api.get(f"{LEDGER}/schedules"))] == [served]
    finally:
        with psycopg.connect(world.sysdb) as conn:
            conn.execute(sql, (before,))


def versions_in_db(sysdb: str) -> dict[str, tuple[str, int, int]]:
    rows = query(sysdb, "SELECT version_name, version_id, version_timestamp, created_at FROM dbos.application_versions")
    return {name: (vid, stamp, created) for name, vid, stamp, created in rows}


def test_versions_as_the_system_database_records_them(world: World) -> None:
    with world.api() as api:
        versions = ok(api.get(f"{LEDGER}/versions"))
    assert {
        v["versionName"]: (v["versionId"], ms(v["versionTimestamp"]), ms(v["createdAt"])) for v in versions
    } == versions_in_db(world.sysdb)
    assert {v["versionName"] for v in versions} == {"v1", "v2"}


# -- the /conductor prefix, and another instance ------------------------------------------------


def test_every_route_is_served_under_the_conductor_prefix_too(world: World) -> None:
    """A client whose base URL is ``http://host:port/conductor``, as for DBOS's managed Conductor."""
    headers = {"Authorization": f"Bearer {API_KEYS['acme']}"}
    app = "/v2/orgs/acme/apps/ledger"
    with httpx.Client(base_url=f"{world.r1.http}/conductor", headers=headers, timeout=10, verify=TLS) as conductor:
        with world.api() as api:
            assert ok(conductor.get("/v2/orgs/acme/apps")) == ok(api.get("/apps"))
        odd = ok(conductor.get(f"{app}/workflows/odd%2Fsteps"))
        assert [summary(odd)] == db_workflows(world, "workflow_uuid = 'odd/steps'")
        assert [s["stepName"] for s in ok(conductor.get(f"{app}/workflows/odd%2Fsteps/steps"))] == ["shout"]
        named = ok(conductor.get(f"{app}/workflows", params={"workflowName": "odd"}))
        assert sorted(w["workflowId"] for w in named) == sorted(ODD_IDS)
        assert ok(conductor.post(f"{app}/workflows/search", json={"workflowIdPrefix": ["odd"]})) == named

        # A change, by encoded ids both ways: fork odd?x=1 into "fork/of?odd#1", then delete that.
        new_id = "fork/of?odd#1"
        created = ok(conductor.post(f"{app}/workflows/odd%3Fx%3D1/fork", json={"newWorkflowId": new_id}), 201)
        assert created == {"workflowId": new_id}
        assert_eventually(lambda: db_status(world, new_id) == "SUCCESS", 20)
        assert db_workflows(world, "workflow_uuid = %s", new_id)[0][7] == "odd?x=1"  # forked_from
        assert ok(conductor.get(f"{app}/workflows/{quote(new_id, safe='')}"))["forkedFrom"] == "odd?x=1"
        assert ok(conductor.delete(f"{app}/workflows/{quote(new_id, safe='')}"), 204) is None
        assert db_status(world, new_id) is None
        problem(conductor.get(f"{app}/workflows/{quote(new_id, safe='')}"), 404)
    audited_once(world, "ledger", "workflow.fork", workflowIds=["odd?x=1"], newWorkflowId=new_id)
    audited_once(world, "ledger", "workflow.delete", workflowIds=[new_id])


def relayed(relay: RelayProcess) -> float:
    return scrape(relay.http, "relay_requests_relayed_total") or 0.0


def test_a_route_is_served_through_the_instance_holding_the_executors_socket(world: World) -> None:
    """The executors hold sockets on instance 1; the API is asked on instance 2."""
    before = relayed(world.r1), relayed(world.r2)
    with world.api(world.r2) as api:
        for e in ok(api.get(f"{LEDGER}/executors")):
            assert e["relayInstance"] == "relay-1"
        got = ok(api.get(f"{LEDGER}/workflows/done-1"))
        assert [summary(got)] == db_workflows(world, "workflow_uuid = 'done-1'")
        listed = ok(api.get(f"{LEDGER}/workflows", params={"workflowName": "odd"}))
        assert sorted(map(summary, listed)) == sorted(db_workflows(world, "name = 'odd'"))
        created = ok(api.post(f"{LEDGER}/workflows/done-1/fork", json={"newWorkflowId": "via-2", "startStep": 10}), 201)
    assert created == {"workflowId": "via-2"}
    assert_eventually(lambda: db_status(world, "via-2") == "SUCCESS", 20)
    assert relayed(world.r1) >= before[0] + 3  # instance 1 sent each request over the executor's socket
    assert relayed(world.r2) == before[1]


# -- changes -------------------------------------------------------------------------------------


def test_cancel_then_resume_a_waiting_workflow(world: World) -> None:
    """Changes waiting-1: CANCELLED, then queued again and running (it waits for a message again)."""
    with world.api() as api:
        assert db_status(world, "waiting-1") == "PENDING"
        assert ok(api.post(f"{LEDGER}/workflows/waiting-1/cancel"), 204) is None
        assert db_status(world, "waiting-1") == "CANCELLED"
        assert ok(api.get(f"{LEDGER}/workflows/waiting-1"))["status"] == "CANCELLED"
        assert ok(api.post(f"{LEDGER}/workflows/waiting-1/resume", json={}), 204) is None
        assert db_status(world, "waiting-1") in ("ENQUEUED", "PENDING")
        assert_eventually(lambda: db_status(world, "waiting-1") == "PENDING", 20)
        # Resuming what does not exist: 404, and the attempt is audited as a failure.
        body = problem(api.post(f"{LEDGER}/workflows/no-such-workflow/resume"), 404)
        assert "no-such-workflow" in body["detail"]
    audited_once(world, "ledger", "workflow.cancel", workflowIds=["waiting-1"])
    audited_once(world, "ledger", "workflow.resume", workflowIds=["waiting-1"])
    failed = audited_once(world, "ledger", "workflow.resume", "failure", workflowIds=["no-such-workflow"])
    assert failed["detail"]["error"]


def test_fork_with_a_given_id_and_with_one_relay_draws(world: World) -> None:
    fork(world, "done-1", "done-1-fork", start_step=10)
    ((status, forked_from, steps),) = query(
        world.sysdb,
        """SELECT status, forked_from,
                  (SELECT count(*) FROM dbos.operation_outputs o WHERE o.workflow_uuid = w.workflow_uuid)
           FROM dbos.workflow_status w WHERE workflow_uuid = 'done-1-fork'""",
    )
    assert (status, forked_from) == ("SUCCESS", "done-1")
    assert steps >= 9  # the steps before step 10, copied
    with world.api() as api:
        assert ok(api.get(f"{LEDGER}/workflows/done-1"))["wasForkedFrom"] is True
        drawn = ok(api.post(f"{LEDGER}/workflows/done-1/fork", json={"startStep": 10}), 201)["workflowId"]
        assert uuid.UUID(drawn)  # Relay drew it before asking (a retry cannot fork twice)
        assert_eventually(lambda: db_status(world, drawn) == "SUCCESS", 20)
        got = ok(api.get(f"{LEDGER}/workflows/{drawn}"))
        assert (got["forkedFrom"], got["workflowName"]) == ("done-1", "parent")
        # Forking what does not exist.
        problem(api.post(f"{LEDGER}/workflows/no-such-workflow/fork", json={}), 404)
    audited_once(world, "ledger", "workflow.fork", workflowIds=["done-1"], newWorkflowId="done-1-fork", startStep=10)
    audited_once(world, "ledger", "workflow.fork", workflowIds=["done-1"], newWorkflowId=drawn)
    audited_once(world, "ledger", "workflow.fork", "failure", workflowIds=["no-such-workflow"])


def forks_waiting(sysdb: str) -> set[str]:
    """The statements of the system database's sessions waiting for a lock on workflow_status, by
    their first word."""
    rows = query(
        sysdb,
        """SELECT split_part(ltrim(query), ' ', 1) FROM pg_stat_activity WHERE datname = current_database()
           AND wait_event_type = 'Lock' AND position('workflow_status' in query) > 0""",
    )
    return {str(r[0]).upper() for r in rows}


def test_a_fork_whose_first_executor_answers_late_is_answered_201(world: World) -> None:
    """A fork is tried on the next executor when the one asked first does not answer in time, with
    the id Relay drew before the first ask. The first one forked all the same, late: the next one
    finds the id taken. That id is this request's, so the fork is made once and answered 201 (not
    409 "a workflow with id ... already exists", about an id the caller never gave)."""
    with psycopg.connect(world.sysdb) as lock, world.api(world.r2) as api, ThreadPoolExecutor(1) as pool:
        # The executor asked first inserts the fork's row, then waits to mark done-1 forked (its row
        # is locked here); the one asked a timeout later (PER_EXECUTOR_SECS) waits for that row's id.
        lock.execute("SELECT 1 FROM dbos.workflow_status WHERE workflow_uuid = 'done-1' FOR UPDATE")
        answer = pool.submit(api.post, f"{LEDGER}/workflows/done-1/fork", json={"startStep": 10})
        assert_eventually(lambda: {"INSERT", "UPDATE"} <= forks_waiting(world.sysdb), 10)
        lock.rollback()
        drawn = ok(answer.result(), 201)["workflowId"]
    assert_eventually(lambda: db_status(world, drawn) == "SUCCESS", 20)
    assert query(world.sysdb, "SELECT forked_from FROM dbos.workflow_status WHERE workflow_uuid = %s", drawn) == [
        ("done-1",)
    ]
    audited_once(world, "ledger", "workflow.fork", workflowIds=["done-1"], newWorkflowId=drawn)


def forked_with_child(world: World, new_id: str) -> str:
    """A fork of done-1 from step 6: it starts a child of its own, then waits for a message;
    cancelled once the child is there, so that nothing runs when it is deleted."""
    fork(world, "done-1", new_id, start_step=6, settle=None)
    child = f"{new_id}-child"
    assert_eventually(lambda: db_status(world, child) == "SUCCESS", 20)
    with world.api() as api:
        ok(api.post(f"{LEDGER}/workflows/{new_id}/cancel"), 204)
    assert db_status(world, new_id) == "CANCELLED"
    return child


def test_delete_a_workflow_with_or_without_its_children(world: World) -> None:
    kept_child = forked_with_child(world, "delete-alone")
    gone_child = forked_with_child(world, "delete-all")
    with world.api() as api:
        assert ok(api.delete(f"{LEDGER}/workflows/delete-alone"), 204) is None
        assert ok(api.delete(f"{LEDGER}/workflows/delete-all", params={"deleteChildren": "true"}), 204) is None
        problem(api.get(f"{LEDGER}/workflows/delete-alone"), 404)
    assert db_status(world, "delete-alone") is None
    assert db_status(world, kept_child) == "SUCCESS"
    assert db_status(world, "delete-all") is None
    assert db_status(world, gone_child) is None
    assert (
        query(
            world.sysdb,
            "SELECT 1 FROM dbos.operation_outputs WHERE workflow_uuid = ANY(%s)",
            ["delete-alone", "delete-all", gone_child],
        )
        == []
    )
    audited_once(world, "ledger", "workflow.delete", workflowIds=["delete-alone"])
    audited_once(world, "ledger", "workflow.delete", workflowIds=["delete-all"])


def test_export_then_import_brings_a_deleted_workflow_back(world: World) -> None:
    fork(world, "done-1", "exported-1", start_step=10)
    row_sql: LiteralString = """SELECT w.status, w.name, w.created_at, w.forked_from,
        (SELECT count(*) FROM dbos.operation_outputs o WHERE o.workflow_uuid = w.workflow_uuid)
        FROM dbos.workflow_status w WHERE workflow_uuid = 'exported-1'"""
    before = query(world.sysdb, row_sql)
    with world.api() as api:
        exported = ok(api.get(f"{LEDGER}/workflows/exported-1/export", params={"exportChildren": "true"}))
        assert set(exported) == {"serializedWorkflow"} and exported["serializedWorkflow"]
        ok(api.delete(f"{LEDGER}/workflows/exported-1"), 204)
        assert query(world.sysdb, row_sql) == []
        imported = api.post(f"{LEDGER}/workflows/import", json=exported)
        assert (imported.status_code, imported.content) == (201, b"")
        assert query(world.sysdb, row_sql) == before
        assert ok(api.get(f"{LEDGER}/workflows/exported-1"))["status"] == "SUCCESS"
        # Imported again: the executor refuses (the workflow is there, a 409), and nobody tries it twice.
        assert "already exists" in problem(api.post(f"{LEDGER}/workflows/import", json=exported), 409)["detail"]
        problem(api.get(f"{LEDGER}/workflows/no-such-workflow/export"), 404)
    assert len(audit(world, "ledger", "workflow.import")) == 2
    audited_once(world, "ledger", "workflow.import", "success")
    audited_once(world, "ledger", "workflow.import", "failure")


def test_bulk_cancel_resume_and_delete(world: World) -> None:
    """Forks of done-1 from step 7 (they wait for a message, PENDING) are the workflows changed."""
    ids = [fork(world, "done-1", f"bulk-{n}", start_step=7, settle="PENDING") for n in range(3)]
    with world.api() as api:
        ok(api.post(f"{LEDGER}/workflows/bulk-cancel", json={"workflowIds": ids}), 204)
        assert [db_status(world, i) for i in ids] == ["CANCELLED"] * 3
        ok(api.post(f"{LEDGER}/workflows/bulk-resume", json={"workflowIds": ids}), 204)
        assert {db_status(world, i) for i in ids} <= {"ENQUEUED", "PENDING"}
        assert_eventually(lambda: [db_status(world, i) for i in ids] == ["PENDING"] * 3, 20)
        ok(api.post(f"{LEDGER}/workflows/bulk-delete", json={"workflowIds": ids, "deleteChildren": True}), 204)
        assert [db_status(world, i) for i in ids] == [None] * 3
        problem(api.post(f"{LEDGER}/workflows/bulk-cancel", json={"workflowIds": []}), 422)
        problem(api.post(f"{LEDGER}/workflows/bulk-delete", json={}), 422)
    for action in ("workflow.bulk_cancel", "workflow.bulk_resume", "workflow.bulk_delete"):
        audited_once(world, "ledger", action, workflowIds=ids)


def test_bulk_fork_from_failure(world: World) -> None:
    with world.api() as api:
        body = {"workflowIds": ["failed-1"], "fromLastFailure": True}
        (forked,) = ok(api.post(f"{LEDGER}/workflows/bulk-fork-from-failure", json=body))["workflowIds"]
        assert_eventually(lambda: db_status(world, forked) == "ERROR", 20)  # it fails again, as the original did
        ((name, forked_from),) = query(
            world.sysdb, "SELECT name, forked_from FROM dbos.workflow_status WHERE workflow_uuid = %s", forked
        )
        assert (name, forked_from) == ("failing", "failed-1")
        # Exactly one of the from* members.
        for wrong in ({}, {"fromLastFailure": True, "fromStep": 1}, {"fromLastStep": True, "fromStepName": "add"}):
            resp = api.post(f"{LEDGER}/workflows/bulk-fork-from-failure", json={"workflowIds": ["failed-1"], **wrong})
            assert "exactly one" in problem(resp, 422)["detail"]
    entry = audited_once(world, "ledger", "workflow.bulk_fork_from_failure", workflowIds=["failed-1"])
    assert entry["detail"]["forkedWorkflowIds"] == [forked]


def test_pause_resume_trigger_and_backfill_a_schedule(world: World) -> None:
    def schedule_status() -> str:
        return str(
            query(world.sysdb, "SELECT status FROM dbos.workflow_schedules WHERE schedule_name = 'every-hour'")[0][0]
        )

    with world.api() as api:
        assert schedule_status() == "PAUSED"  # since the module began
        ok(api.post(f"{LEDGER}/schedules/every-hour/resume"), 204)
        assert schedule_status() == "ACTIVE"
        assert ok(api.get(f"{LEDGER}/schedules/every-hour"))["status"] == "ACTIVE"
        ok(api.post(f"{LEDGER}/schedules/every-hour/pause"), 204)
        assert schedule_status() == "PAUSED"

        triggered = ok(api.post(f"{LEDGER}/schedules/every-hour/trigger"), 201)["workflowId"]
        ((name, schedule_name),) = query(
            world.sysdb, "SELECT name, schedule_name FROM dbos.workflow_status WHERE workflow_uuid = %s", triggered
        )
        assert (name, schedule_name) == ("tick", "every-hour")

        window = {"startTime": "2026-01-01T10:30:00Z", "endTime": "2026-01-01T13:00:00Z"}
        first = ok(api.post(f"{LEDGER}/schedules/every-hour/backfill", json=window))["workflowIds"]
        assert len(first) == 2  # 11:00 and 12:00
        assert [r[0] for r in query(world.sysdb, "SELECT workflow_uuid FROM dbos.workflow_status "
                                    "WHERE workflow_uuid = ANY(%s) ORDER BY 1", first)] == sorted(first)  # fmt: skip
        ticks = query(world.sysdb, "SELECT count(*) FROM dbos.workflow_status WHERE name = 'tick'")
        again = ok(api.post(f"{LEDGER}/schedules/every-hour/backfill", json=window))["workflowIds"]
        assert again == first
        assert query(world.sysdb, "SELECT count(*) FROM dbos.workflow_status WHERE name = 'tick'") == ticks

        problem(api.post(f"{LEDGER}/schedules/no-such-schedule/trigger"), 404)
        problem(api.post(f"{LEDGER}/schedules/every-hour/backfill", json={"startTime": window["startTime"]}), 422)
    audited_once(world, "ledger", "schedule.pause", scheduleName="every-hour")
    audited_once(world, "ledger", "schedule.resume", scheduleName="every-hour")
    audited_once(world, "ledger", "schedule.trigger", scheduleName="every-hour")
    audited_once(world, "ledger", "schedule.trigger", "failure", scheduleName="no-such-schedule")
    assert len(audit(world, "ledger", "schedule.backfill", scheduleName="every-hour", result="success")) == 2


def test_set_the_latest_version(world: World) -> None:
    """v2 connected last, so it is the latest; setting v1 makes v1's timestamp the newest."""
    stamps = {name: stamp for name, (_, stamp, _) in versions_in_db(world.sysdb).items()}
    assert stamps["v2"] > stamps["v1"]
    with world.api() as api:
        ok(api.patch(f"{LEDGER}/versions/latest", json={"versionName": "v1"}), 204)
        stamps = {name: stamp for name, (_, stamp, _) in versions_in_db(world.sysdb).items()}
        assert stamps["v1"] > stamps["v2"]
        latest = max(ok(api.get(f"{LEDGER}/versions")), key=lambda v: ms(v["versionTimestamp"]) or 0)
        assert latest["versionName"] == "v1"
        problem(api.patch(f"{LEDGER}/versions/latest", json={}), 422)
    audited_once(world, "ledger", "application.set_latest_version", versionName="v1")


# -- apps: register and delete --------------------------------------------------------------------


def test_register_an_app_list_it_and_delete_it(world: World) -> None:
    with world.api() as api:
        assert ok(api.put("/apps/ghost-app"), 204) is None
        assert ok(api.put("/apps/ghost-app", json={"privateMode": False}), 204) is None  # again: nothing new
        # Conductor's PATCH carries privateMode too (dbosctl app update --private-mode): false, as it is;
        # true is refused by PUT and PATCH alike, Relay having no private mode.
        assert ok(api.patch("/apps/ghost-app", json={"privateMode": False})) == ok(api.get("/apps/ghost-app"))
        for method in ("PATCH", "PUT"):
            refused = problem(api.request(method, "/apps/ghost-app", json={"privateMode": True}), 422)
            assert "Relay has no private mode" in refused["detail"], method
        problem(api.patch("/apps/no-such-app", json={"privateMode": False}), 404)
        apps = {a["name"]: a for a in ok(api.get("/apps"))}
        ghost = apps["ghost-app"]
        assert (ghost["status"], ghost["language"], ghost["executorTimeoutSecs"]) == ("UNAVAILABLE", None, 60)
        assert apps["ledger"]["status"] == "AVAILABLE"
        assert ok(api.get("/apps/ghost-app/executors")) == []
        # An app relay.yaml lists stays (its executors would bring it back without the file's
        # settings and rules), and so does one with executors in the registry.
        assert problem(api.delete(LEDGER), 409)["error"]["code"] == "defined_in_config"
        assert ok(api.get(LEDGER))["name"] == "ledger"
        asked: list[dict[str, Any]] = []

        def keep(request: dict[str, Any]) -> dict[str, Any]:
            asked.append(request)
            return {"output": []}

        url = executor_url(world.r1, "busy-app")
        with SimulatedPeer(url, f"busy-{uuid.uuid4()}", "answer", replies={"list_workflows": keep}) as peer:
            assert_eventually(lambda: healthy(world.r1, "busy-app", peer.executor_id), 10)
            assert "executors" in problem(api.delete("/apps/busy-app"), 409)["detail"]
            # An executor's own workflows are its app's (apps may share a system database), as every listing.
            assert ok(api.get(f"/apps/busy-app/executors/{peer.executor_id}/workflows")) == []
            assert [r["body"].get("application_name") for r in asked] == [["busy-app"]]
        assert ok(api.get("/apps/busy-app"))["name"] == "busy-app"
        assert ok(api.delete("/apps/ghost-app"), 204) is None
        problem(api.get("/apps/ghost-app"), 404)
        assert "ghost-app" not in {a["name"] for a in ok(api.get("/apps"))}
        problem(api.delete("/apps/ghost-app"), 404)
    # With their result, as every other change the API makes (application.set_latest_version...).
    audited_once(world, "ghost-app", "application.create")
    audited_once(world, "ghost-app", "application.delete")
    # An app registered by its first executor's connection (autoRegisterApps) is audited too, naming that
    # executor and its address; an app that existed (relay.yaml's, whose executors connected) is not.
    (registered,) = audit(world, "busy-app", "application.create", result="success", executorId=peer.executor_id)
    assert re.fullmatch(rf"executor:{re.escape(peer.executor_id)}@127\.0\.0\.1:\d+", registered["actor"])
    assert registered["actor"] == f"executor:{peer.executor_id}@{registered['detail']['address']}"
    assert audit(world, "ledger", "application.create") == []
    # In Conductor's listing its subject is that executor, not Relay itself; ?subject= finds it by its id.
    # Its target is the app; the executor's id is its executorId too: ?executorId= finds it.
    with world.api() as api:
        logs = ok(api.get("/audit-logs", params={"operation": "application.create", "subject": registered["actor"]}))
        by_executor = ok(api.get("/audit", params={"executorId": peer.executor_id, "action": "application.create"}))
    assert [(e["id"], e["executorId"]) for e in by_executor] == [(registered["id"], peer.executor_id)]
    subject = {"type": "executor", "id": registered["actor"], "display": registered["actor"]}
    assert [(e["subject"], e["target"]) for e in logs] == [(subject, {"type": "application", "id": "busy-app"})]


# -- serving: 503, failover, 502, 501, 429 (asked of instance 2) ---------------------------------


def executor_url(relay: RelayProcess, app: str) -> str:
    return f"ws://127.0.0.1:{relay.port}/websocket/{app}/{CONDUCTOR_KEYS['acme']}"


def test_503_when_the_app_has_no_healthy_executor(world: World) -> None:
    with world.api(world.r2) as api:
        ok(api.put("/apps/no-executors"), 204)
        for method, path in (
            ("GET", "/workflows"),
            ("GET", "/workflows/done-1"),
            ("GET", "/queues"),
            ("GET", "/schedules"),
            ("GET", "/versions"),
            ("POST", "/workflows/done-1/cancel"),
        ):
            body = problem(api.request(method, f"/apps/no-executors{path}"), 503)
            assert "no healthy executor" in body["detail"], path
    failed = audited_once(world, "no-executors", "workflow.cancel", "failure", workflowIds=["done-1"])
    assert "no healthy executor" in failed["detail"]["error"]


def test_a_read_moves_on_when_an_executor_does_not_answer_and_a_trigger_does_not(world: World) -> None:
    """App ``failover``: a silent executor and a real one (its own system database). The executors
    are asked in turn, so of two requests in a row one asks the silent one first."""
    sysdb = world.postgres.create_database("sys")
    real = ExecutorProcess(world.workdir, sysdb, world.r2.conductor_url, app="failover", version="vf",
                           module=APP_MODULE)  # fmt: skip
    try:
        with SimulatedPeer(executor_url(world.r2, "failover"), f"silent-{uuid.uuid4()}", "silent",
                           others="silent") as silent, world.api(world.r2) as api:  # fmt: skip
            for executor_id in (real.executor_id, silent.executor_id):
                assert_eventually(lambda: healthy(world.r2, "failover", executor_id), 10)  # noqa: B023
            expected = versions_in_db(sysdb)
            waited, quick = [], []
            for _ in range(4):
                asked = silent.requests["list_application_versions"]
                started = time.monotonic()
                versions = ok(api.get("/apps/failover/versions"))
                took = time.monotonic() - started
                # The real executor's answer, whoever was asked first.
                assert {v["versionName"]: (v["versionId"], ms(v["versionTimestamp"]), ms(v["createdAt"]))
                        for v in versions} == expected  # fmt: skip
                (waited if silent.requests["list_application_versions"] > asked else quick).append(took)
                if waited and quick:
                    break
            assert waited and quick, (waited, quick)
            assert all(PER_EXECUTOR_SECS <= t < PER_EXECUTOR_SECS + SLACK_SECS for t in waited), waited
            assert all(t < PER_EXECUTOR_SECS for t in quick), quick

            # A trigger is never retried: the one that met the silent executor first ends there, 502;
            # the other triggers the schedule. (A trigger first reads the schedule, another turn of the
            # executors: a read between the two triggers makes the second one's trigger go to the other
            # executor.) The schedule is failover's own: one no app has is a 404 before any trigger.
            client = DBOSClient(system_database_url=sysdb)
            try:
                client.create_schedule(schedule_name="hourly", workflow_name="tick", schedule="0 * * * *",
                                       application_name="failover")  # fmt: skip
            finally:
                client.destroy()
            asked = silent.requests["trigger_schedule"]
            answers = [api.post("/apps/failover/schedules/hourly/trigger")]
            ok(api.get("/apps/failover/versions"))
            answers.append(api.post("/apps/failover/schedules/hourly/trigger"))
            assert sorted(r.status_code for r in answers) == [201, 502], [r.text for r in answers]
            assert silent.requests["trigger_schedule"] == asked + 1
            problem(next(r for r in answers if r.status_code == 502), 502)
    finally:
        real.stop()
    assert len(audit(world, "failover", "schedule.trigger", result="failure")) == 1
    assert len(audit(world, "failover", "schedule.trigger", result="success")) == 1


def test_an_executor_that_just_left_costs_a_request_nothing(world: World) -> None:
    """Instance 2 reads which executors serve an app at most once a second: a silent executor
    that leaves in between is still in that list, and is skipped at once, not waited for."""
    with world.api(world.r2) as api:
        with SimulatedPeer(executor_url(world.r2, "ledger"), f"leaving-{uuid.uuid4()}", "silent",
                           others="silent") as leaving:  # fmt: skip
            assert_eventually(lambda: healthy(world.r2, "ledger", leaving.executor_id), 10)
            ok(api.get(f"{LEDGER}/queues"))  # the list of three, read now (the silent one may be asked)
        for _ in range(3):
            started = time.monotonic()
            ok(api.get(f"{LEDGER}/queues"))
            assert time.monotonic() - started < PER_EXECUTOR_SECS
        assert leaving.requests["list_queues"] <= 1
    assert_eventually(lambda: not healthy(world.r2, "ledger", leaving.executor_id), 10)


def get(relay: RelayProcess, path: str) -> httpx.Response:
    """A GET on a client of its own (for requests made from several threads at once)."""
    with relay.api("acme") as api:
        return api.get(path)


def test_502_when_no_executor_answers_and_429_beyond_the_requests_in_flight(world: World) -> None:
    url = executor_url(world.r2, "hung")
    with (
        SimulatedPeer(url, f"hung-{uuid.uuid4()}", "silent", others="silent") as first,
        SimulatedPeer(url, f"hung-{uuid.uuid4()}", "silent", others="silent") as second,
        world.api(world.r2) as api,
    ):
        peers = (first, second)
        for peer in peers:
            assert_eventually(lambda: healthy(world.r2, "hung", peer.executor_id), 10)  # noqa: B023
        started = time.monotonic()
        body = problem(api.get("/apps/hung/workflows"), 502)
        took = time.monotonic() - started
        assert 2 * PER_EXECUTOR_SECS <= took < 2 * PER_EXECUTOR_SECS + SLACK_SECS, took
        assert "no executor of app 'hung' answered" in body["detail"]
        assert [p.requests["list_workflows"] for p in peers] == [1, 1]  # each asked once

        # Two requests in flight (each waits on both silent executors): a third is refused at once.
        with ThreadPoolExecutor(IN_FLIGHT_CAP) as pool:
            held = [pool.submit(get, world.r2, "/apps/hung/queues") for _ in range(IN_FLIGHT_CAP)]
            assert_eventually(lambda: sum(p.requests["list_queues"] for p in peers) >= IN_FLIGHT_CAP, 5)
            started = time.monotonic()
            refused = api.get("/apps/hung/workflows/done-1")
            assert time.monotonic() - started < PER_EXECUTOR_SECS
            problem(refused, 429)
            assert refused.headers["retry-after"] == "1"
            for future in held:
                problem(future.result(), 502)
        # The cap counts requests in flight, not requests made: with them gone, the app is asked again.
        assert [p.requests["get_workflow"] for p in peers] == [0, 0]
        problem(api.get("/apps/hung/workflows/done-1"), 502)
        assert [p.requests["get_workflow"] for p in peers] == [1, 1]


# A workflow's reads, and the message each asks the executor.
READS = {
    "steps": ("list_steps", {"output": [{"function_id": 0, "function_name": "charge"}]}),
    "events": ("get_workflow_events", {"events": [{"key": "k", "value": "v"}]}),
    "notifications": (
        "get_workflow_notifications",
        {"notifications": [{"message": "m", "created_at_epoch_ms": 1, "consumed": False}]},
    ),
    "streams": ("get_workflow_streams", {"streams": [{"key": "k", "values": ["v"]}]}),
    "export": ("export_workflow", {"serialized_workflow": "c2VyaWFsaXplZA=="}),
}


def test_a_workflows_read_asks_whether_it_is_the_apps_at_the_same_time(world: World) -> None:
    """App ``paired``: an executor that answers the check (a listing of the id) only once it has
    the read in hand, so a Relay that waits for the check before reading is never answered (502).
    Another app's workflow is still a 404 (the read's answer dropped), and the check's error is
    the answer whatever the read says, as when the check came first."""

    def listed(request: dict[str, Any]) -> dict[str, Any]:
        ids = request["body"]["workflow_uuids"]
        if ids == ["broken"]:
            return {"error_message": "Exception encountered when listing workflows: the database is away"}
        mine = [{"WorkflowUUID": "mine", "Status": "SUCCESS", "WasForkedFrom": False, "ApplicationName": "paired"}]
        return {"output": mine if ids == ["mine"] else []}  # the SDK filters by application_name

    replies: dict[str, Any] = {"list_workflows": listed, **{kind: fields for kind, fields in READS.values()}}
    url = executor_url(world.r2, "paired")
    releasing = [kind for kind, _ in READS.values()]
    with (
        SimulatedPeer(
            url, f"paired-{uuid.uuid4()}", "silent", replies=replies, paired={"list_workflows": releasing}
        ) as peer,
        world.api(world.r2) as api,
    ):
        assert_eventually(lambda: healthy(world.r2, "paired", peer.executor_id), 10)
        for read, (kind, _) in READS.items():
            resp = api.get(f"/apps/paired/workflows/mine/{read}")
            assert resp.status_code == 200, (read, resp.status_code, resp.text)
            assert resp.json(), read
            asked = peer.requests[kind]
            problem(api.get(f"/apps/paired/workflows/theirs/{read}"), 404)  # another app's, or none
            assert peer.requests[kind] == asked + 1, "read, and its answer dropped"
            body = problem(api.get(f"/apps/paired/workflows/broken/{read}"), 502)
            assert "the database is away" in body["detail"], body


def test_501_when_the_executors_sdk_does_not_know_the_message(world: World) -> None:
    url = executor_url(world.r2, "old-sdk")
    with SimulatedPeer(url, f"old-{uuid.uuid4()}", "silent", others="unknown") as old, world.api(world.r2) as api:
        assert_eventually(lambda: healthy(world.r2, "old-sdk", old.executor_id), 10)
        for method, path, message in (
            ("GET", "/workflows", "list_workflows"),
            ("GET", "/queues/serial", "get_queue"),
            # A cancel reads the workflow first (DBOS answers success for one that does not exist).
            ("POST", "/workflows/done-1/cancel", "list_workflows"),
            ("POST", "/schedules/nightly/trigger", "trigger_schedule"),
        ):
            body = problem(api.request(method, f"/apps/old-sdk{path}"), 501)
            assert f"does not know the message {message}" in body["detail"], body
            assert "Unknown message type" in body["detail"]
    audited_once(world, "old-sdk", "workflow.cancel", "failure", workflowIds=["done-1"])
    # Its only executor gone, the app has none healthy: 503.
    assert_eventually(lambda: not healthy(world.r2, "old-sdk", old.executor_id), 10)
    with world.api(world.r2) as api:
        problem(api.get("/apps/old-sdk/workflows"), 503)


# What relay_client answers a request it is too busy to take (Handlers.refuse): the request's failure
# reply, its payload empty, saying it is busy. Another executor of the app may well be free.
BUSY = ("relay_client: busy, 68 requests in progress or waiting for one of 4 turns; "
        "not served, ask again later")  # fmt: skip


def test_a_read_moves_on_when_an_executor_says_it_is_too_busy_to_take_it(world: World) -> None:
    """App ``crowded``: an executor whose relay_client refuses every request (too many waiting for a
    turn) and a real one. A read that asks the busy one first must get the real one's answer, as it
    does when the busy one stays silent (the client before the refusal), only sooner: the busy one
    said it did not serve the request, so nothing was done and asking the next executor is safe."""
    sysdb = world.postgres.create_database("sys")
    real = ExecutorProcess(world.workdir, sysdb, world.r2.conductor_url, app="crowded", version="vc",
                           module=APP_MODULE)  # fmt: skip
    refusal = {"error_message": BUSY}  # relay_client's Handlers.refuse: an error and no payload
    try:
        with (
            SimulatedPeer(
                executor_url(world.r2, "crowded"),
                f"busy-{uuid.uuid4()}",
                "silent",
                replies={"list_application_versions": refusal},
            ) as busy,
            world.api(world.r2) as api,
        ):
            for executor_id in (real.executor_id, busy.executor_id):
                assert_eventually(lambda: healthy(world.r2, "crowded", executor_id), 10)  # noqa: B023
            expected = versions_in_db(sysdb)
            met_busy_first = 0
            for _ in range(4):
                asked = busy.requests["list_application_versions"]
                resp = api.get("/apps/crowded/versions")
                met_busy_first += busy.requests["list_application_versions"] > asked
                assert resp.status_code == 200, (resp.status_code, resp.text)
                assert {v["versionName"]: (v["versionId"], ms(v["versionTimestamp"]), ms(v["createdAt"]))
                        for v in resp.json()} == expected  # fmt: skip
            assert met_busy_first, "the busy executor was never asked first"
    finally:
        real.stop()


def test_a_workflow_of_no_app_is_listed_and_reached_under_the_app(world: World) -> None:
    """A DBOSClient given no application name writes its workflows with no owner (``application_name``
    NULL): DBOS reads them as every app's, and so does Relay's scoping by app. One enqueued so is
    listed, counted, read, cancelled and deleted under ledger (before billing joins the database)."""
    client = DBOSClient(system_database_url=world.sysdb)
    try:
        options: EnqueueOptions = {"queue_name": "nowhere", "workflow_name": "job", "workflow_id": "nameless-1"}
        client.enqueue(options, 1)
    finally:
        client.destroy()
    assert query(world.sysdb, "SELECT application_name FROM dbos.workflow_status "
                              "WHERE workflow_uuid = 'nameless-1'") == [(None,)]  # fmt: skip
    with world.api() as api:
        listed = ok(api.post(f"{LEDGER}/workflows/search", json={"workflowIds": ["nameless-1"]}))
        assert [w["workflowId"] for w in listed] == ["nameless-1"]
        assert "nameless-1" in [w["workflowId"] for w in ok(api.get(f"{LEDGER}/workflows", params={"limit": 1000}))]
        counted = ok(api.post(f"{LEDGER}/workflows/aggregates", json={"groupByQueueName": True}))
        assert {"group": {"queue_name": "nowhere"}, "count": 1} in counted, counted
        assert ok(api.get(f"{LEDGER}/workflows/nameless-1"))["status"] == "ENQUEUED"
        assert ok(api.get(f"{LEDGER}/workflows/nameless-1/steps")) == []
        assert ok(api.get(f"{LEDGER}/workflows/nameless-1/events")) == []
        ok(api.post(f"{LEDGER}/workflows/nameless-1/cancel"), 204)
        assert db_status(world, "nameless-1") == "CANCELLED"
        assert api.delete(f"{LEDGER}/workflows/nameless-1").status_code == 204
        assert db_status(world, "nameless-1") is None


def test_a_key_limited_to_another_app_on_the_same_system_database_reaches_nothing_of_ledgers(world: World) -> None:
    """Apps ``ledger`` and ``billing`` keep their workflows in one system database, which their executors
    read whole. A key limited to ``billing`` (reads and writes) names ledger's workflows, schedule and
    queue under ``/apps/billing/...``: Relay used to ask billing's executor by id or name alone, which
    read ledger's workflow with its input and steps, cancelled and forked it, and paused, triggered and
    backfilled ledger's schedule. Every route of an app now acts on that app's only (DBOS's
    ``application_name``): nothing of ledger's is listed or counted under billing, and a read or an
    action naming one is a 404, as for one that does not exist, which changes nothing. Last in the
    module: billing's executor joins the world's system database."""
    # DBOS wants version names unique across the apps of a system database.
    billing = ExecutorProcess(world.workdir, world.sysdb, world.r1.conductor_url, app="billing", version="b1")
    try:
        assert_eventually(lambda: healthy(world.r1, "billing", billing.executor_id), 10)
        with world.api() as admin:
            made = admin.post("/tokens/billing-ops", json={"permissions": ["application.read", "application.write"],
                                                           "appNames": ["billing"]})  # fmt: skip
            assert made.status_code == 201, made.text
            before = {w: db_status(world, w) for w in ("waiting-1", "done-1")}
            schedule = ok(admin.get(f"{LEDGER}/schedules/every-hour"))["status"]
        with world.r1.api(key=made.json()["token"]) as key:
            assert ok(key.get("/apps/billing/workflows")) == [], "ledger's workflows listed under billing"
            counted = ok(key.post("/apps/billing/workflows/aggregates", json={"groupByApplicationName": True}))
            assert counted == [], f"ledger's workflows counted under billing: {counted}"
            assert ok(key.get("/apps/billing/schedules")) == [], "ledger's schedule listed under billing"
            assert "serial" not in [q["name"] for q in ok(key.get("/apps/billing/queues"))], "ledger's queue"
            backfill = {"startTime": "2026-01-01T00:00:00Z", "endTime": "2026-01-01T03:00:00Z"}
            for method, path, body, name in [
                ("GET", "/workflows/{}", None, "waiting-1"),
                ("GET", "/workflows/{}/steps", None, "done-1"),
                ("GET", "/workflows/{}/events", None, "done-1"),
                ("GET", "/workflows/{}/export", None, "done-1"),
                ("POST", "/workflows/{}/cancel", None, "waiting-1"),
                ("POST", "/workflows/bulk-cancel", {"workflowIds": ["{}"]}, "waiting-1"),
                ("POST", "/workflows/{}/fork", {"startStep": 0}, "done-1"),
                ("POST", "/workflows/bulk-fork-from-failure", {"workflowIds": ["{}"], "fromLastStep": True}, "done-1"),
                ("GET", "/schedules/{}", None, "every-hour"),
                ("POST", "/schedules/{}/resume", None, "every-hour"),
                ("POST", "/schedules/{}/trigger", None, "every-hour"),
                ("POST", "/schedules/{}/backfill", backfill, "every-hour"),
                ("GET", "/queues/{}", None, "serial"),
            ]:
                # Ledger's name and one nothing has get the same answer, the name apart: a key limited
                # to billing cannot tell which names ledger uses (the SDK's own 404 for a schedule no
                # app has, to a trigger or a backfill, was worded otherwise).
                answers = []
                for named in (name, "nothing-has-this"):
                    sent = None if body is None else json.loads(json.dumps(body).replace("{}", named))
                    got = problem(
                        key.request(
                            method,
                            f"/apps/billing{path.format(quote(named, safe=''))}",
                            json=sent,
                            headers={"X-Request-Id": "same-for-both"},  # the two answers differ by nothing else
                        ),
                        404,
                    )
                    answers.append(json.dumps(got).replace(named, "<name>"))
                assert answers[0] == answers[1], f"{method} {path}: {answers}"
        with world.api() as admin:
            assert {w: db_status(world, w) for w in before} == before, "ledger's workflows changed"
            assert ok(admin.get(f"{LEDGER}/schedules/every-hour"))["status"] == schedule
            assert admin.delete("/tokens/billing-ops").status_code == 204
    finally:
        billing.stop()


# -- long workflow ids -----------------------------------------------------------------------------


def random_id(alphabet: str, size: int, seed: int) -> str:
    """An id of ``size`` bytes in UTF-8 drawn from ``alphabet`` (all of one width), which does not
    compress: PostgreSQL's index holds such an id uncompressed."""
    width = len(alphabet[0].encode())
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(size // width))


LATIN = "".join(chr(c) for c in range(0xC0, 0x250))  # two bytes each in UTF-8
LONG_IDS = {
    # Past the 256 characters Relay took before.
    "ascii-300": random_id(string.ascii_letters + string.digits + "-_.:", 300, 1),
    # Near the longest id PostgreSQL's indexes take when it does not compress: 2,692 bytes in the
    # workflow's own row, a few less in its steps' (whose key adds the step's number).
    "latin-2600-bytes": random_id(LATIN, 2600, 2),
    # Relay's bound exactly: 16 KiB, which PostgreSQL stores compressed (the id repeats itself).
    "repetitive-16384-bytes": ("batch-2026/€/order-" * 1000).encode()[: MAX_WORKFLOW_ID_BYTES - 1].decode() + "!",
}


@pytest.mark.parametrize("name", list(LONG_IDS))
def test_a_workflow_with_a_long_id_is_found_read_forked_cancelled_and_deleted(world: World, name: str) -> None:
    """DBOS bounds no workflow id (PostgreSQL's index does, in bytes, after compression): one past
    the 256 characters Relay once took was listed but answered 422 everywhere else. Such ids are
    found, read, forked (to a long new id), cancelled and deleted through every way in."""
    workflow_id = LONG_IDS[name]
    assert len(workflow_id.encode()) <= MAX_WORKFLOW_ID_BYTES
    # The fork's id: as long, another workflow (its first character changed).
    fork_id = ("Z" if workflow_id[0] != "Z" else "Y") + workflow_id[1:]
    client = DBOSClient(system_database_url=world.sysdb)
    try:
        client.enqueue({"queue_name": "serial", "workflow_name": "job", "workflow_id": workflow_id}, 4)
    finally:
        client.destroy()
    assert_eventually(lambda: db_status(world, workflow_id) == "SUCCESS", 20, what=f"{name} done")
    path = f"{LEDGER}/workflows/{quote(workflow_id, safe='')}"
    with world.api() as api:
        assert [summary(ok(api.get(path)))] == db_workflows(world, "workflow_uuid = %s", workflow_id)
        steps = ok(api.get(f"{path}/steps"))
        assert [(s["stepId"], s["stepName"], s["output"]) for s in steps] == [(1, "add", "8")]
        found = ok(api.post(f"{LEDGER}/workflows/search", json={"workflowIds": [workflow_id]}))
        assert [w["workflowId"] for w in found] == [workflow_id]
        # Forked onto a queue no executor serves, so that it waits there to be cancelled.
        forked = ok(api.post(f"{path}/fork", json={"newWorkflowId": fork_id, "queueName": "nowhere"}), 201)
        assert forked == {"workflowId": fork_id}
        assert db_status(world, fork_id) == "ENQUEUED"
        found = ok(api.post(f"{LEDGER}/workflows/search", json={"forkedFrom": [workflow_id]}))
        assert [w["workflowId"] for w in found] == [fork_id]
        ok(api.post(f"{LEDGER}/workflows/bulk-cancel", json={"workflowIds": [fork_id]}), 204)
        assert db_status(world, fork_id) == "CANCELLED"
        ok(api.post(f"{LEDGER}/workflows/{quote(fork_id, safe='')}/resume", json={"queueName": "nowhere"}), 204)
        assert db_status(world, fork_id) == "ENQUEUED"
        ok(api.post(f"{LEDGER}/workflows/{quote(fork_id, safe='')}/cancel"), 204)
        assert db_status(world, fork_id) == "CANCELLED"
        for gone in (workflow_id, fork_id):
            ok(api.delete(f"{LEDGER}/workflows/{quote(gone, safe='')}"), 204)
            assert db_status(world, gone) is None
    audited_once(world, "ledger", "workflow.fork", workflowIds=[workflow_id], newWorkflowId=fork_id)


def test_a_workflow_id_past_the_bound_is_refused_with_a_422_naming_it(world: World) -> None:
    """One byte past the bound, in characters of two bytes (the bound counts bytes): a clear 422
    from the path, a body's id and a body's list of ids, and no executor asked."""
    too_long = "é" * (MAX_WORKFLOW_ID_BYTES // 2) + "x"
    bound = f"{MAX_WORKFLOW_ID_BYTES} bytes"
    with world.api() as api:
        body = problem(api.get(f"{LEDGER}/workflows/{quote(too_long, safe='')}"), 422)
        assert bound in body["detail"] and "workflow_id" in body["detail"], body
        body = problem(api.post(f"{LEDGER}/workflows/done-1/fork", json={"newWorkflowId": too_long}), 422)
        assert [e["location"] for e in body["errors"]] == ["body.newWorkflowId"], body
        assert bound in body["detail"], body
        body = problem(api.post(f"{LEDGER}/workflows/bulk-cancel", json={"workflowIds": ["done-1", too_long]}), 422)
        assert [e["location"] for e in body["errors"]] == ["body.workflowIds.1"], body
        body = problem(api.post(f"{LEDGER}/workflows/search", json={"workflowIds": [too_long]}), 422)
        assert [e["location"] for e in body["errors"]] == ["body.workflowIds.0"], body


# -- long queue and schedule names -----------------------------------------------------------------

# Random, so that PostgreSQL's indexes hold them uncompressed: DBOS 3.2 takes such names up to about
# 2,600 characters (its unique indexes refuse 2,680), where Relay took 256 before.
LONG_QUEUE = random_id(string.ascii_letters + string.digits + "-_.", 2000, 5)
LONG_SCHEDULE = random_id(string.ascii_letters + string.digits + "-_.", 2000, 6)


def db_queue_name(world: World, workflow_id: str) -> str | None:
    rows = query(world.sysdb, "SELECT queue_name FROM dbos.workflow_status WHERE workflow_uuid = %s", workflow_id)
    return rows[0][0] if rows else None


def db_schedule_status(world: World, schedule_name: str) -> str | None:
    rows = query(world.sysdb, "SELECT status FROM dbos.workflow_schedules WHERE schedule_name = %s", schedule_name)
    return rows[0][0] if rows else None


def test_a_queue_and_a_schedule_with_long_names_are_read_searched_paused_resumed_and_triggered(world: World) -> None:
    """DBOS bounds neither a queue's nor a schedule's name: one past the 256 characters Relay once
    took was listed but answered 422 everywhere else. A queue and a schedule of 2,000 characters,
    made through DBOS, are read, searched by, forked and resumed onto, paused, resumed and triggered;
    a refused pause is audited with the schedule's name."""
    client = DBOSClient(system_database_url=world.sysdb, application_name="ledger")
    made: list[str] = []
    try:
        client.register_queue(LONG_QUEUE, application_name="ledger")
        # Yearly, at midnight on 1 January: it does not fire while the test runs.
        client.create_schedule(
            schedule_name=LONG_SCHEDULE, workflow_name="tick", schedule="0 0 1 1 *", context="long",
            application_name="ledger",
        )  # fmt: skip
        made.append("long-queue-1")
        client.enqueue({"queue_name": LONG_QUEUE, "workflow_name": "job", "workflow_id": "long-queue-1"}, 5)
        assert_eventually(lambda: db_status(world, "long-queue-1") == "SUCCESS", 20, what="the job on the long queue")
        queue_path = f"{LEDGER}/queues/{quote(LONG_QUEUE, safe='')}"
        schedule_path = f"{LEDGER}/schedules/{quote(LONG_SCHEDULE, safe='')}"
        with world.api() as api:
            queue = ok(api.get(queue_path))
            assert (queue["name"], queue["applicationName"]) == (LONG_QUEUE, "ledger")
            assert queue in ok(api.get(f"{LEDGER}/queues"))
            found = ok(api.post(f"{LEDGER}/workflows/search", json={"queueName": [LONG_QUEUE]}))
            assert [w["workflowId"] for w in found] == ["long-queue-1"]
            body = {"groupByQueueName": True, "selectCount": True, "queueName": [LONG_QUEUE]}
            counted = ok(api.post(f"{LEDGER}/workflows/aggregates", json=body))
            assert [(a["group"], a["count"]) for a in counted] == [({"queue_name": LONG_QUEUE}, 1)]

            # Forked onto the long queue, where the executors run it; and forked onto a queue no
            # executor serves, cancelled there, and resumed onto the long queue.
            made += ["long-queue-fork", "long-queue-resumed"]
            fork_path = f"{LEDGER}/workflows/long-queue-1/fork"
            ok(api.post(fork_path, json={"newWorkflowId": "long-queue-fork", "queueName": LONG_QUEUE}), 201)
            ok(api.post(fork_path, json={"newWorkflowId": "long-queue-resumed", "queueName": "nowhere"}), 201)
            ok(api.post(f"{LEDGER}/workflows/long-queue-resumed/cancel"), 204)
            ok(api.post(f"{LEDGER}/workflows/long-queue-resumed/resume", json={"queueName": LONG_QUEUE}), 204)
            for workflow_id in ("long-queue-fork", "long-queue-resumed"):
                assert_eventually(lambda: db_status(world, workflow_id) == "SUCCESS", 20, what=workflow_id)  # noqa: B023
                assert db_queue_name(world, workflow_id) == LONG_QUEUE

            schedule = ok(api.get(schedule_path))
            assert (schedule["scheduleName"], schedule["status"], schedule["context"]) == (
                LONG_SCHEDULE,
                "ACTIVE",
                "long",
            )
            listed = ok(api.get(f"{LEDGER}/schedules", params={"scheduleNamePrefix": LONG_SCHEDULE[:1500]}))
            assert listed == [schedule]
            ok(api.post(f"{schedule_path}/pause"), 204)
            assert db_schedule_status(world, LONG_SCHEDULE) == "PAUSED"
            ok(api.post(f"{schedule_path}/resume"), 204)
            assert db_schedule_status(world, LONG_SCHEDULE) == "ACTIVE"
            triggered = ok(api.post(f"{schedule_path}/trigger"), 201)["workflowId"]
            made.append(triggered)
            assert query(
                world.sysdb, "SELECT name, schedule_name FROM dbos.workflow_status WHERE workflow_uuid = %s", triggered
            ) == [("tick", LONG_SCHEDULE)]
            found = ok(api.post(f"{LEDGER}/workflows/search", json={"scheduleName": [LONG_SCHEDULE]}))
            assert [w["workflowId"] for w in found] == [triggered]
            assert_eventually(lambda: db_status(world, triggered) == "SUCCESS", 20, what="the triggered run")
        audited_once(world, "ledger", "schedule.pause", scheduleName=LONG_SCHEDULE)
        audited_once(world, "ledger", "schedule.trigger", scheduleName=LONG_SCHEDULE)
        # Refused: its entry names the schedule, as a refusal naming a short one does.
        with world.r1.api("acme", VIEWER_KEYS["acme"]) as viewer:
            problem(viewer.post(f"{schedule_path}/pause"), 403)
        assert_eventually(
            lambda: audit(world, "ledger", "schedule.pause", result="failure", scheduleName=LONG_SCHEDULE),
            10,
            what="the refused pause audited with the schedule's name",
        )
    finally:
        client.delete_workflows(made)
        client.delete_schedule(LONG_SCHEDULE)
        client.delete_queue(LONG_QUEUE)
        client.destroy()


def test_a_queue_or_schedule_name_past_the_bound_is_refused_with_a_422_naming_it(world: World) -> None:
    """One byte past the bound, in characters of two bytes (the bound counts bytes): a clear 422
    from the path, a body's name, a body's list of names and a query, and no executor asked."""
    too_long = "é" * (MAX_QUEUE_OR_SCHEDULE_NAME_BYTES // 2) + "x"
    in_path = quote(too_long, safe="")
    bound = f"{MAX_QUEUE_OR_SCHEDULE_NAME_BYTES} bytes"
    with world.api() as api:
        for method, path, field in (
            ("GET", f"{LEDGER}/queues/{in_path}", "name"),
            ("GET", f"{LEDGER}/schedules/{in_path}", "schedule_name"),
            ("POST", f"{LEDGER}/schedules/{in_path}/pause", "schedule_name"),
            ("POST", f"{LEDGER}/schedules/{in_path}/trigger", "schedule_name"),
        ):
            body = problem(api.request(method, path), 422)
            assert f"{field}: longer than {bound}" in body["detail"], body
        for member in ("queueName", "scheduleName"):
            body = problem(api.post(f"{LEDGER}/workflows/search", json={member: ["serial", too_long]}), 422)
            assert [e["location"] for e in body["errors"]] == [f"body.{member}.1"], body
            assert bound in body["detail"], body
        body = problem(api.post(f"{LEDGER}/workflows/done-1/fork", json={"queueName": too_long}), 422)
        assert [e["location"] for e in body["errors"]] == ["body.queueName"], body
        body = problem(api.get(f"{LEDGER}/schedules", params={"scheduleNamePrefix": too_long}), 422)
        assert [e["location"] for e in body["errors"]] == ["query.scheduleNamePrefix"], body
        assert bound in body["detail"], body
    # The document says the bound: in characters, which no longer name can fit, and in bytes.
    with world.r1.client() as root:
        document = ok(root.get("/openapi.json"))
    (name, _) = document["components"]["schemas"]["ForkIn"]["properties"]["queueName"]["anyOf"]
    assert name["maxLength"] == MAX_QUEUE_OR_SCHEDULE_NAME_BYTES and bound in name["description"], name


# -- long workflow and step names, users and partition keys ------------------------------------------

LONG_USER = random_id(string.ascii_letters + string.digits, 2000, 7)
LONG_PARTITION_KEY = random_id(string.ascii_letters + string.digits, 2000, 8)


def test_long_workflow_and_step_names_users_and_partition_keys_are_searched_counted_and_forked_onto(
    world: World,
) -> None:
    """DBOS bounds none of a workflow's name, a step's, an authenticated user or a queue partition
    key (measured with DBOS 3.2 on PostgreSQL: 16,000 random characters of a workflow's name or a
    user, 2,600 of a step's name or a key): Relay took 256 characters of each, so a search, an
    aggregate or a fork naming a longer one answered 422. A workflow of a 2,000-character name,
    whose step's name is as long, run for a 2,000-character user on a partition of as long a key, is
    found, counted, listed with its step and forked by its step's name and onto its partition."""
    client = DBOSClient(system_database_url=world.sysdb, application_name="ledger")
    made = ["long-names-1"]
    try:
        client.register_queue("parts", partition_concurrency=1, application_name="ledger")
        options: EnqueueOptions = {
            "queue_name": "parts", "workflow_name": LONG_WORKFLOW_NAME, "workflow_id": "long-names-1",
            "authenticated_user": LONG_USER, "queue_partition_key": LONG_PARTITION_KEY,
        }  # fmt: skip
        client.enqueue(options, 5)
        assert_eventually(lambda: db_status(world, "long-names-1") == "SUCCESS", 20, what="the long-named workflow")
        with world.api() as api:
            for member, value in (("workflowName", LONG_WORKFLOW_NAME), ("user", LONG_USER)):
                found = ok(api.post(f"{LEDGER}/workflows/search", json={member: [value]}))
                assert [w["workflowId"] for w in found] == ["long-names-1"], member
                body = {"groupByWorkflowName": True, "selectCount": True, member: [value]}
                counted = ok(api.post(f"{LEDGER}/workflows/aggregates", json=body))
                assert [(a["group"], a["count"]) for a in counted] == [({"name": LONG_WORKFLOW_NAME}, 1)], member
            listed = ok(api.get(f"{LEDGER}/workflows", params={"workflowName": LONG_WORKFLOW_NAME}))
            assert [(w["workflowId"], w["user"], w["queuePartitionKey"]) for w in listed] == [
                ("long-names-1", LONG_USER, LONG_PARTITION_KEY)
            ]
            assert [s["stepName"] for s in ok(api.get(f"{LEDGER}/workflows/long-names-1/steps"))] == [LONG_STEP_NAME]
            body = {"groupByFunctionName": True, "selectCount": True, "stepName": [LONG_STEP_NAME]}
            counted = ok(api.post(f"{LEDGER}/steps/aggregates", json=body))
            assert [(a["group"], a["count"]) for a in counted] == [({"function_name": LONG_STEP_NAME}, 1)]
            assert ok(api.get(f"{LEDGER}/schedules", params={"workflowName": LONG_WORKFLOW_NAME})) == []

            made.append("long-names-fork")
            body = {"newWorkflowId": "long-names-fork", "queueName": "parts", "queuePartitionKey": LONG_PARTITION_KEY}
            ok(api.post(f"{LEDGER}/workflows/long-names-1/fork", json=body), 201)
            body = {"workflowIds": ["long-names-1"], "fromStepName": LONG_STEP_NAME, "queueName": "parts",
                    "queuePartitionKey": LONG_PARTITION_KEY}  # fmt: skip
            (by_step,) = ok(api.post(f"{LEDGER}/workflows/bulk-fork-from-failure", json=body))["workflowIds"]
            made.append(by_step)
        for workflow_id in ("long-names-fork", by_step):
            assert_eventually(lambda: db_status(world, workflow_id) == "SUCCESS", 20, what=workflow_id)  # noqa: B023
            assert query(
                world.sysdb,
                "SELECT name, queue_partition_key, forked_from FROM dbos.workflow_status WHERE workflow_uuid = %s",
                workflow_id,
            ) == [(LONG_WORKFLOW_NAME, LONG_PARTITION_KEY, "long-names-1")]
    finally:
        client.delete_workflows(made)
        client.delete_queue("parts")
        client.destroy()


def test_an_app_defined_name_past_the_bound_is_refused_with_a_422_naming_it(world: World) -> None:
    """One byte past the bound, in characters of two bytes: a clear 422 naming the member, from a
    body's name, a body's list of names and a query; an app's version stays bounded at 256
    characters, as the handshake bounds an executor's."""
    too_long = "é" * (MAX_APP_DEFINED_NAME_BYTES // 2) + "x"
    bound = f"{MAX_APP_DEFINED_NAME_BYTES} bytes"
    with world.api() as api:
        for path, body, location in (
            ("/workflows/search", {"workflowName": ["job", too_long]}, "body.workflowName.1"),
            ("/workflows/search", {"user": [too_long]}, "body.user.0"),
            ("/workflows/aggregates", {"groupByStatus": True, "user": [too_long]}, "body.user.0"),
            ("/steps/aggregates", {"groupByStatus": True, "stepName": [too_long]}, "body.stepName.0"),
            ("/workflows/done-1/fork", {"queuePartitionKey": too_long}, "body.queuePartitionKey"),
            ("/workflows/bulk-fork-from-failure", {"workflowIds": ["failed-1"], "fromStepName": too_long},
             "body.fromStepName"),
            ("/workflows/search", {"appVersion": ["v" * 257]}, "body.appVersion.0"),
        ):  # fmt: skip
            refused = problem(api.post(f"{LEDGER}{path}", json=body), 422)
            assert [e["location"] for e in refused["errors"]] == [location], refused
            assert location.startswith("body.appVersion") or bound in refused["detail"], refused
        for path in ("/workflows", "/schedules"):
            refused = problem(api.get(f"{LEDGER}{path}", params={"workflowName": too_long}), 422)
            assert [e["location"] for e in refused["errors"]] in (["query.workflowName"], ["query.workflowName.0"])
            assert bound in refused["detail"], refused
