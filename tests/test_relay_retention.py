"""Retention of Relay's own records, and a few limits that keep one misbehaving party from hurting others."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, off_loop, open_socket
from harness.waiting import assert_eventually
from relay.auth import KeyGrant, Permission, hash_key
from relay.config import RelayConfig, RetentionConfig
from relay.core.ids import ExecutorKey
from relay.core.lifecycle import ExecutorEvent as E
from relay.errors import DatabaseError, ExecutorTimeout
from relay.net.connection import ExecutorConnection
from relay.store import db as db_module
from relay.store.apps import AppStore
from relay.store.db import Database
from relay.store.executors import AppGone, ExecutorStore, Handshake
from relay.store.lease import Lease
from relay.store.migrations import MIGRATIONS
from relay.store.retention import RetentionStore
from relay_protocol import ExecutorInfoReply, RecoveryRequest

StartRelay = Callable[..., RelayProcess]
SECOND = 1 / 86_400  # a second, in days


def rows(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return list(conn.execute(sql, args).fetchall())  # type: ignore[call-overload]


def test_old_records_and_finished_relay_workflows_are_pruned_and_nothing_live(start_relay: StartRelay) -> None:
    config = relay_yaml(free_port(), grace=3600)
    config["retention"] = {
        "auditDays": 2 * SECOND,
        "recoveriesDays": 2 * SECOND,
        "relayWorkflowsDays": 4 * SECOND,
        "executorIdsDays": 2 * SECOND,
        "intervalSecs": 1,
    }
    relay = start_relay(config)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    comes_back, stays_away = str(uuid.uuid4()), str(uuid.uuid4())

    async def executors() -> None:
        for executor_id in (comes_back, stays_away):
            ws = await open_socket(url)
            await handshake(ws, executor_id)
            await off_loop(assert_eventually, lambda e=executor_id: relay.state_of("acme", "ledger", e), 5)
            ws.transport.abort()
        await off_loop(assert_eventually, lambda: relay.state_of("acme", "ledger", stays_away) == "DISCONNECTED", 5)
        ws = await open_socket(url)  # back: its grace period ends (a finished workflow)
        await handshake(ws, comes_back)
        await off_loop(assert_eventually, lambda: relay.state_of("acme", "ledger", comes_back) == "HEALTHY", 5)
        await ws.close()

    asyncio.run(executors())
    db = relay.database_url
    grace_sql = "SELECT workflow_uuid, status FROM dbos.workflow_status WHERE workflow_uuid LIKE 'grace:%%'"
    ended = assert_eventually(lambda: [r[0] for r in rows(db, grace_sql) if r[1] == "SUCCESS"], 3)
    with psycopg.connect(db, autocommit=True) as conn:  # a finished recovery and a running one, both old
        for rid, status in (("old-finished", "succeeded"), ("old-running", "waiting_for_peer")):
            conn.execute(
                """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status,
                                          updated_at) VALUES (%s, 'acme', 'ledger', %s, 'v1', 1, 'operator', %s,
                                          now() - interval '1 hour')""",
                (rid, f"x-{rid}", status),
            )
        conn.execute("INSERT INTO executor_ids (org, app, executor_id, key_id, last_seen_at) VALUES "
                     "('acme', 'ledger', 'forgotten', 'k', now() - interval '1 hour')")  # fmt: skip
    with relay.api() as api:
        assert api.patch("/apps/ledger", json={"executorTimeoutSecs": 3000}).status_code == 200

    def pruned() -> bool:
        audit = rows(db, "SELECT count(*) FROM audit_log")[0][0]
        recoveries = {r[0] for r in rows(db, "SELECT id FROM recoveries")}
        ids = {r[0] for r in rows(db, "SELECT executor_id FROM executor_ids")}
        graces = {r[0]: r[1] for r in rows(db, grace_sql)}
        return (
            audit == 0
            and recoveries == {"old-running"}
            and ids == {comes_back, stays_away}  # both still in the registry
            and not set(ended) & set(graces)  # the ended grace period went
            and set(graces.values()) == {"PENDING"}  # the running ones stay
        )

    assert_eventually(pruned, 15, interval=0.5)
    # The run that pruned the old finished recovery says so: its line is written after its commit,
    # and a line of any other run (there is one a second) would not show the prune was its.
    assert_eventually(lambda: re.search(r"retention: pruned \{[^}]*'recoveries': 1\b", relay.log()), 10)


async def _batch_with_a_bad_row(url: str) -> tuple[list[object], list[str]]:
    db = Database(url)
    await db.open()
    try:
        await db.migrate()
        await AppStore(db).sync_config(RelayConfig.model_validate(relay_yaml(free_port())))
        lease = Lease(db, "batch-test", 30)
        await lease.acquire()
        store = ExecutorStore(db)

        def handshake_of(org: str, app: str, executor_id: str, register_app: bool = False) -> Handshake:
            info = ExecutorInfoReply(request_id="r", executor_id=executor_id, application_version="v1")
            return Handshake(ExecutorKey(org, app, executor_id), info, "batch-test", "key", register_app)

        # Four together, written as one batch; registering an app in an org that does not exist breaks
        # the statement. An app that does not exist (and is not registered) only refuses its own.
        good = [handshake_of("acme", "ledger", f"good-{n}") for n in range(2)]
        bad = handshake_of("no-such-org", "ledger", "bad", register_app=True)
        gone = handshake_of("acme", "no-such-app", "gone")
        batch = [good[0], bad, good[1], gone]
        results = await asyncio.gather(*(store.connected(h) for h in batch), return_exceptions=True)
        async with db.connection() as conn:
            cur = await conn.execute("SELECT executor_id FROM executors ORDER BY executor_id")
            stored = [str(r["executor_id"]) for r in await cur.fetchall()]
        await lease.stop()
        return results, stored
    finally:
        await db.close()


def test_a_batch_of_handshakes_with_one_bad_row_records_the_others(postgres: Postgres) -> None:
    results, stored = asyncio.run(_batch_with_a_bad_row(postgres.create_database("batch")))
    assert isinstance(results[1], DatabaseError)
    assert not isinstance(results[0], BaseException) and not isinstance(results[2], BaseException)
    assert isinstance(results[3], AppGone), results[3]
    assert stored == ["good-0", "good-1"]


async def _send_to_a_peer_that_stopped_reading() -> tuple[float, bool]:
    """An ExecutorConnection whose ASGI send never completes (the peer's buffer is full)."""
    aborted: list[bool] = []

    class Stuck:
        last_heard = 0.0

        def send_ping(self) -> bool:
            return True

        def abort(self) -> None:
            aborted.append(True)

    async def never(_: object) -> None:
        await asyncio.Event().wait()

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    grant = KeyGrant("k", "acme", "prod", frozenset({Permission.WEBSOCKET_CONNECT}))
    scope = {"extensions": {"relay.keepalive": Stuck()}}
    digest = hash_key("k")
    conn = ExecutorConnection(None, grant, digest, "ledger", "test", receive, never, scope)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ExecutorTimeout, match="did not take recovery"):
        await conn.request(RecoveryRequest(executor_ids=["dead"]), timeout=0.3)
    return loop.time() - started, bool(aborted)


