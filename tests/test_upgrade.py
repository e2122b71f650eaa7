"""An upgrade in place from the last release: what 0.2.0 started, this code finishes.

``tests/upgrade/relay-0.2.0.tar.gz`` holds Relay 0.2.0's ``relay/`` and
``workflows/`` exactly as released (``git archive --format=tar de742e9 relay
workflows | gzip -n -9``). Relay 0.2.0 runs from it on a fresh database
(its schema: migrations 1 and 2), starts a grace period and a recovery that
waits for a peer, and is killed with -9; this code then starts on the same
database with the same instance id, migrates forward, and must finish both.
"""

from __future__ import annotations

import signal
import tarfile
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from harness.executors import Evidence, ExecutorProcess, jobs_held
from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, audit_actions, relay_yaml
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually

RELEASE = Path(__file__).resolve().parent / "upgrade" / "relay-0.2.0.tar.gz"
StartExecutor = Callable[..., ExecutorProcess]
GRACE = 6.0


def ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def all_outcomes(evidence: Evidence, n: int) -> dict[str, str] | None:
    outcomes = evidence.outcomes()
    return outcomes if len(outcomes) >= n else None


def schema_versions(relay_db: str) -> list[int]:
    with psycopg.connect(relay_db) as conn:
        return [int(r[0]) for r in conn.execute("SELECT version FROM relay_schema_migrations ORDER BY version")]


def workflow_status(relay_db: str, workflow_id: str) -> str | None:
    with psycopg.connect(relay_db) as conn:
        row = conn.execute(
            "SELECT status FROM dbos.workflow_status WHERE workflow_uuid = %s", (workflow_id,)
        ).fetchone()
    return None if row is None else str(row[0])


