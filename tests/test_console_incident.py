"""The operator console during an incident, as an on-call engineer at 3 a.m. meets it: a reload while
Relay is overloaded, a workflow page left open, the audit log paged while entries keep coming, keys
limited to apps (or the wrong key pasted), actions whose outcome is misreported, a frozen Relay, a
refused event stream, long ids, a recovery that waits for an operator, focus after an action.

Each test here failed on the code before its fix: each names a bug of the console (relay/static/)
found in an on-call review after stop 36, against a real Relay with real DBOS executors and real
Chromium (never a mocked Relay; where a test needs Relay busy at one moment, it holds Relay's own
request slots and lets Relay answer). Their docstrings say what goes wrong and what a fix must make
true. The last test freezes the module's Relay (SIGSTOP), so it runs last.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, LiteralString

import httpx
import psycopg
import pytest
from dbos import DBOSClient
from playwright.sync_api import Browser, Page, Route, expect

from harness.browser import chromium, console_page, sign_in
from harness.executors import ExecutorProcess
from harness.keys import API_KEYS, CONDUCTOR_KEYS, VIEWER_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from harness.web import TLS

expect.set_options(timeout=10_000)
APP_MODULE = "harness.workflow_app"
MAX_REQUESTS = 6  # server.maxConcurrentRequests: enough for the console's own requests, few to fill
# A key made for one app, as an app team's on-call gets.
APP_TEAM = {"appNames": ["ledger"], "permissions": ["application.read", "application.write"]}
HEARTBEAT_SECS = 1.0  # server.eventHeartbeatSecs: an idle event stream gets a heartbeat this often
# How long a frozen Relay is watched: past three missed heartbeats and the console's 2 s of slack.
SILENT_HEARTBEATS = 7


@dataclass
class World:
    workdir: Path
    relay: RelayProcess
    sysdb: str
    ledger: ExecutorProcess
    browser: Browser


@pytest.fixture(scope="module")
def world(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("incident")
    config = relay_yaml(free_port(), pingIntervalSecs=1.0, pingWaitSecs=10.0)
    config["server"].update(eventPollSecs=0.2, eventHeartbeatSecs=HEARTBEAT_SECS, maxConcurrentRequests=MAX_REQUESTS)
    # The app's failed workflow (failed-1) fires this rule within a second, to the app's own
    # executors (the alert handler it lacks: the SDK logs it and answers success, so it is sent).
    config["alerts"] = {"checkIntervalSecs": 1}
    config["orgs"][0]["apps"][0]["alerts"] = [{"kind": "WorkflowFailure", "minIntervalSecs": 3600}]
    config["orgs"][0]["apps"] += [
        {"name": "paged", "executorTimeoutSecs": 60},
        {"name": "versions", "executorTimeoutSecs": 0.5},
    ]
    relay = RelayProcess(workdir, postgres.create_database("relay"), config)
    sysdb = postgres.create_database("sys")
    ledger: ExecutorProcess | None = None
    try:
        with chromium() as browser:
            relay.start()
            ledger = ExecutorProcess(
                workdir, sysdb, relay.conductor_url, module=APP_MODULE, env={"RELAY_TEST_SEED": "1"}
            )
            e = ledger
            assert_eventually(lambda: relay.state_of("acme", "ledger", e.executor_id) == "HEALTHY", 10)
            enqueued: LiteralString = "SELECT 1 FROM dbos.workflow_status WHERE status = 'ENQUEUED'"
            assert_eventually(lambda: not query(sysdb, enqueued), 20)
            yield World(workdir, relay, sysdb, ledger, browser)
    finally:
        if ledger is not None:
            ledger.stop()
        relay.stop()


@pytest.fixture
def page(world: World, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh browser context (its own sessionStorage) for each test; its console errors fail the test."""
    with console_page(world.browser, request, world.workdir, world.relay.log) as page:
        yield page


def query(url: str, sql: LiteralString, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return list(conn.execute(sql, params).fetchall())


def status_in_db(url: str, workflow_id: str) -> str | None:
    rows = query(url, "SELECT status FROM dbos.workflow_status WHERE workflow_uuid = %s", workflow_id)
    return str(rows[0][0]) if rows else None


def finish(world: World, workflow_id: str) -> None:
    """Send a ``parent`` workflow the message it waits for, and wait until it has succeeded."""
    client = DBOSClient(system_database_url=world.sysdb)
    try:
        client.send(workflow_id, "now", topic="go")
    finally:
        client.destroy()
    assert_eventually(lambda: status_in_db(world.sysdb, workflow_id) == "SUCCESS", 15)


def admin(page: Page, world: World) -> None:
    sign_in(page, world.relay.http, "acme", API_KEYS["acme"])


def go(page: Page, hash_route: str) -> None:
    page.evaluate("route => { location.hash = route; }", hash_route)


def settled(page: Page) -> None:
    expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)


def fact(page: Page, name: str) -> Any:
    """The value (``dd``) of one of a workflow page's facts."""
    return page.locator(f'dl.facts dt:text-is("{name}") + dd')


def hold_every_request_slot(stack: ExitStack, relay: RelayProcess) -> None:
    """Fill ``maxConcurrentRequests`` with real requests whose bodies never come (a slow client, or a
    burst of scripts during an incident): Relay answers every other API request 503 "too many
    requests in progress" until ``stack`` closes their sockets. The console's own reads may hold
    slots at that moment, and a held request refused then holds none: more are sent until Relay is
    busy."""

    def hold() -> None:
        s = stack.enter_context(socket.create_connection(("127.0.0.1", relay.port)))
        s.sendall(
            b"PATCH /v2/orgs/acme/apps/ledger HTTP/1.1\r\nHost: relay\r\n"
            b"Authorization: Bearer " + API_KEYS["acme"].encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )

    def busy() -> bool:
        with httpx.Client(base_url=relay.http, verify=TLS) as client:
            asked = client.get("/v2/orgs/acme/apps", headers={"Authorization": f"Bearer {API_KEYS['acme']}"})
        return asked.status_code == 503

    for _ in range(MAX_REQUESTS):
        hold()
    deadline = time.monotonic() + 10
    while not busy():
        assert time.monotonic() < deadline, "Relay still served requests 10 s after every slot was asked for"
        hold()
        time.sleep(0.1)


