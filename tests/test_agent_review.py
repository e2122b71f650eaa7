"""An agent's review: Relay driven as an AI agent drives it, through dbos-mcp 0.8.0 and Conductor's
v2 HTTP API, each answer checked against what Conductor's documentation promises
(dbos-docs ``docs/production/conductor-api.md``) and what dbos-mcp's tools tell the agent.

Each test failed on the code before its fix (a reviewer's, after stop 36): each names the document
line it relies on and the answer an agent would have been misled by. One world for the module:
one Relay, one real DBOS 3.2 executor of ``ledger`` (harness/workflow_app.py, seeding its
fixtures), and dbos-mcp in its own virtual environment (tests/test_dbos_mcp.py's driver); the
executor's system database is read directly, never through Relay.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from harness.executors import ExecutorProcess
from harness.keys import API_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.waiting import assert_eventually
from harness.web import TLS
from tests.test_dbos_mcp import McpDriver, SystemDatabase, mcp_python

APP = "ledger"
LEDGER = f"/apps/{APP}"
MISSING = "no-such-workflow"


@dataclass
class World:
    relay: RelayProcess
    sysdb: SystemDatabase
    executor: ExecutorProcess
    mcp: McpDriver

    def api(self) -> httpx.Client:
        return self.relay.api("acme")


@pytest.fixture(scope="module")
def world(
    postgres: Postgres, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[World]:
    python = mcp_python()
    workdir = tmp_path_factory.mktemp("agent-review")
    failed_before = request.session.testsfailed
    with ExitStack() as stack:
        relay = RelayProcess(workdir, postgres.create_database("relay"), relay_yaml(free_port())).start()
        stack.callback(relay.stop)
        sysdb = SystemDatabase(postgres.create_database("sys"))
        env = {"RELAY_TEST_SEED": "1"}
        executor = ExecutorProcess(workdir, sysdb.url, relay.conductor_url, module="harness.workflow_app", env=env)
        stack.callback(executor.stop)
        mcp = McpDriver(python, f"{relay.http}/conductor/v2", API_KEYS["acme"], "acme", workdir / "driver.log")
        stack.callback(mcp.close)
        assert_eventually(lambda: sysdb.workflows() != [], 20, what="the fixtures seeded")
        yield World(relay, sysdb, executor, mcp)
        if request.session.testsfailed > failed_before:
            print(f"--- driver ---\n{(workdir / 'driver.log').read_text(errors='replace')[-4000:]}")
            print(f"--- relay ---\n{relay.log()[-6000:]}")


def status_of(resp: httpx.Response) -> str:
    return f"{resp.request.method} {resp.request.url.path}: {resp.status_code} {resp.text[:300]}"


def cancels_audited(world: World, workflow_id: str) -> list[dict[str, Any]]:
    with world.api() as api:
        resp = api.get("/audit", params={"app": APP, "action": "workflow.cancel", "limit": 1000})
    assert resp.status_code == 200, status_of(resp)
    return [e for e in resp.json() if e["detail"].get("workflowIds") == [workflow_id]]


# -- actions on what does not exist ----------------------------------------------------------------


def test_cancelling_a_workflow_that_does_not_exist_is_a_404(world: World) -> None:
    """conductor-api.md, Errors: "`404` | No such organization, application, or resource", with the
    example detail "workflow 8f4a... not found". Relay passes on the SDK's silent no-op (DBOS 3.2's
    ``cancel_workflows`` updates no row and reports success) as 204, and audits it as a success: an
    agent told "cancelled" believes it stopped a workflow that was never there (a typo'd id)."""
    assert world.sysdb.workflow(MISSING) is None
    with world.api() as api:
        resp = api.post(f"{LEDGER}/workflows/{MISSING}/cancel")
    assert resp.status_code == 404, status_of(resp)
    assert resp.headers["content-type"] == "application/problem+json"
    assert MISSING in resp.json()["detail"]
    assert [e["detail"]["result"] for e in cancels_audited(world, MISSING)] == ["failure"]


def test_dbos_mcps_cancel_of_a_workflow_that_does_not_exist_fails(world: World) -> None:
    """dbos-mcp's cancel_workflow answers {"message": "Workflow cancelled"} whenever the HTTP call
    succeeds (it raises on a 4xx): so the agent reads "Workflow cancelled" for an id that exists
    nowhere. conductor-api.md, Errors: "`404` | No such organization, application, or resource"."""
    answer = world.mcp.attempt("cancel_workflow", application_name=APP, workflow_id="no-such-mcp-workflow")
    assert world.sysdb.workflow("no-such-mcp-workflow") is None
    assert not answer["ok"], f"dbos-mcp told the agent: {answer.get('result')}"
    assert answer["status"] == 404


def test_bulk_cancelling_only_workflows_that_do_not_exist_is_a_404(world: World) -> None:
    """conductor-api.md, Workflows: "The bulk variants take an array of workflow IDs and apply the
    same operation to each", and Errors: "`404` | No such ... resource". Relay's bulk-resume already
    answers 404 for an unknown id (the SDK checks); bulk-cancel of ids none of which exist is 204,
    and dbos-mcp's bulk_cancel_workflows then says "Cancelled 2 workflows"."""
    ids = ["no-such-bulk-1", "no-such-bulk-2"]
    with world.api() as api:
        resumed = api.post(f"{LEDGER}/workflows/bulk-resume", json={"workflowIds": ids})
        assert resumed.status_code == 404, status_of(resumed)  # as it is: the SDK says which is missing
        resp = api.post(f"{LEDGER}/workflows/bulk-cancel", json={"workflowIds": ids})
    assert resp.status_code == 404, status_of(resp)


def test_deleting_a_workflow_that_does_not_exist_is_a_404(world: World) -> None:
    """conductor-api.md, Errors: "`404` | No such organization, application, or resource". DBOS 3.2's
    ``delete_workflows`` deletes no row and reports success, which Relay serves as 204 (dbos-mcp's
    delete_workflow: "Workflow deleted"), while a GET of the same id is a 404."""
    with world.api() as api:
        assert api.get(f"{LEDGER}/workflows/{MISSING}").status_code == 404
        resp = api.delete(f"{LEDGER}/workflows/{MISSING}")
    assert resp.status_code == 404, status_of(resp)


def test_resuming_a_workflow_that_already_succeeded_is_refused(world: World) -> None:
    """workflow-management.md: "You can resume any `ENQUEUED`, `DELAYED`, `CANCELLED` or
    `MAX_RECOVERY_ATTEMPTS_EXCEEDED` workflow"; dbos-mcp's resume_workflow tells the agent "You cannot
    resume a workflow in any other state". Relay answers 204 for done-1 (SUCCESS): the SDK's update
    skips it and reports success, so dbos-mcp says "Workflow resumed" and nothing ran. A client error
    (4xx, a problem saying the workflow is SUCCESS) is what the agent needs."""
    assert world.sysdb.status("done-1") == "SUCCESS"
    with world.api() as api:
        resp = api.post(f"{LEDGER}/workflows/done-1/resume")
    assert world.sysdb.status("done-1") == "SUCCESS"
    assert 400 <= resp.status_code < 500, status_of(resp)
    assert resp.headers["content-type"] == "application/problem+json"
    assert "SUCCESS" in resp.json()["detail"]


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_pausing_or_resuming_a_schedule_that_does_not_exist_is_a_404(world: World, action: str) -> None:
    """conductor-api.md, Errors: "`404` | No such organization, application, or resource". Relay
    answers 404 to a GET, trigger or backfill of an unknown schedule, but 204 to its pause and resume
    (the SDK updates no row and says success): dbos-mcp's pause_schedule then reports "Schedule
    paused" for a misspelt name while the real schedule keeps firing."""
    with world.api() as api:
        assert api.get(f"{LEDGER}/schedules/no-such-schedule").status_code == 404
        resp = api.post(f"{LEDGER}/schedules/no-such-schedule/{action}")
    assert resp.status_code == 404, status_of(resp)


def test_setting_a_version_that_does_not_exist_as_the_latest_is_a_404(world: World) -> None:
    """conductor-api.md, Applications: "Set latest version | PATCH .../versions/latest", and Errors:
    "`404` | No such organization, application, or resource". Relay answers 204 for a version name
    the app never had (the SDK's update matches no row), so dbos-mcp's set_latest_application_version
    says "Latest version set to v9" and nothing changed."""
    versions = [r["version_name"] for r in world.sysdb.rows("SELECT version_name FROM dbos.application_versions")]
    assert "v9" not in versions
    with world.api() as api:
        resp = api.patch(f"{LEDGER}/versions/latest", json={"versionName": "v9"})
    assert resp.status_code == 404, status_of(resp)


# -- shapes ----------------------------------------------------------------------------------------


def test_an_apps_executor_timeout_is_an_integer_as_conductors_application_has_it(world: World) -> None:
    """dbos-mcp's list_applications documents Conductor's Application as "executorTimeoutSecs (int)".
    relay.yaml gives ledger ``executorTimeoutSecs: 30`` (an integer), and Relay serves ``30.0``: a
    generated client that decodes the field as an integer (dbosctl, in Go) refuses the number. A
    fractional setting is Relay's own (README); a whole one should be served whole."""
    with world.api() as api:
        resp = api.get(LEDGER)
    assert resp.status_code == 200, status_of(resp)
    raw = json.loads(resp.text, parse_float=lambda text: ("float", text))
    assert raw["executorTimeoutSecs"] == 30, f"served as {raw['executorTimeoutSecs']}"


# -- Conductor's routes ------------------------------------------------------------------------------


def test_conductors_audit_log_route_is_served(world: World) -> None:
    """conductor-api.md, Alerting and audit logs: "List audit logs | `GET /v2/orgs/{orgName}/audit-logs`"
    and "Audit log listing accepts `startTime`, `endTime`, `operation`, `subject`, and `target`
    filters alongside `limit` and `offset`"; the contract: "Where Relay and DBOS Conductor offer the
    same thing, Relay uses Conductor's names, paths and shapes". Relay keeps an audit log but serves it
    only at ``/audit``: Conductor's path is a 404."""
    with world.api() as api:
        assert api.post(f"{LEDGER}/workflows/waiting-1/cancel").status_code == 204
        resp = api.get("/audit-logs", params={"operation": "workflow.cancel", "limit": 100})
    assert resp.status_code == 200, status_of(resp)
    entries = resp.json()
    assert entries and {e["operation"] for e in entries} == {"workflow.cancel"}


def test_conductors_audit_log_listing_filters_and_shapes_as_documented(world: World) -> None:
    """audit-logs.md: entries newest first, each with ``id``, ``emitTime`` (``emit_time`` there),
    ``operation``, ``status``, ``subject`` {type, id, display}, ``target`` {type, id} (omitted when
    none applies), ``sourceIp`` and ``details`` (``application_name``, ``workflow_ids`` on bulk
    operations); ``start`` inclusive,
    ``end`` exclusive (``startTime``/``endTime`` in conductor-api.md); ``operation`` by Conductor's
    names (``token.create`` is Relay's ``token.created``); ``subject`` by the key's name; ``target``
    by the resource's id. A key scoped to an app reads only that app's entries."""
    with world.api() as api:
        assert api.post(f"{LEDGER}/workflows/waiting-1/cancel").status_code == 204
        assert api.post(f"{LEDGER}/workflows/bulk-cancel", json={"workflowIds": ["waiting-1"]}).status_code == 204
        body = {"permissions": ["application.read", "organization.read"], "appNames": ["elsewhere"]}
        made = api.post("/tokens/audit-scoped", json=body)
        assert made.status_code == 201, status_of(made)
        scoped_key = made.json()["token"]

        def entries(**params: Any) -> list[dict[str, Any]]:
            resp = api.get("/audit-logs", params=params)
            assert resp.status_code == 200, status_of(resp)
            return list(resp.json())

        single, bulk = entries(operation="workflow.cancel")[0], entries(operation="workflow.bulk_cancel")[0]
        [created] = entries(operation="token.create", target="audit-scoped")
        assert created["subject"]["type"] == "api_key" and created["subject"]["id"] == created["subject"]["display"]
        assert created["target"] == {"type": "token", "id": "audit-scoped"}
        assert created["status"] == "success"
        assert single["target"] == {"type": "workflow", "id": "waiting-1"}
        assert single["status"] == "success" and single["details"]["application_name"] == APP
        assert "target" not in bulk and bulk["details"]["workflow_ids"] == ["waiting-1"]
        assert int(created["id"]) > int(bulk["id"]) > int(single["id"])
        assert single["sourceIp"] == "127.0.0.1", "the address the request came from"

        newest = entries(limit=1000)
        assert [int(e["id"]) for e in newest] == sorted((int(e["id"]) for e in newest), reverse=True)
        by_target = entries(target="waiting-1")
        assert {bulk["id"], single["id"]} <= {e["id"] for e in by_target}
        assert {e["operation"] for e in by_target} <= {"workflow.cancel", "workflow.bulk_cancel"}
        subject = created["subject"]["id"]
        mine = entries(subject=subject, limit=1000)
        assert mine and {e["subject"]["id"] for e in mine} == {subject}
        assert entries(subject="nobody-of-that-name") == []
        at = created["emitTime"]
        assert created["id"] not in {e["id"] for e in entries(endTime=at)}, "endTime is exclusive"
        assert created["id"] in {e["id"] for e in entries(startTime=at)}, "startTime is inclusive"
        assert api.get("/audit-logs", params={"startTime": "yesterday"}).status_code == 422
        assert api.get("/audit-logs", params={"limit": 1001}).status_code == 422

    with world.relay.api("acme", key=scoped_key) as scoped:
        resp = scoped.get("/audit-logs")
    assert resp.status_code == 200, status_of(resp)
    assert resp.json() == [], "a key scoped to another app read ledger's entries"


def test_later_pages_of_the_audit_log_read_with_until_id_are_not_shifted_by_new_entries(world: World) -> None:
    """Offset paging over a log that grows at the top repeats rows: the entries written between
    page one and page two push page one's last rows onto page two. ``untilId`` (the first page's
    newest id) reads page two as of page one; the console's audit pages pass it."""

    def cancel() -> None:
        with world.api() as api:
            assert api.post(f"{LEDGER}/workflows/waiting-1/cancel").status_code == 204

    def page(**params: Any) -> list[int]:
        with world.api() as api:
            resp = api.get("/audit", params={"app": APP, "sortDesc": "true", "limit": 2, **params})
        assert resp.status_code == 200, status_of(resp)
        return [e["id"] for e in resp.json()]

    for _ in range(4):
        cancel()
    first = page()
    expected_second = page(offset=2)
    assert len(first) == len(expected_second) == 2 and max(expected_second) < min(first)
    cancel()
    cancel()
    assert page(offset=2) == first, "without untilId, page two is page one again after two new entries"
    assert page(offset=2, untilId=first[0]) == expected_second
    with world.api() as api:
        assert api.get("/audit", params={"untilId": 0}).status_code == 422


def test_a_status_no_workflow_has_is_refused_not_answered_with_nothing(world: World) -> None:
    """An agent asking for ``status=FAILED`` (DBOS says ERROR) got ``[]`` and reported "no failures";
    the search and the aggregates took it the same way. A status no workflow can have is a 422 that
    names the statuses there are (the document lists them as an enum)."""
    with world.api() as api:
        listed = api.get(f"{LEDGER}/workflows", params={"status": "FAILED"})
        searched = api.post(f"{LEDGER}/workflows/search", json={"status": ["ERROR", "FAILED"]})
        counted = api.post(f"{LEDGER}/workflows/aggregates", json={"groupByStatus": True, "status": ["FAILED"]})
        fine = api.get(f"{LEDGER}/workflows", params={"status": "ERROR"})
    document = httpx.get(f"{world.relay.http}/v2/openapi.json", verify=TLS)
    assert document.status_code == 200, status_of(document)
    for resp in (listed, searched, counted):
        assert resp.status_code == 422, status_of(resp)
        assert "FAILED" in resp.text and "MAX_RECOVERY_ATTEMPTS_EXCEEDED" in resp.text, resp.text
    assert fine.status_code == 200 and {w["status"] for w in fine.json()} == {"ERROR"}
    schema = document.json()["components"]["schemas"]["WorkflowSearch"]["properties"]["status"]
    assert "FAILED" not in json.dumps(schema) and "MAX_RECOVERY_ATTEMPTS_EXCEEDED" in json.dumps(schema)


def test_a_filter_the_plain_list_does_not_take_is_refused_not_ignored(world: World) -> None:
    """``GET .../workflows?startTime=2099-01-01T00:00:00Z`` listed every workflow: the list takes
    ``status``, ``workflowName``, ``limit``, ``offset``, ``sortDesc``, ``loadInput`` and ``loadOutput``,
    and dropped the rest silently, so an agent believed it had filtered. It is a 422 that says so and
    points to the search, which takes every filter."""
    with world.api() as api:
        resp = api.get(f"{LEDGER}/workflows", params={"startTime": "2099-01-01T00:00:00Z"})
        searched = api.post(f"{LEDGER}/workflows/search", json={"startTime": "2099-01-01T00:00:00Z"})
    assert resp.status_code == 422, status_of(resp)
    assert "startTime" in resp.json()["detail"] and "workflows/search" in resp.json()["detail"]
    assert searched.status_code == 200 and searched.json() == []


def test_a_fork_onto_a_version_the_app_never_had_is_a_404(world: World) -> None:
    """A fork (or a bulk fork from failure) onto ``appVersion: "v9"``, a version no executor of the
    app runs or ran, answered 201: the new workflow waited, enqueued, for an executor of v9 that
    never comes, and the agent was told it was forked. conductor-api.md, Errors: "`404` | No such
    organization, application, or resource"."""
    versions = [r["version_name"] for r in world.sysdb.rows("SELECT version_name FROM dbos.application_versions")]
    assert "v9" not in versions and versions
    with world.api() as api:
        refused = api.post(f"{LEDGER}/workflows/done-1/fork", json={"appVersion": "v9", "newWorkflowId": "never-1"})
        bulk = api.post(
            f"{LEDGER}/workflows/bulk-fork-from-failure",
            json={"workflowIds": ["failed-1"], "fromLastFailure": True, "appVersion": "v9"},
        )
        fine = api.post(f"{LEDGER}/workflows/done-1/fork", json={"appVersion": versions[0], "newWorkflowId": "fork-ok"})
    assert refused.status_code == 404 and "v9" in refused.json()["detail"], status_of(refused)
    assert bulk.status_code == 404, status_of(bulk)
    assert fine.status_code == 201, status_of(fine)
    assert world.sysdb.workflow("never-1") is None
