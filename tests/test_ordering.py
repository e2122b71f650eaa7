"""Recoveries take turns, the earliest deaths first (workflows.ordering): the turns alone, on
event loops of their own; then a real Relay's group failure."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from websockets.asyncio.client import ClientConnection

from harness.keys import CONDUCTOR_KEYS
from harness.relay import RelayProcess
from harness.simulated import SimulatedPeer, handshake, open_socket
from tests.prom import scrape
from workflows.ordering import Turns, current_rank, rank_by


def test_a_task_started_by_a_ranked_one_waits_with_its_rank_and_unranked_ones_go_first() -> None:
    """What a grace period does: it ranks itself, then starts the recovery, a task of its own."""
    turns = Turns(1)
    got: list[str] = []

    async def scenario() -> None:
        await turns.take()

        async def death(name: str, due_at: float) -> None:
            rank_by(due_at)
            await asyncio.create_task(recovery(name))

        async def recovery(name: str) -> None:
            await turns.take()
            got.append(f"{name} ({current_rank():g})")
            turns.give_back()

        tasks = [asyncio.create_task(death("second", 20.0)), asyncio.create_task(death("first", 10.0))]
        tasks.append(asyncio.create_task(recovery("an operator's")))
        await _until(lambda: _true(turns.waiting == 3), 5, "three waiting")
        turns.give_back()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert got == ["an operator's (0)", "first (10)", "second (20)"]


def test_turns_go_to_the_waiting_by_rank_across_event_loops() -> None:
    """Recoveries run on DBOS's loop and on Relay's: a turn given back on one wakes the best-ranked
    waiter on either."""
    turns = Turns(1)
    got: list[str] = []
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()

    async def waiter(name: str, rank: float) -> None:
        rank_by(rank)
        await turns.take()
        got.append(name)
        turns.give_back()

    async def scenario() -> None:
        await turns.take()  # held: everyone below waits
        late = asyncio.create_task(waiter("late", 20.0))
        elsewhere = asyncio.run_coroutine_threadsafe(waiter("early, on another loop", 10.0), other)
        await _until(lambda: _true(turns.waiting == 2), 5, "two waiting")
        turns.give_back()
        await late
        await asyncio.wrap_future(elsewhere)

    asyncio.run(scenario())
    other.call_soon_threadsafe(other.stop)
    thread.join(5)
    other.close()
    assert got == ["early, on another loop", "late"]
    assert (turns.held, turns.waiting) == (0, 0)


def test_a_turn_is_not_lost_to_a_waiter_cancelled_before_or_after_it_was_granted() -> None:
    turns = Turns(1)

    async def scenario() -> None:
        await turns.take()
        gone = asyncio.create_task(turns.take())
        await _until(lambda: _true(turns.waiting == 1), 5, "one waiting")
        gone.cancel()  # before its turn came
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert turns.waiting == 0
        granted = asyncio.create_task(turns.take())
        await _until(lambda: _true(turns.waiting == 1), 5, "one waiting")
        turns.give_back()  # its turn is on its way...
        granted.cancel()  # ...and it is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await granted
        await asyncio.wait_for(turns.take(), 5)  # the turn came back
        assert turns.held == 1
        turns.give_back()

    asyncio.run(scenario())
    assert (turns.held, turns.waiting) == (0, 0)


# -- in a real Relay: a group failure recovers its earliest deaths first ------------------------

GROUP = 60
GRACE = 10.0
LAST, STRAGGLERS = 30, 4
REPLIES = {"recovery": {"success": True}, "exist_pending_workflows": {"exist": False}}


async def _connect(url: str, prefix: str) -> list[ClientConnection]:
    sockets = [await open_socket(url) for _ in range(GROUP)]
    for i, ws in enumerate(sockets):
        await handshake(ws, f"{prefix}-{i}")
    return sockets


async def _rows(database_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        return await (await conn.execute(query, params or None)).fetchall()


async def _true(value: bool) -> bool:
    return value


async def _until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(0.2)


async def _two_groups(relay: RelayProcess) -> list[str]:
    """Group "early" dies a second before group "late"; DBOS cannot write a checkpoint from before
    either grace period runs out until after both have, so that both groups' work waits for DBOS's
    threads together. Returns the executors deleted (recovered), in the order of the audit log."""
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    db = relay.database_url
    with (
        SimulatedPeer(url, "peer-1", "answer", replies=REPLIES),
        SimulatedPeer(url, "peer-2", "answer", replies=REPLIES),
    ):
        early, late = await _connect(url, "early"), await _connect(url, "late")

        async def healthy() -> bool:
            rows = await _rows(db, "SELECT count(*) FROM executors WHERE state = 'HEALTHY'")
            return int(rows[0][0]) == 2 * GROUP + 2

        await _until(healthy, 20, "every executor HEALTHY")
        for ws in early:
            ws.transport.abort()
        early_due = time.monotonic() + GRACE
        await asyncio.sleep(1.0)
        for ws in late:
            ws.transport.abort()
        late_due = time.monotonic() + GRACE

        async def waiting() -> bool:  # every grace period recorded its timer and waits
            timers = "SELECT count(*) FROM dbos.operation_outputs WHERE function_name = 'DBOS.sleep'"
            rows = await _rows(db, timers + " AND workflow_uuid LIKE 'grace:%'")
            return int(rows[0][0]) == 2 * GROUP

        await _until(waiting, GRACE - 2, "every grace period's timer")
        assert time.monotonic() < early_due - 0.5, "the grace periods began too late for the test"
        async with await psycopg.AsyncConnection.connect(db) as lock, lock.transaction():
            await lock.execute("LOCK TABLE dbos.operation_outputs IN EXCLUSIVE MODE")
            await asyncio.sleep(late_due + 1.5 - time.monotonic())

        async def deleted() -> bool:
            rows = await _rows(db, "SELECT count(*) FROM audit_log WHERE action = 'executor.deleted'")
            return int(rows[0][0]) == 2 * GROUP

        await _until(deleted, 120, "every dead executor recovered and deleted")
    rows = await _rows(db, "SELECT executor_id FROM audit_log WHERE action = 'executor.deleted' ORDER BY id")
    return [str(e) for (e,) in rows]


def test_a_group_failure_recovers_its_earliest_deaths_first(start_relay: Any) -> None:
    """Without turns, every recovery of a group worked at once, and the group was recovered in
    no particular order, its last deaths mixed with its first. With them, those waiting for a turn
    get it earliest death first."""
    relay: RelayProcess = start_relay(grace=GRACE)
    deleted = [e.split("-")[0] for e in asyncio.run(_two_groups(relay))]
    assert deleted.count("early") == deleted.count("late") == GROUP, deleted
    # The first recoveries to start take the free turns, whichever group they are of; the rest
    # wait, and the early group's get their turns first, so the last deletions are the late
    # group's. Measured: none of the early group among the last 30 in four runs with the turns (two
    # beside a CPU hog), 8 to 15 without; a slow one of the first turns may straggle (CI saw one).
    assert deleted[-LAST:].count("early") <= STRAGGLERS, " ".join(g[0] for g in deleted)
    # Every turn was given back.
    assert scrape(relay.http, "relay_recovery_turns_held") == 0
    assert scrape(relay.http, "relay_recovery_turns_waiting") == 0
