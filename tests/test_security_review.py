"""A security review's findings, each as a test that fails until the defect is fixed.

Each test names the attacker (no key, a read-only key, a key limited to one
app, an executor of one app, or whoever controls the strings an executor
reports), the attack, and what Relay must do instead.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx

from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.receiver import WebhookReceiver
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer, handshake, off_loop, open_socket
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.core.alerts import AuditFact, Kind, Rule, alerts_for_event, webhook_body
from tests.test_alerts import alert_config as alerts_config

StartRelay = Callable[..., RelayProcess]


def ws_url(relay: RelayProcess, org: str = "acme", app: str = "ledger") -> str:
    return f"ws://127.0.0.1:{relay.port}/websocket/{app}/{CONDUCTOR_KEYS[org]}"


def connect_then_leave(relay: RelayProcess, executor_id: str, org: str = "acme", app: str = "ledger") -> None:
    """An executor that connects with its own org's conductor key, is recorded HEALTHY, and leaves."""

    async def run() -> None:
        ws = await open_socket(ws_url(relay, org, app))
        await handshake(ws, executor_id)
        await off_loop(assert_eventually, lambda: relay.state_of(org, app, executor_id) == "HEALTHY", 15)
        await ws.close()

    asyncio.run(run())


def audit(relay: RelayProcess, action: str) -> list[dict[str, Any]]:
    with relay.api() as api:
        return [e for e in api.get("/audit", params={"limit": 10_000}).json() if e["action"] == action]


def alert_config(rules: list[dict[str, Any]]) -> dict[str, Any]:
    """The alert tests' relay.yaml (a short grace period, quick alert timings), three attempts."""
    return alerts_config(free_port(), rules, maxAttempts=3)


# -- /metrics: one tenant's key reads another tenant's registry ------------------------------------


