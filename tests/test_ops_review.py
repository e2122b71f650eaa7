"""An operator's review of alerts and app settings: whether what relay.yaml and the API promise an
app still holds after what operators do at night. Deleting an app and letting its executors bring it
back (its relay.yaml rules and settings), a webhook written by host name (the allow-list at start),
a rule pointed at a working receiver while a death's alert is failing (the alert's fate), a rule
parameter given by both its names, and a dead-lettered workflow against the WorkflowFailure rule.
A real Relay process, real PostgreSQL, real DBOS executors and a real webhook receiver. Each of the
first six failed on the code before its fix (a reviewer's, after stop 36); the last two show the
fixes' own rules (an app the file lists, a rule's id across a webhook's change and the upgrade)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import yaml

from harness.executors import ExecutorProcess
from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.procs import listens
from harness.receiver import WebhookReceiver
from harness.relay import RelayProcess
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.cli import main as cli_main
from relay.domain.alerts import COMMIT_LAG_SECS, MAX_CATCH_UP_SECS
from tests.test_alerts import alert_config, audit

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


def test_an_app_of_relay_yaml_deleted_and_back_keeps_its_relay_yaml_alert_rules(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """``DELETE /apps/ledger`` (allowed: no executor in the registry) cascades to ``alert_rules``,
    relay.yaml's rules included, and they are copied in again only at Relay's next start. When the
    app's executors come back (the app registered again at their connection), its relay.yaml
    ``ExecutorDead`` rule is gone until Relay restarts: a death meanwhile pages nobody."""
    with WebhookReceiver() as receiver:
        rules = [{"kind": "ExecutorDead", "webhook": receiver.url("/dead"), "minIntervalSecs": 0}]
        relay = start_relay(alert_config(free_port(), rules))
        with relay.api() as api:
            assert [r["source"] for r in api.get("/apps/ledger/alerting-rules").json()] == ["config"]
            # Refusing to forget an app of relay.yaml (409) would keep its rules as well.
            assert api.delete("/apps/ledger").status_code in (204, 409)
        executor = start_executor(relay.conductor_url)
        assert_eventually(lambda: relay.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 15)
        with relay.api() as api:
            listed = api.get("/apps/ledger/alerting-rules")
        assert listed.status_code == 200
        assert [r["source"] for r in listed.json()] == ["config"], "relay.yaml's rule is gone after the app came back"


def test_an_app_of_relay_yaml_deleted_and_back_keeps_its_relay_yaml_settings(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """An app listed in relay.yaml, deleted through the API and registered again by its executors'
    next connection, gets the defaults (``AppStore.ensure``: a 60 s grace period, retention off), not
    relay.yaml's settings, and a restart never restores them (``sync_config`` inserts ON CONFLICT DO
    NOTHING): the grace period the operator configured, and its retention, are silently gone."""
    config = alert_config(free_port(), [], grace=2.5)
    config["orgs"][0]["apps"][0]["gcTimeThresholdMs"] = 3_600_000
    relay = start_relay(config)
    with relay.api() as api:
        before = api.get("/apps/ledger").json()
        assert (before["gracePeriodSecs"], before["gcTimeThresholdMs"]) == (2.5, 3_600_000)
        assert api.delete("/apps/ledger").status_code in (204, 409)  # a 409 would keep them too
    executor = start_executor(relay.conductor_url)
    assert_eventually(lambda: relay.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 15)
    with relay.api() as api:
        after = api.get("/apps/ledger").json()
    assert (after["gracePeriodSecs"], after["gcTimeThresholdMs"]) == (2.5, 3_600_000), (
        "relay.yaml's settings of the app are lost once it is deleted and comes back"
    )


def test_relay_yaml_refuses_a_webhook_whose_host_name_the_allow_list_refuses(tmp_path: Path, relay_db: str) -> None:
    """README "Safety": every address a webhook's name resolves to is checked when the rule is made
    (the API answers 422), and relay.yaml refuses a literal loopback address at start (exit 2). The
    same destination written by name, ``http://localhost:PORT/``, is taken silently from relay.yaml
    (``literal_refusal`` checks literal addresses only): Relay starts, and every alert of the rule is
    refused at send time, a final failure, never retried. The operator learns it from the first
    ``alert.failed``, at night."""
    port = free_port()
    config = alert_config(port, [{"kind": "ExecutorDead", "webhook": "http://localhost:9/hook"}])
    config["alerts"]["allowedDestinations"] = []  # loopback not listed: refused
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "RELAY_INSTANCE_ID": "relay-review", "RELAY_HOME": str(tmp_path / "home")}
    env.pop("RELAY_DATABASE_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "serve", "--config", str(path), "--database-url", relay_db],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:

        def started_or_exited() -> bool:
            if proc.poll() is not None:
                return True
            if not listens(proc.pid, port):  # this one answering, not another run's server on the port
                return False
            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1, verify=TLS).status_code == 200
            except httpx.HTTPError:
                return False

        assert_eventually(started_or_exited, 60, what="relay serve to start or refuse its configuration")
        exited = proc.poll()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        _, stderr = proc.communicate()
    assert exited == 2, "relay serve started with a webhook the allow-list refuses (a loopback host name)"
    assert b"webhook" in stderr


def test_a_death_paged_to_a_receiver_that_is_down_reaches_the_webhook_relay_yaml_is_fixed_to(
    start_relay: StartRelay, start_executor: StartExecutor
) -> None:
    """A death's alert keeps failing (the receiver at the rule's webhook is down); the operator points
    the rule at a receiver that works, in relay.yaml, and restarts Relay. relay.yaml's rule ids are
    drawn from their content, webhook included (``config_rule_id``), so the fixed rule is a new rule
    made after the death (it fires only for later events) and the old one is deleted: the delivery
    resumed after the restart ends in ``alert.failed`` ("its rule was deleted") and the death reaches
    no receiver. A delivery is meant to go on after Relay restarts, to where its rule says now."""
    with WebhookReceiver() as down, WebhookReceiver() as fixed:
        down.fail_for(600)
        rules = [{"kind": "ExecutorDead", "webhook": down.url("/old"), "minIntervalSecs": 0}]
        config = alert_config(free_port(), rules, maxAttempts=1000)
        relay = start_relay(config)
        executor = start_executor(relay.conductor_url)
        assert_eventually(lambda: relay.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 15)
        executor.kill()
        assert_eventually(lambda: len(down.deliveries("ExecutorDead")) >= 2, 20, what="refused attempts")
        relay.stop()
        config["orgs"][0]["apps"][0]["alerts"] = [
            {"kind": "ExecutorDead", "webhook": fixed.url("/new"), "minIntervalSecs": 0}
        ]
        relay.config_path.write_text(yaml.safe_dump(config))
        relay.start()

        def paged() -> bool:
            return any(p["executorId"] == executor.executor_id for p in fixed.payloads("ExecutorDead"))

        def given_up() -> list[dict[str, Any]]:
            return audit(relay, "alert.failed")

        assert_eventually(lambda: paged() or given_up(), 30, what="the death paged, or its delivery given up")
        assert paged(), f"the death reached no receiver: {[e['detail'].get('error') for e in given_up()]}"


def test_a_rule_giving_a_parameter_by_both_its_names_with_two_values_is_refused(start_relay: StartRelay) -> None:
    """``ruleMetadata`` takes a parameter by Conductor's name or Relay's (``threshold`` or ``count``,
    ``workflow_name`` or ``workflowName``). Given both, with different values, the rule is made (201)
    with one of them picked silently (``_rule_fields``: the later name in the model's order wins):
    an operator who wrote ``count: 5`` gets a rule that pages at 2 failures, and one who wrote
    ``workflowName: payroll`` a rule that watches ``billing``. A body that says two things about one
    parameter is a 422."""
    with WebhookReceiver() as receiver:
        relay = start_relay(alert_config(free_port(), []))
        with relay.api() as api:
            answers = [
                api.post(
                    "/apps/ledger/alerting-rules",
                    json={
                        "ruleType": "WorkflowFailure",
                        "webhook": receiver.url(),
                        "ruleMetadata": metadata,
                    },
                )
                for metadata in ({"count": 5, "threshold": 2}, {"workflowName": "payroll", "workflow_name": "billing"})
            ]
            made = [r["ruleMetadata"] for r in api.get("/apps/ledger/alerting-rules").json()]
        assert [a.status_code for a in answers] == [422, 422], f"taken as {made}"


def test_a_dead_lettered_workflow_fires_a_workflow_failure_rule_as_it_counts_as_failed_in_the_metrics(
    start_relay: StartRelay, start_executor: StartExecutor, sysdb: str, evidence_db: str
) -> None:
    """A workflow that crashes its executor again and again ends ``MAX_RECOVERY_ATTEMPTS_EXCEEDED``
    (the SDK dates its completion): ``dbos_conductor_v1_workflow_failed_rate`` counts it as failed
    (README "Metrics", as Conductor's metrics.md), and Conductor's WorkflowFailure alert is about
    workflows that fail. Relay's ``WorkflowFailure`` asks only for ``status=["ERROR"]``
    (``ConditionObserver._failures``): the poison workflow that is the worst failure an app has never
    pages, while the dashboard shows it failing."""
    with WebhookReceiver() as receiver:
        failing_app(start_relay, start_executor, evidence_db, receiver, "crashy", 120)
        with psycopg.connect(sysdb, autocommit=True) as conn:

            def failed_rows() -> int:
                row = conn.execute("SELECT count(*) FROM dbos.workflow_status WHERE name = 'failing'").fetchone()
                return int(row[0]) if row else 0

            assert_eventually(lambda: failed_rows() == 1, 15, what="the app's failing workflow")
            # The row the SDK writes when a workflow exceeds its recovery attempts, as that of a real
            # workflow of the app (its application name and version): dead-lettered just now.
            with conn.transaction():
                conn.execute("CREATE TEMP TABLE poison AS SELECT * FROM dbos.workflow_status WHERE name = 'failing'")
                now_ms = int(time.time() * 1000)
                conn.execute(
                    """UPDATE poison SET workflow_uuid = 'crashy-1', name = 'crashy',
                           status = 'MAX_RECOVERY_ATTEMPTS_EXCEEDED', created_at = %s, updated_at = %s,
                           completed_at = %s""",
                    (now_ms - 5000, now_ms, now_ms),
                )
                conn.execute("INSERT INTO dbos.workflow_status SELECT * FROM poison")
        paged = assert_eventually_or_none(lambda: receiver.payloads("WorkflowFailure"), 10)
        assert paged, "a dead-lettered workflow paged nobody (WorkflowFailure counts ERROR only)"
        assert paged[0]["workflowName"] == "crashy"


def failing_app(
    start_relay: StartRelay,
    start_executor: StartExecutor,
    evidence_db: str,
    receiver: WebhookReceiver,
    workflow_name: str,
    window_secs: float,
) -> RelayProcess:
    """A Relay whose ledger has a WorkflowFailure rule (one failure of ``workflow_name`` within
    ``window_secs``) paging ``receiver``, and a HEALTHY alert_app executor that ran one ``failing``."""
    rules = [{"kind": "WorkflowFailure", "workflowName": workflow_name, "count": 1, "windowSecs": window_secs,
              "webhook": receiver.url("/failures"), "minIntervalSecs": 0}]  # fmt: skip
    relay = start_relay(alert_config(free_port(), rules))
    env = {"RELAY_TEST_EVIDENCE": evidence_db, "RELAY_TEST_FAILURES": "1"}
    executor = start_executor(relay.conductor_url, module="harness.alert_app", env=env)
    assert_eventually(lambda: relay.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 15)
    return relay


def assert_eventually_or_none(condition: Callable[[], Any], timeout: float) -> Any:
    """What ``condition`` returns once truthy within ``timeout`` seconds, else its last (falsy) value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_an_app_relay_yaml_lists_is_refused_deletion_until_the_file_no_longer_lists_it(
    start_relay: StartRelay,
) -> None:
    """The fix of the two tests above: ``DELETE`` of an app relay.yaml lists is a 409
    ``defined_in_config`` (the app and its rules stay); once an instance starts
    with a file that no longer lists it, the app can be deleted (``from_config`` follows the file)."""
    config = alert_config(free_port(), [])
    config["orgs"][0]["apps"].append({"name": "extra", "executorTimeoutSecs": 5})
    relay = start_relay(config)
    with relay.api() as api:
        refused = api.delete("/apps/extra")
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "defined_in_config"
        assert "relay.yaml" in refused.json()["detail"]
        assert api.get("/apps/extra").status_code == 200
    relay.stop()
    config["orgs"][0]["apps"] = [a for a in config["orgs"][0]["apps"] if a["name"] != "extra"]
    relay.config_path.write_text(yaml.safe_dump(config))
    relay.start()
    with relay.api() as api:
        assert api.get("/apps/extra").json()["executorTimeoutSecs"] == 5  # kept: the file no longer says
        assert api.delete("/apps/extra").status_code == 204
        assert api.get("/apps/extra").status_code == 404
        assert api.delete("/apps/ledger").status_code == 409  # still listed


def test_a_relay_yaml_rule_keeps_its_id_when_its_webhook_changes_and_when_its_id_was_drawn_the_old_way(
    start_relay: StartRelay, relay_db: str
) -> None:
    """A rule of the file is the rule in the database that watches for the same thing, whatever its
    destination: a webhook changed in relay.yaml keeps the rule's id (its deliveries go on), two rules
    that differ only in their webhooks stay two, and a rule whose id an earlier release drew from its
    content with the webhook (``config-`` and a hash of it) keeps that id across the upgrade: no
    rule is deleted and made again, so nothing fires twice and no delivery loses its rule."""

    def rules() -> dict[str, str]:  # webhook -> id (the API shows no webhook's path)
        with psycopg.connect(relay_db, autocommit=True) as conn:
            rows = conn.execute("SELECT webhook_url, id FROM alert_rules WHERE source = 'config'").fetchall()
        return {str(url): str(rule_id) for url, rule_id in rows}

    with WebhookReceiver() as one, WebhookReceiver() as two:
        rules_in_file = [
            {"kind": "ExecutorDead", "webhook": one.url("/a"), "minIntervalSecs": 0},
            {"kind": "ExecutorDead", "webhook": two.url("/b"), "minIntervalSecs": 0},
        ]
        config = alert_config(free_port(), rules_in_file)
        relay = start_relay(config)
        before = rules()
        assert set(before) == {one.url("/a"), two.url("/b")}
        relay.stop()
        # As an earlier release left it: the first rule under an id of its own drawing.
        with psycopg.connect(relay_db, autocommit=True) as conn:
            old_id = "config-0123456789abcdef0123"
            conn.execute("UPDATE alert_rules SET id = %s WHERE id = %s", (old_id, before[one.url("/a")]))
        config["orgs"][0]["apps"][0]["alerts"][1]["webhook"] = two.url("/moved")
        relay.config_path.write_text(yaml.safe_dump(config))
        relay.start()
        after = rules()
        with relay.api() as api:
            listed = api.get("/apps/ledger/alerting-rules").json()
    assert after == {one.url("/a"): old_id, two.url("/moved"): before[two.url("/b")]}
    assert sorted(r["id"] for r in listed) == sorted(after.values())


def test_a_failure_window_shorter_than_the_check_interval_misses_no_failure(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, sysdb: str, tmp_path: Path
) -> None:
    """A ``WorkflowFailure`` rule counts the failures of its last ``windowSecs`` at each check, every
    ``alerts.checkIntervalSecs``: with a window shorter than that (here 0.01 s against 0.5 s), a
    failure between two windows was counted by neither and paged nobody (the reviewer's suspicion).
    Each count now reaches back at least to the one before.

    That was not enough (a full run at load 7 to 8 paged nobody): the executor stamps a failure
    (``completed_at``) when its status write begins and commits it a moment later. A count that read
    in between did not see it, and the next one, reaching back only to that count's moment, found it
    too old. Here the fork's status write is held across two counts (the executor's
    RELAY_TEST_HOLD_FAILURES), as a loaded machine holds one by chance; each count now reaches back
    ``COMMIT_LAG_SECS`` before the one before."""
    held = tmp_path / "held.jsonl"
    with WebhookReceiver() as receiver:
        config = alert_config(free_port(), [])
        relay = start_relay(config)
        env = {"RELAY_TEST_EVIDENCE": evidence_db, "RELAY_TEST_FAILURES": "1", "RELAY_TEST_HOLD_FAILURES": str(held)}
        executor = start_executor(relay.conductor_url, module="harness.alert_app", env=env)
        assert_eventually(lambda: relay.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 15)
        with psycopg.connect(sysdb, autocommit=True) as conn:
            query = "SELECT workflow_uuid, completed_at FROM dbos.workflow_status WHERE name = 'failing'"
            row = conn.execute(query).fetchone()
        assert row is not None
        # The rule is made once the failure at launch (not held) is out of its counts' reach: its first
        # count reaches back an interval and the margin. What pages is the fork's failure.
        reach = row[1] / 1000 + config["alerts"]["checkIntervalSecs"] + COMMIT_LAG_SECS + 0.1
        assert_eventually(lambda: time.time() > reach, 5, what="the failure at launch out of reach")
        with relay.api() as api:
            rule = {"ruleType": "WorkflowFailure", "webhook": receiver.url("/failures"), "minIntervalSecs": 0,
                    "ruleMetadata": {"workflowName": "failing", "count": 1, "windowSecs": 0.01}}  # fmt: skip
            made = api.post("/apps/ledger/alerting-rules", json=rule)
            assert made.status_code == 201, made.text
            forked = api.post(f"/apps/ledger/workflows/{row[0]}/fork", json={"startStep": 0})
        assert forked.status_code == 201, forked.text
        paged = assert_eventually_or_none(lambda: receiver.payloads("WorkflowFailure"), 10)
        holds = [json.loads(line) for line in held.read_text().splitlines()] if held.exists() else []
    assert [h["counts"] for h in holds] == [2], holds  # the fork's write was held across two counts
    # Held for longer than the margin (a machine so loaded that two counts took that long), it is missed.
    lag = f"held {holds[0]['held_secs']:.2f} s, counts reach back {COMMIT_LAG_SECS} s before the one before"
    assert paged, f"a failure committed after a count that came after its stamp paged nobody ({lag})"
    assert paged[0]["workflowName"] == "failing"


def test_a_failure_between_one_instances_last_count_and_anothers_first_is_counted(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, sysdb: str, relay_db: str, tmp_path: Path
) -> None:
    """Each count of a ``WorkflowFailure`` rule reaches back to the one before (above). That count's
    moment was kept in the memory of the instance that made it: the next round may run on another
    instance (each round runs once, wherever it was started first), or after a restart, and that
    instance reached back one check interval only. A failure after the last count of relay-1, which
    then stopped, and more than that interval (and the margin) before the first count of relay-2 was
    counted by neither, and paged nobody. The count's moment is kept with the rule, in the
    transaction that settles the count, and relay-2 reaches back to relay-1's last count."""
    gate = tmp_path / "fail-now"
    with WebhookReceiver() as receiver:
        rules = [{"kind": "WorkflowFailure", "workflowName": "failing", "count": 1, "windowSecs": 0.5,
                  "webhook": receiver.url("/failures"), "minIntervalSecs": 0}]  # fmt: skip
        # A grace period longer than the test: the executor's reconnection to relay-2 is no death.
        config = alert_config(free_port(), rules, grace=60)
        first = start_relay(config, instance_id="relay-1")
        env = {"RELAY_TEST_EVIDENCE": evidence_db, "RELAY_TEST_FAILURES": "1", "RELAY_TEST_FAILURES_GATE": str(gate)}
        executor = start_executor(first.conductor_url, module="harness.alert_app", env=env)
        assert_eventually(lambda: first.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 15)
        healthy_ms = time.time() * 1000

        def counts_since(since_ms: float) -> int:
            """The rule's evaluations (each its own workflow, relay.alerts.rule) begun after ``since_ms``
            and finished."""
            with psycopg.connect(relay_db, autocommit=True) as conn:
                row = conn.execute(
                    """SELECT count(*) FROM dbos.workflow_status
                       WHERE name = 'relay.alerts.rule' AND status = 'SUCCESS' AND created_at > %s""",
                    (since_ms,),
                ).fetchone()
            return int(row[0]) if row else 0

        assert_eventually(lambda: counts_since(healthy_ms) >= 2, 15, what="relay-1 counting the rule")
        first.stop()
        gate.touch()  # the failure, with no instance running
        with psycopg.connect(sysdb, autocommit=True) as conn:

            def failed_at() -> float | None:
                row = conn.execute(
                    "SELECT completed_at FROM dbos.workflow_status WHERE name = 'failing' AND status = 'ERROR'"
                ).fetchone()
                return None if row is None or row[0] is None else row[0] / 1000

            failed = assert_eventually(failed_at, 15, what="the failure")
        # relay-2's first count, reaching back one check interval and the margin, cannot see it.
        reach = failed + config["alerts"]["checkIntervalSecs"] + COMMIT_LAG_SECS + 0.5
        assert_eventually(lambda: time.time() > reach, 10, what="the failure out of one interval's reach")
        started_ms = time.time() * 1000
        start_relay(config, instance_id="relay-2")
        paged = assert_eventually_or_none(lambda: receiver.payloads("WorkflowFailure"), 20)
        counted = counts_since(started_ms)
        assert paged, f"a failure between two counts paged nobody (relay-2 evaluated the rule {counted} times)"
        assert [p["workflowName"] for p in paged] == ["failing"], paged


def test_a_count_after_a_long_gap_reaches_back_an_hour_beyond_the_window_at_most(
    start_relay: StartRelay, relay_db: str
) -> None:
    """The last count's time is kept in the database (above): after Relay was down for two hours, a
    count reaching back to it would measure two hours of failures against a threshold per
    ``windowSecs``, and page for a rate the rule does not describe. It reaches back the rule's
    window, one check interval and ``MAX_CATCH_UP_SECS`` at most."""
    asked: list[tuple[float, dict[str, Any]]] = []

    def aggregates(request: dict[str, Any]) -> dict[str, Any]:
        asked.append((time.time(), request["body"]))
        deep = reach_back(request["body"], time.time()) > 120  # the count after the gap finds two failures
        return {"output": [{"group": {"name": "failing"}, "count": 2}] if deep else []}

    def reach_back(body: dict[str, Any], at: float) -> float:
        return at - datetime.fromisoformat(body["completed_after"]).timestamp()

    with WebhookReceiver() as receiver:
        rules = [{"kind": "WorkflowFailure", "workflowName": "failing", "count": 1, "windowSecs": 60,
                  "webhook": receiver.url("/failures"), "minIntervalSecs": 0}]  # fmt: skip
        config = alert_config(free_port(), rules)
        relay = start_relay(config)
        url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
        with SimulatedPeer(url, "peer-1", "answer", replies={"get_workflow_aggregates": aggregates}):
            assert_eventually(lambda: asked, 15, what="a first count")
            first = len(asked)

            def counted_after_the_gap() -> list[tuple[float, dict[str, Any]]]:
                deep = [(at, body) for at, body in asked[first:] if reach_back(body, at) > 120]
                if not deep:  # again: a count in flight as it was set down may have settled over it
                    with psycopg.connect(relay_db, autocommit=True) as conn:
                        conn.execute("UPDATE alert_rules SET counted_at = now() - interval '2 hours'")
                return deep

            ((at, body), *_) = assert_eventually(counted_after_the_gap, 15, what="a count after the gap")
            # Its alert says what span it counted, not the rule's window.
            paged = assert_eventually(lambda: receiver.payloads("WorkflowFailure"), 15, what="its alert")[0]
        limit = 60 + config["alerts"]["checkIntervalSecs"] + MAX_CATCH_UP_SECS
        # The reach is taken before Relay reads the rule's time and sends: a second or more under load.
        assert limit - 1 < reach_back(body, at) <= limit + 5, (reach_back(body, at), limit)
        assert re.fullmatch(
            r"2 workflow failing of app ledger failed in the 36\d\d s since the rule was last counted "
            r"\(threshold 1 in 60 s\)\.",
            paged["message"],
        ), paged["message"]


def test_a_clean_stop_in_a_rolling_restart_fires_no_instance_adopted_alert(
    start_relay: StartRelay, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rolling restart stops each instance cleanly, which gives its lease up at once so that
    another adopts its executors without waiting for it to run out: the adoption was audited and
    alerted as an ``InstanceAdopted`` ("another Relay instance adopted one whose lease ran out"), so
    every deploy paged the on-call (the deployment reviewer's suspicion). The entry now says
    ``released: true`` and fires nothing; a lease that runs out (an instance killed) still does.

    ``GET .../instances`` and ``relay instances`` showed both leases alike (not live, "expired"):
    the on-call engineer could not tell a planned stop from a lost instance. The list says
    ``releasedAt`` and the command ``released``; an instance started again under the same id holds
    its lease, its earlier release not shown. The adopter's log said "its lease expired" for both."""
    with WebhookReceiver() as receiver:
        rules = [{"kind": "InstanceAdopted", "webhook": receiver.url()}]
        configs = [alert_config(free_port(), rules) for _ in range(3)]
        for config in configs:
            config["liveness"]["instanceLeaseSecs"] = 1.5
        r1, r2, r3 = (start_relay(config, instance_id=f"relay-{n}") for n, config in enumerate(configs, 1))
        r1.stop()  # SIGTERM: a clean stop

        def adoptions(of: str) -> list[dict[str, Any]]:
            return [e["detail"] for e in audit(r2, "relay.instance_adopted") if e["detail"]["instance"] == of]

        def listed() -> dict[str, dict[str, Any]]:
            with r2.api() as api:
                return {i["instanceId"]: i for i in api.get("/instances").json()}

        def leases() -> dict[str, str]:
            """``relay instances``' lease column by instance, through the command's entry point."""
            for name in [k for k in os.environ if k.startswith("RELAY_")]:
                monkeypatch.delenv(name)
            monkeypatch.setenv("RELAY_URL", r2.http)
            monkeypatch.setenv("RELAY_API_KEY", API_KEYS["acme"])
            capsys.readouterr()
            assert cli_main(["instances"]) == 0
            header, *rows = capsys.readouterr().out.splitlines()
            assert header.split()[:2] == ["INSTANCE", "LEASE"], header
            return {row.split()[0]: row.split()[1] for row in rows}

        stopped = listed()["relay-1"]
        # Given up at the moment of the stop, which ended the lease then: seen by the other instances.
        assert (stopped["live"], stopped["releasedAt"]) == (False, stopped["leaseExpiresAt"])
        assert stopped["releasedAt"] is not None
        assert abs(datetime.fromisoformat(stopped["releasedAt"]).timestamp() - time.time()) < 5
        (released,) = assert_eventually(lambda: adoptions("relay-1"), 15, what="relay-1 adopted")
        assert released["released"] is True
        adopter = {"relay-2": r2, "relay-3": r3}[released["adoptedBy"]]
        # Logged once the adoption (and its audit entry) has committed: awaited, not read at once.
        said = "adopted instance relay-1 (it released its lease): "
        assert_eventually(lambda: said in adopter.log(), 10, what="relay-1's adoption logged")
        # One executor on relay-3, adopted with it: the line said "1 executors".
        url = f"ws://127.0.0.1:{r3.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
        with SimulatedPeer(url, "on-relay-3", "close"):
            assert_eventually(lambda: r3.state_of("acme", "ledger", "on-relay-3") == "HEALTHY", 10)
            r3.signal(signal.SIGKILL)  # its lease runs out
            (lost,) = assert_eventually(lambda: adoptions("relay-3"), 15, what="relay-3 adopted")
        assert lost["released"] is False
        said = "adopted instance relay-3 (its lease expired): 1 executor, "
        assert_eventually(lambda: said in r2.log(), 10, what="relay-3's adoption logged")
        killed = listed()["relay-3"]
        assert (killed["live"], killed["releasedAt"], killed["adoptedBy"]) == (False, None, "relay-2")
        assert leases() == {"relay-1": "released", "relay-2": "held", "relay-3": "expired"}
        paged = assert_eventually(lambda: receiver.payloads("InstanceAdopted"), 15, what="the lost one alerted")
        r1.start()  # the same id again, a new epoch
        again = listed()["relay-1"]
        assert (again["live"], again["releasedAt"], again["adoptedBy"]) == (True, None, None)
        assert again["leaseEpoch"] > stopped["leaseEpoch"]
        assert leases()["relay-1"] == "held"
    assert [p["instance"] for p in paged] == ["relay-3"], paged


def test_relay_yaml_settings_not_in_force_are_named_in_the_log_at_start(start_relay: StartRelay) -> None:
    """An app's settings in relay.yaml are copied when the app is first seen; a PATCH later (or a
    registration before the file listed the app) stands across restarts. The file then reads as in
    force while it is not, and nothing said so (the deployment reviewer's suspicion): each start
    logs which of the file's settings are not in force, and how to change them."""
    relay = start_relay(alert_config(free_port(), [], grace=2.5))
    with relay.api() as api:
        assert api.patch("/apps/ledger", json={"executorTimeoutSecs": 7}).status_code == 200
    assert "differ from those in force" not in relay.log()
    relay.stop()
    relay.start()
    assert "relay.yaml's settings of app acme/ledger differ from those in force" in relay.log()
    assert "executorTimeoutSecs 7.0, not 2.5" in relay.log()
    with relay.api() as api:
        assert api.get("/apps/ledger").json()["executorTimeoutSecs"] == 7


def test_a_relay_yaml_rule_delivering_to_an_app_relay_does_not_know_is_named_in_the_log_at_start(
    start_relay: StartRelay,
) -> None:
    """The API refuses a rule whose ``receiverApp`` Relay does not know (404); relay.yaml's was taken
    without a word, and a typo'd receiver made every alert of the rule fail unseen. The file's rule
    is kept (the app may come: its executors register it), and each start names it in the log."""
    rules = [{"kind": "ExecutorDead", "receiverApp": "ledgr", "minIntervalSecs": 0}]
    relay = start_relay(alert_config(free_port(), rules))
    assert "an alert rule of app acme/ledger delivers to app 'ledgr', which org acme does not have" in relay.log()
    with relay.api() as api:
        listed = api.get("/apps/ledger/alerting-rules").json()
    assert [(r["source"], r["receivingAppId"]) for r in listed] == [("config", "ledgr")], listed