def test_a_grace_period_and_a_waiting_recovery_of_0_2_0_finish_after_the_upgrade(
    tmp_path: Path, postgres: Postgres, relay_db: str, start_executor: StartExecutor, evidence_db: str
) -> None:
    old_home = tmp_path / "relay-0.2.0"
    old_home.mkdir()
    with tarfile.open(RELEASE) as release:
        release.extractall(old_home, filter="data")
    config = relay_yaml(free_port(), grace=GRACE)
    config["orgs"][0]["apps"].append({"name": "solo", "executorTimeoutSecs": 0.3})
    # `python -m relay` in the release's folder runs the release's code, not this checkout's.
    old = RelayProcess(old_home, relay_db, config, "relay-1").start()
    assert schema_versions(relay_db) == [1, 2]  # the release's own schema

    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    # Still sleeping when their executor dies: held back until just before (the gates). Started as
    # they launched, their 10 s sleep had to outlast the other executors' starts and the registry's
    # waits; started at the gate, 2 s is longer than the test takes to kill it.
    jobs = {"RELAY_TEST_JOBS": "2", "RELAY_TEST_JOB_SLEEP": "2"}
    peer = start_executor(old.conductor_url, env=env)
    unrecorded = start_executor(old.conductor_url, env=env)
    solo_sysdb = postgres.create_database("solo_sys")
    ledger_jobs = {**env, **jobs, "RELAY_TEST_JOB_PREFIX": "ledger"}
    solo_jobs = {**env, **jobs, "RELAY_TEST_JOB_PREFIX": "solo"}
    with jobs_held(start_executor, old.conductor_url, tmp_path, ledger_jobs) as held_victim:
        with jobs_held(start_executor, old.conductor_url, tmp_path, solo_jobs, app="solo", sysdb=solo_sysdb) as held:
            for executor in (peer, unrecorded):
                assert_eventually(lambda e=executor: old.state_of("acme", e.app, e.executor_id) == "HEALTHY", 10)
            held_victim.await_healthy(old, {peer.executor_id, unrecorded.executor_id}, 30, what="the victim")
            held.await_healthy(old, set(), 30, what="the lonely executor", app="solo")
            lonely = held.release()
        # 0.2.0 declares the lonely executor dead and its recovery waits for a peer (in DBOS.recv).
        lonely.kill()
        assert_eventually(
            lambda: (old.executor("acme", "solo", lonely.executor_id) or {}).get("blockedReason") == "no_healthy_peer",
            10,
        )
        victim = held_victim.release()
    # 0.2.0 starts the victim's grace period and records its timer; then it dies in the middle of it.
    victim.kill()
    assert_eventually(lambda: old.state_of("acme", "ledger", victim.executor_id) == "DISCONNECTED", 5)
    disconnected_at = ts((old.executor("acme", "ledger", victim.executor_id) or {})["disconnectedAt"])
    assert_eventually(lambda: graces(relay_db, recorded=True) == 1, 10)
    # A second one's run is started but stopped before it records its timer (the table it records
    # it in is locked): resumed, it must not wait a whole grace period from the upgrade.
    with psycopg.connect(relay_db, autocommit=False) as lock:
        lock.execute("LOCK TABLE dbos.operation_outputs IN SHARE ROW EXCLUSIVE MODE")
        unrecorded.kill()
        assert_eventually(lambda: old.state_of("acme", "ledger", unrecorded.executor_id) == "DISCONNECTED", 5)
        unrecorded_at = ts((old.executor("acme", "ledger", unrecorded.executor_id) or {})["disconnectedAt"])
        assert_eventually(lambda: graces(relay_db, recorded=False) == 2, 10)
        old.signal(signal.SIGKILL)
        assert old.proc is not None and old.proc.wait(10) == -signal.SIGKILL
    assert graces(relay_db, recorded=True) == 1, "the second run recorded its timer: the lock came too late"
    assert Evidence(evidence_db).outcomes() == {}

    new = RelayProcess(tmp_path, relay_db, config, "relay-1")
    try:
        new.start()
        up = datetime.now(UTC)
        # The grace periods resume with their deadlines (the one 0.2.0 recorded; for the run that
        # recorded none, one grace period after its executor's disconnection) and the peer recovers
        # both executors.
        for executor, lost in ((victim, disconnected_at), (unrecorded, unrecorded_at)):
            assert_eventually(lambda e=executor: new.executor("acme", "ledger", e.executor_id) is None, GRACE + 20)
            dead = next(e for e in _audit(new, executor.executor_id) if e["action"] == "executor.dead")
            # Declared at that deadline, or as soon as the new instance is up when that took longer (a
            # loaded machine): a grace period begun again would end GRACE after that.
            started = (up - lost).total_seconds()
            late = (ts(dead["at"]) - lost).total_seconds()
            assert GRACE - 0.1 <= late <= max(GRACE, started) + 1.5, (executor is victim, late, started)
        # The waiting recovery is woken by a new peer of its app and finishes.
        rescuer = start_executor(new.conductor_url, app="solo", sysdb=solo_sysdb, env=env)
        assert_eventually(lambda: new.executor("acme", "solo", lonely.executor_id) is None, 30)

        outcomes = assert_eventually(lambda: all_outcomes(Evidence(evidence_db), 4), 60)
        assert {w: e for w, e in outcomes.items() if w.startswith("ledger")} == {
            "ledger-0": peer.executor_id,
            "ledger-1": peer.executor_id,
        }
        assert {w: e for w, e in outcomes.items() if w.startswith("solo")} == {
            "solo-0": rescuer.executor_id,
            "solo-1": rescuer.executor_id,
        }
        assert Evidence(evidence_db).outcome_count() == 4
        for executor, app in ((victim, "ledger"), (unrecorded, "ledger"), (lonely, "solo")):
            actions = audit_actions(new, executor.executor_id)
            for action in ("executor.dead", "recovery.dispatched", "recovery.succeeded", "executor.deleted"):
                assert actions.count(action) == 1, (app, action, actions)
            with new.api() as api:
                (recovery,) = api.get(f"/apps/{app}/recoveries", params={"executorId": executor.executor_id}).json()
            assert recovery["status"] == "succeeded"
            # DBOS records the run's end after its last step's write deleted the record: awaited.
            rid = recovery["recoveryId"]
            assert_eventually(lambda rid=rid: workflow_status(relay_db, rid) == "SUCCESS", 10, what=f"{rid} SUCCESS")
        assert "recovery.waiting_for_peer" in audit_actions(new, lonely.executor_id)
    finally:
        new.stop()


def graces(relay_db: str, recorded: bool) -> int:
    """Relay's PENDING grace periods; with ``recorded``, only those whose timer is recorded."""
    with psycopg.connect(relay_db) as conn:
        row = conn.execute(
            """SELECT count(*) FROM dbos.workflow_status w
               WHERE w.name = 'relay.grace_period' AND w.status = 'PENDING'
                 AND (NOT %s OR EXISTS (SELECT 1 FROM dbos.operation_outputs o
                                        WHERE o.workflow_uuid = w.workflow_uuid))""",
            (recorded,),
        ).fetchone()
    return int(row[0]) if row else 0


