"""The operator console as an on-call engineer uses it during an incident: deep links, time zones,
apps in trouble, pages after an executor or Relay comes back, keys that go away.

Each test here failed on the code before its fix: each names a bug of the console (relay/static/)
found in an on-call review after stop 35, against a real Relay with real DBOS executors (never a
mocked Relay).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, LiteralString
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest
from dbos import DBOSClient
from playwright.sync_api import Browser, Page, expect

from harness.browser import chromium, console_page, sign_in, watch
from harness.executors import ExecutorProcess
from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from tests.test_cli_oncall import insert_dot_workflow

expect.set_options(timeout=10_000)
APP_MODULE = "harness.workflow_app"
MANY = 55  # apps in relay.yaml besides ledger: more than one page (50) of the apps list


@dataclass
class World:
    workdir: Path
    relay: RelayProcess
    sysdb: str
    ledger: ExecutorProcess
    browser: Browser
    started: list[ExecutorProcess]


@pytest.fixture(scope="module")
def world(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("oncall")
    config = relay_yaml(free_port(), pingIntervalSecs=1.0, pingWaitSecs=10.0)
    config["server"].update(eventPollSecs=0.2)
    apps = config["orgs"][0]["apps"]
    apps += [{"name": f"app-{n:02d}", "executorTimeoutSecs": 1.0} for n in range(MANY)]
    apps.append({"name": "quiet", "executorTimeoutSecs": 60})
    relay = RelayProcess(workdir, postgres.create_database("relay"), config)
    sysdb = postgres.create_database("sys")
    executors: list[ExecutorProcess] = []
    try:
        with chromium() as browser:
            relay.start()
            executors.append(ExecutorProcess(workdir, sysdb, relay.conductor_url, module=APP_MODULE,
                                             env={"RELAY_TEST_SEED": "1"}))  # fmt: skip
            e = executors[0]
            assert_eventually(lambda: relay.state_of("acme", "ledger", e.executor_id) == "HEALTHY", 10)
            enqueued: LiteralString = "SELECT 1 FROM dbos.workflow_status WHERE status = 'ENQUEUED'"
            assert_eventually(lambda: not query(sysdb, enqueued), 20)
            yield World(workdir, relay, sysdb, executors[0], browser, executors)
    finally:
        for e in executors:
            e.stop()
        relay.stop()


@pytest.fixture
def page(world: World, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh browser context (its own sessionStorage) for each test; its console errors fail the test."""
    with console_page(world.browser, request, world.workdir, world.relay.log) as page:
        yield page


def query(url: str, sql: LiteralString, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return list(conn.execute(sql, params).fetchall())


def admin(page: Page, world: World) -> None:
    sign_in(page, world.relay.http, "acme", API_KEYS["acme"])


def go(page: Page, hash_route: str) -> None:
    page.evaluate("route => { location.hash = route; }", hash_route)


def settled(page: Page) -> None:
    expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)


def ledger_entry(world: World) -> dict[str, Any]:
    """A fresh audit entry of ledger's (a settings change, audited), as the API gives it."""
    with world.relay.api() as api:
        assert api.patch("/apps/ledger", json={"executorTimeoutSecs": 30}).status_code == 200
        (entry,) = api.get("/audit", params={"app": "ledger", "action": "settings.updated",
                                             "sortDesc": True, "limit": 1}).json()  # fmt: skip
    return entry


