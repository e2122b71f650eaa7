"""The pure core of alerts (relay/core/alerts.py, relay/core/destinations.py, the rules' configuration):
what fires which alert with which idempotency key, what a delivery carries, and where it may go.
No I/O: the end-to-end behaviour is in tests/test_alerts.py."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from typing import Any
from urllib.parse import unquote

import pytest
from pydantic import ValidationError

from relay.config import RelayConfig
from relay.core import alerts
from relay.core.alerts import (
    Alert,
    AuditFact,
    Kind,
    Observed,
    Rule,
    alerts_for_event,
    condition_alert,
    hold_secs,
    idempotency_header,
    retryable_status,
    signature,
    slack_text,
    webhook_body,
)
from relay.core.destinations import DestinationPolicy


def rule(kind: Kind, app: str = "ledger", rule_id: str = "r1", created_at: float = 0.0, **params: Any) -> Rule:
    return Rule(rule_id, "acme", app, kind, params, created_at)


def fact(action: str, executor: str | None = "ex-1", app: str | None = "ledger", **extra: Any) -> AuditFact:
    detail = extra.pop("detail", {})
    return AuditFact(
        id=extra.pop("id", 7), at="2026-11-30T12:00:00Z", at_unix=extra.pop("at_unix", 100.0), org="acme",
        app=app, action=action, executor_id=executor, detail=detail, **extra,
    )  # fmt: skip


def test_a_death_is_one_alert_per_rule_and_a_second_death_is_a_new_key() -> None:
    rules = [rule(Kind.EXECUTOR_DEAD, rule_id="a"), rule(Kind.EXECUTOR_DEAD, rule_id="b"),
             rule(Kind.EXECUTOR_DEAD, app="other"), rule(Kind.RECOVERY_FAILED)]  # fmt: skip
    first = alerts_for_event(fact("executor.dead", detail={"epoch": 3}), rules)
    assert [a.rule_id for a in first] == ["a", "b"]
    assert [a.idempotency_key for a in first] == ["a:ex-1:3", "b:ex-1:3"]
    again = alerts_for_event(fact("executor.dead", id=8, detail={"epoch": 3}), rules)
    assert [a.idempotency_key for a in again] == [a.idempotency_key for a in first], "the same death, the same key"
    second = alerts_for_event(fact("executor.dead", id=9, detail={"epoch": 4}), rules)
    assert {a.idempotency_key for a in second}.isdisjoint(a.idempotency_key for a in first)
    assert all(a.workflow_id == f"alert:{a.idempotency_key}" for a in second)


def test_an_event_before_its_rule_was_made_fires_nothing() -> None:
    assert alerts_for_event(fact("executor.dead", at_unix=99.0), [rule(Kind.EXECUTOR_DEAD, created_at=100.0)]) == []
    assert alerts_for_event(fact("executor.deleted"), [rule(Kind.EXECUTOR_DEAD)]) == []


def test_recovery_failed_fires_at_its_threshold_of_attempts_but_not_on_the_final_entry() -> None:
    rules = [rule(Kind.RECOVERY_FAILED, attempts=3)]
    detail = {"recoveryId": "rec-1", "error": "peer went away"}
    assert alerts_for_event(fact("recovery.failed", detail=detail, failed_attempts=2, recovery_epoch=5), rules) == []
    (alert,) = alerts_for_event(fact("recovery.failed", detail=detail, failed_attempts=3, recovery_epoch=5), rules)
    assert alert.idempotency_key == "r1:ex-1:5" and "peer went away" in alert.message
    assert alert.metadata["failed_attempts"] == "3" and alert.metadata["recovery_id"] == "rec-1"
    final = {**detail, "final": True}
    assert alerts_for_event(fact("recovery.failed", detail=final, failed_attempts=4, recovery_epoch=5), rules) == []


def test_an_adoption_fires_the_rules_of_every_app_of_its_org() -> None:
    rules = [rule(Kind.INSTANCE_ADOPTED, rule_id="a"), rule(Kind.INSTANCE_ADOPTED, app="billing", rule_id="b")]
    detail = {"instance": "relay-1", "adoptedBy": "relay-2", "leaseEpoch": 12, "executors": 4}
    alerts = alerts_for_event(fact("relay.instance_adopted", executor=None, app=None, detail=detail), rules)
    assert [(a.app, a.idempotency_key) for a in alerts] == [("ledger", "a:relay-1:12"), ("billing", "b:relay-1:12")]
    assert alerts[0].subject == {"instance": "relay-1"} and "relay-2" in alerts[0].message


def sample() -> Alert:
    (alert,) = alerts_for_event(fact("executor.dead", detail={"epoch": 3}), [rule(Kind.EXECUTOR_DEAD)])
    return alert


def test_the_webhook_payload_has_the_members_receivers_rely_on() -> None:
    payload = json.loads(webhook_body(sample(), "json"))
    assert {"kind", "org", "app", "message", "at", "idempotencyKey", "executorId"} <= set(payload)
    assert (payload["kind"], payload["org"], payload["app"]) == ("ExecutorDead", "acme", "ledger")
    assert payload["executorId"] == "ex-1" and payload["idempotencyKey"] == "r1:ex-1:3"
    assert Alert.from_json(json.loads(json.dumps(sample().to_json()))) == sample()  # the workflow's input


def test_the_slack_body_is_one_slack_accepts_and_carries_the_key() -> None:
    body = json.loads(webhook_body(sample(), "slack"))
    assert set(body) == {"text", "blocks"} and "ExecutorDead" in body["text"] and "ex-1" in body["text"]
    assert [b["type"] for b in body["blocks"]] == ["header", "section", "context"]
    assert len(body["blocks"][0]["text"]["text"]) <= 150
    assert "r1:ex-1:3" in json.dumps(body["blocks"])


def test_the_idempotency_header_is_the_key_as_it_was_when_ascii_and_percent_encoded_when_not() -> None:
    assert idempotency_header("r1:ex-1:3") == "r1:ex-1:3"
    printable = "config-1b2c:my queue/a+b=c&d?e#f[g]@h!$'(),;*~_.-:7"  # every receiver saw these as they are
    assert idempotency_header(printable) == printable
    assert idempotency_header("r1:exécuteur-ü-1:3") == "r1:ex%C3%A9cuteur-%C3%BC-1:3"
    assert idempotency_header("r1:队列\r\n\x1b:2") == "r1:%E9%98%9F%E5%88%97%0D%0A%1B:2"
    for key in ("r1:exécuteur:3", "r1:50%:3", "r1:a%C3%A9:3", "r1:a\tb:3", "r1:💥:3", printable):
        header = idempotency_header(key)
        assert header.isascii() and header.isprintable(), header
        assert unquote(header) == key, "a receiver decodes the header into the body's idempotencyKey"
    # "%" is encoded: no ASCII key's header is the header of another key.
    assert idempotency_header("r1:a%C3%A9:3") != idempotency_header("r1:aé:3")


GRAVE = "\N{MODIFIER LETTER GRAVE ACCENT}"  # a backtick, as Slack shows it without a code span


def slack_texts(body: dict[str, Any]) -> list[str]:
    texts = [body["text"]]
    for block in body["blocks"]:
        if block["type"] == "section":
            texts.append(block["text"]["text"])
        texts += [e["text"] for e in block.get("elements", [])]
    return texts


def test_a_slack_alert_shows_workflow_and_queue_names_escaped_and_code_spans_unbroken() -> None:
    evil = "job` <!here> & <@U123> <https://evil.example|x> `"
    seen = Observed({"workflowName": evil}, evil, f"3 workflows {evil} failed")
    body = json.loads(webhook_body(condition_alert(rule(Kind.WORKFLOW_FAILURE), seen, 1, "t"), "slack"))
    for text in slack_texts(body):
        assert "<" not in text and ">" not in text, text
        assert "& " not in text, "an & of the name is &amp;"
    context = slack_texts(body)[-1]
    shown = f"job{GRAVE} &lt;!here&gt; &amp; &lt;@U123&gt; &lt;https://evil.example|x&gt; {GRAVE}"
    assert f"workflowName: `{shown}`" in context
    assert context.count("`") == 4, "only Relay's own code spans: the name's and the key's"
    assert body["blocks"][0]["text"] == {"type": "plain_text", "text": "WorkflowFailure: acme/ledger"}
    assert slack_text("a&b<c>d`e") == f"a&amp;b&lt;c&gt;d{GRAVE}e"


def test_a_slack_alerts_mrkdwn_is_verbatim_so_plain_names_and_urls_are_not_parsed() -> None:
    """Slack parses a mrkdwn text object that is not ``verbatim``: plain URLs and channel names
    become links, and "certain mentions" are parsed. Every mrkdwn object of an alert is verbatim,
    the user's text in it shown as typed (escaped), with no mention or link syntax."""
    evil = "@channel @here #general https://evil.example/x <!channel> <http://evil.example|y>"
    seen = Observed({"workflowName": evil}, evil, f"failed: {evil}")
    for fired in condition_alert(rule(Kind.WORKFLOW_FAILURE), seen, 1, "t"), sample():
        body = json.loads(webhook_body(fired, "slack"))
        mrkdwn = [b["text"] for b in body["blocks"] if b["type"] == "section"]
        mrkdwn += [e for b in body["blocks"] for e in b.get("elements", []) if e["type"] == "mrkdwn"]
        assert len(mrkdwn) == 2 and all(t["verbatim"] is True for t in mrkdwn), mrkdwn
        assert all(not {"<", ">"} & set(t["text"]) for t in mrkdwn), mrkdwn
    assert "@channel @here #general https://evil.example/x &lt;!channel&gt;" in mrkdwn_texts(seen)


