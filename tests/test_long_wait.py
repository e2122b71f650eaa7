"""A blocked recovery that has waited long: what a restart of Relay replays stays bounded.

Each wait of a blocked recovery records three DBOS operations, and a restart replays them all
(bench/blocked_replay.py). The re-check backs off to 10 minutes for about a day, then to a day:
a run that has waited many re-checks resumes into a wait that records nothing for hours, and is
still woken at once by a peer that connects and by an operator.
"""

from __future__ import annotations

import base64
import json
import pickle
import time
from collections.abc import Callable
from typing import Any

import psycopg

from harness.keys import CONDUCTOR_KEYS
from harness.relay import RelayProcess
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from harness.waits import OPS_PER_WAIT, recorded_ops, seed_waits
from relay.core.failover import OPERATOR_NUDGE
from workflows.recovery import BLOCKED_RECHECKS_DENSE, blocked_recheck_secs

StartRelay = Callable[..., RelayProcess]
DEAD = "retired-v1"
RID = f"recovery:acme:ledger:{DEAD}:1000000"


def _op(relay_db: str, function_id: int) -> tuple[str, Any] | None:
    """The name and output of the recovery's operation ``function_id``, if recorded."""
    with psycopg.connect(relay_db) as conn:
        row = conn.execute(
            "SELECT function_name, output, serialization FROM dbos.operation_outputs"
            " WHERE workflow_uuid = %s AND function_id = %s",
            (RID, function_id),
        ).fetchone()
    if row is None:
        return None
    name, output, serialization = row
    if output is None:
        return str(name), None
    if name == "DBOS.sleep":
        return str(name), float(json.loads(output))
    assert "pickle" in str(serialization).lower() or serialization is None, serialization
    return str(name), pickle.loads(base64.b64decode(output))


def _last_op(relay_db: str) -> tuple[int, str] | None:
    """The recovery's last recorded operation: its id and name."""
    with psycopg.connect(relay_db) as conn:
        row = conn.execute(
            "SELECT function_id, function_name FROM dbos.operation_outputs WHERE workflow_uuid = %s"
            " ORDER BY function_id DESC LIMIT 1",
            (RID,),
        ).fetchone()
    return None if row is None else (int(row[0]), str(row[1]))


def _next_wait(relay_db: str, after: int) -> int:
    """The ``DBOS.recv`` of the recovery's wait under way once one began after operation ``after``
    (the recv itself is recorded when the wait ends; its deadline, the next operation, at once)."""
    waiting: list[int] = []

    def waits_again() -> bool:
        last = _last_op(relay_db)
        if last is not None and last[1] == "DBOS.sleep" and last[0] > after:
            waiting.append(last[0] - 1)
        return bool(waiting)

    assert_eventually(waits_again, 30, what=f"a wait after operation {after}")
    return waiting[-1]


def _woken_by(relay_db: str, recv_id: int) -> dict[str, Any]:
    """The message that ended the wait whose ``DBOS.recv`` is operation ``recv_id``."""
    recorded: list[tuple[str, Any]] = []

    def ended() -> bool:
        op = _op(relay_db, recv_id)
        if op is not None:
            recorded.append(op)
        return op is not None

    assert_eventually(ended, 30, what=f"the wait of operation {recv_id} to end")
    name, message = recorded[-1]
    assert name == "DBOS.recv", recorded[-1]
    assert isinstance(message, dict), f"the wait timed out ({message!r}) instead of being woken"
    return message


def test_a_month_of_rechecks_records_a_few_hundred_operations_not_thirteen_thousand() -> None:
    def waits_within(secs: float) -> int:
        waited, n = 0.0, 0
        while waited < secs:
            waited += blocked_recheck_secs(n)
            n += 1
        return n

    day = 86_400.0
    assert waits_within(day) == BLOCKED_RECHECKS_DENSE  # the first day keeps its 10-minute re-checks
    assert OPS_PER_WAIT * waits_within(30 * day) <= 600
    assert OPS_PER_WAIT * waits_within(365 * day) <= 1_600
    assert blocked_recheck_secs(BLOCKED_RECHECKS_DENSE - 1) == 600.0
    assert blocked_recheck_secs(10_000) == day


