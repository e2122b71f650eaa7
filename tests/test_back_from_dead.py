"""Executors declared DEAD that come back together (a reconnect storm) are handled together
(workflows.engine ``_drain_back``): one read of their recovery runs per batch, their records'
writes combined, and a record whose write fails is retried alone without failing the others; and
the blocked recoveries an executor connecting wakes. Real Relay, real PostgreSQL, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import psycopg
from dbos import DBOSClient
from websockets.asyncio.client import ClientConnection

from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.receiver import WebhookReceiver
from harness.relay import RelayProcess, audit_actions, listeners_paused, relay_yaml
from harness.simulated import SimulatedPeer, handshake, open_socket
from harness.waiting import assert_eventually
from tests.prom import scrape

BACK = 24
BAD = "back-5"  # its record's write fails until the test lets it through


def _records(relay: RelayProcess) -> dict[str, tuple[str, str, str | None]]:
    """Each executor's recovery record: its id, status and error."""
    with psycopg.connect(relay.database_url) as conn:
        rows = conn.execute(
            "SELECT executor_id, id, status, error FROM recoveries WHERE executor_id LIKE 'back-%%'"
        ).fetchall()
    return {str(e): (str(i), str(s), None if err is None else str(err)) for e, i, s, err in rows}


async def _connect(relay: RelayProcess, ids: list[str]) -> list[ClientConnection]:
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    sockets = await asyncio.gather(*(open_socket(url) for _ in ids))
    await asyncio.gather(*(handshake(ws, executor_id) for ws, executor_id in zip(sockets, ids, strict=True)))
    return list(sockets)


def test_executors_back_from_the_dead_together_are_handled_in_batches_and_a_bad_record_fails_alone(
    start_relay: Any,
) -> None:
    # The simulated executors only answer pings: a wait for them longer than the tests' usual 1 s, lest a
    # test process starved of the CPU for a second be disconnected for silence (the deaths below are
    # sockets aborted, seen at once whatever the wait).
    relay: RelayProcess = start_relay(grace=0.3, repairIntervalSecs=3600, pingWaitSecs=5.0)  # only the start-up sweep
    ids = [f"back-{i}" for i in range(BACK)]

    async def die() -> None:
        for ws in await _connect(relay, ids):
            ws.transport.abort()

    asyncio.run(die())
    # Declared DEAD, each one's recovery waits for a peer; an operator cancels every run with DBOS's
    # tools, so that no run is live and each record goes on saying it waits.
    assert_eventually(
        lambda: len(_records(relay)) == BACK and {s for _, s, _ in _records(relay).values()} == {"waiting_for_peer"},
        20,
        what="every recovery waiting for a peer",
    )
    client = DBOSClient(system_database_url=relay.database_url)
    try:
        for rid, _, _ in _records(relay).values():
            client.cancel_workflow(rid)
    finally:
        client.destroy()
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute(f"""
            CREATE FUNCTION refuse_bad() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'refused for the test'; END $$;
            CREATE TRIGGER refuse_bad BEFORE UPDATE ON recoveries FOR EACH ROW
            WHEN (NEW.executor_id = '{BAD}' AND NEW.status = 'failed') EXECUTE FUNCTION refuse_bad()""")

    async def storm() -> None:
        sockets = await _connect(relay, ids)  # all at once: the same ids, back from their deaths
        try:

            def others_ended() -> bool:
                records = _records(relay)
                return all(records[e][1] == "failed" for e in ids if e != BAD)

            await asyncio.to_thread(assert_eventually, others_ended, 20, what="the others' records ended")
            records = _records(relay)
            assert all("reconnected" in (records[e][2] or "") for e in ids if e != BAD), records
            assert records[BAD][1] == "waiting_for_peer", records[BAD]
            await asyncio.to_thread(
                assert_eventually, lambda: "could not be ended" in relay.log(), 10, what="the failure logged"
            )
            # A batch is counted once its writes have committed, and the failure seen logged may be an
            # earlier batch's: the others' count awaited, not read the moment their records have ended.
            await asyncio.to_thread(
                assert_eventually,
                lambda: scrape(relay.http, "relay_back_from_dead_executors_total") == BACK - 1,
                10,
                what="the others counted",
            )
            # Handled together: a few batches (the reconnections arrive over a moment), not one per executor.
            batches = scrape(relay.http, "relay_back_from_dead_batches_total")
            assert batches is not None and batches <= BACK / 3, batches
            with psycopg.connect(relay.database_url, autocommit=True) as conn:
                conn.execute("DROP TRIGGER refuse_bad ON recoveries")
            # Tried again after its backoff, it ends too.
            await asyncio.to_thread(
                assert_eventually, lambda: _records(relay)[BAD][1] == "failed", 15, what="the bad one ended at last"
            )
            # Counted once its write has committed: awaited, not read the moment its record has ended.
            await asyncio.to_thread(
                assert_eventually,
                lambda: scrape(relay.http, "relay_back_from_dead_executors_total") == BACK,
                10,
                what="the bad one counted",
            )
        finally:
            await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)

    asyncio.run(storm())


