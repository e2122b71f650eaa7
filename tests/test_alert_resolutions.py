"""Resolutions that must not be lost: a burst of deaths read by a poll that lags behind the audit log,
a rule removed while its alert is open (through the API, from relay.yaml, with its app), and a death
longer than retention. Real PostgreSQL, real Relay and DBOS executors where the case needs them,
a real webhook receiver."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from harness.executors import ExecutorProcess
from harness.ports import free_port
from harness.receiver import WebhookReceiver
from harness.relay import RelayProcess
from harness.waiting import assert_eventually
from relay.config import AlertsConfig, RelayConfig, RetentionConfig
from relay.core.alerts import Alert, Kind, Observed
from relay.core.destinations import DestinationPolicy
from relay.core.ids import ExecutorKey, RecoveryRef
from relay.core.lifecycle import ExecutorEvent
from relay.domain.alerts import AlertSender
from relay.domain.operator import Operator
from relay.errors import Conflict
from relay.net.webhook import WebhookSender
from relay.store.alerts import AlertStore, config_rule_id
from relay.store.apps import AppStore
from relay.store.audit import audit_executor
from relay.store.configsync import sync_config
from relay.store.db import Database
from relay.store.executors import ExecutorStore, Handshake
from relay.store.migrations import MIGRATIONS
from relay.store.recoveries import RecoveryStore
from relay.store.retention import RetentionStore
from relay_protocol import ExecutorInfoReply
from tests.test_alerts import (
    SHORT_AUDIT_DAYS,
    YAML_SECRET,
    aged,
    alert_config,
    alert_keys,
    audit,
    signed,
    wait_aged,
    wait_entries_aged,
    with_store,
)
from tests.test_migration_indexes import migrate
from workflows.alerts import AlertLoops, due_alerts

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


def test_rules_deleted_while_their_alerts_are_open_resolve_them_to_where_they_went_once(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """The app's only executor dies (nobody can recover it): an ExecutorDead rule and an
    UnresponsiveApplication rule alert, a third rule's alert is refused for good by its receiver (a
    400). The operator deletes the three rules through the API while the death goes on: each open
    alert gets one resolution, at its rule's webhook, saying the rule was removed (the destination
    went with the rule, and they stayed open for ever); the failed alert gets none. When a peer joins
    and the death ends, nothing is resolved again."""
    with WebhookReceiver() as receiver:
        receiver.refused_prefix = "/refused"
        relay = start_relay(alert_config(free_port(), [], grace=0.5))
        dying = start_executor(relay.conductor_url)
        with relay.api() as api:
            made = {
                path: api.post("/apps/ledger/alerting-rules",
                               json={"ruleType": kind, "webhook": receiver.url(path), "minIntervalSecs": 0,
                                     **({"ruleMetadata": {"forSecs": 0}} if kind == "UnresponsiveApplication" else {})})
                for path, kind in [("/dead", "ExecutorDead"), ("/down", "UnresponsiveApplication"),
                                   ("/refused", "ExecutorDead")]
            }  # fmt: skip
            assert all(r.status_code == 201 for r in made.values()), [r.text for r in made.values()]
            assert_eventually(lambda: relay.state_of("acme", "ledger", dying.executor_id) == "HEALTHY", 10)
            dying.kill()

            def at(path: str) -> list[dict[str, Any]]:
                return [d.payload for d in receiver.deliveries() if d.path == path]

            assert_eventually(lambda: at("/dead") and at("/down") and audit(relay, "alert.failed"), 20, what="alerts")
            assert relay.state_of("acme", "ledger", dying.executor_id) == "DEAD", "the death goes on"
            for rule in made.values():
                assert api.delete(f"/apps/ledger/alerting-rules/{rule.json()['id']}").status_code == 204
            assert_eventually(lambda: len(at("/dead")) == 2 and len(at("/down")) == 2, 20, what="the resolutions")
            # A peer joins and the death ends: the poll resolves the removed rule's alert of it again, under
            # the id its removal's resolution ran as, which DBOS does not run twice.
            start_executor(relay.conductor_url)
            assert_eventually(lambda: audit(relay, "executor.deleted"), 20, what="the death's end")
        time.sleep(1.0)  # a few more polls: nothing repeats
        for path, subject in [("/dead", {"executorId": dying.executor_id}), ("/down", {"appName": "ledger"})]:
            alert, resolution = at(path)
            assert "status" not in alert and alert.items() >= subject.items()
            assert resolution["status"] == "resolved" and resolution["resolves"] == alert["idempotencyKey"]
            assert resolution.items() >= subject.items() and resolution["kind"] == alert["kind"]
            assert resolution["metadata"]["ended"] == "rule_removed", resolution
            assert "is no longer watched: its rule was deleted (by api:" in resolution["message"], resolution
        assert len(at("/refused")) == 1, "an alert that failed is not resolved"
        ended = audit(relay, "alert.resolved")
        assert sorted(e["detail"]["resolves"] for e in ended) == sorted(p["idempotencyKey"] for p in
                                                                        (at("/dead")[0], at("/down")[0]))  # fmt: skip
        assert all(e["detail"]["ended"] == "rule_removed" for e in ended)


def recording(store: AlertStore) -> tuple[AlertLoops, list[Alert]]:
    """An audit poll whose deliveries are recorded, not started (DBOS does not run in the test)."""
    recorded: list[Alert] = []

    async def start(alert: Alert) -> None:
        recorded.append(alert)

    return AlertLoops(store, AlertsConfig(), lambda: True, start=start), recorded


def sender_to(store: AlertStore | None) -> AlertSender:
    return AlertSender(store, None, WebhookSender(DestinationPolicy.from_entries(["127.0.0.1"]), 2.0, "t"))  # type: ignore[arg-type]


async def deliver(store: AlertStore, sender: AlertSender, alert: Alert) -> None:
    """One delivery as relay.alert.deliver makes it (claimed, sent, finished), or a resolution as
    relay.alert.resolve does (once the alert it resolves was sent)."""
    if alert.resolves is None:
        assert (await store.claim(alert)).send
    else:
        assert await store.status_of(alert.resolves) == "sent"
    outcome, where = await sender.attempt(alert, 1)
    assert outcome.ok, outcome
    await store.finish(alert, True, 1, None, where, f"test:{alert.idempotency_key}")


def dead_rule_in_and_out(receiver: WebhookReceiver) -> tuple[list[dict[str, Any]], RelayConfig, RelayConfig]:
    """An ExecutorDead rule to ``receiver``'s /dead; relay.yaml with it, and the same file without it."""
    rules: list[dict[str, Any]] = [{"kind": "ExecutorDead", "webhook": receiver.url("/dead"), "minIntervalSecs": 0}]
    return (
        rules,
        RelayConfig.model_validate(alert_config(free_port(), rules)),
        RelayConfig.model_validate(alert_config(free_port(), [])),
    )


