"""Write-combining (relay.store.combiner) on real PostgreSQL: writes that arrive together share a
transaction, a bad row fails alone, and fencing still holds for every row of a batch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest
from psycopg import sql

from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import relay_yaml
from relay.config import RelayConfig
from relay.core.ids import ExecutorKey
from relay.core.lifecycle import ExecutorEvent, ExecutorState
from relay.core.peers import Peer
from relay.errors import ConnectionLost, DatabaseError, DatabaseUnreachable, Fenced
from relay.store.apps import AppStore
from relay.store.audit import AuditEntry, AuditStore
from relay.store.combiner import WriteCombiner
from relay.store.db import Database, patiently
from relay.store.executors import Connected, ExecutorStore, Handshake, IdentityTaken
from relay.store.instances import InstanceStore
from relay.store.lease import Lease
from relay.store.recoveries import RecoveryStore
from relay_protocol import ExecutorInfoReply

GROUP = 8


Instance = tuple[Database, Lease, ExecutorStore]


@asynccontextmanager
async def _instances(url: str, *names: str) -> AsyncIterator[list[Instance]]:
    """Relay instances on one database (the apps of relay_yaml configured), each holding its lease;
    one lane of combined writes each, so that what is queued together shares a transaction."""
    opened: list[Instance] = []
    try:
        for name in names:
            db = Database(url)
            await db.open()
            await db.migrate()
            db.writes = WriteCombiner(db, lanes=1)
            lease = Lease(db, name, 30)
            opened.append((db, lease, ExecutorStore(db)))
            await lease.acquire()
        await AppStore(opened[0][0]).sync_config(RelayConfig.model_validate(relay_yaml(free_port())))
        yield opened
    finally:
        for db, lease, _ in opened:
            await lease.stop()
            await db.close()


async def _connect(
    executors: ExecutorStore, instance: str, executor_id: str, *, lost: bool = True
) -> tuple[ExecutorKey, int]:
    """A HEALTHY executor held by ``instance``; then DISCONNECTED when ``lost``."""
    info = ExecutorInfoReply(
        request_id="r", executor_id=executor_id, application_version="v1", hostname="host", language="python"
    )
    key = ExecutorKey("acme", "ledger", executor_id)
    epoch = (await executors.connected(Handshake(key, info, instance, "key"))).epoch
    if lost:
        assert await executors.apply(key, ExecutorEvent.LOST, epoch=epoch, instance=instance)
    return key, epoch


async def _rows(db: Database) -> tuple[dict[str, str], int]:
    async with db.connection() as conn:
        states = await (await conn.execute("SELECT executor_id, state FROM executors")).fetchall()
        audit = await (await conn.execute("SELECT count(*) AS n FROM audit_log")).fetchone()
    assert audit is not None
    return {r["executor_id"]: r["state"] for r in states}, int(audit["n"])


async def _a_bad_row_fails_alone(url: str) -> None:
    async with _instances(url, "relay-1") as [(db, _, executors)]:
        store, audit = RecoveryStore(db, executors), AuditStore(db)
        deaths = [await _connect(executors, "relay-1", f"ex-{i}") for i in range(GROUP)]
        _, audit_before = await _rows(db)
        batches, writes = db.writes.batches, db.writes.writes
        # Queued together: GROUP declarations of death, and among them one audit entry that
        # PostgreSQL cannot store (a NUL in a text).
        results = await asyncio.gather(
            *(store.declare_dead(key, epoch, ExecutorEvent.GRACE_EXPIRED, "relay", f"d{i}")
              for i, (key, epoch) in enumerate(deaths[: GROUP // 2])),
            audit.record("acme", "ledger", AuditEntry("settings.updated", "relay\x00")),
            *(store.declare_dead(key, epoch, ExecutorEvent.GRACE_EXPIRED, "relay", f"d{i}")
              for i, (key, epoch) in enumerate(deaths[GROUP // 2 :], start=GROUP // 2)),
            return_exceptions=True,
        )  # fmt: skip
        bad = results.pop(GROUP // 2)
        assert isinstance(bad, DatabaseError) and isinstance(bad.__cause__, psycopg.DataError), bad
        assert results == [True] * GROUP
        states, audit_after = await _rows(db)
        assert states == {f"ex-{i}": "DEAD" for i in range(GROUP)}
        assert audit_after == audit_before + GROUP  # one executor.dead each; the bad entry is not there
        # All of them in one transaction (the one that failed was rolled back and not counted).
        assert (db.writes.batches - batches, db.writes.writes - writes) == (1, GROUP)
        # Each write's own guard still decides: declared again, nothing changes and no entry is added.
        again = await asyncio.gather(
            *(store.declare_dead(key, epoch + 1, ExecutorEvent.GRACE_EXPIRED, "relay", f"e{i}")
              for i, (key, epoch) in enumerate(deaths)),
        )  # fmt: skip
        assert again == [False] * GROUP
        assert await _rows(db) == (states, audit_after)


def test_a_bad_row_in_a_combined_write_fails_alone_and_the_others_commit(postgres: Postgres) -> None:
    asyncio.run(_a_bad_row_fails_alone(postgres.create_database("combine_bad")))


async def _declared_now_only_once(url: str) -> None:
    async with _instances(url, "relay-1") as [(db, _, executors)]:
        store = RecoveryStore(db, executors)
        (key, epoch), (other, other_epoch) = [await _connect(executors, "relay-1", f"ex-{i}") for i in range(2)]
        dead = ExecutorEvent.GRACE_EXPIRED
        # The grace period declares the first one; the repair sweep, holding a row read before,
        # then finds it DEAD: declared, but not by the sweep (which must neither warn nor act).
        assert await store.declare_dead(key, epoch, dead, "relay", "grace")
        assert not await store.declare_dead_now(key, epoch, dead, "relay", "repair")
        assert await store.declare_dead(key, epoch, dead, "relay", "grace")  # a re-run step finds it done
        # One the grace period did not declare: the sweep's declaration is its own.
        assert await store.declare_dead_now(other, other_epoch, dead, "relay", "repair")
        # Another epoch's declaration is no declaration at all.
        assert not await store.declare_dead_now(other, other_epoch + 1, dead, "relay", "late")
        assert (await _rows(db))[0] == {"ex-0": "DEAD", "ex-1": "DEAD"}
        async with db.connection() as conn:
            cur = await conn.execute("SELECT dedupe_key FROM audit_log WHERE action = 'executor.dead' ORDER BY id")
            assert [r["dedupe_key"] for r in await cur.fetchall()] == ["grace", "repair"]


def test_a_declaration_of_death_tells_whether_it_was_this_one(postgres: Postgres) -> None:
    asyncio.run(_declared_now_only_once(postgres.create_database("combine_declared")))


async def _a_stale_instances_batch_changes_nothing(url: str) -> None:
    async with _instances(url, "relay-1", "relay-2") as [(db1, _, ex1), (db2, _, ex2)]:
        stale = [await _connect(ex1, "relay-1", f"a-{i}") for i in range(GROUP)]
        live = [await _connect(ex2, "relay-2", f"b-{i}") for i in range(GROUP)]
        async with db1.connection() as conn:  # relay-1's lease is taken over
            await conn.execute("UPDATE relay_instances SET lease_epoch = lease_epoch + 1 WHERE instance_id = 'relay-1'")
        s1, s2 = RecoveryStore(db1, ex1), RecoveryStore(db2, ex2)
        committed = db1.writes.writes
        dead = ExecutorEvent.GRACE_EXPIRED
        results = await asyncio.gather(
            *(s1.declare_dead(key, epoch, dead, "relay", f"s{i}") for i, (key, epoch) in enumerate(stale)),
            *(s2.declare_dead(key, epoch, dead, "relay", f"l{i}") for i, (key, epoch) in enumerate(live)),
            return_exceptions=True,
        )
        assert all(isinstance(r, Fenced) for r in results[:GROUP]), results[:GROUP]
        assert results[GROUP:] == [True] * GROUP
        states, _ = await _rows(db1)
        stale_states = {k: v for k, v in states.items() if k.startswith("a-")}
        assert stale_states == {f"a-{i}": "DISCONNECTED" for i in range(GROUP)}
        assert {k: v for k, v in states.items() if k.startswith("b-")} == {f"b-{i}": "DEAD" for i in range(GROUP)}
        assert db1.writes.writes == committed


def test_a_stale_instances_combined_writes_take_no_effect(postgres: Postgres) -> None:
    asyncio.run(_a_stale_instances_batch_changes_nothing(postgres.create_database("combine_fence")))


async def _renewal_and_adoption_beside_a_write(url: str) -> None:
    """A fenced transaction in flight holds up an adoption of its instance, never its renewal."""
    held = asyncio.Event()
    release = asyncio.Event()

    async def long_write(conn: Any) -> None:
        await conn.execute("SELECT 1")
        held.set()
        await release.wait()

    async with _instances(url, "relay-1", "relay-2") as [(db1, lease1, _), (db2, _, ex2)]:
        try:
            writing = asyncio.create_task(db1.writes.run(long_write))
            await held.wait()
            started = time.monotonic()
            assert await asyncio.wait_for(lease1.renew(), 5)
            assert time.monotonic() - started < 1.0
            async with db2.connection() as conn:  # relay-1's lease runs out while its write is open
                await conn.execute(
                    "UPDATE relay_instances SET lease_expires_at = now() - interval '1 second' "
                    "WHERE instance_id = 'relay-1'"
                )
            assert lease1.epoch is not None
            adopting = asyncio.create_task(InstanceStore(db2, ex2).adopt("relay-2", "relay-1", lease1.epoch))
            await asyncio.sleep(1.0)
            assert not adopting.done()  # waits for relay-1's write to commit
            release.set()
            await writing
            adoption = await asyncio.wait_for(adopting, 10)
            assert adoption is not None
            with pytest.raises(Fenced):
                await db1.writes.run(long_write)
        finally:
            release.set()


def test_a_write_in_flight_holds_up_an_adoption_but_not_a_renewal(postgres: Postgres) -> None:
    asyncio.run(_renewal_and_adoption_beside_a_write(postgres.create_database("combine_lock")))


async def _shared_peer_reads(url: str) -> None:
    async with _instances(url, "relay-1") as [(_, _, executors)]:

        async def join(executor_id: str) -> None:
            await _connect(executors, "relay-1", executor_id, lost=False)

        await join("p-1")
        # Concurrent readers that accept an older list share one read.
        lists = await asyncio.gather(*(executors.healthy_peers("acme", "ledger", 5.0) for _ in range(20)))
        assert lists[0] == (Peer("p-1", "v1"),) and all(same is lists[0] for same in lists)  # one tuple for all
        await join("p-2")
        # Within max_age, the shared read is still the answer: the newcomer is not seen yet...
        assert await executors.healthy_peers("acme", "ledger", 5.0) == (Peer("p-1", "v1"),)
        # ...a fresh read sees it, and becomes the read the next callers share.
        assert await executors.healthy_peers("acme", "ledger") == (Peer("p-1", "v1"), Peer("p-2", "v1"))
        assert await executors.healthy_peers("acme", "ledger", 5.0) == (Peer("p-1", "v1"), Peer("p-2", "v1"))
        await join("p-3")
        await asyncio.sleep(0.3)
        # An older read than max_age is not used.
        assert len(await executors.healthy_peers("acme", "ledger", 0.2)) == 3


def test_a_group_of_deaths_shares_its_reads_of_the_healthy_peers(postgres: Postgres) -> None:
    asyncio.run(_shared_peer_reads(postgres.create_database("combine_peers")))


async def _settled(url: str) -> None:
    async with _instances(url, "relay-1") as [(db, _, executors)]:
        key, epoch = await _connect(executors, "relay-1", "ex-1", lost=False)
        async with await psycopg.AsyncConnection.connect(url) as blocker:
            await blocker.execute("SELECT 1 FROM executors FOR UPDATE")
            write = asyncio.create_task(executors.apply(key, ExecutorEvent.LOST, epoch=epoch, instance="relay-1"))
            await asyncio.sleep(0.3)  # its transaction waits for the row
            write.cancel()  # its caller gone (a handler that uvicorn cancels): the transaction goes on
            started = time.monotonic()
            await db.writes.settled(0.5)
            assert 0.5 <= time.monotonic() - started < 1.5  # bounded: that lane still waits
            await blocker.rollback()
        started = time.monotonic()
        await db.writes.settled(10.0)  # the lane commits the write and ends
        assert time.monotonic() - started < 2.0
        assert (await _rows(db))[0] == {"ex-1": "DISCONNECTED"}


def test_a_stop_awaits_the_combined_writes_in_flight_for_a_bounded_time(postgres: Postgres) -> None:
    """Before a stop records its executors lost, it lets the combined writes in flight finish (they
    lock the same rows): even a write whose caller is gone, and for at most the time it is given."""
    asyncio.run(_settled(postgres.create_database("settled")))


async def _batched_settled(url: str) -> None:
    async with _instances(url, "relay-1") as [(db, _, executors)]:
        key, epoch = await _connect(executors, "relay-1", "ex-1", lost=False)
        async with await psycopg.AsyncConnection.connect(url) as blocker:
            await blocker.execute("SELECT 1 FROM executors FOR UPDATE")
            write = asyncio.create_task(executors.lost(key, epoch, "relay-1"))
            await asyncio.sleep(0.3)  # its batch's statement waits for the row
            write.cancel()  # its caller gone (a handler that uvicorn cancels): the batch goes on
            started = time.monotonic()
            await executors.settled(0.5)
            assert 0.5 <= time.monotonic() - started < 1.5  # bounded: the batch still waits
            await blocker.rollback()
        started = time.monotonic()
        await executors.settled(10.0)  # the batch commits and its writer ends
        assert time.monotonic() - started < 2.0
        assert (await _rows(db))[0] == {"ex-1": "DISCONNECTED"}


def test_a_stop_awaits_the_batched_disconnections_in_flight_for_a_bounded_time(postgres: Postgres) -> None:
    """Disconnections are written in batches of their own (``ExecutorStore.lost``), not through the
    combined writes: a stop, before it records its executors lost, lets those in flight finish too
    (they lock the same rows), bounded as the combined writes' wait is."""
    asyncio.run(_batched_settled(postgres.create_database("batched_settled")))