STORM = 20


def test_a_whole_app_back_from_the_dead_wakes_each_blocked_recovery_about_once(start_relay: Any) -> None:
    """Every executor of the app died, so each one's recovery waits for a peer. They all come back
    at once: each reconnection is a peer for the others' recoveries, and woken once per connection
    the app's recoveries would get STORM x STORM wake-ups. Woken together, about one each, and
    each still ends (its executor is back)."""
    relay: RelayProcess = start_relay(grace=0.3, repairIntervalSecs=3600, pingWaitSecs=5.0)  # as above
    ids = [f"back-{i}" for i in range(STORM)]

    async def die() -> None:
        for ws in await _connect(relay, ids):
            ws.transport.abort()

    asyncio.run(die())
    assert_eventually(
        lambda: len(_records(relay)) == STORM and {s for _, s, _ in _records(relay).values()} == {"waiting_for_peer"},
        20,
        what="every recovery waiting for a peer",
    )
    before = scrape(relay.http, "relay_recovery_wakeups_total")
    assert before is not None

    async def storm() -> None:
        sockets = await _connect(relay, ids)
        try:

            def all_ended() -> bool:
                return not any(s == "waiting_for_peer" for _, s, _ in _records(relay).values())

            # Long before the first re-check of a blocked wait (30 s): woken, not re-checked.
            await asyncio.to_thread(assert_eventually, all_ended, 20, what="every recovery ended")
            assert {relay.state_of("acme", "ledger", e) for e in ids} == {"HEALTHY"}
        finally:
            await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)

    asyncio.run(storm())
    woken = scrape(relay.http, "relay_recovery_wakeups_total")
    assert woken is not None and woken - before <= 3 * STORM, (before, woken)


