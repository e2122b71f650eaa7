"""A graceful stop of an instance that holds many executors.

uvicorn closes every socket when the server stops. Each connection used to record its own
disconnection (one combined write per socket) inside uvicorn's five-second graceful window;
with thousands of executors that outlasted the window, and uvicorn cancelled the rest with one
logged traceback per socket. Now a socket closed by the shutdown records nothing itself, and
the instance marks every executor it held DISCONNECTED in one statement and starts their grace
periods (``Runtime.stop``). Real Relay, real PostgreSQL, simulated executors on real sockets.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from websockets.asyncio.client import ClientConnection

from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, open_socket
from relay.config import RelayConfig
from relay.core.ids import ExecutorKey
from relay.runtime import run_for_at_most
from relay.store.apps import AppStore
from relay.store.db import Database
from relay.store.executors import ExecutorStore, Handshake
from relay.store.lease import Lease
from relay_protocol import ExecutorInfoReply
from workflows.gracestart import grace_queue

StartRelay = Callable[..., RelayProcess]
EXECUTORS = 200


async def connect_and_stop(relay: RelayProcess) -> float:
    """Connect the executors, wait until Relay holds them all, stop Relay; returns the stop's seconds."""
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    gate = asyncio.Semaphore(50)

    async def one(i: int) -> ClientConnection:
        async with gate:
            ws = await open_socket(url)
            await handshake(ws, f"held-{i}")
            return ws

    sockets = await asyncio.gather(*(one(i) for i in range(EXECUTORS)))
    await until_healthy(relay, EXECUTORS)
    started = time.monotonic()
    await asyncio.to_thread(relay.stop)
    stopped = time.monotonic() - started
    await asyncio.gather(*(ws.wait_closed() for ws in sockets))
    return stopped


async def until_healthy(relay: RelayProcess, n: int) -> None:
    deadline = time.monotonic() + 30
    while healthy(relay) < n:
        assert time.monotonic() < deadline, f"only {healthy(relay)} of {n} HEALTHY"
        await asyncio.sleep(0.1)


def healthy(relay: RelayProcess) -> int:
    with psycopg.connect(relay.database_url) as conn:
        row = conn.execute("SELECT count(*) FROM executors WHERE state = 'HEALTHY'").fetchone()
    assert row is not None
    return int(row[0])


def test_a_stop_records_its_executors_disconnection_at_once_and_starts_their_grace_periods(
    start_relay: StartRelay,
) -> None:
    relay = start_relay(grace=60)
    stopped = asyncio.run(connect_and_stop(relay))
    assert relay.proc is not None and relay.proc.returncode == 0, relay.log()[-3000:]
    log = relay.log()
    after = log[log.index("Shutting down") :]
    assert "Exception in ASGI application" not in after and "graceful shutdown exceeded" not in after, after[-3000:]
    # No socket recorded its own disconnection: the instance recorded them all.
    assert " is DISCONNECTED" not in after, after[-3000:]
    assert_all_disconnected_with_grace_periods(relay)
    assert stopped < 10, f"the stop took {stopped:.1f} s"


def assert_all_disconnected_with_grace_periods(relay: RelayProcess) -> None:
    with psycopg.connect(relay.database_url) as conn:
        states = dict(conn.execute("SELECT state, count(*) FROM executors GROUP BY state").fetchall())
        # Running on this instance, or waiting on its queue (started together, not run yet).
        graces = conn.execute(
            """SELECT count(DISTINCT workflow_uuid) FROM dbos.workflow_status WHERE name = 'relay.grace_period'
                 AND (status = 'PENDING' AND executor_id = %s OR status = 'ENQUEUED' AND queue_name = %s)""",
            (relay.instance_id, grace_queue(relay.instance_id)),
        ).fetchone()
    assert states == {"DISCONNECTED": EXECUTORS}, states
    assert graces == (EXECUTORS,), "each disconnection has its grace period, left for the next start"


