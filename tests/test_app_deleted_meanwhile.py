"""Writes keyed to an app whose app is deleted between the look for it and the write: the API's
answer is the 404 of an app that is not there, not a 503 (a failed statement) or a 500. Real
PostgreSQL; another session deletes the app and commits once the write waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus

from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.relay import RelayProcess
from harness.simulated import handshake, off_loop, open_socket
from harness.waiting import assert_eventually
from relay.config import AlertRuleConfig
from relay.core.ids import ExecutorKey
from relay.core.lifecycle import ExecutorEvent, ExecutorState
from relay.domain.alerts import AlertRules
from relay.domain.operator import Operator
from relay.errors import Conflict, NotFound
from relay.store.alerts import AlertStore
from relay.store.apps import AppStore
from relay.store.db import Database
from relay.store.executors import AppGone, ExecutorStore, Handshake
from relay_protocol import ExecutorInfoReply
from tests.test_alert_resolutions import waiting_for_locks
from tests.test_alerts import alert_config, with_store

StartRelay = Callable[..., RelayProcess]


async def deleted_meanwhile(relay_db: str, db: Database, write: Any) -> tuple[BaseException | None, int]:
    """``write`` (a coroutine) run while another session deletes app ledger: it has read that the app
    exists (the deletion is not committed), then waits for the app's row, which the commit removes.
    What it raised, and how many alert rules ledger has after."""
    async with await psycopg.AsyncConnection.connect(relay_db) as holder:
        async with holder.transaction():
            await holder.execute("DELETE FROM apps WHERE org = 'acme' AND name = 'ledger'")
            writing = asyncio.create_task(write, name="write")
            await waiting_for_locks(holder, 1, writing)
        outcome = (await asyncio.gather(writing, return_exceptions=True))[0]
    async with db.connection() as conn:
        cur = await conn.execute("SELECT count(*) AS n FROM alert_rules WHERE org = 'acme' AND app = 'ledger'")
        row = await cur.fetchone()
    return outcome, row["n"] if row else -1


def test_an_alert_rule_created_as_its_app_is_deleted_is_not_found(relay_db: str) -> None:
    """The route looks for the app (refusal), then inserts the rule: an app deleted in between made the
    insert fail on its foreign key, answered 503 database_unavailable. It is the 404 "no app" now."""
    rule = AlertRuleConfig.model_validate({"kind": "ExecutorDead"})

    async def body(db: Database, store: AlertStore) -> tuple[BaseException | None, int]:
        rules = AlertRules(db, store, AppStore(db), None)  # type: ignore[arg-type]  # no webhook to check

        async def write() -> None:
            assert await rules.refusal("acme", "ledger", rule) is None  # the app is there (uncommitted)
            await rules.create("acme", "ledger", rule, "api:ops")

        return await deleted_meanwhile(relay_db, db, write())

    outcome, left = with_store(relay_db, [], body)
    assert isinstance(outcome, NotFound), repr(outcome)
    assert str(outcome) == "no app 'ledger' in org 'acme'"
    assert left == 0


def test_settings_changed_as_the_app_is_deleted_are_not_found(relay_db: str) -> None:
    """PATCH reads the app, then updates it: an app deleted in between updated no row, and the read
    after it failed an assertion (a 500). It is the 404 "no app" now."""

    async def body(db: Database, _: AlertStore) -> tuple[BaseException | None, int]:
        operator = Operator(db, AppStore(db), ExecutorStore(db), None, None)  # type: ignore[arg-type]
        return await deleted_meanwhile(
            relay_db, db, operator.update_settings("acme", "ledger", {"executor_timeout_secs": 5.0}, "api:ops")
        )

    outcome, _ = with_store(relay_db, [], body)
    assert isinstance(outcome, NotFound), repr(outcome)
    assert str(outcome) == "no app 'ledger' in org 'acme'"


# -- an executor's handshake (and the repair sweep's reinstated record) as its app is deleted -----------


async def deleted_during_handshake(relay: RelayProcess) -> tuple[int, str, ClientConnection]:
    """An executor's handshake to app scratch (registered, with an alert rule) while an operator
    deletes it: the DELETE locks the app's row, then waits for the rule, which a session of this test
    holds until the handshake waits too. The DELETE's status, the executor's id and its socket."""

    def delete() -> int:
        with relay.api() as api:
            return api.delete("/apps/scratch").status_code

    with relay.api() as api:
        assert api.put("/apps/scratch").status_code == 204
        rule = {"ruleType": "ExecutorDead", "webhook": "http://127.0.0.1:9/hook"}
        assert api.post("/apps/scratch/alerting-rules", json=rule).status_code == 201
    async with await psycopg.AsyncConnection.connect(relay.database_url) as holder:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM alert_rules WHERE app = 'scratch' FOR UPDATE")
            deleting = asyncio.create_task(asyncio.to_thread(delete), name="delete")
            await waiting_for_locks(holder, 1, deleting)  # it holds the app's row, waits for the rule
            ws = await open_socket(f"ws://127.0.0.1:{relay.port}/websocket/scratch/{CONDUCTOR_KEYS['acme']}")
            executor_id = await handshake(ws)
            await waiting_for_locks(holder, 2, deleting)  # the handshake waits for the app's row
        return await deleting, executor_id, ws


def test_an_executor_connecting_as_its_app_is_deleted_registers_it_again(start_relay: StartRelay) -> None:
    """An operator deletes app scratch (no executors) while an executor's handshake records it: the
    DELETE had locked the app's row (and waits here for a lock on its alert rule, which this test
    holds), the handshake found the app there and waited for the row to write the executor's. The
    DELETE committed, and the handshake's write failed on its foreign key: the socket was closed
    with 1011 "relay database unavailable" and an error logged about the database. Now the DELETE
    wins and the handshake registers the app again, as an unknown app's first connection does: the
    executor is HEALTHY, listed under the app, and the app cannot be deleted while it is."""
    relay = start_relay(alert_config(free_port(), []))

    def registered_again(executor_id: str) -> None:
        with relay.api() as api:
            app = api.get("/apps/scratch").json()  # with the defaults, its executor counted
            assert app["executorTimeoutSecs"] == 60 and app["executors"]["HEALTHY"] == 1, app
            listed = api.get("/apps/scratch/executors").json()
            assert [(e["executorId"], e["state"]) for e in listed] == [(executor_id, "HEALTHY")]
            assert api.get("/apps/scratch/alerting-rules").json() == []  # the DELETE took its rule
            assert api.delete("/apps/scratch").status_code == 409  # the rule that holds: it has an executor
            audited = [e["action"] for e in api.get("/audit", params={"app": "scratch"}).json()]
            assert audited.count("application.delete") == 1, audited

    async def run() -> tuple[int, int | None]:
        status, executor_id, ws = await deleted_during_handshake(relay)
        try:
            healthy = lambda: relay.state_of("acme", "scratch", executor_id) == "HEALTHY"  # noqa: E731
            await off_loop(assert_eventually, healthy, 5)
            await asyncio.to_thread(registered_again, executor_id)
            return status, ws.close_code
        finally:
            await ws.close()

    status, close_code = asyncio.run(run())
    assert (status, close_code) == (204, None)  # the DELETE won, and the socket stays open
    assert "relay database unavailable" not in relay.log()
    assert "cannot record its connection" not in relay.log()


def test_an_executor_connecting_as_its_app_is_deleted_is_refused_clearly_without_auto_registration(
    start_relay: StartRelay,
) -> None:
    """autoRegisterApps off, the same race: the socket was closed 1011 "relay database unavailable";
    it is closed 4404 "no such app: it was deleted" now, the app stays deleted, nothing of the
    executor is kept, and the SDK's next attempt is refused with the 404 of an unknown app."""
    config = alert_config(free_port(), [])
    config["autoRegisterApps"] = False
    relay = start_relay(config)

    async def run() -> tuple[int, int | None, str | None, int]:
        status, _, ws = await deleted_during_handshake(relay)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
        try:
            await open_socket(f"ws://127.0.0.1:{relay.port}/websocket/scratch/{CONDUCTOR_KEYS['acme']}")
        except InvalidStatus as exc:
            return status, ws.close_code, ws.close_reason, exc.response.status_code
        return status, ws.close_code, ws.close_reason, 101

    assert asyncio.run(run()) == (204, 4404, "no such app: it was deleted", 404)
    with relay.api() as api:
        assert api.get("/apps/scratch").status_code == 404
    with psycopg.connect(relay.database_url) as conn:
        assert conn.execute("SELECT count(*) FROM executors WHERE app = 'scratch'").fetchone() == (0,)
    assert "refused: no app 'scratch' in org 'acme' (deleted during its handshake)" in relay.log()