def test_an_executor_connecting_wakes_only_the_recoveries_waiting_for_a_peer_of_its_language(
    start_relay: Any,
) -> None:
    """An app whose executors mix SDKs: a TypeScript and a Go executor died beside a healthy Python
    one, and each one's recovery waits for a peer of its own language (``no_peer_of_its_language``).
    Every executor connecting to the app woke both, whatever its language: each wake-up of a
    recovery no connecting executor can serve cost it a few checkpoints and a read of the app's
    peers, for nothing. A Go executor connecting wakes the Go executor's recovery alone; one whose
    handshake gives no language fits any, and wakes the TypeScript executor's too."""
    relay: RelayProcess = start_relay(grace=0.3, repairIntervalSecs=3600, pingWaitSecs=5.0)  # as above
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"

    def waits_for_its_language(executor_id: str) -> bool:
        found = relay.executor("acme", "ledger", executor_id) or {}
        return found.get("blockedReason") == "no_peer_of_its_language"

    def wakeups() -> float:
        woken = scrape(relay.http, "relay_recovery_wakeups_total")
        assert woken is not None
        return woken

    with contextlib.ExitStack() as stack:
        stack.enter_context(SimulatedPeer(url, "lang-python", "answer"))
        for dead, language in (("lang-ts", "typescript"), ("lang-go", "go")):
            with SimulatedPeer(url, dead, "answer", language=language):
                assert_eventually(lambda d=dead: relay.state_of("acme", "ledger", d) == "HEALTHY", 10)
            # (It died as the block left: its socket cut.)
            assert_eventually(lambda d=dead: waits_for_its_language(d), 15, what=f"{dead} waiting for its language")
        # Each run gives its dead executor's language (the console's card names the peer it waits for).
        with relay.api() as api:
            runs = api.get("/apps/ledger/recoveries").json()
            assert {r["executorId"]: r["language"] for r in runs} == {"lang-ts": "typescript", "lang-go": "go"}, runs
            one = api.get(f"/apps/ledger/recoveries/{runs[0]['recoveryId']}").json()
            assert one["language"] == runs[0]["language"], one
        before = wakeups()
        stack.enter_context(SimulatedPeer(url, "lang-go-peer", "lie", language="go"))
        assert_eventually(lambda: "recovery.dispatched" in audit_actions(relay, "lang-go"), 10, what="go dispatched")
        # The Go recovery's wake-up is counted before its dispatch, as the TypeScript one's would be
        # (sent with it, for the same connection).
        assert wakeups() - before == 1, (before, wakeups())
        assert waits_for_its_language("lang-ts")
        stack.enter_context(SimulatedPeer(url, "lang-unsaid", "lie", language=None))
        assert_eventually(lambda: "recovery.dispatched" in audit_actions(relay, "lang-ts"), 10, what="ts dispatched")
        assert wakeups() - before == 2, (before, wakeups())


def test_an_instance_that_learns_of_blocked_recoveries_wakes_only_those_its_executors_may_take(
    start_relay: Any,
) -> None:
    """As above, but the wake-ups of an instance that hears of the app's blocked recoveries only
    after executors of the app connected to it (their connections found nothing to wake): it woke
    every blocked recovery of the app, whatever its language, so a Go executor there woke the
    TypeScript executor's recovery too, for nothing. It wakes those its executors may take, as
    their connections would have: the Go executor's alone. The instances' listening connections
    stop reading (their PostgreSQL backends stopped), so that instance 2 hears of the recoveries
    blocked on instance 1 only once the Go peer is there; a long lease and no repair sweep, so
    that it does not read them from the database meanwhile (as in test_instances)."""
    settings = {"repairIntervalSecs": 3600, "pingWaitSecs": 5.0, "instanceLeaseSecs": 60}  # pings: as above
    r1, r2 = (start_relay(relay_yaml(free_port(), grace=0.3, **settings), instance_id=f"relay-{n}") for n in (1, 2))
    url1, url2 = (f"ws://127.0.0.1:{r.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}" for r in (r1, r2))

    def waits_for_its_language(executor_id: str) -> bool:
        found = r1.executor("acme", "ledger", executor_id) or {}
        return found.get("blockedReason") == "no_peer_of_its_language"

    def wakeups() -> float:  # instance 2's
        woken = scrape(r2.http, "relay_recovery_wakeups_total")
        assert woken is not None
        return woken

    with contextlib.ExitStack() as stack:
        with listeners_paused(r1.database_url, 2):
            # A Python executor on instance 2; a TypeScript and a Go one die on instance 1.
            stack.enter_context(SimulatedPeer(url2, "learn-python", "answer"))
            for dead, language in (("learn-ts", "typescript"), ("learn-go", "go")):
                with SimulatedPeer(url1, dead, "answer", language=language):
                    assert_eventually(lambda d=dead: r1.state_of("acme", "ledger", d) == "HEALTHY", 10)
                assert_eventually(lambda d=dead: waits_for_its_language(d), 15, what=f"{dead} waiting for its language")
            stack.enter_context(SimulatedPeer(url2, "learn-go-peer", "lie", language="go"))
            assert_eventually(
                lambda: (r1.executor("acme", "ledger", "learn-go-peer") or {}).get("relayInstance") == "relay-2", 10
            )
            # Instance 2 knows of no blocked recovery yet: its executors' connections woke none.
            assert wakeups() == 0
        assert_eventually(lambda: "recovery.dispatched" in audit_actions(r1, "learn-go"), 10, what="go dispatched")
        # Counted before the Go recovery's dispatch, as the TypeScript one's would be (sent with it).
        assert wakeups() == 1
        assert waits_for_its_language("learn-ts")


