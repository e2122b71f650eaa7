"""Requests the HTTP API must refuse by itself, as a client's mistake (4xx), rather than pass them
on to the database or an executor and answer 5xx; and requests it must pass on in a form the
executor reads. Found by fuzzing the OpenAPI document
(tests/test_openapi_fuzz.py); each case here is one it found."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from urllib.parse import quote

import httpx
import pytest
from pydantic import TypeAdapter, ValidationError

from harness.executors import ExecutorProcess
from harness.keys import API_KEYS
from harness.postgres import Postgres
from harness.relay import RelayProcess
from harness.web import TLS
from relay.api import build_api
from relay.api.shapes import Rfc3339
from relay.api.workflows import WorkflowSearch
from relay.core.times import sdk_time
from relay.store.db import Database
from relay_protocol import MAX_WORKFLOW_ID_BYTES

ADMIN = {"Authorization": f"Bearer {API_KEYS['acme']}"}


@pytest.fixture(scope="module")
def executor(relay: RelayProcess, postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real executor of ``ledger`` (with harness/workflow_app.py's workflows), so that requests
    reach as far as they can."""
    workdir, sysdb = tmp_path_factory.mktemp("refusals-executor"), postgres.create_database("sys")
    env = {"RELAY_TEST_SEED": "1"}
    executor = ExecutorProcess(workdir, sysdb, relay.conductor_url, module="harness.workflow_app", env=env)
    yield executor.executor_id
    executor.stop()


@pytest.fixture
def api(relay: RelayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=relay.http, headers=ADMIN, timeout=10, verify=TLS) as client:
        yield client


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("TRACE", "/healthz", "GET, HEAD"),  # every GET route answers HEAD too (relay.api.HeadAsGet)
        ("POST", "/v2/orgs/acme/apps", "GET, HEAD"),
        ("GET", "/v2/orgs/acme/apps/ledger/workflows/abc/cancel", "POST"),
        ("HEAD", "/v2/orgs/acme/apps/ledger/workflows/abc/cancel", "POST"),  # no HEAD where there is no GET
        ("POST", "/v2/orgs/acme/apps/ledger", "GET, HEAD, PUT, PATCH, DELETE"),  # four routes share the path
        ("PUT", "/conductor/v2/orgs/acme/tokens/abc", "POST, PATCH, DELETE"),
    ],
)
def test_a_method_not_allowed_says_which_are(api: httpx.Client, method: str, path: str, allowed: str) -> None:
    resp = api.request(method, path)
    assert resp.status_code == 405, resp.text
    assert resp.headers["content-type"] == "application/problem+json"
    assert resp.headers["allow"] == allowed, "RFC 9110: a 405 lists the methods of the resource"


@pytest.mark.parametrize("path", ["/apps", "/apps/ledger/executors", "/apps/ledger/recoveries", "/tokens", "/audit"])
def test_an_offset_past_a_bigint_is_refused(api: httpx.Client, path: str) -> None:
    assert api.get(f"/v2/orgs/acme{path}", params={"offset": 2**53 - 1}).status_code == 200
    for offset in (2**53, 2**63):  # past what JSON carries exactly, past a bigint
        resp = api.get(f"/v2/orgs/acme{path}", params={"offset": offset})
        assert resp.status_code == 422, resp.text  # not 503 "database error: bigint out of range"
        assert resp.json()["errors"][0]["location"] == "query.offset"