async def polled_and_delivered(store: AlertStore, sender: AlertSender, overlap_secs: float | None = None) -> None:
    """Two audit polls that remember starting nothing (DBOS forgot the workflows they started, as
    retention makes it), each alert they would start delivered (:func:`deliver`)."""
    loops, recorded = recording(store)
    if overlap_secs is not None:
        loops.overlap_secs = overlap_secs
    for _ in range(2):
        await loops.poll_events()
    for alert in recorded:
        await deliver(store, sender, alert)


async def declared_dead(db: Database, name: str) -> int:
    """Executor ``name`` of acme/ledger connected, lost and declared dead (audited); its epoch."""
    executors, key = ExecutorStore(db), ExecutorKey("acme", "ledger", name)
    info = ExecutorInfoReply(request_id="r", executor_id=name, application_version="v1")
    epoch = (await executors.connected(Handshake(key, info, "relay-1", "key"))).epoch
    for event in (ExecutorEvent.LOST, ExecutorEvent.GRACE_EXPIRED):
        assert await executors.apply(key, event, epoch=epoch)
    async with db.transaction() as conn:
        await audit_executor(conn, key, "executor.dead", f"dead:{name}", detail={"epoch": epoch})
    return epoch


async def recovered(db: Database, name: str, epoch: int) -> None:
    """Its death over: its workflows recovered by peer-1, verified, its record deleted (audited)."""
    executors, key = ExecutorStore(db), ExecutorKey("acme", "ledger", name)
    for event in (ExecutorEvent.RECOVERY_SENT, ExecutorEvent.RECOVERED):
        assert await executors.apply(key, event, epoch=epoch)
    async with db.transaction() as conn:
        await conn.execute(
            """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status)
               VALUES (%s, 'acme', 'ledger', %s, 'v1', %s, 'grace_period', 'succeeded')""",
            (f"rec-{name}", name, epoch),
        )
        detail = {"recoveryId": f"rec-{name}", "verifiedBy": "peer-1"}
        await audit_executor(conn, key, "executor.deleted", f"deleted:{name}", peer="peer-1", detail=detail)


def test_rules_taken_out_of_relay_yaml_resolve_their_open_alerts_once_and_a_death_over_just_before(
    relay_db: str,
) -> None:
    """An app is down (UnresponsiveApplication alerted) and two of its executors died (ExecutorDead
    alerted): one still dead, the other recovered a moment ago, its end not read by the audit poll
    yet. The rules are taken out of relay.yaml and two instances start (each syncs the file): each
    open alert is resolved once, at its rule's webhook, signed with its secret; the death that ended
    before says how it ended (the poll reads it after its rule is gone)."""
    with WebhookReceiver() as receiver:
        rules = [
            {"kind": "ExecutorDead", "webhook": receiver.url("/dead"), "secret": YAML_SECRET, "minIntervalSecs": 0},
            {"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": 0, "webhook": receiver.url("/down")},
        ]
        sender = sender_to(None)

        async def body(db: Database, store: AlertStore) -> list[dict[str, Any]]:
            sender.store = store
            loops, recorded = recording(store)
            epochs = {name: await declared_dead(db, name) for name in ("still-dead", "recovered")}
            await loops.poll_events()
            (down_rule,) = await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION}))
            ((down, _),) = await due_alerts(store, down_rule, [Observed({"appName": "ledger"}, "ledger", "down")])
            for alert in [*recorded, down]:
                await deliver(store, sender, alert)
            await recovered(db, "recovered", epochs["recovered"])  # its end not read before the rules go
            without = RelayConfig.model_validate(alert_config(free_port(), []))
            for _ in range(2):  # two instances start with the file's new version
                await store.sync_config(without)
            assert await store.rules_of(frozenset(Kind)) == []
            recorded.clear()
            for _ in range(2):
                await loops.poll_events()
            for alert in recorded:
                await deliver(store, sender, alert)
            async with db.connection() as conn:
                cur = await conn.execute("SELECT detail FROM audit_log WHERE action = 'alert.resolved' ORDER BY id")
                return [r["detail"] for r in await cur.fetchall()]

        try:
            ended = with_store(relay_db, rules, body)
        finally:
            sender.webhooks.close()
    firing = [d.payload for d in receiver.deliveries() if "status" not in d.payload]
    resolved = {d.payload["resolves"]: d for d in receiver.deliveries() if d.payload.get("status") == "resolved"}
    assert len(firing) == 3 and sorted(resolved) == sorted(p["idempotencyKey"] for p in firing), resolved
    assert len(receiver.deliveries()) == 6, "one resolution each"
    by_subject = {(d.path, d.payload.get("executorId") or d.payload["appName"]): d for d in resolved.values()}
    for subject in [("/dead", "still-dead"), ("/down", "ledger")]:
        payload = by_subject[subject].payload
        assert payload["metadata"]["ended"] == "rule_removed", payload
        assert "taken out of relay.yaml" in payload["message"] and "no longer watched" in payload["message"]
    over = by_subject[("/dead", "recovered")].payload
    assert over["metadata"]["ended"] == "recovered" and over["metadata"]["recovered_by"] == "peer-1", over
    assert all(signed(d, YAML_SECRET) for d in receiver.deliveries() if d.path == "/dead")
    assert sorted(e["subjectKey"] for e in ended) == ["ledger", "still-dead"], "once each, for the open ones"
    assert all(e["ended"] == "rule_removed" for e in ended)


def test_a_death_longer_than_the_audit_retention_is_still_resolved_when_it_ends(relay_db: str) -> None:
    """An executor dead for longer than retention.auditDays (its recovery waits for an operator):
    retention pruned its ExecutorDead alert's row by its age, and Relay's workflow of that key goes
    after relayWorkflowsDays, sooner still; when the death ended, nothing said the alert was ever sent
    and its resolution was not. The row stays while the death goes on, and goes once it is over."""
    settings = RetentionConfig(audit_days=SHORT_AUDIT_DAYS)
    with WebhookReceiver() as receiver:
        rules = [{"kind": "ExecutorDead", "webhook": receiver.url(), "minIntervalSecs": 0}]
        sender = sender_to(None)

        async def body(db: Database, store: AlertStore) -> tuple[set[str], set[str], set[str]]:
            sender.store = store
            loops, recorded = recording(store)
            epoch = await declared_dead(db, "stuck")
            await loops.poll_events()
            (alert,) = recorded
            await deliver(store, sender, alert)
            await wait_aged(db, alert.idempotency_key)
            await RetentionStore(db).prune(settings)
            during = await alert_keys(db)
            await recovered(db, "stuck", epoch)
            loops, recorded = recording(store)  # months later: no instance remembers starting the alert
            await loops.poll_events()
            for resolution in recorded:
                await deliver(store, sender, resolution)
            await RetentionStore(db).prune(settings)
            kept = await alert_keys(db)  # while the entry that ended the death is in the audit log
            await wait_entries_aged(db, "executor.deleted")
            await RetentionStore(db).prune(settings)
            return during, kept, await alert_keys(db)

        try:
            during, kept, after = with_store(relay_db, rules, body)
        finally:
            sender.webhooks.close()
    alert, *resolutions = receiver.payloads("ExecutorDead")
    assert during == {alert["idempotencyKey"]}, "the alert's row was pruned while its death went on"
    assert kept == during, "pruned before the entry that ended the death was as old"
    assert [r["resolves"] for r in resolutions] == [alert["idempotencyKey"]], "never resolved"
    assert resolutions[0]["metadata"]["ended"] == "recovered"
    assert after == set(), "pruned by its age once the death's end is as old"