def test_metrics_show_a_key_nothing_of_another_orgs_apps_or_executors(start_relay: StartRelay) -> None:
    """Attacker: any key with ``metric.read`` of org globex (or a key of acme limited to another app).

    Attack: ``GET /metrics`` (the default ``scope=all``). Relay's own families ``relay_executors``,
    ``relay_executors_blocked`` and ``relay_reconcile_*`` carry ``org`` and ``app`` labels and are
    served unfiltered, so globex's key reads acme's app names and how many executors each has in
    each state, and a key limited to one app reads every other app of its org.

    Expected: as for the apps' figures (``dbos_conductor_v1_*``), a scrape shows the key's org, and
    of a key limited to apps only those apps: no series labelled with another org or app.
    """
    relay = start_relay()
    connect_then_leave(relay, "acme-secret-executor", org="acme", app="ledger")
    with relay.api() as admin:
        made = admin.post("/tokens/other-app-metrics", json={"permissions": ["metric.read"], "appNames": ["other"]})
        assert made.status_code == 201, made.text
        limited = made.json()["token"]

    def scraped(key: str) -> str:
        resp = httpx.get(f"{relay.http}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10, verify=TLS)
        assert resp.status_code == 200, resp.text
        return resp.text

    # The acme executor's record is there to be counted (its own org sees it).
    assert_eventually(lambda: 'org="acme"' in scraped(API_KEYS["acme"]), 10, what="acme's executors in /metrics")
    foreign = [line for line in scraped(API_KEYS["globex"]).splitlines() if 'org="acme"' in line]
    assert foreign == [], f"globex's key reads acme's registry: {foreign[:3]}"
    other_apps = [line for line in scraped(limited).splitlines() if re.search(r'\bapp="ledger"', line)]
    assert other_apps == [], f"a key limited to app 'other' reads app ledger: {other_apps[:3]}"


# -- alerts: strings an executor chooses, in webhooks ----------------------------------------------


def test_a_webhook_alert_about_an_executor_whose_id_is_not_ascii_is_delivered(start_relay: StartRelay) -> None:
    """Attacker: an executor of the app (or simply an app whose executor ids, workflow names or queue
    names are not ASCII: ``exécuteur-1``, a hostname, a name in Chinese).

    Attack: the executor connects with a non-ASCII ``executor_id`` and then dies. The ExecutorDead
    alert's idempotency key (rule, subject, epoch) holds the id, and Relay sends it raw in the
    ``X-Relay-Idempotency-Key`` header: httpx refuses a non-ASCII header value (UnicodeEncodeError),
    every attempt fails the same way, and the alert ends in ``alert.failed``. An executor thereby
    chooses that its own death is never paged (WorkflowFailure and SlowQueue alerts fail the same
    way for a workflow or queue name that is not ASCII).

    Expected: the webhook is delivered (the header's value encoded so that any subject can be sent),
    with the executor's id in its body.
    """
    executor_id = "exécuteur-ü-1"
    with WebhookReceiver() as receiver:
        rules = [{"kind": "ExecutorDead", "webhook": receiver.url("/dead"), "minIntervalSecs": 0}]
        relay = start_relay(alert_config(rules))
        connect_then_leave(relay, executor_id)
        assert_eventually(
            lambda: any(e["executorId"] == executor_id for e in audit(relay, "executor.dead")), 20, what="the death"
        )
        assert_eventually(
            lambda: audit(relay, "alert.sent") or audit(relay, "alert.failed"), 20, what="the alert's outcome"
        )
        failed = audit(relay, "alert.failed")
        assert failed == [], f"the alert about {executor_id!r} was not delivered: {failed[0]['detail']}"
        assert [d.payload["executorId"] for d in receiver.deliveries("ExecutorDead")] == [executor_id]


def _dead_alert(executor_id: str) -> dict[str, Any]:
    """The Slack body of the ExecutorDead alert about ``executor_id``, made as Relay makes it."""
    rule = Rule("r1", "acme", "ledger", Kind.EXECUTOR_DEAD, {}, 0.0)
    fact = AuditFact(
        id=7,
        at="2026-01-01T00:00:00Z",
        at_unix=1.0,
        org="acme",
        app="ledger",
        action="executor.dead",
        executor_id=executor_id,
        detail={"epoch": 3},
    )
    (alert,) = alerts_for_event(fact, [rule])
    body: dict[str, Any] = json.loads(webhook_body(alert, "slack"))
    return body


def _mrkdwn_texts(body: dict[str, Any]) -> list[str]:
    """Every text of the Slack body that Slack reads as mrkdwn (the fallback ``text`` is too)."""
    texts = [body["text"]]
    for block in body["blocks"]:
        if block["type"] == "section" and block["text"]["type"] == "mrkdwn":
            texts.append(block["text"]["text"])
        for element in block.get("elements", []):
            if element.get("type") == "mrkdwn":
                texts.append(element["text"])
    return texts


def test_slack_alerts_do_not_pass_slack_control_sequences_from_executor_strings() -> None:
    """Attacker: an executor of the app (it chooses its ``executor_id``; a workflow's name, a queue's
    name and an error's text reach other kinds of alert the same way).

    Attack: an executor named ``x` <!channel> <https://evil.example/login|Relay: sign in again>``
    dies. Its ExecutorDead alert to a ``format: slack`` webhook puts the id into ``mrkdwn`` text as
    it is, inside the message and inside a backtick span it can close: Slack then notifies everyone
    in the on-call channel (``<!channel>``) and shows a link to the attacker's page under a label of
    the attacker's choosing, posted by Relay's trusted integration.

    Expected: as Slack's documentation requires of untrusted text, ``&``, ``<`` and ``>`` are escaped
    (``&amp;``, ``&lt;``, ``&gt;``) in every mrkdwn text, so that no control sequence of the
    executor's reaches Slack; the id is still shown (escaped).
    """
    evil = "x` <!channel> <https://evil.example/login|Relay: sign in again> `"
    texts = _mrkdwn_texts(_dead_alert(evil))
    for text in texts:
        assert "<!channel>" not in text, f"a Slack broadcast from an executor's id: {text!r}"
        assert "<https://evil.example" not in text, f"a Slack link from an executor's id: {text!r}"
    assert any("&lt;!channel&gt;" in text for text in texts), "the id is shown, escaped"


# -- logs: text an executor sends, in Relay's log ----------------------------------------------------


def test_an_alert_handlers_error_reaches_the_log_with_its_control_characters_escaped(
    start_relay: StartRelay,
) -> None:
    """Attacker: an executor of the app an alert is delivered to (a rule without a webhook delivers to
    its app's own ``@DBOS.alert_handler``).

    Attack: it answers the ``alert`` request with ``success: false`` and an ``error_message`` holding
    terminal escape sequences (ESC ``]0;`` sets the terminal's title, ESC ``[2J`` clears the screen;
    OSC 52 writes the clipboard). Relay logs the failed attempt with the error's last line as it
    came: the sequences reach the terminal of the operator reading the log (``docker logs``,
    ``journalctl -f``), as Relay's own rule says they must not (ids and names are logged escaped:
    tests/test_hostile_input.py).

    Expected: the error is in the log with its control characters escaped (``printable``), and no
    ESC byte an executor sent is in Relay's log.
    """
    hostile = "handler failed \x1b]0;owned\x07\x1b[2J\x1b[31mRELAY OK"
    relay = start_relay(alert_config([{"kind": "ExecutorDead", "minIntervalSecs": 0}]))
    replies: dict[str, Any] = {"alert": {"success": False, "error_message": hostile}}
    with SimulatedPeer(ws_url(relay), "alert-handler", on_recovery="lie", replies=replies):
        assert_eventually(lambda: relay.state_of("acme", "ledger", "alert-handler") == "HEALTHY", 15)
        connect_then_leave(relay, "dies-first")
        assert_eventually(
            lambda: "alert handler failed" in relay.log(), 30, what="the failed attempt to deliver the alert"
        )
    assert "\x1b" not in relay.log(), "an executor's escape sequences are in Relay's log as it sent them"


def test_a_peers_id_and_error_reach_the_recovery_log_escaped(start_relay: StartRelay) -> None:
    """Attacker: an executor of the app (its key may connect executors to the app).

    Attack: it connects under an id holding a line end and a forged log line, with a newer
    ``application_version`` than the others, so that a recovery onto the latest version asks it the
    app's versions; it answers ``list_application_versions`` with an empty list and an
    ``error_message`` holding a line end, another forged line and terminal escapes. The recovery
    logs ``no versions from <peer>: <reply>`` with the peer's id and the executor's error as they
    came: the attacker writes whole lines of its choosing into Relay's log (a forged CRITICAL, a
    forged "recovered" line) and sends escape sequences to the operator's terminal, though Relay
    logs ids escaped everywhere else (tests/test_hostile_input.py).

    Expected: the peer's id and its error are logged with their control characters escaped: no line
    of the log is one the executor wrote, and no ESC it sent is in the log.
    """
    config = relay_yaml(free_port(), grace=1.0)
    config["orgs"][0]["apps"][0]["recoverToLatestVersion"] = True
    relay = start_relay(config)
    peer_id = "peer\n2026-01-01 00:00:00,000 CRITICAL relay: forged by the peer's id"
    error = "no versions\n2026-01-01 00:00:00,000 CRITICAL relay: forged by the peer's error\x1b]0;owned\x07"
    replies: dict[str, Any] = {"list_application_versions": {"output": [], "error_message": error}}
    with SimulatedPeer(ws_url(relay), peer_id, on_recovery="lie", version="v2", replies=replies):
        assert_eventually(lambda: relay.state_of("acme", "ledger", quote(peer_id, safe="")) == "HEALTHY", 15)
        connect_then_leave(relay, "dies-on-v1")
        assert_eventually(lambda: "no versions from" in relay.log(), 30, what="the recovery asking the peer")
    log = relay.log()
    forged = [line for line in log.splitlines() if line.split(" ", 2)[-1].startswith("CRITICAL relay: forged")]
    assert forged == [], f"lines an executor wrote are in Relay's log: {forged}"
    assert "\x1b" not in log, "an executor's escape sequences are in Relay's log as it sent them"
