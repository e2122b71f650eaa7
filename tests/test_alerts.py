"""Alerts end to end: a real Relay, real DBOS 3.2 executors, a real webhook receiver (an HTTP
server in the test) and an app whose ``@DBOS.alert_handler`` writes what it receives."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import json
import random
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import psycopg
from dbos import DBOSClient, EnqueueOptions
from dbos._error import DBOSException

from harness.executors import ExecutorProcess
from harness.keys import CONDUCTOR_KEYS, VIEWER_KEYS
from harness.ports import free_port
from harness.receiver import Delivery, WebhookReceiver
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from relay.api.alerts import rule_json
from relay.config import AlertsConfig, RelayConfig, RetentionConfig, ascii_host
from relay.core.alerts import AuditFact, Kind, Observed, Rule, alerts_for_event
from relay.core.destinations import DestinationPolicy
from relay.core.ids import ExecutorKey
from relay.core.lifecycle import ExecutorEvent
from relay.domain.alerts import AlertSender, ConditionObserver, RuleEvaluations
from relay.metrics import ALERTS_SENT
from relay.net.webhook import LOOKUP_THREADS, Attempt, WebhookSender
from relay.store.alerts import AlertStore
from relay.store.apps import AppStore
from relay.store.db import Database
from relay.store.executors import ExecutorStore, Handshake
from relay.store.lease import Lease
from relay.store.retention import RetentionStore
from relay_protocol import MAX_QUEUE_OR_SCHEDULE_NAME_BYTES, ExecutorInfoReply
from tests.prom import scrape
from workflows.alerts import AlertLoops, _send_failed, due_alerts, finish, late_workflow_id
from workflows.services import WORKFLOWS_VERSION, Services, bind

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]
YAML_SECRET = "yaml-secret-of-twenty-chars"


def alert_config(port: int, rules: list[dict[str, Any]], grace: float = 1.0, **alerts: Any) -> dict[str, Any]:
    """relay_yaml with short alert timings, loopback allowed, and ``rules`` on acme's ledger."""
    config = relay_yaml(port, grace=grace)
    config["alerts"] = {
        "allowedDestinations": ["127.0.0.1"],
        "pollIntervalSecs": 0.2,
        "checkIntervalSecs": 0.5,
        "retryInitialSecs": 0.3,
        "retryMaxSecs": 1.0,
        "timeoutSecs": 2.0,
        **alerts,
    }
    config["orgs"][0]["apps"][0]["alerts"] = rules
    return config


def signed(delivery: Delivery, secret: str) -> bool:
    """The receiver's check of X-Relay-Signature, as the README tells receivers to make it."""
    expected = "sha256=" + hmac.new(secret.encode(), delivery.body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, delivery.headers.get("x-relay-signature", ""))


def audit(relay: RelayProcess, action: str) -> list[dict[str, Any]]:
    with relay.api() as api:
        return [e for e in api.get("/audit", params={"limit": 10_000}).json() if e["action"] == action]


def deaths(relay: RelayProcess) -> set[tuple[str, str]]:
    return {(e["executorId"], str(e["detail"]["epoch"])) for e in audit(relay, "executor.dead")}


def keys_by_death(receiver: WebhookReceiver) -> dict[tuple[str, str], set[str]]:
    """The ExecutorDead alerts' keys the receiver accepted, by death (not their resolutions': a death
    recovered by a peer is resolved too)."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for payload in receiver.payloads("ExecutorDead"):
        if payload.get("status") != "resolved":
            found[(payload["executorId"], payload["epoch"])].add(payload["idempotencyKey"])
    return found


def test_a_dead_executor_is_one_signed_delivery_per_rule(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    with WebhookReceiver() as receiver:
        rules = [{"kind": "ExecutorDead", "webhook": receiver.url("/hooks/yaml-path?token=yaml-token"),
                  "secret": YAML_SECRET, "minIntervalSecs": 0}]  # fmt: skip
        relay = start_relay(alert_config(free_port(), rules))
        with relay.api() as api:
            made = api.post("/apps/ledger/alerting-rules", json={
                "ruleType": "ExecutorDead", "webhook": receiver.url("/hooks/api-path?token=api-token"),
                "minIntervalSecs": 0,
            })  # fmt: skip
            assert made.status_code == 201, made.text
            secret = made.json()["secret"]
            listed = api.get("/apps/ledger/alerting-rules")
        assert listed.status_code == 200
        assert {r["source"] for r in listed.json()} == {"config", "api"}
        for shown in (listed.text, made.text.replace(secret, "")):
            for hidden in ("/hooks/", "token", YAML_SECRET, secret):
                assert hidden not in shown
        assert all(r["webhook"] == f"http://127.0.0.1:{receiver.port}" for r in listed.json())

        executor = start_executor(relay.conductor_url)
        assert_eventually(lambda: relay.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 10)
        executor.kill()

        sent = assert_eventually(lambda: len(audit(relay, "alert.sent")) == 2 and audit(relay, "alert.sent"), 20)
        (death,) = deaths(relay)
        arrived = receiver.deliveries("ExecutorDead")
        assert len(arrived) == 2 and all(d.accepted for d in arrived)
        by_path = {d.path.split("?")[0]: d for d in arrived}
        assert signed(by_path["/hooks/yaml-path"], YAML_SECRET)
        assert signed(by_path["/hooks/api-path"], secret)
        assert not signed(by_path["/hooks/api-path"], YAML_SECRET)
        for delivery in arrived:
            payload = delivery.payload
            assert payload["kind"] == "ExecutorDead" and (payload["org"], payload["app"]) == ("acme", "ledger")
            assert (payload["executorId"], payload["epoch"]) == death
            assert payload["message"] and payload["at"].endswith("Z")
            assert delivery.headers["x-relay-idempotency-key"] == payload["idempotencyKey"]
        assert len({d.payload["idempotencyKey"] for d in arrived}) == 2  # one per rule
        assert all(e["executorId"] == executor.executor_id for e in sent)
        assert "/hooks/" not in json.dumps(sent) and "token" not in json.dumps(sent)
        # A delivery is counted once its alert.sent is written (the same step, after the commit):
        # awaited, not read the moment the entries are there.
        assert_eventually(
            lambda: scrape(relay.http, "relay_alerts_sent_total", kind="ExecutorDead") == 2, 10, what="2 sent"
        )
        assert "/hooks/" not in relay.log() and "token=" not in relay.log()


def test_a_flapping_executor_pages_once_per_repeat_interval_and_a_refused_delivery_fails(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """One executor declared dead twice (paused past its grace period, back, then killed): a new key
    per death for a rule with no repeat interval, one alert in all for a rule with a long one, and a
    receiver that answers 400 gets one attempt per death, each ending in ``alert.failed``. Each death
    is over (recovered by the peer, or back): the alerts sent are resolved, each after its alert;
    the one held back by the repeat interval and those that failed are not."""
    with WebhookReceiver() as receiver:
        receiver.refused_prefix = "/refused"
        rules = [
            {"kind": "ExecutorDead", "webhook": receiver.url("/every"), "minIntervalSecs": 0},
            {"kind": "ExecutorDead", "webhook": receiver.url("/damped"), "minIntervalSecs": 600},
            {"kind": "ExecutorDead", "webhook": receiver.url("/refused"), "minIntervalSecs": 0},
        ]
        relay = start_relay(alert_config(free_port(), rules))
        peer = start_executor(relay.conductor_url)
        flapping = start_executor(relay.conductor_url)
        assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 10)
        assert_eventually(lambda: relay.state_of("acme", "ledger", flapping.executor_id) == "HEALTHY", 10)
        flapping.pause()
        assert_eventually(lambda: len(deaths(relay)) == 1, 15, what="the first death")
        flapping.resume()
        assert_eventually(lambda: relay.state_of("acme", "ledger", flapping.executor_id) == "HEALTHY", 15)
        flapping.kill()
        assert_eventually(lambda: len(deaths(relay)) == 2, 15, what="the second death")

        def arrived(path: str, resolved: bool = False) -> list[Delivery]:
            return [
                d
                for d in receiver.deliveries("ExecutorDead")
                if d.path == path and (d.payload.get("status") == "resolved") == resolved
            ]

        assert_eventually(lambda: len(arrived("/every")) >= 2 and len(audit(relay, "alert.failed")) >= 2, 20)
        assert_eventually(lambda: len(arrived("/every", True)) == 2 and arrived("/damped", True), 20, what="resolved")
        died = deaths(relay)
        assert {(d.payload["executorId"], d.payload["epoch"]) for d in arrived("/every")} == died
        assert len({d.payload["idempotencyKey"] for d in arrived("/every")}) == 2, "a second death is a new alert"
        (damped,) = arrived("/damped")  # the second death came well within its minIntervalSecs
        assert (damped.payload["executorId"], damped.payload["epoch"]) in died
        # Resolved: each alert sent, after it; not the second death's, held back at /damped.
        for path in ("/every", "/damped"):
            order = [d.payload["idempotencyKey"] for d in receiver.deliveries("ExecutorDead") if d.path == path]
            for resolution in arrived(path, True):
                assert order.index(resolution.payload["resolves"]) < order.index(resolution.payload["idempotencyKey"])
            assert {r.payload["resolves"] for r in arrived(path, True)} == {
                d.payload["idempotencyKey"] for d in arrived(path)
            }
        assert not arrived("/refused", True), "a failed alert is not resolved"
        refused = arrived("/refused")
        assert len(refused) == 2 and not any(d.accepted for d in refused), "a 400 is not tried again"
        failed = audit(relay, "alert.failed")
        assert len(failed) == 2 and all(e["detail"]["attempts"] == 1 and "400" in e["detail"]["error"] for e in failed)
        assert all("/refused" not in json.dumps(e) for e in failed)
        # Counted once its alert.failed is written, as a delivery sent is (below): awaited.
        assert_eventually(
            lambda: scrape(relay.http, "relay_alerts_failed_total", kind="ExecutorDead") == 2, 10, what="2 failed"
        )
        # 3 alerts, 3 resolutions. A delivery is counted once the receiver has answered it (its
        # alert.sent's step): the last resolutions' counts awaited, not read the moment they arrived.
        assert_eventually(
            lambda: scrape(relay.http, "relay_alerts_sent_total", kind="ExecutorDead") == 6, 10, what="6 sent"
        )


def test_a_delivery_outlives_the_instance_that_started_it(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """The instance holding a death's delivery (waiting out a failing receiver) is killed: the
    instance that adopts it finishes the delivery, with the same key, and alerts the adoption."""
    with WebhookReceiver() as receiver:
        rules = [
            {"kind": "ExecutorDead", "webhook": receiver.url(), "secret": YAML_SECRET, "minIntervalSecs": 0},
            {"kind": "InstanceAdopted", "webhook": receiver.url()},
        ]
        configs = [alert_config(free_port(), rules) for _ in range(2)]
        for config in configs:
            config["liveness"]["instanceLeaseSecs"] = 1.5
        r1, r2 = (start_relay(config, instance_id=f"relay-{n}") for n, config in enumerate(configs, 1))
        executor = start_executor(r1.conductor_url)
        assert_eventually(lambda: r2.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 10)
        receiver.fail_for(600)
        executor.kill()
        assert_eventually(lambda: receiver.deliveries("ExecutorDead", accepted=False), 15, what="a refused delivery")
        # The failed attempt is logged once its step's checkpoint is written: from then on a kill
        # cannot make the adopter repeat it as attempt 1.
        assert_eventually(lambda: "attempt 1 to " in r1.log() + r2.log(), 15, what="the failed attempt recorded")
        r1.signal(signal.SIGKILL)
        assert r1.proc is not None
        r1.proc.wait()
        adopted = assert_eventually(lambda: audit(r2, "relay.instance_adopted"), 15, what="the adoption")
        receiver.fail_until = 0.0
        (death,) = deaths(r2)
        keys = assert_eventually(lambda: keys_by_death(receiver).get(death), 20, what="the death's delivery")
        assert len(keys) == 1 and all(signed(d, YAML_SECRET) for d in receiver.deliveries("ExecutorDead"))

        def sent_deaths() -> list[dict[str, Any]]:
            return [e for e in audit(r2, "alert.sent") if e["detail"]["kind"] == "ExecutorDead"]

        (sent,) = assert_eventually(sent_deaths, 10)
        assert sent["detail"]["attempts"] >= 2
        (adoption,) = assert_eventually(lambda: receiver.payloads("InstanceAdopted"), 15, what="InstanceAdopted")
        assert adoption["instance"] == "relay-1" and adoption["app"] == "ledger"
        assert adoption["epoch"] == str(adopted[0]["detail"]["leaseEpoch"])


def test_deliveries_outlive_a_failing_receiver_and_a_killed_relay(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """The receiver answers 503 (about 10 s), and Relay is killed meanwhile: once both are back,
    each death has arrived with exactly one idempotency key (repeats of it allowed), signed."""
    with WebhookReceiver() as receiver:
        rules = [{"kind": "ExecutorDead", "webhook": receiver.url(), "secret": YAML_SECRET, "minIntervalSecs": 0}]
        relay = start_relay(alert_config(free_port(), rules, grace=2.0))
        first = start_executor(relay.conductor_url)
        second = start_executor(relay.conductor_url)
        for executor in (first, second):
            assert_eventually(lambda ex=executor: relay.state_of("acme", "ledger", ex.executor_id) == "HEALTHY", 10)

        def refused(executor: ExecutorProcess) -> list[Delivery]:
            return [d for d in receiver.deliveries("ExecutorDead", accepted=False)
                    if d.payload["executorId"] == executor.executor_id]  # fmt: skip

        receiver.fail_for(600)  # down until told otherwise
        first.kill()
        assert_eventually(lambda: refused(first), 15, what="a refused delivery of the first death")
        relay.signal(signal.SIGKILL)  # with the first death's delivery waiting for its next attempt
        assert relay.proc is not None
        relay.proc.wait()
        relay.start()
        assert_eventually(lambda: relay.state_of("acme", "ledger", second.executor_id) == "HEALTHY", 10)
        second.kill()
        assert_eventually(lambda: refused(second), 15, what="a refused delivery of the second death")
        attempts_of_first = len(refused(first))
        receiver.fail_until = 0.0  # the receiver is back

        def delivered() -> bool:
            died = deaths(relay)
            return len(died) >= 2 and set(keys_by_death(receiver)) >= died

        assert_eventually(delivered, 30, interval=0.2)
        died, keys = deaths(relay), keys_by_death(receiver)
        assert {executor for executor, _ in died} >= {first.executor_id, second.executor_id}
        assert set(keys) == died, "an alert for each death, and none for anything else"
        assert all(len(found) == 1 for found in keys.values()), keys
        assert all(signed(d, YAML_SECRET) for d in receiver.deliveries("ExecutorDead"))
        assert attempts_of_first >= 2, "the first death's delivery went on trying after the restart"

        # The deaths' alerts (not their resolutions, sent once the receiver was back, often at once).
        def alerts_sent() -> list[dict[str, Any]]:
            return [e for e in audit(relay, "alert.sent") if "resolves" not in e["detail"]]

        sent = assert_eventually(lambda: len(alerts_sent()) >= 2 and alerts_sent(), 10)
        assert all(entry["detail"]["attempts"] >= 2 for entry in sent), sent


def test_a_recovery_failing_again_and_again_is_one_alert_at_its_threshold(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """The only peer answers every ``recovery`` with a failure: RecoveryFailed fires once its
    second attempt has failed, and the attempts after it are the same alert (one key)."""
    with WebhookReceiver() as receiver:
        rules = [{"kind": "RecoveryFailed", "attempts": 2, "webhook": receiver.url(), "minIntervalSecs": 0}]
        config = alert_config(free_port(), rules, grace=0.5)
        config["liveness"].update(
            recoveryAckTimeoutSecs=1.5, failoverBackoffInitialSecs=0.3, failoverBackoffMaxSecs=0.6
        )
        relay = start_relay(config)
        dying = start_executor(relay.conductor_url)
        url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
        refusal = {"recovery": {"success": False, "error_message": "disk full"}}
        with SimulatedPeer(url, "refusing-peer", "answer", replies=refusal) as peer:
            assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 10)
            dying.kill()
            assert_eventually(lambda: len(audit(relay, "recovery.failed")) >= 3, 30, what="three failed attempts")
            (alert,) = assert_eventually(lambda: receiver.payloads("RecoveryFailed"), 10, what="RecoveryFailed")
        assert alert["executorId"] == dying.executor_id and "disk full" in alert["message"]
        assert alert["metadata"]["failed_attempts"] == "2", "fired at its threshold, not before nor later"
        (death,) = deaths(relay)
        assert alert["epoch"] == death[1]
        assert len({p["idempotencyKey"] for p in receiver.payloads("RecoveryFailed")}) == 1


def test_a_deaths_alerts_are_resolved_once_it_is_over_by_its_coming_back_or_a_peers_recovery(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """A death's ExecutorDead and RecoveryFailed alerts are resolved when the death is over, once
    each and after their alert: the executor, paused past its grace period while the only peer
    refuses to recover it, connects again (both resolved, saying so); then, killed with -9, it is
    recovered by a real peer (its ExecutorDead resolved, naming the peer; the RecoveryFailed rule
    alerted nothing for that death, so it resolves nothing)."""
    with WebhookReceiver() as receiver:
        rules = [
            {"kind": "ExecutorDead", "webhook": receiver.url("/dead"), "minIntervalSecs": 0},
            {"kind": "RecoveryFailed", "attempts": 1, "webhook": receiver.url("/failed"), "minIntervalSecs": 0},
        ]
        config = alert_config(free_port(), rules, grace=0.5)
        config["liveness"].update(
            recoveryAckTimeoutSecs=1.5, failoverBackoffInitialSecs=0.3, failoverBackoffMaxSecs=0.6
        )
        relay = start_relay(config)
        dying = start_executor(relay.conductor_url)
        url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
        refusal = {"recovery": {"success": False, "error_message": "disk full"}}

        def at(path: str) -> list[dict[str, Any]]:
            """What the receiver accepted at ``path`` about ``dying`` (the refusing peer dies too, at the end)."""
            return [
                d.payload
                for d in receiver.deliveries(accepted=True)
                if d.path == path and d.payload["executorId"] == dying.executor_id
            ]

        with SimulatedPeer(url, "refusing-peer", "answer", replies=refusal) as refusing:
            assert_eventually(lambda: relay.state_of("acme", "ledger", refusing.executor_id) == "HEALTHY", 10)
            assert_eventually(lambda: relay.state_of("acme", "ledger", dying.executor_id) == "HEALTHY", 10)
            dying.pause()
            # (Two rules' deliveries, each its own workflow: the ExecutorDead alert may arrive second.)
            assert_eventually(lambda: at("/failed") and at("/dead"), 20, what="RecoveryFailed and ExecutorDead")
            assert not any(p.get("status") for p in at("/dead") + at("/failed")), "not over yet"
            dying.resume()
            assert_eventually(lambda: len(at("/dead")) == 2 and len(at("/failed")) == 2, 20, what="both resolved")
        (first,) = {d for d in deaths(relay) if d[0] == dying.executor_id}
        for path in ("/dead", "/failed"):
            alert, resolution = at(path)
            assert "status" not in alert and (alert["executorId"], alert["epoch"]) == first
            assert resolution["status"] == "resolved" and resolution["resolves"] == alert["idempotencyKey"]
            assert resolution["idempotencyKey"] == alert["idempotencyKey"] + ":resolved"
            assert (resolution["kind"], resolution["executorId"], resolution["epoch"]) == (alert["kind"], *first)
            assert f"executor {dying.executor_id} connected again" in resolution["message"], resolution["message"]
            assert resolution["metadata"]["ended"] == "connected_again"

        peer = start_executor(relay.conductor_url)
        assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 10)
        assert_eventually(lambda: relay.state_of("acme", "ledger", dying.executor_id) == "HEALTHY", 10)
        dying.kill()
        assert_eventually(lambda: len(at("/dead")) == 4, 20, what="the second death's alert and resolution")
        (second,) = {d for d in deaths(relay) if d[0] == dying.executor_id} - {first}
        alert, resolution = at("/dead")[2:]
        assert "status" not in alert and (alert["executorId"], alert["epoch"]) == second
        assert resolution["resolves"] == alert["idempotencyKey"] and resolution["epoch"] == second[1]
        assert f"recovered by peer {peer.executor_id}" in resolution["message"], resolution["message"]
        assert resolution["metadata"]["recovered_by"] == peer.executor_id
        resolved = sorted(p["resolves"] for p in at("/dead") + at("/failed") if p.get("status"))
        # A delivery's alert.sent is recorded once the receiver has answered it: awaited, not read at once.
        assert_eventually(
            lambda: set(resolved) <= {e["detail"].get("resolves") for e in audit(relay, "alert.sent")},
            10,
            what="each resolution's alert.sent names it",
        )
        time.sleep(1.0)  # a few more polls: nothing repeats, and the second death's RecoveryFailed stays quiet
        assert (len(at("/dead")), len(at("/failed"))) == (4, 2)


def test_a_death_over_before_its_alert_was_claimed_is_still_resolved_after_it(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """An executor killed with -9 that left nothing PENDING, whose only peer runs another version:
    its record is deleted within milliseconds of its death (nothing to recover), so the poll reads
    the death and its end together, and the resolution's first look may come before the alert's
    delivery claimed its key (here: the claim waits for the rule's row, held as another instance's
    claim would hold it). It waits for that delivery rather than finding the alert never claimed:
    the alert, then its resolution saying there was nothing to recover."""
    with WebhookReceiver() as receiver:
        rules = [{"kind": "ExecutorDead", "webhook": receiver.url(), "minIntervalSecs": 0}]
        config = alert_config(free_port(), rules, grace=0.3)
        relay = start_relay(config)
        dying = start_executor(relay.conductor_url)
        peer = start_executor(relay.conductor_url, version="v2")
        assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 10)
        assert_eventually(lambda: relay.state_of("acme", "ledger", dying.executor_id) == "HEALTHY", 10)
        # Another instance's claim of the same rule holds its row (FOR UPDATE): the alert's claim waits.
        with psycopg.connect(relay.database_url) as held:
            held.execute("SELECT 1 FROM alert_rules FOR UPDATE")
            dying.kill()
            assert_eventually(lambda: audit(relay, "executor.deleted"), 20, what="the death over")
            time.sleep(1.5)  # a few polls: the resolution's delivery has begun, its alert still unclaimed
            assert receiver.payloads() == []
            held.rollback()
        alert, resolution = assert_eventually(lambda: len(receiver.payloads()) >= 2 and receiver.payloads(), 20)
        assert "status" not in alert and alert["executorId"] == dying.executor_id
        assert resolution["resolves"] == alert["idempotencyKey"], resolution
        assert resolution["metadata"]["ended"] == "nothing_pending" and "nothing to recover" in resolution["message"]
        assert resolution["metadata"]["verified_by"] == peer.executor_id


def received(evidence_db: str, name: str) -> list[dict[str, Any]]:
    """What the receiving app's alert handler wrote."""
    with psycopg.connect(evidence_db) as conn:
        try:
            rows = conn.execute(
                "SELECT message, metadata, executor_id FROM alerts_received WHERE name = %s", (name,)
            ).fetchall()
        except psycopg.errors.UndefinedTable:
            return []
    return [{"message": m, "metadata": md, "executorId": e} for m, md, e in rows]