def test_an_apps_rules_deleted_with_it_resolve_their_open_alerts_and_a_refused_delete_resolves_nothing(
    relay_db: str,
) -> None:
    """An app's rules go with the app (``DELETE /apps/{app}``): an alert one of them left open is
    resolved at its webhook, saying the app was deleted. A delete refused (the app still has an
    executor in the registry) changes nothing and resolves nothing."""
    with WebhookReceiver() as receiver:
        sender = sender_to(None)

        async def body(db: Database, store: AlertStore) -> tuple[int, list[dict[str, Any]]]:
            sender.store = store
            operator = Operator(db, AppStore(db), ExecutorStore(db), None, None)  # type: ignore[arg-type]
            async with db.transaction() as conn:
                for app in ("billing", "busy"):
                    await AppStore(db).register(conn, "acme", app)
                    await store.create(conn, {
                        "id": f"rule-{app}", "org": "acme", "app": app, "kind": "UnresponsiveApplication",
                        "params": {"forSecs": 0}, "min_interval_secs": 0, "webhook_url": receiver.url(f"/{app}"),
                        "secret": None, "format": "json", "receiver_app": None, "created_by": "test"})  # fmt: skip
            for rule in await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION})):
                down = [Observed({"appName": rule.app}, rule.app, "down")]
                ((alert, _),) = await due_alerts(store, rule, down)
                await deliver(store, sender, alert)
            key = ExecutorKey("acme", "busy", "still-here")
            info = ExecutorInfoReply(request_id="r", executor_id=key.executor_id, application_version="v1")
            await ExecutorStore(db).connected(Handshake(key, info, "relay-1", "key"))
            try:
                await operator.delete_app("acme", "busy", "api:ops")
                raise AssertionError("an app with an executor was deleted")
            except Conflict:
                pass
            await operator.delete_app("acme", "billing", "api:ops")
            loops, recorded = recording(store)
            await loops.poll_events()
            for resolution in recorded:
                await deliver(store, sender, resolution)
            async with db.connection() as conn:
                cur = await conn.execute("SELECT app, detail FROM audit_log WHERE action = 'alert.resolved'")
                return len(await store.rules_of(frozenset(Kind))), [dict(r) for r in await cur.fetchall()]

        try:
            left, ended = with_store(relay_db, [], body)
        finally:
            sender.webhooks.close()
    assert left == 1, "busy's rule stays, billing's went with its app"
    assert [e["app"] for e in ended] == ["billing"] and ended[0]["detail"]["ended"] == "rule_removed"
    alert, resolution = [d.payload for d in receiver.deliveries() if d.path == "/billing"]
    assert resolution["resolves"] == alert["idempotencyKey"] and resolution["metadata"]["ended"] == "rule_removed"
    assert "its app billing was deleted (by api:ops)" in resolution["message"], resolution
    assert len(receiver.deliveries()) == 3, "busy's alert, billing's alert and its resolution"


def test_an_alert_older_than_the_audit_retention_is_kept_until_its_end_is_resolved(relay_db: str) -> None:
    """A death and an outage alerted more than auditDays ago, each over now (the executor recovered;
    the outage's rule removed): a retention job that ran before the audit poll read the end pruned
    the alert's row at once (its death no longer going on, its condition no longer held), and the
    resolution found no sign that the alert was ever sent: never delivered. Each row stays while the
    entry that ends it (the death's end, the ``alert.resolved``) is in the audit log."""
    days = 2e-5  # 1.7 s: the alerts grow older than it, the ends written just before the job do not
    settings = RetentionConfig(audit_days=days)
    with WebhookReceiver() as receiver:
        rules = [
            {"kind": "ExecutorDead", "webhook": receiver.url("/dead"), "minIntervalSecs": 0},
            {"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": 0, "webhook": receiver.url("/down")},
        ]
        sender = sender_to(None)

        async def body(db: Database, store: AlertStore) -> tuple[list[Alert], dict[str, str | None]]:
            sender.store = store
            loops, recorded = recording(store)
            epoch = await declared_dead(db, "stuck")
            await loops.poll_events()
            (down_rule,) = await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION}))
            ((down, _),) = await due_alerts(store, down_rule, [Observed({"appName": "ledger"}, "ledger", "down")])
            alerts = [*recorded, down]
            for alert in alerts:
                await deliver(store, sender, alert)
            deadline = time.monotonic() + 15
            while not all([await aged(db, a.idempotency_key, days) for a in alerts]):
                assert time.monotonic() < deadline, "the alerts never grew older than auditDays"
                await asyncio.sleep(0.1)
            await recovered(db, "stuck", epoch)  # the death is over
            await store.sync_config(RelayConfig.model_validate(alert_config(free_port(), [rules[0]])))
            await RetentionStore(db).prune(settings)  # before the poll reads either end
            loops, recorded = recording(store)  # no instance remembers starting the alerts
            await loops.poll_events()
            # relay.alert.resolve sends a resolution once the alert it resolves is found sent
            return recorded, {a.resolves or "": await store.status_of(a.resolves or "") for a in recorded}

        try:
            started, found = with_store(relay_db, rules, body)
        finally:
            sender.webhooks.close()
    alerts = {d.path: d.payload["idempotencyKey"] for d in receiver.deliveries()}
    assert sorted(alerts) == ["/dead", "/down"], alerts
    assert sorted(a.resolves or "" for a in started) == sorted(alerts.values()), "a resolution was never started"
    assert found == dict.fromkeys(alerts.values(), "sent"), "the alerts' rows were pruned: nothing resolved"


