"""The REST API: auth, errors, listing, and apps registered on first connection."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import httpx
import psycopg
import pytest

from harness.keys import CONDUCTOR_KEYS
from harness.relay import RelayProcess
from harness.simulated import handshake, off_loop, open_socket
from harness.waiting import assert_eventually
from harness.web import TLS
from tests.prom import AUTH, sample

StartRelay = Callable[..., RelayProcess]


# The tests that only read (and are refused) share conftest's module Relay: each start costs seconds, and
# nothing they do changes what another reads (no write, no socket; a refused read is not audited and
# counts toward no limit). Those that connect executors or read counts of connections get a Relay
# of their own (own_relay), as a socket or app one left behind would change another's answer.


@pytest.fixture
def own_relay(start_relay: StartRelay) -> RelayProcess:
    return start_relay()


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "api-acme-secret"}, {"Authorization": "Basic x"}],
)
def test_401_without_a_valid_api_key(relay: RelayProcess, headers: dict[str, str]) -> None:
    resp = httpx.get(f"{relay.http}/v2/orgs/acme/apps", headers=headers, verify=TLS)
    assert resp.status_code == 401
    # Refused before the route, by the request guard, as a problem (RFC 9457).
    assert resp.headers["content-type"] == "application/problem+json"
    assert resp.json()["status"] == 401


def test_a_conductor_key_is_not_an_api_key(relay: RelayProcess) -> None:
    # A valid key that only has websocket.connect: refused for lack of application.read.
    with relay.api("acme", key=CONDUCTOR_KEYS["acme"]) as api:
        resp = api.get("/apps")
    assert resp.status_code == 403
    assert "application.read" in resp.json()["error"]["message"]


def test_403_for_another_orgs_resources(relay: RelayProcess) -> None:
    with relay.api("globex", key="api-acme-secret") as api:
        for path in ("/apps", "/apps/ledger", "/apps/ledger/executors", "/apps/ledger/executors/x"):
            resp = api.get(path)
            assert resp.status_code == 403, path
            assert resp.json()["error"]["code"] == "forbidden"


def test_a_viewer_can_read(relay: RelayProcess) -> None:
    with relay.api("acme", key="api-acme-viewer") as api:
        assert api.get("/apps").status_code == 200


def test_apps_from_the_config_with_their_settings(relay: RelayProcess) -> None:
    with relay.api() as api:
        apps = api.get("/apps").json()
        assert len(apps) == 1
        relays_own = {
            k: apps[0][k] for k in ("org", "name", "executorTimeoutSecs", "recoverToLatestVersion", "executors")
        }
        assert relays_own == {
            "org": "acme",
            "name": "ledger",
            "executorTimeoutSecs": 30.0,
            "recoverToLatestVersion": False,
            "executors": {"HEALTHY": 0, "DISCONNECTED": 0, "DEAD": 0, "RECOVERING": 0},
        }
        # Conductor's Application members, beside Relay's own.
        conductors = {k: apps[0][k] for k in ("id", "orgId", "status", "language", "privateMode", "dbosCloud")}
        assert conductors == {
            "id": "ledger",
            "orgId": "acme",
            "status": "UNAVAILABLE",  # no executor connected
            "language": None,
            "privateMode": False,
            "dbosCloud": False,
        }
        assert api.get("/apps/ledger").json() == apps[0]


def test_not_found_and_invalid_requests_use_the_error_shape(relay: RelayProcess) -> None:
    with relay.api() as api:
        for path in ("/apps/nope", "/apps/nope/executors", "/apps/ledger/executors/nope"):
            resp = api.get(path)
            assert resp.status_code == 404, path
            assert resp.json()["error"]["code"] == "not_found"
        resp = api.get("/apps/ledger/executors", params={"state": "ASLEEP"})
        assert resp.status_code == 422
        assert resp.json()["error"]["code"] == "invalid_request"
        assert "state" in resp.json()["error"]["message"]
        resp = api.get("/apps/ledger/executors/x/workflows", params={"limit": 0})
        assert resp.status_code == 422
    resp = httpx.get(f"{relay.http}/nowhere", verify=TLS)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "http_error"


def test_unlisted_app_is_registered_on_first_connection_with_defaults(own_relay: RelayProcess) -> None:
    relay = own_relay

    async def connect() -> str:
        ws = await open_socket(f"ws://127.0.0.1:{relay.port}/websocket/payroll/{CONDUCTOR_KEYS['acme']}")
        executor_id = await handshake(ws)
        await off_loop(assert_eventually, lambda: relay.state_of("acme", "payroll", executor_id) == "HEALTHY", 5)
        await ws.close()
        return executor_id

    executor_id = asyncio.run(connect())
    with relay.api() as api:
        app = api.get("/apps/payroll").json()
    assert app["executorTimeoutSecs"] == 60.0 and app["recoverToLatestVersion"] is False
    assert_eventually(lambda: relay.state_of("acme", "payroll", executor_id) == "DISCONNECTED", 5)
    with relay.api("globex") as api:
        assert api.get("/apps/payroll").status_code == 404


def test_health_ready_and_metrics(own_relay: RelayProcess) -> None:
    relay = own_relay
    assert httpx.get(f"{relay.http}/healthz", verify=TLS).json() == {"status": "ok"}
    assert httpx.get(f"{relay.http}/readyz", verify=TLS).json() == {"status": "ready"}
    with psycopg.connect(relay.database_url) as conn:
        row = conn.execute("SELECT lease_epoch FROM relay_instances WHERE instance_id = 'relay-1'").fetchone()
    assert row is not None and row[0] >= 1

    async def connect() -> None:
        ws = await open_socket(f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}")
        executor_id = await handshake(ws)
        await off_loop(assert_eventually, lambda: relay.state_of("acme", "ledger", executor_id) == "HEALTHY", 5)
        text = (await off_loop(httpx.get, f"{relay.http}/metrics", headers=AUTH)).text
        assert sample(text, "relay_connections") == 1
        assert sample(text, "relay_executors", org="acme", app="ledger", state="HEALTHY") == 1
        assert sample(text, "relay_hub_events_total", kind="handshakes") == 1
        await ws.close()

    asyncio.run(connect())


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text"])
def test_the_scrape_has_no_created_series(relay: RelayProcess, accept: str) -> None:
    """prometheus_client's Counter and Histogram objects (the alerts' counters, the recovery
    pipeline's) gave every series a ``*_created`` one, a gauge of its own in the text format; Relay's
    other counters and Conductor's figures have none."""
    resp = httpx.get(f"{relay.http}/metrics", headers={**AUTH, "Accept": accept}, timeout=5, verify=TLS)
    assert resp.status_code == 200
    assert "relay_alerts_sent_total{" in resp.text and "relay_recovery_dead_to_deleted_seconds_count" in resp.text
    assert [line for line in resp.text.splitlines() if "_created" in line] == []