def test_a_recovery_that_waited_long_resumes_into_a_sparse_recheck_and_is_still_woken(
    start_relay: StartRelay, relay_db: str
) -> None:
    relay = start_relay(grace=0.5)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, DEAD, "answer"):
        assert_eventually(lambda: relay.state_of("acme", "ledger", DEAD) == "HEALTHY", 10)
    # DEAD, and its recovery waits for a peer (there is none): its first wait under way.
    assert_eventually(lambda: _op(relay_db, 4) is not None, 30, what="the recovery's first wait")
    assert (relay.executor("acme", "ledger", DEAD) or {}).get("blockedReason") == "no_healthy_peer"
    relay.stop()

    # It has waited a day and a few days' sparser re-checks with nothing changing.
    waits = BLOCKED_RECHECKS_DENSE + 8
    ops = seed_waits(relay_db, RID, waits)
    relay.start()
    live_recv, live_deadline = 3 + OPS_PER_WAIT * waits, 4 + OPS_PER_WAIT * waits
    assert_eventually(lambda: _op(relay_db, live_deadline) is not None, 60, what="the recovery to resume its wait")
    op = _op(relay_db, live_deadline)
    assert op is not None and op[0] == "DBOS.sleep", op
    # The wait it resumed into re-checks in a day, not in 10 minutes: nothing more is recorded meanwhile.
    assert op[1] - time.time() > 0.9 * 86_400.0, f"the next re-check is {op[1] - time.time():.0f}s away"
    assert recorded_ops(relay_db, RID) == ops + 1

    # An operator's nudge ends that day-long wait at once; the same block found, the next wait is
    # a day-long one again (the block's re-checks go on counting).
    with relay.api() as api:
        resp = api.post(f"/apps/ledger/executors/{DEAD}/recover")
        assert resp.status_code == 202, resp.text
        assert resp.json()["recoveryId"] == RID
    message = _woken_by(relay_db, live_recv)
    assert message.get("reason") == OPERATOR_NUDGE, message
    next_recv = _next_wait(relay_db, live_deadline)
    deadline = _op(relay_db, next_recv + 1)
    assert deadline is not None and deadline[1] - time.time() > 0.9 * 86_400.0, deadline

    with SimulatedPeer(url, "v2-0", "answer", version="v2"):  # a peer joins: that wait ends at once too
        message = _woken_by(relay_db, next_recv)
        assert message.get("reason") == "peer_connected", message
        assert_eventually(
            lambda: (
                (r := relay.executor("acme", "ledger", DEAD)) and r["blockedReason"] == "version_upgrade_not_allowed"
            ),
            30,
        )
        _next_wait(relay_db, next_recv + 1)  # blocked anew (gather, mark_blocked), it waits again
    assert relay.executor("acme", "ledger", DEAD) is not None, "the recovery was meant to still be waiting"


def _seed_wakeups(relay_db: str, wakeups: int) -> int:
    """Replace what the blocked run recorded after its first steps by ``wakeups`` turns of its wait
    loop, each ended early by a peer connecting (``peer_connected``), one a second over the last
    minutes, each finding the same block: what a run blocked for a few minutes records while the
    app's executors reconnect (a rolling restart, a crash-looping pod). Relay must be stopped."""
    ops = seed_waits(relay_db, RID, wakeups)  # the shape of the turns; their messages rewritten below
    woken = base64.b64encode(pickle.dumps({"reason": "peer_connected", "peer": "v1-restarting"})).decode()
    with psycopg.connect(relay_db) as conn:
        conn.execute(
            "UPDATE dbos.operation_outputs SET output = %s WHERE workflow_uuid = %s AND function_name = 'DBOS.recv'",
            (woken, RID),
        )
    return ops


def test_wakeups_of_a_block_minutes_old_do_not_make_its_recheck_sparse(start_relay: StartRelay, relay_db: str) -> None:
    """Wrong: the re-check counts every wait of a block, a wait ended early by a wake-up too, and
    goes sparse after BLOCKED_RECHECKS_DENSE of them, however young the block. Each executor of the
    app that (re)connects wakes every blocked recovery of the app, so an app of a few hundred
    executors restarting in turn, or one crash-looping executor, pushes a block a few minutes old
    to a re-check a day away. CHANGELOG and README promise the 10-minute re-check "for the first
    day"; what only the re-check sees (a lost wake-up, the PENDING workflows ended by other means)
    is then seen up to a day late minutes into the block."""
    relay = start_relay(grace=0.5)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, DEAD, "answer"):
        assert_eventually(lambda: relay.state_of("acme", "ledger", DEAD) == "HEALTHY", 10)
    assert_eventually(lambda: _op(relay_db, 4) is not None, 30, what="the recovery's first wait")
    relay.stop()

    # Blocked for about three minutes, woken by a reconnecting executor once a second meanwhile.
    wakeups = BLOCKED_RECHECKS_DENSE + 8
    _seed_wakeups(relay_db, wakeups)
    with psycopg.connect(relay_db) as conn:
        row = conn.execute(
            "SELECT min(started_at_epoch_ms) FROM dbos.operation_outputs WHERE workflow_uuid = %s", (RID,)
        ).fetchone()
    assert row is not None
    blocked_since = int(row[0]) / 1000
    relay.start()
    live_deadline = 4 + OPS_PER_WAIT * wakeups
    assert_eventually(lambda: _op(relay_db, live_deadline) is not None, 60, what="the recovery to resume its wait")
    op = _op(relay_db, live_deadline)
    assert op is not None and op[0] == "DBOS.sleep", op
    age = time.time() - blocked_since
    assert age < 3_600, f"the block is {age:.0f}s old: not the case this test is about"
    assert op[1] - time.time() <= 600 + 60, (
        f"a block {age:.0f}s old re-checks in {op[1] - time.time():.0f}s, not within 10 minutes"
    )