def mrkdwn_texts(seen: Observed) -> str:
    body = json.loads(webhook_body(condition_alert(rule(Kind.WORKFLOW_FAILURE), seen, 1, "t"), "slack"))
    return body["blocks"][1]["text"]["text"]


def test_a_long_slack_message_is_cut_between_escapes() -> None:
    for pad in range(2890, 2901):
        message = "x" * pad + "&" * 50
        seen = Observed({"queueName": "q"}, "q", message)
        body = json.loads(webhook_body(condition_alert(rule(Kind.SLOW_QUEUE), seen, 1, "t"), "slack"))
        section = body["blocks"][1]["text"]["text"]
        assert len(section) <= 2900 and section.removeprefix("x" * pad).replace("&amp;", "") == "", section[-8:]


def test_the_body_and_its_signature_are_the_same_at_every_attempt() -> None:
    body = webhook_body(sample(), "json")
    assert webhook_body(sample(), "json") == body
    expected = "sha256=" + hmac.new(b"the-secret", body, hashlib.sha256).hexdigest()
    assert signature("the-secret", body) == expected != signature("another-secret", body)


def test_only_a_receiver_that_may_recover_is_tried_again() -> None:
    assert [s for s in (200, 400, 401, 404, 408, 410, 429, 500, 503) if retryable_status(s)] == [408, 429, 500, 503]