def test_a_time_shown_on_the_audit_page_typed_into_since_finds_that_entry_in_any_time_zone(
    world: World,
) -> None:
    """Every time the console shows is UTC ("2026-12-05 03:51:25Z"), but the "Since" filter (and the
    workflows' "Created from"/"Created until") is an ``<input type=datetime-local>`` that
    ``new Date(value).toISOString()`` reads in the browser's own time zone. An operator in New York
    who types the time of the entry they see gets entries since five hours later: the entry is not
    there ("No entry matches."). The same address (``#/audit?since=...``, "to share") also means a
    different instant to each colleague who opens it."""
    entry = ledger_entry(world)
    context = world.browser.new_context(timezone_id="America/New_York")
    try:
        page = context.new_page()
        admin(page, world)
        go(page, "#/audit?app=ledger&action=settings.updated")
        rows = page.get_by_role("table", name="Audit entries").locator("tbody tr")
        expect(rows.first).to_be_visible()
        shown = rows.first.locator("time").inner_text()  # as the operator reads it
        assert shown.endswith("Z") and shown[:16].replace(" ", "T") == entry["at"][:16], (shown, entry["at"])
        page.get_by_label("Since").fill(shown[:16].replace(" ", "T"))  # the minute of the entry shown
        with page.expect_request(lambda r: urlsplit(r.url).path.endswith("/audit")) as asked:
            page.get_by_role("button", name="Filter").click()
        since = parse_qs(urlsplit(asked.value.url).query)["since"][0]
        settled(page)
        assert since[:16] == entry["at"][:16], f"asked since {since} for an entry shown at {shown}"
        expect(rows.first).to_contain_text("settings.updated")
    finally:
        context.close()


def test_the_workflows_of_an_app_are_shown_once_an_executor_of_it_connects(
    world: World, page: Page, postgres: Postgres
) -> None:
    """README: the console "reads the page it shows again only when an event concerns it: an executor
    of the app shown changed". The workflows page (and queues, schedules) answers 503 while the app has
    no healthy executor; when one connects, the executor event comes but the workflows page ignores
    it (its ``relevant`` takes only ``workflow.*`` audit entries): the 503 alert stays on the page,
    with no workflow listed, until the operator reloads. This is what an operator sees after
    restarting a crashed app."""
    admin(page, world)
    go(page, "#/apps/quiet/workflows")
    alert = page.locator("main p.alert")
    expect(alert).to_contain_text("no healthy executor connected")
    quiet = ExecutorProcess(world.workdir, postgres.create_database("quiet"), world.relay.conductor_url, app="quiet")
    world.started.append(quiet)
    assert_eventually(lambda: world.relay.state_of("acme", "quiet", quiet.executor_id) == "HEALTHY", 10)
    expect(page.locator("#live")).to_have_text("Live")
    page.wait_for_timeout(3_000)  # the executor's events have come (the apps page would have read again)
    assert page.locator("main p.alert").all_inner_texts() == [], "the 503 stays though an executor is HEALTHY"
    expect(page.get_by_text("No workflow matches.")).to_be_visible()


def test_an_app_with_a_blocked_recovery_comes_first_even_when_it_is_not_on_the_first_page_of_names(
    world: World, page: Page
) -> None:
    """README: apps with blocked recoveries are "shown first and in red". The console sorts blocked
    apps first only within the page of 50 it read, and Relay pages apps by name: with more than 50
    apps, a blocked ``app-54`` is on the second page, after 50 healthy ones, and the first page
    (what an operator opens in an incident) shows no trouble at all."""
    url = f"ws://127.0.0.1:{world.relay.port}/websocket/app-54/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "app-54-victim", "answer"):
        pass  # its socket dropped, as if the process died; nobody else serves app-54
    assert_eventually(lambda: (world.relay.executor("acme", "app-54", "app-54-victim") or {}).get("blockedReason")
                      == "no_healthy_peer", 15)  # fmt: skip
    admin(page, world)
    settled(page)
    first = page.locator("tbody tr").first
    expect(first.locator("th")).to_have_text("app-54")
    expect(first).to_have_class("blocked-row")


def test_how_long_an_executor_has_been_in_its_state_keeps_counting(
    world: World, page: Page, postgres: Postgres
) -> None:
    """Executors: "since when it is in its state", shown with an "N s ago" computed once, when the page
    was read. Nothing polls and a HEALTHY executor sends no event, so the text never changes: an
    executor DEAD for an hour still reads "3 s ago" on a console left open. Here an executor that has
    just connected still reads its age of page-opening time six seconds later."""
    fresh = ExecutorProcess(world.workdir, postgres.create_database("fresh"), world.relay.conductor_url, app="app-01")
    world.started.append(fresh)
    assert_eventually(lambda: world.relay.state_of("acme", "app-01", fresh.executor_id) == "HEALTHY", 10)
    admin(page, world)
    go(page, "#/apps/app-01/executors")
    row = page.locator(f'tbody tr:has([data-executor="{fresh.executor_id}"])')
    expect(row).to_be_visible()
    page.wait_for_timeout(6_000)
    shown = row.locator(".when").inner_text()
    connected = row.locator("time").get_attribute("datetime")
    actual = page.evaluate("iso => Math.round((Date.now() - new Date(iso).getTime()) / 1000)", connected)
    assert actual < 90 and shown.endswith(" s ago"), (actual, shown)
    assert abs(int(shown.split()[0]) - actual) <= 2, f"shows {shown!r}; it connected {actual} s ago"


