"""The operator console in a real browser (Debian's Chromium, driven by Playwright) against a real
Relay with real DBOS 3.2 executors: what an operator sees and does, checked against what Relay's
API and the apps' system databases hold.

One world for the module (each start costs seconds): one Relay, the app ``ledger`` served by a
seeded harness/workflow_app.py executor (workflows with steps, a child, one waiting, one failed),
and the app ``payments`` with one harness/executor_app.py executor holding sleeping workflows, the
one that is killed with SIGKILL. Screenshots of the main pages go to docs/screenshots/ (the README
shows two of them). The tests run in file order: the kill comes first, while ``payments`` has a
single executor.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import string
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, LiteralString
from urllib.parse import parse_qs, quote, unquote, urlsplit

import httpx
import psycopg
import pytest
from dbos import DBOSClient
from playwright.sync_api import Browser, Locator, Page, expect
from websockets.sync.client import connect

from harness.browser import axe_violations, chromium, chromium_path, console_page, screenshot, sign_in, watch
from harness.executors import ExecutorProcess
from harness.haproxy import Haproxy
from harness.keys import API_KEYS, CONDUCTOR_KEYS, VIEWER_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer, info_reply
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.cli import main as cli_main
from relay.store.db import Database
from relay.store.lease import Lease

expect.set_options(timeout=10_000)
README = Path(__file__).resolve().parents[1] / "README.md"
GRACE_SECS = 3.0  # payments: long enough to see DISCONNECTED on the page, short for the test
APP_MODULE = "harness.workflow_app"


@dataclass
class World:
    workdir: Path
    relay: RelayProcess
    sysdb: str  # ledger's system database
    paysys: str  # payments' system database
    ledger: ExecutorProcess
    payments: ExecutorProcess
    browser: Browser
    started: list[ExecutorProcess]  # every executor the module started, to stop at its end


@pytest.fixture(scope="module")
def world(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("console")
    # Liveness is not what these tests are about (a kill is seen by its socket's close): pings
    # spaced so that a loaded machine's executors are not dropped for a late pong.
    config = relay_yaml(free_port(), pingIntervalSecs=1.0, pingWaitSecs=10.0)
    config["server"].update(eventPollSecs=0.2)
    config["orgs"][0]["apps"].append({"name": "payments", "executorTimeoutSecs": GRACE_SECS})
    relay = RelayProcess(workdir, postgres.create_database("relay"), config)
    sysdb, paysys = postgres.create_database("sys"), postgres.create_database("pay")
    executors: list[ExecutorProcess] = []
    try:
        with chromium() as browser:  # first: without a browser there is nothing to test
            relay.start()
            executors.append(ExecutorProcess(workdir, sysdb, relay.conductor_url, module=APP_MODULE,
                                             env={"RELAY_TEST_SEED": "1"}))  # fmt: skip
            executors.append(ExecutorProcess(workdir, paysys, relay.conductor_url, app="payments", sleepers=2))
            for e in executors:
                assert_eventually(lambda: relay.state_of("acme", e.app, e.executor_id) == "HEALTHY", 10)  # noqa: B023
            # The seeded queue's jobs run just after seeding: let the database hold still.
            enqueued: LiteralString = "SELECT 1 FROM dbos.workflow_status WHERE status = 'ENQUEUED'"
            assert_eventually(lambda: not query(sysdb, enqueued), 20)
            yield World(workdir, relay, sysdb, paysys, *executors, browser, executors)
    finally:
        for e in executors:
            e.stop()
        relay.stop()


@pytest.fixture
def page(world: World, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh browser context (its own sessionStorage) for each test; its console errors fail the test."""
    with console_page(world.browser, request, world.workdir, world.relay.log) as page:
        yield page


# HTML's valid global date-time string in UTC: at most three fraction digits (Relay serves six).
HTML_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,3})?Z")


def html_times(page_times: list[str | None], served: list[str]) -> None:
    """The ``datetime`` attributes of a page's ``<time>`` elements are valid HTML and are the times Relay
    served (six fraction digits), to the millisecond: a browser reads them as the same instant."""
    assert all(t is not None and HTML_TIME.fullmatch(t) for t in page_times), page_times
    assert page_times == [s[:23] + "Z" for s in served], (page_times, served)


