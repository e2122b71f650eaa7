"""Keys managed at run time (the tokens API), on two instances, and what a key may do."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus

from harness.keys import API_KEYS, VIEWER_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, off_loop, open_socket
from harness.waiting import assert_eventually
from relay.config import RelayConfig
from relay.store.apps import AppStore
from relay.store.db import Database
from relay.store.keys import KeyStore, grants_from_config

StartRelay = Callable[..., RelayProcess]


def api(relay: RelayProcess, key: str, org: str = "acme") -> httpx.Client:
    return httpx.Client(base_url=f"{relay.http}/v2/orgs/{org}", headers={"Authorization": f"Bearer {key}"}, timeout=10)


def status(relay: RelayProcess, key: str, path: str = "/apps") -> int:
    with api(relay, key) as client:
        return client.get(path).status_code


def ws_url(relay: RelayProcess, key: str, app: str = "ledger") -> str:
    return f"ws://127.0.0.1:{relay.port}/websocket/{app}/{key}"


def two_instances(start_relay: StartRelay) -> tuple[RelayProcess, RelayProcess]:
    config = relay_yaml(free_port(), grace=30)
    relay1 = start_relay(config, instance_id="relay-1")
    relay2 = start_relay({**config, "server": {**config["server"], "port": free_port()}}, instance_id="relay-2")
    return relay1, relay2


def create(relay: RelayProcess, name: str, body: dict[str, Any] | None, key: str = API_KEYS["acme"]) -> str:
    with api(relay, key) as client:
        resp = client.post(f"/tokens/{name}", json=body)
    assert resp.status_code == 201, resp.text
    created: dict[str, str] = resp.json()
    assert created["tokenName"] == name and created["token"].startswith("relay_")
    return created["token"]


def test_a_key_is_created_used_renamed_and_deleted_on_two_instances(start_relay: StartRelay) -> None:
    relay1, relay2 = two_instances(start_relay)
    secret = create(relay1, "robot", {"permissions": ["websocket.connect", "application.read"]})

    # Usable through the other instance within a moment, for the API and for executors.
    assert_eventually(lambda: status(relay2, secret) == 200, 3)

    async def connect() -> tuple[ClientConnection, str]:
        ws = await open_socket(ws_url(relay2, secret))
        executor_id = await handshake(ws)
        await off_loop(assert_eventually, lambda: relay2.state_of("acme", "ledger", executor_id) == "HEALTHY", 5)
        return ws, executor_id

    async def scenario() -> tuple[int | None, str]:
        ws, executor_id = await connect()
        with api(relay1, API_KEYS["acme"]) as admin:
            listed = admin.get("/tokens").json()
            robot = next(t for t in listed if t["tokenName"] == "robot")
            assert robot["permissions"] == ["application.read", "websocket.connect"]
            assert "token" not in robot and "sha256" not in robot  # the secret is never shown again
            assert admin.patch("/tokens/robot", json={"newName": "robot-2"}).status_code == 200
        # Renamed, the same key still works (executors are bound to its permanent id).
        assert status(relay1, secret) == 200
        await ws.ping()
        deleted_at = time.monotonic()
        with api(relay2, API_KEYS["acme"]) as admin:
            assert admin.delete("/tokens/robot-2").status_code == 204
        # Refused by both instances within 2 s, and its socket closed.
        for relay in (relay1, relay2):
            await off_loop(assert_eventually, lambda r=relay: status(r, secret) == 401, 2)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 2.0 - (time.monotonic() - deleted_at) + 0.5)
        with pytest.raises(InvalidStatus) as refused:
            await open_socket(ws_url(relay1, secret))
        assert refused.value.response.status_code == 403
        return ws.close_code, executor_id

    code, executor_id = asyncio.run(scenario())
    assert code == 4401
    # The executor goes through its grace period like any lost connection.
    assert_eventually(lambda: relay2.state_of("acme", "ledger", executor_id) == "DISCONNECTED", 3)
    with api(relay1, API_KEYS["acme"]) as admin:
        actions = [e["action"] for e in admin.get("/audit").json() if e["action"].startswith("token.")]
    assert actions == ["token.created", "token.renamed", "token.deleted"]


def test_a_key_cannot_grant_more_than_it_has(start_relay: StartRelay) -> None:
    relay = start_relay()
    limited = create(relay, "limited", {"permissions": ["token.write", "application.read"], "appNames": ["ledger"]})
    with api(relay, limited) as client:
        resp = client.post("/tokens/stronger", json={"permissions": ["application.write"]})
        assert resp.status_code == 409 and "application.write" in resp.text
        resp = client.post("/tokens/wider", json={"appNames": ["other"]})
        assert resp.status_code == 409
        assert client.post("/tokens/same", json=None).status_code == 201


async def _syncs_at_once(url: str, instances: int, rounds: int) -> None:
    config = RelayConfig.model_validate(relay_yaml(free_port()))
    dbs = [Database(url) for _ in range(instances)]
    try:
        for db in dbs:
            await db.open()
        await dbs[0].migrate()
        await AppStore(dbs[0]).sync_config(config)
        expected = sorted(sha for sha, _ in grants_from_config(config))
        for _ in range(rounds):
            async with dbs[0].transaction() as conn:
                await conn.execute("DELETE FROM tokens")
            results = await asyncio.gather(*(KeyStore(db).sync_config(config) for db in dbs), return_exceptions=True)
            assert [r for r in results if r is not None] == []
            async with dbs[0].connection() as conn:
                cur = await conn.execute("SELECT sha256 FROM tokens WHERE source = 'config' ORDER BY sha256")
                assert [r["sha256"] for r in await cur.fetchall()] == expected
    finally:
        for db in dbs:
            await db.close()


def test_instances_starting_together_on_a_new_database_all_sync_the_keys_of_relay_yaml(postgres: Postgres) -> None:
    """Instances starting at once wrote relay.yaml's keys in transactions of their own: two inserting
    the same key collided on its secret's unique index, and one of them failed to start (seen in
    bench.fleet). They now take turns."""
    asyncio.run(_syncs_at_once(postgres.create_database("keys_at_once"), instances=16, rounds=150))


def test_keys_from_relay_yaml_are_listed_but_managed_in_the_file(start_relay: StartRelay) -> None:
    relay = start_relay()
    with api(relay, API_KEYS["acme"]) as admin:
        listed = {t["tokenName"]: t for t in admin.get("/tokens").json()}
        assert listed["ops"]["source"] == "config"
        assert admin.delete("/tokens/ops").status_code == 409
        assert admin.post("/tokens/ops").status_code == 409  # the name is taken
    with api(relay, VIEWER_KEYS["acme"]) as viewer:
        assert viewer.get("/tokens").status_code == 200  # token.read
        assert viewer.post("/tokens/x").status_code == 403  # not token.write


def test_a_key_scoped_to_an_app_reaches_only_that_app(start_relay: StartRelay) -> None:
    relay = start_relay()
    scoped = create(
        relay, "ledger-only", {"permissions": ["application.read", "websocket.connect"], "appNames": ["ledger"]}
    )
    with api(relay, scoped) as client:
        assert client.get("/apps/ledger/executors").status_code == 200
        assert client.get("/apps/other/executors").status_code == 403

    async def attempt(app: str) -> int:
        try:
            ws = await open_socket(ws_url(relay, scoped, app))
        except InvalidStatus as exc:
            return exc.response.status_code
        await ws.close()
        return 101

    assert asyncio.run(attempt("other")) == 403
    assert asyncio.run(attempt("ledger")) == 101
