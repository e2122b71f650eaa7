"""Schemathesis against Relay's own OpenAPI document (``/openapi.json``): every operation under
``/v2``, with valid and invalid inputs, must answer as its document says (status, media type,
body schema), never with a server error, and refuse what the document does not allow.

The target is disposable: a Relay of this module's own, with an app of its own (``fuzz``) served
by one real executor of harness/workflow_app.py on a system database of its own, and an admin
key; whatever the fuzzer cancels, forks, deletes or creates touches nothing else. Path
parameters are drawn half the time from what exists there (the app's workflows, its executor,
its schedule and queue), so that operations reach past "not found".

Bounded for CI: 12 examples per operation and phase, from a fixed seed (about a minute). A
longer run, from a new seed each time: ``RELAY_OPENAPI_FUZZ_EXAMPLES=500`` (per operation and
phase), optionally with ``RELAY_OPENAPI_FUZZ_SECONDS=1800`` to stop after that long; a failure
names its seed, which ``RELAY_OPENAPI_FUZZ_SEED`` replays.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
import schemathesis
import schemathesis.engine
from pydantic import ValidationError
from schemathesis.config import SchemathesisConfig
from schemathesis.config._checks import (
    NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES,
    POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES,
)
from schemathesis.engine import Status, StopReason, events

from harness.executors import ExecutorProcess
from harness.keys import API_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from relay.api.alerts import CreateAlertingRule

APP = "fuzz"
LONG_RUN = "RELAY_OPENAPI_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("RELAY_OPENAPI_FUZZ_EXAMPLES", "12"))
SECONDS = int(os.environ.get("RELAY_OPENAPI_FUZZ_SECONDS", "0"))
SEED = int(os.environ["RELAY_OPENAPI_FUZZ_SEED"]) if "RELAY_OPENAPI_FUZZ_SEED" in os.environ else None
WORKFLOWS = [
    "done-1",
    "done-1-child",
    "waiting-1",
    "failed-1",
    "queued-0",
    "queued-1",
    "odd/steps",
    "odd?x=1",
    "odd#frag",
]
# Where the target lets alert webhooks go (alerts.allowedDestinations); nothing listens there.
ALLOWED_WEBHOOK = "http://127.0.0.1:9/fuzz-alerts"
# A backfill makes one workflow per tick of the hourly schedule: the fuzzer's windows are cut to this.
MAX_BACKFILL = timedelta(hours=6)


@dataclass(frozen=True)
class Target:
    relay: RelayProcess
    executor_id: str


@pytest.fixture(scope="module")
def target(
    postgres: Postgres, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Target]:
    workdir = tmp_path_factory.mktemp("openapi-fuzz")
    # Liveness as in production rather than the harness's quick 1 s: on a loaded CI machine an executor
    # a second late with a pong would be disconnected, and what the fuzzer asked meanwhile answered 503
    # (rightly, but this test is about the API's answers, not about liveness).
    config = relay_yaml(free_port(), pingIntervalSecs=5.0, pingWaitSecs=30.0)
    config["alerts"] = {"allowedDestinations": ["127.0.0.1"]}
    relay = RelayProcess(workdir, postgres.create_database("relay"), config).start()
    sysdb = postgres.create_database("sys")
    env = {"RELAY_TEST_SEED": "1"}
    executor = ExecutorProcess(workdir, sysdb, relay.conductor_url, app=APP, module="harness.workflow_app", env=env)
    failed_before = request.session.testsfailed
    yield Target(relay, executor.executor_id)
    executor.stop()
    relay.stop()
    if request.session.testsfailed > failed_before:
        print(f"--- {relay.instance_id} log ---\n{relay.log()[-8000:]}")


def relay_schema(target: Target) -> Any:
    """The document as Relay serves it, under /v2 only (not the dashboard), with the fuzzer's settings."""

    def drawn(dictionary: str) -> dict[str, Any]:
        return {"dictionary": dictionary, "probability": 0.5}

    settings: dict[str, Any] = {
        "headers": {"Authorization": f"Bearer {API_KEYS['acme']}"},
        "dictionaries": {
            "workflows": {"values": WORKFLOWS},
            "executors": {"values": [target.executor_id]},
            "schedules": {"values": ["every-hour"]},
            "queues": {"values": ["serial"]},
            "versions": {"values": ["v1"]},
        },
        "parameters": {
            "path.org": "acme",
            "path.app": APP,
            "path.workflow_id": drawn("workflows"),
            "body.workflowIds[*]": drawn("workflows"),
            "path.executor_id": drawn("executors"),
            "path.schedule_name": drawn("schedules"),
            "path.queue_name": drawn("queues"),
            "body.versionName": drawn("versions"),
        },
        "generation": {"max-examples": EXAMPLES, "deterministic": SEED is None and not LONG_RUN},
        "phases": {"stateful": {"enabled": False}},
        "operations": [
            {
                # A workflow may be called "search" or "import": GET and DELETE .../workflows/{workflow_id}
                # answer on these paths too, and the Allow of a 405 there says so.
                "include-path-regex": "/workflows/(search|import|aggregates|bulk-[a-z-]+)$",
                "checks": {
                    "allow_header_conformance": {"enabled": False},
                    # Lists of workflow ids, each up to 16 KiB: a list the document allows, or one past its
                    # maxItems, can be past the body's limit (server.maxRequestBodyBytes), which no schema
                    # can say; such a body is refused with a 413 before it is read.
                    "negative_data_rejection": {
                        "expected-statuses": [*NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES, "413"]
                    },
                    "positive_data_acceptance": {
                        "expected-statuses": [*POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES, "413"]
                    },
                },
            },
            {
                # Free JSON (attributes) may not hold NUL, which PostgreSQL cannot store; no schema can say
                # so at every depth, so the fuzzer's valid requests have none.
                "include-path-regex": "/workflows/(search|aggregates)$",
                "generation": {"allow-x00": False},
            },
            {
                # Valid JSON is not a valid export (gzip of a pickle, in base64): the fuzzer cannot make one.
                "include-path-regex": "/workflows/import$",
                "checks": {"positive_data_acceptance": {"enabled": False}},
            },
        ],
        "request-timeout": 30,
    }
    if SEED is not None:
        settings["seed"] = SEED
    if SECONDS:
        settings["max-time"] = SECONDS
    schema = schemathesis.openapi.from_url(
        f"{target.relay.http}/openapi.json", config=SchemathesisConfig.from_dict(settings)
    )
    schema.hook("map_body")(narrow_backfill)
    schema.hook("map_case").apply_to(method="POST", path_regex="/alerting-rules$")(allowed_webhook)
    # Not the event stream: it does not end, so there is no response to check (tests/test_events.py tests it).
    return schema.include(path_regex="^/v2/").exclude(path_regex="/events$")