def test_conditions_fire_to_webhooks_and_to_an_apps_alert_handler(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    """Failed workflows, a queue held up, a recovery blocked and an app with no executor left, each
    delivered once: to the webhook, or through the ``alert`` message to another app's handler."""
    with WebhookReceiver() as receiver:
        rules = [
            {"kind": "WorkflowFailure", "workflowName": "failing", "count": 3, "windowSecs": 120,
             "webhook": receiver.url(), "format": "slack"},
            {"kind": "SlowQueue", "queueName": "serial", "thresholdSecs": 1, "receiverApp": "notifier"},
            {"kind": "UnresponsiveApplication", "forSecs": 1, "webhook": receiver.url()},
            {"kind": "RecoveryBlocked", "reason": "no_healthy_peer", "forSecs": 1, "receiverApp": "notifier"},
        ]  # fmt: skip
        config = alert_config(free_port(), rules)
        config["orgs"][0]["apps"].append({"name": "notifier"})
        relay = start_relay(config)
        env = {"RELAY_TEST_EVIDENCE": evidence_db}
        notifier = start_executor(
            relay.conductor_url, app="notifier", version="n1", module="harness.alert_app", env=env
        )
        ledger = start_executor(relay.conductor_url, module="harness.alert_app", env={
            **env, "RELAY_TEST_FAILURES": "3", "RELAY_TEST_HOLD_QUEUE": "2"})  # fmt: skip

        failures = assert_eventually(lambda: receiver.deliveries("WorkflowFailure"), 20, what="WorkflowFailure")
        slack = failures[0].payload
        assert set(slack) == {"text", "blocks"} and "failing" in slack["text"]
        assert failures[0].headers["x-relay-idempotency-key"] in json.dumps(slack["blocks"])
        (slow,) = assert_eventually(lambda: received(evidence_db, "SlowQueue"), 20, what="SlowQueue at notifier")
        assert slow["metadata"]["queue_name"] == "serial" and slow["executorId"] == notifier.executor_id
        # The app enqueues three workflows on the queue one after the other (the blocker, still
        # ENQUEUED like the two jobs, as the count of 3 in most runs shows): a check that falls
        # between their reaching the threshold rightly counts fewer (one CI run counted 1). The alert
        # says what it counted.
        stuck = int(slow["metadata"]["stuck_workflow_count"])
        assert 1 <= stuck <= 3 and slow["message"].startswith(f"{stuck} workflows of app ledger have waited"), slow
        assert slow["metadata"]["threshold_secs"] == "1" and slow["metadata"]["oldest_enqueued_at"], slow
        assert slow["metadata"]["application_name"] == "ledger" and slow["metadata"]["idempotency_key"]

        ledger.kill()  # its only executor: nobody can recover it, and nobody answers for the app
        unresponsive = assert_eventually(lambda: receiver.payloads("UnresponsiveApplication"), 20)
        assert unresponsive[0]["appName"] == "ledger" and unresponsive[0]["metadata"]["connected_executor_count"] == "0"
        (blocked,) = assert_eventually(lambda: received(evidence_db, "RecoveryBlocked"), 20)
        assert blocked["metadata"]["executor_id"] == ledger.executor_id
        assert blocked["metadata"]["blocked_reason"] == "no_healthy_peer"

        # A condition that keeps holding is one alert, however many rounds see it.
        assert_eventually(lambda: len(audit(relay, "alert.sent")) >= 4, 10)
        headers = [d.headers["x-relay-idempotency-key"] for d in receiver.deliveries()]
        assert len(headers) == len(set(headers)) == 2
        assert len(received(evidence_db, "SlowQueue")) == 1 and len(received(evidence_db, "RecoveryBlocked")) == 1


def round_began(relay: RelayProcess, idempotency_key: str) -> float:
    """When the round that started the delivery ``alert:{idempotency_key}`` began: its first step (the
    delivery's parent is the rule's workflow, whose parent is the round)."""
    with psycopg.connect(relay.database_url) as conn:
        row = conn.execute(
            """SELECT min(o.started_at_epoch_ms) FROM dbos.workflow_status w
               JOIN dbos.workflow_status r ON r.workflow_uuid = w.parent_workflow_id
               JOIN dbos.operation_outputs o ON o.workflow_uuid = r.parent_workflow_id
               WHERE w.workflow_uuid = %s""",
            (f"alert:{idempotency_key}",),
        ).fetchone()
    assert row is not None and row[0] is not None, f"no round started alert:{idempotency_key}"
    return int(row[0]) / 1000


def test_apps_whose_executors_do_not_answer_hold_up_no_other_apps_alert(start_relay: StartRelay) -> None:
    """Five apps whose only executor never answers, each with a WorkflowFailure rule that waits
    executorRequestTimeoutSecs (1 s) for it, come before ledger's rule in every round: ledger's
    failures arrive about a timeout after the round began, not after the five (5 s) as when the
    round asked one rule after the other."""
    timeout, interval, mute = 1.0, 6.0, [f"mute-{n}" for n in range(5)]
    with WebhookReceiver() as receiver:
        config = alert_config(free_port(), [], checkIntervalSecs=interval)
        config["server"]["executorRequestTimeoutSecs"] = timeout
        config["orgs"][0]["apps"] += [
            {"name": app, "alerts": [{"kind": "WorkflowFailure", "webhook": receiver.url(f"/{app}")}]} for app in mute
        ]
        relay = start_relay(config)
        failed = {"get_workflow_aggregates": {"output": [{"group": {"name": "charge"}, "count": 2}]}}
        with contextlib.ExitStack() as stack:
            for app in [*mute, "ledger"]:
                url = f"ws://127.0.0.1:{relay.port}/websocket/{app}/{CONDUCTOR_KEYS['acme']}"
                replies = {} if app in mute else failed
                stack.enter_context(SimulatedPeer(url, f"{app}-1", "answer", replies=replies, others="silent"))
            for app in [*mute, "ledger"]:
                assert_eventually(lambda app=app: relay.state_of("acme", app, f"{app}-1") == "HEALTHY", 10)
            # Its id sorts after relay.yaml's (config-...): the last rule of every round.
            with psycopg.connect(relay.database_url, autocommit=True) as conn:
                conn.execute(
                    """INSERT INTO alert_rules (id, org, app, kind, params, min_interval_secs, webhook_url, source)
                       VALUES ('z-ledger', 'acme', 'ledger', 'WorkflowFailure', '{}', 0, %s, 'api')""",
                    (receiver.url("/ledger"),),
                )
            first = assert_eventually(lambda: [d for d in receiver.deliveries() if d.path == "/ledger"], 3 * interval)
        assert first[0].payload["app"] == "ledger" and first[0].payload["workflowName"] == "*"
        # Timed from the start of the round that delivered it (its first step, by Relay's clock), not
        # from the interval's boundary: a round that starts late on a busy machine is not counted.
        took = first[0].at - round_began(relay, first[0].headers["x-relay-idempotency-key"])
        assert 0 < took < 3 * timeout, f"ledger's alert came {took:.1f} s after its round began"
        assert not [d for d in receiver.deliveries() if d.path != "/ledger"], "the mute apps never answered"


def test_an_apps_alert_goes_out_while_another_apps_rule_waits_for_its_hanging_executors(
    start_relay: StartRelay,
) -> None:
    """App hanging's two executors are connected and never answer: its WorkflowFailure rule waits
    executorRequestTimeoutSecs (5 s) for each, 10 s, in every round. Ledger's only executor drops:
    its UnresponsiveApplication alert arrives within a few seconds, not once hanging's evaluation
    has given up, as when a round started its deliveries only after every rule was evaluated."""
    timeout = 5.0
    with WebhookReceiver() as receiver:
        rules = [{"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": 0,
                  "webhook": receiver.url("/ledger")}]  # fmt: skip
        config = alert_config(free_port(), rules, grace=60)  # DISCONNECTED all along, never dead
        config["server"]["executorRequestTimeoutSecs"] = timeout
        config["orgs"][0]["apps"].append(
            {"name": "hanging", "alerts": [{"kind": "WorkflowFailure", "webhook": receiver.url("/hanging")}]}
        )
        relay = start_relay(config)

        def url(app: str) -> str:
            return f"ws://127.0.0.1:{relay.port}/websocket/{app}/{CONDUCTOR_KEYS['acme']}"

        with contextlib.ExitStack() as stack:
            hanging = [stack.enter_context(SimulatedPeer(url("hanging"), f"hanging-{n}", "answer", others="silent"))
                       for n in (1, 2)]  # fmt: skip
            with SimulatedPeer(url("ledger"), "ledger-1", "answer"):
                for app, executor in [("hanging", "hanging-1"), ("hanging", "hanging-2"), ("ledger", "ledger-1")]:
                    assert_eventually(lambda a=app, e=executor: relay.state_of("acme", a, e) == "HEALTHY", 10)
                assert_eventually(lambda: any(p.requests["get_workflow_aggregates"] for p in hanging), 10,
                                  what="hanging's rule waiting for its executors")  # fmt: skip
                dropped = time.time()  # before the drop, which the alert follows
            (alert,) = assert_eventually(lambda: receiver.deliveries("UnresponsiveApplication"), 4 * timeout)
        took = alert.at - dropped
        assert alert.payload["app"] == "ledger"
        assert took < timeout, f"ledger's alert came {took:.1f} s after its executor dropped"
        assert not receiver.deliveries("WorkflowFailure"), "hanging's executors never answered"


def test_a_rule_still_being_evaluated_is_left_out_of_the_next_rounds_and_holds_one_turn() -> None:
    """Rounds come every checkIntervalSecs whether or not a hanging app's rule has finished: a round
    after the first skips the rule, rather than take another turn for it, so that rules of hanging
    apps do not pile up until every turn is theirs and the other rules wait."""

    async def scenario() -> tuple[list[bool], bool, bool]:
        turns = RuleEvaluations(at_once=2)
        hanging, released = asyncio.Event(), asyncio.Event()

        async def evaluate(rule_id: str) -> bool:
            async with turns.turn(rule_id) as evaluating:
                if evaluating and rule_id == "hanging":
                    hanging.set()
                    await released.wait()
                return evaluating

        first = asyncio.create_task(evaluate("hanging"))
        await hanging.wait()
        later_rounds = [await asyncio.wait_for(evaluate("hanging"), 5) for _ in range(3)]  # each skips it at once
        other = await asyncio.wait_for(evaluate("ledger"), 5)  # the turn left is free
        released.set()
        return later_rounds, other, await first

    later_rounds, other, first = asyncio.run(scenario())
    assert later_rounds == [False, False, False] and other and first


def test_a_round_the_previous_release_began_finishes_with_its_own_steps(start_relay: StartRelay) -> None:
    """This release's rounds are ``relay.alerts.round`` (a workflow per rule asked of its app's executors,
    each evaluated in one step; the rules read from the registry in one step of the round's). A
    ``relay.alerts.check`` (one step per rule) that an instance of the previous release began, handed
    to DBOS's recovery (its internal queue) in a rolling upgrade, still runs here, with its steps; and
    an interval whose round that instance started first is left to it, without a warning."""
    interval = 1.0
    rules = [{"kind": "UnresponsiveApplication", "webhook": "http://127.0.0.1:9/"},
             {"kind": "RecoveryBlocked", "webhook": "http://127.0.0.1:9/"},
             {"kind": "WorkflowFailure", "webhook": "http://127.0.0.1:9/"}]  # fmt: skip
    relay = start_relay(alert_config(free_port(), rules, checkIntervalSecs=interval))

    def steps(workflow_id: str) -> list[str]:
        with psycopg.connect(relay.database_url) as conn:
            rows = conn.execute(
                "SELECT function_name FROM dbos.operation_outputs WHERE workflow_uuid = %s ORDER BY function_id",
                (workflow_id,),
            ).fetchall()
        return [name for (name,) in rows]

    client = DBOSClient(system_database_url=relay.database_url, application_name="relay")
    try:
        # An interval to come, whose round the old instance began: counted once the client is made (a
        # loaded machine may take seconds to), so that it is still to come when the round is enqueued.
        later = int(time.time() // interval) + 3
        options: EnqueueOptions = {
            "workflow_name": "relay.alerts.check",
            "queue_name": "_dbos_internal_queue",
            "workflow_id": f"relay-alerts:{later}",
            "app_version": WORKFLOWS_VERSION,
        }
        assert client.enqueue(options).get_result() == 0
    finally:
        client.destroy()
    assert steps(f"relay-alerts:{later}") == ["relay.alerts.rules"] + ["relay.alerts.evaluate"] * 3
    assert_eventually(lambda: time.time() > (later + 1.5) * interval, 4 * interval)

    def rounds_ended() -> list[str]:
        with psycopg.connect(relay.database_url) as conn:
            rounds = conn.execute(
                "SELECT workflow_uuid FROM dbos.workflow_status"
                " WHERE name = 'relay.alerts.round' AND status = 'SUCCESS'"
            )
            return [wid for (wid,) in rounds.fetchall()]

    # The round after it began at its interval's start; it ends a few transactions later (later still
    # on a loaded machine): awaited, not read at a moment of the clock.
    ours = assert_eventually(
        lambda: (o := rounds_ended()) and f"relay-alerts:{later + 1}" in o and o, 10, what="the round after it ended"
    )
    assert ours and all(wid.startswith("relay-alerts:") for wid in ours)
    # A workflow for the rule asked of executors; the two read from the registry in the round's own step.
    assert steps(ours[0]) == ["relay.alerts.rules", "relay.alerts.rule", "relay.alerts.evaluate_registry"]
    with psycopg.connect(relay.database_url) as conn:
        rule_runs = conn.execute(
            "SELECT workflow_uuid, name FROM dbos.workflow_status WHERE parent_workflow_id = %s", (ours[0],)
        ).fetchall()
    assert [name for _, name in rule_runs] == ["relay.alerts.rule"]
    for wid, _ in rule_runs:
        assert wid.startswith(f"{ours[0]}:rule:"), wid
        # The round does not wait for its rules' workflows: the rule's step may come after the round's end.
        assert_eventually(lambda wid=wid: steps(wid) == ["relay.alerts.evaluate_rule"], 10, what=f"{wid}'s step")
    assert f"relay-alerts:{later + 1}" in ours, "the round after it is this release's"
    assert relay.runs_of("relay.alerts.check") == 1, "this release starts its rounds as relay.alerts.round"
    assert "cannot start the alert check" not in relay.log()


def test_rules_through_the_api(start_relay: StartRelay) -> None:
    """Conductor's shapes, the allow-list's 422s, relay.yaml's rules read-only, the secret shown once."""
    rules = [{"kind": "RecoveryFailed", "attempts": 2, "webhook": "http://127.0.0.1:9/yaml/secret-path"}]
    relay = start_relay(alert_config(free_port(), rules))
    with relay.api() as api:

        def create(body: dict[str, Any]) -> Any:
            return api.post("/apps/ledger/alerting-rules", json=body)

        for url, why in [
            ("http://10.1.2.3/hook", "private"),
            ("http://169.254.169.254/latest/meta-data", "link-local"),
            ("http://[::1]:8080/hook", "loopback"),
            ("http://192.168.0.1:8080/hook", "private"),
            ("ftp://127.0.0.1/hook", "scheme"),
        ]:
            refused = create({"ruleType": "ExecutorDead", "webhook": url})
            assert refused.status_code == 422, url
            problem = refused.json()
            assert problem["errors"][0]["location"] == "body.webhook" and why in problem["detail"], problem
        for body, where in [
            ({"ruleType": "ExecutorDead", "ruleMetadata": {"count": 3}}, "body.ruleMetadata.count"),
            ({"ruleType": "SlowQueue", "ruleMetadata": {"nope": 1}}, "body.ruleMetadata.nope"),
            ({"ruleType": "UnresponsiveApplication"}, "body.receivingAppName"),
            ({"ruleType": "ExecutorDead", "minIntervalSecs": False}, "body.minIntervalSecs"),
            ({"ruleType": "ExecutorDead", "secret": "short"}, "body.secret"),
            ({"ruleType": "Nope"}, "body.ruleType"),
        ]:
            refused = create(body)
            assert refused.status_code == 422 and refused.json()["errors"][0]["location"] == where, refused.text

        # A secret with a control character was taken: the signature is still a valid header, but the
        # receiver, given the secret from a file or a form that keeps no such character, refused every
        # delivery as forged.
        for secret in ["0123456789abcdef\n", "0123456789\r\nabcdef", "\t0123456789abcdef", "0123456789abcdef\x7f"]:
            refused = create({"ruleType": "ExecutorDead", "webhook": "http://127.0.0.1:9/x", "secret": secret})
            assert refused.status_code == 422, (secret, refused.text)
            (error,) = refused.json()["errors"]
            assert error["location"] == "body.secret" and "none of them a control character" in error["message"], error

        # JSON's 1e999 is an infinity; past ten years, PostgreSQL cannot take now() minus it: either
        # made every delivery of the rule fail (or gave a 503 quoting SQL), and not a 422.
        hook = '"webhook": "http://127.0.0.1:9/x"'
        for kind, given, where, why in [
            ("ExecutorDead", '"minIntervalSecs": 1e999', "body.minIntervalSecs", "finite number"),
            ("ExecutorDead", '"minIntervalSecs": 2e11', "body.minIntervalSecs", "less than or equal to"),
            ("WorkflowFailure", '"ruleMetadata": {"windowSecs": 1e999}', "body.ruleMetadata.windowSecs", "finite"),
            ("WorkflowFailure", '"ruleMetadata": {"period_secs": 1e12}', "body.ruleMetadata.period_secs", "less"),
            ("WorkflowFailure", '"ruleMetadata": {"count": 1e30}', "body.ruleMetadata.count", "less than"),
            ("SlowQueue", '"ruleMetadata": {"thresholdSecs": 1e999}', "body.ruleMetadata.thresholdSecs", "finite"),
            ("UnresponsiveApplication", '"ruleMetadata": {"forSecs": 1e999}', "body.ruleMetadata.forSecs", "finite"),
            ("RecoveryFailed", '"ruleMetadata": {"attempts": 99999999999}', "body.ruleMetadata.attempts", "less"),
        ]:
            raw = f'{{"ruleType": "{kind}", {hook}, {given}}}'.encode()
            refused = api.post("/apps/ledger/alerting-rules", content=raw, headers={"content-type": "application/json"})
            assert refused.status_code == 422, (given, refused.status_code, refused.text)
            (error,) = refused.json()["errors"]
            assert error["location"] == where and why in error["message"], (given, error)

        missing = create({"ruleType": "ExecutorDead", "receivingAppName": "no-such-app"})
        assert missing.status_code == 404 and "no-such-app" in missing.json()["detail"]
        made = create({"ruleType": "WorkflowFailure", "minIntervalSecs": 60,
                       "ruleMetadata": {"workflow_name": "*", "threshold": 5, "period_secs": 600}})  # fmt: skip
        assert made.status_code == 201, made.text
        rule = made.json()
        assert "secret" not in rule and rule["receivingAppId"] == "ledger" and rule["appId"] == "ledger"
        assert rule["ruleMetadata"] == {"workflowName": None, "count": 5, "windowSecs": 600}
        assert rule["minIntervalSecs"] == 60 and rule["lastFiredAt"] is None and rule["readOnly"] is False
        given = create({"ruleType": "ExecutorDead", "webhook": "http://127.0.0.1:9/x", "secret": "s" * 20})
        assert given.status_code == 201 and "secret" not in given.json() and given.json()["secretSet"] is True

        listed = api.get("/apps/ledger/alerting-rules").json()
        config_rule = next(r for r in listed if r["source"] == "config")
        assert config_rule["readOnly"] and config_rule["ruleType"] == "RecoveryFailed"
        assert "secret-path" not in json.dumps(listed) and "s" * 20 not in json.dumps(listed)
        refused = api.delete(f"/apps/ledger/alerting-rules/{config_rule['id']}")
        assert refused.status_code == 409 and "relay.yaml" in refused.json()["detail"]
        assert api.delete(f"/apps/ledger/alerting-rules/{rule['id']}").status_code == 204
        assert api.delete(f"/apps/ledger/alerting-rules/{rule['id']}").status_code == 404
        assert api.get("/apps/nope/alerting-rules").status_code == 404
        done = [e["action"] for e in api.get("/audit").json() if e["detail"].get("result") != "failure"]
        assert done.count("alerting_rule.create") == 2 and done.count("alerting_rule.delete") == 1
        # The 422s are audited as refused attempts, at most 10 a minute per key and action.
        refusals = [e for e in api.get("/audit", params={"action": "alerting_rule.create"}).json()
                    if e["detail"].get("result") == "failure"]  # fmt: skip
        assert 1 <= len(refusals) <= 10 and {e["detail"]["status"] for e in refusals} == {422}, refusals
    with relay.api(key=VIEWER_KEYS["acme"]) as viewer:
        assert viewer.get("/apps/ledger/alerting-rules").status_code == 200
        assert viewer.post("/apps/ledger/alerting-rules", json={"ruleType": "ExecutorDead"}).status_code == 403


def test_a_key_limited_to_apps_makes_rules_that_deliver_only_to_its_apps(start_relay: StartRelay) -> None:
    """A key limited to ledger cannot route ledger's alerts to billing's executors, and learns
    nothing of which apps exist: a 403 for any app outside its own, existing or not."""
    relay = start_relay(alert_config(free_port(), []))
    with relay.api() as admin:
        assert admin.put("/apps/billing").status_code == 204
        made = admin.post("/tokens/ledger-ops", json={"permissions": ["application.write", "application.read"],
                                                      "appNames": ["ledger"]})  # fmt: skip
        assert made.status_code == 201, made.text
    with relay.api(key=made.json()["token"]) as limited:

        def create(body: dict[str, Any]) -> httpx.Response:
            return limited.post("/apps/ledger/alerting-rules", json={"ruleType": "ExecutorDead", **body})

        to_billing, to_nowhere = create({"receivingAppName": "billing"}), create({"receivingAppName": "no-such-app"})
        assert to_billing.status_code == 403 and "'billing'" in to_billing.json()["detail"], to_billing.text
        assert to_nowhere.status_code == 403, to_nowhere.text  # not a 404: that would say billing exists
        assert create({"receivingAppName": "ledger"}).status_code == 201
        assert create({}).status_code == 201  # ledger's own executors
        assert create({"webhook": "http://127.0.0.1:9/x"}).status_code == 201
        listed = limited.get("/apps/ledger/alerting-rules").json()
    assert sorted(r["receivingAppId"] or "webhook" for r in listed) == ["ledger", "ledger", "webhook"]
    with relay.api() as admin:  # a key for every app may
        made = admin.post(
            "/apps/ledger/alerting-rules", json={"ruleType": "ExecutorDead", "receivingAppName": "billing"}
        )
        assert made.status_code == 201, made.text


def test_an_app_whose_records_are_all_deleted_is_still_unresponsive(relay_db: str) -> None:
    """An app counts as having had executors while their ids are remembered, not only while their
    records last: a verified recovery deletes a record, and an app never connected stays quiet."""
    rules = [{"kind": "UnresponsiveApplication", "forSecs": 1, "webhook": "http://127.0.0.1:9/"}]

    async def scenario(db: Database, alerts: AlertStore) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        kinds = frozenset({Kind.UNRESPONSIVE_APPLICATION})
        (rule,) = [r for r in await alerts.rules_of(kinds) if r.app == "ledger"]
        observer = ConditionObserver(alerts, gateway=None)  # type: ignore[arg-type]  # not asked for this kind
        never = await observer.observe(rule)
        executors = ExecutorStore(db)
        key = ExecutorKey("acme", "ledger", "only-one")
        info = ExecutorInfoReply(request_id="r", executor_id=key.executor_id, application_version="v1")
        epoch = (await executors.connected(Handshake(key, info, "relay-1", "key"))).epoch
        healthy = await observer.observe(rule)
        lost, dead = ExecutorEvent.LOST, ExecutorEvent.GRACE_EXPIRED
        for event in (lost, dead, ExecutorEvent.RECOVERY_SENT, ExecutorEvent.RECOVERED):  # deleted
            assert await executors.apply(key, event, epoch=epoch)
        deleted = await observer.observe(rule) or []
        # The app deleted (no record left) and created again: its old ids are an earlier app's.
        async with db.transaction() as conn:
            assert await AppStore.delete(conn, "acme", "ledger")
        async with db.transaction() as conn:  # as the API's PUT registers it
            assert await AppStore(db).register(conn, "acme", "ledger")
        return never or [], healthy or [], deleted, await observer.observe(rule) or []

    never, healthy, deleted, recreated = with_store(relay_db, rules, scenario)
    assert never == [] and healthy == [] and recreated == []
    assert [o.subject for o in deleted] == [{"appName": "ledger"}]


# -- the webhook sender on its own, against a real receiver; names resolved by an injected lookup ------


def resolving_to(*addresses: str, asked: list[str] | None = None) -> Callable[..., list[tuple[Any, ...]]]:
    """A getaddrinfo for WebhookSender under which every name resolves to ``addresses``, in that
    order (the names it is asked for are added to ``asked``)."""

    def getaddrinfo(host: str, port: int, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        if asked is not None:
            asked.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in addresses]

    return getaddrinfo


def test_webhook_lookups_that_hang_leave_the_threads_of_the_loops_default_executor_free() -> None:
    """DBOS makes its executor, bounded, the loop's default; a webhook host whose name server never
    answers holds a thread for each lookup well past the delivery's timeout. Those threads must be
    the sender's own, few, and given back when the lookups end."""
    answer = threading.Event()
    lock = threading.Lock()
    running, most = 0, 0
    all_in: list[Callable[[], None]] = []  # sets an asyncio.Event once every lookup thread is taken

    def hanging(host: str, port: int, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            if running == LOOKUP_THREADS:
                all_in[0]()
        answer.wait(10)
        with lock:
            running -= 1
        return resolving_to("93.184.216.34")(host, port)

    async def scenario() -> tuple[int | None, list[Attempt], str | None]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))  # DBOS's, with one thread left
        taken = asyncio.Event()
        all_in.append(lambda: loop.call_soon_threadsafe(taken.set))
        sender = WebhookSender(DestinationPolicy.from_entries([]), 0.5, "t", getaddrinfo=hanging)
        try:
            posts = [asyncio.create_task(sender.post("https://tarpit.example/hook", b"{}", {})) for _ in range(5)]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(taken.wait(), 5.0)  # every lookup thread taken; the fifth waits
            # As a DBOS database call: it runs while the lookups still hang (they hang for 10 s; a thread
            # they held would make it wait that long), and sees them all hanging. No clock is read.
            hanging_meanwhile: int | None = None
            with contextlib.suppress(TimeoutError):
                hanging_meanwhile = await asyncio.wait_for(loop.run_in_executor(None, lambda: running), 5.0)
            outcomes = await asyncio.gather(*posts)
            answer.set()  # the name server answers at last: the threads are free for the next lookups
            return hanging_meanwhile, outcomes, await sender.check("https://tarpit.example/hook")
        finally:
            answer.set()
            sender.close()

    hanging_meanwhile, outcomes, later = asyncio.run(scenario())
    assert hanging_meanwhile == LOOKUP_THREADS, "the loop's default executor waited for a thread held by a lookup"
    assert all(not o.ok and o.retry and "0.5s" in (o.error or "") for o in outcomes), outcomes
    assert most == LOOKUP_THREADS  # the fifth waited for a thread (and gave up), queued nowhere
    assert later is None


def test_a_delivery_relay_cannot_make_fails_at_once_with_why() -> None:
    """What the send step did not expect (a request httpx refuses to build, a body that cannot be
    encoded) would be met again at every attempt: it is the attempt's clear error, not tried again."""
    try:
        "r1:exécuteur:3".encode("ascii")  # as httpx encodes a header's value
    except UnicodeEncodeError as exc:
        record = _send_failed(exc)
    assert record["ok"] is False and record["retry"] is False, record
    error = record["error"] or ""
    assert error.startswith("Relay could not make the delivery (UnicodeEncodeError: ") and "not tried again" in error
    assert len(error) <= 500
    # What may pass (an odd error of the socket or of a receiver app's answer) is tried again.
    passing = _send_failed(ConnectionResetError("reset by peer"))
    assert passing["ok"] is False and passing["retry"] is True, passing
    assert passing["error"] == "ConnectionResetError: reset by peer", passing


def test_a_webhook_goes_to_the_next_checked_address_when_one_cannot_be_connected_to() -> None:
    """The host resolves to an address that refuses, one that drops the connection attempt (a full
    accept queue), then the receiver's: all tried within the delivery's one timeout."""
    with WebhookReceiver() as receiver, socket.socket() as tarpit, socket.socket() as queued:
        tarpit.bind(("127.0.0.3", receiver.port))
        tarpit.listen(0)
        queued.connect(("127.0.0.3", receiver.port))  # the one connection its accept queue holds
        getaddrinfo = resolving_to("127.0.0.2", "127.0.0.3", "127.0.0.1")
        url = f"http://hooks.example:{receiver.port}/x"

        async def scenario() -> tuple[Attempt, float, Attempt]:
            sender = WebhookSender(DestinationPolicy.from_entries(["127.0.0.0/8"]), 2.0, "t", getaddrinfo=getaddrinfo)
            down = WebhookSender(
                DestinationPolicy.from_entries(["127.0.0.0/8"]), 2.0, "t", getaddrinfo=resolving_to("127.0.0.2")
            )
            try:
                began = time.monotonic()
                sent = await sender.post(url, b"{}", {})
                return sent, time.monotonic() - began, await down.post(url, b"{}", {})
            finally:
                sender.close()
                down.close()

        sent, took, refused = asyncio.run(scenario())
    assert sent.ok and sent.status == 200, sent
    (delivery,) = receiver.deliveries()
    assert delivery.headers["host"] == f"hooks.example:{receiver.port}"
    assert took < 1.5, f"{took:.1f}s"  # the silent address had its share of the timeout (1 s), not all of it
    assert not refused.ok and refused.retry and "ConnectError" in (refused.error or ""), refused


def test_a_webhook_on_an_internationalised_host_name_is_sent_under_its_idna_name() -> None:
    asked: list[str] = []
    with WebhookReceiver() as receiver:
        url = f"http://Bücher.example:{receiver.port}/x"

        async def scenario() -> tuple[str | None, Attempt, str | None, str | None]:
            getaddrinfo = resolving_to("127.0.0.1", asked=asked)
            sender = WebhookSender(DestinationPolicy.from_entries(["127.0.0.1"]), 2.0, "t", getaddrinfo=getaddrinfo)
            by_name = WebhookSender(
                DestinationPolicy.from_entries(["bücher.example"], to_ascii=ascii_host),
                2.0,
                "t",
                getaddrinfo=getaddrinfo,
            )
            try:
                return (
                    await sender.check(url),  # what the API asks when the rule is made
                    await sender.post(url, b"{}", {}),
                    await by_name.check(url),  # listed by its Unicode name
                    await sender.check("http://\N{SNOWMAN}.example/x"),  # a name IDNA does not allow
                )
            finally:
                sender.close()
                by_name.close()

        refused, sent, listed, snowman = asyncio.run(scenario())
    assert refused is None and listed is None
    assert sent.ok, sent
    (delivery,) = receiver.deliveries()
    assert delivery.headers["host"] == f"xn--bcher-kva.example:{receiver.port}"
    assert set(asked) == {"xn--bcher-kva.example"}
    assert snowman is not None and "internationalised" in snowman, snowman


def with_store(relay_db: str, rules: list[dict[str, Any]], body: Callable[[Database, AlertStore], Any]) -> Any:
    """``body(db, store)`` against a real database holding relay.yaml's ``rules``, under a lease."""
    config = RelayConfig.model_validate(alert_config(free_port(), rules))

    async def scenario() -> Any:
        db = Database(relay_db)
        await db.open()
        await db.migrate()
        lease = Lease(db, "relay-1", 30)
        await lease.acquire()
        try:
            await AppStore(db).sync_config(config)
            store = AlertStore(db)
            await store.sync_config(config)
            return await body(db, store)
        finally:
            await lease.stop()
            await db.close()

    return asyncio.run(scenario())


def test_an_episode_held_back_by_the_repeat_interval_goes_out_once_the_interval_has_passed(relay_db: str) -> None:
    """An app down, back for a moment, down again for good: the second outage begins within
    minIntervalSecs of the first alert and is held back; the first round after the interval
    delivers it (late, once) since it still holds, and the interval counts again from then."""
    # The test's own steps between two claims (a few transactions) must fit in the interval, for the
    # second episode and the third to begin within it: 0.6 s left a loaded machine too little.
    interval = 2.0
    rules = [{"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": interval,
              "webhook": "http://127.0.0.1:9/"}]  # fmt: skip
    down = [Observed({"appName": "ledger"}, "ledger", "down")]

    async def body(db: Database, store: AlertStore) -> tuple[list[tuple[float, int, bool]], list[Any], bool]:
        (rule,) = await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION}))
        ((first, late),) = await due_alerts(store, rule, down)
        began = time.monotonic()  # the interval counts from the claim (its transaction's now()), after this
        assert not late and (await store.claim(first)).send
        await store.finish(first, True, 1, None, "x", "d1")
        assert await due_alerts(store, rule, []) == []  # back up: the episode ends
        ((second, late),) = await due_alerts(store, rule, down)  # down again, within the interval
        assert second.idempotency_key != first.idempotency_key and not late
        assert not (await store.claim(second)).send  # held back
        rounds: list[tuple[float, int, bool]] = []  # (when, alerts due, whether one was claimed)
        while not any(sent for *_, sent in rounds):  # rounds go on while it keeps holding
            assert time.monotonic() - began < interval + 3, f"never delivered: {len(rounds)} rounds"
            due = await due_alerts(store, rule, down)
            assert all(late and a.idempotency_key == second.idempotency_key for a, late in due), due
            sent = [(await store.claim(alert, late)).send for alert, late in due]
            rounds.append((time.monotonic() - began, len(due), any(sent)))
            await asyncio.sleep(0.05)
        after = [await due_alerts(store, rule, down) for _ in range(3)]  # still down: nothing more is due
        await due_alerts(store, rule, [])  # up, and down again at once: within the interval of the late one
        ((third, _),) = await due_alerts(store, rule, down)
        return rounds, after, (await store.claim(third)).send

    rounds, after, third_sent = with_store(relay_db, rules, body)
    *before, (fired_at, _, _) = rounds
    assert fired_at >= interval and all(due == 0 for _, due, _ in before), rounds  # not before the interval
    assert after == [[], [], []], "delivered once"
    assert not third_sent, "the next episode's interval counts from the late alert"


