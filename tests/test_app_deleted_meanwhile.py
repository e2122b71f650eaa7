"""Writes keyed to an app whose app is deleted between the look for it and the write: the API's
answer is the 404 of an app that is not there, not a 503 (a failed statement) or a 500. Real
PostgreSQL; another session deletes the app and commits once the write waits for it."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from relay.config import AlertRuleConfig
from relay.domain.alerts import AlertRules
from relay.domain.operator import Operator
from relay.errors import NotFound
from relay.store.alerts import AlertStore
from relay.store.apps import AppStore
from relay.store.db import Database
from relay.store.executors import ExecutorStore
from tests.test_alert_resolutions import waiting_for_locks
from tests.test_alerts import with_store


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
