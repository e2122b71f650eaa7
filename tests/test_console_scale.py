"""The console at scale: 100,000 workflows in an app's system database and 1,000 executors in Relay's
registry (both seeded directly with SQL), one real DBOS executor connected so that the workflow
pages are served. Every request the console makes is recorded: each list is asked a page at a
time (a limit no larger than the console's page), no answer holds more rows than asked, and each
page shows its first page.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, LiteralString

import psycopg
import pytest
from playwright.sync_api import Response, expect

from harness.browser import chromium, sign_in, watch
from harness.executors import ExecutorProcess
from harness.keys import API_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.waiting import assert_eventually

WORKFLOWS = 100_000
EXECUTORS = 1_000  # seeded, besides the real one
RECOVERIES = 300
AUDIT = 5_000
PAGE_BOUND = 100
DASH = "\N{EN DASH}"  # as the pager writes ranges  # no console request may ask for more rows than this
# Requests that are not lists, or lists bounded by what an app declares: no limit to check.
UNPAGED = ("/whoami", "/events", "/apps/ledger", "/instances", "/queues", "/schedules")

SEED_EXECUTORS = """
INSERT INTO executors (org, app, executor_id, state, application_version, hostname, language, dbos_version,
                       connected_at, disconnected_at, dead_at, relay_instance, blocked_reason)
SELECT 'acme', 'ledger', 'seeded-' || lpad(g::text, 4, '0'),
       CASE WHEN g %% 10 < 7 THEN 'HEALTHY' WHEN g %% 10 < 9 THEN 'DISCONNECTED' ELSE 'DEAD' END,
       'v' || (g %% 3 + 1), 'host-' || (g %% 50), 'python', '3.2.0',
       now() - make_interval(secs => g), CASE WHEN g %% 10 >= 7 THEN now() END,
       CASE WHEN g %% 10 = 9 THEN now() END,
       -- an instance that never ran here: nobody adopts its executors or asks them anything
       'relay-seeded', CASE WHEN g %% 10 = 9 THEN 'no_healthy_peer' END
FROM generate_series(1, %s) AS g
"""
SEED_RECOVERIES = """
INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, run, trigger, status, error)
SELECT 'recovery:acme:ledger:gone-' || g || ':' || g, 'acme', 'ledger', 'gone-' || g, 'v1', g, 1, 'grace_period',
       'succeeded', NULL
FROM generate_series(1, %s) AS g
"""
SEED_AUDIT = """
INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
SELECT 'acme', 'ledger', 'executor.dead', 'gone-' || g, 'relay', jsonb_build_object('epoch', g)
FROM generate_series(1, %s) AS g
"""
SEED_WORKFLOWS = """
INSERT INTO dbos.workflow_status (workflow_uuid, status, name, executor_id, created_at, updated_at,
                                  application_version, queue_name, completed_at)
SELECT 'seed-' || lpad(g::text, 6, '0'),
       (ARRAY['SUCCESS', 'SUCCESS', 'ERROR', 'CANCELLED'])[g %% 4 + 1],
       (ARRAY['checkout', 'refund', 'report'])[g %% 3 + 1],
       'seeded-' || lpad((g %% 1000 + 1)::text, 4, '0'),
       1700000000000 + g * 1000, 1700000000000 + g * 1000 + 500,
       'v' || (g %% 3 + 1), CASE WHEN g %% 5 = 0 THEN 'serial' END, 1700000000000 + g * 1000 + 500
FROM generate_series(1, %s) AS g
"""


@dataclass
class Scale:
    relay: RelayProcess
    sysdb: str
    executor: ExecutorProcess


@pytest.fixture(scope="module")
def scale(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scale]:
    workdir = tmp_path_factory.mktemp("scale")
    relay_db, sysdb = postgres.create_database("relay"), postgres.create_database("sys")
    relay = RelayProcess(workdir, relay_db, relay_yaml(free_port()))
    executor: ExecutorProcess | None = None
    try:
        relay.start()
        executor = ExecutorProcess(workdir, sysdb, relay.conductor_url)
        assert_eventually(lambda: relay.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 10)  # type: ignore[union-attr]
        with psycopg.connect(relay_db) as conn:
            conn.execute(SEED_EXECUTORS, (EXECUTORS,))
            conn.execute(SEED_RECOVERIES, (RECOVERIES,))
            conn.execute(SEED_AUDIT, (AUDIT,))
        with psycopg.connect(sysdb) as conn:
            conn.execute(SEED_WORKFLOWS, (WORKFLOWS,))
            conn.execute("ANALYZE dbos.workflow_status")
        yield Scale(relay, sysdb, executor)
    finally:
        if executor is not None:
            executor.stop()
        relay.stop()


def first_page(
    sysdb: str, version: str, executor: str | None = None, window: tuple[int, int] | None = None
) -> list[str]:
    """The ids of the newest 50 workflows of this version (executor, created in this window), as the
    console's first page lists them."""
    sql: LiteralString = """
        SELECT workflow_uuid FROM dbos.workflow_status
        WHERE application_version = %(version)s AND (%(executor)s::text IS NULL OR executor_id = %(executor)s)
          AND (%(lo)s::bigint IS NULL OR created_at BETWEEN %(lo)s AND %(hi)s)
        ORDER BY created_at DESC LIMIT 50"""
    lo, hi = window or (None, None)
    with psycopg.connect(sysdb) as conn:
        rows = conn.execute(sql, {"version": version, "executor": executor, "lo": lo, "hi": hi}).fetchall()
    return [r[0] for r in rows]


