"""Refused attempts at audited operations are audited as failures (dbos-docs audit-logs.md: an
entry's ``status`` is "`success`, or `failure` if the operation was rejected or errored (for
example, a denied attempt or invalid request)"), bounded per key and operation.

A real Relay (its own PostgreSQL database), called over HTTP.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from harness.keys import API_KEYS, VIEWER_KEYS
from harness.pgserver import PostgresServer
from harness.ports import free_port
from harness.relay import RelayProcess, relay_yaml
from harness.waiting import assert_eventually
from relay.api.refusals import MAX_REFUSALS_PER_MINUTE, RefusalBudget
from relay_protocol import MAX_WORKFLOW_ID_BYTES

ORG = "/v2/orgs/acme"
APP = f"{ORG}/apps/ledger"


def make_key(relay: RelayProcess, name: str, permissions: list[str], apps: list[str] | None = None) -> str:
    body: dict[str, Any] = {"permissions": permissions}
    if apps is not None:
        body["appNames"] = apps
    with relay.client() as admin:
        made = admin.post(f"{ORG}/tokens/{name}", json=body)
        assert made.status_code == 201, made.text
        token: str = made.json()["token"]
        return token


def entries(relay: RelayProcess, **params: str) -> list[dict[str, Any]]:
    with relay.client() as admin:
        resp = admin.get(f"{ORG}/audit-logs", params={**params, "limit": "1000"})
        assert resp.status_code == 200, resp.text
        found: list[dict[str, Any]] = resp.json()
        return found


def relay_entries(relay: RelayProcess, action: str) -> list[dict[str, Any]]:
    with relay.client() as admin:
        resp = admin.get(f"{ORG}/audit", params={"action": action, "limit": "10000"})
        assert resp.status_code == 200, resp.text
        found: list[dict[str, Any]] = resp.json()
        return found


def refused_entry(relay: RelayProcess, operation: str, subject: str, target: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        hits = entries(relay, operation=operation, subject=subject, target=target)
        return hits[0] if hits else None

    return assert_eventually(found, 20, what=f"a {operation} entry by {subject} on {target}")


def test_a_denied_write_is_audited_as_a_failure(relay: RelayProcess) -> None:
    """A key lacking application.write cancels a workflow (403): the attempt is in the audit log,
    ``status: failure``, with its subject, operation, target and reason; the key's secret is not."""
    viewer = VIEWER_KEYS["acme"]
    with relay.client(viewer) as api:
        refused = api.post(f"{APP}/workflows/wf-denied/cancel")
        assert refused.status_code == 403, refused.text
    entry = refused_entry(relay, "workflow.cancel", "view", "wf-denied")
    assert entry["status"] == "failure"
    assert entry["subject"] == {"type": "api_key", "id": "view", "display": "view"}
    assert entry["target"] == {"type": "workflow", "id": "wf-denied"}
    # Written after the answer, by a task of its own: the address of the refused request still.
    assert entry["sourceIp"] == "127.0.0.1"
    assert entry["details"]["application_name"] == "ledger"
    assert entry["details"]["status"] == 403
    assert entry["details"]["code"] == "forbidden"
    assert "application.write" in entry["details"]["error"]
    assert viewer not in json.dumps(entry)
    [row] = [r for r in relay_entries(relay, "workflow.cancel") if r["detail"].get("workflowIds") == ["wf-denied"]]
    assert row["actor"] == "api:view" and row["app"] == "ledger"
    assert row["detail"]["result"] == "failure"


def test_a_key_outside_its_apps_and_a_token_it_may_not_make_are_audited(relay: RelayProcess) -> None:
    """403 for an app outside the key's scope (a schedule's pause) and for a permission the key
    lacks on Conductor's ``token.create`` (Relay's ``token.created``)."""
    scoped = make_key(relay, "scoped-writer", ["application.read", "application.write"], ["other-app"])
    with relay.client(scoped) as api:
        assert api.post(f"{APP}/schedules/nightly/pause").status_code == 403
        assert api.post(f"{ORG}/tokens/sneaky", json={"permissions": ["token.write"]}).status_code == 403
    paused = refused_entry(relay, "schedule.pause", "scoped-writer", "nightly")
    assert paused["status"] == "failure" and paused["target"] == {"type": "schedule", "id": "nightly"}
    token = refused_entry(relay, "token.create", "scoped-writer", "sneaky")
    assert token["status"] == "failure" and token["target"] == {"type": "token", "id": "sneaky"}
    assert token["details"]["code"] == "forbidden"