def test_a_reload_while_relay_answers_503_keeps_the_key(world: World, page: Page) -> None:
    """console.js's start: ``GET /whoami`` failing for any reason clears sessionStorage. A reload
    while Relay answers 503 (overloaded, its database briefly unreachable, an instance restarting
    behind a balancer) signs the operator out: they must find and paste the key again, in the middle
    of an incident, though the key is valid. A 503 (or no answer at all) says nothing about the key;
    only a 401 does. Here the reload's ``/whoami`` is answered 503 by Relay itself (every request
    slot held); once Relay serves again, a reload must land on the Apps page, still signed in."""
    admin(page, world)
    settled(page)
    with ExitStack() as held:

        def when_busy(route: Route) -> None:
            hold_every_request_slot(held, world.relay)  # the page's files are loaded; now Relay is busy
            route.continue_()

        page.route("**/v2/orgs/acme/whoami", when_busy, times=1)
        with page.expect_response(lambda r: r.url.endswith("/whoami")) as answered:
            page.reload()
        assert answered.value.status == 503, answered.value.status
        page.wait_for_timeout(500)  # the console has read the answer
    assert page.evaluate("sessionStorage.getItem('relay.key')") == API_KEYS["acme"], "a 503 signed the operator out"
    page.reload()
    expect(page.get_by_role("heading", name="Apps", exact=True)).to_be_visible()


def test_a_workflows_own_page_shows_it_finished_without_a_reload(world: World, page: Page) -> None:
    """A workflow's page (``#/apps/ledger/workflows/waiting-1``) reads again only on a ``workflow.*``
    audit entry (console-pages.js ``workflowPage``'s ``relevant``); a workflow that finishes is not
    audited, nothing polls, and the page has no Search button to press. An operator watching a stuck
    workflow after sending it what it waited for sees PENDING (and its Cancel button) long after
    the system database says SUCCESS, and may cancel or re-run work that is done."""
    admin(page, world)
    go(page, "#/apps/ledger/workflows/waiting-1")
    expect(fact(page, "Status")).to_have_text("PENDING")
    finish(world, "waiting-1")
    expect(fact(page, "Status")).to_have_text("SUCCESS", timeout=20_000)


def settings_entries(page: Page) -> list[str]:
    """The ``executorTimeoutSecs`` each listed ``settings.updated`` entry set (its detail's ``after``)."""
    details = page.get_by_role("table", name="Audit entries").locator(
        'tbody tr td:last-child li[data-key="after"] code'
    )
    return [str(json.loads(d)["executorTimeoutSecs"]) for d in details.all_inner_texts()]


def test_the_next_page_of_the_audit_log_repeats_no_entry_when_new_ones_come(world: World, page: Page) -> None:
    """The audit log is newest first, 100 at a time, paged with ``offset``. While the operator reads
    page 1 the incident goes on and new entries are written; "Next page" asks ``offset=100`` of the
    list as it is now, which has shifted by the new entries: page 2 starts with entries already
    read on page 1 (and, paging the other way, entries are skipped). Here 3 entries come between the
    pages, and 3 of page 1's entries are shown again on page 2."""

    def patch_many(first: int, count: int) -> None:
        with world.relay.api() as api:
            for n in range(first, first + count):
                assert api.patch("/apps/paged", json={"executorTimeoutSecs": n}).status_code == 200

    patch_many(1000, 110)
    admin(page, world)
    go(page, "#/audit?app=paged&action=settings.updated")
    settled(page)
    first = settings_entries(page)
    assert len(first) == 100 and first[0] == "1109", first[:3]
    patch_many(2000, 3)  # the incident goes on while page 1 is read
    page.get_by_role("button", name="Next page").click()
    expect(page.get_by_text("Showing 101\u2013")).to_be_visible()  # an en dash: "Showing 101 to 200"
    settled(page)
    second = settings_entries(page)
    again = sorted(set(first) & set(second))
    assert not again, f"page 2 shows again {len(again)} entries of page 1: {again}"


def test_a_key_limited_to_apps_is_not_offered_an_audit_log_that_is_only_a_403(world: World, page: Page) -> None:
    """README: "What the key may do decides what the console shows". ``GET /audit`` needs
    ``organization.read`` (relay/api/audit.py). A key made for one app (``application.read`` and
    ``application.write`` on ledger, as an app team's on-call gets) is offered **Audit log** in
    the main navigation, and the page is only the error "this API key lacks the permission
    organization.read (403)". (Instances was hidden for the same reason; Audit log was not.)"""
    with world.relay.api() as api:
        made = api.post("/tokens/incident-scoped", json=APP_TEAM)
    assert made.status_code == 201, made.text
    sign_in(page, world.relay.http, "acme", made.json()["token"])
    expect(page.get_by_role("row", name="ledger")).to_be_visible()
    audit = page.get_by_role("navigation", name="Main").get_by_role("link", name="Audit log")
    if audit.is_visible():
        audit.click()
        settled(page)
        alerts = page.locator("main p.alert").all_inner_texts()
        assert alerts == [], f"offered a page that is only a 403: {alerts}"


def test_focus_stays_on_the_page_after_cancel_removes_the_button_that_had_it(world: World, page: Page) -> None:
    """README: focus is moved "into and back out of dialogs". Confirming Cancel closes the dialog and
    gives focus back to the **Cancel…** button; the refresh that follows shows the workflow
    CANCELLED, without that button (``basePage.refresh`` finds no element of the same focus key), so
    focus falls to ``<body>``: a keyboard or screen-reader user is thrown to the top of the document
    with nothing said about where they are. Focus should land on something on the page (the
    outcome, the Resume button, the heading)."""
    client = DBOSClient(system_database_url=world.sysdb)
    try:
        client.enqueue({"queue_name": "serial", "workflow_name": "parent", "workflow_id": "cancel-me"}, 9, 3600.0)
    finally:
        client.destroy()
    assert_eventually(lambda: status_in_db(world.sysdb, "cancel-me") in ("PENDING", "ENQUEUED"), 10)
    admin(page, world)
    go(page, "#/apps/ledger/workflows/cancel-me")
    page.get_by_role("button", name="Cancel…").click()
    page.get_by_role("dialog").get_by_role("button", name="Cancel workflow").click()
    expect(page.locator("#action-status")).to_have_text("Cancelled cancel-me.")
    expect(fact(page, "Status")).to_have_text("CANCELLED")
    settled(page)
    focused = page.evaluate(
        "() => { const a = document.activeElement;"
        " return a && a !== document.body && a.isConnected ? (a.id || a.textContent || a.tagName) : null; }"
    )
    assert focused is not None, "after Cancel, focus is on <body>: the button that had it was removed"
    # A later refresh (the audit event of another action on it reads the page again) keeps focus on
    # the page: the outcome it fell back to, put back by each refresh, lost it as it was taken out.
    with page.expect_response(lambda r: r.url.split("?")[0].endswith("/apps/ledger/workflows/cancel-me")):
        with world.relay.api() as api:
            assert api.post("/apps/ledger/workflows/cancel-me/cancel").status_code < 300
    settled(page)
    focused = page.evaluate(
        "() => { const a = document.activeElement;"
        " return a && a !== document.body && a.isConnected ? (a.id || a.textContent || a.tagName) : null; }"
    )
    assert focused is not None, "after a later refresh, focus is on <body>: the outcome that had it was put back"