def test_a_condition_alert_is_keyed_by_its_episode_or_its_deaths_epoch() -> None:
    unresponsive = rule(Kind.UNRESPONSIVE_APPLICATION, forSecs=5)
    seen = Observed({"appName": "ledger"}, "ledger", "no executor")
    assert condition_alert(unresponsive, seen, 1, "t").idempotency_key == "r1:ledger:1"
    assert condition_alert(unresponsive, seen, 2, "t").idempotency_key == "r1:ledger:2"
    blocked = Observed({"executorId": "ex-1"}, "ex-1@3", "waiting", epoch="3")
    assert condition_alert(rule(Kind.RECOVERY_BLOCKED), blocked, 9, "t").idempotency_key == "r1:ex-1@3:3"
    assert hold_secs(unresponsive) == 5.0 and hold_secs(rule(Kind.RECOVERY_BLOCKED)) == 60.0
    assert hold_secs(rule(Kind.SLOW_QUEUE, thresholdSecs=10)) == 0.0  # its threshold is in the question asked


def policy(*entries: str, public: bool = True) -> DestinationPolicy:
    return DestinationPolicy.from_entries(entries, public)


@pytest.mark.parametrize(
    ("host", "address", "entries", "public", "allowed"),
    [
        ("hooks.example", "93.184.216.34", (), True, True),
        ("hooks.example", "93.184.216.34", (), False, False),
        ("hooks.example", "10.0.0.5", (), True, False),
        ("hooks.example", "10.0.0.5", ("10.0.0.0/8",), True, True),
        ("hooks.internal", "10.0.0.5", ("*.internal",), True, True),
        ("metadata", "169.254.169.254", (), True, False),
        ("127.0.0.1", "127.0.0.1", (), True, False),
        ("127.0.0.1", "127.0.0.1", ("127.0.0.1",), True, True),
        ("mapped", "::ffff:10.0.0.1", (), True, False),
        ("mapped", "::ffff:10.0.0.1", ("10.0.0.0/8",), True, True),
        # IPv4 addresses inside IPv6 ones: NAT64, local-use NAT64, 6to4, Teredo
        ("nat64", "64:ff9b::a9fe:a9fe", (), True, False),  # 169.254.169.254, the metadata address
        ("nat64", "64:ff9b::a00:1", (), True, False),
        ("nat64", "64:ff9b::7f00:1", (), True, False),
        ("nat64", "64:ff9b::a00:1", ("10.0.0.0/8",), True, True),
        ("nat64", "64:ff9b::5db8:d822", (), True, True),  # 93.184.216.34
        ("nat64", "64:ff9b::5db8:d822", ("64:ff9b::/96",), False, True),
        ("local-nat64", "64:ff9b:1::a00:1", (), True, False),
        ("local-nat64", "64:ff9b:1::5db8:d822", (), True, False),  # where the IPv4 address sits varies
        ("local-nat64", "64:ff9b:1::a00:1", ("64:ff9b:1::/48",), True, True),
        ("6to4", "2002:a00:1::1", (), True, False),
        ("6to4", "2002:a9fe:a9fe::1", (), True, False),
        ("6to4", "2002:5db8:d822::1", (), True, True),
        ("teredo", "2001:0:4136:e378:8000:63bf:f5ff:fffe", (), True, False),  # its client is 10.0.0.1
        ("plain-v6", "2606:4700::1111", (), True, True),
        # IPv4-compatible (::/96, deprecated) and IPv4-translated (::ffff:0:0:0/96): their IPv4 address
        ("compatible", "::7f00:1", (), True, False),  # 127.0.0.1
        ("compatible", "::a9fe:a9fe", (), True, False),  # 169.254.169.254
        ("compatible", "::a00:1", (), True, False),
        ("compatible", "::7f00:1", ("127.0.0.1",), True, True),
        ("compatible", "::5db8:d822", (), True, True),
        ("translated", "::ffff:0:7f00:1", (), True, False),
        ("translated", "::ffff:0:a9fe:a9fe", (), True, False),
        ("translated", "::ffff:0:a00:1", ("10.0.0.0/8",), True, True),
        ("translated", "::ffff:0:5db8:d822", (), True, True),
        ("loopback-v6", "::1", (), True, False),
        ("unspecified-v6", "::", (), True, False),
    ],
)
def test_the_allow_list(host: str, address: str, entries: tuple[str, ...], public: bool, allowed: bool) -> None:
    refused = policy(*entries, public=public).check(host, [ipaddress.ip_address(address)])
    assert (refused is None) == allowed, refused