def narrow_backfill(context: Any, body: Any) -> Any:
    """A fuzzed window can span centuries, and an hourly schedule would enqueue millions of
    workflows: a backfill's window is cut to :data:`MAX_BACKFILL`."""
    if context.operation is None or not context.operation.path.endswith("/backfill") or not isinstance(body, dict):
        return body
    try:
        start, end = datetime.fromisoformat(body["startTime"]), datetime.fromisoformat(body["endTime"])
        if end - start > MAX_BACKFILL:
            return {**body, "endTime": (start + MAX_BACKFILL).isoformat()}
    except (KeyError, TypeError, ValueError, OverflowError):
        pass
    return body


def allowed_webhook(context: Any, case: Any) -> Any:
    """A rule's webhook must resolve to an address alerts.allowedDestinations allows, which depends on
    the deployment and its DNS, not on the document: a webhook the document allows (as Relay's own
    body model says) is sent as one the target allows (its own 127.0.0.1). One the document refuses
    is sent as it was made: a body stays as valid, or as invalid, as it was made."""
    body = case.body
    webhook = body.get("webhook") if isinstance(body, dict) else None
    if webhook is not None and webhook_allowed_by_document(webhook):
        case.body = {**body, "webhook": ALLOWED_WEBHOOK}
    return case


def webhook_allowed_by_document(webhook: Any) -> bool:
    try:
        CreateAlertingRule.model_validate({"ruleType": "ExecutorDead", "webhook": webhook})
    except ValidationError:
        return False
    return True


def failures_of(event: Any) -> Iterator[str]:
    """What a finished scenario found, one line (and its curl) per failed check."""
    if isinstance(event, (events.ScenarioFinished, events.FuzzScenarioFinished)):
        for case_id, checks in event.recorder.checks.items():
            for check in checks:
                if check.status == Status.FAILURE and check.failure_info is not None:
                    failure, sample = check.failure_info.failure, check.failure_info.code_sample
                    said = answer(event.recorder.interactions.get(case_id))
                    yield f"{failure.operation} {failure.code} {failure.title}: {failure.message}{said}\n    {sample}"
    elif isinstance(event, events.NonFatalError):
        yield f"{event.label}: {event.info.title}: {event.info.message}"


def troubles(target: Target) -> str:
    """Relay's warnings and errors during the run, first ones first (a failure's line may be all CI shows)."""
    lines = [line for line in target.relay.log().splitlines() if " WARNING " in line or " ERROR " in line]
    said = [line.split(" ", 3)[-1][:200] for line in lines if "Invalid HTTP request" not in line]
    return f"Relay logged {len(said)} warnings and errors: {said[:3]}"


def answer(interaction: Any) -> str:
    """What Relay answered, for a failure's line: a status alone ("Server error") does not say which
    error, and Relay's problem details do."""
    response = getattr(interaction, "response", None)
    if response is None:
        return ""
    body = response.content[:1000].decode("utf-8", "replace")
    return f" (answered {response.status_code} after {response.elapsed:.2f} s: {body})"


# A long run may take as long as it was given (pytest-timeout's 0: no limit).
@pytest.mark.timeout(SECONDS + 120 if SECONDS else 0 if LONG_RUN else 240)
def test_every_operation_keeps_to_its_document(target: Target) -> None:
    schema = relay_schema(target)
    found: dict[str, None] = {}  # in order, once each
    tested: set[str] = set()
    stop = None
    cases = 0
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.FatalError):
            raise event.exception
        if isinstance(event, events.ScenarioFinished) and event.status != Status.SKIP:
            tested.add(event.recorder.label)
            cases += len(event.recorder.cases)
        found.update(dict.fromkeys(failures_of(event)))
        if isinstance(event, events.EngineFinished):
            stop = event.stop_reason
    print(f"{len(tested)} operations tested, {cases} cases; the run {stop}")
    assert not found, f"{len(found)} failures (seed {schema.config.seed}; {troubles(target)}):\n" + "\n".join(found)
    if stop is StopReason.COMPLETED:
        assert len(tested) >= 45, f"only {len(tested)} operations were tested: {sorted(tested)}"