def limit_of(path: str, query: dict[str, list[str]], body: Any) -> int | None:
    if isinstance(body, dict) and "limit" in body:
        return int(body["limit"])
    if "limit" in query:
        return int(query["limit"][0])
    return None


def test_every_console_request_is_paged_and_the_pages_show_their_first_page(scale: Scale) -> None:
    relay = scale.relay
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1280, "height": 900}, timezone_id="UTC")
        page = context.new_page()
        watched = watch(page)
        responses: list[Response] = []
        page.on("response", lambda r: responses.append(r) if "/v2/" in r.url and "/events" not in r.url else None)
        expect.set_options(timeout=15_000)
        timings: dict[str, float] = {}

        def visit(route: str, ready: str, name: str) -> None:
            start = time.monotonic()
            page.evaluate("route => { location.hash = route; }", route)
            expect(page.locator(ready).first).to_be_visible()
            expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)
            timings[name] = time.monotonic() - start

        sign_in(page, relay.http, "acme", API_KEYS["acme"])
        expect(page.get_by_role("row", name="ledger")).to_contain_text("701")  # 700 seeded HEALTHY and the real one
        expect(page.get_by_role("row", name="ledger")).to_contain_text("100 blocked")

        visit("#/apps/ledger/executors", "tbody tr[data-state]", "executors")
        rows = page.locator("tbody tr[data-state]")
        expect(rows).to_have_count(50)
        expect(page.get_by_text(f"Showing 1{DASH}50 of 1001")).to_be_visible()
        page.get_by_role("button", name="Next page").click()
        expect(page.get_by_text(f"Showing 51{DASH}100 of 1001")).to_be_visible()
        expect(rows).to_have_count(50)
        visit("#/apps/ledger/executors?state=DEAD", "tbody tr[data-state=DEAD]", "executors DEAD")
        expect(page.get_by_text(f"Showing 1{DASH}50 of 100")).to_be_visible()
        expect(page.locator("tbody tr[data-state=DEAD]")).to_have_count(50)

        visit("#/apps/ledger/recoveries", "section.recovery", "recoveries")
        expect(page.locator("section.recovery")).to_have_count(20)

        visit("#/apps/ledger/workflows", "tbody tr", "workflows")
        listed = page.locator("tbody tr th")
        expect(listed).to_have_count(50)
        assert listed.first.inner_text() == f"seed-{WORKFLOWS:06d}"  # newest first
        page.get_by_role("button", name="Next page").click()
        expect(listed.first).to_have_text(f"seed-{WORKFLOWS - 50:06d}")
        expect(listed).to_have_count(50)
        visit("#/apps/ledger/workflows?status=ERROR&name=report", "tbody tr", "workflows ERROR")
        expect(listed).to_have_count(50)
        # The time window, version and executor filters, through the form, against the system database.
        form = page.get_by_role("form", name="Filter workflows")
        form.get_by_label("Status").select_option("")
        form.get_by_label("Workflow name").fill("")
        form.get_by_label("Created from").fill("2023-11-14T22:20")  # seed 400 (the page runs in UTC)
        form.get_by_label("Created until").fill("2023-11-14T22:25")  # seed 700
        form.get_by_label("App version").fill("v2")
        form.get_by_role("button", name="Search").click()
        window = (1_700_000_400_000, 1_700_000_700_000)
        expected = first_page(scale.sysdb, "v2", window=window)
        expect(listed.first).to_have_text(expected[0])
        assert listed.all_inner_texts() == expected and len(expected) == 50
        form.get_by_label("Executor id").fill("seeded-0401")  # seeds 400, 1400, ...: only 400 in the window
        form.get_by_role("button", name="Search").click()
        expect(listed).to_have_count(1)
        assert listed.all_inner_texts() == first_page(scale.sysdb, "v2", "seeded-0401", window) == ["seed-000400"]
        form.get_by_label("Created from").fill("")
        form.get_by_label("Created until").fill("")
        form.get_by_role("button", name="Search").click()  # the executor's v2 workflows at any time
        expect(listed).to_have_count(34)  # g = 400 + 1000 k with g % 3 == 1: k = 0, 3, ..., 99
        assert listed.all_inner_texts() == first_page(scale.sysdb, "v2", "seeded-0401")
        search = [b for _, path, _, b in watched.requests if path.endswith("/workflows/search")][-2]
        assert search["appVersion"] == ["v2"] and search["executorId"] == ["seeded-0401"]
        assert (search["startTime"], search["endTime"]) == ("2023-11-14T22:20:00.000Z", "2023-11-14T22:25:00.000Z")

        visit("#/apps/ledger/workflows/seed-000123", "dl.facts", "workflow")
        expect(page.locator("dl.facts")).to_contain_text("CANCELLED")  # 123 % 4 == 3

        visit("#/audit", "tbody tr", "audit")
        expect(page.locator("tbody tr")).to_have_count(100)
        visit("#/instances", "tbody tr", "instances")
        visit("#/", "tbody tr", "apps")

        for response in responses:
            response.finished()
        sizes = {}
        for response in responses:
            body = response.json() if response.ok and response.status != 204 else None
            if isinstance(body, list):
                sizes[response.url] = len(body)
        context.close()

    print("time to each page's first page (s):", {k: round(v, 2) for k, v in timings.items()})
    assert watched.requests, "no request recorded"
    unpaged = []
    for method, path, query, body in watched.requests:
        if path.endswith(UNPAGED) or ("/workflows/seed-" in path and not path.endswith("/steps")):
            continue
        limit = limit_of(path, query, body)
        if limit is None or limit > PAGE_BOUND:
            unpaged.append((method, path, query, body))
    assert unpaged == [], "requests without a page bound"
    assert sizes and max(sizes.values()) <= PAGE_BOUND, sizes
    assert max(timings.values()) < 10, timings


