"""Keys managed at run time (the tokens API), on two instances, and what a key may do."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus

from harness.keys import API_KEYS, CONDUCTOR_KEYS, VIEWER_KEYS, sha
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, off_loop, open_socket
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.config import RelayConfig
from relay.store.apps import AppStore
from relay.store.db import Database
from relay.store.keys import KeyStore, grants_from_config

StartRelay = Callable[..., RelayProcess]


def api(relay: RelayProcess, key: str, org: str = "acme") -> httpx.Client:
    return httpx.Client(
        base_url=f"{relay.http}/v2/orgs/{org}", headers={"Authorization": f"Bearer {key}"}, timeout=10, verify=TLS
    )


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
        with api(relay2, API_KEYS["acme"]) as admin:
            assert admin.delete("/tokens/robot-2").status_code == 204
        deleted_at = time.monotonic()  # the deletion was committed before its answer: counted from after it
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


def test_a_key_scoped_to_apps_sees_renames_and_deletes_only_keys_within_its_powers(start_relay: StartRelay) -> None:
    """Such a key deleted and renamed any key of its org (the org's admin keys, other apps' conductor
    keys) and listed them all. It now acts on the keys it could have created, and lists only those."""
    relay = start_relay()
    limited = create(relay, "limited", {"permissions": ["token.write", "token.read"], "appNames": ["ledger"]})
    create(relay, "billing-exec", {"appNames": ["billing"]})  # another app's conductor key
    create(relay, "org-admin", {"permissions": ["application.write", "application.read", "token.write"]})
    create(relay, "ledger-writer", {"permissions": ["application.write"], "appNames": ["ledger"]})  # beyond it
    create(relay, "ledger-exec", {"appNames": ["ledger"]})
    create(relay, "ledger-exec-2", None, key=limited)  # scoped to ledger, as its creator is
    with api(relay, limited) as client:
        # The keys it may not list are, to it, as keys that do not exist (a 403 would tell it which
        # names its org's other keys have); the one it lists but may not change is a 403.
        for attempt in (
            client.delete("/tokens/billing-exec"),
            client.patch("/tokens/billing-exec", json={"newName": "x"}),
            client.delete("/tokens/org-admin"),
            client.patch("/tokens/org-admin", json={"newName": "pwned"}),
            client.delete("/tokens/ops"),  # relay.yaml's admin key
        ):
            assert attempt.status_code == 404, (attempt.request.url, attempt.text)
            assert attempt.json()["detail"] == client.delete("/tokens/no-such-key").json()["detail"].replace(
                "no-such-key", attempt.request.url.path.rsplit("/", 1)[1]
            )
        beyond = client.delete("/tokens/ledger-writer")
        assert beyond.status_code == 403, beyond.text
        assert beyond.json()["error"]["code"] == "forbidden"
        # The keys scoped to its apps (ledger-writer too: seen, not changed); filtered before paging,
        # so that every page is whole and they add up to the list.
        within = ["ledger-exec", "ledger-exec-2", "ledger-writer", "limited"]
        assert [t["tokenName"] for t in client.get("/tokens").json()] == within
        pages = [client.get("/tokens", params={"limit": 2, "offset": offset}).json() for offset in (0, 2)]
        assert [[t["tokenName"] for t in page] for page in pages] == [within[:2], within[2:]]
        assert client.patch("/tokens/ledger-exec", json={"newName": "ledger-exec-1"}).status_code == 200
        assert client.delete("/tokens/ledger-exec-1").status_code == 204
    with api(relay, API_KEYS["acme"]) as admin:
        names = {t["tokenName"] for t in admin.get("/tokens").json()}
    assert {"billing-exec", "org-admin", "ledger-writer", "ops", "prod"} <= names
    assert "ledger-exec-1" not in names and "pwned" not in names


def test_a_socket_whose_key_is_deleted_during_its_handshake_is_closed(start_relay: StartRelay) -> None:
    """The key was checked when the socket opened, and the sockets of a deleted key were closed only
    if the hub held them already: a socket in its handshake then was admitted, and stayed."""
    relay = start_relay()
    secret = create(relay, "robot", {"appNames": ["ledger"]})

    async def scenario() -> tuple[int | None, str]:
        ws = await open_socket(ws_url(relay, secret))  # accepted; Relay asked executor_info
        with api(relay, API_KEYS["acme"]) as admin:
            assert admin.delete("/tokens/robot").status_code == 204
        await off_loop(assert_eventually, lambda: status(relay, secret) == 401, 3)  # the key ring reloaded
        executor_id = await handshake(ws)
        with pytest.raises(ConnectionClosed):
            while True:  # whatever Relay sends before it closes the socket
                await asyncio.wait_for(ws.recv(), 3)
        return ws.close_code, executor_id

    code, executor_id = asyncio.run(scenario())
    assert code == 4401
    # Lost like a socket whose key is deleted: its grace period runs.
    assert_eventually(lambda: relay.state_of("acme", "ledger", executor_id) == "DISCONNECTED", 3)


def test_rotating_or_narrowing_a_key_in_relay_yaml_closes_the_sockets_it_no_longer_admits(
    start_relay: StartRelay,
) -> None:
    """relay.yaml's keys keep their id when their secret or their apps change, and only the sockets of
    keys whose id disappeared were closed: a rotated-out secret kept its sockets."""
    config = relay_yaml(free_port(), grace=30)
    keys = config["orgs"][0]["conductorKeys"]
    keys.append({"name": "staging", "sha256": sha("ck-staging")})
    relay1 = start_relay(config, instance_id="relay-1")

    async def connect(key: str) -> tuple[ClientConnection, str]:
        ws = await open_socket(ws_url(relay1, key))
        executor_id = await handshake(ws)
        await off_loop(assert_eventually, lambda: relay1.state_of("acme", "ledger", executor_id) == "HEALTHY", 5)
        return ws, executor_id

    async def closed(ws: ClientConnection) -> int | None:
        with pytest.raises(ConnectionClosed):
            while True:
                await asyncio.wait_for(ws.recv(), 5)
        return ws.close_code

    async def scenario() -> list[tuple[int | None, str]]:
        sockets = [await connect(CONDUCTOR_KEYS["acme"]), await connect("ck-staging")]
        changed = copy.deepcopy(config)
        changed["server"]["port"] = free_port()
        changed["orgs"][0]["conductorKeys"] = [
            {"name": "prod", "sha256": sha("a-fresh-secret")},  # rotated
            {"name": "staging", "sha256": sha("ck-staging"), "apps": ["other"]},  # no longer for ledger
        ]
        await off_loop(start_relay, changed, "relay-2")  # writes relay.yaml's keys to the database
        return [(await closed(ws), executor_id) for ws, executor_id in sockets]

    for code, executor_id in asyncio.run(scenario()):
        assert code == 4401
        assert_eventually(lambda e=executor_id: relay1.state_of("acme", "ledger", e) == "DISCONNECTED", 3)


def test_a_key_an_instances_relay_yaml_no_longer_has_is_removed_everywhere_and_the_audit_log_says_so(
    start_relay: StartRelay,
) -> None:
    """Keys are shared by every instance: one started with a relay.yaml that lacks a key takes it
    from all of them (the README asks for the same relay.yaml everywhere). That used to happen with
    no word anywhere; the operator whose key stops working now finds who removed it and why."""
    config = relay_yaml(free_port(), grace=30)
    config["orgs"][0]["apiKeys"].append({"name": "oncall", "sha256": sha("ak-oncall"), "role": "admin"})
    relay1 = start_relay(config, instance_id="relay-1")
    assert status(relay1, "ak-oncall") == 200
    changed = copy.deepcopy(config)
    changed["server"]["port"] = free_port()
    changed["orgs"][0]["apiKeys"].pop()  # this instance's relay.yaml is an older one
    relay2 = start_relay(changed, instance_id="relay-2")
    assert_eventually(lambda: status(relay1, "ak-oncall") == 401, 5)
    with api(relay1, API_KEYS["acme"]) as client:
        entries = [e for e in client.get("/audit").json() if e["action"] == "token.deleted"]
    assert [(e["actor"], e["detail"]["tokenName"], e["detail"]["source"]) for e in entries] == [
        ("relay.yaml", "oncall", "config")
    ]
    assert "'oncall' of org 'acme' is not in this instance's relay.yaml" in relay2.log()