def query(url: str, sql: LiteralString, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return list(conn.execute(sql, params).fetchall())


def status_in_db(url: str, workflow_id: str) -> str | None:
    rows = query(url, "SELECT status FROM dbos.workflow_status WHERE workflow_uuid = %s", workflow_id)
    return str(rows[0][0]) if rows else None


def admin(page: Page, world: World) -> None:
    sign_in(page, world.relay.http, "acme", API_KEYS["acme"])


def go(page: Page, hash_route: str) -> None:
    """Follow a route inside the console, as a link would (no reload: the hash changes)."""
    page.evaluate("route => { location.hash = route; }", hash_route)


def reads_of(workflow_id: str) -> Any:
    """A predicate for ``page.expect_request``: the console reads this workflow (again)."""
    return lambda r: r.method == "GET" and urlsplit(r.url).path.endswith(f"/workflows/{workflow_id}")


def states_on_page(page: Page) -> list[str]:
    return list(page.eval_on_selector_all("tbody tr[data-state]", "rows => rows.map(r => r.dataset.state)"))


def test_without_chromium_the_browser_tests_fail_saying_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Never a skip: no Chromium is an error that says what to install (./test.sh installs it as root)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("RELAY_CHROMIUM", raising=False)
    with pytest.raises(RuntimeError, match=r"apt-get install -y chromium"):
        chromium_path()
    monkeypatch.setenv("RELAY_CHROMIUM", str(tmp_path / "no-such-chromium"))
    with pytest.raises(RuntimeError, match="RELAY_CHROMIUM"):
        chromium_path()
    monkeypatch.setenv("RELAY_CHROMIUM", "/usr/bin/chromium")
    assert chromium_path() == "/usr/bin/chromium"


# -- signing in --------------------------------------------------------------------------------------


def test_sign_in_with_a_key_shows_the_apps_and_sign_out_forgets_the_key(world: World, page: Page) -> None:
    page.goto(f"{world.relay.http}/")
    page.get_by_label("Organization").fill("acme")
    page.get_by_label("API key").fill("not-a-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("not valid")

    admin(page, world)
    expect(page.locator("#who")).to_have_text("ops in acme")
    expect(page.locator("#live")).to_have_text("Live")  # the event stream is open
    rows = page.locator("tbody tr")
    expect(rows).to_have_count(2)
    expect(page.get_by_role("row", name="ledger")).to_contain_text("Available")
    expect(page.get_by_role("row", name="payments")).to_contain_text("v1: 1 healthy")
    assert page.evaluate("sessionStorage.getItem('relay.key')") == API_KEYS["acme"]
    screenshot(page, "apps")

    page.reload()  # the key is kept for the tab
    expect(page.get_by_role("heading", name="Apps", exact=True)).to_be_visible()
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in to Relay")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('relay.key')") is None


PREFIX_PROXY = """\
global
    maxconn 100
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend public
    bind 127.0.0.1:{port}
    http-request deny deny_status 404 unless {{ path_beg /{prefix}/ }}
    default_backend relay
backend relay
    http-request replace-path /{prefix}(/.*) \\1
    http-request set-header X-Forwarded-Prefix /{prefix}
    server relay 127.0.0.1:{relay_port}
"""


def test_the_console_and_the_api_browser_work_under_a_path_prefix(world: World, page: Page) -> None:
    """A platform team serving Relay at ``/relay/`` of a shared host, behind a reverse proxy that
    takes the prefix off (haproxy here): the console read its files and the API from the host's
    root, none of which the proxy serves, and showed nothing. Everything it reads is below the
    prefix now, the event stream included; so are the API browser's document and the calls of its
    "Try it out", which would otherwise go to the host's root."""
    proxy = prefix_proxy(world, "relay")
    paths: list[str] = []
    page.on("request", lambda r: paths.append(urlsplit(r.url).path))
    try:
        sign_in(page, f"http://127.0.0.1:{proxy.port}/relay", "acme", API_KEYS["acme"])
        expect(page.locator("#live")).to_have_text("Live")  # the event stream, through the prefix
        expect(page.get_by_role("row", name="payments")).to_contain_text("v1: 1 healthy")
        try_whoami_in_the_api_browser(page, f"http://127.0.0.1:{proxy.port}/relay")
    finally:
        proxy.stop()
    assert paths and all(p.startswith("/relay/") for p in paths), paths


def test_the_api_browsers_try_it_out_goes_below_a_prefix_the_apis_paths_also_start_with(
    world: World, page: Page
) -> None:
    """Relay served at ``/v2/`` of a host: "Try it out" took the API's own ``/v2/orgs/...`` for a
    path already below the prefix, so the call went to the host's ``/v2/orgs/...`` (the proxy
    passed ``/orgs/...`` on, a 404). Every call of the API browser goes below the prefix."""
    proxy = prefix_proxy(world, "v2")
    try:
        try_whoami_in_the_api_browser(page, f"http://127.0.0.1:{proxy.port}/v2")
    finally:
        proxy.stop()


def test_the_conductor_api_document_names_its_server_below_the_prefix(world: World) -> None:
    """Relay served at ``/relay/`` by a proxy that takes the prefix off and names it in
    X-Forwarded-Prefix: the documents at ``/relay/conductor/v2/openapi.json`` and
    ``/relay/v2/openapi.json`` named their server ``/conductor``, from the host's root, so a client
    made from them (schemathesis, dbos-mcp) called the host's ``/conductor/v2/...``, which the proxy
    does not serve (404). They name ``/relay/conductor`` now, where the API answers."""
    proxy = prefix_proxy(world, "relay")
    root = f"http://127.0.0.1:{proxy.port}"
    try:
        for where in ("/relay/conductor/v2/openapi.json", "/relay/v2/openapi.json"):
            document = httpx.get(f"{root}{where}")
            assert document.status_code == 200, (where, document.text)
            assert document.json()["servers"] == [{"url": "/relay/conductor"}], where
            base = httpx.URL(f"{root}{where}").join(document.json()["servers"][0]["url"])
            apps = httpx.get(f"{base}/v2/orgs/acme/apps", headers={"Authorization": f"Bearer {API_KEYS['acme']}"})
            assert apps.status_code == 200 and "payments" in {a["name"] for a in apps.json()}, (where, apps.text)
    finally:
        proxy.stop()


def prefix_proxy(world: World, prefix: str) -> Haproxy:
    """haproxy on 127.0.0.1:``proxy.port``, serving the world's Relay below ``/{prefix}/`` and
    taking the prefix off."""
    port = free_port()
    config = PREFIX_PROXY.format(port=port, relay_port=world.relay.port, prefix=prefix)
    return Haproxy(config, port, world.workdir / f"prefix-{prefix}.log")


def try_whoami_in_the_api_browser(page: Page, base: str) -> None:
    """In the API browser at ``{base}/docs``, as an operator: Authorize with the key, "Try it out"
    on GET /v2/orgs/{org}/whoami, Execute. The call goes to ``{base}/v2/orgs/acme/whoami`` and is
    answered 200, as the page shows."""
    page.goto(f"{base}/docs")
    expect(page.get_by_role("heading", name=re.compile("Relay"))).to_be_visible()
    page.locator("button.authorize").first.click()
    page.get_by_label("auth-bearer-value").fill(API_KEYS["acme"])
    page.locator(".auth-btn-wrapper button.authorize").click()
    page.get_by_role("button", name="Close").click()
    whoami = page.locator("#operations-org-whoami_v2_orgs__org__whoami_get")
    whoami.locator(".opblock-summary-control").click()
    whoami.get_by_role("button", name="Try it out").click()
    whoami.get_by_placeholder("org").fill("acme")
    with page.expect_response(lambda r: r.request.method == "GET" and "/whoami" in r.url) as executed:
        whoami.get_by_role("button", name="Execute").click()
    assert executed.value.url == f"{base}/v2/orgs/acme/whoami", executed.value.url
    assert executed.value.status == 200, executed.value.text()
    assert executed.value.json()["org"] == "acme", executed.value.text()
    expect(whoami.locator(".request-url")).to_contain_text(f"{base}/v2/orgs/acme/whoami")
    expect(whoami.locator(".live-responses-table tbody .response-col_status")).to_have_text("200")


def test_a_key_renamed_while_signed_in_is_shown_by_its_new_name(world: World, page: Page) -> None:
    """A rename keeps the key working and its event stream open, and a key without
    organization.read hears of no key's change: the header kept the old name until a reload."""
    admin_key = {"Authorization": f"Bearer {API_KEYS['acme']}"}
    tokens = f"{world.relay.http}/v2/orgs/acme/tokens"
    created = httpx.post(
        f"{tokens}/night-shift", json={"permissions": ["application.read"]}, headers=admin_key, verify=TLS
    )
    assert created.status_code == 201, created.text
    try:
        sign_in(page, world.relay.http, "acme", created.json()["token"])
        expect(page.locator("#who")).to_have_text("night-shift in acme · read-only")
        renamed = httpx.patch(f"{tokens}/night-shift", json={"newName": "day-shift"}, headers=admin_key, verify=TLS)
        assert renamed.status_code == 200, renamed.text
        go(page, "#/apps/ledger")
        expect(page.locator("#who")).to_have_text("day-shift in acme · read-only")
    finally:
        for name in ("night-shift", "day-shift"):
            httpx.delete(f"{tokens}/{name}", headers=admin_key, verify=TLS)


def test_a_key_refused_the_event_stream_asks_for_it_once_and_says_so(world: World, page: Page) -> None:
    """A key that signs in but lacks ``application.read`` (one that reads the audit log and the
    instances) gets 403 from /events, and will every time: the console stops there. Retrying, it
    asked again after 1, 3, 7 s... (then every 10 s)."""
    with world.relay.api() as api:
        made = api.post("/tokens/console-org-only", json={"permissions": ["organization.read"]})
    assert made.status_code == 201, made.text
    watched = watch(page)
    sign_in(page, world.relay.http, "acme", made.json()["token"])
    page.wait_for_timeout(4_000)  # a console that retried would have asked twice more by now
    streams = [path for _, path, _, _ in watched.requests if path.endswith("/events")]
    assert streams == ["/v2/orgs/acme/events"], streams
    expect(page.locator("#live")).to_have_text("Live updates are not available for this key")


# -- an executor's death and recovery, live -----------------------------------------------------------


def test_a_killed_executor_goes_disconnected_dead_and_recovered_on_the_page_without_a_reload(
    world: World, page: Page
) -> None:
    admin(page, world)
    victim = world.payments
    go(page, "#/apps/payments/executors")
    healthy = page.locator(f'tbody tr[data-state="HEALTHY"]:has([data-executor="{victim.executor_id}"])')
    expect(healthy).to_be_visible()
    record = world.relay.executor("acme", "payments", victim.executor_id)
    assert record is not None
    cells = healthy.locator("td").all_inner_texts()  # state, version, SDK, host, instance, since, recoveries
    sdk = f"{record['language']} {record['dbosVersion']}"
    assert cells[1:5] == [record["applicationVersion"], sdk, record["hostname"], "relay-1"], cells
    html_times([healthy.locator("time").get_attribute("datetime")], [record["connectedAt"]])  # since it connected
    page.evaluate("window.__sameDocument = true")  # gone if the page were reloaded

    before_kill = time.monotonic()  # the grace period counts from the disconnection, after this
    os.kill(victim.proc.pid, signal.SIGKILL)  # a real kill -9 of the executor process
    victim.proc.wait()
    killed = time.monotonic()
    expect(page.locator('tbody tr[data-state="DISCONNECTED"]')).to_be_visible(timeout=GRACE_SECS * 1000)
    seen_disconnected = time.monotonic() - killed
    # Its only peer is gone: DEAD, and blocked until an executor of the app connects.
    dead = page.locator('tbody tr[data-state="DEAD"]')
    expect(dead).to_be_visible(timeout=(GRACE_SECS + 5) * 1000)
    assert time.monotonic() - before_kill >= GRACE_SECS - 0.5, "declared dead before its grace period ran out"
    expect(dead).to_contain_text("blocked: no healthy peer")
    assert seen_disconnected < GRACE_SECS
    to_recoveries = dead.get_by_role("link", name="Recoveries")
    assert to_recoveries.get_attribute("href") == f"#/apps/payments/recoveries?executor={victim.executor_id}"
    screenshot(page, "executors")

    page.get_by_role("link", name="Apps", exact=True).first.click()  # the overview highlights it
    blocked_row = page.get_by_role("row", name="payments")
    expect(blocked_row).to_have_class("blocked-row")
    expect(blocked_row).to_contain_text("1 blocked")
    page.go_back()

    peer = ExecutorProcess(world.workdir, world.paysys, world.relay.conductor_url, app="payments")
    world.started.append(peer)  # stopped by the fixture
    expect(page.locator(f'tbody tr[data-state="HEALTHY"]:has([data-executor="{peer.executor_id}"])')).to_be_visible()
    expect(page.locator("tbody tr[data-state]")).to_have_count(1, timeout=10_000)  # the dead one recovered: deleted
    assert world.relay.executor("acme", "payments", victim.executor_id) is None
    assert page.evaluate("window.__sameDocument") is True

    page.get_by_role("link", name="Recoveries").click()
    card = page.locator(f'section.recovery:has-text("{victim.executor_id}")')
    expect(card).to_contain_text("succeeded")
    timeline = card.get_by_role("list")
    labels = ["DEAD", "Waiting for a healthy peer", "Attempt 1: dispatched", "Peer", "Verified", "Deleted"]
    expect(timeline.locator(".step-title")).to_have_text(labels)
    expect(timeline).to_contain_text(peer.executor_id)
    with world.relay.api() as api:
        (recovery,) = api.get("/apps/payments/recoveries", params={"executorId": victim.executor_id}).json()
    attempt = recovery["attempts"][-1]
    assert attempt["peerExecutorId"] == peer.executor_id and attempt["outcome"] == "succeeded"
    (waited,) = [t["at"] for t in recovery["timeline"] if t["action"] == "recovery.waiting_for_peer"]
    times = [recovery["deadAt"], waited, attempt["dispatchedAt"], attempt["endedAt"], attempt["deletedAt"]]
    shown = timeline.locator("time").evaluate_all("ts => ts.map(t => t.getAttribute('datetime'))")
    html_times(shown, times)  # each step with its time, from the recovery's audit entries
    assert times == sorted(times)
    screenshot(page, "recovery")


# -- workflows -------------------------------------------------------------------------------------


def test_workflows_are_listed_a_page_at_a_time_and_filtered_as_the_system_database_has_them(
    world: World, page: Page
) -> None:
    admin(page, world)
    watched = watch(page)
    go(page, "#/apps/ledger/workflows")
    listed = page.locator("tbody tr")
    expected = query(world.sysdb, "SELECT workflow_uuid FROM dbos.workflow_status")
    expect(listed).to_have_count(len(expected))
    assert set(listed.locator("th").all_inner_texts()) == {r[0] for r in expected}
    screenshot(page, "workflows")

    page.get_by_label("Status").select_option("ERROR")
    page.get_by_role("button", name="Search").click()
    errors = {r[0] for r in query(world.sysdb, "SELECT workflow_uuid FROM dbos.workflow_status WHERE status = 'ERROR'")}
    expect(listed).to_have_count(len(errors))
    assert set(listed.locator("th").all_inner_texts()) == errors == {"failed-1"}

    go(page, "#/apps/ledger/workflows?queue=serial&name=job")
    expect(listed).to_have_count(3)
    assert set(listed.locator("th").all_inner_texts()) == {"queued-0", "queued-1", "queued-2"}
    searches = [body for method, path, _, body in watched.requests if path.endswith("/workflows/search")]
    assert searches and all(body["limit"] == 50 and body["offset"] == 0 for body in searches)
    assert {"status": ["ERROR"]}.items() <= searches[-2].items()
    assert searches[-1]["queueName"] == ["serial"] and searches[-1]["workflowName"] == ["job"]


def test_a_workflow_shows_its_steps_as_a_timeline_its_child_and_its_data_on_demand(world: World, page: Page) -> None:
    admin(page, world)
    watched = watch(page)
    go(page, "#/apps/ledger/workflows/done-1")
    steps = page.get_by_role("list", name="Steps (", exact=False)
    rows = query(
        world.sysdb,
        "SELECT function_id, function_name FROM dbos.operation_outputs WHERE workflow_uuid = %s ORDER BY function_id",
        "done-1",
    )
    expect(steps.locator(":scope > li")).to_have_count(len(rows))
    titles = steps.locator(".step-title").all_inner_texts()
    assert titles == [f"Step {n}: {name}" for n, name in rows]
    expect(steps).to_contain_text("child done-1-child")
    children = page.get_by_role("table", name="Child workflows of done-1")
    expect(children.locator("tbody tr")).to_have_count(1)
    expect(children).to_contain_text("done-1-child")
    expect(page.locator("pre")).to_have_count(0)  # inputs and outputs only when asked

    def reads() -> list[tuple[list[str], list[str]]]:
        asked = [q for method, path, q, _ in watched.requests if path.endswith("/workflows/done-1")]
        return [(q["loadInput"], q["loadOutput"]) for q in asked]

    before = reads()  # the page may read it again when a live update arrives: never with the data
    assert before and set(map(str, before)) == {str((["false"], ["false"]))}
    page.get_by_role("button", name="Show inputs and outputs").click()
    expect(page.get_by_role("heading", name="Output")).to_be_visible()
    expect(page.locator("pre").nth(1)).to_contain_text("TOTAL 2 2 hello")  # what parent(1, ...) returned
    assert (["true"], ["true"]) in reads()[len(before) :]  # the data, asked for on the click
    screenshot(page, "workflow")

    page.get_by_role("link", name="done-1-child").first.click()  # to the child, and its parent link back
    expect(page.get_by_role("heading", name="Workflow done-1-child")).to_be_visible()
    expect(page.get_by_role("link", name="done-1", exact=True)).to_be_visible()


def test_a_durable_sleep_not_over_yet_is_shown_sleeping_not_done(
    world: World, page: Page, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """DBOS records a ``DBOS.sleep`` as it begins, its wake time as its completion (so that its
    duration is the sleep). The workflow's page showed an hour's sleep begun a second ago as
    "done · 3600.0 s", and ``relay workflows steps`` as SUCCESS: an on-call engineer reads a
    workflow stuck in its sleep as one whose steps are all done. The payments executor's sleepers
    sleep for an hour."""
    sleepers = query(
        world.paysys,
        "SELECT workflow_uuid FROM dbos.workflow_status WHERE name = 'sleeper' AND status = 'PENDING' LIMIT 1",
    )
    assert sleepers, "no sleeper PENDING"
    wid = sleepers[0][0]
    admin(page, world)
    go(page, f"#/apps/payments/workflows/{quote(wid, safe='')}")
    steps = page.get_by_role("list", name="Steps (", exact=False)
    slept = steps.locator(":scope > li").filter(has_text="DBOS.sleep")
    expect(slept).to_contain_text("sleeping")
    # The wake time as a time, not the element's name (`until [object HTMLTimeElement]`).
    expect(slept.locator("time")).to_have_count(2)
    expect(slept).to_contain_text(re.compile(r"· until \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ"))
    expect(slept).not_to_contain_text("done")
    expect(steps.locator(":scope > li").filter(has_text="note_step")).to_contain_text("done")

    for name in [k for k in os.environ if k.startswith("RELAY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("RELAY_URL", world.relay.http)
    monkeypatch.setenv("RELAY_API_KEY", API_KEYS["acme"])
    capsys.readouterr()
    assert cli_main(["workflows", "steps", "payments", wid]) == 0
    table = capsys.readouterr().out.splitlines()
    outcomes = {line.split()[1]: line.split()[2] for line in table[1:]}
    assert outcomes == {"note_step": "SUCCESS", "DBOS.sleep": "SLEEPING"}, table
    # Its output is its wake time, not DBOS's stored seconds since 1970 (1796614730.408226).
    (slept_row,) = [line for line in table if "DBOS.sleep" in line]
    assert re.search(r"SLEEPING +until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", slept_row), slept_row


def test_cancel_asks_for_confirmation_and_the_workflow_is_cancelled_in_the_system_database(
    world: World, page: Page
) -> None:
    admin(page, world)
    assert status_in_db(world.sysdb, "waiting-1") == "PENDING"
    go(page, "#/apps/ledger/workflows/waiting-1")
    cancel = page.get_by_role("button", name="Cancel…")
    cancel.click()
    dialog = page.get_by_role("dialog", name="Cancel this workflow?")
    expect(dialog).to_be_visible()
    assert page.evaluate("document.activeElement.closest('dialog') !== null"), "focus is not in the dialog"
    assert axe_violations(page) == []
    dialog.get_by_role("button", name="Keep it as it is").click()
    expect(dialog).to_have_count(0)
    assert page.evaluate("document.activeElement.textContent") == "Cancel…", "focus did not return to the button"
    assert status_in_db(world.sysdb, "waiting-1") == "PENDING"

    page.keyboard.press("Enter")  # the focused button, from the keyboard
    page.get_by_role("dialog").get_by_role("button", name="Cancel workflow").click()
    assert_eventually(lambda: status_in_db(world.sysdb, "waiting-1") == "CANCELLED", 10, what="waiting-1 CANCELLED")
    expect(page.locator("dl.facts")).to_contain_text("CANCELLED")
    expect(page.get_by_role("button", name="Resume…")).to_be_visible()
    expect(page.get_by_role("button", name="Cancel…")).to_have_count(0)
    with world.relay.api() as api:
        entries = api.get("/audit", params={"app": "ledger", "action": "workflow.cancel"}).json()
    assert [e["detail"]["workflowIds"] for e in entries] == [["waiting-1"]]

    # And resumed, again behind a confirmation: queued again, then running (waiting for its message).
    page.get_by_role("button", name="Resume…").click()
    page.get_by_role("dialog", name="Resume this workflow?").get_by_role("button", name="Resume workflow").click()
    resumed = ("ENQUEUED", "PENDING")
    assert_eventually(lambda: status_in_db(world.sysdb, "waiting-1") in resumed, 10, what="waiting-1 resumed")
    expect(page.get_by_role("button", name="Cancel…")).to_be_visible()
    with world.relay.api() as api:
        entries = api.get("/audit", params={"app": "ledger", "action": "workflow.resume"}).json()
    assert [e["detail"]["workflowIds"] for e in entries] == [["waiting-1"]]


def test_fork_from_a_step_makes_the_fork_in_the_system_database(world: World, page: Page) -> None:
    admin(page, world)
    go(page, "#/apps/ledger/workflows/done-1")
    page.get_by_role("button", name="Fork from here… (step 3: DBOS.setEvent)").click()
    dialog = page.get_by_role("dialog", name="Fork this workflow?")
    expect(dialog.get_by_label("Start from step")).to_have_value("3")
    dialog.get_by_label("New workflow id (optional)").fill("done-1-fork-console")
    dialog.get_by_role("button", name="Fork workflow").click()
    expect(page.get_by_role("heading", name="Workflow done-1-fork-console")).to_be_visible()  # the console goes to it

    fork = "done-1-fork-console"
    rows = query(world.sysdb, "SELECT forked_from FROM dbos.workflow_status WHERE workflow_uuid = %s", fork)
    assert rows == [("done-1",)]
    copied = query(
        world.sysdb,
        "SELECT function_id FROM dbos.operation_outputs WHERE workflow_uuid = %s AND function_id < 3",
        "done-1-fork-console",
    )
    assert sorted(r[0] for r in copied) == [1, 2], "the steps before the fork's start are copied, not run again"
    expect(page.locator("dl.facts")).to_contain_text("done-1")  # "Forked from"


def test_a_read_only_key_sees_no_cancel_resume_or_fork(world: World, page: Page) -> None:
    sign_in(page, world.relay.http, "acme", VIEWER_KEYS["acme"])
    expect(page.locator("#who")).to_contain_text("read-only")
    for workflow in ("done-1", "failed-1", "queued-0"):
        go(page, f"#/apps/ledger/workflows/{workflow}")
        expect(page.get_by_role("heading", name=f"Workflow {workflow}")).to_be_visible()
        expect(page.locator("ol.timeline > li").first).to_be_visible()
        for name in ("Cancel…", "Resume…", "Fork…", "Fork from here…"):
            expect(page.get_by_role("button", name=name)).to_have_count(0)
        expect(page.locator("button", has_text="Fork")).to_have_count(0)


def test_an_actions_error_stays_after_the_refresh_its_audit_entry_brings(world: World, page: Page) -> None:
    """Every action is audited, failed ones too, and the audit event reads the page again: the
    outcome shown must survive that, until the operator acts again or leaves."""
    admin(page, world)
    go(page, "#/apps/ledger/workflows/failed-1")
    page.get_by_role("button", name="Fork…").click()
    dialog = page.get_by_role("dialog", name="Fork this workflow?")
    dialog.get_by_label("New workflow id (optional)").fill("done-1")  # taken: 409
    with page.expect_request(reads_of("failed-1")):  # the refresh the audit entry brings
        dialog.get_by_role("button", name="Fork workflow").click()
        # Said as Conductor would, not PostgreSQL's "DETAIL:  Key (workflow_uuid)=(done-1) ...".
        expect(page.locator("#action-status")).to_have_text("a workflow with id done-1 already exists (409)")
    expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)  # that refresh is done
    assert "a workflow with id done-1 already exists" in page.locator("#action-status").inner_text()


def test_a_delayed_workflow_can_be_cancelled_not_resumed_and_is_a_status_to_filter_by(world: World, page: Page) -> None:
    """DBOS 3.2 holds a workflow enqueued with a delay as DELAYED, and counts it as active: Resume
    would enqueue it at once, skipping its delay."""
    client = DBOSClient(system_database_url=world.sysdb)
    try:
        client.enqueue({"queue_name": "later", "workflow_name": "job", "workflow_id": "delayed-1",
                        "delay_seconds": 36_000, "application_name": "ledger"}, 5)  # fmt: skip
    finally:
        client.destroy()
    assert status_in_db(world.sysdb, "delayed-1") == "DELAYED"
    admin(page, world)
    go(page, "#/apps/ledger/workflows?status=DELAYED")
    expect(page.get_by_label("Status")).to_have_value("DELAYED")  # offered, and chosen from the address
    listed = page.locator("tbody tr")
    expect(listed).to_have_count(1)
    expect(listed).to_contain_text("delayed-1")

    listed.get_by_role("link", name="delayed-1").click()
    expect(page.locator("dl.facts")).to_contain_text("DELAYED")
    expect(page.get_by_role("button", name="Fork…")).to_be_visible()
    expect(page.get_by_role("button", name="Resume…")).to_have_count(0)
    watched = watch(page)
    page.get_by_role("button", name="Cancel…").click()
    page.get_by_role("dialog").get_by_role("button", name="Cancel workflow").click()
    assert_eventually(lambda: status_in_db(world.sysdb, "delayed-1") == "CANCELLED", 10, what="delayed-1 CANCELLED")
    expect(page.locator("dl.facts")).to_contain_text("CANCELLED")
    expect(page.locator("#action-status")).to_have_text("Cancelled delayed-1.")

    def reads() -> list[str]:
        return [path for _, path, _, _ in watched.requests if path.endswith("/workflows/delayed-1")]

    for _ in range(50):  # the console's own read after the cancel, then the audit entry's
        if len(reads()) >= 2:
            break
        page.wait_for_timeout(100)  # (Playwright reports requests while it waits)
    assert len(reads()) >= 2, reads()
    expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)
    assert page.locator("#action-status").inner_text() == "Cancelled delayed-1."


def test_the_console_polls_nothing_when_nothing_changes(world: World, page: Page) -> None:
    """The old dashboard read every app's executors every 5 s; the console reads a page once and again
    only when the event stream says something on it changed."""
    admin(page, world)
    expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)
    watched = watch(page)
    go(page, "#/apps/ledger/executors")
    expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)
    go(page, "#/")  # the page the old dashboard polled
    expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)
    expect(page.get_by_role("row", name="ledger")).to_be_visible()
    shown = len(watched.requests)
    page.wait_for_timeout(6_000)  # longer than the old dashboard's period
    assert watched.requests[shown:] == [], "the apps read again with nothing changed"
    # Each page once; no app's executors but the one page asked. (Showing a page also reads the key,
    # /whoami, for its name in the header: a rename changes nothing else a page could hear of.)
    assert [path for _, path, _, _ in watched.requests if path != "/v2/orgs/acme/whoami"] == [
        "/v2/orgs/acme/apps/ledger",
        "/v2/orgs/acme/apps/ledger/executors",
        "/v2/orgs/acme/apps/ledger/recoveries",  # the executors recovered lately, named above the list
        "/v2/orgs/acme/apps",
    ]