def test_a_send_to_a_peer_that_stopped_reading_times_out_and_drops_it() -> None:
    waited, aborted = asyncio.run(_send_to_a_peer_that_stopped_reading())
    assert 0.3 <= waited < 1.0 and aborted


async def _long_lived_executor_in_recovery(
    db: Database, instance: str
) -> tuple[Lease, ExecutorStore, ExecutorKey, int]:
    """An executor that stayed connected (through ``instance``) for 40 days, its id last presented
    then, and died just now: its recovery sent. Returns the lease held, the store, its key and epoch."""
    await db.migrate()
    await AppStore(db).sync_config(RelayConfig.model_validate(relay_yaml(free_port())))
    lease = Lease(db, "ids-test", 30)
    await lease.acquire()
    store = ExecutorStore(db)
    key = ExecutorKey("acme", "ledger", "long-lived")
    info = ExecutorInfoReply(request_id="r", executor_id=key.executor_id, application_version="v1")
    connected = await store.connected(Handshake(key, info, instance, "key"))
    async with db.connection() as conn:
        await conn.execute("UPDATE executor_ids SET last_seen_at = now() - interval '40 days'")
    assert await store.lost(key, connected.epoch, instance)
    for event in (E.GRACE_EXPIRED, E.RECOVERY_SENT):
        assert await store.apply(key, event, epoch=connected.epoch)
    return lease, store, key, connected.epoch


