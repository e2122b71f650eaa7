"""The settings relay.yaml and the API both take (an app's grace period and retention, an alert
rule's parameters) have one bound each: a value one takes, the other takes, and a value one refuses,
the other refuses for the same reason. The API once capped ``executorTimeoutSecs`` at 7 days while
relay.yaml took ten years for the same setting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from harness.ports import free_port
from harness.relay import RelayProcess, relay_yaml
from relay.config import (
    MAX_COUNT,
    MAX_MS,
    MAX_SECS,
    MIN_LEASE_SECS,
    MIN_POLL_SECS,
    MIN_ROUND_SECS,
    RelayConfig,
    parse_config,
)
from relay.errors import ConfigError

StartRelay = Callable[..., RelayProcess]
DURATIONS = (0, 0.5, 8 * 24 * 3600, MAX_SECS, MAX_SECS + 1)
COUNTS = (0, 1, MAX_COUNT, MAX_COUNT + 1)
THRESHOLDS = (0, 1, MAX_MS, MAX_MS + 1)


@dataclass(frozen=True)
class Setting:
    name: str
    values: tuple[float, ...]
    kind: str | None = None  # an alert rule's parameter (of a rule of this kind), or an app's setting
    in_metadata: bool = True  # the parameter in the API's ruleMetadata (minIntervalSecs is beside it)

    def yaml(self, value: float) -> str:
        if self.kind is None:
            return f"orgs: [{{name: a, apps: [{{name: x, {self.name}: {value}}}]}}]"
        return f"orgs: [{{name: a, apps: [{{name: x, alerts: [{{kind: {self.kind}, {self.name}: {value}}}]}}]}}]"

    def send(self, api: httpx.Client, value: float) -> httpx.Response:
        if self.kind is None:
            return api.patch("/apps/ledger", json={self.name: value})
        given = {"ruleMetadata": {self.name: value}} if self.in_metadata else {self.name: value}
        return api.post("/apps/ledger/alerting-rules", json={"ruleType": self.kind, **given})


SETTINGS = [
    Setting("executorTimeoutSecs", DURATIONS),
    Setting("gcTimeThresholdMs", THRESHOLDS),
    Setting("gcRowsThreshold", THRESHOLDS),
    Setting("globalTimeoutMs", THRESHOLDS),
    Setting("minIntervalSecs", DURATIONS, "ExecutorDead", in_metadata=False),
    Setting("windowSecs", DURATIONS, "WorkflowFailure"),
    Setting("count", COUNTS, "WorkflowFailure"),
    Setting("thresholdSecs", DURATIONS, "SlowQueue"),
    Setting("forSecs", DURATIONS, "RecoveryBlocked"),
    Setting("attempts", COUNTS, "RecoveryFailed"),
]


def from_yaml(setting: Setting, value: float) -> str | None:
    """Why relay.yaml refuses the value; None if it takes it."""
    try:
        parse_config(setting.yaml(value), "relay.yaml")
    except ConfigError as exc:
        return str(exc)
    return None


def from_api(api: httpx.Client, setting: Setting, value: float) -> str | None:
    """Why the API refuses the value (its 422's reason); None if it takes it."""
    resp = setting.send(api, value)
    if resp.status_code in (200, 201):
        return None
    assert resp.status_code == 422, resp.text
    problem: dict[str, Any] = resp.json()
    assert all(e["location"].startswith("body.") for e in problem["errors"]), problem
    return "; ".join(f"{e['location'].rsplit('.', 1)[-1]}: {e['message']}" for e in problem["errors"])


def test_relay_yaml_and_the_api_take_and_refuse_the_same_values_for_the_same_reason(start_relay: StartRelay) -> None:
    relay = start_relay(relay_yaml(free_port()))
    verdicts: dict[tuple[str, float], tuple[str | None, str | None]] = {}
    with relay.api() as api:
        for setting in SETTINGS:
            for value in setting.values:
                verdicts[setting.name, value] = from_yaml(setting, value), from_api(api, setting, value)
    # A grace period of 8 days, as relay.yaml takes it; ten years at most, and the API says so plainly.
    assert verdicts["executorTimeoutSecs", 8 * 24 * 3600] == (None, None)
    assert verdicts["executorTimeoutSecs", MAX_SECS] == (None, None)
    too_long = f"executorTimeoutSecs: Input should be less than or equal to {MAX_SECS}"
    assert verdicts["executorTimeoutSecs", MAX_SECS + 1][1] == too_long
    for (name, value), (yaml_refusal, api_refusal) in verdicts.items():
        if yaml_refusal is None or api_refusal is None:
            assert yaml_refusal == api_refusal, (name, value, "relay.yaml", yaml_refusal, "the API", api_refusal)
        else:  # one reason, the same in both, in the words of the one bound
            assert api_refusal.startswith(f"{name}: ") and ";" not in api_refusal, (name, value, api_refusal)
            assert api_refusal in yaml_refusal, (name, value, yaml_refusal, api_refusal)


# Every interval of relay.yaml and its floor (the API sets no interval: it has none of these).
FLOORS = {
    "server.eventPollSecs": MIN_POLL_SECS,
    "server.eventHeartbeatSecs": MIN_ROUND_SECS,
    "liveness.pingIntervalSecs": MIN_POLL_SECS,
    "liveness.failoverBackoffInitialSecs": MIN_POLL_SECS,
    "liveness.instanceLeaseSecs": MIN_LEASE_SECS,
    "liveness.socketCheckSecs": MIN_ROUND_SECS,
    "liveness.repairIntervalSecs": MIN_ROUND_SECS,
    "retention.intervalSecs": MIN_ROUND_SECS,
    "retention.appsIntervalSecs": MIN_ROUND_SECS,
    "alerts.pollIntervalSecs": MIN_POLL_SECS,
    "alerts.checkIntervalSecs": MIN_ROUND_SECS,
    "alerts.retryInitialSecs": MIN_POLL_SECS,
    "reconciler.intervalSecs": MIN_ROUND_SECS,
}


def test_every_interval_in_relay_yaml_is_listed_with_its_floor() -> None:
    """A setting named like an interval that FLOORS leaves out is one nobody decided a floor for."""
    named = {
        f"{section}.{field.alias}"
        for section, model in RelayConfig.model_fields.items()
        if isinstance(model.default, BaseModel)
        for field in type(model.default).model_fields.values()
        if field.alias and field.alias.lower().endswith(("intervalsecs", "pollsecs"))
    }
    assert named <= FLOORS.keys(), named - FLOORS.keys()


@pytest.mark.parametrize(("where", "floor"), FLOORS.items())
def test_an_interval_below_its_floor_is_refused_naming_the_setting_and_the_floor(where: str, floor: float) -> None:
    """Intervals only had to be more than 0: retention.appsIntervalSecs 0.000001 started 526 rounds
    of one app, each with its audit entry and row, in 5 s."""
    section, name = where.split(".")
    wait = ", pingWaitSecs: 1.0" if name == "pingIntervalSecs" else ""  # which must exceed the interval

    def refusal(value: float) -> str | None:
        try:
            parse_config(f"{section}: {{{name}: {value}{wait}}}", "relay.yaml")
        except ConfigError as exc:
            return str(exc)
        return None

    assert refusal(floor) is None
    assert (
        refusal(0.000001)
        == f"relay.yaml: invalid configuration\n  {where}: Input should be greater than or equal to {floor}"
    )