async def _disconnections_together(url: str) -> None:
    async with _instances(url, "relay-1", "relay-2") as [(db1, _, ex1), (db2, _, ex2)]:
        mine = [await _connect(ex1, "relay-1", f"m-{i}", lost=False) for i in range(GROUP)]
        stale = [await _connect(ex2, "relay-2", f"s-{i}", lost=False) for i in range(GROUP)]
        # Together, in one statement, each row's guard its own: the epoch of a socket that is gone
        # (the executor reconnected since) changes nothing.
        (old_key, old_epoch) = mine[0]
        results = await asyncio.gather(*(ex1.lost(key, epoch, "relay-1") for key, epoch in mine[1:]),
                                        ex1.lost(old_key, old_epoch - 1, "relay-1"))  # fmt: skip
        assert results == [True] * (GROUP - 1) + [False]
        assert ex1.lost_batches <= 2  # the first alone, the rest queued behind it together
        states, _ = await _rows(db1)
        assert {e: s for e, s in states.items() if e.startswith("m-")} == {
            f"m-{i}": "HEALTHY" if i == 0 else "DISCONNECTED" for i in range(GROUP)
        }

        # An executor that reconnects while its batch waits for its row: the reconnection commits
        # first (here a new epoch, as the upsert writes it), and the batch's guard skips that row.
        async with db1.connection() as conn:
            await conn.execute("UPDATE executors SET state = 'HEALTHY' WHERE executor_id LIKE 'm-%'")
        racer = await psycopg.AsyncConnection.connect(url)
        try:
            await racer.execute("UPDATE executors SET epoch = epoch + 1000 WHERE executor_id = 'm-3'")
            batch = asyncio.gather(*(ex1.lost(key, epoch, "relay-1") for key, epoch in mine))
            async with db1.connection() as conn:
                for _ in range(200):  # until the batch waits for the racer's row lock
                    cur = await conn.execute(
                        "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE '%%UPDATE executors e SET state%%'"
                    )
                    if (row := await cur.fetchone()) and row["n"]:
                        break
                    await asyncio.sleep(0.02)
                else:
                    raise AssertionError("the batch never waited for the racer's row")
            await racer.commit()
            assert await batch == [i != 3 for i in range(GROUP)]
        finally:
            await racer.close()
        assert (await _rows(db1))[0]["m-3"] == "HEALTHY"

        # A bad row (a NUL in an id) fails the statement: each row is then written alone, and only
        # the bad one fails.
        async with db1.connection() as conn:
            await conn.execute("UPDATE executors SET state = 'HEALTHY' WHERE executor_id LIKE 'm-%'")
        nul = ExecutorKey("acme", "ledger", "n-\x00")
        results = await asyncio.gather(
            *(ex1.lost(key, epoch, "relay-1") for key, epoch in mine[4:]), ex1.lost(nul, 1, "relay-1"),
            *(ex1.lost(key, epoch, "relay-1") for key, epoch in mine[1:3]),
            return_exceptions=True,
        )  # fmt: skip
        bad = results.pop(GROUP - 4)
        assert isinstance(bad, DatabaseError) and isinstance(bad.__cause__, psycopg.DataError), bad
        assert results == [True] * (GROUP - 2)

        # A stale instance's batch changes nothing, and each of its callers is told.
        async with db2.connection() as conn:
            await conn.execute("UPDATE relay_instances SET lease_epoch = lease_epoch + 1 WHERE instance_id = 'relay-2'")
        results = await asyncio.gather(*(ex2.lost(key, epoch, "relay-2") for key, epoch in stale),
                                       return_exceptions=True)  # fmt: skip
        assert all(isinstance(r, Fenced) for r in results), results
        states, _ = await _rows(db2)
        assert {e: s for e, s in states.items() if e.startswith("s-")} == {f"s-{i}": "HEALTHY" for i in range(GROUP)}