def test_an_app_down_again_soon_after_it_came_back_is_alerted_once_the_interval_has_passed(
    start_relay: StartRelay,
) -> None:
    """End to end: an app's only executor drops (an alert), comes back, drops again at once. The
    second outage is held back by minIntervalSecs, and delivered, by its late workflow, once the
    interval has passed (it still holds): before, no alert went out for it, however long it lasted."""
    interval = 6.0  # long enough for the second outage to begin within it, on a busy machine too
    with WebhookReceiver() as receiver:
        rules = [{"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": interval,
                  "webhook": receiver.url("/down")}]  # fmt: skip
        relay = start_relay(alert_config(free_port(), rules, grace=60))  # DISCONNECTED all along, never dead

        def rows(sql: str) -> list[tuple[Any, ...]]:
            with psycopg.connect(relay.database_url, autocommit=True) as conn:
                return conn.execute(sql).fetchall()

        url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
        with SimulatedPeer(url, "only-one", "answer"):
            assert_eventually(lambda: relay.state_of("acme", "ledger", "only-one") == "HEALTHY", 10)
            # The interval counts from the first alert's claim (its transaction's now()), which follows
            # the outage, so after this; its delivery's arrival may be later than the claim by more
            # than the second's is, and is no point to count from.
            before_first_claim = time.time()
        assert_eventually(lambda: receiver.payloads("UnresponsiveApplication"), 15, what="the first outage")
        with SimulatedPeer(url, "only-one", "answer"):  # back: the episode ends at the next round
            assert_eventually(lambda: rows("SELECT 1 FROM alert_conditions") == [], 10, what="the episode ended")
        suppressed = assert_eventually(lambda: rows("SELECT idempotency_key FROM alerts WHERE status = 'suppressed'"),
                                       10, what="the second outage held back")  # fmt: skip
        (first, second) = assert_eventually(lambda: firing(receiver)[1:] and firing(receiver), interval + 15)
        assert second.payload["idempotencyKey"] == suppressed[0][0]
        assert second.at - before_first_claim >= interval and first.at < second.at
        # The first outage's end is resolved (it was alerted); the second still holds.
        assert_eventually(lambda: len(audit(relay, "alert.sent")) == 3, 10)
        (resolved,) = [d.payload for d in receiver.deliveries("UnresponsiveApplication") if d not in firing(receiver)]
        assert resolved["resolves"] == first.payload["idempotencyKey"]
    assert len(receiver.deliveries("UnresponsiveApplication")) == 3