def test_a_workflow_with_more_children_than_a_page_pages_them(scale: Scale) -> None:
    """A workflow's page listed its first 50 children and said nothing of the rest (an on-call
    reviewer's finding after stop 36): with 120, the children are paged like every other list."""
    with psycopg.connect(scale.sysdb) as conn:
        conn.execute(
            """UPDATE dbos.workflow_status SET parent_workflow_id = 'seed-000123'
               WHERE workflow_uuid BETWEEN 'seed-000200' AND 'seed-000319'"""
        )
    with chromium() as browser:
        context = browser.new_context()
        page = context.new_page()
        sign_in(page, scale.relay.http, "acme", API_KEYS["acme"])
        page.evaluate("route => { location.hash = route; }", "#/apps/ledger/workflows/seed-000123")
        children = page.get_by_role("table", name="Child workflows of seed-000123").locator("tbody tr")
        expect(children).to_have_count(50)
        pager = page.get_by_role("navigation", name="Child pages")
        expect(pager).to_contain_text(f"Showing 1{DASH}50")
        pager.get_by_role("button", name="Next page").click()
        expect(pager).to_contain_text(f"Showing 51{DASH}100")
        expect(children).to_have_count(50)
        pager.get_by_role("button", name="Next page").click()
        expect(pager).to_contain_text(f"Showing 101{DASH}120")
        expect(children).to_have_count(20)
        shown = set(children.locator("th").all_inner_texts())
        context.close()
    assert len(shown) == 20 and all("seed-0002" <= s <= "seed-000319" for s in shown), shown