def enqueue_parent(world: World, workflow_id: str) -> None:
    """A ``parent`` workflow that waits an hour for its message: PENDING (or ENQUEUED behind another)."""
    client = DBOSClient(system_database_url=world.sysdb)
    try:
        client.enqueue({"queue_name": "serial", "workflow_name": "parent", "workflow_id": workflow_id}, 9, 3600.0)
    finally:
        client.destroy()
    assert_eventually(lambda: status_in_db(world.sysdb, workflow_id) in ("PENDING", "ENQUEUED"), 10)


def test_a_cancel_that_was_done_is_not_reported_as_failed_when_the_read_after_it_fails(
    world: World, page: Page
) -> None:
    """``act()`` in console-pages.js says "Cancelled X." and then reads the page again inside the same
    ``try``: when that read fails (Relay busy, 503; the executor slow, 504), the catch replaces the
    outcome with the read's error, in red. The workflow is cancelled (Relay answered 204 and audited
    it) but the outcome, which stays until the next action, says it failed: at 3 a.m. the operator
    cancels again, or escalates a cancel that worked. Here Relay's own 204 reaches the console while
    every request slot of Relay is held, so the read after it gets Relay's 503."""
    enqueue_parent(world, "cancel-busy")
    admin(page, world)
    go(page, "#/apps/ledger/workflows/cancel-busy")
    outcome = page.locator("#action-status")
    with ExitStack() as held:
        # What the handler met (None once the 204 went on to the console): its failure otherwise stays
        # in Playwright's dispatcher, and the console waits for an answer that never comes.
        handled: list[BaseException | None] = []

        def then_busy(route: Route) -> None:
            try:
                done = route.fetch()  # Relay cancels it: 204
                assert done.status == 204, done.status
                hold_every_request_slot(held, world.relay)
            except BaseException as exc:
                handled.append(exc)
                route.abort()
                return
            route.fulfill(response=done)
            handled.append(None)

        page.route("**/workflows/cancel-busy/cancel", then_busy, times=1)
        page.get_by_role("button", name="Cancel…").click()
        page.get_by_role("dialog").get_by_role("button", name="Cancel workflow").click()
        # The cancel, then every slot held: Relay's time and the handler's own bound (10 s), which a
        # loaded machine stretches; the console's part is timed on its own below.
        deadline = time.monotonic() + 60
        while not handled and time.monotonic() < deadline:
            page.wait_for_timeout(100)  # (Playwright's events, the handler among them, run meanwhile)
        assert handled == [None], handled
        expect(outcome).not_to_have_text("", timeout=10_000)
        page.wait_for_timeout(500)  # the read after the cancel has been answered
    assert_eventually(lambda: status_in_db(world.sysdb, "cancel-busy") == "CANCELLED", 10)
    expect(fact(page, "Status")).to_have_text("CANCELLED", timeout=15_000)  # read again once Relay serves
    expect(outcome).to_contain_text("Cancelled cancel-busy")


def test_a_key_limited_to_apps_sees_a_colleagues_cancel_without_a_reload(world: World, page: Page) -> None:
    """README: the console reads the page it shows again "when an event concerns it: ... an entry was
    audited"; the workflows pages listen for nothing else (``workflow.*`` audit entries). But the
    event stream sends audit events only to keys with ``organization.read`` (relay/api/events.py),
    which a key limited to apps does not have: for an app team's on-call key, a workflow a colleague
    cancels stays listed PENDING (the same page with an admin key shows it CANCELLED within a second)."""
    enqueue_parent(world, "colleague-cancels")
    with world.relay.api() as api:
        made = api.post("/tokens/incident-team", json=APP_TEAM)
    assert made.status_code == 201, made.text
    sign_in(page, world.relay.http, "acme", made.json()["token"])
    go(page, "#/apps/ledger/workflows")
    row = page.get_by_role("row").filter(has=page.get_by_role("link", name="colleague-cancels", exact=True))
    expect(row).to_contain_text(re.compile("PENDING|ENQUEUED"))
    expect(page.locator("#live")).to_have_text("Live")
    with world.relay.api() as api:
        assert api.post("/apps/ledger/workflows/colleague-cancels/cancel").status_code == 204
    assert_eventually(lambda: status_in_db(world.sysdb, "colleague-cancels") == "CANCELLED", 10)
    expect(row).to_contain_text("CANCELLED")


def test_a_long_workflow_id_does_not_push_the_workflows_table_off_the_screen(world: World, page: Page) -> None:
    """Workflow ids are the app's to choose (idempotency keys, hashes, message keys). The ``.id`` style
    (``word-break: break-all``) breaks ids everywhere but in the workflows table, where the id is a
    bare link (``workflowsTable``'s first column, also the children table and a workflow's Parent
    and Forked from): a 160-character id with no break in it widens the table past the window, and
    the Status column the operator looks for is scrolled out of sight (the page scrolls sideways)."""
    long_id = "a" * 160
    client = DBOSClient(system_database_url=world.sysdb)
    try:
        client.enqueue({"queue_name": "serial", "workflow_name": "job", "workflow_id": long_id}, 1)
    finally:
        client.destroy()
    assert_eventually(lambda: status_in_db(world.sysdb, long_id) is not None, 10)
    admin(page, world)
    go(page, "#/apps/ledger/workflows")
    expect(page.get_by_role("link", name=long_id, exact=True)).to_be_visible()
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], f"the page is {widths[0]} px wide in a {widths[1]} px window"


@contextmanager
def blocked_on_version(world: World, dead: str, peer: str) -> Iterator[None]:
    """``dead`` (version v1 of ``versions``) dies while ``peer``, on another version, is the only
    healthy executor: its recovery waits for an operator (``version_upgrade_not_allowed``) while
    the block lasts."""
    url = f"ws://127.0.0.1:{world.relay.port}/websocket/versions/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, peer, "answer", version=f"v-{peer}"):
        with SimulatedPeer(url, dead, "answer", version="v1"):
            pass  # it dies; the only healthy peer runs another version
        assert_eventually(lambda: (world.relay.executor("acme", "versions", dead) or {}).get("blockedReason")
                          == "version_upgrade_not_allowed", 15)  # fmt: skip
        yield