def recorded_operations(relay_db: str, workflow_id: str) -> list[str]:
    with psycopg.connect(relay_db) as conn:
        rows = conn.execute(
            "SELECT function_name FROM dbos.operation_outputs WHERE workflow_uuid = %s ORDER BY function_id",
            (workflow_id,),
        ).fetchall()
    return [str(r[0]) for r in rows]


def test_a_recovery_of_0_2_0_in_its_backoff_sleep_finishes_after_the_upgrade(
    tmp_path: Path, relay_db: str, start_executor: StartExecutor, evidence_db: str
) -> None:
    """0.2.0 waits out a failed attempt's backoff in DBOS.sleep; this code waits in DBOS.recv (an
    operator's nudge ends it) only in runs it starts. A run 0.2.0 began, killed with its sleep
    recorded, must replay that sleep here and finish in the same run."""
    old_home = tmp_path / "relay-0.2.0"
    old_home.mkdir()
    with tarfile.open(RELEASE) as release:
        release.extractall(old_home, filter="data")
    config = relay_yaml(free_port(), grace=0.3, failoverBackoffInitialSecs=8, failoverBackoffMaxSecs=8)
    old = RelayProcess(old_home, relay_db, config, "relay-1").start()
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    # Held back until it is HEALTHY (the gate): started as it launched, their 10 s sleep had to
    # outlast its start and the registry's wait; started at the gate, 2 s is longer than the test
    # takes to kill it.
    jobs = {"RELAY_TEST_JOBS": "2", "RELAY_TEST_JOB_SLEEP": "2", "RELAY_TEST_JOB_PREFIX": "ledger"}
    url = f"ws://127.0.0.1:{old.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, str(uuid.uuid4()), "answer", replies={"recovery": {"success": False}}) as bad:
        with jobs_held(start_executor, old.conductor_url, tmp_path, {**env, **jobs}) as held:
            # The refusing peer too: recorded after the victim's death, it would not be asked.
            assert_eventually(lambda: old.state_of("acme", "ledger", bad.executor_id) == "HEALTHY", 10)
            held.await_healthy(old, {bad.executor_id}, 30, what="the victim")
            victim = held.release()
        victim.kill()  # its one peer refuses: the attempt fails and 0.2.0 sleeps out its backoff
        with psycopg.connect(relay_db) as conn:
            rid = assert_eventually(
                lambda: (r := conn.execute("SELECT id FROM recoveries WHERE executor_id = %s",
                                           (victim.executor_id,)).fetchone()) and str(r[0]), 10)  # fmt: skip
        assert_eventually(lambda: "DBOS.sleep" in recorded_operations(relay_db, rid), 15)
        assert bad.recovery_requests == 1
    assert_eventually(lambda: old.state_of("acme", "ledger", bad.executor_id) == "DEAD", 10)
    old.signal(signal.SIGKILL)
    assert old.proc is not None and old.proc.wait(10) == -signal.SIGKILL

    new = RelayProcess(tmp_path, relay_db, config, "relay-1")
    try:
        new.start()
        rescuer = start_executor(new.conductor_url, env=env)
        outcomes = assert_eventually(lambda: all_outcomes(Evidence(evidence_db), 2), 60)
        assert outcomes == {"ledger-0": rescuer.executor_id, "ledger-1": rescuer.executor_id}
        assert_eventually(lambda: new.executor("acme", "ledger", victim.executor_id) is None, 20)
        with new.api() as api:
            (recovery,) = api.get("/apps/ledger/recoveries", params={"executorId": victim.executor_id}).json()
        assert recovery["recoveryId"] == rid and recovery["status"] == "succeeded", recovery
        assert [a["outcome"] for a in recovery["attempts"]] == ["failed", "succeeded"]
        # The same run, not one the repair sweep began; DBOS records its end after its last step's write
        # deleted the record (awaited), and then every operation it recorded is there to read.
        assert_eventually(lambda: workflow_status(relay_db, rid) == "SUCCESS", 10, what="the same run's SUCCESS")
        operations = recorded_operations(relay_db, rid)
        shown = ", ".join(operations)  # the whole list in the message (pytest shortens a list it shows)
        # The failed attempt's backoff is the sleep 0.2.0 recorded, replayed as a sleep (a wait in
        # DBOS.recv there would not replay). When that backoff ran out before the rescuer connected
        # (a loaded machine starts an executor slowly), the run then found no peer and waited for one
        # as 0.2.0 does too: mark_blocked, then DBOS.recv with its deadline's DBOS.sleep, woken by the
        # rescuer's connection. No other wait.
        (failed,) = [i for i, op in enumerate(operations) if op == "relay.fail_attempt"]
        assert operations[failed + 1] == "DBOS.sleep", shown
        waits = [i for i, op in enumerate(operations) if op == "DBOS.recv"]
        for i in waits:
            assert operations[i - 1] == "relay.mark_blocked" and operations[i + 1] == "DBOS.sleep", shown
        assert operations.count("DBOS.sleep") == 1 + len(waits), shown
    finally:
        new.stop()


