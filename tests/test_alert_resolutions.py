"""Resolutions that must not be lost: a burst of deaths read by a poll that lags behind the audit log,
a rule removed while its alert is open (through the API, from relay.yaml, with its app), and a death
longer than retention. Real PostgreSQL, real Relay and DBOS executors where the case needs them,
a real webhook receiver."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from harness.executors import ExecutorProcess
from harness.relay import RelayProcess
from relay.config import AlertsConfig
from relay.core.alerts import Alert
from relay.store.alerts import AlertStore
from relay.store.db import Database
from tests.test_alerts import with_store
from workflows.alerts import AlertLoops

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


def test_a_burst_of_deaths_each_over_at_once_is_resolved_though_the_poll_lags_behind_the_log(relay_db: str) -> None:
    """1,200 deaths, each over within moments (nothing to recover), written before the poll reads them:
    a poll reads a death and its end together, and the end's resolution was left for a later poll to
    find in the overlap (the last minute, at most a page of entries), the alert then started. A poll
    that lags more than the overlap behind the log (here shortened, as a burst or a restart makes it)
    found nothing there: every resolution was lost. Each is started with its death's alert, once."""
    deaths = 1200
    rules = [{"kind": "ExecutorDead", "webhook": "http://127.0.0.1:9/", "minIntervalSecs": 0}]

    async def body(db: Database, store: AlertStore) -> list[list[Alert]]:
        async with db.transaction() as conn:
            await conn.execute(
                """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status)
                   SELECT 'r' || g, 'acme', 'ledger', 'e' || g, 'v1', 1, 'grace_period', 'succeeded'
                   FROM generate_series(1, %s) g""",
                (deaths,),
            )
            await conn.execute(
                """INSERT INTO audit_log (org, app, action, executor_id, peer_executor_id, actor, detail)
                   SELECT 'acme', 'ledger', a.action, 'e' || g, a.peer, 'relay',
                          CASE WHEN a.n = 1 THEN jsonb_build_object('epoch', 1)
                               ELSE jsonb_build_object('recoveryId', 'r' || g, 'verifiedBy', 'peer',
                                                       'nothingPending', true) END
                   FROM generate_series(1, %s) g,
                        (VALUES (1, 'executor.dead', NULL), (2, 'executor.deleted', 'peer')) AS a(n, action, peer)
                   ORDER BY g, a.n""",
                (deaths,),
            )
        polls: list[list[Alert]] = []

        async def start(alert: Alert) -> None:
            polls[-1].append(alert)

        loops = AlertLoops(store, AlertsConfig(), lambda: True, start=start)
        loops.overlap_secs = 0.2  # the minute, shortened: each poll comes later than that after the entries
        while not polls or polls[-1]:
            await asyncio.sleep(0.3)
            polls.append([])
            await loops.poll_events()
        return polls

    polls = with_store(relay_db, rules, body)
    started = [a for poll in polls for a in poll]
    alerts = {a.idempotency_key for a in started if a.resolves is None}
    resolutions = [a for a in started if a.resolves is not None]
    assert len(alerts) == deaths, f"{len(alerts)} alerts for {deaths} deaths"
    assert len(resolutions) == deaths, f"{len(resolutions)} of the {deaths} deaths' ends were resolved"
    assert {a.resolves for a in resolutions} == alerts, "each resolves its death's alert, once"
    assert all(a.metadata["ended"] == "nothing_pending" for a in resolutions)
    for poll in polls:  # never before its alert: in the poll that starts the alert, or a later one
        at = {a.idempotency_key: i for i, a in enumerate(poll) if a.resolves is None}
        assert all(at.get(a.resolves, -1) < i for i, a in enumerate(poll) if a.resolves is not None)