# -- the other pages, and accessibility ------------------------------------------------------------


def test_audit_queues_schedules_and_instances(world: World, page: Page) -> None:
    admin(page, world)
    go(page, "#/audit?app=payments")
    expect(page.get_by_role("table", name="Audit entries")).to_contain_text("executor.deleted")
    page.get_by_label("Action").select_option("executor.dead")
    page.get_by_role("button", name="Filter").click()
    rows = page.locator("tbody tr")
    expect(rows).to_have_count(1)
    expect(rows).to_contain_text("executor.dead")
    dead_one = rows.locator("td").nth(2).inner_text()
    page.get_by_label("Action").select_option("")
    page.get_by_label("Executor id").fill(dead_one)
    page.get_by_role("button", name="Filter").click()
    with world.relay.api() as api:
        expected = api.get("/audit", params={"app": "payments", "executorId": dead_one, "limit": 100}).json()
    expect(rows).to_have_count(len(expected))
    assert len(expected) >= 3 and {e["executorId"] for e in expected} == {dead_one}  # dead, recovery..., deleted
    page.get_by_label("Since").fill("2999-01-01T00:00")  # nothing yet
    page.get_by_role("button", name="Filter").click()
    expect(page.get_by_text("No entry matches.")).to_be_visible()
    page.get_by_label("Since").fill("2000-01-01T00:00")
    page.get_by_role("button", name="Filter").click()
    expect(rows).to_have_count(len(expected))
    assert "2000-01-01" in page.evaluate("location.hash")  # the filters are in the address, to share

    go(page, "#/apps/ledger/queues")
    expect(page.get_by_role("row", name="serial")).to_contain_text("1")
    go(page, "#/apps/ledger/schedules")
    expect(page.get_by_role("row", name="every-hour")).to_contain_text("0 * * * *")
    go(page, "#/instances")

    def instance_row(name: str) -> Locator:
        # By its own cell (the row's header): a row's name holds every cell, and another instance's
        # row names relay-1 once relay-1 adopts it ("adopted by").
        return page.get_by_role("row").filter(has=page.get_by_role("rowheader", name=name, exact=True))

    instance = instance_row("relay-1")
    expect(instance).to_contain_text("live")
    screenshot(page, "instances")

    # A lease given up by a clean stop read "expired", as one that ran out did: two instances more
    # on the database, by Relay's own lease, one stopped cleanly and one lost as a crash loses it.
    with ThreadPoolExecutor(1) as pool:  # Playwright's loop runs on this thread
        pool.submit(asyncio.run, stopped_and_lost(world.relay.database_url)).result()

    def both_out() -> bool:
        with world.relay.api() as api:
            others = [i for i in api.get("/instances").json() if i["instanceId"] != "relay-1"]
        return len(others) == 2 and not any(i["live"] for i in others)

    assert_eventually(both_out, 10, what="the two leases out")
    page.reload()  # not waiting for the page to read them again when relay-1 adopts them
    expect(instance.locator(".badge")).to_have_text("live")
    expect(instance_row("relay-stopped").locator(".badge")).to_have_text("released")
    expect(instance_row("relay-crashed").locator(".badge")).to_have_text("expired")