def firing(receiver: WebhookReceiver, kind: str = "UnresponsiveApplication") -> list[Delivery]:
    """The deliveries of alerts of ``kind``, not of their resolutions."""
    return [d for d in receiver.deliveries(kind) if d.payload.get("status") != "resolved"]


def test_the_audit_poll_reads_past_a_burst_of_more_than_a_page_of_entries(relay_db: str) -> None:
    """1,500 deaths within a minute: entries read already (young enough to be read again, for those
    committed late) never fill the page in place of new ones; two polls read them all."""

    async def body(db: Database, store: AlertStore) -> tuple[list[int], list[int], set[int]]:
        async with db.transaction() as conn:
            await conn.execute(
                """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
                   SELECT 'acme', 'ledger', 'executor.dead', 'e' || g, 'relay', jsonb_build_object('epoch', 1)
                   FROM generate_series(1, 1500) g"""
            )
            cur = await conn.execute("SELECT id FROM audit_log WHERE action = 'executor.dead' ORDER BY id")
            ids = {int(r["id"]) for r in await cur.fetchall()}
        cursor = await store.cursor()
        first = [f.id for f in await store.audit_facts(cursor, 60.0)]
        second = [f.id for f in await store.audit_facts(max(first), 60.0)]
        return first, second, ids

    first, second, ids = with_store(relay_db, [], body)
    assert len(first) == 1000 and len(ids) == 1500
    new = [i for i in second if i > max(first)]
    assert len(new) == 500, f"the second poll read {len(new)} of the 500 entries after the first page"
    assert set(first) | set(new) == ids
    assert len(second) == 1500, "and the first page again (the overlap): entries committed late are found"


