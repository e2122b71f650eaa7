"""What grows with age in a long-lived Relay: records that nothing ever prunes.

Each test here states what grows, how fast in a real fleet, and the bound it should have. A fleet
that restarts often (every deploy draws fresh executor ids and, for containers whose hostname is the
default ``RELAY_INSTANCE_ID``, fresh instance ids) is the case each one is written for.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import psycopg

from harness.executors import ExecutorProcess
from harness.keys import CONDUCTOR_KEYS
from harness.relay import RelayProcess, audit_actions
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from relay.config import RetentionConfig
from relay.store.db import Database
from relay.store.executors import ExecutorStore
from relay.store.instances import Adoption, InstanceStore
from relay.store.lease import Lease
from relay.store.retention import RetentionStore

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]

# Retention's ages, as short as the tests can wait for (under a second).
SHORT_DAYS = 1e-5
SHORT = RetentionConfig(
    audit_days=SHORT_DAYS,
    recoveries_days=SHORT_DAYS,
    relay_workflows_days=SHORT_DAYS,
    executor_ids_days=SHORT_DAYS,
    app_metrics_days=SHORT_DAYS,
)


async def _until_older_than(db: Database, sql: str, days: float, what: str) -> None:
    """Wait until ``sql`` (one boolean: is it old enough, by the database's clock) says so."""
    deadline = time.monotonic() + 15
    while True:
        async with db.connection() as conn:
            cur = await conn.execute(sql, (days,))
            row = await cur.fetchone()
        if row is not None and all(row.values()):
            return
        assert time.monotonic() < deadline, f"{what} never grew older than retention's age"
        await asyncio.sleep(0.1)


async def _deploys(db: Database, survivor: Lease, generations: int) -> list[Adoption]:
    """``generations`` instances, each started under a fresh id (a container's new hostname), stopped
    cleanly (a rolling deploy), and adopted by the next one, which in turn stops; ``survivor``, the
    instance that stays, adopts the last. Returns every adoption, in order."""
    instances = InstanceStore(db, ExecutorStore(db))
    adoptions: list[Adoption] = []
    previous: tuple[str, int] | None = None
    for n in range(generations):
        lease = Lease(db, f"relay-pod-{n:04d}", 30)
        epoch = await lease.acquire()
        if previous is not None:
            adoption = await instances.adopt(lease.instance_id, *previous)
            assert adoption is not None, f"generation {n} could not adopt {previous[0]}"
            adoptions.append(adoption)
        await lease.stop()  # released: its lease ends now
        previous = (lease.instance_id, epoch)
    assert previous is not None
    assert survivor.epoch is not None
    db.fence = (survivor.instance_id, survivor.epoch)  # the survivor's own fenced writes from here
    final = await instances.adopt(survivor.instance_id, *previous)
    assert final is not None
    adoptions.append(final)
    return adoptions


def _with_db(relay_db: str, body: Callable[[Database, Lease], Any]) -> Any:
    async def scenario() -> Any:
        db = Database(relay_db)
        await db.open()
        await db.migrate()
        async with db.connection() as conn:  # one org: an adoption is audited in each
            await conn.execute("INSERT INTO orgs (name) VALUES ('acme') ON CONFLICT DO NOTHING")
        survivor = Lease(db, "relay-stays", 30)
        await survivor.acquire()
        try:
            return await body(db, survivor)
        finally:
            await survivor.stop()
            await db.close()

    return asyncio.run(scenario())


def test_retention_forgets_instances_adopted_long_ago(relay_db: str) -> None:
    """What grows: ``relay_instances``. Every start under a new ``RELAY_INSTANCE_ID`` (the default is
    ``hostname:port``, and a container's or a Deployment pod's hostname changes at every start)
    inserts a row; its adoption marks it ``adopted_by`` and nothing ever deletes it. A fleet of three
    instances deployed twice a day leaves ~2,000 rows a year, all listed by ``GET .../instances`` (no
    paging, one count of executors per row), and a single instance in Docker leaves one per restart.

    Expected bound: an instance adopted longer ago than retention's age (it holds no executors and its
    workflows were taken over at its adoption) is deleted by the retention round, as executor ids not
    seen for ``executorIdsDays`` are; only live instances and recent adoptions remain."""
    generations = 20

    async def body(db: Database, survivor: Lease) -> tuple[int, list[str]]:
        await _deploys(db, survivor, generations)
        await _until_older_than(
            db,
            """SELECT bool_and(adopted_at < now() - make_interval(secs => %s * 86400)) AS old
               FROM relay_instances WHERE adopted_by IS NOT NULL""",
            SHORT_DAYS,
            "the adoptions",
        )
        await RetentionStore(db).prune(SHORT)
        async with db.connection() as conn:
            cur = await conn.execute("SELECT instance_id FROM relay_instances ORDER BY instance_id")
            left = [str(r["instance_id"]) for r in await cur.fetchall()]
        return generations, left

    generations, left = _with_db(relay_db, body)
    assert left == ["relay-stays"], (
        f"retention kept {len(left) - 1} of the {generations} instances adopted long ago "
        f"(relay_instances grows by one row per start under a new id): {left[:5]}..."
    )


def test_an_adoption_does_not_carry_every_instance_ever_adopted(relay_db: str) -> None:
    """What grows: the set of instances an adoption passes on (``InstanceStore.adopt`` moves every
    instance the dead one had adopted to the adopter, whatever their age). With a fresh instance id
    per start, each rolling deploy's adopter inherits the whole history: the n-th adoption's
    ``relay.instance_adopted`` entry (written in every org) lists n-1 ``inherited`` ids, and
    ``Durable.take_over`` (and ``resume_adopted`` at every start) looks for pending workflows of all
    of them. After a year of twice-daily deploys that is ~700 ids per adoption and per start; a
    single instance in Docker (each start adopts the one before, with all it had adopted) sees the same.

    Expected bound: an instance whose workflows were taken over by an earlier adoption, long ago, is
    not passed on again; an adoption carries the instance it adopts and the few recently adopted ones
    that may still have work (here, the last generation's), not the whole history."""
    generations = 20

    async def body(db: Database, survivor: Lease) -> tuple[list[int], dict[str, Any], int]:
        adoptions = await _deploys(db, survivor, generations)
        async with db.connection() as conn:
            cur = await conn.execute(
                """SELECT detail FROM audit_log WHERE action = 'relay.instance_adopted'
                   AND detail->>'adoptedBy' = 'relay-stays'"""
            )
            last_entry = (await cur.fetchone() or {}).get("detail") or {}
        carried = await InstanceStore(db, ExecutorStore(db)).adopted_by("relay-stays")
        return [len(a.inherited) for a in adoptions], last_entry, len(carried)

    inherited, last_entry, carried = _with_db(relay_db, body)
    assert max(inherited) <= 2, (
        f"the adoptions inherited {inherited} instances: the last one carries every instance ever adopted "
        f"(its audit entry lists {len(last_entry.get('inherited', []))}; resume_adopted looks at {carried})"
    )


def test_an_idle_executor_of_a_retired_version_does_not_wait_for_an_operator_forever(
    start_relay: StartRelay, start_executor: StartExecutor, sysdb: str
) -> None:
    """What grows: ``executors`` rows in ``DEAD``, their unfinished ``recoveries`` (status
    ``awaiting_operator``, which retention never prunes), their ``executor_ids`` (kept while the record
    is), and one ``PENDING`` DBOS workflow each on Relay's system database, re-checking every 30 s
    (which ``relayWorkflowsDays`` never collects). DBOS's application version is a hash of the code, so
    every deploy moves an app to a new version; with the default ``recoverToLatestVersion: false``,
    each executor of the old version that outlives its last same-version peer's grace period (at
    least the last of a rollout, usually all of them) is declared DEAD and its recovery blocks on
    ``version_upgrade_not_allowed``, although it left nothing to recover. A fleet of 50 executors
    deployed daily adds up to 50 such records and workflows a day, forever (the executor list, the
    ``relay_executors_blocked`` gauge and every blocked-recovery re-check grow with them).

    Expected bound: a dead executor with no ``PENDING`` workflow has nothing to move onto a newer
    version; its recovery finishes (``succeeded``) and its record is deleted, as with a same-version
    peer, so that a deploy leaves nothing behind."""
    relay = start_relay(grace=0.5)
    old = start_executor(relay.conductor_url)  # v1, no jobs: nothing left PENDING when it stops
    assert_eventually(lambda: relay.state_of("acme", "ledger", old.executor_id) == "HEALTHY", 10)
    new = start_executor(relay.conductor_url, version="v2")  # the deploy's new version
    assert_eventually(lambda: relay.state_of("acme", "ledger", new.executor_id) == "HEALTHY", 10)
    old.kill()  # the rollout stops the last v1 executor
    with psycopg.connect(sysdb) as conn:
        pending = conn.execute(
            "SELECT count(*) FROM dbos.workflow_status WHERE executor_id = %s AND status = 'PENDING'",
            (old.executor_id,),
        ).fetchone()
    assert pending is not None and pending[0] == 0, "the old executor was meant to leave nothing to recover"
    # Declared dead (its record may be gone by the next look: the audit log keeps the death).
    assert_eventually(lambda: "executor.dead" in audit_actions(relay, old.executor_id), 15)

    def settled() -> str | None:
        record = relay.executor("acme", "ledger", old.executor_id)
        if record is None:
            return "deleted"
        return "blocked" if record.get("blockedReason") == "version_upgrade_not_allowed" else None

    outcome = assert_eventually(settled, 20)
    with relay.api() as api:
        recoveries = api.get("/apps/ledger/recoveries", params={"executorId": old.executor_id}).json()
    assert outcome == "deleted", (
        f"an idle executor of the old version, with no PENDING workflow, is kept DEAD waiting for an operator "
        f"(recoveries: {[r['status'] for r in recoveries]}): every deploy adds such records forever"
    )
    assert [r["status"] for r in recoveries] == ["succeeded"]
    with relay.api() as api:
        audit = api.get("/audit", params={"executorId": old.executor_id}).json()
    succeeded = next(e for e in audit if e["action"] == "recovery.succeeded")
    assert succeeded["detail"]["nothingPending"] is True and succeeded["peerExecutorId"] == new.executor_id
    actions = [e["action"] for e in audit]
    assert "recovery.dispatched" not in actions and "recovery.awaiting_operator" not in actions, actions
    assert actions.index("recovery.succeeded") < actions.index("executor.deleted")
    # Nothing left running on Relay's side either: its recovery workflow finished.
    assert_eventually(
        lambda: relay.runs_of("relay.recover", "PENDING") == 0 and relay.runs_of("relay.recover") == 1, 10
    )


def _recovery_steps(relay_db: str, executor_id: str) -> int:
    """Checkpoints DBOS holds for the recovery workflows of ``executor_id`` (Relay's own system database)."""
    with psycopg.connect(relay_db) as conn:
        row = conn.execute(
            "SELECT count(*) FROM dbos.operation_outputs WHERE workflow_uuid LIKE %s",
            (f"recovery:acme:ledger:{executor_id}:%",),
        ).fetchone()
    return int(row[0]) if row else 0


def _settled_steps(relay_db: str, executor_id: str) -> int:
    """The count of :func:`_recovery_steps` once it has not changed for a second."""
    deadline = time.monotonic() + 20
    count, since = _recovery_steps(relay_db, executor_id), time.monotonic()
    while time.monotonic() - since < 1.0:
        assert time.monotonic() < deadline, "the recovery's checkpoints never stopped changing"
        time.sleep(0.1)
        now = _recovery_steps(relay_db, executor_id)
        if now != count:
            count, since = now, time.monotonic()
    return count


def test_a_waiting_recovery_does_not_add_checkpoints_at_every_wake_up(start_relay: StartRelay, relay_db: str) -> None:
    """What grows: DBOS's ``operation_outputs`` of a recovery that waits (``no_healthy_peer``,
    ``version_upgrade_not_allowed``). Each turn of its wait loop records new steps (``relay.recovery.gather``,
    the ``DBOS.recv`` and its timeout), and it turns every ``BLOCKED_RECHECK_SECS`` (30 s) and at every
    connection of any executor of the app: ~3 rows a turn, ~8,600 a day per waiting recovery, more in
    a fleet whose executors reconnect often. The workflow stays ``PENDING``, so ``relayWorkflowsDays``
    never collects them, and every replay (a Relay restart, an adoption) reads the whole history:
    a recovery waiting a month for an operator replays ~260,000 steps each time its instance restarts.

    Expected bound: a waiting recovery's checkpoints do not grow with the time it waits or the wake-ups
    it gets (a wait that only finds the same block again records nothing new, or the wait starts over
    in a fresh run); here, ten peers of another version connecting add at most a few rows."""
    relay = start_relay(grace=0.5)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    dead = "retired-v1"
    with SimulatedPeer(url, dead, "answer"):
        assert_eventually(lambda: relay.state_of("acme", "ledger", dead) == "HEALTHY", 10)
    # Its socket cut: DEAD after the grace period, and its recovery waits (no peer at all).
    assert_eventually(lambda: (r := relay.executor("acme", "ledger", dead)) and r["blockedReason"], 20)
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(SimulatedPeer(url, "v2-0", "answer", version="v2"))
        assert_eventually(lambda: relay.state_of("acme", "ledger", first.executor_id) == "HEALTHY", 10)
        # The first wake-up finds the version block and records it: from here, the wait is the steady state.
        assert_eventually(
            lambda: (
                (r := relay.executor("acme", "ledger", dead)) and r["blockedReason"] == "version_upgrade_not_allowed"
            ),
            20,
        )
        baseline = _settled_steps(relay_db, dead)  # that turn has settled into its wait
        wakes = 10
        for n in range(1, wakes + 1):  # the deploy's new executors connect, one after another
            peer = stack.enter_context(SimulatedPeer(url, f"v2-{n}", "answer", version="v2"))
            assert_eventually(lambda p=peer: relay.state_of("acme", "ledger", p.executor_id) == "HEALTHY", 10)
        # A bounded wait records at most a few rows; give every wake-up time to be handled, failing at
        # once if the history grows past the bound.
        deadline = time.monotonic() + 10
        grown = 0
        while time.monotonic() < deadline:
            grown = _recovery_steps(relay_db, dead) - baseline
            assert grown <= 5, (
                f"the waiting recovery of {dead} recorded {grown} more checkpoints after {wakes} peers connected "
                f"(from {baseline}): its history grows with every wake-up, for as long as it waits"
            )
            time.sleep(0.2)
    assert relay.executor("acme", "ledger", dead) is not None, "the recovery was meant to still be waiting"