def test_deaths_whose_ends_are_written_after_their_rules_removal_began_are_resolved(relay_db: str) -> None:
    """An ExecutorDead rule is taken out of relay.yaml while two deaths it alerted are ending. One's
    recovery succeeds while the removal's transaction waits for the rule's row (a delivery's claim or
    a round's settling holds it a moment; here another session). The other's executor connected again
    just before the removal, and its recovery run writes the final ``recovery.failed`` a little after.
    The removal found neither death going on (no ``alert.resolved`` of its own), and the audit poll,
    reading each end after the rule had gone, took only rules removed after the end: both
    resolutions were lost. Each is resolved now, once, saying how its death ended."""
    rules = [{"kind": "ExecutorDead", "webhook": "http://127.0.0.1:9/", "minIntervalSecs": 0}]

    async def body(db: Database, store: AlertStore) -> tuple[list[Alert], list[Alert]]:
        loops, recorded = recording(store)
        epochs = {name: await declared_dead(db, name) for name in ("ending", "back")}
        await loops.poll_events()
        for alert in recorded:
            assert (await store.claim(alert)).send
            await store.finish(alert, True, 1, None, "x", f"sent:{alert.idempotency_key}")
        key = ExecutorKey("acme", "ledger", "back")
        info = ExecutorInfoReply(request_id="r", executor_id="back", application_version="v1")
        await ExecutorStore(db).connected(Handshake(key, info, "relay-1", "key"))  # HEALTHY again
        without = RelayConfig.model_validate(alert_config(free_port(), []))
        async with await psycopg.AsyncConnection.connect(relay_db) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM alert_rules WHERE id = %s FOR UPDATE", (recorded[0].rule_id,))
                removal = asyncio.create_task(store.sync_config(without))
                deadline = time.monotonic() + 10
                while not (await (await holder.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted"
                )).fetchone() or (0,))[0]:  # fmt: skip
                    assert time.monotonic() < deadline and not removal.done(), "the removal never waited"
                    await asyncio.sleep(0.02)
                await recovered(db, "ending", epochs["ending"])  # the death ends while the removal waits
            await removal
        assert await store.rules_of(frozenset(Kind)) == []
        async with db.transaction() as conn:  # the run of the death that is over ends, as abandon writes it
            await conn.execute(
                """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status)
                   VALUES ('rec-back', 'acme', 'ledger', 'back', 'v1', %s, 'grace_period', 'failed')""",
                (epochs["back"],),
            )
            detail = {"error": "the executor reconnected", "recoveryId": "rec-back", "final": True}
            await audit_executor(conn, key, "recovery.failed", "back:final", detail=detail)
        alerts = list(recorded)
        loops, recorded = recording(store)
        for _ in range(2):
            await loops.poll_events()
        return alerts, recorded

    alerts, resolutions = with_store(relay_db, rules, body)
    assert sorted(r.resolves or "" for r in resolutions) == sorted(a.idempotency_key for a in alerts), resolutions
    ended = {r.subject["executorId"]: r.metadata["ended"] for r in resolutions}
    assert ended == {"ending": "recovered", "back": "connected_again"}, ended


async def waiting_for_locks(conn: psycopg.AsyncConnection[Any], n: int, *tasks: asyncio.Task[Any]) -> None:
    """Until ``n`` sessions wait for a lock (each of ``tasks`` still running)."""
    deadline = time.monotonic() + 10
    while True:
        cur = await conn.execute("SELECT count(DISTINCT pid) FROM pg_locks WHERE NOT granted")
        row = await cur.fetchone()
        if row is not None and row[0] >= n:
            return
        assert time.monotonic() < deadline, f"fewer than {n} sessions ever waited for a lock"
        for task in tasks:
            assert not task.done(), f"{task.get_name()} ended before it waited: {task}"
        await asyncio.sleep(0.01)


def test_an_app_deleted_while_relay_yaml_takes_its_rules_out_deletes_it_and_syncs_without_a_deadlock(
    relay_db: str,
) -> None:
    """App ledger is taken out of relay.yaml (its two rules with it) and, while a starting instance's
    sync removes those rules, an operator deletes the app. The sync locked relay.yaml's rules by their
    creation, the app's deletion by id: with the rule added later having the smaller id, each held one
    rule and waited for the other, and PostgreSQL failed one of them (the DELETE answered 503, or the
    instance failed to start). Both lock by id now: one waits for the other, and both succeed. Another
    session holds the first rule meanwhile, so that both are under way when it lets go."""
    rules = [{"kind": "ExecutorDead", "webhook": "http://127.0.0.1:9/", "minIntervalSecs": secs} for secs in (0, 1)]
    without = alert_config(free_port(), [])
    without["orgs"][0]["apps"] = [{"name": "other"}]

    async def body(db: Database, store: AlertStore) -> tuple[list[Any], int, list[str]]:
        config = RelayConfig.model_validate(without)
        ids = sorted(r.id for r in await store.rules_of(frozenset(Kind)))
        async with db.transaction() as conn:  # the rule of the larger id came first, at an earlier start
            await conn.execute("UPDATE alert_rules SET created_at = now() - interval '1 day' WHERE id = %s", (ids[1],))
        await AppStore(db).sync_config(config)  # ledger is no longer the file's: it may be deleted
        operator = Operator(db, AppStore(db), ExecutorStore(db), None, None)  # type: ignore[arg-type]
        async with await psycopg.AsyncConnection.connect(relay_db) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM alert_rules WHERE id = %s FOR UPDATE", (ids[0],))
                deleting = asyncio.create_task(operator.delete_app("acme", "ledger", "api:ops"), name="delete")
                await waiting_for_locks(holder, 1, deleting)
                syncing = asyncio.create_task(sync_config(db, config), name="sync")  # a start's: apps, rules, keys
                await waiting_for_locks(holder, 2, deleting, syncing)
            outcomes = await asyncio.gather(deleting, syncing, return_exceptions=True)
        async with db.connection() as conn:
            cur = await conn.execute("SELECT count(*) AS n FROM apps WHERE org = 'acme' AND name = 'ledger'")
            row = await cur.fetchone()
            cur = await conn.execute("SELECT id FROM alert_rules_removed ORDER BY id")
            removed = [str(r["id"]) for r in await cur.fetchall()]
        assert removed == ids, "the rules' destinations were not kept for their resolutions"
        return outcomes, row["n"] if row else -1, removed

    outcomes, ledgers, _ = with_store(relay_db, rules, body)
    assert outcomes == [None, None], outcomes
    assert ledgers == 0, "the app was not deleted"


def test_two_instances_starting_with_relay_yaml_rules_in_another_order_both_start(relay_db: str) -> None:
    """Two instances start at once, their files listing the same two new rules in another order (a
    file being rolled out). Each inserted the rules in its file's order and waited for the other's
    insert of the second: PostgreSQL failed one, and that instance did not start. The syncs take
    turns now. Another session's insert of the first rule, rolled back, holds both up meanwhile."""
    rules = [{"kind": "ExecutorDead", "webhook": "http://127.0.0.1:9/", "minIntervalSecs": secs} for secs in (0, 1)]
    configs = [RelayConfig.model_validate(alert_config(free_port(), order)) for order in (rules, rules[::-1])]

    async def body(db: Database, store: AlertStore) -> tuple[list[Any], list[str]]:
        first = config_rule_id("acme", "ledger", configs[0].orgs[0].apps[0].alerts[0])
        async with await psycopg.AsyncConnection.connect(relay_db) as holder:
            async with holder.transaction(force_rollback=True):
                await holder.execute(
                    """INSERT INTO alert_rules (id, org, app, kind, min_interval_secs, webhook_url, source)
                       VALUES (%s, 'acme', 'ledger', 'ExecutorDead', 0, 'http://127.0.0.1:9/', 'config')""",
                    (first,),
                )
                syncs = [asyncio.create_task(store.sync_config(c), name=f"sync {n}") for n, c in enumerate(configs)]
                await waiting_for_locks(holder, 1, *syncs)
                await waiting_for_locks(holder, 2, *syncs)
            outcomes = await asyncio.gather(*syncs, return_exceptions=True)
        return outcomes, sorted(r.id for r in await store.rules_of(frozenset(Kind)))

    outcomes, ids = with_store(relay_db, [], body)
    assert outcomes == [None, None], outcomes
    assert len(ids) == 2, ids