def test_an_audit_entry_committed_long_after_its_transaction_began_is_still_read(relay_db: str) -> None:
    """An entry is dated its transaction's start and its id drawn before the commit: a transaction
    open longer than the overlap (an instance paused in it) commits an entry older than the window,
    below the cursor. The poll reads back to the oldest transaction open at the previous poll."""

    async def body(db: Database, store: AlertStore) -> tuple[list[str], list[str]]:
        loops = AlertLoops(store, AlertsConfig(), lambda: True)
        loops.overlap_secs = 0.3  # the window of a minute, shortened (an hour's pause, shortened too)
        death = """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
                   VALUES ('acme', 'ledger', 'executor.dead', %s, 'relay', '{}')"""
        async with await psycopg.AsyncConnection.connect(relay_db) as slow:
            async with slow.transaction():
                await slow.execute(death, ("slow",))
                async with db.transaction() as conn:  # a later id, committed first
                    await conn.execute(death, ("quick",))
                first = await loops.read_facts(await store.cursor())
                await store.advance(max(f.id for f in first))
                await asyncio.sleep(1.0)  # the transaction stays open past the window, then commits
            second = await loops.read_facts(await store.cursor())
        return [str(f.executor_id) for f in first], [str(f.executor_id) for f in second]

    first, second = with_store(relay_db, [], body)
    assert "quick" in first and "slow" not in first
    assert "slow" in second, f"the late entry was never read: {second}"


def sent_count(kind: str) -> float:
    (metric,) = ALERTS_SENT.collect()
    return sum(s.value for s in metric.samples if s.name.endswith("_total") and s.labels["kind"] == kind)


def test_a_delivery_recorded_twice_by_its_step_run_again_is_counted_once(relay_db: str) -> None:
    """DBOS runs a step again when its checkpoint was not written: a workflow resumed in this process
    while its first execution, stale, had already recorded the outcome. The step's body, run twice
    under the same step (its audit entry's key), counts the alert once in relay_alerts_sent_total."""
    rules = [{"kind": "ExecutorDead", "webhook": "http://127.0.0.1:9/"}]

    async def body(db: Database, store: AlertStore) -> tuple[float, float, int]:
        (rule,) = await store.rules_of(frozenset({Kind.EXECUTOR_DEAD}))
        fact = AuditFact(1, "2026-01-01T00:00:00Z", time.time(), "acme", "ledger", "executor.dead", "e1", {"epoch": 9})
        (alert,) = alerts_for_event(fact, [rule])
        assert (await store.claim(alert)).send
        bind(cast(Services, SimpleNamespace(alerts=SimpleNamespace(store=store), loop=asyncio.get_running_loop())))
        step_body = inspect.unwrap(finish)  # what DBOS runs for the step, without its checkpoint
        try:
            before = sent_count(alert.kind)
            await step_body(alert.to_json(), True, 1, None, "x")
            once = sent_count(alert.kind) - before
            await step_body(alert.to_json(), True, 1, None, "x")  # the same step, run again
            twice = sent_count(alert.kind) - before
        finally:
            bind(None)
        async with db.connection() as conn:
            cur = await conn.execute("SELECT count(*) AS n FROM audit_log WHERE action = 'alert.sent'")
            entries = await cur.fetchone()
        assert entries is not None
        return once, twice, int(entries["n"])

    once, twice, entries = with_store(relay_db, rules, body)
    assert (once, entries) == (1, 1)
    assert twice == 1, "the alert was counted twice"


def test_a_rule_made_with_an_infinite_interval_before_the_bound_still_delivers_and_lists(relay_db: str) -> None:
    """The API took minIntervalSecs 1e999 (an infinity) before it was bounded: such a rule's
    deliveries are claimed (every one failed, PostgreSQL refusing the interval) and it lists."""

    async def body(db: Database, store: AlertStore) -> tuple[bool, bool, str]:
        async with db.transaction() as conn:
            record = await store.create(conn, {
                "id": "r1", "org": "acme", "app": "ledger", "kind": "ExecutorDead", "params": {},
                "min_interval_secs": float("inf"), "webhook_url": "http://127.0.0.1:9/", "secret": None,
                "format": "json", "receiver_app": None, "created_by": "t"})  # fmt: skip
        deaths = [AuditFact(n, "2026-01-01T00:00:00Z", time.time() + 10, "acme", "ledger", "executor.dead", "e1",
                            {"epoch": n}) for n in (1, 2)]  # fmt: skip
        first, second = (alerts_for_event(fact, [record.rule()])[0] for fact in deaths)
        sent = (await store.claim(first)).send
        held = (await store.claim(second)).send  # within the interval (ten years, as near as matters)
        return sent, held, json.dumps(rule_json(record), allow_nan=False)

    sent, held, listed = with_store(relay_db, [], body)
    assert sent and not held
    assert json.loads(listed)["minIntervalSecs"] == 10 * 365 * 24 * 3600