async def stopped_and_lost(database_url: str) -> None:
    db = Database(database_url)
    await db.open()
    try:
        stopped, crashed = Lease(db, "relay-stopped", 30), Lease(db, "relay-crashed", 0.5)
        await stopped.acquire()
        await stopped.stop()  # gives the lease up
        await crashed.acquire()
        await crashed._drop()  # its connection goes as a crash's would: no lease.stop(), the lease runs out
    finally:
        await db.close()


def readme_audit_actions() -> set[str]:
    """The audit actions README.md names: the audit log's row of the API table, and Operating workflows."""
    text = README.read_text(encoding="utf-8")
    (row,) = [line for line in text.splitlines() if line.startswith("| `GET /v2/orgs/{org}/audit[")]
    start = text.index("Every change is audited (`GET /v2/orgs/{org}/audit")
    named = re.findall(r"`([a-z_]+\.[a-z_]+)`", row + text[start : text.index("\n\n", start)])
    return {a for a in named if not a.endswith((".read", ".write"))}  # not the permissions


def test_the_audit_page_offers_every_action_and_keeps_to_the_app_filter_applied(world: World, page: Page) -> None:
    admin(page, world)
    go(page, "#/audit?app=ledger")
    expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)
    offered = set(page.locator("#au-action option").evaluate_all("os => os.map(o => o.value)"))
    actions = readme_audit_actions()
    assert {"workflow.bulk_cancel", "token.renamed", "schedule.trigger", "application.create"} <= actions
    assert actions - offered == set()

    # Typed and not applied, another app is no filter yet: an entry of ledger's reads the page again,
    # for ledger.
    page.get_by_label("App", exact=True).fill("payments")
    with page.expect_request(lambda r: urlsplit(r.url).path.endswith("/audit"), timeout=5_000) as asked:
        with world.relay.api() as api:
            refused = api.post("/apps/ledger/workflows/failed-1/fork", json={"newWorkflowId": "done-1"})
        assert refused.status_code == 409, refused.text
    assert parse_qs(urlsplit(asked.value.url).query)["app"] == ["ledger"]
    expect(page.get_by_role("table", name="Audit entries").locator("tbody tr").first).to_contain_text("workflow.fork")