def _handshake(executor_id: str, register_app: bool) -> Handshake:
    info = ExecutorInfoReply(request_id="r", executor_id=executor_id, application_version="v1")
    return Handshake(ExecutorKey("acme", "ledger", executor_id), info, "relay-1", "key", register_app)


def _executor_rows(db: Database) -> Any:
    async def rows() -> int:
        async with db.connection() as conn:
            cur = await conn.execute("SELECT count(*) AS n FROM executors WHERE org = 'acme' AND app = 'ledger'")
            row = await cur.fetchone()
        return int(row["n"]) if row else -1

    return rows()


def test_a_handshake_as_its_app_is_deleted_is_refused_clearly_when_apps_do_not_register_themselves(
    relay_db: str,
) -> None:
    """autoRegisterApps off: the handshake's write waited for the app's row, which the deletion removed,
    and failed on its foreign key, a DatabaseError ("relay database unavailable" to the executor). It
    is AppGone now (the socket's close says the app is gone), and nothing of the executor is written."""

    async def body(db: Database, _: AlertStore) -> tuple[BaseException | None, int]:
        executors = ExecutorStore(db)
        outcome, _ = await deleted_meanwhile(relay_db, db, executors.connected(_handshake("e-1", False)))
        return outcome, await _executor_rows(db)

    outcome, rows = with_store(relay_db, [], body)
    assert isinstance(outcome, AppGone), repr(outcome)
    assert str(outcome) == "no app 'ledger' in org 'acme'"
    assert rows == 0