Json = dict[str, object]
TOO_BIG = 2**63
TOO_LONG = "x" * 257  # the protocol carries names of up to 256 characters
# and workflow ids, queues' and schedules' names of up to 16 KiB in UTF-8: 8,193 characters of two
# bytes are past it.
TOO_MANY_BYTES = "é" * (MAX_WORKFLOW_ID_BYTES // 2 + 1)


@pytest.mark.parametrize(
    ("method", "path", "body", "params"),
    [
        ("GET", "/workflows", None, {"offset": TOO_BIG}),
        ("GET", "/workflows/abc/steps", None, {"offset": TOO_BIG}),
        ("POST", "/workflows/search", {"offset": TOO_BIG}, None),
        ("POST", "/workflows/search", {"workflowName": ["a\u0000b"]}, None),
        ("POST", "/workflows/search", {"workflowIds": [TOO_MANY_BYTES]}, None),
        ("POST", "/workflows/search", {"attributes": {"k": "\u0000"}}, None),
        ("POST", "/workflows/aggregates", {"groupByStatus": True, "timeBucketSizeMs": TOO_BIG}, None),
        ("POST", "/steps/aggregates", {"groupByStatus": True, "timeBucketSizeMs": TOO_BIG}, None),
        ("POST", "/workflows/abc/fork", {"startStep": TOO_BIG}, None),
        ("POST", "/workflows/abc/resume", {"queueName": TOO_MANY_BYTES}, None),
        ("POST", "/workflows/bulk-cancel", {"workflowIds": ["a\u0000"]}, None),
        ("POST", "/workflows/bulk-fork-from-failure", {"workflowIds": ["a"], "fromStep": TOO_BIG}, None),
        ("GET", f"/workflows/{quote(TOO_MANY_BYTES, safe='')}", None, None),
        ("GET", f"/schedules/{quote(TOO_MANY_BYTES, safe='')}", None, None),
        ("PATCH", "/versions/latest", {"versionName": TOO_LONG}, None),
    ],
)
def test_what_the_protocol_cannot_carry_is_refused(
    api: httpx.Client,
    executor: str,
    method: str,
    path: str,
    body: dict[str, object] | None,
    params: dict[str, int] | None,
) -> None:
    resp = api.request(method, f"/v2/orgs/acme/apps/ledger{path}", json=body, params=params)
    assert resp.status_code == 422, resp.text  # not 500: the request never leaves Relay
    assert resp.headers["content-type"] == "application/problem+json"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"startTime": "0001-01-01T00:00:00Z"}, 200),  # the executor read "1-01-01T..." and failed: 502
        ({"startTime": "0999-12-31T23:00:00+01:00", "endTime": "9999-12-31T23:59:59Z"}, 200),
        ({"startTime": "0001-01-01T00:00:00+01:00"}, 200),  # year 0 in UTC: a 500 before; the first time
        ({"endTime": "9999-12-31T23:59:59-01:00"}, 200),  # year 10000: the last time
        ({"startTime": 0}, 422),  # RFC 3339, not seconds
        ({"startTime": "2026-01-01T00:00:00"}, 422),  # RFC 3339 has an offset: not read in the server's zone
        ({"endTime": "2026-01-01T00:00:00.5"}, 422),
    ],
)
def test_times_reach_the_executor_in_a_form_it_reads_or_are_refused(
    api: httpx.Client, executor: str, body: Json, status: int
) -> None:
    resp = api.post("/v2/orgs/acme/apps/ledger/workflows/search", json=body)
    assert resp.status_code == status, resp.text


