"""Bad input from the network: each case gets a clear answer or log line and
affects no other connection (a real DBOS executor stays connected throughout)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from harness.executors import ExecutorProcess
from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, off_loop, open_socket
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.net.hub import RefusalLog
from tests.prom import AUTH, sample

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


def ws_url(relay: RelayProcess, key: str = CONDUCTOR_KEYS["acme"], app: str = "ledger") -> str:
    return f"ws://127.0.0.1:{relay.port}/websocket/{app}/{key}"


@pytest.fixture
def relay_and_bystander(
    start_relay: StartRelay, start_executor: StartExecutor
) -> tuple[RelayProcess, ExecutorProcess, str]:
    """A Relay with one real executor connected; returns its connectedAt to check it never reconnects."""
    config = relay_yaml(free_port(), handshake=1.0)
    config["server"]["maxFrameBytes"] = 64 * 1024
    relay = start_relay(config)
    ex = start_executor(relay.conductor_url)
    record = assert_eventually(lambda: relay.executor("acme", "ledger", ex.executor_id), 10)
    assert record["state"] == "HEALTHY"
    return relay, ex, record["connectedAt"]


def assert_bystander_untouched(relay: RelayProcess, ex: ExecutorProcess, connected_at: str) -> None:
    record = relay.executor("acme", "ledger", ex.executor_id)
    assert record is not None
    assert record["state"] == "HEALTHY"
    assert record["connectedAt"] == connected_at, "the real executor was disconnected"
    with relay.api() as api:
        resp = api.get(f"/apps/ledger/executors/{ex.executor_id}/workflows")
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    "path",
    [
        "/websocket/ledger/wrong-key",
        "/websocket/ledger/",
        "/websocket/ledger",
        "/conductor/v1alpha1/websocket/ledger/x",
    ],
)
def test_bad_or_missing_key_is_refused_with_403_and_a_json_reason(
    relay_and_bystander: tuple[RelayProcess, ExecutorProcess, str], path: str
) -> None:
    relay, ex, connected_at = relay_and_bystander

    async def attempt() -> InvalidStatus:
        with pytest.raises(InvalidStatus) as info:
            await open_socket(f"ws://127.0.0.1:{relay.port}{path}")
        return info.value

    error = asyncio.run(attempt())
    assert error.response.status_code == 403
    assert json.loads(error.response.body)["error"]["code"] == "bad_key"
    assert "bad or missing conductor key" in relay.log()
    assert "wrong-key" not in relay.log(), "keys are never logged"
    assert CONDUCTOR_KEYS["acme"] not in relay.log(), "keys are never logged"
    assert "ERROR" not in relay.log()
    assert_bystander_untouched(relay, ex, connected_at)


def test_an_api_key_is_not_a_conductor_key(relay_and_bystander: tuple[RelayProcess, ExecutorProcess, str]) -> None:
    relay, _, _ = relay_and_bystander

    async def attempt() -> int:
        with pytest.raises(InvalidStatus) as info:
            await open_socket(ws_url(relay, key="api-acme-secret"))
        return info.value.response.status_code

    assert asyncio.run(attempt()) == 403


def test_executor_that_never_answers_executor_info_is_closed(
    relay_and_bystander: tuple[RelayProcess, ExecutorProcess, str],
) -> None:
    relay, ex, connected_at = relay_and_bystander

    async def silent() -> tuple[int | None, float]:
        before = time.monotonic()  # Relay's deadline begins once it has sent executor_info: after this
        ws = await open_socket(ws_url(relay))
        assert json.loads(await ws.recv())["type"] == "executor_info"
        after = time.monotonic()  # and before this
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
        closed = time.monotonic()
        return ws.close_code, closed - before, closed - after

    code, at_least, at_most = asyncio.run(silent())
    assert code == 4408
    assert 0.9 <= at_least and at_most < 3.0  # handshakeTimeoutSecs is 1 in this test
    assert "no executor_info reply within 1s; closing" in relay.log()
    assert_bystander_untouched(relay, ex, connected_at)


def test_malformed_binary_and_unknown_frames_are_logged_and_ignored(
    relay_and_bystander: tuple[RelayProcess, ExecutorProcess, str],
) -> None:
    relay, ex, connected_at = relay_and_bystander

    async def misbehave() -> str:
        ws = await open_socket(ws_url(relay))
        executor_id = await handshake(ws)
        await off_loop(assert_eventually, lambda: relay.state_of("acme", "ledger", executor_id) == "HEALTHY", 5)
        await ws.send("{not json")
        await ws.send(b"\x00\x01binary")
        await ws.send(json.dumps(["a", "list"]))
        await ws.send(json.dumps({"type": "recovery", "request_id": "nobody-asked", "success": True}))
        await ws.send(json.dumps({"type": "executor_info"}))
        # Still connected and still answering pings: Relay did not drop it.
        await asyncio.sleep(1.5)
        assert await off_loop(relay.state_of, "acme", "ledger", executor_id) == "HEALTHY"
        await ws.close()
        return executor_id

    executor_id = asyncio.run(misbehave())
    log = relay.log()
    name = f"executor acme/ledger/{executor_id}"
    assert f"{name}: ignored a malformed frame: frame is not valid JSON" in log
    assert f"{name}: ignored a binary frame (8 bytes)" in log
    assert f"{name}: ignored a malformed frame: frame: expected a JSON object, got list" in log
    assert f'{name}: ignored a "recovery" reply with unknown request_id "nobody-asked"' in log
    assert f"{name}: ignored a malformed frame: frame: request_id: required field missing" in log
    assert_eventually(lambda: relay.state_of("acme", "ledger", executor_id) == "DISCONNECTED", 5)
    assert_bystander_untouched(relay, ex, connected_at)


def test_bad_executor_info_reply_is_refused(relay_and_bystander: tuple[RelayProcess, ExecutorProcess, str]) -> None:
    relay, ex, connected_at = relay_and_bystander

    async def bad_reply() -> int | None:
        ws = await open_socket(ws_url(relay))
        request = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "executor_info", "request_id": request["request_id"], "executor_id": 42}))
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
        return ws.close_code

    assert asyncio.run(bad_reply()) == 4400
    assert "bad executor_info reply: executor_info reply: executor_id: expected str, got int" in relay.log()
    assert_bystander_untouched(relay, ex, connected_at)


def test_a_deeply_nested_executor_info_reply_is_refused(
    relay_and_bystander: tuple[RelayProcess, ExecutorProcess, str],
) -> None:
    """Nested 700 deep, with an escape that makes a lone surrogate: within what the JSON decoder
    takes, and once beyond what cleaning the frame of surrogates could copy (a traceback)."""
    relay, ex, connected_at = relay_and_bystander
    hostname = "[" * 700 + '"\\ud800"' + "]" * 700

    async def nested_reply() -> int | None:
        ws = await open_socket(ws_url(relay))
        request = json.loads(await ws.recv())
        await ws.send(f'{{"type": "executor_info", "request_id": "{request["request_id"]}", "executor_id": "deep",'
                      f' "application_version": "v1", "hostname": {hostname}}}')  # fmt: skip
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
        return ws.close_code

    assert asyncio.run(nested_reply()) == 4400
    log = relay.log()
    assert "bad executor_info reply: executor_info reply: hostname: expected str" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert_bystander_untouched(relay, ex, connected_at)


def test_frame_over_the_size_limit_closes_only_that_connection(
    relay_and_bystander: tuple[RelayProcess, ExecutorProcess, str],
) -> None:
    relay, ex, connected_at = relay_and_bystander

    async def oversize() -> tuple[str, int | None]:
        ws = await open_socket(ws_url(relay))
        executor_id = await handshake(ws)
        await off_loop(assert_eventually, lambda: relay.state_of("acme", "ledger", executor_id) == "HEALTHY", 5)
        await ws.send(json.dumps({"type": "list_workflows", "request_id": "x", "output": "y" * 100_000}))
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
        return executor_id, ws.close_code

    executor_id, code = asyncio.run(oversize())
    assert code == 1009
    assert f"executor acme/ledger/{executor_id}: frame over 65536 bytes; connection closed" in relay.log()
    assert_eventually(lambda: relay.state_of("acme", "ledger", executor_id) == "DISCONNECTED", 5)
    assert_bystander_untouched(relay, ex, connected_at)


def test_flood_of_connection_attempts_leaves_others_alone(
    relay_and_bystander: tuple[RelayProcess, ExecutorProcess, str],
) -> None:
    relay, ex, connected_at = relay_and_bystander

    async def bad_key() -> int:
        try:
            ws = await open_socket(ws_url(relay, key="nope"))
        except InvalidStatus as exc:
            return exc.response.status_code
        await ws.close()
        return 101

    async def silent() -> int | None:
        ws = await open_socket(ws_url(relay))
        try:
            await asyncio.wait_for(ws.wait_closed(), 10)
        finally:
            await ws.close()
        return ws.close_code

    async def flood() -> tuple[list[int], list[int | None], str]:
        bad = [bad_key() for _ in range(300)]
        quiet = [silent() for _ in range(100)]
        results = await asyncio.gather(asyncio.gather(*bad), asyncio.gather(*quiet), good_one())
        return results[0], results[1], results[2]

    async def good_one() -> str:
        await asyncio.sleep(0.3)  # in the middle of the flood
        ws = await open_socket(ws_url(relay))
        executor_id = await handshake(ws)
        await asyncio.sleep(0.5)
        await ws.close()
        return executor_id

    refused, closed, newcomer = asyncio.run(flood())
    assert refused == [403] * 300
    assert closed == [4408] * 100  # each silent one is closed at its handshake timeout
    with relay.api() as api:
        record = api.get(f"/apps/ledger/executors/{newcomer}").json()
    assert record["executorId"] == newcomer  # a well-behaved newcomer got through mid-flood
    assert_bystander_untouched(relay, ex, connected_at)
    metrics = httpx.get(f"{relay.http}/metrics", headers=AUTH, verify=TLS).text
    assert sample(metrics, "relay_hub_events_total", kind="rejected_bad_key") == 300
    # Counted, each of them, but logged once a minute per host and app (an executor with a deleted
    # key tries again every second for as long as it runs: a line each was the log's whole volume).
    assert relay.log().count("bad or missing conductor key") == 1
    assert sample(metrics, "relay_hub_events_total", kind="rejected_handshake_timeout") == 100


def test_pending_handshakes_beyond_the_cap_get_503(start_relay: StartRelay) -> None:
    config = relay_yaml(free_port(), handshake=3.0)
    config["server"]["maxPendingHandshakes"] = 20
    relay = start_relay(config)

    async def scenario() -> tuple[list[int], str]:
        holders = [await open_socket(ws_url(relay)) for _ in range(20)]
        with pytest.raises(InvalidStatus) as info:
            await open_socket(ws_url(relay))
        status = info.value.response.status_code
        body = json.loads(info.value.response.body)["error"]["code"]
        for ws in holders:
            await ws.close()
        return [status], body

    statuses, code = asyncio.run(scenario())
    assert statuses == [503]
    assert code == "busy"
    assert "handshakes already pending" in relay.log()


def test_unknown_websocket_path_is_404(start_relay: StartRelay) -> None:
    relay = start_relay()

    async def attempt() -> int:
        with pytest.raises(InvalidStatus) as info:
            await open_socket(f"ws://127.0.0.1:{relay.port}/elsewhere")
        return info.value.response.status_code

    assert asyncio.run(attempt()) == 404


def test_a_refusal_is_logged_again_after_its_interval_with_the_number_refused_in_between() -> None:
    refusals = RefusalLog(every=0.2)
    assert refusals.due("bad_key", "10.0.0.1", "ledger") == 0  # the first: logged
    assert [refusals.due("bad_key", "10.0.0.1", "ledger") for _ in range(3)] == [None] * 3
    assert refusals.due("bad_key", "10.0.0.2", "ledger") == 0  # another host: its own line
    assert refusals.due("bad_key", "10.0.0.1", "billing") == 0  # another app too
    time.sleep(0.25)
    assert refusals.due("bad_key", "10.0.0.1", "ledger") == 3  # logged again, saying how many since
    assert refusals.due("bad_key", "10.0.0.1", "ledger") is None