def test_a_stop_that_cancels_disconnections_still_being_written_logs_no_traceback_and_loses_none(
    start_relay: StartRelay,
) -> None:
    """Sockets that closed just before the stop, their disconnections held up by the database
    (here: a transaction holding their rows), outlast uvicorn's graceful window and are cancelled.
    Each used to log an "Exception in ASGI application" traceback; now the handler ends quietly
    and the stop and the repair sweep do what it left undone."""
    relay = start_relay(grace=60)
    closed = 10
    asyncio.run(stop_while_disconnections_wait(relay, closed))
    assert relay.proc is not None and relay.proc.returncode == 0, relay.log()[-3000:]
    log = relay.log()
    after = log[log.index("Shutting down") :]
    assert "graceful shutdown exceeded" in after, "the handlers were not cancelled: the test proves nothing"
    assert "Exception in ASGI application" not in after and "Traceback" not in after, after[-3000:]
    assert_all_disconnected_with_grace_periods(relay)


async def stop_while_disconnections_wait(relay: RelayProcess, closed: int) -> None:
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    sockets = []
    for i in range(EXECUTORS):
        ws = await open_socket(url)
        await handshake(ws, f"held-{i}")
        sockets.append(ws)
    await until_healthy(relay, EXECUTORS)
    async with await psycopg.AsyncConnection.connect(relay.database_url) as blocker:
        await blocker.execute("SELECT 1 FROM executors FOR UPDATE")  # held until the rollback below
        await asyncio.gather(*(ws.close() for ws in sockets[:closed]))
        async with await psycopg.AsyncConnection.connect(relay.database_url, autocommit=True) as watch:
            deadline = time.monotonic() + 60
            while True:  # until Relay's write of those disconnections waits on the rows
                cur = await watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query ILIKE '%%UPDATE executors%%'"
                )
                row = await cur.fetchone()
                if row is not None and row[0] > 0:
                    break
                assert time.monotonic() < deadline, "Relay's write of the disconnections never waited"
                await asyncio.sleep(0.05)
        stopping = asyncio.create_task(asyncio.to_thread(relay.stop))
        while "graceful shutdown exceeded" not in relay.log():
            assert not stopping.done(), relay.log()[-3000:]
            await asyncio.sleep(0.1)
        await blocker.rollback()
    await stopping
    await asyncio.gather(*(ws.wait_closed() for ws in sockets))


def test_a_stop_held_up_says_at_which_step_while_it_waits(start_relay: StartRelay) -> None:
    """A stop whose writes wait (here: on the executors' rows, held by a transaction) logs the step
    it is at every second, so that a stop killed by its process manager still says where it was."""
    relay = start_relay(grace=60)
    asyncio.run(stop_while_the_rows_are_held(relay))
    assert relay.proc is not None and relay.proc.returncode == 0, relay.log()[-3000:]
    after = relay.log()[relay.log().index("Shutting down") :]
    assert "Traceback" not in after, after[-3000:]
    with psycopg.connect(relay.database_url) as conn:
        states = dict(conn.execute("SELECT state, count(*) FROM executors GROUP BY state").fetchall())
    assert states == {"DISCONNECTED": 1}, states


async def stop_while_the_rows_are_held(relay: RelayProcess) -> None:
    ws = await open_socket(f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}")
    await handshake(ws, "held-0")
    await until_healthy(relay, 1)
    waiting = "instance relay-1: stopping: recording its executors' disconnection for "
    async with await psycopg.AsyncConnection.connect(relay.database_url) as blocker:
        await blocker.execute("SELECT 1 FROM executors FOR UPDATE")  # held until the rollback below
        stopping = asyncio.create_task(asyncio.to_thread(relay.stop))
        while waiting not in relay.log():
            assert not stopping.done(), relay.log()[-3000:]
            await asyncio.sleep(0.1)
        await blocker.rollback()
    await stopping
    await ws.wait_closed()