def test_an_app_relay_yaml_lists_again_while_it_is_deleted_is_registered_again(relay_db: str) -> None:
    """An operator deletes app ledger, no longer in relay.yaml, as an instance starts with a file that
    lists it again. The deletion read that the file did not list the app, then the sync listed it,
    then the deletion went on: the app the file lists was gone (and the file's rules with it) until
    the next start. The deletion locks the app's row before it reads: the sync waits for it, then
    registers the app again. Another session holds the app's rule meanwhile."""
    with_ledger = alert_config(free_port(), [])
    without = {**with_ledger, "orgs": [{**with_ledger["orgs"][0], "apps": [{"name": "other"}]}]}

    async def body(db: Database, store: AlertStore) -> tuple[Any, list[Any]]:
        apps = AppStore(db)
        await apps.sync_config(RelayConfig.model_validate(without))
        async with db.transaction() as conn:
            await store.create(conn, {
                "id": "api-rule", "org": "acme", "app": "ledger", "kind": "ExecutorDead", "params": {},
                "min_interval_secs": 0, "webhook_url": "http://127.0.0.1:9/", "secret": None, "format": "json",
                "receiver_app": None, "created_by": "test"})  # fmt: skip
        operator = Operator(db, apps, ExecutorStore(db), None, None)  # type: ignore[arg-type]
        async with await psycopg.AsyncConnection.connect(relay_db) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM alert_rules WHERE id = 'api-rule' FOR UPDATE")
                deleting = asyncio.create_task(operator.delete_app("acme", "ledger", "api:ops"), name="delete")
                await waiting_for_locks(holder, 1, deleting)
                syncing = asyncio.create_task(sync_config(db, RelayConfig.model_validate(with_ledger)))  # a start's
                deadline = time.monotonic() + 10
                while not syncing.done():  # done at once, or waiting for the deletion
                    cur = await holder.execute("SELECT count(DISTINCT pid) FROM pg_locks WHERE NOT granted")
                    if ((await cur.fetchone()) or (0,))[0] >= 2:
                        break
                    assert time.monotonic() < deadline, "the sync neither ended nor waited"
                    await asyncio.sleep(0.01)
            outcomes = await asyncio.gather(deleting, syncing, return_exceptions=True)
        async with db.connection() as conn:
            cur = await conn.execute("SELECT from_config FROM apps WHERE org = 'acme' AND name = 'ledger'")
            return outcomes, [r["from_config"] for r in await cur.fetchall()]

    outcomes, ledger = with_store(relay_db, [], body)
    assert outcomes == [None, None], outcomes
    assert ledger == [True], "the app relay.yaml lists was deleted"


def test_two_instances_starting_with_relay_yaml_apps_in_another_order_both_start(relay_db: str) -> None:
    """Two instances start at once, their files listing apps ledger and shop in another order. Each
    marked the apps in its file's order and waited for the other's second: PostgreSQL failed one,
    and that instance did not start. The syncs take turns now. Another session holds the first app
    meanwhile, so that both are under way when it lets go."""
    files = []
    for names in (["ledger", "shop"], ["shop", "ledger"]):
        config = alert_config(free_port(), [])
        files.append({**config, "orgs": [{**config["orgs"][0], "apps": [{"name": n} for n in names]}]})
    configs = [RelayConfig.model_validate(f) for f in files]

    async def body(db: Database, store: AlertStore) -> list[Any]:
        apps = AppStore(db)
        await apps.sync_config(configs[0])
        async with await psycopg.AsyncConnection.connect(relay_db) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM apps WHERE org = 'acme' AND name = 'ledger' FOR UPDATE")
                syncs = [asyncio.create_task(apps.sync_config(c), name=f"sync {n}") for n, c in enumerate(configs)]
                await waiting_for_locks(holder, 1, *syncs)
                await waiting_for_locks(holder, 2, *syncs)
            return await asyncio.gather(*syncs, return_exceptions=True)

    assert with_store(relay_db, [], body) == [None, None]


def test_a_rule_put_back_and_taken_out_again_resolves_a_long_death_once(relay_db: str) -> None:
    """An ExecutorDead rule is taken out of relay.yaml while the death it alerted goes on (resolved:
    ``rule_removed``), put back (it draws the same id), and, once relayWorkflowsDays and auditDays
    have passed, taken out again before the death ends. The second removal found the alert open
    again (its ``alert.resolved`` pruned), and the death's end resolved it once more under the same
    key (Relay's workflow of the first resolution pruned): three resolutions of one incident. The
    alert's row says it was resolved: one resolution."""
    settings = RetentionConfig(audit_days=SHORT_AUDIT_DAYS, relay_workflows_days=SHORT_AUDIT_DAYS)
    with WebhookReceiver() as receiver:
        rules, with_rule, without = dead_rule_in_and_out(receiver)
        sender = sender_to(None)

        async def poll_and_deliver(store: AlertStore) -> None:
            await polled_and_delivered(store, sender)

        async def body(db: Database, store: AlertStore) -> tuple[str, list[str]]:
            sender.store = store
            epoch = await declared_dead(db, "stuck")
            await poll_and_deliver(store)  # the alert
            (rule,) = await store.rules_of(frozenset({Kind.EXECUTOR_DEAD}))
            await store.sync_config(without)
            await poll_and_deliver(store)  # its resolution: the rule was removed
            await store.sync_config(with_rule)
            assert [r.id for r in await store.rules_of(frozenset({Kind.EXECUTOR_DEAD}))] == [rule.id]
            await wait_entries_aged(db, "alert.resolved")
            await RetentionStore(db).prune(settings)  # the entry and the removed rule's row go
            await store.sync_config(without)  # taken out again
            await poll_and_deliver(store)
            await recovered(db, "stuck", epoch)  # the death ends
            await poll_and_deliver(store)
            async with db.connection() as conn:
                cur = await conn.execute("SELECT dedupe_key FROM audit_log WHERE action = 'alert.resolved'")
                return rule.id, [str(r["dedupe_key"]) for r in await cur.fetchall()]

        try:
            rule_id, entries = with_store(relay_db, rules, body)
        finally:
            sender.webhooks.close()
    alert, *resolutions = receiver.payloads("ExecutorDead")
    assert alert["idempotencyKey"].startswith(f"{rule_id}:stuck:") and "status" not in alert
    assert [r["resolves"] for r in resolutions] == [alert["idempotencyKey"]], resolutions
    assert resolutions[0]["metadata"]["ended"] == "rule_removed"
    assert entries == [], "the removal again wrote a second alert.resolved"