@pytest.mark.parametrize(
    "route",
    [
        "#/",
        "#/apps/ledger/executors",
        "#/apps/payments/recoveries",
        "#/apps/ledger/workflows",
        "#/apps/ledger/workflows/done-1",
        "#/apps/ledger/queues",
        "#/apps/ledger/schedules",
        "#/apps/ledger/alerts",
        "#/audit",
        "#/instances",
    ],
)
def test_the_main_pages_have_no_serious_accessibility_violations(world: World, page: Page, route: str) -> None:
    admin(page, world)
    go(page, route)
    expect(page.locator('main .data[aria-busy="false"]')).to_have_count(1)  # its data is shown
    expect(page.locator("main h1")).to_be_focused()  # focus moves to the new page's heading
    assert axe_violations(page) == []


def test_the_sign_in_page_has_no_serious_accessibility_violations_and_works_from_the_keyboard(
    world: World, page: Page
) -> None:
    page.goto(f"{world.relay.http}/")
    expect(page.get_by_label("Organization")).to_be_focused()
    assert axe_violations(page) == []
    page.keyboard.type("acme")
    page.keyboard.press("Tab")
    page.keyboard.type(API_KEYS["acme"])
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", name="Apps", exact=True)).to_be_visible()
    # The skip link comes first, before the main navigation, and is visible when focused.
    page.get_by_role("navigation", name="Main").get_by_role("link").first.focus()
    page.keyboard.press("Shift+Tab")
    skip = page.get_by_role("link", name="Skip to content")
    expect(skip).to_be_focused()
    assert skip.bounding_box() is not None and skip.bounding_box()["x"] >= 0  # type: ignore[index]
    page.keyboard.press("Enter")
    expect(page.locator("main")).to_be_focused()


