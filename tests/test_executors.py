"""Real DBOS 3.2 executors (the SDK's own conductor client) against a real Relay."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime

from harness.executors import ExecutorProcess
from harness.proxy import TcpProxy
from harness.relay import RelayProcess
from harness.waiting import assert_eventually

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


def ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_executor_appears_healthy_with_its_identity(start_relay: StartRelay, start_executor: StartExecutor) -> None:
    relay = start_relay()
    ex = start_executor(relay.conductor_url, version="v7")
    record = assert_eventually(lambda: relay.executor("acme", "ledger", ex.executor_id), 10)
    assert record["state"] == "HEALTHY"
    assert record["applicationVersion"] == "v7"
    assert record["language"] == "python"
    assert record["dbosVersion"].startswith("3.2.")
    assert record["hostname"]
    assert record["metadata"] == {"test": True}
    assert record["relayInstance"] == "relay-1"
    assert record["disconnectedAt"] is None
    with relay.api() as api:
        app = api.get("/apps/ledger").json()
        assert app["executors"]["HEALTHY"] == 1
        listed = api.get("/apps/ledger/executors", params={"state": "HEALTHY"}).json()
        assert [e["executorId"] for e in listed] == [ex.executor_id]
        assert api.get("/apps/ledger/executors", params={"state": "DEAD"}).json() == []


def test_the_conductor_v1alpha1_prefix_is_accepted(start_relay: StartRelay, start_executor: StartExecutor) -> None:
    relay = start_relay()
    ex = start_executor(relay.conductor_url + "conductor/v1alpha1")
    assert_eventually(lambda: relay.state_of("acme", "ledger", ex.executor_id) == "HEALTHY", 10)


def test_request_reaches_the_executor_and_its_reply_comes_back(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    relay = start_relay()
    ex = start_executor(relay.conductor_url, sleepers=3)
    assert_eventually(lambda: relay.state_of("acme", "ledger", ex.executor_id) == "HEALTHY", 10)
    with relay.api() as api:
        resp = api.get(f"/apps/ledger/executors/{ex.executor_id}/workflows", params={"status": "PENDING"})
        assert resp.status_code == 200, resp.text
        workflows = resp.json()
    assert len(workflows) == 3
    assert {w["status"] for w in workflows} == {"PENDING"}
    assert {w["name"] for w in workflows} == {"sleeper"}
    assert {w["executorId"] for w in workflows} == {ex.executor_id}


def test_kill_9_is_disconnected_within_ping_wait(start_relay: StartRelay, start_executor: StartExecutor) -> None:
    # A missed pong tells no sooner than pingWaitSecs - pingIntervalSecs (5.5 s) after the kill: room
    # for a loaded machine to see the closed socket well before that.
    relay = start_relay(pingIntervalSecs=0.5, pingWaitSecs=6.0)
    ex = start_executor(relay.conductor_url)
    assert_eventually(lambda: relay.state_of("acme", "ledger", ex.executor_id) == "HEALTHY", 10)
    ex.kill()
    killed = time.time()  # (the process is reaped: Relay may have seen the socket close already)
    assert_eventually(lambda: relay.state_of("acme", "ledger", ex.executor_id) == "DISCONNECTED", 6.0 + 0.5)
    record = relay.executor("acme", "ledger", ex.executor_id)
    assert record is not None and record["disconnectedAt"] is not None
    # The kernel closes a killed process's socket, so Relay knows at once: timed by Relay's own
    # record, not by when this test's reads saw it (a stall of the test process is not Relay's).
    assert ts(record["disconnectedAt"]).timestamp() - killed < 4.0


def test_sigstop_is_disconnected_after_ping_wait_and_not_before(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    interval, wait = 0.25, 2.0
    relay = start_relay(pingIntervalSecs=interval, pingWaitSecs=wait)
    ex = start_executor(relay.conductor_url)
    assert_eventually(lambda: relay.state_of("acme", "ledger", ex.executor_id) == "HEALTHY", 10)
    # Any frame counts as heard: a request answered through the executor is a frame Relay reads
    # after ``heard`` (not a pong that a busy machine may have kept from coming in the last interval).
    heard = time.monotonic()
    with relay.api() as api:
        assert api.get(f"/apps/ledger/executors/{ex.executor_id}/workflows").status_code == 200
    ex.pause()
    paused = time.time()  # the executor's last frame came before this
    try:
        # The socket stays open; only the missing pongs tell, and not before ``heard`` + wait:
        # every state read that has ended by then must be HEALTHY.
        while True:
            state = relay.state_of("acme", "ledger", ex.executor_id)
            if time.monotonic() >= heard + wait:
                break
            assert state == "HEALTHY"
            time.sleep(0.05)
        # And soon after: within the 2 s the chaos checker allows a loaded machine past pingWaitSecs
        # (chaos/dbrules.py, HEALTHY_TOLERANCE_SECS), timed by Relay's own record: when this test's
        # reads see it is no measure of Relay (the test process stalls on a loaded machine too).
        record = assert_eventually(
            lambda: (r := relay.executor("acme", "ledger", ex.executor_id)) and r["state"] == "DISCONNECTED" and r, 10
        )
        assert ts(record["disconnectedAt"]).timestamp() - paused < wait + 2.0
        assert f"executor acme/ledger/{ex.executor_id}: nothing heard for 2s" in relay.log()
    finally:
        ex.resume()
    # Woken up, the SDK finds its socket closed and reconnects with the same id.
    assert_eventually(lambda: relay.state_of("acme", "ledger", ex.executor_id) == "HEALTHY", 15)


def test_cut_connection_comes_back_healthy_in_the_same_record(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    relay = start_relay()
    with TcpProxy(("127.0.0.1", relay.port)) as proxy:
        ex = start_executor(f"ws://127.0.0.1:{proxy.port}/")
        first = assert_eventually(lambda: relay.executor("acme", "ledger", ex.executor_id), 10)
        assert first["state"] == "HEALTHY"
        assert_eventually(lambda: proxy.open_pairs == 1, 5)

        def disconnected() -> dict[str, str] | None:
            rec = relay.executor("acme", "ledger", ex.executor_id)
            return rec if rec and rec["disconnectedAt"] else None

        proxy.cut()
        cut = time.time()
        # Relay sees the closed socket at once: timed by its own record, not by when this test's reads
        # see it (a stall of the test process is not Relay's), and whatever state the record is in by
        # then (the SDK may be back already).
        gone = assert_eventually(disconnected, 10)
        assert ts(gone["disconnectedAt"]).timestamp() - cut < 1.0

        def back() -> dict[str, str] | None:
            rec = relay.executor("acme", "ledger", ex.executor_id)
            return rec if rec and rec["state"] == "HEALTHY" else None

        again = assert_eventually(back, 10)
    assert again["executorId"] == ex.executor_id
    assert ts(again["connectedAt"]) > ts(first["connectedAt"])
    assert ts(first["connectedAt"]) < ts(again["disconnectedAt"]) < ts(again["connectedAt"])
    with relay.api() as api:
        assert len(api.get("/apps/ledger/executors").json()) == 1


def test_orgs_never_see_each_other(start_relay: StartRelay, start_executor: StartExecutor) -> None:
    relay = start_relay()
    a = start_executor(relay.conductor_url, org="acme")
    g = start_executor(relay.conductor_url, org="globex")
    assert_eventually(lambda: relay.state_of("acme", "ledger", a.executor_id) == "HEALTHY", 10)
    assert_eventually(lambda: relay.state_of("globex", "ledger", g.executor_id) == "HEALTHY", 10)
    with relay.api("acme") as api:
        assert [e["executorId"] for e in api.get("/apps/ledger/executors").json()] == [a.executor_id]
        assert api.get(f"/apps/ledger/executors/{g.executor_id}").status_code == 404
        assert api.get(f"/apps/ledger/executors/{g.executor_id}/workflows").status_code == 409
    with relay.api("globex") as api:
        assert [e["executorId"] for e in api.get("/apps/ledger/executors").json()] == [g.executor_id]
    # An acme key asking for globex's resources is refused outright.
    with relay.api("globex", key="api-acme-secret") as api:
        resp = api.get("/apps/ledger/executors")
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "forbidden"


def test_restarted_relay_marks_the_executors_it_held_disconnected_then_they_return(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    relay = start_relay()
    ex = start_executor(relay.conductor_url)
    assert_eventually(lambda: relay.state_of("acme", "ledger", ex.executor_id) == "HEALTHY", 10)
    relay.proc.kill()  # type: ignore[union-attr]
    relay.proc.wait()  # type: ignore[union-attr]
    relay.start()
    # The SDK retries every second; it comes back under the same id.
    assert_eventually(lambda: relay.state_of("acme", "ledger", ex.executor_id) == "HEALTHY", 15)
    record = relay.executor("acme", "ledger", ex.executor_id)
    assert record is not None and record["disconnectedAt"] is not None