def test_alerts_the_previous_release_resolved_by_a_rules_removal_are_resolved_once(relay_db: str) -> None:
    """A rolling upgrade: an instance of the release before migration 20 takes an ExecutorDead rule
    out of relay.yaml while two deaths it alerted go on, and writes their ``alert.resolved`` without
    marking the alerts' rows. One death ends after its resolution's workflow is forgotten
    (relayWorkflowsDays, before auditDays): its end resolved the alert a second time. The other goes
    on past auditDays, the rule put back and taken out again: the removal, then the death's end,
    resolved it a second and a third time. The entry counts while it is there, and retention marks
    the row as it prunes the entry: one resolution each."""
    settings = RetentionConfig(audit_days=SHORT_AUDIT_DAYS, relay_workflows_days=SHORT_AUDIT_DAYS)
    with WebhookReceiver() as receiver:
        rules, with_rule, without = dead_rule_in_and_out(receiver)
        sender = sender_to(None)

        async def poll_and_deliver(store: AlertStore) -> None:
            # Each entry read once, as DBOS starts a workflow id once meanwhile.
            await polled_and_delivered(store, sender, overlap_secs=0.0)

        async def body(db: Database, store: AlertStore) -> list[str]:
            sender.store = store
            epochs = {name: await declared_dead(db, name) for name in ("over", "stuck")}
            await poll_and_deliver(store)  # the two alerts
            await store.sync_config(without)
            await poll_and_deliver(store)  # their resolutions: the rule was removed
            async with db.transaction() as conn:  # as the previous release left them
                await conn.execute("UPDATE alerts SET resolved_at = NULL")
            await recovered(db, "over", epochs["over"])
            await poll_and_deliver(store)
            await store.sync_config(with_rule)  # put back
            await wait_entries_aged(db, "alert.resolved")
            await RetentionStore(db).prune(settings)  # the entries and the removed rule's row go
            await store.sync_config(without)  # taken out again
            await poll_and_deliver(store)
            await recovered(db, "stuck", epochs["stuck"])
            await poll_and_deliver(store)
            async with db.connection() as conn:
                cur = await conn.execute("SELECT idempotency_key FROM alerts WHERE resolved_at IS NULL")
                return [str(r["idempotency_key"]) for r in await cur.fetchall()]

        try:
            unmarked = with_store(relay_db, rules, body)
        finally:
            sender.webhooks.close()
    payloads = receiver.payloads("ExecutorDead")
    alerts = sorted(p["idempotencyKey"] for p in payloads if "resolves" not in p)
    resolved = sorted(p["resolves"] for p in payloads if "resolves" in p)
    assert len(alerts) == 2 and resolved == alerts, payloads
    assert unmarked == []


async def sessions_waiting(conn: psycopg.AsyncConnection[Any]) -> int:
    """How many sessions of this database wait for a lock."""
    cur = await conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    row = await cur.fetchone()
    return int(row[0]) if row else 0


def test_rules_taken_out_again_as_retention_prunes_their_old_rows_are_removed_and_pruned_without_a_deadlock(
    relay_db: str,
) -> None:
    """Two relay.yaml rules taken out long ago (more than relayWorkflowsDays) and put back are taken
    out again as retention's round prunes the rows that kept their destinations. The removal upserts
    those rows by id; the round deleted them in the table's order (the other one here, as the table's
    history left it): each held one row and waited for the other, and PostgreSQL failed one of them
    (the instance's start, or the round). The round leaves a row another transaction holds for its
    next round now: both go through, the removed rules' rows are there (recent) for their
    resolutions, and an old row nobody holds is pruned. Another session holds the second rule's row
    meanwhile, so that both are under way when it lets go."""
    rules = [{"kind": "ExecutorDead", "webhook": "http://127.0.0.1:9/", "minIntervalSecs": secs} for secs in (0, 1)]
    without = RelayConfig.model_validate(alert_config(free_port(), []))

    async def body(db: Database, store: AlertStore) -> tuple[list[Any], dict[str, bool]]:
        ids = sorted(r.id for r in await store.rules_of(frozenset(Kind)))
        async with db.transaction() as conn:  # removed long ago, the larger id first in the table
            for removed_id, rule_id in ((ids[1], ids[1]), (ids[0], ids[0]), ("config-long-gone", ids[0])):
                await conn.execute(
                    """INSERT INTO alert_rules_removed (id, org, app, kind, min_interval_secs, webhook_url, format,
                                                       source, created_at, removed_at, removed_why)
                       SELECT %s, org, app, kind, min_interval_secs, webhook_url, format, source, created_at,
                              now() - interval '30 days', 'its rule was taken out of relay.yaml'
                       FROM alert_rules WHERE id = %s""",
                    (removed_id, rule_id),
                )
        async with await psycopg.AsyncConnection.connect(relay_db, autocommit=True) as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM alert_rules_removed WHERE id = %s FOR UPDATE", (ids[1],))
                pruning = asyncio.create_task(RetentionStore(db).prune(RetentionConfig()), name="prune")
                deadline = time.monotonic() + 10
                while not pruning.done() and await sessions_waiting(holder) < 1:  # done, or waiting
                    assert time.monotonic() < deadline, "the round neither ended nor waited"
                    await asyncio.sleep(0.01)
                waiting = 0 if pruning.done() else 1
                syncing = asyncio.create_task(store.sync_config(without), name="sync")
                while await sessions_waiting(holder) < waiting + 1:
                    assert time.monotonic() < deadline and not syncing.done(), "the removal never waited"
                    await asyncio.sleep(0.01)
            outcomes = await asyncio.gather(pruning, syncing, return_exceptions=True)
        async with db.connection() as conn:
            cur = await conn.execute(
                "SELECT id, removed_at > now() - interval '1 hour' AS recent FROM alert_rules_removed ORDER BY id"
            )
            return outcomes, {str(r["id"]): bool(r["recent"]) for r in await cur.fetchall()}

    (pruned, synced), removed = with_store(relay_db, rules, body)
    assert not isinstance(pruned, BaseException) and synced is None, (pruned, synced)
    assert len(removed) == 2 and all(removed.values()), removed


# The advisory lock that holds retention's round where a test's trigger (:func:`pause_retention`) stops it.
PAUSE_KEY = 7_215_420_113_952


async def pause_retention(relay_db: str, table: str, when: str = "") -> None:
    """A trigger, in this test's database only, that makes retention's deletion from ``table`` wait
    while a session holds :data:`PAUSE_KEY`: at its statement, or (``when``, a row's condition) at
    that row, the rows before it deleted already. Its transaction stays open, its deletions uncommitted."""
    level = f"ROW WHEN ({when})" if when else "STATEMENT"
    async with await psycopg.AsyncConnection.connect(relay_db, autocommit=True) as conn:
        await conn.execute(
            f"""CREATE FUNCTION paused() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN PERFORM pg_advisory_xact_lock_shared({PAUSE_KEY}); RETURN OLD; END $$"""
        )
        await conn.execute(f"CREATE TRIGGER paused BEFORE DELETE ON {table} FOR EACH {level} EXECUTE FUNCTION paused()")