def test_text_from_key_holders_is_shown_as_text_and_its_bidi_controls_escaped(world: World, page: Page) -> None:
    """Workflow ids are chosen by whoever starts a workflow (often from an end user's input): one that
    is markup is shown as its characters, and one ending in U+202E (right-to-left override) reordered
    the ids after it in the same line of the audit log ("x\\u202e, second" read "x dnoces ,"), so
    that what was refused did not read as what was asked. The console shows such characters escaped."""
    markup = '<img src=x onerror="window.__pwned=1">'
    ids = [markup, "flip\u202e", "second"]
    with world.relay.api() as api:
        refused = api.post("/apps/ledger/workflows/bulk-cancel", json={"workflowIds": ids})
    assert refused.status_code == 404, refused.text  # no such workflows: refused, and audited
    admin(page, world)
    go(page, "#/audit?app=ledger&action=workflow.bulk_cancel")
    listed = page.locator('li[data-key="workflowIds"]').first
    expect(listed).to_contain_text(markup)
    assert page.evaluate("window.__pwned") is None and page.locator("main img").count() == 0
    # Where the first and the last letter of "second" are drawn: left to right, as it is written.
    first, last = listed.locator(".id", has_text="second").evaluate(
        """el => {
          const text = [...el.querySelectorAll("*"), el].flatMap((n) => [...n.childNodes])
            .find((n) => n.nodeType === Node.TEXT_NODE && n.data === "second");
          const at = (i) => { const r = document.createRange(); r.setStart(text, i); r.setEnd(text, i + 1);
            return r.getBoundingClientRect().left; };
          return [at(0), at(5)];
        }"""
    )
    assert first < last, (first, last)
    # Shown escaped, as the command line shows it; the error's text reads in its own order too.
    expect(listed).to_contain_text("flip\\u202e, second")
    expect(page.locator(".error-text").first).to_contain_text("flip\\u202e, second")


