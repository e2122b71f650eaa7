"""A rolling upgrade: an instance of Relay 0.2.0 and one of this code on one database.

DBOS 3.2's queue manager starts a worker for every queue of the application it finds in the
database unless the process names its own (``DBOS.listen_queues``): this code listens to its
instance's grace queue only, 0.2.0 to all of them. So 0.2.0 may take a grace period this code
queued, whose inputs carry a sixth argument (``lost_at``) that 0.2.0's ``grace_period`` does not
take: it ends in ERROR at once, and the owner's repair sweep must make up for it.
"""

from __future__ import annotations

import signal
import tarfile
import time
from pathlib import Path

import psycopg
import pytest

from harness.executors import Evidence
from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from tests.test_upgrade import RELEASE, StartExecutor, all_outcomes, schema_versions, ts

GRACE = 4.0  # queued (START_AT_ONCE_BELOW_SECS is 2), not started at once
REPAIR = 2.0  # repairIntervalSecs of this code's instance
# The repair sweep's own work (a few queries and a transaction) on a loaded two-core machine.
SWEEP_SLACK = 3.0


def grace_row(conn: psycopg.Connection[tuple[object, ...]], executor_id: str) -> tuple[str, str, str] | None:
    """The grace period of ``executor_id``'s disconnection: its id, DBOS status and the instance
    that took it (DBOS's executor id)."""
    row = conn.execute(
        "SELECT workflow_uuid, status, executor_id FROM dbos.workflow_status"
        " WHERE name = 'relay.grace_period' AND workflow_uuid LIKE %s",
        (f"grace:%:{executor_id}:%",),
    ).fetchone()
    return None if row is None else (str(row[0]), str(row[1]), str(row[2]))


def settled(row: tuple[str, str, str]) -> bool:
    """Whether a grace period's row says who took it, for good: not still queued, and not PENDING on
    0.2.0's instance, which is the moment between taking it and failing it."""
    _, status, by = row
    return status not in ("ENQUEUED", "DELAYED") and not (status == "PENDING" and by == "relay-2")


def hand_to_old_release(relay_db: str, new: RelayProcess, executor_id: str) -> tuple[str, str, str]:
    """Stop this code's instance the moment its grace period for ``executor_id`` is on the queue,
    until some instance has taken it: only 0.2.0's queue worker runs meanwhile."""
    with psycopg.connect(relay_db, autocommit=True) as conn:
        deadline = time.monotonic() + 10
        while grace_row(conn, executor_id) is None:
            assert time.monotonic() < deadline, "no grace period was queued"
            time.sleep(0.002)
        new.signal(signal.SIGSTOP)
        try:
            # Taken: by 0.2.0, which fails it at once (PENDING for an instant, then ERROR); or by this
            # code's worker just before it stopped (PENDING on relay-1: it waits out the grace period).
            return assert_eventually(lambda: (r := grace_row(conn, executor_id)) and settled(r) and r, 10)
        finally:
            new.signal(signal.SIGCONT)


def run_by(relay_db: str, workflow_id: str) -> tuple[str, str] | None:
    """A workflow's DBOS status and the instance that ran it."""
    with psycopg.connect(relay_db) as conn:
        row = conn.execute(
            "SELECT status, executor_id FROM dbos.workflow_status WHERE workflow_uuid = %s", (workflow_id,)
        ).fetchone()
    return None if row is None else (str(row[0]), str(row[1]))


def audit_entries(relay: RelayProcess, executor_id: str) -> list[dict[str, str]]:
    with relay.api() as api:
        entries: list[dict[str, str]] = api.get("/audit", params={"executorId": executor_id}).json()
    return entries


def release_home(tmp_path: Path, name: str) -> Path:
    home = tmp_path / name
    home.mkdir()
    with tarfile.open(RELEASE) as release:
        release.extractall(home, filter="data")
    return home