async def prune_while_removed(relay_db: str, db: Database, store: AlertStore, without: RelayConfig) -> list[Any]:
    """Retention's round, held by :func:`pause_retention`, and relay.yaml's rules taken out meanwhile
    (the round waiting, the removal under way until it waits too), then the round let go; their
    outcomes (an exception for one that failed)."""
    settings = RetentionConfig(audit_days=SHORT_AUDIT_DAYS)
    async with await psycopg.AsyncConnection.connect(relay_db, autocommit=True) as holder:
        await holder.execute("SELECT pg_advisory_lock(%s)", (PAUSE_KEY,))
        pruning = asyncio.create_task(RetentionStore(db).prune(settings), name="prune")
        deadline = time.monotonic() + 10
        while await sessions_waiting(holder) < 1:
            assert time.monotonic() < deadline and not pruning.done(), "the round never reached the pause"
            await asyncio.sleep(0.01)
        removing = asyncio.create_task(store.sync_config(without), name="sync")
        while await sessions_waiting(holder) < 2:
            assert time.monotonic() < deadline and not removing.done(), "the removal never waited"
            await asyncio.sleep(0.01)
        await holder.execute("SELECT pg_advisory_unlock(%s)", (PAUSE_KEY,))
        return await asyncio.gather(pruning, removing, return_exceptions=True)


async def resolved_by_the_previous_release(
    db: Database, store: AlertStore, sender: AlertSender, with_rule: RelayConfig, without: RelayConfig
) -> list[str]:
    """Two deaths an ExecutorDead rule alerted (executors ``a`` and ``b``), the rule taken out of
    relay.yaml by an instance of the previous release (their ``alert.resolved`` written, delivered,
    the rows not marked), put back, and the entries older than auditDays; the alerts' keys, in order."""
    for name in ("a", "b"):
        await declared_dead(db, name)
    await polled_and_delivered(store, sender, overlap_secs=0.0)  # the two alerts
    await store.sync_config(without)
    await polled_and_delivered(store, sender, overlap_secs=0.0)  # their resolutions
    async with db.transaction() as conn:
        await conn.execute("UPDATE alerts SET resolved_at = NULL")  # as the previous release left them
    await store.sync_config(with_rule)  # put back
    await wait_entries_aged(db, "alert.resolved")
    return sorted(await alert_keys(db))


async def resolved_entries(db: Database) -> tuple[list[str], list[str]]:
    """The ``alert.resolved`` entries' dedupe keys, and the keys of the alerts not marked resolved."""
    async with db.connection() as conn:
        cur = await conn.execute("SELECT dedupe_key FROM audit_log WHERE action = 'alert.resolved' ORDER BY 1")
        entries = [str(r["dedupe_key"]) for r in await cur.fetchall()]
        cur = await conn.execute("SELECT idempotency_key FROM alerts WHERE resolved_at IS NULL ORDER BY 1")
        return entries, [str(r["idempotency_key"]) for r in await cur.fetchall()]


def test_a_rule_taken_out_again_as_retention_prunes_its_alerts_old_resolutions_resolves_them_no_second_time(
    relay_db: str,
) -> None:
    """A rolling upgrade: the previous release resolved two deaths' alerts by their rule's removal
    (the entries alone), the rule was put back, and is taken out again as retention's round, past
    auditDays, has deleted the entries and marked the rows but not committed yet. The removal, which
    found the rows not marked, wrote each entry again once the round committed (the deletion it
    waited for, by the entry's dedupe key, done): a second ``alert.resolved``, and a second
    resolution delivered. The removal waits for the rows the round holds, and finds them marked."""
    with WebhookReceiver() as receiver:
        rules, with_rule, without = dead_rule_in_and_out(receiver)
        sender = sender_to(None)

        async def body(db: Database, store: AlertStore) -> tuple[list[Any], tuple[list[str], list[str]]]:
            sender.store = store
            await resolved_by_the_previous_release(db, store, sender, with_rule, without)
            await pause_retention(relay_db, "recovery_attempts")  # the round's next statement
            outcomes = await prune_while_removed(relay_db, db, store, without)
            await polled_and_delivered(store, sender, overlap_secs=0.0)
            return outcomes, await resolved_entries(db)

        try:
            (pruned, synced), (entries, unmarked) = with_store(relay_db, rules, body)
        finally:
            sender.webhooks.close()
    payloads = receiver.payloads("ExecutorDead")
    alerts = sorted(p["idempotencyKey"] for p in payloads if "resolves" not in p)
    assert len(alerts) == 2 and sorted(p["resolves"] for p in payloads if "resolves" in p) == alerts, payloads
    assert not isinstance(pruned, BaseException) and synced is None, (pruned, synced)
    assert entries == [] and unmarked == [], (entries, unmarked)


def test_a_rule_taken_out_again_as_retention_prunes_its_alerts_old_resolutions_does_not_deadlock(
    relay_db: str,
) -> None:
    """As above, the round caught between its deletions: it has deleted the entry of ``b``'s alert
    (the newer in the log) and not yet ``a``'s. The removal found ``a``'s entry there, wrote nothing
    and marked its row, then waited for the round's deletion of ``b``'s entry; the round, going on
    to mark ``a``'s row, waited for the removal: PostgreSQL failed one of them (here the removal: an
    instance's start). Both lock the rows first, in one order: both
    go through, no entry written again, every row marked."""
    with WebhookReceiver() as receiver:
        rules, with_rule, without = dead_rule_in_and_out(receiver)
        sender = sender_to(None)

        async def body(db: Database, store: AlertStore) -> tuple[list[Any], tuple[list[str], list[str]]]:
            sender.store = store
            a, _ = await resolved_by_the_previous_release(db, store, sender, with_rule, without)
            async with db.transaction() as conn:  # a's entry after b's in the log, for the round to reach last
                await conn.execute(
                    """WITH moved AS (DELETE FROM audit_log WHERE dedupe_key = %s RETURNING *)
                       INSERT INTO audit_log SELECT * FROM moved""",
                    (f"alert.resolved:{a}",),
                )
            await pause_retention(relay_db, "audit_log", f"OLD.dedupe_key = 'alert.resolved:{a}'")
            outcomes = await prune_while_removed(relay_db, db, store, without)
            return outcomes, await resolved_entries(db)

        try:
            (pruned, synced), (entries, unmarked) = with_store(relay_db, rules, body)
        finally:
            sender.webhooks.close()
    assert not isinstance(pruned, BaseException) and synced is None, (pruned, synced)
    assert entries == [] and unmarked == [], (entries, unmarked)