def test_a_keys_name_is_shown_as_text_with_its_bidi_controls_escaped(world: World, page: Page) -> None:
    """A key's name is its creator's text: shown in the header as its characters, its U+202E escaped
    (it drew " in acme · read-only" backwards)."""
    admin_key = {"Authorization": f"Bearer {API_KEYS['acme']}"}
    tokens = f"{world.relay.http}/v2/orgs/acme/tokens"
    name = "<b>on call\u202e"
    created = httpx.post(f"{tokens}/{name}", json={"permissions": ["application.read"]}, headers=admin_key, verify=TLS)
    assert created.status_code == 201, created.text
    try:
        sign_in(page, world.relay.http, "acme", created.json()["token"])
        expect(page.locator("#who")).to_have_text("<b>on call\\u202e in acme · read-only")
        assert page.locator("header b, #who b").count() == 0
    finally:
        httpx.delete(f"{tokens}/{name}", headers=admin_key, verify=TLS)


def test_a_workflows_outcome_shows_its_bidi_controls_escaped(world: World, page: Page) -> None:
    """The outcome of an action on a workflow (``Cancelled <id>.``) was written to the page as it was,
    past the escaping every other text has: an id ending in U+202E drew the rest of the line backwards."""
    workflow_id = "late\u202e"
    client = DBOSClient(system_database_url=world.sysdb)
    try:
        client.enqueue({"queue_name": "later", "workflow_name": "job", "workflow_id": workflow_id,
                        "delay_seconds": 36_000, "application_name": "ledger"}, 5)  # fmt: skip
    finally:
        client.destroy()
    admin(page, world)
    go(page, f"#/apps/ledger/workflows/{quote(workflow_id, safe='')}")  # the link's address: the id itself
    page.get_by_role("button", name="Cancel…").click()
    page.get_by_role("dialog").get_by_role("button", name="Cancel workflow").click()
    assert_eventually(lambda: status_in_db(world.sysdb, workflow_id) == "CANCELLED", 10, what="cancelled")
    expect(page.locator("#action-status")).to_have_text("Cancelled late\\u202e.")


def test_a_blocked_recoverys_command_for_copying_is_the_executors_id_itself(world: World, page: Page) -> None:
    """A blocked recovery's card shows the command that recovers the executor, to copy into a shell.
    The console escapes U+202E to show it (``\\u202e``): the command then named another executor, and
    one with a ``$`` or a quote was never quoted. Each word is quoted as a shell reads it back: an id
    with such characters in ANSI-C quotes (``$'...\\u202e...'``), which bash turns back into the id.
    (The SDKs and Relay's clients name executors by UUID; the protocol takes any id, as here.)"""
    executor_id = "cut\u202e$HOME's"

    url = f"ws://127.0.0.1:{world.relay.port}/websocket/solo/{CONDUCTOR_KEYS['acme']}"
    with connect(url, open_timeout=10) as ws:  # (the page's own event loop runs in this thread)
        request = json.loads(ws.recv(timeout=10))
        ws.send(info_reply(request["request_id"], executor_id))
        assert_eventually(lambda: world.relay.state_of("acme", "solo", executor_id) == "HEALTHY", 10)
    assert_eventually(lambda: world.relay.state_of("acme", "solo", executor_id) == "DISCONNECTED", 10)
    with world.relay.api() as api:  # declared dead now; the app has no other executor: blocked
        recover = api.post(f"/apps/solo/executors/{quote(executor_id, safe='')}/recover", json={})
    assert recover.status_code == 202, recover.text
    admin(page, world)
    go(page, f"#/apps/solo/recoveries?executor={quote(executor_id, safe='')}")
    command = page.locator("section.recovery code").first
    expect(command).to_have_text(re.compile(r"^relay recover solo \$'.*'$"))
    shown = command.inner_text()
    assert "\u202e" not in shown and "\\u202e" in shown, shown
    # What a shell makes of the words after "relay recover": the app, and the executor's id itself.
    assert read_back(shown.removeprefix("relay recover ")) == ["solo", executor_id]
    # And so of any id: one like an option, a space, a tab, a backslash, a command substitution.
    for odd in ("-x", "a b", "tab\tid", "back\\slash'\u2066", "$(touch /nonexistent)"):
        shown = page.evaluate(
            """async (id) => (await import(new URL("console-ui.js", document.querySelector("script[type=module]").src)))
                 .shellCommand("relay recover", ["solo", id], ["--to-latest"])"""
        , odd)  # fmt: skip
        words = read_back(shown.removeprefix("relay recover "))
        assert words in (["solo", odd, "--to-latest"], ["--to-latest", "--", "solo", odd]), (odd, shown)

    # A workflow's status is the executor's text: it coloured its badge as a class ("SUCCESS alert" took
    # the page's alert class too). A known status is a class; any other is the neutral "other".
    reported = [{"WorkflowUUID": "odd-1", "Status": "SUCCESS alert", "WasForkedFrom": False},
                {"WorkflowUUID": "failed-9", "Status": "ERROR", "WasForkedFrom": False}]  # fmt: skip
    url = f"ws://127.0.0.1:{world.relay.port}/websocket/odd-status/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "odd-1", "answer", replies={"list_workflows": {"output": reported}}):
        go(page, "#/apps/odd-status/workflows")
        badges = page.locator("tbody tr .badge")
        expect(badges).to_have_text(["SUCCESS alert", "ERROR"])
        assert [b.get_attribute("class") for b in badges.all()] == ["badge other", "badge ERROR"]


def read_back(words: str) -> list[str]:
    """The words bash makes of ``words``."""
    read = subprocess.run(["bash", "-c", f"printf '%s\\0' {words}"], capture_output=True, text=True, check=True)
    return read.stdout.split("\0")[:-1]


# -- long workflow ids -----------------------------------------------------------------------------


