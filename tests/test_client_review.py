"""A platform team's review of Relay with relay_client executors (dbos 3.4): each test fails on the
code as it is, for the reason its docstring gives, and passes once that is fixed.

Real Relay, real PostgreSQL, real DBOS executors: the SDK's own client on dbos 3.2
(harness/executor_app.py) and relay_client on dbos 3.4 (harness/client_app.py), as in
tests/test_client.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psycopg

from harness.executors import ExecutorProcess
from harness.postgres import Postgres
from harness.relay import RelayProcess
from harness.waiting import assert_eventually

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


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


# An application on dbos 3.4 with relay_client, its DBOS name and its Relay app given apart.
NAMED_APP = """
import os, sys, time
from dbos import DBOS, SetWorkflowID
import relay_client

E = os.environ


@DBOS.workflow()
def job(secs: float) -> str:
    DBOS.sleep(secs)
    return "done"


DBOS(config={"name": E["REVIEW_DBOS_NAME"], "system_database_url": E["RELAY_TEST_SYSDB"],
             "application_version": "v1", "executor_id": relay_client.new_executor_id(),
             "notification_listener_polling_interval_sec": 0.1, "sys_db_pool_size": 4})
DBOS.launch()
try:
    relay_client.connect(E["RELAY_TEST_CONDUCTOR_URL"], key=E["RELAY_TEST_CONDUCTOR_KEY"], app=E["RELAY_TEST_APP"])
except relay_client.RelayClientError as exc:
    print(f"REFUSED {exc}", file=sys.stderr, flush=True)
for i in range(int(E.get("REVIEW_JOBS", "0"))):
    with SetWorkflowID(f"{E['REVIEW_DBOS_NAME']}-job-{i}"):
        DBOS.start_workflow(job, 600.0)
print(f"READY {DBOS.executor_id}", flush=True)
while True:
    time.sleep(3600)
"""


def test_a_recovery_is_not_declared_done_by_an_executor_of_another_dbos_application(
    start_relay: StartRelay, start_executor: StartExecutor, client_py: Path, sysdb: str, postgres: Postgres
) -> None:
    """With dbos 3.2 the app an executor joins on Relay is its DBOS application's name; relay_client
    takes it as an argument of its own (``connect(url, key=..., app=...)``) and accepts any. A second
    DBOS application (``payments``, its own system database) copied its ``connect`` line from the first
    (``app="ledger"``), and is on Relay a peer of the ledger executors. A ledger executor dies. Relay
    asks the only peer it knows, the payments executor, to recover it: ``_recover_pending_workflows``
    and ``exist_pending_workflows`` look in the payments system database and find nothing, so it
    answers success and "nothing pending". Relay records the recovery as succeeded and deletes the
    dead executor, while its workflows stay PENDING in the ledger's system database, owned by no live
    executor: stranded, with the audit log saying they were recovered. connect() knows DBOS's
    application name, and could refuse an ``app`` that is not it (or take it as the default)."""
    relay = start_relay(grace=0.5)

    def start(dbos_name: str, jobs: int, db: str) -> ExecutorProcess:
        env = {"REVIEW_DBOS_NAME": dbos_name, "REVIEW_JOBS": str(jobs)}
        return start_executor(relay.conductor_url, command=[str(client_py), "-c", NAMED_APP], env=env, sysdb=db)

    ledger = start("ledger", 2, sysdb)
    payments = start("payments", 0, postgres.create_database("payments"))
    assert_eventually(lambda: healthy(relay, ledger), 15)
    connected = assert_eventually(lambda: healthy(relay, payments) or "REFUSED" in payments.log_path.read_text(), 15)
    assert connected
    assert_eventually(lambda: len(pending_of(sysdb, ledger.executor_id)) == 2, 15)
    ledger.kill()

    def verdict() -> str | None:
        record = relay.executor("acme", "ledger", ledger.executor_id)
        if record is None:
            return "deleted"
        return record.get("blockedReason")

    outcome = assert_eventually(verdict, 30)
    if outcome == "deleted":  # Relay says the dead executor's work has a new home
        assert pending_of(sysdb, ledger.executor_id) == [], "recovery declared done; the workflows are still PENDING"


def pending_of(sysdb: str, executor_id: str) -> list[str]:
    with psycopg.connect(sysdb) as conn:
        rows = conn.execute(
            "SELECT workflow_uuid FROM dbos.workflow_status WHERE executor_id = %s AND status = 'PENDING'",
            (executor_id,),
        ).fetchall()
    return sorted(str(r[0]) for r in rows)