def test_a_recovery_waiting_for_an_operator_says_how_the_operator_acts(world: World, page: Page) -> None:
    """CONTRACT 3: without ``recoverToLatestVersion`` a dead executor whose version no healthy peer
    runs is blocked (``version_upgrade_not_allowed``), surfaced "(API, dashboard, metrics)", and
    waits "for an operator". The console's Recoveries card says "Waiting for an operator (version
    upgrade not allowed)" and gives that operator nothing: no Recover button (the API's
    ``POST .../executors/{id}/recover`` with ``toLatestVersion``; the CLI's ``relay recover APP
    EXECUTOR --to-latest``), not even the command to type, as the console gives for a workflow id
    it cannot open. The contract does not ask the console for the button; this test asks for a way
    out named on the card: a Recover button, or the command."""
    with blocked_on_version(world, "versions-v1", "versions-v2"):
        admin(page, world)
        go(page, "#/apps/versions/recoveries")
        card = page.locator('section.recovery:has(h2:has-text("versions-v1"))').first
        expect(card).to_contain_text("awaiting operator")
        expect(card).to_contain_text("Waiting for an operator (version upgrade not allowed)")
        recover = card.get_by_role("button", name=re.compile("recover", re.IGNORECASE))
        assert recover.count() or "relay recover" in card.inner_text(), (
            f"the card waits for an operator and offers no way to act: {card.inner_text()!r}"
        )


def test_recover_now_on_a_blocked_card_recovers_onto_the_latest_version(world: World, page: Page) -> None:
    """The way out the card offers, taken: **Recover now…** with "onto the latest version" (checked
    for a recovery that waits for an operator) starts the operator's recovery, the outcome links
    its run, and Relay records the operator's recovery with the permission to move onto the latest
    version (what the recovery does with it is tests/test_recovery.py's; a simulated peer has no
    versions to list)."""
    with blocked_on_version(world, "versions-old", "versions-v3"):
        admin(page, world)
        go(page, "#/apps/versions/recoveries?executor=versions-old")
        card = page.locator('section.recovery:has(h2:has-text("versions-old"))').first
        expect(card).to_contain_text("relay recover versions versions-old --to-latest")
        card.get_by_role("button", name=re.compile("Recover now")).click()
        dialog = page.get_by_role("dialog")
        expect(dialog.get_by_label(re.compile("Onto the latest version"))).to_be_checked()
        dialog.get_by_role("button", name="Recover now").click()
        outcome = page.locator("#action-status")
        expect(outcome).to_contain_text("versions-old")
        run = outcome.get_by_role("link").inner_text()
        with world.relay.api() as api:
            asked = api.get("/audit", params={"app": "versions", "action": "recovery.manual_requested"}).json()
        mine = [e["detail"] for e in asked if e["executorId"] == "versions-old"]
        assert [(d["recoveryId"], d["toLatestVersion"]) for d in mine] == [(run, True)], mine
        go(page, "#/apps/versions/executors")  # offered on the executors' page too, for one not HEALTHY
        expect(page.get_by_role("button", name="Recover now… (versions-old)")).to_be_visible()
        expect(page.get_by_role("button", name="Recover now… (versions-v3)")).to_have_count(0)


def test_a_recovery_ended_by_its_executors_return_is_not_shown_as_a_failure(world: World, page: Page) -> None:
    """An executor that reconnects while DEAD ends its recovery run: ``failed`` in the API (the
    contract's statuses have no other), and the card said "run 1 failed" with the error "the
    executor reconnected or its record is gone", as a run whose every peer failed: on-call read a
    failure where nothing is left to do. The card says the run ended as the executor came back."""
    url = f"ws://127.0.0.1:{world.relay.port}/websocket/versions/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "versions-returns", "answer", version="v-returns"):
        pass  # it dies, with no peer to recover it: its recovery waits
    assert_eventually(lambda: (world.relay.executor("acme", "versions", "versions-returns") or {}).get("blockedReason")
                      == "no_healthy_peer", 15)  # fmt: skip
    with SimulatedPeer(url, "versions-returns", "answer", version="v-returns"):

        def ended() -> bool:
            with world.relay.api() as api:
                runs = api.get("/apps/versions/recoveries", params={"executorId": "versions-returns"}).json()
            return [r["status"] for r in runs] == ["failed"]

        assert_eventually(ended, 15, what="its recovery ended by its return")
        admin(page, world)
        go(page, "#/apps/versions/recoveries?executor=versions-returns")
        card = page.locator('section.recovery:has(h2:has-text("versions-returns"))').first
        expect(card.locator("h2")).to_contain_text("ended: executor back")
        expect(card.locator("h2 .badge.failed")).to_have_count(0)
        expect(card.locator("ol.timeline")).to_contain_text("Ended: the executor reconnected")
        expect(card).to_contain_text("the executor reconnected: it is back")


def test_a_recovery_waiting_for_a_peer_of_its_language_says_so(world: World, page: Page) -> None:
    """An app mixing SDKs (README: an app's executors in one language): a TypeScript executor died
    beside a healthy Python one, and its recovery waits for a TypeScript peer
    (``no_peer_of_its_language``). The card said "Waiting for a healthy peer", and, once a
    TypeScript peer had been tried and lost, "Blocked: no healthy peer", while the app's executors
    page listed a healthy one: on-call read that the app had none. The card names the wait for a
    peer of the executor's language, and says which languages (the recovery's error). It said "a
    healthy peer of its language", not which: the recovery's ``language`` names it (TypeScript, as
    the SDKs are named). An app of its own, so that no other test's executors are its peers."""
    with world.relay.api() as api:
        assert api.put("/apps/mixed").status_code in (201, 204)
        assert api.patch("/apps/mixed", json={"executorTimeoutSecs": 0.5}).status_code == 200
    url = f"ws://127.0.0.1:{world.relay.port}/websocket/mixed/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "mixed-python", "answer"):
        with SimulatedPeer(url, "mixed-ts", "answer", language="typescript"):
            assert_eventually(lambda: world.relay.state_of("acme", "mixed", "mixed-ts") == "HEALTHY", 10)
        assert_eventually(lambda: (world.relay.executor("acme", "mixed", "mixed-ts") or {}).get("blockedReason")
                          == "no_peer_of_its_language", 15)  # fmt: skip

        def blocked_after_its_attempt() -> bool:
            with world.relay.api() as api:
                (run,) = api.get("/apps/mixed/recoveries", params={"executorId": "mixed-ts"}).json()
            return run["status"] == "waiting_for_peer" and [a["outcome"] for a in run["attempts"]] == ["failed"]

        # A TypeScript peer comes, is asked, and is lost (its socket closed as it is asked): none is left.
        with SimulatedPeer(url, "mixed-ts-peer", "close", language="typescript"):
            assert_eventually(blocked_after_its_attempt, 20, what="blocked again after its attempt failed")
        admin(page, world)
        go(page, "#/apps/mixed/recoveries?executor=mixed-ts")
        card = page.locator('section.recovery:has(h2:has-text("mixed-ts"))').first
        timeline = card.locator("ol.timeline")
        expect(timeline).to_contain_text("Waiting for a healthy TypeScript peer")
        expect(timeline).to_contain_text("Blocked: no healthy TypeScript peer")
        expect(card).to_contain_text("(python), which cannot run a typescript executor's workflows")

        # An answer without the language (an instance of the release before) says "of its language".
        def as_the_release_before(route: Route) -> None:
            answer = route.fetch()
            older = [{k: v for k, v in r.items() if k != "language"} for r in answer.json()]
            route.fulfill(response=answer, json=older)

        page.route("**/v2/orgs/acme/apps/mixed/recoveries?*", as_the_release_before)
        page.reload()
        expect(timeline).to_contain_text("Blocked: no healthy peer of its language")
        expect(timeline).to_contain_text("Waiting for a healthy peer of its language")