def test_a_long_workflow_id_leaves_the_page_its_actions_and_its_dialogs_on_the_screen(world: World, page: Page) -> None:
    """Relay takes workflow ids up to 16 KiB (PostgreSQL holds 2,692 bytes that do not compress). The
    console showed such an id whole wherever it named one: a 2,600-character id was a heading of 17
    lines that pushed the workflow's actions and status off the first screen, a row of the list 20
    lines high, and its cancel dialog and the outcome line ran past their boxes. Listed, linked and
    in the heading an id shows three lines (the whole id a click away); in a sentence, its ends."""
    rng = random.Random(7)
    workflow_id = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(2600))
    client = DBOSClient(system_database_url=world.sysdb)
    try:  # waits an hour for its message: PENDING, to be cancelled
        client.enqueue({"queue_name": "serial", "workflow_name": "parent", "workflow_id": workflow_id}, 5, 3600.0)
    finally:
        client.destroy()
    assert_eventually(lambda: status_in_db(world.sysdb, workflow_id) == "PENDING", 20, what="the long one PENDING")
    admin(page, world)
    go(page, f"#/apps/ledger/workflows/{quote(workflow_id, safe='')}")
    heading = page.get_by_role("heading", name=f"Workflow {workflow_id}")  # its name is the whole id
    expect(heading).to_be_visible()
    box = heading.bounding_box()
    assert box is not None and box["height"] < 120, box  # three lines of the id and the word
    cancel = page.get_by_role("button", name="Cancel…")
    expect(cancel).to_be_in_viewport()
    page.get_by_text("The whole id (2600 characters)").click()
    expect(page.locator("details.whole-id code")).to_have_text(workflow_id)
    child = page.get_by_role("link", name=f"{workflow_id}-child").first  # the step's link, to the child
    expect(child).to_be_visible()
    assert unquote(child.get_attribute("href") or "") == f"#/apps/ledger/workflows/{workflow_id}-child"

    cancel.click()
    dialog = page.get_by_role("dialog", name="Cancel this workflow?")
    expect(dialog).to_be_in_viewport(ratio=1)
    fits = "e => e.scrollWidth <= e.clientWidth"
    assert dialog.locator("p").evaluate(fits), "the dialog's text runs past it"
    expect(dialog).to_contain_text(f"{workflow_id[:56]}…{workflow_id[-20:]}")
    dialog.get_by_role("button", name="Cancel workflow").click()
    assert_eventually(lambda: status_in_db(world.sysdb, workflow_id) == "CANCELLED", 10, what="cancelled")
    expect(page.locator("#action-status")).to_contain_text("Cancelled")
    assert page.locator("#action-status").evaluate(fits), "the outcome runs past the page"
    assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")

    go(page, "#/apps/ledger/workflows")
    row = page.get_by_role("row").filter(has=page.get_by_role("link", name=workflow_id, exact=True))
    expect(row).to_contain_text("CANCELLED")
    box = row.bounding_box()
    assert box is not None and box["height"] < 120, box


# -- long queue and schedule names -------------------------------------------------------------------


def test_long_queue_and_schedule_names_leave_their_tables_and_the_workflows_page_on_the_screen(
    world: World, page: Page
) -> None:
    """Relay takes queue and schedule names up to 16 KiB (DBOS stores 2,600 random characters on
    PostgreSQL). The console showed such a name whole on one line: a 2,000-character queue made the
    queues table 20,000 pixels wide (its figures a long scroll away), the schedules, workflows and
    alert rules tables as wide, and the page of a workflow on that queue 17,500 pixels wide. Listed,
    linked or a workflow's fact, a name shows three lines (its link and accessible name the whole
    name), in an audit entry too."""
    rng = random.Random(11)
    queue = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(2000))
    schedule = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(2000))
    client = DBOSClient(system_database_url=world.sysdb, application_name="ledger")
    try:
        client.register_queue(queue, application_name="ledger")
        # Yearly, at midnight on 1 January: it does not fire while the test runs.
        client.create_schedule(schedule_name=schedule, workflow_name="tick", schedule="0 0 1 1 *", context="c",
                               application_name="ledger")  # fmt: skip
        # Waits an hour for its message: PENDING on the long queue while the pages are read.
        client.enqueue({"queue_name": queue, "workflow_name": "parent", "workflow_id": "on-a-long-queue"}, 9, 3600.0)
        assert_eventually(lambda: status_in_db(world.sysdb, "on-a-long-queue") == "PENDING", 20, what="it running")
        with world.relay.api() as api:
            rule = api.post(
                "/apps/ledger/alerting-rules", json={"ruleType": "SlowQueue", "ruleMetadata": {"queueName": queue}}
            )
            assert rule.status_code == 201, rule.text
            assert api.post(f"/apps/ledger/schedules/{quote(schedule, safe='')}/pause").status_code == 204
        admin(page, world)
        fits = "e => e.scrollWidth <= e.clientWidth"

        def on_screen(row: Locator) -> None:
            expect(row).to_be_visible()
            box = row.bounding_box()
            assert box is not None and box["height"] < 120, box  # three lines of the name
            assert all(page.locator(".scroll").evaluate_all(f"es => es.map({fits})")), "a table wider than its box"
            assert page.locator("html").evaluate(fits), "the page is wider than the window"

        def row_of(link_name: str) -> Locator:
            return page.get_by_role("row").filter(has=page.get_by_role("link", name=link_name, exact=True))

        go(page, "#/apps/ledger/queues")
        on_screen(row_of(queue))
        expect(row_of(queue).get_by_role("link", name="1", exact=True)).to_be_in_viewport()  # the one running
        go(page, "#/apps/ledger/schedules")
        row = page.get_by_role("row").filter(has_text=schedule)
        on_screen(row)
        expect(row.locator("code.cron")).to_have_text("0 0 1 1 *")
        go(page, f"#/apps/ledger/workflows?queue={quote(queue, safe='')}")
        on_screen(row_of("on-a-long-queue"))
        go(page, "#/apps/ledger/workflows/on-a-long-queue")
        fact = page.locator("dl.facts dd").filter(has_text=queue)
        expect(fact).to_have_text(queue)
        box = fact.bounding_box()
        assert box is not None and box["height"] < 80, box
        assert page.locator("html").evaluate(fits), "the page is wider than the window"
        expect(page.get_by_role("button", name="Cancel…")).to_be_in_viewport()
        go(page, "#/apps/ledger/alerts")
        on_screen(page.get_by_role("row").filter(has_text=f"queueName {queue}"))
        go(page, "#/audit?app=ledger&action=schedule.pause")
        on_screen(page.get_by_role("row").filter(has_text=schedule))
    finally:
        try:
            with world.relay.api() as api:  # cancelled by its executor, which stops waiting for the message
                api.post("/apps/ledger/workflows/on-a-long-queue/cancel")
                for r in api.get("/apps/ledger/alerting-rules").json():
                    if r["ruleType"] == "SlowQueue":
                        api.delete(f"/apps/ledger/alerting-rules/{r['id']}")
            client.delete_workflows(["on-a-long-queue"], delete_children=True)
            client.delete_schedule(schedule)
            client.delete_queue(queue)
        finally:
            client.destroy()
