"""Hostile and unlucky input at the executor side: it affects only its sender, and nothing is left stranded."""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus

from harness.keys import CONDUCTOR_KEYS, sha
from harness.ports import free_port
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, info_reply, off_loop, open_socket
from harness.waiting import assert_eventually
from tests.prom import scrape

StartRelay = Callable[..., RelayProcess]
OTHER_KEY = "ck-acme-second"


def ws_url(relay: RelayProcess, key: str = CONDUCTOR_KEYS["acme"], app: str = "ledger") -> str:
    return f"ws://127.0.0.1:{relay.port}/websocket/{app}/{key}"


def config(**server: Any) -> dict[str, Any]:
    cfg = relay_yaml(free_port(), handshake=2.0)
    cfg["server"].update(server)
    cfg["orgs"][0]["conductorKeys"].append({"name": "second", "sha256": sha(OTHER_KEY)})
    return cfg


def healthy(relay: RelayProcess, app: str = "ledger") -> set[str]:
    with relay.api() as api:
        rows = api.get(f"/apps/{app}/executors", params={"state": "HEALTHY", "limit": 1000}).json()
    return {r["executorId"] for r in rows}


# How long a socket may wait for Relay's close: forty bad handshakes come together with forty honest
# ones, each honest one a durable registry write, on a 2-core machine that CI loads further (a close
# came later than 5 s once there). What the tests check is the close and its code, not how soon.
CLOSE_WAIT_SECS = 15.0


async def close_code(ws: ClientConnection, timeout: float = CLOSE_WAIT_SECS) -> int | None:
    with pytest.raises(ConnectionClosed):
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    return ws.close_code


def bad_info_replies(request_id: str) -> list[str]:
    """executor_info replies that must be refused, each in its own way."""
    good = json.loads(info_reply(request_id, str(uuid.uuid4())))
    return [
        json.dumps({**good, "hostname": "host\x00name"}),
        json.dumps({**good, "executor_metadata": {"x": math.nan}}),  # json.dumps writes NaN
        json.dumps({**good, "hostname": "h" * (10 * 1024 * 1024)}),
        json.dumps({**good, "executor_id": 42}),
        json.dumps({**good, "executor_id": "id\x00"}),
        json.dumps({**good, "application_version": ["v1"]}),
        json.dumps({**good, "executor_metadata": {"big": "x" * 70_000}}),
        json.dumps({**good, "executor_id": "e" * 300}),
    ]


def test_forty_honest_and_forty_bad_handshakes_at_once(start_relay: StartRelay) -> None:
    # The honest ones answer executor_info late while the loop builds the bad frames: the
    # handshake timeout is not what this test is about.
    cfg = config(handshakeTimeoutSecs=30.0)
    # This client's one loop also builds and sends the bad frames (10 MiB ones among them):
    # pings are spaced so that its honest sockets answer them in time.
    cfg["liveness"].update(pingIntervalSecs=5.0, pingWaitSecs=20.0)
    relay = start_relay(cfg)
    honest_ids = [str(uuid.uuid4()) for _ in range(40)]

    opened: list[ClientConnection] = []

    async def honest(executor_id: str) -> ClientConnection:
        ws = await open_socket(ws_url(relay))
        opened.append(ws)
        await handshake(ws, executor_id)
        return ws

    async def bad(n: int) -> int | None:
        ws = await open_socket(ws_url(relay), max_size=None)
        opened.append(ws)
        request = json.loads(await ws.recv())
        replies = bad_info_replies(request["request_id"])
        await ws.send(replies[n % len(replies)])
        return await close_code(ws)

    async def crowd() -> tuple[list[ClientConnection], list[int | None]]:
        results = await asyncio.gather(*(honest(i) for i in honest_ids), *(bad(n) for n in range(40)))
        sockets = [r for r in results[:40] if isinstance(r, ClientConnection)]
        codes = [r for r in results[40:] if not isinstance(r, ClientConnection)]
        await off_loop(assert_eventually, lambda: healthy(relay) >= set(honest_ids), 15)
        return sockets, codes

    async def run() -> list[int | None]:
        try:
            _, codes = await crowd()
            return codes
        finally:
            await asyncio.gather(*(ws.close() for ws in opened))

    codes = asyncio.run(run())
    assert codes == [4400] * 40
    assert "cannot record its connection" not in relay.log()
    with psycopg.connect(relay.database_url) as conn:
        hostnames = {r[0] for r in conn.execute("SELECT hostname FROM executors")}
    assert hostnames == {"simulated"}  # nothing of the bad ones reached the registry