def test_a_stranded_executor_reinstated_as_its_app_is_deleted_is_left_alone(relay_db: str) -> None:
    """The reconciler found work of an executor without a record, then the app was deleted (it had no
    executor in the registry) as it wrote the record back: the insert failed on its foreign key, a
    DatabaseError that its step retried for half an hour before the run ended in ERROR. It finds the app
    gone now: no record (None), and the app stays deleted."""

    async def body(db: Database, _: AlertStore) -> tuple[BaseException | int | None, int]:
        executors = ExecutorStore(db)
        key = ExecutorKey("acme", "ledger", "e-1")

        async def reinstate() -> int | None:
            async with db.fenced() as conn:
                return await executors.stranded(conn, key, "v1", "relay-1", None)

        outcome, _ = await deleted_meanwhile(relay_db, db, reinstate())
        return outcome, await _executor_rows(db)

    outcome, rows = with_store(relay_db, [], body)
    assert outcome is None and rows == 0, (outcome, rows)


def test_a_grace_period_and_a_recovery_writing_their_executor_as_its_app_is_deleted(relay_db: str) -> None:
    """The grace period's write (DISCONNECTED to DEAD) held up by another session, then the record's
    deletion (nothing left to recover) not committed yet: an app deletion meanwhile is the 409 of an app
    with an executor, at once (it waits for neither), and both writes land. Once the record is gone, the
    app is deleted. (Were the deletion to wait for the executors' rows, or skip its check, it would hang
    here or fail on the foreign key: a 503.)"""
    lifecycle = ExecutorEvent

    async def body(db: Database, _: AlertStore) -> list[object]:
        executors = ExecutorStore(db)
        operator = Operator(db, AppStore(db), executors, None, None)  # type: ignore[arg-type]
        key = ExecutorKey("acme", "ledger", "e-1")
        async with db.connection() as conn:  # as if taken out of relay.yaml: the API may delete it
            await conn.execute("UPDATE apps SET from_config = false WHERE org = 'acme' AND name = 'ledger'")
        epoch = (await executors.connected(_handshake("e-1", False))).epoch
        assert await executors.lost(key, epoch, "relay-1")

        async def delete() -> str:
            try:
                await asyncio.wait_for(operator.delete_app("acme", "ledger", "api:ops"), 5)
            except Conflict as exc:
                return str(exc)
            return "deleted"

        seen: list[object] = []
        async with await psycopg.AsyncConnection.connect(relay_db) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM executors WHERE executor_id = 'e-1' FOR UPDATE")
                grace = asyncio.create_task(
                    executors.apply(key, lifecycle.GRACE_EXPIRED, epoch=epoch, expected=ExecutorState.DISCONNECTED)
                )
                await waiting_for_locks(holder, 1, grace)
                seen.append(await delete())
        seen.append(await grace)
        record = await executors.get(key)
        seen.append(record.state if record else None)
        async with db.connection() as conn, conn.transaction():
            assert await executors.apply(key, lifecycle.NOTHING_PENDING, epoch=epoch, conn=conn)
            seen.append(await delete())
        seen += [await executors.get(key), await delete()]
        return seen

    seen = with_store(relay_db, [], body)
    busy = "app 'ledger' still has executors in the registry"
    assert seen == [busy, True, ExecutorState.DEAD, busy, None, "deleted"], seen