def test_rounds_that_overlap_on_two_instances_alert_one_episode_once(start_relay: StartRelay) -> None:
    """A rule's evaluation outlasts its round when the executor it asks is slow; the per-instance turn
    keeps that instance's later rounds off the rule, but the other instance's rounds evaluate it. The
    failures begin just after the first reading ("none"), which comes back 6 s later: by then the
    other instance's rounds have seen them and alerted. The stale reading must not end the episode
    (README: "while it keeps holding it is one alert"): one idempotency key, one alert."""
    slow_secs = 6.0
    with WebhookReceiver() as receiver:
        rules = [{"kind": "WorkflowFailure", "webhook": receiver.url(), "minIntervalSecs": 0}]
        configs = [alert_config(free_port(), rules) for _ in range(2)]
        for config in configs:
            config["server"]["executorRequestTimeoutSecs"] = 3 * slow_secs
            config["metrics"] = {"appFigures": False}  # the rule's requests are the only aggregates
        r1, _r2 = (start_relay(config, instance_id=f"relay-{n}") for n, config in enumerate(configs, 1))
        slow = {"get_workflow_aggregates": slow_secs}
        failing = {"output": [{"group": {"name": "charge"}, "count": 2}]}
        first_asked: list[float] = []

        def aggregates(request: dict[str, Any]) -> dict[str, Any]:
            if not first_asked:
                first_asked.append(time.time())
                return {"output": []}  # no failure yet; this reply waits slow_secs
            slow.clear()  # every later reading is answered at once, and sees the failures
            return failing

        url = f"ws://127.0.0.1:{r1.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
        replies: dict[str, Any] = {"get_workflow_aggregates": aggregates}
        with SimulatedPeer(url, "ledger-1", "answer", replies=replies, slow=slow):
            first = assert_eventually(lambda: receiver.deliveries("WorkflowFailure"), 20, what="the first alert")
            # The other instance alerted while the first reading was still on its way.
            assert first[0].at < first_asked[0] + slow_secs, (first[0].at - first_asked[0], slow_secs)
            # The stale reading has been settled, and rounds went on for a few seconds since.
            time.sleep(max(0.0, first_asked[0] + slow_secs + 4 - time.time()))
        with psycopg.connect(r1.database_url) as conn:
            ran = conn.execute(
                """SELECT executor_id, count(*) FROM dbos.workflow_status WHERE name = 'relay.alerts.rule'
                   GROUP BY executor_id ORDER BY executor_id"""
            ).fetchall()
        keys = [d.payload["idempotencyKey"] for d in receiver.deliveries("WorkflowFailure", accepted=True)]
        assert len(set(keys)) == 1, f"one episode of failures alerted as {sorted(set(keys))} (rule runs: {ran})"


def test_an_older_reading_changes_nothing_and_a_reset_sequence_does_not_silence_a_rule(relay_db: str) -> None:
    """Evaluations of a rule that overlap settle in any order: an older reading that comes back
    after a newer one changes nothing (the episode the newer one saw goes on, under its key). If the
    readings' sequence goes back (a restore, a copy by logical replication, which leaves sequences
    behind), the rule still settles its readings instead of finding each stale for ever."""
    rules = [{"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": 0,
              "webhook": "http://127.0.0.1:9/"}]  # fmt: skip
    down = [Observed({"appName": "ledger"}, "ledger", "down")]

    async def body(db: Database, store: AlertStore) -> None:
        (rule,) = await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION}))
        older, newer = await store.reading(), await store.reading()
        ((first, _),) = await due_alerts(store, rule, down, newer)
        assert await due_alerts(store, rule, [], older) == []  # "up", read before: nothing ends
        ((same, _),) = await due_alerts(store, rule, down, await store.reading())
        assert same.idempotency_key == first.idempotency_key
        async with db.connection() as conn:
            await conn.execute("ALTER SEQUENCE alert_readings RESTART WITH 1")
        assert await due_alerts(store, rule, [], await store.reading()) == []  # up: the episode ends
        ((again, _),) = await due_alerts(store, rule, down, await store.reading())  # down: a new one
        assert again.idempotency_key != first.idempotency_key

    with_store(relay_db, rules, body)


# Retention's age for Relay's records in these tests: 0.864 s (auditDays is a fraction of a day).
SHORT_AUDIT_DAYS = 1e-5


async def aged(db: Database, key: str, days: float = SHORT_AUDIT_DAYS) -> bool:
    """Whether the alert row of ``key`` is older than ``days`` by the database's clock, as retention judges."""
    async with db.connection() as conn:
        cur = await conn.execute(
            """SELECT created_at < now() - make_interval(secs => %s * 86400) AS old
               FROM alerts WHERE idempotency_key = %s""",
            (days, key),
        )
        row = await cur.fetchone()
    return bool(row and row["old"])


async def wait_aged(db: Database, *keys: str) -> None:
    deadline = time.monotonic() + 15
    while not all([await aged(db, key) for key in keys]):
        assert time.monotonic() < deadline, f"the rows of {keys} never grew older than retention's age"
        await asyncio.sleep(0.1)


async def wait_entries_aged(db: Database, action: str, days: float = SHORT_AUDIT_DAYS) -> None:
    """Until the audit entries of ``action`` are older than ``days`` by the database's clock (retention
    keeps an alert while the entry that ends it is in the audit log)."""
    deadline = time.monotonic() + 15
    while True:
        async with db.connection() as conn:
            cur = await conn.execute(
                """SELECT count(*) AS young FROM audit_log
                   WHERE action = %s AND at >= now() - make_interval(secs => %s * 86400)""",
                (action, days),
            )
            row = await cur.fetchone()
        if row and row["young"] == 0:
            return
        assert time.monotonic() < deadline, f"the {action} entries never grew older than {days} days"
        await asyncio.sleep(0.1)


async def alert_keys(db: Database) -> set[str]:
    async with db.connection() as conn:
        cur = await conn.execute("SELECT idempotency_key FROM alerts")
        return {str(r["idempotency_key"]) for r in await cur.fetchall()}


def relay_system_database(relay_db: str) -> None:
    """Relay's own DBOS system database, as DBOS creates it (the ``dbos`` schema of Relay's database)."""
    dbos_cli = Path(sys.executable).parent / "dbos"
    done = subprocess.run([str(dbos_cli), "migrate", "-s", relay_db], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


async def delivery_workflows(relay_db: str, statuses: dict[str, str]) -> None:
    """Delivery workflows in Relay's system database, by id, in a DBOS status each: enqueued with
    DBOS's client, then put in the status a run of them would leave (``PENDING`` while an instance
    runs it, ``MAX_RECOVERY_ATTEMPTS_EXCEEDED`` once DBOS dead-lettered it)."""

    def enqueue() -> None:
        client = DBOSClient(system_database_url=relay_db, application_name="relay")
        try:
            for workflow_id in statuses:
                options: EnqueueOptions = {
                    "queue_name": "relay-test",
                    "workflow_name": "relay.alert.deliver",
                    "workflow_id": workflow_id,
                }
                client.enqueue(options, {})
        finally:
            client.destroy()
        with psycopg.connect(relay_db, autocommit=True) as conn:
            for workflow_id, status in statuses.items():
                conn.execute(
                    "UPDATE dbos.workflow_status SET status = %s WHERE workflow_uuid = %s", (status, workflow_id)
                )

    await asyncio.to_thread(enqueue)


def test_an_episode_longer_than_the_audit_retention_is_not_alerted_again(relay_db: str) -> None:
    """An app down for longer than retention.auditDays: retention pruned the alert's row (its key's
    claim) by its age while the episode still held, and the next round found the key unclaimed and
    delivered the same episode again (Relay's own workflow of that key is collected after
    relayWorkflowsDays, sooner still). The row stays while its condition holds, and goes once the
    episode has ended and it is old enough."""
    rules = [{"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": 0, "webhook": "http://127.0.0.1:9/"}]
    down = [Observed({"appName": "ledger"}, "ledger", "down")]
    settings = RetentionConfig(audit_days=SHORT_AUDIT_DAYS)

    async def body(db: Database, store: AlertStore) -> tuple[list[Any], tuple[set[str], set[str]], set[str], str]:
        (rule,) = await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION}))
        ((alert, _),) = await due_alerts(store, rule, down)
        assert (await store.claim(alert)).send
        await store.finish(alert, True, 1, None, "x", "d1")
        await wait_aged(db, alert.idempotency_key)
        await RetentionStore(db).prune(settings)
        again = await due_alerts(store, rule, down)  # still down: the same episode
        during = await alert_keys(db)
        await due_alerts(store, rule, [])  # back up: the episode ends
        await RetentionStore(db).prune(settings)
        ending = await alert_keys(db)  # its resolution is yet to be sent
        await wait_entries_aged(db, "alert.resolved")
        await RetentionStore(db).prune(settings)
        return again, (during, ending), await alert_keys(db), alert.idempotency_key

    again, kept, after, key = with_store(relay_db, rules, body)
    assert again == [], "the episode was alerted again after retention"
    assert kept == ({key}, {key}), "kept while the episode held, and while the entry that ended it is in the audit log"
    assert after == set(), "an episode that ended is pruned by its age, once its end is as old"


def test_retention_keeps_what_a_delivery_under_way_a_held_back_episode_and_the_repeat_interval_rely_on(
    relay_db: str,
) -> None:
    """Rows older than auditDays that something still relies on are kept: a death whose delivery has
    not finished (its retries go on; its key must stay claimed), an episode held back by
    minIntervalSecs that still holds (it goes out late, once, not again on time), and the last alert
    about a subject while the rule's repeat interval, longer than auditDays, still counts from it."""
    interval = 5.0
    rules = [
        {"kind": "ExecutorDead", "webhook": "http://127.0.0.1:9/", "minIntervalSecs": 0},
        {"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": interval, "webhook": "http://127.0.0.1:9/"},
    ]  # fmt: skip
    down = [Observed({"appName": "ledger"}, "ledger", "down")]
    settings = RetentionConfig(audit_days=SHORT_AUDIT_DAYS)

    async def body(db: Database, store: AlertStore) -> dict[str, Any]:
        (dead_rule,) = await store.rules_of(frozenset({Kind.EXECUTOR_DEAD}))
        (rule,) = await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION}))
        fact = AuditFact(1, "2026-01-01T00:00:00Z", time.time() + 10, "acme", "ledger", "executor.dead", "e1",
                         {"epoch": 3})  # fmt: skip
        (death,) = alerts_for_event(fact, [dead_rule])
        assert (await store.claim(death, claimant=death.workflow_id)).send  # its delivery goes on (retrying)
        await delivery_workflows(relay_db, {death.workflow_id: "PENDING"})
        ((first, _),) = await due_alerts(store, rule, down)
        began = time.monotonic()
        assert (await store.claim(first)).send
        await store.finish(first, True, 1, None, "x", "d1")
        await due_alerts(store, rule, [])  # up again: the first episode is over
        ((second, _),) = await due_alerts(store, rule, down)  # down again within the interval
        assert not (await store.claim(second)).send  # held back
        await wait_aged(db, death.idempotency_key, first.idempotency_key, second.idempotency_key)
        assert time.monotonic() - began < interval, "the test's steps outlasted the repeat interval"
        await RetentionStore(db).prune(settings)
        kept = await alert_keys(db)
        on_time = await due_alerts(store, rule, down)  # within the interval: nothing may go out yet
        late: list[tuple[Any, bool]] = []
        while not late:  # the rounds after the interval
            assert time.monotonic() - began < interval + 10, "the held-back episode never went out"
            late = await due_alerts(store, rule, down)
            await asyncio.sleep(0.1)
        late_sent = (await store.claim(second, True)).send
        await store.finish(death, True, 2, None, "x", "d2")  # the death's delivery ends: its row may go
        await RetentionStore(db).prune(settings)
        return {"keys": (death.idempotency_key, first.idempotency_key, second.idempotency_key), "kept": kept,
                "on_time": on_time, "late": late, "late_sent": late_sent, "finally": await alert_keys(db)}  # fmt: skip

    relay_system_database(relay_db)
    found = with_store(relay_db, rules, body)
    death_key, first_key, second_key = found["keys"]
    assert death_key in found["kept"], "a delivery under way lost its claim"
    assert second_key in found["kept"], "a held-back episode that still holds lost its claim"
    assert first_key in found["kept"], "the repeat interval lost the alert it counts from"
    assert found["on_time"] == [], "the held-back episode was found due on time"
    assert [(a.idempotency_key, late) for a, late in found["late"]] == [(second_key, True)] and found["late_sent"]
    assert death_key not in found["finally"], "a finished delivery past auditDays is pruned"