def test_a_time_without_offset_is_refused_whatever_the_servers_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    """It was read in the Relay process's zone: 00:00 reached the executor as 05:00 UTC in New York."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        for naive in ("2026-01-01T00:00:00", "2026-01-01 00:00", datetime(2026, 1, 1)):
            with pytest.raises(ValidationError, match="needs its UTC offset"):
                WorkflowSearch.model_validate({"startTime": naive})
            with pytest.raises(ValidationError, match="needs its UTC offset"):
                TypeAdapter(Rfc3339).validate_python(naive)  # a query's time (the audit's since)
        sent = WorkflowSearch.model_validate({"startTime": "2026-01-01T00:00:00-05:00"}).body().start_time
        assert sent == "2026-01-01T05:00:00.000000+00:00"
    finally:
        monkeypatch.undo()
        time.tzset()


def test_sdk_time_is_what_python_3_10_reads() -> None:
    for when in (
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(999, 12, 31, 23, 59, 59, 5, tzinfo=UTC),
        datetime(2026, 5, 1, 12, 0, tzinfo=timezone(timedelta(hours=2))),
    ):
        text = sdk_time(when)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00", text), text
        assert datetime.fromisoformat(text) == when


@pytest.mark.parametrize("path", ["/workflows/aggregates", "/steps/aggregates"])
def test_an_aggregate_groups_by_something(api: httpx.Client, executor: str, path: str) -> None:
    assert api.post(f"/v2/orgs/acme/apps/ledger{path}").status_code == 422  # the body says what to group by
    for nothing in ({}, {"selectCount": True}, {"groupByStatus": False, "timeBucketSizeMs": None}):
        resp = api.post(f"/v2/orgs/acme/apps/ledger{path}", json=nothing)
        assert resp.status_code == 422, resp.text  # the SDK's ValueError: a 502, with its traceback, before
        assert "nothing to group by" in resp.json()["detail"]
    resp = api.post(f"/v2/orgs/acme/apps/ledger{path}", json={"timeBucketSizeMs": 60_000})
    assert resp.status_code == 200, resp.text  # a time bucket is a group


@pytest.mark.parametrize(
    "serialized", ["0", "not base64!", base64.b64encode(b"a pickle, but not gzipped").decode(), ""]
)
def test_an_import_is_what_an_export_gives(api: httpx.Client, executor: str, serialized: str) -> None:
    resp = api.post("/v2/orgs/acme/apps/ledger/workflows/import", json={"serializedWorkflow": serialized})
    assert resp.status_code == 422, resp.text  # the executor failed to unpack it: a 502, before
    assert resp.json()["errors"][0]["location"] == "body.serializedWorkflow"


def test_importing_a_workflow_that_exists_is_a_conflict(api: httpx.Client, executor: str) -> None:
    exported = api.get("/v2/orgs/acme/apps/ledger/workflows/done-1/export")
    assert exported.status_code == 200, exported.text
    resp = api.post("/v2/orgs/acme/apps/ledger/workflows/import", json=exported.json())
    assert resp.status_code == 409, resp.text  # the executor's UniqueViolation: a 502 with its traceback, before
    # Said as Conductor would, not PostgreSQL's "DETAIL:  Key (workflow_uuid)=(done-1) already exists."
    assert resp.json()["detail"] == "a workflow with id done-1 already exists"
    forked = api.post("/v2/orgs/acme/apps/ledger/workflows/failed-1/fork", json={"newWorkflowId": "done-1"})
    assert forked.status_code == 409, forked.text
    assert forked.headers["content-type"] == "application/problem+json"
    assert forked.json()["detail"] == "a workflow with id done-1 already exists"
    assert forked.json()["error"]["code"] == "conflict"


@pytest.mark.parametrize("count", [1, 400])
def test_resuming_workflows_that_do_not_exist_is_a_404_however_many(
    api: httpx.Client, executor: str, count: int
) -> None:
    ids = [f"nope-{i}" for i in range(count)]
    resp = api.post("/v2/orgs/acme/apps/ledger/workflows/bulk-resume", json={"workflowIds": ids})
    assert resp.status_code == 404, resp.text  # 400 ids: 502, the error cut before it said "non-existent"
    # What is missing, not "Traceback" (Relay reads the ids first: DBOS would cancel none silently).
    detail = resp.json()["detail"]
    assert detail.startswith("workflow nope-0 not found" if count == 1 else "workflows nope-0, nope-1,"), detail
    assert "Traceback" not in detail


def test_forking_from_a_step_name_the_workflow_lacks_is_a_404(api: httpx.Client, executor: str) -> None:
    body = {"workflowIds": ["done-1"], "fromStepName": "no-such-step"}
    resp = api.post("/v2/orgs/acme/apps/ledger/workflows/bulk-fork-from-failure", json=body)
    assert resp.status_code == 404, resp.text  # 502, before
    assert resp.json()["detail"] == "Exception: Workflow done-1 has no step named 'no-such-step'"


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/apps/ledger/workflows", {"status": "a\x00b"}),  # a 500: the handler's own model refused it
        ("/apps/ledger/workflows", {"workflowName": "\x00"}),
        ("/apps/ledger/schedules", {"workflowName": "\x00"}),
        ("/apps/ledger/recoveries", {"executorId": "\x00"}),  # a 500: PostgreSQL refused it
        ("/audit", {"executorId": "\x00"}),
        ("/audit", {"app": "ledger\x00"}),
    ],
)
def test_a_nul_in_a_query_is_refused(api: httpx.Client, executor: str, path: str, params: dict[str, str]) -> None:
    resp = api.get(f"/v2/orgs/acme{path}", params=params)
    assert resp.status_code == 422, resp.text
    assert resp.headers["content-type"] == "application/problem+json"


@pytest.mark.parametrize("app", ["a\x00", "\udc00"])
@pytest.mark.parametrize("name", ["odd-app", "ops"])  # "ops": taken by relay.yaml's key
def test_a_key_for_an_app_name_postgresql_cannot_store_is_refused(api: httpx.Client, name: str, app: str) -> None:
    body, headers = json.dumps({"appNames": [app]}).encode(), {"content-type": "application/json"}
    resp = api.post(f"/v2/orgs/acme/tokens/{name}", content=body, headers=headers)
    assert resp.status_code == 422, resp.text  # 503 "database error", before


PROBES = {
    # An interval PostgreSQL cannot compute (what minIntervalSecs: 1e999 gave, before its bound).
    "interval": ("SELECT now() - make_interval(secs => %s)", float("inf")),
    # A NUL in a text: refused by psycopg itself, before it is sent.
    "nul": ("SELECT %s::text", "a\x00b"),
    # Not the request's values: the database's (or Relay's) trouble, a 503 as before.
    "no-table": ("SELECT * FROM no_such_table WHERE id = %s", 1),
    # The connection lost under the statement (here ended by the server): unreachable, for now.
    "lost": ("SELECT pg_terminate_backend(pg_backend_pid()) AND %s", True),
}
UNAVAILABLE = {
    "no-table": "a statement of Relay's database failed; the instance's log says why",
    "lost": "Relay's database is unreachable; the instance's log says why",
}


@pytest.mark.parametrize(("probe", "status"), [("interval", 422), ("nul", 422), ("no-table", 503), ("lost", 503)])
def test_a_value_postgresql_refuses_is_a_422_that_quotes_no_sql(relay_db: str, probe: str, status: int) -> None:
    """Whatever a handler passes on that PostgreSQL refuses as data (psycopg's DataError) is the
    client's to correct, the same at every try: a 422 whose detail names the problem and quotes no
    SQL, not a 503 "database unavailable". Other database errors stay 503. The handler here stands
    for any route (those known to pass such values on now refuse them first)."""
    api = build_api(None)

    @api.get("/probe/{name}")
    async def run(name: str) -> None:
        db = Database(relay_db, min_size=1, max_size=1)
        await db.open()
        try:
            async with db.connection() as conn:
                statement, value = PROBES[name]
                await conn.execute(statement, (value,))
        finally:
            await db.close()

    async def request() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://relay") as client:
            return await client.get(f"/probe/{probe}")

    resp = asyncio.run(request())
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/problem+json"
    detail = resp.json()["detail"]
    if status == 503:
        # The database's words (here the table's name; elsewhere a host, a constraint) are the log's.
        assert detail == UNAVAILABLE[probe], detail
    if status == 422:
        assert detail.startswith("a value of the request was refused: ") and len(detail) > 40, detail
        assert "SELECT" not in detail and "make_interval" not in detail and "LINE" not in detail, detail