def test_a_grace_period_0_2_0_takes_off_this_releases_queue_is_made_up_for_by_the_repair_sweep(
    tmp_path: Path, relay_db: str, start_executor: StartExecutor, evidence_db: str
) -> None:
    # An instance of 0.2.0 runs (schema 1 and 2); then one of this code starts and migrates.
    old = RelayProcess(release_home(tmp_path, "relay-0.2.0"), relay_db, relay_yaml(free_port(), grace=GRACE), "relay-2")
    old.start()
    # pingWaitSecs: this instance is stopped for about a poll of the queue (1 s); its executors stay.
    config = relay_yaml(free_port(), grace=GRACE, repairIntervalSecs=REPAIR, pingWaitSecs=15)
    new = RelayProcess(tmp_path, relay_db, config, "relay-1")
    try:
        new.start()
        assert schema_versions(relay_db)[-1] > 2
        # From then on an instance of 0.2.0 cannot start: migration 7 dropped its table of keys.
        third = RelayProcess(release_home(tmp_path, "relay-0.2.0-again"), relay_db, relay_yaml(free_port()), "relay-3")
        with pytest.raises(RuntimeError, match='relation "keys" does not exist'):
            third.start()

        env = {"RELAY_TEST_EVIDENCE": evidence_db}
        jobs = {"RELAY_TEST_JOBS": "2", "RELAY_TEST_JOB_SLEEP": "10"}  # still sleeping when their executor dies
        peer = start_executor(new.conductor_url, env=env)
        victims = [start_executor(new.conductor_url, env={**env, **jobs, "RELAY_TEST_JOB_PREFIX": p}) for p in "ab"]
        for executor in (peer, *victims):
            assert_eventually(lambda e=executor: new.state_of("acme", "ledger", e.executor_id) == "HEALTHY", 10)

        # One death after the other, each grace period handed to 0.2.0. Two, because this code's
        # queue worker may still take one in the few milliseconds before it is stopped.
        graces, lost = {}, {}
        for victim in victims:
            victim.kill()
            graces[victim.executor_id] = hand_to_old_release(relay_db, new, victim.executor_id)
            lost[victim.executor_id] = ts((new.executor("acme", "ledger", victim.executor_id) or {})["disconnectedAt"])
        # 0.2.0 took them and could not run them: its grace_period has no lost_at.
        taken = [(status, by) for _, status, by in graces.values()]
        assert ("ERROR", "relay-2") in taken and set(taken) <= {("ERROR", "relay-2"), ("PENDING", "relay-1")}, taken

        # This code's repair sweep declares each death once the grace period has passed, and a
        # healthy peer recovers the victims' workflows, each once.
        for victim in victims:
            assert_eventually(lambda v=victim: new.executor("acme", "ledger", v.executor_id) is None, GRACE + 30)
        outcomes = assert_eventually(lambda: all_outcomes(Evidence(evidence_db), 4), 60)
        assert outcomes == dict.fromkeys(("a-0", "a-1", "b-0", "b-1"), peer.executor_id)
        assert Evidence(evidence_db).outcome_count() == 4
        for victim in victims:
            entries = audit_entries(new, victim.executor_id)
            actions = [e["action"] for e in entries]
            for action in ("executor.dead", "recovery.dispatched", "recovery.succeeded", "executor.deleted"):
                assert actions.count(action) == 1, (action, actions)
            late = ts(next(e["at"] for e in entries if e["action"] == "executor.dead")) - lost[victim.executor_id]
            assert GRACE - 0.1 <= late.total_seconds() <= GRACE + REPAIR + SWEEP_SLACK, late
            with new.api() as api:
                (recovery,) = api.get("/apps/ledger/recoveries", params={"executorId": victim.executor_id}).json()
            assert recovery["status"] == "succeeded", recovery
            # The recovery ran on this code's instance: 0.2.0 takes no workflow that is not queued. DBOS
            # records its end after its last step's write deleted the record: awaited, not read at once.
            rid = recovery["recoveryId"]
            assert_eventually(lambda rid=rid: run_by(relay_db, rid) == ("SUCCESS", "relay-1"), 10, what=f"{rid} run")
    finally:
        new.stop()
        old.stop()


def test_an_instance_of_0_2_0_that_no_instance_will_adopt_is_named_at_start(tmp_path: Path, relay_db: str) -> None:
    """0.2.0 predates leases: an instance of it that stopped (here, killed with an executor on it)
    is adopted by nobody. Its executors stay HEALTHY and what it began waits for an instance with
    its id (0.2.0's default id, hostname:port, changes with the container): the new release says so."""
    old = RelayProcess(release_home(tmp_path, "relay-0.2.0"), relay_db, relay_yaml(free_port()), "relay-old").start()
    url = f"ws://127.0.0.1:{old.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "left-behind", "answer"):
        assert_eventually(lambda: old.state_of("acme", "ledger", "left-behind") == "HEALTHY", 10)
        old.signal(signal.SIGKILL)
        assert old.proc is not None and old.proc.wait(10) == -signal.SIGKILL
    new = RelayProcess(tmp_path, relay_db, relay_yaml(free_port()), "relay-new")
    try:
        new.start()
        assert new.state_of("acme", "ledger", "left-behind") == "HEALTHY"  # nobody will say otherwise
    finally:
        new.stop()
    warning = (
        "WARNING relay: instance relay-old has no lease (Relay 0.2.0, which predates leases) and holds 1 executor "
        "record(s), 1 of them HEALTHY, and 0 pending workflow(s): no instance adopts it. While it runs, this is a "
        "rolling upgrade's normal state; once it has stopped, start this release with RELAY_INSTANCE_ID=relay-old "
        "to take its executors, grace periods and recoveries over"
    )
    assert new.log().count(warning) == 1, new.log()
    assert "instance relay-new has no lease" not in new.log()