def test_an_apps_grace_period_is_shown_as_set_also_from_the_release_before(world: World, page: Page) -> None:
    """The Apps page's Grace period is the one set, a fraction included: ``versions`` has 0.5 s
    (relay.yaml), which the API's ``executorTimeoutSecs`` rounds up to 1 for Conductor's clients
    and ``gracePeriodSecs`` keeps. In a rolling upgrade the list may come from an instance of the
    release before, which had no ``gracePeriodSecs`` and served the value set in
    ``executorTimeoutSecs`` (the CLI reads either): the column read "undefined s". That answer is
    Relay's own with ``gracePeriodSecs`` taken out and ``executorTimeoutSecs`` as the value set."""
    admin(page, world)
    apps = page.get_by_role("table", name="Apps")

    def grace_of(app: str) -> Any:
        return apps.locator("tbody tr", has=page.get_by_role("link", name=app, exact=True)).locator("td").last

    expect(grace_of("versions")).to_have_text("0.5 s")

    older_answers = []

    def as_the_release_before(route: Route) -> None:
        older_answers.append(route.request.url)
        answer = route.fetch()
        older = [{k: v for k, v in a.items() if k != "gracePeriodSecs"} | {"executorTimeoutSecs": a["gracePeriodSecs"]}
                 for a in answer.json()]  # fmt: skip
        route.fulfill(response=answer, json=older)

    page.route("**/v2/orgs/acme/apps?*", as_the_release_before)
    page.reload()
    expect(grace_of("versions")).to_have_text("0.5 s")
    assert older_answers, "the page was not answered as the release before answers"


def test_a_disconnected_executor_says_when_it_is_declared_dead(world: World, page: Page) -> None:
    """An executor DISCONNECTED showed its state and since when, and nothing of when it would be
    declared DEAD: on-call had to find the app's grace period and add it up. The executors list and
    the executor's own page say it, from the API's ``graceEndsAt`` (its grace period's deadline).
    An app of its own, so that its death after the test (a minute later) is no other test's. The row
    shows the executor's SDK too (language and version): an app whose executors mix languages loses
    work (README), and the list showed no language."""
    with world.relay.api() as api:
        assert api.put("/apps/grace-shown").status_code in (201, 204)
        assert api.patch("/apps/grace-shown", json={"executorTimeoutSecs": 60}).status_code == 200
    url = f"ws://127.0.0.1:{world.relay.port}/websocket/grace-shown/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "grace-away", "answer"):
        assert_eventually(lambda: world.relay.state_of("acme", "grace-shown", "grace-away") == "HEALTHY", 10)

    def ends() -> str | None:
        found = world.relay.executor("acme", "grace-shown", "grace-away") or {}
        return found.get("graceEndsAt") if found.get("state") == "DISCONNECTED" else None

    assert_eventually(lambda: ends() is not None, 10, what="DISCONNECTED, its grace period's end known")
    shown = re.sub(r"\.\d+Z$", "Z", str(ends()).replace("T", " "))  # as the console writes a time
    admin(page, world)
    for address in ("#/apps/grace-shown/executors", "#/apps/grace-shown/executors?executor=grace-away"):
        go(page, address)
        row = page.locator('tbody tr:has([data-executor="grace-away"])')
        expect(row).to_contain_text(f"dead at {shown} unless it reconnects")
        # Its SDK, language and version, as its handshake said: an app mixing languages is seen here.
        expect(row.locator("td").nth(2)).to_have_text("python 3.2.0")  # (the first cell is a th)


def test_an_executor_id_leads_to_the_executor_or_once_recovered_to_its_recoveries(world: World, page: Page) -> None:
    """An executor id on a workflow's page, or a recovery's peer, was plain text; and an executor
    recovered (its record deleted) vanished from the Executors list, which said nothing of it while
    other executors were listed: the engineer paged about it found nothing there. Now the id links
    to the executor (its row while the registry holds it) and the list says which executors were
    recovered lately, each linked to its recovery run."""
    url = f"ws://127.0.0.1:{world.relay.port}/websocket/versions/{CONDUCTOR_KEYS['acme']}"
    replies: dict[str, Any] = {"recovery": {"success": True}, "exist_pending_workflows": {"exist": False}}
    with SimulatedPeer(url, "versions-keeper", "answer", version="v7", replies=replies):
        with SimulatedPeer(url, "versions-gone", "answer", version="v7"):
            pass  # it dies; the keeper recovers it and its record is deleted
        assert_eventually(lambda: world.relay.executor("acme", "versions", "versions-gone") is None, 15)
        admin(page, world)
        go(page, "#/apps/versions/executors")
        expect(page.locator("[data-executor=versions-keeper]")).to_be_visible()  # the list is not empty
        recent = page.locator("#recently-recovered")
        expect(recent).to_contain_text("1 recovery succeeded in the last hour, its executor removed from this list")
        recent.get_by_role("link", name="versions-gone", exact=True).click()
        expect(page).to_have_url(re.compile(r"#/apps/versions/recoveries\?executor=versions-gone$"))
        card = page.locator('section.recovery:has(h2:has-text("versions-gone"))').first
        expect(card).to_contain_text("succeeded")
        card.locator("ol.timeline").get_by_role("link", name="versions-keeper").first.click()
        expect(page.get_by_role("heading", name="Executor versions-keeper")).to_be_visible()
        expect(page.locator("[data-executor=versions-keeper]")).to_be_visible()
        expect(page.locator('tr[data-state="HEALTHY"]')).to_have_count(1)
        # An id the registry no longer holds: the page says so and where its recoveries are.
        go(page, "#/apps/versions/executors?executor=versions-gone")
        gone = page.locator("#executor-gone")
        expect(gone).to_contain_text("not in the registry")
        gone.get_by_role("link", name="its recoveries").click()
        expect(page.locator('section.recovery:has(h2:has-text("versions-gone"))').first).to_be_visible()
    # A workflow's executor, from its page, to that executor's row.
    go(page, "#/apps/ledger/workflows/done-1")
    executor_id = world.ledger.executor_id
    page.locator("dl.facts").get_by_role("link", name=executor_id, exact=True).click()
    expect(page.get_by_role("heading", name=f"Executor {executor_id}")).to_be_visible()
    expect(page.locator(f'tr[data-state="HEALTHY"] [data-executor="{executor_id}"]')).to_be_visible()