async def _an_id_connected_long_ago_whose_record_was_just_deleted(url: str) -> tuple[dict[str, bool], int]:
    db = Database(url)
    await db.open()
    try:
        lease, store, key, epoch = await _long_lived_executor_in_recovery(db, "ids-test")
        assert await store.apply(key, E.RECOVERED, epoch=epoch)  # its recovery, verified: record deleted
        pruned = await RetentionStore(db).prune(RetentionConfig(executor_ids_days=30))
        gone = await store.gone("acme", "ledger", [key.executor_id])
        await lease.stop()
        return gone, pruned.executor_ids
    finally:
        await db.close()


def test_an_id_is_remembered_for_executor_ids_days_after_its_record_goes(postgres: Postgres) -> None:
    """An executor connected for longer than executorIdsDays (a long-lived service) presented its id
    only when it connected. Once it died and its record was deleted, the next retention job forgot
    its id at once: work its recovery left behind then counted as an unknown id's, which the
    reconciler leaves alone, and another key could take the id over."""
    gone, forgotten = asyncio.run(
        _an_id_connected_long_ago_whose_record_was_just_deleted(postgres.create_database("ids"))
    )
    assert gone == {"long-lived": True}, "the id is remembered: its stranded work is the reconciler's"
    assert forgotten == 0


async def _upgrade_with_an_id_deleted_by_the_previous_release(url: str) -> dict[str, bool]:
    saved = db_module.MIGRATIONS
    db_module.MIGRATIONS = [m for m in MIGRATIONS if m.version < 19]
    db = Database(url)
    await db.open()
    try:
        await db.migrate()
        async with db.connection() as conn:  # as the previous release left them: seen at their connection
            for executor_id, deleted in (("deleted-lately", "1 hour"), ("deleted-long-ago", "35 days")):
                await conn.execute(
                    """INSERT INTO executor_ids (org, app, executor_id, key_id, last_seen_at)
                       VALUES ('acme', 'ledger', %s, 'k', now() - interval '40 days')""",
                    (executor_id,),
                )
                await conn.execute(
                    """INSERT INTO audit_log (org, app, action, executor_id, actor, at)
                       VALUES ('acme', 'ledger', 'executor.deleted', %s, 'relay', now() - %s::interval)""",
                    (executor_id, deleted),
                )
        db_module.MIGRATIONS = saved
        assert await db.migrate() == [m.version for m in MIGRATIONS if m.version >= 19]
        await RetentionStore(db).prune(RetentionConfig(executor_ids_days=30))
        return await ExecutorStore(db).gone("acme", "ledger", ["deleted-lately", "deleted-long-ago"])
    finally:
        db_module.MIGRATIONS = saved
        await db.close()


def test_ids_deleted_by_the_previous_release_are_seen_last_at_their_deletion(postgres: Postgres) -> None:
    gone = asyncio.run(_upgrade_with_an_id_deleted_by_the_previous_release(postgres.create_database("ids19")))
    assert gone == {"deleted-lately": True, "deleted-long-ago": False}


async def _an_id_whose_record_an_instance_of_the_previous_stop_deleted(url: str) -> tuple[dict[str, bool], int]:
    db = Database(url)
    await db.open()
    try:
        # This code's instance migrated the database (to 19) and runs beside the old one.
        lease, store, key, epoch = await _long_lived_executor_in_recovery(db, "old-instance")
        async with db.transaction() as conn:
            # Its recovery verified on an instance of the previous stop (schema 17, which the floor lets
            # run on 19): its record deleted and audited as that code does, its id not marked seen.
            cur = await conn.execute(
                """DELETE FROM executors WHERE org = 'acme' AND app = 'ledger' AND executor_id = %s
                   AND state = 'RECOVERING' AND epoch = %s""",
                (key.executor_id, epoch),
            )
            assert cur.rowcount == 1
            await conn.execute(
                """INSERT INTO audit_log (org, app, action, executor_id, peer_executor_id, actor, detail)
                   VALUES ('acme', 'ledger', 'executor.deleted', %s, 'peer-1', 'relay', '{}')""",
                (key.executor_id,),
            )
        pruned = await RetentionStore(db).prune(RetentionConfig(executor_ids_days=30))
        gone = await store.gone("acme", "ledger", [key.executor_id])
        await lease.stop()
        return gone, pruned.executor_ids
    finally:
        await db.close()