def test_an_invalid_request_is_audited_without_its_body(relay: RelayProcess) -> None:
    """422 for a body Relay refuses: the entry names the schedule and the refusal, not the body."""
    with relay.client() as api:
        refused = api.post(f"{APP}/schedules/weekly/backfill", json={"secret-looking": "body-text-xyz"})
        assert refused.status_code == 422, refused.text
    entry = refused_entry(relay, "schedule.backfill", "ops", "weekly")
    assert entry["status"] == "failure"
    assert entry["details"]["status"] == 422 and entry["details"]["code"] == "invalid_request"
    text = json.dumps(entry)
    assert "body-text-xyz" not in text and "secret-looking" not in text


def test_another_orgs_key_is_audited_in_its_own_org(relay: RelayProcess) -> None:
    """globex's key cancels in acme (403): the attempt is in globex's log (``detail.org``), and acme's
    log names no key of another org."""
    with relay.client(API_KEYS["globex"]) as api:
        assert api.post(f"{APP}/workflows/wf-cross-org/cancel").status_code == 403

    def in_globex() -> list[dict[str, Any]] | None:
        resp = api_globex.get("/v2/orgs/globex/audit-logs", params={"target": "wf-cross-org"})
        assert resp.status_code == 200, resp.text
        found: list[dict[str, Any]] = resp.json()
        return found or None

    with relay.client(API_KEYS["globex"]) as api_globex:
        [entry] = assert_eventually(in_globex, 20, what="the attempt in globex's log")
    assert entry["status"] == "failure" and entry["details"]["org"] == "acme"
    assert "application_name" not in entry["details"]
    assert entries(relay, target="wf-cross-org") == []


def test_a_refused_read_and_a_request_without_a_valid_key_are_not_audited(relay: RelayProcess) -> None:
    """A GET refused (403: an export needs application.write) and writes with no key or a wrong one
    (401) leave no entry; a refused write after them does (so the absence is not a delay)."""
    viewer = VIEWER_KEYS["acme"]
    with relay.client(viewer) as api:
        assert api.get(f"{APP}/workflows/wf-read/export").status_code == 403
    for key in (None, "not-a-key"):
        with relay.client(key) as anonymous:
            assert anonymous.post(f"{APP}/workflows/wf-nokey/cancel").status_code == 401
    with relay.client(viewer) as api:
        assert api.post(f"{APP}/workflows/wf-after/cancel").status_code == 403
    refused_entry(relay, "workflow.cancel", "view", "wf-after")
    assert entries(relay, target="wf-read") == []
    assert entries(relay, target="wf-nokey") == []