def test_an_ipv4_address_written_as_ipv6_is_named_as_the_ipv4_address_it_carries() -> None:
    assert "127.0.0.1 is a loopback address" in (policy().check("::7f00:1", [ipaddress.ip_address("::7f00:1")]) or "")
    metadata = policy().check("hooks.example", [ipaddress.ip_address("::ffff:0:a9fe:a9fe")]) or ""
    assert "resolves to 169.254.169.254, a link-local address" in metadata
    assert "::1 is a loopback address" in (policy().check("::1", [ipaddress.ip_address("::1")]) or "")


def test_a_name_resolving_to_one_refused_address_is_refused() -> None:
    addresses = [ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("10.0.0.5")]
    assert "10.0.0.5" in (policy().check("two-faced.example", addresses) or "")


def config(rules: list[dict[str, Any]], allowed: list[str] | None = None) -> RelayConfig:
    return RelayConfig.model_validate({
        "alerts": {"allowedDestinations": allowed or []},
        "orgs": [{"name": "acme", "apps": [{"name": "ledger", "alerts": rules}, {"name": "notifier"}]}],
    })  # fmt: skip


def test_the_issues_relay_yaml_shape_is_accepted() -> None:
    made = config([
        {"kind": "ExecutorDead", "webhook": "https://hooks.example/relay"},
        {"kind": "WorkflowFailure", "workflowName": "job", "count": 3, "windowSecs": 300, "receiverApp": "notifier"},
        {"kind": "SlowQueue", "queueName": "serial", "thresholdSecs": 120, "webhook": "https://hooks.example/s",
         "format": "slack"},
    ])  # fmt: skip
    rules = made.orgs[0].apps[0].alerts
    assert [r.kind for r in rules] == [Kind.EXECUTOR_DEAD, Kind.WORKFLOW_FAILURE, Kind.SLOW_QUEUE]
    assert rules[1].params() == {"workflowName": "job", "count": 3, "windowSecs": 300.0}
    assert rules[2].format == "slack"


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "ExecutorDead", "count": 3},  # a parameter of another kind
        {"kind": "ExecutorDead", "webhook": "https://hooks.example/x", "receiverApp": "notifier"},
        {"kind": "ExecutorDead", "receiverApp": "notifier", "format": "slack"},
        {"kind": "ExecutorDead", "webhook": "http://10.0.0.1/x"},  # not on the allow-list
        {"kind": "Nope"},
    ],
)
def test_rules_relay_yaml_refuses(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        config([bad])


def test_a_listed_private_destination_is_accepted_in_relay_yaml() -> None:
    assert config([{"kind": "ExecutorDead", "webhook": "http://10.0.0.1/x"}], allowed=["10.0.0.0/8"]).orgs


def test_a_resolution_names_the_alert_it_resolves_and_a_firing_alerts_input_keeps_its_shape() -> None:
    """A resolution (from its ``alert.resolved`` entry) has its own key, ``status: resolved`` and
    the key it resolves in body, metadata and Slack title; a firing alert's workflow input and body
    have no member they did not have before (an instance of the previous release reads them)."""
    detail = {"ruleId": "r1", "kind": "RecoveryBlocked", "resolves": "r1:ex@7:7", "subjectKey": "ex@7",
              "epoch": "7", "reason": "the recovery of executor ex is no longer blocked"}  # fmt: skip
    resolution = alerts.resolution_alert(fact("alert.resolved", detail=detail))
    assert resolution is not None and resolution.idempotency_key == "r1:ex@7:7:resolved"
    assert resolution.subject == {"executorId": "ex"} and resolution.workflow_id == "alert:r1:ex@7:7:resolved"
    body = json.loads(webhook_body(resolution, "json"))
    assert body["status"] == "resolved" and body["resolves"] == "r1:ex@7:7" and body["executorId"] == "ex"
    assert "no longer blocked" in body["message"] and body["metadata"]["reason"] == detail["reason"]
    assert resolution.sdk_metadata()["status"] == "resolved"
    assert json.loads(webhook_body(resolution, "slack"))["blocks"][0]["text"]["text"].startswith("Resolved: ")
    assert Alert.from_json(resolution.to_json()) == resolution
    assert alerts.resolution_alert(fact("alert.resolved", detail={**detail, "kind": "NoSuchKind"})) is None
    (firing,) = alerts_for_event(fact("executor.dead", detail={"epoch": 3}), [rule(Kind.EXECUTOR_DEAD)])
    assert "resolves" not in firing.to_json() and "status" not in json.loads(webhook_body(firing, "json"))


def test_a_deaths_end_resolves_the_alert_of_each_death_rule_of_its_app_under_the_deaths_key() -> None:
    """The entry that ends a death (its record deleted after a recovery, or a final recovery.failed:
    the executor is back) makes one resolution per ExecutorDead and RecoveryFailed rule of its app,
    keyed by the death's alert (rule, executor, epoch), saying how it ended; a failed attempt, or an
    entry whose recovery is not known, ends nothing."""
    rules = [rule(Kind.EXECUTOR_DEAD, rule_id="a"), rule(Kind.RECOVERY_FAILED, rule_id="b"),
             rule(Kind.EXECUTOR_DEAD, app="other", rule_id="c"), rule(Kind.RECOVERY_BLOCKED, rule_id="d"),
             rule(Kind.INSTANCE_ADOPTED, rule_id="e")]  # fmt: skip
    (dead,) = alerts_for_event(fact("executor.dead", detail={"epoch": 3}), rules)
    deleted = fact("executor.deleted", peer="p-2", recovery_epoch=3, detail={"recoveryId": "x", "verifiedBy": "p-3"})
    recovered = alerts.death_resolutions(deleted, rules)
    assert [r.resolves for r in recovered] == [dead.idempotency_key, "b:ex-1:3"]
    assert [r.idempotency_key for r in recovered] == [f"{dead.idempotency_key}:resolved", "b:ex-1:3:resolved"]
    first = recovered[0]
    assert (first.kind, first.subject, first.epoch) == ("ExecutorDead", {"executorId": "ex-1"}, "3")
    assert "recovered by peer p-2, verified by p-3" in first.message
    assert {k: v for k, v in first.metadata.items() if k != "reason"} == {
        "status": "resolved", "resolves": dead.idempotency_key, "ended": "recovered", "recovered_by": "p-2",
        "verified_by": "p-3",
    }  # fmt: skip
    idle = alerts.death_resolutions(
        fact("executor.deleted", peer="p-2", recovery_epoch=3, detail={"nothingPending": True, "verifiedBy": "p-2"}),
        rules,
    )
    assert idle[0].metadata["ended"] == "nothing_pending" and "nothing to recover" in idle[0].message
    back = alerts.death_resolutions(
        fact("recovery.failed", recovery_epoch=3, detail={"final": True, "error": "the executor reconnected"}), rules
    )
    assert [r.metadata["ended"] for r in back] == ["connected_again"] * 2 and "ex-1 connected again" in back[0].message
    assert alerts.death_resolutions(fact("recovery.failed", recovery_epoch=3, detail={"error": "x"}), rules) == []
    assert alerts.death_resolutions(fact("executor.deleted", detail={"recoveryId": "gone"}), rules) == []
    # A verified recovery ends the death with its executor.deleted; one whose executor connected again
    # before the deletion (record kept) ends it itself: nothing else will (the soak of seed 50).
    succeeded = {"recoveryId": "x", "verifiedBy": "p-3"}
    assert (
        alerts.death_resolutions(fact("recovery.succeeded", peer="p-2", recovery_epoch=3, detail=succeeded), rules)
        == []
    )
    kept = alerts.death_resolutions(
        fact("recovery.succeeded", peer="p-2", recovery_epoch=3, detail={**succeeded, "recordKept": True}), rules
    )
    assert [r.resolves for r in kept] == [dead.idempotency_key, "b:ex-1:3"]
    assert kept[0].metadata["ended"] == "recovered" and "ex-1 connected again meanwhile" in kept[0].message