def test_retention_prunes_an_old_delivery_that_never_finished_once_its_workflow_no_longer_runs(
    relay_db: str,
) -> None:
    """A row ``sending`` older than auditDays is kept while its delivery workflow may still finish it
    (PENDING or ENQUEUED in Relay's own system database), under the id the delivery recorded as its
    claimant or, for a row of an earlier release, ``alert:{key}`` or ``alert:{key}:late``. A delivery
    that never reaches ``finish`` (DBOS dead-lettered its workflow, or the workflow is gone, collected
    after relayWorkflowsDays) left its row ``sending`` for good: it is pruned by its age."""
    rules = [{"kind": "ExecutorDead", "webhook": "http://127.0.0.1:9/", "minIntervalSecs": 0}]
    settings = RetentionConfig(audit_days=SHORT_AUDIT_DAYS)
    cases = ["enqueued", "pending", "dead_lettered", "gone", "earlier_release", "earlier_release_late",
             "earlier_release_gone"]  # fmt: skip

    async def body(db: Database, store: AlertStore) -> tuple[dict[str, str], set[str], set[str]]:
        (rule,) = await store.rules_of(frozenset({Kind.EXECUTOR_DEAD}))
        alerts = {}
        for i, case in enumerate(cases):
            fact = AuditFact(i + 1, "2026-01-01T00:00:00Z", time.time() + 10, "acme", "ledger", "executor.dead",
                             case, {"epoch": 3})  # fmt: skip
            (alerts[case],) = alerts_for_event(fact, [rule])
            claimant = None if case.startswith("earlier_release") else alerts[case].workflow_id
            assert (await store.claim(alerts[case], claimant=claimant)).send
        await delivery_workflows(relay_db, {
            alerts["enqueued"].workflow_id: "ENQUEUED",
            alerts["pending"].workflow_id: "PENDING",
            alerts["dead_lettered"].workflow_id: "MAX_RECOVERY_ATTEMPTS_EXCEEDED",
            alerts["earlier_release"].workflow_id: "PENDING",
            late_workflow_id(alerts["earlier_release_late"]): "PENDING",
            alerts["earlier_release_gone"].workflow_id: "CANCELLED",
        })  # fmt: skip
        keys = {case: alert.idempotency_key for case, alert in alerts.items()}
        await wait_aged(db, *keys.values())
        await RetentionStore(db).prune(settings)
        kept = await alert_keys(db)
        async with db.connection() as conn:  # the running ones end: DBOS dead-letters them
            await conn.execute(
                "UPDATE dbos.workflow_status SET status = 'MAX_RECOVERY_ATTEMPTS_EXCEEDED' WHERE status <> 'SUCCESS'"
            )
        await RetentionStore(db).prune(settings)
        return keys, kept, await alert_keys(db)

    relay_system_database(relay_db)
    keys, kept, after = with_store(relay_db, rules, body)
    running = {"enqueued", "pending", "earlier_release", "earlier_release_late"}
    assert kept == {keys[c] for c in running}, (
        f"kept {sorted(c for c in cases if keys[c] in kept)}: an old row sending is kept exactly while its "
        "delivery workflow runs"
    )
    assert after == set(), "a delivery that never finished keeps its row forever"


async def came_due(store: AlertStore, rule: Rule, down: Any, interval: float) -> list[tuple[Any, bool]]:
    """The due alerts of ``rule`` once its held-back episode comes due (within the interval and 10 s)."""
    deadline = time.monotonic() + interval + 10
    while not (due := await due_alerts(store, rule, down)):
        assert time.monotonic() < deadline, "the held-back episode never came due"
        await asyncio.sleep(0.05)
    return due


def test_a_held_back_episode_that_ends_before_its_late_claim_is_not_delivered(relay_db: str) -> None:
    """A late delivery goes out only if its episode still holds (README): the round found it holding,
    but its claim can come after the outage is over (a Relay restarted in between, its workflow
    resumed later). It was sent then, paging someone about an outage already over."""
    interval = 1.0
    rules = [{"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": interval,
              "webhook": "http://127.0.0.1:9/"}]  # fmt: skip
    down = [Observed({"appName": "ledger"}, "ledger", "down")]

    async def body(db: Database, store: AlertStore) -> tuple[bool, bool, list[Any], str]:
        (rule,) = await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION}))
        ((first, _),) = await due_alerts(store, rule, down)
        assert (await store.claim(first)).send
        await store.finish(first, True, 1, None, "x", "d1")
        await due_alerts(store, rule, [])
        ((second, _),) = await due_alerts(store, rule, down)
        assert not (await store.claim(second)).send  # held back
        due = await came_due(store, rule, down, interval)
        ((late_alert, late),) = due
        await due_alerts(store, rule, [])  # the app is back before the late delivery claims
        sent = (await store.claim(late_alert, late)).send
        async with db.connection() as conn:
            cur = await conn.execute("SELECT status FROM alerts WHERE idempotency_key = %s", (second.idempotency_key,))
            row = await cur.fetchone()
        assert row is not None
        return late, sent, await due_alerts(store, rule, []), str(row["status"])

    late, sent, after, status = with_store(relay_db, rules, body)
    assert late
    assert not sent, "a late alert went out for an episode already over"
    assert after == [] and status == "suppressed"


def test_a_slow_queue_rule_naming_no_queue_sends_conductors_star_as_its_queue_name(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    """Conductor's SlowQueue alert carries ``queue_name``: the rule's queue name filter, or ``*`` for
    all queues, and ``stuck_workflow_count`` over them (docs/production/alerting.md). Relay sent the
    held queue's own name under ``queue_name`` for a rule naming none, one alert per queue: a handler
    written for Conductor's alerts (which matches ``queue_name`` to its rules) read another meaning.
    Now one alert per rule as Conductor's, the queues held up in Relay's own ``queues``."""
    with WebhookReceiver() as receiver:
        rules = [
            {"kind": "SlowQueue", "thresholdSecs": 1, "receiverApp": "notifier"},
            {"kind": "SlowQueue", "thresholdSecs": 1, "minIntervalSecs": 1, "webhook": receiver.url()},
        ]  # fmt: skip
        config = alert_config(free_port(), rules)
        config["orgs"][0]["apps"].append({"name": "notifier"})
        relay = start_relay(config)
        env = {"RELAY_TEST_EVIDENCE": evidence_db}
        start_executor(relay.conductor_url, app="notifier", version="n1", module="harness.alert_app", env=env)
        start_executor(relay.conductor_url, module="harness.alert_app", env={**env, "RELAY_TEST_HOLD_QUEUE": "2"})

        (handled,) = assert_eventually(lambda: received(evidence_db, "SlowQueue"), 30, what="SlowQueue at notifier")
        metadata = handled["metadata"]
        assert metadata["queue_name"] == "*", metadata
        assert metadata["queues"] == "serial" and metadata["threshold_secs"] == "1"
        stuck = int(metadata["stuck_workflow_count"])
        assert 1 <= stuck <= 3 and handled["message"].startswith(f"{stuck} workflows of app ledger have waited")
        (hooked,) = assert_eventually(lambda: receiver.payloads("SlowQueue"), 20, what="SlowQueue at the webhook")
        assert hooked["queueName"] == "*" and hooked["metadata"]["queue_name"] == "*", hooked
        assert hooked["metadata"]["queues"] == "serial"
        assert hooked["idempotencyKey"].split(":")[1] == "*", "one alert per rule, keyed by its filter"
        # The queue stays held: one episode, one alert for each rule.
        assert_eventually(lambda: len(audit(relay, "alert.sent")) == 2, 10)
        assert len(received(evidence_db, "SlowQueue")) == 1 and len(receiver.payloads("SlowQueue")) == 1


def test_a_first_delivery_resumed_after_its_late_one_claimed_does_not_send_the_alert_again(relay_db: str) -> None:
    """A first delivery holds its episode back (minIntervalSecs) but crashes before its claim step's
    checkpoint; once the interval has passed the late delivery claims the key and sends. Then the
    first is resumed and its claim step runs again: it found the key 'sending' and sent it too, a
    second page for one episode (a receiving app's handler, as Conductor's, has no key to drop it
    by). Only the workflow that claimed the key sends it; that workflow's own step run again still does."""
    interval = 1.0
    rules = [{"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": interval,
              "webhook": "http://127.0.0.1:9/"}]  # fmt: skip
    down = [Observed({"appName": "ledger"}, "ledger", "down")]

    async def body(db: Database, store: AlertStore) -> tuple[bool, bool, bool]:
        (rule,) = await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION}))
        ((first, _),) = await due_alerts(store, rule, down)
        assert (await store.claim(first, False, first.workflow_id)).send
        await store.finish(first, True, 1, None, "x", "d1")
        await due_alerts(store, rule, [])
        ((second, _),) = await due_alerts(store, rule, down)
        assert not (await store.claim(second, False, second.workflow_id)).send  # held back
        await came_due(store, rule, down, interval)
        late_sent = (await store.claim(second, True, late_workflow_id(second))).send
        resumed_first = (await store.claim(second, False, second.workflow_id)).send  # its step run again
        resumed_late = (await store.claim(second, True, late_workflow_id(second))).send
        return late_sent, resumed_first, resumed_late

    late_sent, resumed_first, resumed_late = with_store(relay_db, rules, body)
    assert late_sent
    assert not resumed_first, "the resumed first delivery sent the alert the late one sends"
    assert resumed_late, "the late delivery's claim step run again still sends"


def test_an_alerted_outage_that_ends_is_resolved_once_after_its_alert_even_while_the_receiver_fails(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """The app's only executor dies (UnresponsiveApplication) while the receiver answers 503; the app
    comes back before the alert got through. Once the receiver is back, it gets the alert, then its
    resolution (never before it), once each, the resolution naming why the outage ended."""
    with WebhookReceiver() as receiver:
        rules = [{"kind": "UnresponsiveApplication", "forSecs": 0.5, "webhook": receiver.url(), "secret": YAML_SECRET}]
        relay = start_relay(alert_config(free_port(), rules, grace=0.5))
        first = start_executor(relay.conductor_url)
        assert_eventually(lambda: relay.state_of("acme", "ledger", first.executor_id) == "HEALTHY", 10)
        receiver.fail_for(600)
        first.kill()
        assert_eventually(lambda: receiver.deliveries("UnresponsiveApplication", accepted=False), 20, what="a 503")
        second = start_executor(relay.conductor_url)  # the app is back, its alert still undelivered
        assert_eventually(lambda: audit(relay, "alert.resolved"), 20, what="the episode's end recorded")
        assert receiver.payloads() == [], "nothing got through while the receiver failed"
        receiver.fail_until = 0.0
        sent = assert_eventually(lambda: len(receiver.payloads()) >= 2 and receiver.payloads(), 20, what="both")
        alert, resolution = sent[:2]
        assert "status" not in alert and alert["appName"] == "ledger", alert
        assert resolution["status"] == "resolved" and resolution["resolves"] == alert["idempotencyKey"]
        assert resolution["idempotencyKey"] == alert["idempotencyKey"] + ":resolved"
        assert resolution["kind"] == "UnresponsiveApplication" and resolution["appName"] == "ledger"
        assert "has 1 healthy executor again" in resolution["message"], resolution["message"]
        assert all(signed(d, YAML_SECRET) for d in receiver.deliveries())
        sent = assert_eventually(lambda: len(audit(relay, "alert.sent")) >= 2 and audit(relay, "alert.sent"), 10)
        assert [e["detail"].get("resolves") for e in sent] == [None, alert["idempotencyKey"]]
        assert relay.state_of("acme", "ledger", second.executor_id) == "HEALTHY"
        assert len(receiver.payloads()) == 2, "one alert, one resolution: no repeat once either was sent"


def test_an_unresponsive_apps_alert_is_resolved_saying_so_when_retention_forgets_its_executors(
    relay_db: str,
) -> None:
    """An app whose executor records are all gone (each recovery verified) stays unresponsive while
    their ids are remembered. Once retention prunes them (executorIdsDays), Relay can no longer tell
    the app ever had executors and stops watching it: the alerted episode ends, and the receiver
    gets a resolution that says why (not that the app came back), once."""
    with WebhookReceiver() as receiver:
        rules = [{"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": 0, "webhook": receiver.url()}]
        retention = RetentionConfig(executor_ids_days=SHORT_AUDIT_DAYS)

        async def body(db: Database, store: AlertStore) -> tuple[str, list[Any], Attempt]:
            (rule,) = await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION}))
            observer = ConditionObserver(store, gateway=None)  # type: ignore[arg-type]  # not asked for this kind
            executors, key = ExecutorStore(db), ExecutorKey("acme", "ledger", "only-one")
            info = ExecutorInfoReply(request_id="r", executor_id=key.executor_id, application_version="v1")
            epoch = (await executors.connected(Handshake(key, info, "relay-1", "key"))).epoch
            for event in (ExecutorEvent.LOST, ExecutorEvent.GRACE_EXPIRED, ExecutorEvent.RECOVERY_SENT,
                          ExecutorEvent.RECOVERED):  # fmt: skip
                assert await executors.apply(key, event, epoch=epoch)
            down = await observer.observe_why(rule)
            assert down is not None and len(down[0]) == 1, "records gone, ids remembered: unresponsive"
            ((alert, _),) = await due_alerts(store, rule, down[0], over=down[1])
            assert (await store.claim(alert)).send
            await store.finish(alert, True, 1, None, "x", "d1")
            pruned = 0
            deadline = time.monotonic() + 15
            while not pruned:  # the id is pruned once it is older than executorIdsDays (0.9 s)
                assert time.monotonic() < deadline, "retention never pruned the executor's id"
                await asyncio.sleep(0.2)
                pruned = (await RetentionStore(db).prune(retention)).executor_ids
            over = await observer.observe_why(rule)
            assert over is not None and over[0] == []
            for _ in range(2):  # the episode ends once, however many rounds see it over
                assert await due_alerts(store, rule, over[0], over=over[1]) == []
            facts = [f for f in await store.audit_facts(0, 60) if f.action == "alert.resolved"]
            resolutions = [a for f in facts for a in AlertLoops.alerts_for(f, [])]
            sender = AlertSender(store, None, WebhookSender(DestinationPolicy.from_entries(["127.0.0.1"]), 2.0, "t"))  # type: ignore[arg-type]
            try:
                return alert.idempotency_key, resolutions, await sender.attempt(resolutions[0], 1)
            finally:
                sender.webhooks.close()

        key, resolutions, (attempt, _) = with_store(relay_db, rules, body)
    assert len(resolutions) == 1 and attempt.ok, attempt
    (payload,) = receiver.payloads("UnresponsiveApplication")
    assert payload["status"] == "resolved" and payload["resolves"] == key
    assert payload["idempotencyKey"] == f"{key}:resolved" and payload["appName"] == "ledger"
    message = payload["message"]
    assert "no longer remembers any executor" in message and "executorIdsDays" in message, message
    assert "healthy" not in message, "the app is not known to be back"