def _audit(relay: RelayProcess, executor_id: str) -> list[dict[str, str]]:
    with relay.api() as api:
        entries: list[dict[str, str]] = api.get("/audit", params={"executorId": executor_id}).json()
    return entries


def test_a_recovery_of_0_2_0_waiting_for_an_operator_with_nothing_pending_finishes_after_the_upgrade(
    tmp_path: Path, relay_db: str, start_executor: StartExecutor
) -> None:
    """0.2.0 blocks the recovery of an idle executor whose version no peer runs
    (``version_upgrade_not_allowed``) and waits in ``DBOS.recv``; this code, replaying that run's
    recorded steps (0.2.0's names, its wait loop's order), finds nothing PENDING at its next round
    and ends the same run ``succeeded``, the record deleted, with no recovery frame sent."""
    old_home = tmp_path / "relay-0.2.0"
    old_home.mkdir()
    with tarfile.open(RELEASE) as release:
        release.extractall(old_home, filter="data")
    config = relay_yaml(free_port(), grace=0.3)
    old = RelayProcess(old_home, relay_db, config, "relay-1").start()
    idle = start_executor(old.conductor_url)  # v1, no jobs: it leaves nothing PENDING
    assert_eventually(lambda: old.state_of("acme", "ledger", idle.executor_id) == "HEALTHY", 10)
    newer = start_executor(old.conductor_url, version="v2")
    assert_eventually(lambda: old.state_of("acme", "ledger", newer.executor_id) == "HEALTHY", 10)
    idle.kill()
    assert_eventually(
        lambda: (
            (old.executor("acme", "ledger", idle.executor_id) or {}).get("blockedReason")
            == "version_upgrade_not_allowed"
        ),
        15,
    )
    with psycopg.connect(relay_db) as conn:
        row = conn.execute("SELECT id FROM recoveries WHERE executor_id = %s", (idle.executor_id,)).fetchone()
    assert row is not None
    rid = str(row[0])
    # 0.2.0 waits in DBOS.recv (its timeout, DBOS.sleep, is recorded as the wait begins).
    assert_eventually(lambda: recorded_operations(relay_db, rid)[-1:] == ["DBOS.sleep"], 10)
    before = recorded_operations(relay_db, rid)
    assert before[0] == "relay.open_recovery"  # 0.2.0's shape of steps
    old.signal(signal.SIGKILL)
    assert old.proc is not None and old.proc.wait(10) == -signal.SIGKILL

    new = RelayProcess(tmp_path, relay_db, config, "relay-1")
    try:
        new.start()  # the v2 executor reconnects to it; the waiting run replays, then looks again
        assert_eventually(lambda: new.executor("acme", "ledger", idle.executor_id) is None, 60)
        with new.api() as api:
            (recovery,) = api.get("/apps/ledger/recoveries", params={"executorId": idle.executor_id}).json()
        assert recovery["recoveryId"] == rid and recovery["status"] == "succeeded", recovery
        assert recovery["attempts"] == []  # nothing was dispatched
        assert_eventually(lambda: workflow_status(relay_db, rid) == "SUCCESS", 10)  # the same run finished
        operations = recorded_operations(relay_db, rid)
        # 0.2.0's steps replayed as recorded (its DBOS.recv is written when it returns, before its timeout's row).
        assert [o for o in operations if o != "DBOS.recv"][: len(before)] == before, operations
        assert operations[-1] == "relay.succeed_nothing_pending", operations
        actions = audit_actions(new, idle.executor_id)
        assert "recovery.dispatched" not in actions, actions
        assert actions.count("recovery.succeeded") == 1 and actions.count("executor.deleted") == 1, actions
    finally:
        new.stop()