def test_disconnections_recorded_together_keep_each_rows_guard_and_fencing(postgres: Postgres) -> None:
    asyncio.run(_disconnections_together(postgres.create_database("combine_lost")))


async def _sessions_waiting(conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def _reconnections_during_an_adoption(url: str) -> tuple[object, list[object]]:
    async with _instances(url, "relay-1", "relay-2") as [(_, lease1, ex1), (db2, _, ex2)]:
        for executor_id in ("m-b", "m-a"):  # in the table, m-b first
            await _connect(ex1, "relay-1", executor_id, lost=False)
        async with db2.connection() as conn:  # relay-1 crashed: its rows still say HEALTHY, its lease ran out
            await conn.execute(
                "UPDATE relay_instances SET lease_expires_at = now() - interval '1 second' "
                "WHERE instance_id = 'relay-1'"
            )
        assert lease1.epoch is not None
        info = {n: ExecutorInfoReply(request_id="r", executor_id=n, application_version="v1") for n in ("m-a", "m-b")}
        # Its executors connect again to relay-2, m-a first: one batch (its statement itself, which the
        # combiner would write again row by row had it failed, hiding the deadlock but for a second).
        batch = [Handshake(ExecutorKey("acme", "ledger", n), info[n], "relay-2", "key") for n in ("m-a", "m-b")]
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM executors WHERE executor_id = 'm-b' FOR UPDATE")
                adopting = asyncio.create_task(InstanceStore(db2, ex2).adopt("relay-2", "relay-1", lease1.epoch))
                deadline = time.monotonic() + 10
                while await _sessions_waiting(holder) < 1:
                    assert time.monotonic() < deadline and not adopting.done(), "the adoption never waited"
                    await asyncio.sleep(0.01)
                connecting = asyncio.gather(ex2._upsert_connected(batch), return_exceptions=True)
                while await _sessions_waiting(holder) < 2:
                    assert time.monotonic() < deadline and not connecting.done(), "the batch never waited"
                    await asyncio.sleep(0.01)
            (adopted,) = await asyncio.gather(adopting, return_exceptions=True)
            return adopted, list(await connecting)


def test_executors_connecting_again_while_their_crashed_instance_is_adopted_meet_no_deadlock(
    postgres: Postgres,
) -> None:
    """An instance crashed; its executors connect again to another (one batch of handshakes) while
    that one adopts the crashed instance. The adoption locked the executors' rows in the table's
    order, the batch in the order the handshakes came: each held one and waited for the other, and
    PostgreSQL failed one of them (the adoption, or the batch, written again row by row a second
    later). Both lock by (org, app, executor id) now: one waits for the other. Another session holds
    the first row in the table meanwhile, so that both are under way when it lets go."""
    adopted, results = asyncio.run(_reconnections_during_an_adoption(postgres.create_database("adopt_batch")))
    assert adopted is not None and not isinstance(adopted, BaseException), adopted
    assert not any(isinstance(r, BaseException) for r in results), results
    (outcome,) = results
    assert isinstance(outcome, tuple)
    connected, gone = outcome
    assert sorted(k.executor_id for k in connected) == ["m-a", "m-b"] and not gone


async def _disconnections_and_reconnections_at_once(url: str, whole_instance: bool) -> tuple[object, object]:
    async with _instances(url, "relay-1", "relay-2") as [(_, _, ex1), (_, _, ex2)]:
        epochs = dict([await _connect(ex1, "relay-1", n, lost=False) for n in ("m-b", "m-a")])  # m-b first
        info = {n: ExecutorInfoReply(request_id="r", executor_id=n, application_version="v1") for n in ("m-a", "m-b")}
        keys = [ExecutorKey("acme", "ledger", n) for n in ("m-b", "m-a")]
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM executors WHERE executor_id = 'm-a' FOR UPDATE")
                # The executors connect again to relay-2 (one batch of handshakes, its statement
                # itself: the writer would write it again row by row had it failed) before relay-1
                # writes their old sockets' disconnections (one batch, m-b first, as the join may
                # take them), or all of its executors' at a stop.
                batch = [Handshake(k, info[k.executor_id], "relay-2", "key") for k in keys]
                connecting = asyncio.gather(ex2._upsert_connected(batch), return_exceptions=True)
                deadline = time.monotonic() + 10
                while await _sessions_waiting(holder) < 1:
                    assert time.monotonic() < deadline and not connecting.done(), "the handshakes never waited"
                    await asyncio.sleep(0.01)
                lost = [(k, epochs[k], "relay-1") for k in keys]
                losing = asyncio.gather(ex1.instance_lost("relay-1") if whole_instance else ex1._update_lost(lost),
                                        return_exceptions=True)  # fmt: skip
                while await _sessions_waiting(holder) < 2:
                    assert time.monotonic() < deadline and not losing.done(), "the disconnections never waited"
                    await asyncio.sleep(0.01)
            ((connected,), (disconnected,)) = await connecting, await losing
            return connected, disconnected


@pytest.mark.parametrize("whole_instance", [False, True], ids=["batch", "instance_lost"])
def test_executors_disconnecting_and_connecting_again_at_once_meet_no_deadlock(
    postgres: Postgres, caplog: pytest.LogCaptureFixture, whole_instance: bool
) -> None:
    """A network blip: executors' old sockets close and they connect again to another instance at
    once, one batch of each (or the old instance stops: one statement for all of its executors).
    The disconnections locked the rows in the join's (or the table's) order, the handshakes by key:
    each held a row the other waited for, and PostgreSQL failed one (the batch, written again row by
    row a second later and counted as an error; or the stop's statement, run again a second later).
    All of them lock by (org, app, executor id) now: one waits for the other. Another session holds
    the first key's row meanwhile, so that both are under way when it lets go, the handshakes first."""
    caplog.set_level(logging.INFO, "relay.store")
    url = postgres.create_database(f"blip_{int(whole_instance)}")
    connected, disconnected = asyncio.run(_disconnections_and_reconnections_at_once(url, whole_instance))
    assert not isinstance(connected, BaseException) and not isinstance(disconnected, BaseException), (
        connected,
        disconnected,
    )
    assert sorted(k.executor_id for k in connected[0]) == ["m-a", "m-b"]  # type: ignore[index]
    assert disconnected == (0 if whole_instance else set())  # the executors had moved: nothing to write
    assert "deadlock" not in caplog.text  # instance_lost runs again after one, and says so


async def _new_apps_registered_by_a_sync_and_a_batch(url: str) -> tuple[object, list[object], set[tuple[str, str]]]:
    async with _instances(url, "relay-1", "relay-2") as [(db1, _, _), (_, _, ex2)]:
        # A new relay.yaml lists an app of each org, globex first; relay-2's executors of both apps
        # connect as relay-1 starts with it (one batch: registered by their connection, in key order).
        rolled_out = relay_yaml(free_port())
        rolled_out["orgs"].reverse()
        for org, app in (("globex", "x-new"), ("acme", "y-new")):
            next(o for o in rolled_out["orgs"] if o["name"] == org)["apps"].append({"name": app})
        keys = [ExecutorKey("acme", "y-new", "e-y"), ExecutorKey("globex", "x-new", "e-x")]
        batch = [
            Handshake(k, ExecutorInfoReply(request_id="r", executor_id=k.executor_id, application_version="v1"),
                      "relay-2", "key", register_app=True)
            for k in keys
        ]  # fmt: skip
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as holder:
            async with holder.transaction():
                # Holds the sync at org acme's row (another session writing it), whatever it wrote before.
                await holder.execute("UPDATE orgs SET created_at = created_at WHERE name = 'acme'")
                syncing = asyncio.create_task(AppStore(db1).sync_config(RelayConfig.model_validate(rolled_out)))
                deadline = time.monotonic() + 10
                while await _sessions_waiting(holder) < 1:
                    assert time.monotonic() < deadline and not syncing.done(), "the sync never waited"
                    await asyncio.sleep(0.01)
                # Its statement itself: the combiner would write a failed batch again row by row.
                connecting = asyncio.gather(ex2._upsert_connected(batch), return_exceptions=True)
                while not connecting.done() and await _sessions_waiting(holder) < 2:
                    assert time.monotonic() < deadline, "the batch neither ended nor waited"
                    await asyncio.sleep(0.01)
            (synced,) = await asyncio.gather(syncing, return_exceptions=True)
            results = await connecting
        async with db1.connection() as conn:
            cur = await conn.execute("SELECT org, name FROM apps WHERE from_config AND name LIKE '%%-new'")
            listed = {(str(r["org"]), str(r["name"])) for r in await cur.fetchall()}
        return synced, list(results), listed


def test_new_apps_registered_by_a_relay_yaml_sync_and_a_batch_of_handshakes_at_once_meet_no_deadlock(
    postgres: Postgres,
) -> None:
    """An instance starts with a relay.yaml that lists new apps while their executors, connecting to
    another instance, register them (autoRegisterApps). A batch of handshakes registers its missing
    apps in its transaction, in key order; the sync wrote them in the file's order: each had inserted
    an app the other then inserted too, and PostgreSQL failed one of them ("deadlock detected": the
    instance's start, or the batch, written again row by row a second later). The sync writes them in
    key order too now."""
    synced, results, listed = asyncio.run(_new_apps_registered_by_a_sync_and_a_batch(postgres.create_database("sync")))
    assert not isinstance(synced, BaseException), repr(synced)
    assert not any(isinstance(r, BaseException) for r in results), results
    ((connected, gone),) = results
    assert sorted(k.executor_id for k in connected) == ["e-x", "e-y"] and gone == set()
    assert listed == {("acme", "y-new"), ("globex", "x-new")}


async def _apps_registered_by_handshakes_some_refused(url: str) -> tuple[list[dict[str, Any]], object, set[str]]:
    async with _instances(url, "relay-1") as [(db, _, ex)]:
        async with db.connection() as conn:
            # Ids an earlier app of each name bound to its key (kept after the app's deletion).
            await conn.execute(
                """INSERT INTO executor_ids (org, app, executor_id, key_id)
                   VALUES ('acme', 'again', 'a-old', 'old-key'), ('acme', 'refused', 'r-old', 'old-key')"""
            )

        def handshake(app: str, executor_id: str, port: int) -> Handshake:
            info = ExecutorInfoReply(request_id="r", executor_id=executor_id, application_version="v1")
            key = ExecutorKey("acme", app, executor_id)
            return Handshake(key, info, "relay-1", "new-key", register_app=True, client=f"10.0.0.1:{port}")

        # One batch: the app's first executor in key order is refused, the second accepted.
        connected, gone = await ex._upsert_connected([handshake("again", "b-new", 2), handshake("again", "a-old", 1)])
        assert sorted(k.executor_id for k in connected) == ["b-new"] and gone == set()
        # An app whose only handshake is refused.
        (refused,) = await asyncio.gather(ex.connected(handshake("refused", "r-old", 3)), return_exceptions=True)
        entries = await AuditStore(db).list_entries("acme", None, "b-new", None, 10, action="application.create")
        async with db.connection() as conn:
            cur = await conn.execute("SELECT name FROM apps WHERE org = 'acme' AND name IN ('again', 'refused')")
            apps = {str(r["name"]) for r in await cur.fetchall()}
        return entries, refused, apps


def test_an_app_registered_by_a_batch_of_handshakes_is_audited_as_an_accepted_executors_doing(
    postgres: Postgres,
) -> None:
    """A batch of handshakes registers an app: its entry names the first executor of it in key order
    that the batch accepts, in its executorId column too (``?executorId=`` finds it); it named the first
    in key order even if the batch refused it (its id bound to an earlier app of that name), with the
    column empty. A handshake refused so registered the app even if no other was accepted: it
    registers nothing now, and is refused as IdentityTaken."""
    entries, refused, apps = asyncio.run(_apps_registered_by_handshakes_some_refused(postgres.create_database("reg")))
    assert [(e["app"], e["actor"], e["executor_id"]) for e in entries] == [
        ("again", "executor:b-new@10.0.0.1:2", "b-new")
    ], entries
    assert entries[0]["detail"] == {"result": "success", "executorId": "b-new", "address": "10.0.0.1:2"}
    assert isinstance(refused, IdentityTaken), repr(refused)
    assert apps == {"again"}


@asynccontextmanager
async def _one_connection(url: str) -> AsyncIterator[tuple[Database, Lease, ExecutorStore]]:
    """A store on a pool of one connection (a test that holds it leaves none for the writes), the apps
    of relay.yaml synced and the lease held."""
    db = Database(url, min_size=1, max_size=1)
    await db.open()
    try:
        await db.migrate()
        await AppStore(db).sync_config(RelayConfig.model_validate(relay_yaml(free_port())))
        lease = Lease(db, "relay-1", 30)
        await lease.acquire()
        yield db, lease, ExecutorStore(db)
    finally:
        await db.close()


async def _handshakes_that_fail_together_or_alone(url: str) -> None:
    async with _one_connection(url) as (db, lease, executors):  # its one connection held: none for the handshakes

        def handshake(executor_id: str, hostname: str = "host") -> Handshake:
            info = ExecutorInfoReply(
                request_id="r", executor_id=executor_id, application_version="v1", hostname=hostname
            )
            return Handshake(ExecutorKey("acme", "ledger", executor_id), info, "relay-1", "key")

        async def together(*ids: str, hostname: str = "host") -> list[object]:
            # Queued before the writer's first round: one batch.
            return await asyncio.gather(*(executors.connected(handshake(i, hostname)) for i in ids),
                                        return_exceptions=True)  # fmt: skip

        def requests() -> int:
            return db.pool.get_stats().get("requests_num", 0)

        # A statement of the batch's own fails (a NUL PostgreSQL cannot store): written again row by
        # row, the others are recorded and only the bad row is refused.
        both = await asyncio.gather(together("a", "c"), together("b", hostname="bad\x00"))
        (a, c), (b,) = both
        assert isinstance(a, Connected) and isinstance(c, Connected), both
        assert isinstance(b, DatabaseError) and not isinstance(b, DatabaseUnreachable), repr(b)
        assert isinstance(b.__cause__, psycopg.DataError), repr(b.__cause__)

        # No connection within the wait: the database not reached. The batch is refused together, at
        # one request of the pool, not written again row by row (each waiting in turn).
        async with db.connection():
            asked = requests()
            results = await patiently(together("d", "e", "f"), 0.05)
            assert all(isinstance(r, DatabaseUnreachable) for r in results), results
            assert requests() - asked == 1

        # The connection lost under the batch's statement (the server ended it), and the database refusing
        # every connection after it (gone): run once more, which finds no connection, then refused together.
        async with db.connection() as conn:
            pid, name = conn.info.backend_pid, sql.Identifier(conn.info.dbname)
        # (From another database: PostgreSQL does not take the current one's connections away.)
        async with await psycopg.AsyncConnection.connect(url, dbname="postgres", autocommit=True) as other:
            await other.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(name))
            await other.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
            asked = requests()
            results = await together("g", "h", "i")
            await other.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(name))
        assert all(type(r) is DatabaseUnreachable for r in results), results  # the second run's: no connection
        assert requests() - asked == 2
        await lease.stop()