def test_a_workflow_whose_id_is_a_dot_segment_is_not_a_link_to_another_page(world: World, page: Page) -> None:
    """DBOS takes any string as a workflow id, and Relay serves ``..`` at ``.../workflows/%2E%2E`` (the
    command line encodes it so). A browser cannot ask for it: it resolves a dot segment in any
    encoding (``%2E%2E`` too) before sending. The console linked the workflow ``..`` listed on the
    workflows page, and the link opened an error page (its reads went to ``/apps/ledger`` and
    ``/apps/ledger/steps``). It is listed without a link now, saying how to read it."""
    insert_dot_workflow(world.sysdb, world.ledger.executor_id)
    admin(page, world)
    go(page, "#/apps/ledger/workflows")
    row = (
        page.get_by_role("table", name="Workflows of ledger")
        .locator("tbody tr")
        .filter(has=page.locator("th", has_text=re.compile(r"^\.\.$")))
    )
    expect(row).to_have_count(1)
    expect(row.get_by_role("link", name="..", exact=True)).to_have_count(0)
    assert row.locator("th span").get_attribute("title") == (
        "A browser cannot open this id; use: relay workflows get ledger .."
    )
    expect(page.get_by_role("link", name="done-1", exact=True)).to_have_count(1)  # others are links


def test_a_key_deleted_while_signed_in_says_so_and_keeps_the_page_to_come_back_to(world: World, page: Page) -> None:
    """When the key is deleted, Relay ends its event stream; the console's next try gets 401 and
    calls ``signOut()``: the sign-in form comes back with no word of why (a reload says "Your key
    is no longer valid; sign in again.", this path says nothing), and ``history.replaceState`` has
    dropped the address, so the operator who signs in again with a new key lands on Apps, not on the
    filtered page they were working from."""
    with world.relay.api() as api:
        made = api.post("/tokens/oncall-doomed", json={"permissions": ["application.read", "application.write"]})
    assert made.status_code == 201, made.text
    sign_in(page, world.relay.http, "acme", made.json()["token"])
    go(page, "#/apps/ledger/workflows?status=ERROR")
    settled(page)
    with world.relay.api() as api:
        assert api.delete("/tokens/oncall-doomed").status_code == 204
    expect(page.get_by_role("heading", name="Sign in to Relay")).to_be_visible()
    expect(page.locator("#signin-error")).to_contain_text("no longer valid")
    assert page.evaluate("location.hash") == "#/apps/ledger/workflows?status=ERROR"


def test_searching_again_with_the_same_filters_reads_the_workflows_again(world: World, page: Page) -> None:
    """A workflow that finishes is not audited, so the workflows page is not read again when one does;
    an operator presses Search to see where things stand now. The form's submit only sets
    ``location.hash``, and with the filters unchanged the hash is the same: no ``hashchange``, no
    request, and the list keeps showing ``waiting-1`` PENDING after it finished (the same holds for
    Filter on the executors, recoveries and audit pages)."""
    admin(page, world)
    go(page, "#/apps/ledger/workflows?status=PENDING")
    row = page.get_by_role("row", name="waiting-1", exact=False).first
    expect(row).to_contain_text("PENDING")
    client = DBOSClient(system_database_url=world.sysdb)
    try:
        client.send("waiting-1", "now", topic="go")  # it finishes: SUCCESS, not audited
    finally:
        client.destroy()
    assert_eventually(lambda: query(world.sysdb, "SELECT status FROM dbos.workflow_status WHERE workflow_uuid = %s",
                                    "waiting-1") == [("SUCCESS",)], 15)  # fmt: skip
    watched = watch(page)
    page.get_by_role("button", name="Search").click()
    page.wait_for_timeout(1_500)
    searches = [path for _, path, _, _ in watched.requests if path.endswith("/workflows/search")]
    assert searches, "Search with the same filters asked Relay nothing"
    expect(page.get_by_text("No workflow matches.")).to_be_visible()