def test_the_recoveries_listing_filters_by_status_and_time_and_counts_on_every_page(scale: Scale) -> None:
    """``status``, ``updatedSince`` (at or after) and ``total=true`` (``X-Total-Count``, the same on
    every page); a bad value of each is refused with the API's error shape, naming it."""
    with psycopg.connect(scale.relay.database_url) as conn:
        row = conn.execute(
            """SELECT updated_at, count(*) OVER (PARTITION BY org, app) AS n FROM recoveries
               WHERE org = 'acme' AND app = 'ledger' AND status = 'succeeded' ORDER BY updated_at LIMIT 1"""
        ).fetchone()
    assert row is not None and row[1] >= RECOVERIES
    oldest, succeeded = row[0].isoformat(), row[1]  # (the seeded runs, and any a test added)
    with scale.relay.api() as api:
        params: dict[str, Any] = {"status": "succeeded", "updatedSince": oldest, "limit": 7, "offset": succeeded - 5}
        page = api.get("/apps/ledger/recoveries", params={**params, "total": "true"})
        assert page.status_code == 200, page.text
        assert page.headers["X-Total-Count"] == str(succeeded) and len(page.json()) == 5
        assert "X-Total-Count" not in api.get("/apps/ledger/recoveries", params=params).headers
        for query, total in ({"status": "failed"}, 0), ({"updatedSince": "2999-01-01T00:00:00Z"}, 0):
            none = api.get("/apps/ledger/recoveries", params={**query, "total": "true"})
            assert (none.status_code, none.json(), none.headers["X-Total-Count"]) == (200, [], str(total))
        for name, bad in (
            ("status", "done"),
            ("updatedSince", "yesterday"),
            ("updatedSince", "2026-01-01T00:00:00"),
            ("total", "maybe"),
            ("executorDeleted", "maybe"),
        ):
            refused = api.get("/apps/ledger/recoveries", params={name: bad})
            assert refused.status_code == 422, (name, bad, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "invalid_request" and name in error["message"], (name, bad, error)


def test_the_recently_recovered_line_counts_every_recovery_of_the_last_hour(scale: Scale) -> None:
    """An app's Executors page says how many executors were recovered in the last hour: it counted
    them among the app's 20 newest recoveries, and said "20 executors" in a mass failure of any size.
    Of the 300 seeded succeeded runs (their executors deleted), 50 ended two hours ago: 250 now, and
    gone-300 came back and was recovered again (its two runs the newest): 251 runs, asked of the API
    (``status=succeeded&updatedSince=...&total=true``: ``X-Total-Count``), the newest five executors
    named. The count is of runs: the line said "251 executors were recovered" (there were 250) and
    "and 246 more" beside five names. A run that succeeded while its executor had connected again
    (``recordKept``: no ``executor.deleted``) removed nothing from the list and is not counted
    (``executorDeleted=true``): the line said 252, "their executors removed"."""
    with psycopg.connect(scale.relay.database_url) as conn:
        conn.execute(
            """UPDATE recoveries SET created_at = clock_timestamp()
               WHERE id = 'recovery:acme:ledger:gone-300:300'"""
        )
        conn.execute(
            """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, run, trigger,
                                       status, created_at, updated_at)
               VALUES ('recovery:acme:ledger:gone-300:1300', 'acme', 'ledger', 'gone-300', 'v1', 1300, 1,
                       'grace_period', 'succeeded', clock_timestamp(), clock_timestamp())"""
        )
        conn.execute(
            """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
               SELECT 'acme', 'ledger', 'executor.deleted', executor_id, 'relay',
                      jsonb_build_object('recoveryId', id, 'attempt', 1)
               FROM recoveries WHERE org = 'acme' AND app = 'ledger' AND status = 'succeeded'"""
        )
        conn.execute(
            """UPDATE recoveries SET updated_at = now() - interval '2 hours'
               WHERE app = 'ledger' AND executor_id = ANY(%s)""",
            ([f"gone-{g}" for g in range(1, 51)],),
        )
        conn.execute(
            """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, run, trigger,
                                       status, created_at, updated_at)
               VALUES ('recovery:acme:ledger:back-1:1', 'acme', 'ledger', 'back-1', 'v1', 1, 1,
                       'grace_period', 'succeeded', clock_timestamp(), clock_timestamp());
               INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
               VALUES ('acme', 'ledger', 'recovery.succeeded', 'back-1', 'relay',
                       '{"recoveryId": "recovery:acme:ledger:back-1:1", "attempt": 1, "recordKept": true}')"""
        )
    hour_ago = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    with scale.relay.api() as api:
        for deleted, total in ("true", 251), ("false", 1):
            params = {"status": "succeeded", "updatedSince": hour_ago, "executorDeleted": deleted, "total": "true"}
            runs = api.get("/apps/ledger/recoveries", params={**params, "limit": 1, "sortDesc": "true"})
            assert runs.status_code == 200 and runs.headers["X-Total-Count"] == str(total), (deleted, runs.text)
            assert [(r["executorId"], r["deletedAt"] is None) for r in runs.json()] == [
                ("back-1", True) if deleted == "false" else ("gone-300", False)
            ]
    with chromium() as browser:
        context = browser.new_context()
        page = context.new_page()
        sign_in(page, scale.relay.http, "acme", API_KEYS["acme"])
        page.evaluate("route => { location.hash = route; }", "#/apps/ledger/executors")
        recent = page.locator("#recently-recovered")
        expect(recent).to_contain_text("251 recoveries succeeded in the last hour, their executors removed")
        # Five executors named, six of the runs (gone-300's two): 245 more runs.
        expect(recent).to_contain_text(": gone-300, gone-99, gone-98, gone-97, gone-96 and 245 more.")
        named = recent.get_by_role("link").all_inner_texts()
        context.close()
    assert len(named) == 5 and all(n.startswith("gone-") and int(n[5:]) > 50 for n in named), named