def test_an_executors_key_pasted_by_mistake_is_refused_with_a_word_on_why(world: World, page: Page) -> None:
    """relay.yaml holds two kinds of key side by side, and at 3 a.m. the wrong one gets pasted. The
    console signs in with any key ``/whoami`` accepts: an executor's conductor key (only
    ``websocket.connect``) is taken in as "prod in acme · read-only", and every page it is offered
    is only a 403 ("this API key lacks the permission application.read (403)"): nothing says that
    this is an executor's key and that the console wants an API key. A key that may read nothing
    the console shows should be refused at sign-in, saying so."""
    page.goto(f"{world.relay.http}/")
    page.get_by_label("Organization").fill("acme")
    page.get_by_label("API key").fill(CONDUCTOR_KEYS["acme"])
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_timeout(1_500)  # whoami, then (if it was taken in) the Apps page's read
    shown = page.locator("main").inner_text()
    assert "(403)" not in shown, f"signed in with a key that may read nothing: {shown!r}"
    expect(page.locator("#signin-error")).to_contain_text(re.compile("key", re.IGNORECASE))


def test_a_cancel_that_came_too_late_does_not_say_cancelled(world: World, page: Page) -> None:
    """A workflow can finish while the operator reads the Cancel dialog (or while its page, which is not
    read again when it finishes, still shows it PENDING). Cancelling a finished workflow changes
    nothing (DBOS leaves a SUCCESS as it is; Relay answers 204), and ``act()`` in console-pages.js
    says "Cancelled race-1." whatever the workflow's status is after it: the outcome, kept until
    the next action, says it was cancelled next to a Status of SUCCESS. The operator at 3 a.m. reads
    the green text and believes the work was stopped. Here the workflow gets its message and
    finishes just before Relay receives the cancel."""
    with world.relay.api() as api:
        forked = api.post("/apps/ledger/workflows/waiting-1/fork", json={"startStep": 1, "newWorkflowId": "race-1"})
    assert forked.status_code < 300, forked.text
    assert_eventually(lambda: status_in_db(world.sysdb, "race-1") == "PENDING", 15)
    admin(page, world)
    go(page, "#/apps/ledger/workflows/race-1")
    expect(fact(page, "Status")).to_have_text("PENDING")

    def finished_first(route: Route) -> None:
        finish(world, "race-1")
        route.continue_()

    page.route("**/workflows/race-1/cancel", finished_first, times=1)
    page.get_by_role("button", name="Cancel…").click()
    page.get_by_role("dialog").get_by_role("button", name="Cancel workflow").click()
    expect(fact(page, "Status")).to_have_text("SUCCESS")
    assert status_in_db(world.sysdb, "race-1") == "SUCCESS"
    outcome = page.locator("#action-status")
    expect(outcome).not_to_have_text("")
    assert "Cancelled race-1" not in outcome.inner_text(), f"says {outcome.inner_text()!r} of a SUCCESS workflow"


def test_a_console_refused_the_event_stream_for_too_many_streams_says_so(world: World, page: Page) -> None:
    """Relay caps the event streams of one key (``server.maxEventStreamsPerKey``, 8; beyond: 429, README
    "Live updates"). An on-call engineer with the console open in several tabs (or a team sharing
    an ops key) gets 429 for the next one, and the console says "Reconnecting…", the same words as
    for a Relay that is down, and keeps asking every 10 s: the operator believes Relay is
    unreachable, while it is refusing this tab a stream, and no page of this tab is read again when
    something changes. The console should say why live updates are missing."""
    with ExitStack() as held:
        for _ in range(12):  # the key's streams, as other tabs hold them, until Relay refuses one
            s = held.enter_context(socket.create_connection(("127.0.0.1", world.relay.port)))
            s.sendall(
                b"GET /v2/orgs/acme/events HTTP/1.1\r\nHost: relay\r\nAccept: text/event-stream\r\n"
                b"Authorization: Bearer " + API_KEYS["acme"].encode() + b"\r\n\r\n"
            )
            s.settimeout(10)
            got = s.recv(4096)
            while b"\r\n\r\n" not in got or (got.startswith(b"HTTP/1.1 200") and b"event: ready" not in got):
                more = s.recv(4096)
                assert more, got
                got += more
            if got.startswith(b"HTTP/1.1 429"):
                break
        else:
            raise AssertionError("Relay never refused a stream of the key")
        admin(page, world)
        settled(page)
        live = page.locator("#live")
        expect(live).not_to_have_text("")
        page.wait_for_timeout(2_000)
        assert live.inner_text() != "Reconnecting…", "refused a stream (429) and says it is reconnecting"


def test_a_failed_workflows_error_is_shown_without_asking_for_its_inputs_and_outputs(world: World, page: Page) -> None:
    """Conductor's console shows a workflow's details with its outcome; the on-call engineer opens a
    failed workflow to read why it failed. The workflow page read it with ``loadOutput=false``
    (outputs can be large, so they wait for **Show inputs and outputs**), and DBOS gives the
    error only with the output: ``failed-1``'s page said ERROR and not why, and nothing on the page
    said that the error was behind that button."""
    admin(page, world)
    go(page, "#/apps/ledger/workflows/failed-1")
    expect(fact(page, "Status")).to_have_text("ERROR")
    expect(fact(page, "Error")).to_contain_text("failed on purpose with 3")
    expect(page.get_by_role("heading", name="Input")).to_have_count(0)  # inputs and outputs still wait


PHONE_PAGES = (
    "#/",
    "#/apps/ledger/executors",
    "#/apps/ledger/recoveries",
    "#/apps/ledger/workflows",
    "#/apps/ledger/workflows/done-1",
    "#/apps/ledger/queues",
    "#/apps/ledger/schedules",
    "#/audit?app=ledger",
    "#/instances",
)


def test_no_page_scrolls_sideways_on_a_phone(world: World, page: Page) -> None:
    """README: the console is for on-call work, and on-call is often a phone. At 390 px wide the
    tables (Apps has nine columns, Executors seven, the workflows eight) were wider than the
    window, so the whole page scrolled sideways, header and filters with it, and the columns at
    the right (State, Status, Grace period) were out of sight. A wide table may scroll inside its
    own box, reachable with the keyboard; the page itself must fit the window."""
    page.set_viewport_size({"width": 390, "height": 800})
    admin(page, world)
    wide = []
    for route in PHONE_PAGES:
        go(page, route)
        settled(page)
        widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        if widths[0] > widths[1]:
            wide.append(f"{route}: {widths[0]} px")
        for box in page.locator("main .scroll").all():
            # a box that scrolls can be reached and scrolled with the keyboard (axe: scrollable-region-focusable)
            assert box.get_attribute("tabindex") == "0", route
    assert not wide, f"pages wider than the 390 px window: {wide}"