async def _instance_lost_through_a_deadlock(url: str) -> None:
    db = Database(url)
    await db.open()
    try:
        await db.migrate()
        await AppStore(db).sync_config(RelayConfig.model_validate(relay_yaml(free_port())))
        lease = Lease(db, "deadlock-test", 30)
        await lease.acquire()
        executors = ExecutorStore(db)
        for executor_id in ("ex-1", "ex-2"):  # in this order in the table: the statement meets ex-1 first
            info = ExecutorInfoReply(request_id="r", executor_id=executor_id, application_version="v1",
                                     hostname="host", language="python")  # fmt: skip
            await executors.connected(Handshake(ExecutorKey("acme", "ledger", executor_id), info, "deadlock-test", "k"))
        async with await psycopg.AsyncConnection.connect(url) as other:
            # The other transaction (at the stop that failed in CI: the instance's own combined writes of
            # disconnections) holds ex-2, and waits for ex-1 once the stop's statement holds it and waits
            # for ex-2. It waits 10 s before looking for a deadlock, the stop's 1 s (PostgreSQL's
            # default): the stop's transaction is the one PostgreSQL fails.
            await other.execute("SET deadlock_timeout = '10s'")
            await other.execute("UPDATE executors SET hostname = 'other' WHERE executor_id = 'ex-2'")
            stop = asyncio.create_task(executors.instance_lost("deadlock-test"))

            async def stop_waits() -> bool:
                async with db.connection() as conn:
                    cur = await conn.execute(
                        """SELECT count(*) AS n FROM pg_stat_activity
                            WHERE wait_event_type = 'Lock' AND query LIKE 'WITH held AS%%'"""
                    )
                    row = await cur.fetchone()
                return row is not None and row["n"] == 1

            for _ in range(100):
                if await stop_waits():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the stop's statement never waited for ex-2")
            await other.execute("UPDATE executors SET hostname = 'other' WHERE executor_id = 'ex-1'")
            assert not stop.done()  # it failed on the deadlock and waits again, now for this transaction
            await other.commit()
        assert await asyncio.wait_for(stop, 10) == 2
        async with db.connection() as conn:
            cur = await conn.execute("SELECT executor_id, state, hostname FROM executors ORDER BY executor_id")
            rows = [tuple(r.values()) for r in await cur.fetchall()]
        assert rows == [("ex-1", "DISCONNECTED", "other"), ("ex-2", "DISCONNECTED", "other")], rows
        await lease.stop()
    finally:
        await db.close()


def test_a_stop_that_meets_a_deadlock_on_its_executors_rows_records_them_all_the_same(postgres: Postgres) -> None:
    """Recording every executor of a stopping instance lost locks their rows in key order; other
    writes still being written several to a transaction lock them in theirs. PostgreSQL breaks such a deadlock by
    failing one transaction: the stop's runs again (it failed one fresh-clone CI run with a traceback
    and an "Application shutdown failed")."""
    asyncio.run(_instance_lost_through_a_deadlock(postgres.create_database("deadlock")))


def test_a_call_that_outlasts_its_bound_is_left_running_in_a_daemon_thread() -> None:
    """How a stop waits for DBOS's own stop: at most a bound, and what is still running then does
    not hold up the process's exit (a daemon thread). Returns and errors come through as they are."""

    async def scenario() -> None:
        release = threading.Event()
        started = time.monotonic()
        assert not await run_for_at_most(release.wait, 0.3)
        assert 0.3 <= time.monotonic() - started < 2.0
        (stuck,) = [t for t in threading.enumerate() if t.name == "relay-wait"]
        assert stuck.daemon and stuck.is_alive()
        release.set()
        stuck.join(2)
        assert not stuck.is_alive()
        assert await run_for_at_most(lambda: None, 2.0)

        def fails() -> None:
            raise ValueError("from the thread")

        with pytest.raises(ValueError, match="from the thread"):
            await run_for_at_most(fails, 2.0)

    asyncio.run(scenario())