def test_a_recovery_ended_by_its_executors_return_says_so_and_one_whose_record_went_says_that(
    start_relay: Any,
) -> None:
    """A recovery whose executor is no longer dead ends ``failed`` (the contract's statuses), and its
    error was "the executor reconnected or its record is gone" whichever it was: on-call could not
    tell an executor back (nothing to do) from a record deleted under the run. Relay reads which as
    the run ends: ``back-returns`` reconnects (its entry has ``executorBack: true``, which the console
    shows); ``back-gone``'s record is deleted, as another run of its death that finished deletes
    it, and its run, woken by the first one's return (a peer for it), says the record is gone.
    Neither final entry fires the app's RecoveryFailed rule (one attempt is enough for it): the
    deaths' ExecutorDead alerts are resolved by those entries, and nothing comes for RecoveryFailed."""
    with WebhookReceiver() as receiver:
        config = relay_yaml(free_port(), grace=0.3, repairIntervalSecs=3600, pingWaitSecs=5.0)  # as above
        config["alerts"] = {"allowedDestinations": ["127.0.0.1"], "pollIntervalSecs": 0.2, "checkIntervalSecs": 0.5}
        config["orgs"][0]["apps"][0]["alerts"] = [
            {"kind": "ExecutorDead", "webhook": receiver.url("/dead"), "minIntervalSecs": 0},
            {"kind": "RecoveryFailed", "attempts": 1, "webhook": receiver.url("/failed"), "minIntervalSecs": 0},
        ]
        relay: RelayProcess = start_relay(config)
        ids = ["back-returns", "back-gone"]

        async def die() -> None:
            for ws in await _connect(relay, ids):
                ws.transport.abort()

        asyncio.run(die())
        assert_eventually(
            lambda: {s for _, s, _ in _records(relay).values()} == {"waiting_for_peer"} and len(_records(relay)) == 2,
            20,
            what="both recoveries waiting for a peer",
        )
        with relay.api() as api:
            runs = api.get("/apps/ledger/recoveries").json()
        assert {r["executorId"]: r["language"] for r in runs} == {"back-returns": "python", "back-gone": "python"}
        with psycopg.connect(relay.database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM executors WHERE executor_id = 'back-gone'")

        async def back() -> None:
            (ws,) = await _connect(relay, ["back-returns"])
            try:
                ended = lambda: {s for _, s, _ in _records(relay).values()} == {"failed"}  # noqa: E731
                await asyncio.to_thread(assert_eventually, ended, 20, what="both recoveries ended")
            finally:
                await ws.close()

        asyncio.run(back())
        records = _records(relay)
        assert records["back-returns"][2] == (
            "the executor reconnected: it is back, so there is nothing to recover for it"
        )
        assert records["back-gone"][2] == (
            "the executor's record is gone: another recovery run of this death finished and deleted it"
        )
        with relay.api() as api:
            entries = api.get("/audit", params={"action": "recovery.failed"}).json()
            runs = api.get("/apps/ledger/recoveries").json()
        finals = {e["executorId"]: e["detail"] for e in entries if e["detail"].get("final")}
        # The record of each death is gone (replaced as its executor reconnected, or deleted): each run
        # kept its language as it opened.
        assert {r["executorId"]: r["language"] for r in runs} == {"back-returns": "python", "back-gone": "python"}
        assert finals["back-returns"].get("executorBack") is True, finals
        assert "executorBack" not in finals["back-gone"], finals

        def resolved() -> set[str]:
            return {d.payload["executorId"] for d in receiver.deliveries(accepted=True)
                    if d.path == "/dead" and d.payload.get("status") == "resolved"}  # fmt: skip

        # The final entries, read by the alerts' poll: each death's ExecutorDead alert resolved by them.
        assert_eventually(lambda: resolved() == set(ids), 20, what="both deaths' ExecutorDead resolved")
        assert [d.payload for d in receiver.deliveries() if d.path == "/failed"] == []