def test_an_executor_id_belongs_to_the_key_that_first_presented_it(start_relay: StartRelay) -> None:
    relay = start_relay(config())
    executor_id = str(uuid.uuid4())

    async def run() -> int | None:
        first = await open_socket(ws_url(relay))
        await handshake(first, executor_id)
        await off_loop(assert_eventually, lambda: executor_id in healthy(relay), 5)
        record = await off_loop(relay.executor, "acme", "ledger", executor_id)
        thief = await open_socket(ws_url(relay, key=OTHER_KEY))
        await handshake(thief, executor_id)
        code = await close_code(thief)
        assert await off_loop(relay.executor, "acme", "ledger", executor_id) == record  # untouched
        await first.ping()  # the rightful socket is still open
        await first.close()
        return code

    assert asyncio.run(run()) == 4403
    assert "belongs to another key" in relay.log()


def test_a_newer_handshake_through_another_instance_closes_the_older_socket_at_once(
    start_relay: StartRelay,
) -> None:
    cfg1 = config()
    relay1 = start_relay(cfg1, instance_id="relay-1")
    relay2 = start_relay({**cfg1, "server": {**cfg1["server"], "port": free_port()}}, instance_id="relay-2")
    executor_id = str(uuid.uuid4())

    async def run() -> int | None:
        old = await open_socket(ws_url(relay1))  # half-open from now on: this client never closes it
        await handshake(old, executor_id)
        await off_loop(assert_eventually, lambda: relay1.state_of("acme", "ledger", executor_id) == "HEALTHY", 5)
        new = await open_socket(ws_url(relay2))
        await handshake(new, executor_id)
        code = await close_code(old, timeout=3)  # well before the socket check (10 s)
        record = await off_loop(relay2.executor, "acme", "ledger", executor_id)
        assert record is not None and record["state"] == "HEALTHY" and record["relayInstance"] == "relay-2"
        await new.ping()
        await new.close()
        return code

    assert asyncio.run(run()) == 4409


def test_a_disconnection_lost_to_a_database_error_is_recorded_by_the_socket_check(start_relay: StartRelay) -> None:
    cfg = config()
    cfg["liveness"]["socketCheckSecs"] = 0.5
    relay = start_relay(cfg)
    executor_id = str(uuid.uuid4())
    refuse = """CREATE FUNCTION refuse_disconnect() RETURNS trigger AS $$
                BEGIN RAISE EXCEPTION 'injected failure'; END $$ LANGUAGE plpgsql;
                CREATE TRIGGER refuse_disconnect BEFORE UPDATE ON executors FOR EACH ROW
                WHEN (NEW.state = 'DISCONNECTED') EXECUTE FUNCTION refuse_disconnect()"""

    async def run() -> None:
        ws = await open_socket(ws_url(relay))
        await handshake(ws, executor_id)
        await off_loop(assert_eventually, lambda: relay.state_of("acme", "ledger", executor_id) == "HEALTHY", 5)
        with psycopg.connect(relay.database_url, autocommit=True) as conn:
            conn.execute(refuse)  # the database refuses every disconnection for now
            ws.transport.abort()
            await off_loop(assert_eventually, lambda: "cannot record its disconnection yet" in relay.log(), 5)
            assert await off_loop(relay.state_of, "acme", "ledger", executor_id) == "HEALTHY"
            conn.execute("DROP TRIGGER refuse_disconnect ON executors")
        await off_loop(assert_eventually, lambda: relay.state_of("acme", "ledger", executor_id) == "DISCONNECTED", 5)

    asyncio.run(run())
    # Logged once the disconnection is recorded: awaited, not read the moment DISCONNECTED is seen.
    recorded = "no socket here; its disconnection is recorded now"
    assert_eventually(lambda: recorded in relay.log(), 10, what="the disconnection recorded by the socket check")
    with relay.api() as api:  # and its grace period runs: the same as any lost connection
        assert api.get(f"/apps/ledger/executors/{executor_id}").json()["disconnectedAt"]