def test_the_alerts_of_an_app_and_its_rules_are_a_tab_of_the_app(world: World, page: Page) -> None:
    """Relay alerts (README "Alerts"), and the console showed nothing of it: no page of an app's
    alerting rules (``GET .../alerting-rules``: kind, destination, last fired) nor of the alerts
    that fired (the audit log's ``alert.sent`` and ``alert.failed``, found only by choosing the
    action in the whole org's log, as raw JSON). The on-call engineer asks "did it page, whom, and
    about what" on the app's own page. A read-only key made for the app, which may not read the
    audit log, sees the rules and when each last fired, and is told where the rest is, not shown
    a 403."""
    admin(page, world)
    go(page, "#/apps/ledger/executors")
    page.get_by_role("navigation", name="App ledger").get_by_role("link", name="Alerts").click()
    expect(page.get_by_role("heading", name="Alerts of ledger", exact=True)).to_be_visible()
    rule = page.get_by_role("table", name="Alerting rules of ledger").get_by_role("row", name="WorkflowFailure")
    expect(rule).to_contain_text("the alert handler of ledger")
    expect(rule).to_contain_text("relay.yaml")
    sent = page.get_by_role("table", name="Alerts of ledger, newest first").get_by_role("row", name="WorkflowFailure")
    expect(sent).to_contain_text("sent")  # live: the page reads again when the alert is audited
    expect(sent.get_by_role("link", name="any workflow")).to_have_count(0)
    expect(sent).to_contain_text("any workflow")
    expect(rule).not_to_contain_text("never")  # it has fired

    with world.relay.api() as api:
        made = api.post("/tokens/incident-alerts", json={"appNames": ["ledger"], "permissions": ["application.read"]})
    assert made.status_code == 201, made.text
    page.get_by_role("button", name="Sign out").click()
    sign_in(page, world.relay.http, "acme", made.json()["token"])
    go(page, "#/apps/ledger/alerts")
    settled(page)
    expect(
        page.get_by_role("table", name="Alerting rules of ledger").get_by_role("row", name="WorkflowFailure")
    ).not_to_contain_text("never")
    expect(page.locator("#alerts-unreadable")).to_contain_text("organization.read")
    assert page.locator("main p.alert").all_inner_texts() == []


def test_an_alerts_resolution_is_not_shown_as_the_same_alert_sent_again(world: World, page: Page) -> None:
    """An alert whose condition ends is followed by its resolution, to the same place (README
    "Alerts", Resolutions), audited as ``alert.sent`` too. The Alerts tab showed both rows alike
    (kind, "sent", the same subject): the on-call engineer read the end of an incident as the same
    page sent twice. A failure of ``failing`` (a fork of failed-1) fires a rule of a one-second
    window, whose next round resolves it."""
    with world.relay.api() as api:
        made = api.post(
            "/apps/ledger/alerting-rules",
            json={
                "ruleType": "WorkflowFailure",
                "ruleMetadata": {"workflowName": "failing", "windowSecs": 1},
                "receivingAppName": "ledger",
                "minIntervalSecs": 1,
            },
        )
        assert made.status_code == 201, made.text
        rule = made.json()["id"]
        forked = api.post("/apps/ledger/workflows/failed-1/fork", json={"startStep": 1, "newWorkflowId": "resolved-1"})
        assert forked.status_code < 300, forked.text
    try:
        admin(page, world)
        go(page, "#/apps/ledger/alerts")
        rows = page.get_by_role("table", name="Alerts of ledger, newest first").get_by_role("row", name="failing")
        expect(rows).to_have_count(2)  # live: the page reads again as each is audited
        expect(rows.nth(0)).to_contain_text("resolution sent")  # newest first: the resolution
        expect(rows.nth(1)).not_to_contain_text("resolution")
        expect(rows.nth(1)).to_contain_text("sent")
    finally:
        with world.relay.api() as api:
            assert api.delete(f"/apps/ledger/alerting-rules/{rule}").status_code == 204


def test_enter_twice_on_cancel_keeps_the_workflow(world: World, page: Page) -> None:
    """From the keyboard, **Cancel…** opens its confirmation with focus on **Cancel workflow**, the
    destructive button: a second Enter (a repeated key, a habit) cancels the workflow that the
    dialog was there to protect. WAI-ARIA's alert dialog pattern puts focus on the least
    destructive action; here Enter, Enter must leave the workflow running."""
    enqueue_parent(world, "keep-me")
    admin(page, world)
    go(page, "#/apps/ledger/workflows/keep-me")
    page.get_by_role("button", name="Cancel…").focus()
    page.keyboard.press("Enter")
    expect(page.get_by_role("dialog")).to_be_visible()
    page.keyboard.press("Enter")
    expect(page.get_by_role("dialog")).to_have_count(0)
    page.wait_for_timeout(500)  # a cancel, had one been sent, has been answered
    assert status_in_db(world.sysdb, "keep-me") != "CANCELLED", "Enter, Enter cancelled the workflow"
    expect(page.get_by_role("button", name="Cancel…")).to_be_focused()
    with world.relay.api() as api:  # it holds the serial queue: done with it
        assert api.post("/apps/ledger/workflows/keep-me/cancel").status_code == 204


def test_an_audited_refusal_reads_as_words_and_links_its_workflow(world: World, page: Page) -> None:
    """The audit log is where the on-call engineer reads what was done (and refused) during the
    incident. Its Detail column was the entry's JSON on one line: a refused resume read
    ``{"error":"workflow done-1 (SUCCESS) has finished ...","result":"failure","workflowIds":["done-1"]}``,
    the error a JSON string among braces and the workflow it names not a link to its page."""
    with world.relay.api() as api:
        assert api.post("/apps/ledger/workflows/done-1/resume").status_code == 409
    admin(page, world)
    go(page, "#/audit?app=ledger&action=workflow.resume")
    settled(page)
    row = page.get_by_role("table", name="Audit entries").locator("tbody tr").first
    detail = row.locator("td").last
    expect(detail.locator('li[data-key="error"]')).to_have_text(
        "error: workflow done-1 (SUCCESS) has finished and cannot be resumed; fork it to run it again"
    )
    expect(detail).not_to_contain_text('{"')
    detail.get_by_role("link", name="done-1", exact=True).click()
    expect(page.get_by_role("heading", name="Workflow done-1")).to_be_visible()