def test_console_page_is_served(relay: RelayProcess) -> None:
    resp = httpx.get(f"{relay.http}/", verify=TLS)
    assert resp.status_code == 200
    assert "text/html" in resp.headers["content-type"]
    script = httpx.get(f"{relay.http}/static/console-api.js", verify=TLS)  # its scripts are files of their own (CSP)
    assert "/v2/orgs/" in script.text and "Authorization" in script.text


def test_a_crowd_connecting_at_once_is_recorded_and_a_duplicate_id_replaces_its_socket(
    own_relay: RelayProcess,
) -> None:
    relay = own_relay
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"

    async def crowd() -> tuple[list[str], int | None, int | None]:
        sockets = [await open_socket(url) for _ in range(150)]
        twin = await open_socket(url)
        again = None
        try:
            ids = await asyncio.gather(*(handshake(ws) for ws in sockets), handshake(twin, "twin"))
            await off_loop(assert_eventually, lambda: len(_healthy(relay)) == 151, 30)
            # As `dbosctl app executors` asks (dbos-ctl internal/cli/app.go:261): no limit, and no
            # way to page. All 151, not the first 100.
            listed = await off_loop(_listed_without_a_limit, relay)
            assert set(ids) <= {e["executorId"] for e in listed}, len(listed)
            # The same executor id again while its first socket is open: a reconnect after a blip.
            # (Which of two handshakes in flight at once is newer is the order Relay records them
            # in, so the first is recorded before the second is opened.)
            again = await open_socket(url)
            await handshake(again, "twin")
            await asyncio.wait_for(twin.wait_closed(), 30)
            await asyncio.sleep(1.0)  # time enough for the old socket's close to be (wrongly) recorded
            assert relay.state_of("acme", "ledger", "twin") == "HEALTHY"
            assert len(_healthy(relay)) == 151
            return list(ids), twin.close_code, again.close_code
        finally:
            await asyncio.gather(*(ws.close() for ws in [*sockets, twin, *([again] if again else [])]))

    ids, twin_code, again_code = asyncio.run(crowd())
    assert twin_code == 4409  # replaced by the newer connection
    assert again_code is None  # which stays open
    assert len(set(ids)) == 151