def test_a_key_limited_to_apps_is_not_offered_a_page_it_may_not_read(world: World, page: Page) -> None:
    """README: "What the key may do decides what the console shows ... a key limited to apps sees those
    apps." A key made for one app (``application.read``/``write`` on ledger) still gets the main
    navigation's **Instances**, whose only content is the error "this API key lacks the permission
    organization.read (403)"."""
    with world.relay.api() as api:
        scoped = {"appNames": ["ledger"], "permissions": ["application.read", "application.write"]}
        made = api.post("/tokens/oncall-scoped", json=scoped)
    assert made.status_code == 201, made.text
    sign_in(page, world.relay.http, "acme", made.json()["token"])
    expect(page.get_by_role("row", name="ledger")).to_be_visible()
    instances = page.get_by_role("navigation", name="Main").get_by_role("link", name="Instances")
    if instances.count():
        instances.click()
        settled(page)
        assert page.locator("main p.alert").all_inner_texts() == [], "offered a page that is only a 403"


def test_a_read_that_failed_for_a_passing_reason_is_tried_again_without_a_reload(world: World, page: Page) -> None:
    """A page whose read failed (the app's only executor answered with an error: 502) stayed failed
    until something it listens for happened or the operator reloaded; a console left open in an
    incident showed a stale error. A read that failed for a reason that passes (no status, 429,
    5xx) is tried again by itself, 2 s later, then less often; nothing else changes meanwhile
    here (no event of the app)."""
    answers: list[str] = []

    def list_workflows(_: dict[str, Any]) -> dict[str, Any]:
        answers.append("asked")
        if len(answers) == 1:
            return {"error_message": "the system database is being restarted"}
        return {"output": []}

    url = f"ws://127.0.0.1:{world.relay.port}/websocket/app-03/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "app-03-flaky", "silent", replies={"list_workflows": list_workflows}):
        assert_eventually(lambda: world.relay.state_of("acme", "app-03", "app-03-flaky") == "HEALTHY", 10)
        admin(page, world)
        go(page, "#/apps/app-03/workflows")
        expect(page.locator("main p.alert")).to_contain_text("being restarted")
        expect(page.get_by_text("No workflow matches.")).to_be_visible(timeout=6_000)
        expect(page.locator("main p.alert")).to_have_count(0)
        assert len(answers) == 2, answers  # once failing, once again by itself: no more
        page.wait_for_timeout(2_500)
        assert len(answers) == 2, answers  # a page that reads fine is not read again


def test_no_empty_error_box_is_left_once_a_page_reads_again_after_relay_restarts(world: World, page: Page) -> None:
    """Relay restarting while the page is open: a read while it is down fails and the page's status
    becomes a red ``.alert`` box ("Failed to fetch"). When Relay is back the stream reconnects and
    the page reads again; ``refresh()`` empties the text but leaves the class, so an empty red box
    (border, pink background, 8 px padding) stays above the good data for as long as the page is
    open. (Runs last: it restarts the module's Relay.)"""
    admin(page, world)
    go(page, "#/apps/ledger/executors")
    settled(page)
    world.relay.stop()
    expect(page.locator("#live")).to_have_text("Reconnecting…")
    page.get_by_label("State").select_option("HEALTHY")
    page.get_by_role("button", name="Filter").click()  # a read while Relay is down
    expect(page.locator("main p.alert")).to_have_text("Failed to fetch")
    world.relay.start()
    expect(page.locator("#live")).to_have_text("Live", timeout=20_000)
    expect(page.locator(f'tbody tr:has([data-executor="{world.ledger.executor_id}"])')).to_be_visible()
    expect(page.locator("main p.alert")).to_have_count(0)
    boxes = page.locator("main p.alert").evaluate_all("ps => ps.map(p => p.getBoundingClientRect().height)")
    assert boxes == [], f"an empty error box {boxes} px high is left on the page"