def test_apps_are_not_registered_from_the_path_when_auto_registration_is_off(start_relay: StartRelay) -> None:
    cfg = config()
    cfg["autoRegisterApps"] = False
    relay = start_relay(cfg)

    async def attempt(app: str) -> int:
        try:
            ws = await open_socket(ws_url(relay, app=app))
        except InvalidStatus as exc:
            return exc.response.status_code
        await handshake(ws)
        await ws.close()
        return 101

    # Counted, and exported from the start: an alert on its increase sees the first refusal.
    assert scrape(relay.http, "relay_hub_events_total", kind="rejected_unknown_app") == 0
    assert asyncio.run(attempt("no-such-app")) == 404
    assert scrape(relay.http, "relay_hub_events_total", kind="rejected_unknown_app") == 1
    assert asyncio.run(attempt("ledger")) == 101
    with relay.api() as api:
        assert [a["name"] for a in api.get("/apps").json()] == ["ledger"]


def test_a_key_holds_a_bounded_number_of_sockets(start_relay: StartRelay) -> None:
    relay = start_relay(config(maxSocketsPerKey=3))

    async def run() -> tuple[int, bool]:
        sockets = [await open_socket(ws_url(relay)) for _ in range(3)]
        with pytest.raises(InvalidStatus) as refused:
            await open_socket(ws_url(relay))
        other = await open_socket(ws_url(relay, key=OTHER_KEY))  # another key is not affected
        await handshake(other)
        for ws in [*sockets, other]:
            await ws.close()
        await asyncio.sleep(0.2)
        again = await open_socket(ws_url(relay))  # the count goes down with the closes
        await again.close()
        return refused.value.response.status_code, True

    assert asyncio.run(run()) == (429, True)


def test_ids_and_names_are_logged_escaped(start_relay: StartRelay) -> None:
    relay = start_relay(config())
    forged = "x\n2026-01-01 00:00:00,000 CRITICAL relay: forged line"

    async def run() -> None:
        ws = await open_socket(ws_url(relay))
        await handshake(ws, forged)
        await off_loop(assert_eventually, lambda: "connected (version v1" in relay.log(), 5)
        await ws.close()

    asyncio.run(run())
    assert "CRITICAL relay: forged line" not in [line.split(" ", 2)[-1] for line in relay.log().splitlines()]
    assert "x\\n2026-01-01" in relay.log()


def test_lists_are_paged(start_relay: StartRelay) -> None:
    relay = start_relay(config())
    ids = sorted(str(uuid.uuid4()) for _ in range(5))

    async def run() -> None:
        sockets = []
        for executor_id in ids:
            ws = await open_socket(ws_url(relay))
            await handshake(ws, executor_id)
            sockets.append(ws)
        await off_loop(assert_eventually, lambda: healthy(relay) == set(ids), 5)
        with relay.api() as api:
            first = api.get("/apps/ledger/executors", params={"limit": 2}).json()
            rest = api.get("/apps/ledger/executors", params={"limit": 2, "offset": 2}).json()
            assert len(first) == 2 and len(rest) == 2
            assert not {e["executorId"] for e in first} & {e["executorId"] for e in rest}
            assert api.get("/apps/ledger/executors", params={"limit": 100_000}).status_code == 422
        for ws in sockets:
            await ws.close()

    asyncio.run(run())