def test_a_batch_of_handshakes_is_refused_together_when_the_database_is_not_reached_else_written_row_by_row(
    postgres: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database not reached (no connection of the pool in time, or the connection lost under the
    statement and none to be had after it: :class:`DatabaseUnreachable`, made where the error is, in
    relay.store.db): every row of a batch of handshakes would fail the same way, each after the pool's
    10 s in turn, so the batch is refused at once. A statement failing for a row of its own: the others
    are recorded, row by row."""
    monkeypatch.setattr("relay.store.db.LOST_AGAIN_WAIT_SECS", 0.25)  # the second run's wait, shortened
    asyncio.run(_handshakes_that_fail_together_or_alone(postgres.create_database("handshakes_refused")))


async def _combined_writes_beside_a_batch_locked_by_key(url: str) -> tuple[object, list[object], object]:
    async with _instances(url, "relay-1") as [(_, _, executors)]:
        epochs = dict([await _connect(executors, "relay-1", n, lost=False) for n in ("m-a", "m-b")])
        keys = sorted(epochs, key=lambda k: k.executor_id)  # m-a first, in key order
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM executors WHERE executor_id = 'm-a' FOR UPDATE")
                # A batch of disconnections (its statement itself, which the writer would write again
                # row by row had it failed) waits for m-a, the first key, holding nothing.
                batch = [(k, epochs[k], "relay-1") for k in keys]
                losing = asyncio.gather(executors._update_lost(batch), return_exceptions=True)
                deadline = time.monotonic() + 10
                while await _sessions_waiting(holder) < 1:
                    assert time.monotonic() < deadline and not losing.done(), "the batch never waited"
                    await asyncio.sleep(0.01)
                # Two combined writes queued the other way round, m-b first: one transaction. In the
                # order queued it locked m-b, then waited for m-a behind the batch, which then waited
                # for m-b: a deadlock, and PostgreSQL failed one of them.
                combined = asyncio.gather(
                    *(
                        executors.apply(k, ExecutorEvent.LOST, epoch=epochs[k], instance="relay-1")
                        for k in reversed(keys)
                    ),
                    return_exceptions=True,
                )
                while await _sessions_waiting(holder) < 2:
                    assert time.monotonic() < deadline and not combined.done(), "the combined writes never waited"
                    await asyncio.sleep(0.01)
            ((lost,),) = [await losing]
            return lost, list(await combined), {(k, epochs[k]) for k in keys}


def test_combined_writes_queued_out_of_key_order_meet_no_deadlock_with_a_batch_locked_by_key(
    postgres: Postgres,
) -> None:
    """The writes a transaction of the combiner carries lock their executors' rows in key order
    (_LOCK_ORDER), as the batches of handshakes, of disconnections, a stop and an adoption do, not in
    the order they were queued: one waits for the other. Another session holds the first key's row
    meanwhile, so that both are under way, the batch first, when it lets go."""
    url = postgres.create_database("combine_order")
    lost, combined, both = asyncio.run(_combined_writes_beside_a_batch_locked_by_key(url))
    assert not isinstance(lost, BaseException), repr(lost)
    assert not any(isinstance(r, BaseException) for r in combined), combined
    assert lost == both and combined == [False, False]  # the batch, first, recorded both: nothing left to write


async def _a_deletion_combined_beside_a_batch_of_handshakes(url: str) -> tuple[list[object], list[object]]:
    async with _instances(url, "relay-1") as [(_, _, executors)]:
        a, a_epoch = await _connect(executors, "relay-1", "m-a", lost=False)
        b, b_epoch = await _connect(executors, "relay-1", "m-b", lost=False)
        c, c_epoch = await _connect(executors, "relay-1", "m-c")
        assert await executors.apply(c, ExecutorEvent.DECLARED_DEAD, epoch=c_epoch)
        again = [
            Handshake(k, ExecutorInfoReply(request_id="r", executor_id=k.executor_id, application_version="v1"),
                      "relay-1", "key")
            for k in (a, c)
        ]  # fmt: skip
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM executors WHERE executor_id = 'm-b' FOR UPDATE")
                # One transaction, in key order: m-a's record, m-b's (held: it waits there), then m-c's
                # deletion, which updates m-c's id row before its record (as a handshake writes them).
                combined = asyncio.gather(
                    executors.apply(c, ExecutorEvent.NOTHING_PENDING, epoch=c_epoch),
                    executors.apply(a, ExecutorEvent.LOST, epoch=a_epoch, instance="relay-1"),
                    executors.apply(b, ExecutorEvent.LOST, epoch=b_epoch, instance="relay-1"),
                    return_exceptions=True,
                )
                deadline = time.monotonic() + 10
                while await _sessions_waiting(holder) < 1:
                    assert time.monotonic() < deadline and not combined.done(), "the combined writes never waited"
                    await asyncio.sleep(0.01)
                # m-a and m-c connect again: the batch writes both ids, then waits for m-a's record. The
                # combined writes, let go, then wanted m-c's id row: a deadlock, PostgreSQL failed one.
                connecting = asyncio.gather(executors._upsert_connected(again), return_exceptions=True)
                while await _sessions_waiting(holder) < 2:
                    assert time.monotonic() < deadline and not connecting.done(), "the handshakes never waited"
                    await asyncio.sleep(0.01)
            return list(await combined), list(await connecting)


def test_a_deletion_combined_with_other_executors_writes_meets_no_deadlock_with_a_batch_of_handshakes(
    postgres: Postgres,
) -> None:
    """A write deleting a record (a dead executor with nothing pending, a recovery verified) updates
    its remembered id before the record, as a handshake writes them; a batch of handshakes writes all
    its ids, then all its records. In a combined transaction after another executor's write, in key
    order, it held that record while it waited for an id such a batch held, the batch waiting for the
    record: "deadlock detected", one failed. A combined transaction of several executors locks their
    ids first now, in key order, as the batch does. Another session holds m-b's record meanwhile, so
    that both are under way, the combined writes first, when it lets go."""
    combined, connecting = asyncio.run(
        _a_deletion_combined_beside_a_batch_of_handshakes(postgres.create_database("ids_order"))
    )
    assert combined == [True, True, True], combined
    (written,) = connecting
    assert not isinstance(written, BaseException), repr(written)  # the batch that PostgreSQL failed
    connected, gone = written
    assert {k.executor_id: r.previous_state for k, r in connected.items()} == {  # type: ignore[union-attr]
        "m-a": ExecutorState.DISCONNECTED,  # the combined writes, first, recorded its disconnection
        "m-c": None,  # and deleted m-c's record: a new one
    } and gone == set()


async def _disconnections_that_fail_together(url: str) -> tuple[list[object], int, list[object]]:
    async with _one_connection(url) as (db, lease, executors):  # its one connection held: none for the disconnections
        held = [await _connect(executors, "relay-1", f"d-{i}", lost=False) for i in range(GROUP)]

        async def losing() -> list[object]:  # queued before the writer's first round: one batch
            return await asyncio.gather(*(executors.lost(k, e, "relay-1") for k, e in held), return_exceptions=True)

        async with db.connection():
            asked = db.pool.get_stats().get("requests_num", 0)
            refused = await patiently(losing(), 0.05)
            requests = db.pool.get_stats().get("requests_num", 0) - asked
        # Nothing lost: each row is still HEALTHY, held by this instance (its socket check records it
        # once the database answers), and is recorded then.
        recorded = await losing()
        await lease.stop()
        return refused, requests, recorded


def test_a_batch_of_disconnections_is_refused_together_when_the_database_is_not_reached(postgres: Postgres) -> None:
    """The database not reached (no connection of the pool in time): a batch of disconnections was
    written again row by row (combined), each write waiting for the pool in turn (the pool's 10 s
    each, in an outage). It is refused together now, at one request of the pool, as a batch of
    handshakes is; each caller keeps its row for the socket check, which records it later."""
    refused, requests, recorded = asyncio.run(_disconnections_that_fail_together(postgres.create_database("lost_out")))
    assert all(isinstance(r, DatabaseUnreachable) for r in refused), refused
    assert requests == 1
    assert recorded == [True] * GROUP


async def _a_connection_lost_under_a_combined_write(url: str) -> tuple[object, object]:
    async with _instances(url, "relay-1") as [(_, lease, executors)]:
        a, a_epoch = await _connect(executors, "relay-1", "m-a", lost=False)
        b, b_epoch = await _connect(executors, "relay-1", "m-b", lost=False)
        assert lease._conn is not None
        kept = lease._conn.info.backend_pid  # the lease's own connection: not the pool's
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM executors WHERE executor_id = 'm-a' FOR UPDATE")
                losing = asyncio.gather(
                    executors.apply(a, ExecutorEvent.LOST, epoch=a_epoch, instance="relay-1"), return_exceptions=True
                )
                deadline = time.monotonic() + 10
                while await _sessions_waiting(holder) < 1:
                    assert time.monotonic() < deadline and not losing.done(), "the combined write never waited"
                    await asyncio.sleep(0.01)
                # A restart of PostgreSQL, as the pool sees it: every one of its connections ends, the idle
                # ones (waited for until they have), then the one under the combined write's statement.
                for waiting in (False, True):
                    await holder.execute(
                        """SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
                           WHERE datname = current_database() AND pid NOT IN (pg_backend_pid(), %s)
                             AND (wait_event_type IS NOT DISTINCT FROM 'Lock') = %s""",
                        (kept, waiting),
                    )
            (lost,) = await losing
        # The next write: on a working connection (the idle ones were checked, the broken ones replaced).
        after = await asyncio.gather(
            executors.apply(b, ExecutorEvent.LOST, epoch=b_epoch, instance="relay-1"), return_exceptions=True
        )
        return lost, after[0]


def test_a_connection_lost_under_a_combined_write_is_connection_lost_and_the_next_write_succeeds(
    postgres: Postgres,
) -> None:
    """The server ends the connection under a combined write's statement (a restart, a failover): the
    write got a plain DatabaseError (its failure taken for the write's own), and the pool's idle
    connections, broken too, were not checked, so that the next write failed on one. It is the
    transaction's failure now, as Database.connection makes it: ConnectionLost, and the idle
    connections checked."""
    lost, after = asyncio.run(_a_connection_lost_under_a_combined_write(postgres.create_database("combine_lost")))
    assert isinstance(lost, ConnectionLost), repr(lost)
    assert after is True, repr(after)


async def _disconnections_after_a_restart(url: str) -> tuple[list[object], dict[str, str]]:
    async with _instances(url, "relay-1") as [(db, lease, executors)]:
        held = [await _connect(executors, "relay-1", f"r-{i}", lost=False) for i in range(GROUP)]
        assert lease._conn is not None
        kept = lease._conn.info.backend_pid  # the lease's own connection: not the pool's
        # A restart of PostgreSQL, as the pool sees it once the server is back: its idle connections
        # ended (waited for until they have), the database answering new ones.
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as killer:
            await killer.execute(
                """SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
                   WHERE datname = current_database() AND pid NOT IN (pg_backend_pid(), %s)""",
                (kept,),
            )
        recorded = await asyncio.gather(*(executors.lost(k, e, "relay-1") for k, e in held), return_exceptions=True)
        states, _ = await _rows(db)
        return recorded, states


def test_a_batch_of_disconnections_meeting_a_connection_the_server_ended_is_written_on_another(
    postgres: Postgres,
) -> None:
    """PostgreSQL restarted and back: a batch of disconnections is given one of the pool's idle
    connections, which the restart ended. It was refused together, as in an outage (ConnectionLost is
    the database not reached): each executor stayed HEALTHY until the socket check, pingIntervalSecs
    later, and each socket's close logged an error. Written once more on a working connection now
    (the idle ones checked first), at once."""
    recorded, states = asyncio.run(_disconnections_after_a_restart(postgres.create_database("lost_restart")))
    assert recorded == [True] * GROUP, recorded
    assert states == {f"r-{i}": "DISCONNECTED" for i in range(GROUP)}, states


class _Unordered:
    """A key that does not compare (as an object), only hashes: a store's key without an order."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"_Unordered({self.name!r})"


async def _keys_that_do_not_order(url: str) -> tuple[list[object], list[list[object]], list[object]]:
    async with _instances(url, "relay-1") as [(db, _, _)]:
        combiner = WriteCombiner(db, lanes=1, base_lanes=1)
        locked: list[list[object]] = []

        async def lock(conn: psycopg.AsyncConnection[Any], keys: list[Any]) -> None:
            locked.append(list(keys))

        def write(value: str) -> Any:
            async def run(conn: psycopg.AsyncConnection[dict[str, Any]]) -> str:
                row = await (await conn.execute("SELECT %s::text AS v", (value,))).fetchone()
                assert row is not None
                return str(row["v"])

            return run

        keyed = [ExecutorKey("acme", "ledger", "e-b"), _Unordered("x"), "s-key", ExecutorKey("acme", "ledger", "e-a")]
        # Queued together, one batch: two keys of a type that does not order among others that do.
        batch = [combiner.run(write(f"w{i}"), locks=key, lock_keys=lock) for i, key in enumerate(keyed)]
        batch += [
            combiner.run(write("unordered-2"), locks=_Unordered("y"), lock_keys=lock),
            combiner.run(write("free")),
        ]
        results = await asyncio.wait_for(asyncio.gather(*batch, return_exceptions=True), 5)
        # The lane goes on: the next writes are written.
        after = await asyncio.wait_for(
            asyncio.gather(combiner.run(write("next"), locks=ExecutorKey("acme", "ledger", "e-c"), lock_keys=lock)), 5
        )
        with pytest.raises(TypeError):  # an unhashable key is refused to its caller, at once
            await combiner.run(write("never"), locks=["a", "list"], lock_keys=lock)  # type: ignore[arg-type]
        return results, locked, list(after)


def test_a_combined_batch_whose_keys_do_not_order_fails_those_writes_alone_and_the_lane_goes_on(
    postgres: Postgres,
) -> None:
    """The combiner sorted a batch's keys before its transaction: keys that do not compare raised
    TypeError there, the lane's task died, and every write of the batch waited for ever (and those
    queued behind it, until another write came). The writes whose keys do not order fail alone with
    a TypeError that says so; keys of several types run type by type; the lane writes the next."""
    results, locked, after = asyncio.run(_keys_that_do_not_order(postgres.create_database("combine_unordered")))
    refused = [results[1], results[4]]
    assert all(isinstance(r, TypeError) and "does not order" in str(r) for r in refused), refused
    assert [results[i] for i in (0, 2, 3, 5)] == ["w0", "w2", "w3", "free"]
    a, b = ExecutorKey("acme", "ledger", "e-a"), ExecutorKey("acme", "ledger", "e-b")
    assert locked == [["s-key", a, b]]  # each type's keys in order, the types by name (builtins.str first)
    assert after == ["next"]


async def _handshakes_after_a_restart(url: str) -> tuple[list[object], list[object], dict[str, str], int]:
    async with _instances(url, "relay-1") as [(db, lease, executors)]:

        def handshake(executor_id: str) -> Handshake:
            info = ExecutorInfoReply(request_id="r", executor_id=executor_id, application_version="v1")
            return Handshake(ExecutorKey("acme", "ledger", executor_id), info, "relay-1", "key")

        async def together(*ids: str) -> list[object]:  # queued before the writer's first round: one batch
            return await asyncio.gather(*(executors.connected(handshake(i)) for i in ids), return_exceptions=True)

        first = await together(*(f"h-{i}" for i in range(GROUP // 2)))
        assert lease._conn is not None
        kept = lease._conn.info.backend_pid  # the lease's own connection: not the pool's
        # A restart of PostgreSQL, as the pool sees it once the server is back: its idle connections
        # ended (waited for until they have), the database answering new ones.
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as killer:
            cur = await killer.execute(
                """SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) FROM pg_stat_activity
                   WHERE datname = current_database() AND pid NOT IN (pg_backend_pid(), %s)""",
                (kept,),
            )
            ended = await cur.fetchone()
        assert ended is not None
        second = await together(*(f"h-{i}" for i in range(GROUP)))  # the first four again, four new
        states, _ = await _rows(db)
        return first, second, states, int(ended[0])


def test_a_batch_of_handshakes_meeting_a_connection_the_server_ended_is_written_on_another(
    postgres: Postgres,
) -> None:
    """PostgreSQL restarted and back: a batch of handshakes is given one of the pool's idle connections,
    which the restart ended. It was refused together, as in an outage (ConnectionLost is the database
    not reached): every executor of it was closed and connected again a second later. Written once more
    on a working connection now (the idle ones checked first), as a batch of disconnections is: each
    handshake accepted at its first try."""
    first, second, states, ended = asyncio.run(_handshakes_after_a_restart(postgres.create_database("hs_restart")))
    assert all(isinstance(r, Connected) for r in first), first
    assert ended >= 1  # the pool's connections the "restart" ended
    assert all(isinstance(r, Connected) for r in second), second
    previous = [r.previous_state for r in second if isinstance(r, Connected)]
    assert previous == [ExecutorState.HEALTHY] * (GROUP // 2) + [None] * (GROUP // 2), previous
    assert states == {f"h-{i}": "HEALTHY" for i in range(GROUP)}, states


class _CommitReplyLost:
    """A TCP proxy to PostgreSQL that, once armed, passes the next COMMIT on to the server and ends
    the connection as the server's reply comes, without passing it back: the commit made, its reply
    lost (a connection cut in that instant, a failover). The messages are the wire protocol's."""

    COMMIT = b"Q\x00\x00\x00\x0bCOMMIT\x00"  # the simple query psycopg sends to end a transaction
    DONE = b"C\x00\x00\x00\x0bCOMMIT\x00"  # the server's CommandComplete for it

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        socket_dir = parse_qs(parts.query).get("host", [""])[0]  # the harness's server: a Unix socket
        self.target = (socket_dir, parts.hostname or "localhost", parts.port or 5432)
        self.armed = False
        self.cut = 0

    async def serve(self) -> asyncio.Server:
        return await asyncio.start_server(self._pair, "127.0.0.1", 0)

    async def _pair(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        socket_dir, host, port = self.target
        if socket_dir.startswith("/"):
            server_r, server_w = await asyncio.open_unix_connection(f"{socket_dir}/.s.PGSQL.{port}")
        else:
            server_r, server_w = await asyncio.open_connection(host, port)
        committing = asyncio.Event()

        async def up() -> None:
            while data := await client_r.read(65536):
                if self.armed and self.COMMIT in data:
                    self.armed = False
                    committing.set()
                server_w.write(data)
                await server_w.drain()

        async def down() -> None:
            held = b""
            while data := await server_r.read(65536):
                if committing.is_set():
                    held += data
                    if self.DONE in held:  # committed: the reply dropped, the connection ended
                        self.cut += 1
                        return
                    continue
                client_w.write(data)
                await client_w.drain()

        pipes = [asyncio.create_task(up()), asyncio.create_task(down())]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)  # either side ended: both
        finally:
            client_w.transport.abort()
            server_w.transport.abort()
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)


async def _commit_reply_lost(url: str) -> tuple[int, int, object, bool, dict[str, str]]:
    proxy = _CommitReplyLost(url)
    server = await proxy.serve()
    port = server.sockets[0].getsockname()[1]
    parts = urlsplit(url)
    proxied = f"postgresql://{parts.username}:{parts.password or ''}@127.0.0.1:{port}{parts.path}?sslmode=disable"
    try:
        async with _instances(proxied, "relay-1") as [(db, _, executors)]:
            key, epoch = await _connect(executors, "relay-1", "x")  # HEALTHY, then DISCONNECTED
            info = ExecutorInfoReply(request_id="r", executor_id="x", application_version="v1")
            proxy.armed = True
            back = await executors.connected(Handshake(key, info, "relay-1", "key"))  # the reply lost
            assert isinstance(back, Connected)
            proxy.armed = True
            lost = await executors.lost(key, back.epoch, "relay-1")  # and a disconnection's
            states, _ = await _rows(db)
            # A transaction this server never saw (a failover to a replica the commit did not reach):
            # not committed, the batch run again (not an error that writes it row by row).
            assert not await db._committed(str(2**40 + 1000))
            return proxy.cut, epoch, back, lost, states
    finally:
        server.close()


def test_a_batch_whose_commit_was_made_but_its_reply_lost_is_not_reported_as_its_own_doing(
    postgres: Postgres,
) -> None:
    """A batch of handshakes (or of disconnections) whose connection is lost under its COMMIT, the
    commit made (its reply lost: a cut, a failover in that instant), was run once more: the second
    run found its rows HEALTHY already, its own first run's doing, and told the hub so. A DISCONNECTED
    executor back had its grace period left to run out, one DEAD its recovery records left unended
    (previous state HEALTHY, not DISCONNECTED or DEAD); a disconnection was reported not recorded
    (its grace period left to the repair sweep). The first run's outcome, asked of PostgreSQL by its
    transaction id (pg_xact_status), is the batch's now."""
    cut, epoch, back, lost, states = asyncio.run(_commit_reply_lost(postgres.create_database("reply_lost")))
    assert cut == 2  # both COMMITs made on the server, their replies lost
    assert isinstance(back, Connected)
    assert back.previous_state is ExecutorState.DISCONNECTED and back.previous_epoch == epoch, back
    assert lost is True  # the disconnection recorded, by the first run
    assert states == {"x": "DISCONNECTED"}, states