def test_paging_through_executors_sees_each_once_while_they_reconnect(own_relay: RelayProcess) -> None:
    """Executors are listed in id order: a reconnect between two pages moves nothing (in order of
    connection, the executor that reconnected went to the end and was listed twice, another never)."""
    relay = own_relay
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"

    def page(offset: int) -> list[str]:
        with relay.api() as api:
            return [
                e["executorId"] for e in api.get("/apps/ledger/executors", params={"limit": 1, "offset": offset}).json()
            ]

    async def scenario() -> list[str]:
        sockets = {}
        for executor_id in ("page-c", "page-a", "page-b"):  # connected in another order than their ids'
            sockets[executor_id] = ws = await open_socket(url)
            await handshake(ws, executor_id)
            healthy = functools.partial(lambda e: relay.state_of("acme", "ledger", e) == "HEALTHY", executor_id)
            await off_loop(assert_eventually, healthy, 5)
        again = None
        try:
            first = await off_loop(page, 0)
            again = await open_socket(url)  # the first listed reconnects
            await handshake(again, first[0])
            await asyncio.wait_for(sockets[first[0]].wait_closed(), 10)  # replaced: the new one is recorded
            return [first, await off_loop(page, 1), await off_loop(page, 2)]
        finally:
            await asyncio.gather(*(ws.close() for ws in [*sockets.values(), *([again] if again else [])]))

    assert asyncio.run(scenario()) == [["page-a"], ["page-b"], ["page-c"]]


def test_an_executor_back_from_the_dead_sends_nothing_to_its_finished_grace_period(
    start_relay: StartRelay,
) -> None:
    """Only a DISCONNECTED record has a grace period waiting for the reconnect's message: one sent
    to a grace period that already declared the executor DEAD stayed unread in DBOS's table."""
    relay = start_relay(grace=2.0)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"

    def state_is(state: str) -> Callable[[], bool]:
        return lambda: relay.state_of("acme", "ledger", "lazarus") == state

    def graces() -> list[tuple[str, str, Any]]:
        with psycopg.connect(relay.database_url) as conn:
            rows = conn.execute(
                """SELECT workflow_uuid, status, output FROM dbos.workflow_status
                   WHERE workflow_uuid LIKE 'grace:acme:ledger:lazarus:%' ORDER BY created_at"""
            ).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    async def scenario() -> None:
        ws = await open_socket(url)
        await handshake(ws, "lazarus")
        await off_loop(assert_eventually, state_is("HEALTHY"), 5)
        await ws.close()
        await off_loop(assert_eventually, state_is("DEAD"), 10)
        ws = await open_socket(url)  # back from the dead
        await handshake(ws, "lazarus")
        await off_loop(assert_eventually, state_is("HEALTHY"), 5)
        # The control: a blip within the grace period, whose reconnect's message ends it early.
        await ws.close()
        await off_loop(assert_eventually, state_is("DISCONNECTED"), 5)
        ws = await open_socket(url)
        try:
            await handshake(ws, "lazarus")
            await off_loop(assert_eventually, lambda: [g[1] for g in graces()] == ["SUCCESS", "SUCCESS"], 10)
        finally:
            await ws.close()

    asyncio.run(scenario())
    (_, dead_status, _), (blip, _, _) = graces()[:2]  # (closing the socket at the end began a third)
    with psycopg.connect(relay.database_url) as conn:
        sent = conn.execute(
            "SELECT destination_uuid FROM dbos.notifications WHERE destination_uuid LIKE 'grace:%'"
        ).fetchall()
    assert dead_status == "SUCCESS" and [r[0] for r in sent] == [blip]


def _listed_without_a_limit(relay: RelayProcess) -> list[dict[str, Any]]:
    with relay.api() as api:
        rows: list[dict[str, Any]] = api.get("/apps/ledger/executors").json()
        return rows


def _healthy(relay: RelayProcess) -> list[str]:
    with relay.api() as api:
        rows = api.get("/apps/ledger/executors", params={"state": "HEALTHY", "limit": 1000}).json()
        return [e["executorId"] for e in rows]
