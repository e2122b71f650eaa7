"""A platform team's review of Relay with relay_client executors (dbos 3.4): each test fails on the
code as it is, for the reason its docstring gives, and passes once that is fixed.

Real Relay, real PostgreSQL, real DBOS executors: the SDK's own client on dbos 3.2
(harness/executor_app.py) and relay_client on dbos 3.4 (harness/client_app.py), as in
tests/test_client.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.client_venv import client_python
from harness.executors import ExecutorProcess
from harness.relay import RelayProcess
from harness.waiting import assert_eventually

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


@pytest.fixture(scope="session")
def client_py() -> Path:
    return client_python()


@pytest.fixture
def start_client_executor(start_executor: StartExecutor, client_py: Path) -> StartExecutor:
    def start(conductor_url: str, **kwargs: Any) -> ExecutorProcess:
        return start_executor(conductor_url, python=client_py, module="harness.client_app", **kwargs)

    return start


def healthy(relay: RelayProcess, executor: ExecutorProcess) -> bool:
    return relay.state_of("acme", executor.app, executor.executor_id) == "HEALTHY"


def test_a_request_the_client_does_not_serve_is_answered_by_a_32_executor_of_the_same_app(
    start_relay: StartRelay, start_executor: StartExecutor, start_client_executor: StartExecutor, evidence_db: str
) -> None:
    """A team moving an app from dbos 3.2 to 3.4 runs both for a while, in one app on one system
    database (a rolling upgrade). relay_client answers "Unknown message type" to
    get_workflow_notifications (and streams, export, import), which the 3.2 executors serve. The
    gateway (relay/domain/gateway.py) asks the app's healthy executors in turn and re-raises
    UnsupportedMessage at once, without asking another: the same GET answers 200 or 501 depending on
    whose turn it is."""
    relay = start_relay()
    sdk = start_executor(
        relay.conductor_url,
        env={"RELAY_TEST_EVIDENCE": evidence_db, "RELAY_TEST_JOBS": "1", "RELAY_TEST_JOB_SLEEP": "0"},
    )
    client = start_client_executor(relay.conductor_url)
    for executor in (sdk, client):
        assert_eventually(lambda executor=executor: healthy(relay, executor), 15)
    with relay.api() as api:

        def finished() -> bool:
            resp = api.get("/apps/ledger/workflows/job-0")
            return resp.status_code == 200 and resp.json().get("status") == "SUCCESS"

        assert_eventually(finished, 15)
        codes = []
        for i in range(6):
            codes.append(api.get("/apps/ledger/workflows/job-0/notifications").status_code)
            # Other reads of the app in between (the console's, Relay's own): each takes a turn too.
            for _ in range(i % 2):
                assert api.get("/apps/ledger/workflows", params={"limit": 1}).status_code == 200
    assert codes == [200] * 6, codes