def test_a_flood_of_refused_attempts_writes_at_most_the_bound(relay: RelayProcess) -> None:
    """500 refused cancels from one key: at most MAX_REFUSALS_PER_MINUTE entries per minute the
    flood took (plus the minute it started in), every refusal still answered 403."""
    flooder = make_key(relay, "flooder", ["application.read"])
    started = time.monotonic()
    with relay.client(flooder) as api:
        for i in range(500):
            assert api.post(f"{APP}/workflows/flood-{i}/cancel").status_code == 403
    minutes = int((time.monotonic() - started) // 60) + 2  # the windows the flood may have touched
    first = refused_entry(relay, "workflow.cancel", "flooder", "flood-0")
    assert first["status"] == "failure"
    # A sentinel from another key, written after the flood, shows the flood's writes are done.
    with relay.client(VIEWER_KEYS["acme"]) as api:
        assert api.post(f"{APP}/workflows/after-flood/cancel").status_code == 403
    refused_entry(relay, "workflow.cancel", "view", "after-flood")
    flood = entries(relay, operation="workflow.cancel", subject="flooder")
    assert 1 <= len(flood) <= MAX_REFUSALS_PER_MINUTE * minutes, len(flood)


def test_a_successful_operation_is_audited_as_before(relay: RelayProcess) -> None:
    """A change that worked keeps its entry: ``status: success``, no refusal's members."""
    with relay.client() as api:
        assert api.put(f"{ORG}/apps/refusal-app").status_code == 204
    entry = refused_entry(relay, "application.create", "ops", "refusal-app")
    assert entry["status"] == "success"
    assert entry["details"] == {"result": "success", "application_name": "refusal-app", "private_mode": False}


def test_the_budget_admits_the_bound_and_counts_the_rest_into_the_next_entry() -> None:
    budget = RefusalBudget(limit=3, window=60.0)
    key = ("acme", "key-1", "workflow.cancel")
    assert [budget.admit(key, 0.0) for _ in range(3)] == [0, 0, 0]
    assert [budget.admit(key, 1.0) for _ in range(5)] == [None] * 5
    assert budget.admit(("acme", "key-2", "workflow.cancel"), 1.0) == 0, "another key has its own budget"
    assert budget.admit(key, 61.0) == 5, "the next window's first entry carries the suppressed count"
    assert budget.admit(key, 61.5) == 0


def test_a_refusal_is_answered_the_same_while_the_database_is_down(tmp_path: Path) -> None:
    """The answer does not wait for the entry: with Relay's database stopped, a 403 and a 422 are the
    same answers, status and body, as with it up; the lost entry is a line in Relay's log."""
    server = PostgresServer("refusals-db")
    relay = RelayProcess(tmp_path, server.url(server.create_database("relay")), relay_yaml(free_port()))
    try:
        relay.start()

        def answers() -> list[tuple[int, bytes]]:
            with relay.client(VIEWER_KEYS["acme"]) as viewer, relay.client() as admin:
                # The same request ids each time: the bodies carry them (requestId).
                denied = viewer.post(f"{APP}/workflows/wf-down/cancel", headers={"X-Request-Id": "denied"})
                invalid = admin.post(
                    f"{APP}/schedules/nightly/backfill", json={"bogus": 1}, headers={"X-Request-Id": "invalid"}
                )
            return [(denied.status_code, denied.content), (invalid.status_code, invalid.content)]

        up = answers()
        assert [status for status, _ in up] == [403, 422]
        server.stop()
        assert answers() == up
        assert_eventually(lambda: "could not audit a refused" in relay.log(), 60, what="the lost entry in the log")
    finally:
        relay.stop()
        server.close()


def test_a_refused_path_naming_what_relay_cannot_store_is_audited_without_it(relay: RelayProcess) -> None:
    """Workflow ids are bounded at 16 KiB in UTF-8 (a NUL is answered 404 before any route): a refusal
    naming a long id within it is audited with it as the target, one past it without a target."""
    odd = make_key(relay, "odd-paths", ["application.read"])
    within = ["x" * 300, "y" * 4000]
    past = "é" * (MAX_WORKFLOW_ID_BYTES // 2 + 1)
    with relay.client(odd) as api:
        for workflow_id in (*within, past):
            assert api.post(f"{APP}/workflows/{quote(workflow_id, safe='')}/cancel").status_code == 403

    def all_three() -> list[dict[str, Any]] | None:
        found = entries(relay, operation="workflow.cancel", subject="odd-paths")
        return found if len(found) == 3 else None

    found = assert_eventually(all_three, 20, what="the three refusals audited")
    for entry in found:
        assert entry["status"] == "failure"
        assert entry["details"]["application_name"] == "ledger"
    named = sorted((e["target"]["type"], e["target"]["id"]) for e in found if "target" in e)
    assert named == [("workflow", workflow_id) for workflow_id in within], found


def test_a_refused_recover_is_no_entry_about_the_executor(relay: RelayProcess) -> None:
    """A refused operator's recover names the executor in its detail, not as the entry's executor:
    an entry about an executor defers the reconciler's look at it, which a refused key must not do."""
    with relay.client(VIEWER_KEYS["acme"]) as api:
        assert api.post(f"{APP}/executors/exec-refused/recover").status_code == 403

    def found() -> list[dict[str, Any]] | None:
        rows = relay_entries(relay, "recovery.manual_requested")
        return [r for r in rows if r["detail"].get("executorId") == "exec-refused"] or None

    [row] = assert_eventually(found, 20, what="the refused recover's entry")
    assert row["executorId"] is None and row["detail"]["result"] == "failure" and row["actor"] == "api:view"