def test_the_queues_tab_says_what_each_queue_holds_now(world: World, page: Page) -> None:
    """Conductor's queues tab shows the workflows enqueued and running on each queue; Relay's listed
    only how the queues are declared (concurrency, rate limit), so "is the queue stuck, since
    when?" took a search per queue and status. Here ``serial`` (concurrency 1) runs one workflow
    that waits and holds another behind it: the tab says 1 running, at least 1 enqueued (linked to
    them) and since when."""
    enqueue_parent(world, "queue-head")
    enqueue_parent(world, "queue-behind")
    try:
        assert_eventually(lambda: status_in_db(world.sysdb, "queue-head") == "PENDING", 10)
        admin(page, world)
        go(page, "#/apps/ledger/queues")
        row = page.get_by_role("table", name="Queues of ledger").get_by_role("row", name="serial")
        cells = row.locator("td")
        expect(cells.nth(1)).to_have_text("1")  # Running
        expect(row.get_by_role("time")).to_have_count(1)  # the oldest enqueued, since when
        cells.nth(0).get_by_role("link").click()
        expect(page.get_by_label("Status")).to_have_value("ENQUEUED")
        expect(page.get_by_role("link", name="queue-behind", exact=True)).to_be_visible()
    finally:
        with world.relay.api() as api:  # they hold the serial queue: done with them
            for workflow_id in ("queue-behind", "queue-head"):
                assert api.post(f"/apps/ledger/workflows/{workflow_id}/cancel").status_code == 204


def test_a_workflow_stuck_behind_its_queue_can_be_started_now(world: World, page: Page) -> None:
    """Conductor's console resumes "any ENQUEUED, DELAYED, CANCELLED or MAX_RECOVERY_ATTEMPTS_EXCEEDED
    workflow" (dbos-docs conductor/workflow-management): an ENQUEUED one starts at once, outside
    its queue's limits, which is how an on-call engineer gets one urgent workflow past a queue
    held by another. Relay's API does it (``POST .../resume``), but the console offered an ENQUEUED
    workflow only Cancel. Here ``serial`` (concurrency 1) runs ``start-head``, which waits, and
    ``start-behind`` waits behind it: Resume, confirmed, runs it."""
    enqueue_parent(world, "start-head")
    enqueue_parent(world, "start-behind")
    try:
        assert_eventually(lambda: status_in_db(world.sysdb, "start-head") == "PENDING", 10)
        assert status_in_db(world.sysdb, "start-behind") == "ENQUEUED"
        admin(page, world)
        go(page, "#/apps/ledger/workflows/start-behind")
        expect(fact(page, "Status")).to_have_text("ENQUEUED")
        page.get_by_role("button", name="Resume…").click()
        dialog = page.get_by_role("dialog", name="Start this workflow now?")
        expect(dialog).to_contain_text("outside its queue's concurrency and rate limits")
        dialog.get_by_role("button", name="Start now").click()
        expect(page.locator("#action-status")).to_have_text("Resumed start-behind.")
        assert_eventually(lambda: status_in_db(world.sysdb, "start-behind") == "PENDING", 10)
    finally:
        with world.relay.api() as api:  # they hold the serial queue: done with them
            for workflow_id in ("start-behind", "start-head"):
                assert api.post(f"/apps/ledger/workflows/{workflow_id}/cancel").status_code == 204


def test_a_read_only_key_is_told_why_a_failed_workflow_offers_no_action(world: World, page: Page) -> None:
    """A viewer key (``role: viewer``) opening the failed workflow it was paged about found no Fork,
    Resume or Cancel and no word on why: the buttons were left out in silence, and "read-only"
    was only a word in the header. The page says that the key may not act, and what would."""
    sign_in(page, world.relay.http, "acme", VIEWER_KEYS["acme"])
    go(page, "#/apps/ledger/workflows/failed-1")
    expect(fact(page, "Error")).to_contain_text("failed on purpose")
    expect(page.get_by_role("button", name=re.compile("Fork|Resume|Cancel"))).to_have_count(0)
    expect(page.locator("#read-only-note")).to_contain_text("application.write")


def test_a_frozen_relay_is_not_shown_as_live(world: World, page: Page) -> None:
    """Relay sends a heartbeat on an idle event stream every ``eventHeartbeatSecs`` so that a reader can
    tell a quiet stream from a dead one; the console never looks (``readEvents`` only waits for the
    next bytes). When Relay's instance freezes (a stopped VM, a GC pause, a network path that drops
    packets without a reset) the socket stays open, no heartbeat comes, and the console keeps
    saying **Live** while nothing it shows is read again. Here Relay is stopped (SIGSTOP) for seven
    heartbeats; the console should say it is not live (it learns their interval from ``ready``).
    Runs last: it freezes the module's Relay."""
    admin(page, world)
    go(page, "#/apps/ledger/executors")
    settled(page)
    live = page.locator("#live")
    expect(live).to_have_text("Live")
    world.relay.signal(signal.SIGSTOP)
    try:
        page.wait_for_timeout(SILENT_HEARTBEATS * HEARTBEAT_SECS * 1000)
        shown = live.inner_text()
    finally:
        world.relay.signal(signal.SIGCONT)
    silent = SILENT_HEARTBEATS * HEARTBEAT_SECS
    assert shown != "Live", f"Relay has sent nothing for {silent:g} s and the console says {shown!r}"


def test_the_queues_tab_reads_its_figures_again_after_a_failure_that_passes(world: World, page: Page) -> None:
    """The Queues tab reads what each queue holds every 10 s; one failed read (here a 503, as Relay
    answers when no executor can be asked or its database is away for a moment) stopped that for as
    long as the page was shown, leaving "could not be read" on an on-call engineer's screen after
    the cause had passed. Only an SDK that cannot aggregate at all (501) is not asked again."""
    admin(page, world)
    failed = {"n": 0}

    def once_unavailable(route: Route) -> None:
        failed["n"] += 1
        problem = {"title": "Service Unavailable", "status": 503, "error": {"code": "database_unavailable"}}
        route.fulfill(status=503, content_type="application/problem+json", body=json.dumps(problem))

    page.route("**/apps/ledger/workflows/aggregates", once_unavailable, times=1)
    go(page, "#/apps/ledger/queues")
    expect(page.get_by_role("alert")).to_contain_text("could not be read")
    assert failed["n"] == 1
    row = page.get_by_role("table", name="Queues of ledger").get_by_role("row", name="serial")
    expect(row.locator("td").nth(1)).to_have_text("0", timeout=20_000)  # read again, and served
    expect(page.get_by_text("could not be read")).to_have_count(0)