def test_the_upgrade_marks_the_alerts_an_earlier_release_resolved(relay_db: str) -> None:
    """Migration 20: an alert whose ``alert.resolved`` an earlier release wrote (its rule removed
    while its death went on) is marked resolved, so that its death's end, read by this release, does
    not resolve it again; an alert with no such entry is not."""
    assert migrate(relay_db, [m for m in MIGRATIONS if m.version <= 19])[-1] == 19
    with psycopg.connect(relay_db) as conn:
        for key in ("r:gone:1", "r:open:1"):
            conn.execute(
                """INSERT INTO alerts (idempotency_key, rule_id, org, app, kind, subject, status)
                   VALUES (%s, 'r', 'acme', 'ledger', 'ExecutorDead', %s, 'sent')""",
                (key, key.split(":")[1]),
            )
        conn.execute(
            """INSERT INTO audit_log (org, app, action, executor_id, actor, detail, dedupe_key)
               VALUES ('acme', 'ledger', 'alert.resolved', 'gone', 'relay', '{}', 'alert.resolved:r:gone:1')"""
        )
    assert migrate(relay_db) == [m.version for m in MIGRATIONS if m.version > 19]
    with psycopg.connect(relay_db) as conn:
        marked = conn.execute("SELECT idempotency_key, resolved_at IS NOT NULL FROM alerts ORDER BY 1").fetchall()
    assert marked == [("r:gone:1", True), ("r:open:1", False)]


def test_a_recovery_verified_after_its_executor_connected_again_resolves_the_deaths_alert(relay_db: str) -> None:
    """A death's recovery is verified (its workflows recovered by the peer), and the executor connects
    again before the write that deletes its record: the record, a live connection's now, is kept. No
    ``executor.deleted`` comes then, nor a final ``recovery.failed`` (the run succeeded), and the
    death's ExecutorDead alert stayed open for good (the soak of seed 50: a paused instance adopted,
    its executor back 0.2 s before the success). The success says the record was kept and ends it."""
    rules = [{"kind": "ExecutorDead", "webhook": "http://127.0.0.1:9/", "minIntervalSecs": 0}]

    async def body(db: Database, store: AlertStore) -> tuple[list[Alert], list[Alert], bool, dict[str, Any]]:
        loops, fired = recording(store)
        epoch = await declared_dead(db, "back")
        await loops.poll_events()
        for alert in fired:
            assert (await store.claim(alert)).send
            await store.finish(alert, True, 1, None, "x", f"sent:{alert.idempotency_key}")
        executors, key = ExecutorStore(db), ExecutorKey("acme", "ledger", "back")
        async with db.transaction() as conn:
            await conn.execute(
                """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status)
                   VALUES ('rec-back', 'acme', 'ledger', 'back', 'v1', %s, 'grace_period', 'waiting_for_peer')""",
                (epoch,),
            )
        info = ExecutorInfoReply(request_id="r", executor_id="back", application_version="v1")
        await executors.connected(Handshake(key, info, "relay-1", "key"))  # back, before the success's write
        recoveries = RecoveryStore(db, executors)
        deleted = await recoveries.succeed(RecoveryRef(key, epoch, "rec-back"), 1, "peer-1", "t", "peer-1")
        async with db.connection() as conn:
            cur = await conn.execute("SELECT detail FROM audit_log WHERE action = 'recovery.succeeded'")
            (row,) = await cur.fetchall()
        # The listing's executorDeleted: this run kept the record (the console's recently-recovered
        # line, which says the executors were removed, does not count it).
        kept = [await recoveries.count("acme", "ledger", "back", "succeeded", None, gone) for gone in (True, False)]
        assert kept == [0, 1], kept
        loops, resolved = recording(store)
        await loops.poll_events()
        # A run that deleted its record (its executor stayed away) is the one counted.
        gone_epoch, gone = await declared_dead(db, "gone"), ExecutorKey("acme", "ledger", "gone")
        async with db.transaction() as conn:
            await conn.execute(
                """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status)
                   VALUES ('rec-gone', 'acme', 'ledger', 'gone', 'v1', %s, 'grace_period', 'dispatching')""",
                (gone_epoch,),
            )
        assert await executors.apply(gone, ExecutorEvent.RECOVERY_SENT, epoch=gone_epoch)
        assert await recoveries.succeed(RecoveryRef(gone, gone_epoch, "rec-gone"), 1, "peer-1", "t2", "peer-1")
        removed = [await recoveries.count("acme", "ledger", "gone", "succeeded", None, g) for g in (True, False)]
        assert removed == [1, 0], removed
        return fired, resolved, deleted, row["detail"]

    fired, resolved, deleted, detail = with_store(relay_db, rules, body)
    assert not deleted and detail.get("recordKept") is True, detail
    assert [r.resolves for r in resolved] == [a.idempotency_key for a in fired] and len(fired) == 1, resolved
    assert resolved[0].metadata["ended"] == "recovered" and "connected again meanwhile" in resolved[0].message


def test_a_recoverys_log_lines_are_written_once_and_bounded_when_its_steps_run_again(
    relay_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """relay.recovery's lines for an attempt failed and a success: a DBOS step run again after a crash
    (its write committed, its output not recorded) wrote its line again, the success's saying the
    record was "kept (it connected again)" though the first run had deleted it; and the failure's
    line held the peer's error whole (an executor's words, a frame up to 64 MiB). Now each is logged
    by the run that recorded it, the error cut as every untrusted text in the log is (printable)."""

    async def body(db: Database, _store: AlertStore) -> None:
        executors, key = ExecutorStore(db), ExecutorKey("acme", "ledger", "x")
        epoch = await declared_dead(db, "x")
        recoveries, ref = RecoveryStore(db, executors), RecoveryRef(key, epoch, "rec-x")
        async with db.transaction() as conn:
            await conn.execute(
                """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status)
                   VALUES ('rec-x', 'acme', 'ledger', 'x', 'v1', %s, 'grace_period', 'dispatching')""",
                (epoch,),
            )
        for attempt in (1, 2):
            assert await executors.apply(key, ExecutorEvent.RECOVERY_SENT, epoch=epoch)
            async with db.transaction() as conn:
                await conn.execute(
                    """INSERT INTO recovery_attempts (recovery_id, attempt, peer_executor_id, mode, outcome)
                       VALUES ('rec-x', %s, 'peer-1', 'same_version', 'dispatched')""",
                    (attempt,),
                )
            for _ in range(2):  # the step, and its run again after a crash
                if attempt == 1:
                    await recoveries.fail_attempt(ref, 1, "peer-1", "boom\n" + "e" * 100_000, "t-fail")
                else:
                    await recoveries.succeed(ref, 2, "peer-1", "t-ok", "peer-1")

    with caplog.at_level(logging.INFO, logger="relay.recovery"):
        with_store(relay_db, [], body)
    lines = [r.getMessage() for r in caplog.records if r.name == "relay.recovery" and "rec-x" in r.message]
    failed = [line for line in lines if "attempt 1 on peer peer-1 failed" in line]
    succeeded = [line for line in lines if "succeeded" in line]
    assert len(failed) == 1 and len(failed[0]) < 500 and "\n" not in failed[0], [x[:200] for x in failed]
    assert succeeded == [
        "recovery rec-x of executor acme/ledger/x succeeded: recovered by peer peer-1, its record deleted"
    ]