def test_an_id_whose_record_an_older_instance_deleted_after_the_upgrade_is_remembered(postgres: Postgres) -> None:
    """A rolling upgrade: migration 19 ran when this code's first instance started, and an instance of
    the previous stop, still running, deletes a record the way it always did (its id not marked seen).
    Migration 19 cannot see it (it ran before), so the next retention job forgot the id of an executor
    connected for longer than executorIdsDays as soon as its record went. Its deletion counts as its
    last sighting whoever deleted it."""
    gone, forgotten = asyncio.run(
        _an_id_whose_record_an_instance_of_the_previous_stop_deleted(postgres.create_database("ids-rolling"))
    )
    assert gone == {"long-lived": True}, "the id is remembered: its stranded work is the reconciler's"
    assert forgotten == 0


async def _sessions_waiting(conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def _ids_coming_back_as_retention_forgets_them(url: str) -> tuple[object, list[object], list[str]]:
    db = Database(url)
    await db.open()
    try:
        await db.migrate()
        await AppStore(db).sync_config(RelayConfig.model_validate(relay_yaml(free_port())))
        lease = Lease(db, "ids-back", 30)
        await lease.acquire()
        store = ExecutorStore(db)
        async with db.connection() as conn:  # not seen for 40 days; in the table, back-b first
            for name in ("back-b", "back-a"):
                await conn.execute(
                    """INSERT INTO executor_ids (org, app, executor_id, key_id, first_seen_at, last_seen_at)
                       VALUES ('acme', 'ledger', %s, 'key', now() - interval '50 days', now() - interval '40 days')""",
                    (name,),
                )

        def handshake_of(name: str) -> Handshake:
            info = ExecutorInfoReply(request_id="r", executor_id=name, application_version="v1")
            return Handshake(ExecutorKey("acme", "ledger", name), info, "ids-back", "key")

        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM executor_ids WHERE executor_id = 'back-b' FOR UPDATE")
                pruning = asyncio.create_task(RetentionStore(db).prune(RetentionConfig(executor_ids_days=30)))
                deadline = asyncio.get_running_loop().time() + 10
                while not pruning.done() and await _sessions_waiting(holder) < 1:  # done, or waiting
                    assert asyncio.get_running_loop().time() < deadline, "the round neither ended nor waited"
                    await asyncio.sleep(0.01)
                waiting = 0 if pruning.done() else 1
                # One batch, back-a first: its statement itself, which the combiner would write again
                # row by row had it failed (relay.store.executors), hiding the deadlock but for a second.
                batch = [handshake_of(n) for n in ("back-a", "back-b")]
                connecting = asyncio.gather(store._upsert_connected(batch), return_exceptions=True)
                while await _sessions_waiting(holder) < waiting + 1:
                    assert asyncio.get_running_loop().time() < deadline, "the batch never waited"
                    assert not connecting.done(), connecting
                    await asyncio.sleep(0.01)
            (pruned,) = await asyncio.gather(pruning, return_exceptions=True)
            results = await connecting
        async with db.connection() as conn:
            cur = await conn.execute("SELECT executor_id FROM executors ORDER BY executor_id")
            stored = [str(r["executor_id"]) for r in await cur.fetchall()]
        await lease.stop()
        return pruned, list(results), stored
    finally:
        await db.close()


def test_ids_coming_back_as_retention_forgets_them_are_connected_and_pruned_without_a_deadlock(
    postgres: Postgres,
) -> None:
    """Two executors not seen for executorIdsDays connect at once (one batch) as retention's round
    forgets their ids. The batch upserts the ids in its order, the round deleted them in the table's:
    each held one and waited for the other, and PostgreSQL failed one of them (the round, or the batch,
    written again one row at a time a second later). The round leaves an id another transaction
    holds for its next round now. Another session holds the second id meanwhile, so that both are
    under way when it lets go."""
    pruned, results, stored = asyncio.run(_ids_coming_back_as_retention_forgets_them(postgres.create_database("back")))
    assert not isinstance(pruned, BaseException), pruned
    assert not any(isinstance(r, BaseException) for r in results), results
    assert stored == ["back-a", "back-b"]