def test_a_rule_edited_in_relay_yaml_while_its_condition_holds_pages_once_and_resolves_the_alert(
    relay_db: str,
) -> None:
    """An app is down and alerted; the operator edits its rule in relay.yaml (a longer repeat
    interval) and Relay restarts. The rule's id was drawn from its parameters, so the edited rule was
    a new one: the same outage paged a second time under a new key, and the first alert was never
    resolved (its rule and episode deleted). The edited rule keeps its id: one page, then the end of
    the outage resolves that alert."""
    rules = [{"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": 0, "webhook": "http://127.0.0.1:9/"}]
    down = [Observed({"appName": "ledger"}, "ledger", "down")]
    kinds = frozenset({Kind.UNRESPONSIVE_APPLICATION})

    async def body(db: Database, store: AlertStore) -> tuple[str, str, list[Any], list[str]]:
        (rule,) = await store.rules_of(kinds)
        ((alert, _),) = await due_alerts(store, rule, down)
        assert (await store.claim(alert)).send
        await store.finish(alert, True, 1, None, "x", "d1")
        edited = [{**rules[0], "minIntervalSecs": 600, "webhook": "http://127.0.0.1:8/"}]
        await store.sync_config(RelayConfig.model_validate(alert_config(free_port(), edited)))
        (after,) = await store.rules_of(kinds)
        again = [a.idempotency_key for a, _ in await due_alerts(store, after, down)]  # still down
        await due_alerts(store, after, [])  # back up
        facts = [f for f in await store.audit_facts(0, 60) if f.action == "alert.resolved"]
        return alert.idempotency_key, after.id, again, [f.detail["resolves"] for f in facts]

    key, rule_id, again, resolved = with_store(relay_db, rules, body)
    assert again == [], "the outage was paged again under the edited rule"
    assert resolved == [key] and key.startswith(f"{rule_id}:"), "the edited rule keeps its id"


def test_a_blocked_recovery_is_resolved_when_the_death_is_over_not_when_a_recovery_is_tried(relay_db: str) -> None:
    """A dead executor's recovery waits (RecoveryBlocked, alerted); a peer comes and a recovery is
    sent, which fails, and the recovery waits again. Its alert's key is the death's, so the wait
    after the failed try cannot page again: had the try resolved the alert, the receiver would
    believe the executor recovered while it still waits. The alert is resolved once, when the
    death is over (its workflows recovered and its record deleted)."""
    rules = [{"kind": "RecoveryBlocked", "forSecs": 0, "minIntervalSecs": 0, "webhook": "http://127.0.0.1:9/"}]
    blocked = ExecutorEvent.BLOCKED

    async def body(db: Database, store: AlertStore) -> tuple[list[int], str, list[dict[str, Any]]]:
        (rule,) = await store.rules_of(frozenset({Kind.RECOVERY_BLOCKED}))
        observer = ConditionObserver(store, gateway=None)  # type: ignore[arg-type]  # not asked for this kind
        executors, key = ExecutorStore(db), ExecutorKey("acme", "ledger", "stuck")
        info = ExecutorInfoReply(request_id="r", executor_id=key.executor_id, application_version="v1")
        epoch = (await executors.connected(Handshake(key, info, "relay-1", "key"))).epoch
        for event in (ExecutorEvent.LOST, ExecutorEvent.GRACE_EXPIRED):
            assert await executors.apply(key, event, epoch=epoch)
        assert await executors.apply(key, blocked, epoch=epoch, reason="no_healthy_peer")

        async def resolved_after(*events: ExecutorEvent) -> int:
            for event in events:
                reason = "no_healthy_peer" if event is blocked else None
                assert await executors.apply(key, event, epoch=epoch, reason=reason)
            assert await due_alerts(store, rule, await observer.observe(rule) or []) == []
            return len([f for f in await store.audit_facts(0, 60) if f.action == "alert.resolved"])

        ((alert, _),) = await due_alerts(store, rule, await observer.observe(rule) or [])
        assert (await store.claim(alert)).send
        await store.finish(alert, True, 1, None, "x", "d1")
        counts = [
            await resolved_after(ExecutorEvent.RECOVERY_SENT),  # a peer is asked
            await resolved_after(ExecutorEvent.RECOVERY_FAILED, blocked),  # it failed: waiting again
            await resolved_after(ExecutorEvent.RECOVERY_SENT, ExecutorEvent.RECOVERED),  # recovered: deleted
            await resolved_after(),
        ]
        facts = [f.detail for f in await store.audit_facts(0, 60) if f.action == "alert.resolved"]
        return counts, alert.idempotency_key, facts

    counts, key, facts = with_store(relay_db, rules, body)
    assert counts == [0, 0, 1, 1], "resolved while the death was not over, or not once it was"
    (fact,) = facts
    assert fact["resolves"] == key and fact["executorId"] == "stuck" and "recovered" in fact["reason"]


def test_with_send_resolutions_off_an_ended_episode_is_audited_and_no_resolution_is_started(relay_db: str) -> None:
    """``alerts.sendResolutions: false`` (a receiver that takes every call as a new alert): the end
    is still audited, and the audit poll starts no delivery for it."""
    rules = [{"kind": "UnresponsiveApplication", "forSecs": 0, "minIntervalSecs": 0, "webhook": "http://127.0.0.1:9/"}]
    down = [Observed({"appName": "ledger"}, "ledger", "down")]
    config = RelayConfig.model_validate(alert_config(free_port(), rules, sendResolutions=False))
    assert config.alerts.send_resolutions is False

    async def body(db: Database, store: AlertStore) -> tuple[int, int]:
        (rule,) = await store.rules_of(frozenset({Kind.UNRESPONSIVE_APPLICATION}))
        ((alert, _),) = await due_alerts(store, rule, down)
        assert (await store.claim(alert)).send
        await store.finish(alert, True, 1, None, "x", "d1")
        await due_alerts(store, rule, [])
        ended = len([f for f in await store.audit_facts(0, 60) if f.action == "alert.resolved"])
        # DBOS is not launched here: a delivery started would raise (as with resolutions on).
        started = await AlertLoops(store, config.alerts, lambda: True).poll_events()
        on = config.alerts.model_copy(update={"send_resolutions": True})
        try:
            await AlertLoops(store, on, lambda: True).poll_events()
        except DBOSException as exc:
            assert "No DBOS was created" in str(exc)
            return ended, started
        raise AssertionError("with resolutions on, the poll started no delivery")

    assert with_store(relay_db, rules, body) == (1, 0)


def test_a_rule_added_back_beside_its_edited_self_is_a_rule_of_its_own(relay_db: str) -> None:
    """A relay.yaml rule (forSecs 30) was edited (forSecs 90) and kept its id, the one drawn from
    forSecs 30; the operator then adds a forSecs 30 rule back beside it. Its id, drawn again from
    forSecs 30, was the edited rule's: the second upsert overwrote the first, and one of the two
    rules the file names was gone (its alerts never sent). Both are rules, each with an id of its own."""
    hook = "http://127.0.0.1:9/"
    first = {"kind": "UnresponsiveApplication", "forSecs": 30, "minIntervalSecs": 0, "webhook": hook}
    edited = {**first, "forSecs": 90}
    kinds = frozenset({Kind.UNRESPONSIVE_APPLICATION})

    async def body(db: Database, store: AlertStore) -> list[tuple[str, float]]:
        await store.sync_config(RelayConfig.model_validate(alert_config(free_port(), [edited])))
        await store.sync_config(RelayConfig.model_validate(alert_config(free_port(), [edited, first])))
        return sorted((r.id, float(r.param("forSecs", 0.0))) for r in await store.rules_of(kinds))

    rules = with_store(relay_db, [first], body)
    assert sorted(secs for _, secs in rules) == [30.0, 90.0], f"a rule of the file was lost: {rules}"
    assert len({rule_id for rule_id, _ in rules}) == 2, rules


def test_rules_and_app_figures_count_their_apps_own_workflows_whichever_executor_answers(
    start_relay: StartRelay,
) -> None:
    """Apps may share a system database. Relay's own counts (a WorkflowFailure and a SlowQueue rule's
    conditions, the app figures' five requests) asked without ``application_name``, so that what was
    counted was whatever the executor answering took for its app (the SDKs' default: their own app,
    which the API's requests no longer rely on either). Every one names the app now. The executor is
    simulated: it keeps what Relay asks."""
    rules = [
        {"kind": "WorkflowFailure", "webhook": "http://127.0.0.1:9/"},
        {"kind": "SlowQueue", "thresholdSecs": 1, "webhook": "http://127.0.0.1:9/"},
    ]
    config = alert_config(free_port(), rules)
    config["metrics"] = {"appFiguresWindowSecs": 1.0}
    relay = start_relay(config)
    asked: list[dict[str, Any]] = []

    def keep(request: dict[str, Any]) -> dict[str, Any]:
        asked.append(request)
        return {"output": []}

    def seen() -> set[str]:
        found = set()
        for request in list(asked):
            status = request["body"].get("status") or []
            if "ERROR" in status:
                found.add("WorkflowFailure")
            elif status == ["ENQUEUED"]:
                found.add("SlowQueue")
            elif request["type"] == "get_step_aggregates":
                found.add("figures")
        return found

    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "ledger-1", "answer", replies={"get_workflow_aggregates": keep,
                                                          "get_step_aggregates": keep}):  # fmt: skip
        assert_eventually(lambda: seen() == {"WorkflowFailure", "SlowQueue", "figures"}, 20, what="every count")
    unnamed = [(r["type"], r["body"]) for r in asked if r["body"].get("application_name") != ["ledger"]]
    assert unnamed == [], f"counts that do not name the app: {unnamed}"


def test_a_slow_queue_rule_for_a_queue_of_2000_characters_is_made_both_ways_and_fires(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    """A queue's name is bounded as the workflow API bounds it (16 KiB in UTF-8; DBOS takes 2,000
    random characters on PostgreSQL): a rule's ``queueName`` was bounded at 1,024 characters in
    relay.yaml and the API, so no rule could watch such a queue. A rule for one is made in relay.yaml
    and through the API, by Relay's name and Conductor's, and both fire while the queue is held up."""
    long_queue = "".join(random.Random(2000).choice(string.ascii_letters + string.digits) for _ in range(2000))
    with WebhookReceiver() as receiver:
        rules = [{"kind": "SlowQueue", "queueName": long_queue, "thresholdSecs": 1, "webhook": receiver.url("/yaml")}]
        relay = start_relay(alert_config(free_port(), rules))
        with relay.api() as api:
            made = api.post(
                "/apps/ledger/alerting-rules",
                json={"ruleType": "SlowQueue", "webhook": receiver.url("/api"),
                      "ruleMetadata": {"queue_name": long_queue, "threshold_secs": 1}},
            )  # fmt: skip
            assert made.status_code == 201, made.text
            assert made.json()["ruleMetadata"] == {"queueName": long_queue, "thresholdSecs": 1}
            # One byte past the bound is refused, naming the parameter.
            past = "é" * (MAX_QUEUE_OR_SCHEDULE_NAME_BYTES // 2) + "x"
            refused = api.post(
                "/apps/ledger/alerting-rules", json={"ruleType": "SlowQueue", "ruleMetadata": {"queueName": past}}
            )
            assert refused.status_code == 422, refused.text
            assert [e["location"] for e in refused.json()["errors"]] == ["body.ruleMetadata.queueName"], refused.text
        env = {
            "RELAY_TEST_EVIDENCE": evidence_db,
            "RELAY_TEST_HOLD_QUEUE": "1",
            "RELAY_TEST_HOLD_QUEUE_NAME": long_queue,
        }
        start_executor(relay.conductor_url, module="harness.alert_app", env=env)

        def fired() -> dict[str, list[dict[str, Any]]]:
            sent = receiver.deliveries("SlowQueue", accepted=True)
            by_path = {path: [d.payload for d in sent if d.path == path] for path in ("/yaml", "/api")}
            return by_path if all(by_path.values()) else {}

        for path, payloads in assert_eventually(
            fired, 30, what="SlowQueue for the long queue, from both rules"
        ).items():
            (payload,) = payloads
            assert payload["queueName"] == long_queue and payload["metadata"]["queues"] == long_queue, (path, payload)
