"""A grace period counts from the disconnection, not from when its workflow could be started.

When a group of executors drops at once, their grace-period workflows are started one after
another; before, the time a disconnection waited in that queue was added to its grace period
(the last of 1,000 was declared DEAD about 10 s late). Here the start is held up for real:
the test locks Relay's DBOS ``workflow_status`` table against inserts for two seconds after
the socket closes. The executor must still be declared DEAD one grace period after it went.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime

import psycopg

from harness.keys import CONDUCTOR_KEYS
from harness.relay import RelayProcess
from harness.simulated import handshake, open_socket

StartRelay = Callable[..., RelayProcess]
GRACE_SECS = 3.0
HELD_SECS = 2.0


def at(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


async def wait_for(check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def scenario(relay: RelayProcess) -> tuple[float, float, float]:
    """Returns (just before the socket closed, just after, when the executor was declared DEAD), this
    machine's clock."""
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    ws = await open_socket(url)
    await handshake(ws, "late-starter")
    await wait_for(lambda: relay.state_of("acme", "ledger", "late-starter") == "HEALTHY", 10)
    with psycopg.connect(relay.database_url) as lock:
        # Inserts into workflow_status wait behind this lock: no grace period can start.
        lock.execute("LOCK TABLE dbos.workflow_status IN SHARE ROW EXCLUSIVE MODE")
        closed = time.time()  # before the close: Relay's disconnection (the deadline's start) is after it
        ws.transport.abort()
        after_close = time.time()  # and Relay cannot have seen it before it happened
        await wait_for(lambda: relay.state_of("acme", "ledger", "late-starter") == "DISCONNECTED", 5)
        await asyncio.sleep(max(0.0, after_close + HELD_SECS - time.time()))
        started = lock.execute("SELECT count(*) FROM dbos.workflow_status WHERE name = 'relay.grace_period'").fetchone()
        assert started == (0,), "the grace period started while its table was locked"
    await wait_for(lambda: relay.state_of("acme", "ledger", "late-starter") == "DEAD", 30)
    with relay.api() as api:
        entries = api.get("/audit", params={"executorId": "late-starter"}).json()
    (dead,) = [e for e in entries if e["action"] == "executor.dead"]
    return closed, after_close, at(dead["at"])


def test_a_grace_period_started_late_still_ends_one_grace_period_after_the_disconnection(
    start_relay: StartRelay,
) -> None:
    relay = start_relay(grace=GRACE_SECS)
    closed, after_close, dead = asyncio.run(scenario(relay))
    # Before, the grace period ran from the workflow's start, which the lock held until HELD_SECS after
    # ``after_close`` at least: DEAD at HELD_SECS + GRACE_SECS or later. Anything sooner is the fix; the
    # rest of that margin is for a loaded machine (the workflow starts after the lock goes, then sleeps).
    assert GRACE_SECS - 0.2 <= dead - closed and dead - after_close < GRACE_SECS + HELD_SECS, (
        f"declared DEAD {dead - closed:.2f} s after the close"
    )
