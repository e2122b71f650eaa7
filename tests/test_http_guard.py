"""Hostile HTTP: what a request costs before it is authenticated, slow clients, and what the
open endpoints give away. A real Relay, real sockets; raw ones where a well-behaved client
would not do what an attacker does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import InvalidStatus

from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import open_socket
from harness.waiting import assert_eventually
from tests.prom import sample

HANDSHAKE_CAP = 5  # maxPendingHandshakes
ADMIN = {"Authorization": f"Bearer {API_KEYS['acme']}"}


@pytest.fixture(scope="module")
def relay(
    postgres: Postgres, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RelayProcess]:
    """One Relay with tight limits for the whole module (each start costs seconds)."""
    config = relay_yaml(free_port(), handshake=2.0)
    config["server"].update(maxPendingHandshakes=HANDSHAKE_CAP)
    relay = RelayProcess(tmp_path_factory.mktemp("guard"), postgres.create_database("relay"), config)
    failed_before = request.session.testsfailed
    relay.start()
    yield relay
    relay.stop()
    if request.session.testsfailed > failed_before:
        print(f"--- {relay.instance_id} log ---\n{relay.log()[-6000:]}")


# -- executors' handshakes ----------------------------------------------------------------------


def test_simultaneous_handshakes_cannot_overshoot_the_pending_cap(relay: RelayProcess) -> None:
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"

    async def attempt() -> ClientConnection | int:
        try:
            return await open_socket(url)  # and never answer executor_info
        except InvalidStatus as exc:
            return exc.response.status_code

    async def crowd() -> tuple[int, list[int]]:
        results = await asyncio.gather(*(attempt() for _ in range(3 * HANDSHAKE_CAP)))
        accepted = [r for r in results if isinstance(r, ClientConnection)]
        for ws in accepted:
            await ws.close()
        return len(accepted), [r for r in results if isinstance(r, int)]

    accepted, refused = asyncio.run(crowd())
    assert 1 <= accepted <= HANDSHAKE_CAP
    assert refused == [503] * (3 * HANDSHAKE_CAP - accepted)

    def pending() -> float | None:
        return sample(httpx.get(f"{relay.http}/metrics", headers=ADMIN).text, "relay_pending_handshakes")

    assert_eventually(lambda: pending() == 0, 5, what="every slot given back")
