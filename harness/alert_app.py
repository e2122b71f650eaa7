"""A real DBOS 3.2 application for the alert tests: it fails workflows, holds a queue up, and
receives alerts with the SDK's ``@DBOS.alert_handler``.

Run as ``python -m harness.alert_app`` with the settings of :mod:`harness.executor_app`
(RELAY_TEST_APP, RELAY_TEST_SYSDB, RELAY_TEST_CONDUCTOR_URL, RELAY_TEST_CONDUCTOR_KEY,
RELAY_TEST_APP_VERSION) and:

- RELAY_TEST_EVIDENCE: a PostgreSQL URL; every alert the handler receives becomes a row of
  ``alerts_received`` (name, message, metadata, the executor that took it);
- RELAY_TEST_FAILURES: how many ``failing`` workflows to run (each raises) once launched;
- RELAY_TEST_FAILURES_GATE: a file; the ``failing`` workflows run once it exists (after READY),
  not at launch: a failure at a moment the test picks (while Relay is down, say);
- RELAY_TEST_HOLD_QUEUE: how many ``job`` workflows to enqueue on the queue ``serial``
  (concurrency 1) behind a ``blocker`` that waits an hour, so they stay ENQUEUED;
- RELAY_TEST_HOLD_QUEUE_NAME: that queue's name, if not ``serial``;
- RELAY_TEST_HOLD_FAILURES: a file; each workflow that fails after READY holds its ERROR status
  write (stamped when it began) uncommitted until this executor has answered two counts of failed
  workflows (``get_workflow_aggregates``) begun after the stamp, then appends a JSON line (workflow
  id, counts, seconds held) to the file: a late commit, as a loaded machine makes one, made certain.

Prints ``READY <executor_id>`` once it has done all that.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import psycopg
import sqlalchemy as sa
from dbos import DBOS, DBOSConfig, SetWorkflowID
from dbos._sys_db import SystemDatabase
from dbos._utils import GlobalParams

ENV = os.environ


def take_alert(name: str, message: str, metadata: dict[str, str]) -> None:
    with psycopg.connect(ENV["RELAY_TEST_EVIDENCE"]) as conn:
        conn.execute(
            "INSERT INTO alerts_received (name, message, metadata, executor_id) VALUES (%s, %s, %s, %s)",
            (name, message, json.dumps(metadata), GlobalParams.executor_id),
        )


def prepare() -> None:
    with psycopg.connect(ENV["RELAY_TEST_EVIDENCE"]) as conn:
        conn.execute("SELECT pg_advisory_xact_lock(43)")
        conn.execute(
            """CREATE TABLE IF NOT EXISTS alerts_received (
                   name text NOT NULL, message text NOT NULL, metadata jsonb NOT NULL, executor_id text NOT NULL,
                   at timestamptz NOT NULL DEFAULT clock_timestamp())"""
        )


# Counts of failed workflows a held status write waits for, begun after its stamp: Relay takes the
# first one's moment before it asks, which may be before the stamp; the second's after the first
# was answered, which is after it.
HELD_ACROSS = 2


def hold_failures(path: str) -> None:
    """RELAY_TEST_HOLD_FAILURES (above). SQLAlchemy's ``commit`` event runs before the commit is
    sent, inside the status write's transaction (DBOS's ``update_workflow_outcome``)."""
    answered = threading.Condition()
    counts: list[float] = []  # when each count of failed workflows began, once answered
    holding = threading.local()
    original_counts = SystemDatabase.get_workflow_aggregates
    original_write = SystemDatabase.update_workflow_outcome

    def counted(self: SystemDatabase, **kwargs: Any) -> Any:
        began = time.monotonic()
        rows = original_counts(self, **kwargs)
        if "ERROR" in (kwargs.get("status") or []):
            with answered:
                counts.append(began)
                answered.notify_all()
        return rows

    def written(self: SystemDatabase, workflow_id: str, status: Any, **kwargs: Any) -> bool:
        holding.workflow_id = workflow_id if status == "ERROR" else None
        try:
            return original_write(self, workflow_id, status, **kwargs)
        finally:
            holding.workflow_id = None

    def before_commit(conn: sa.Connection) -> None:
        workflow_id = getattr(holding, "workflow_id", None)
        if workflow_id is None:
            return
        holding.workflow_id = None  # once per write, should DBOS retry it
        stamped = time.monotonic()  # after the stamp: the transaction began before this
        with answered:
            answered.wait_for(lambda: sum(1 for began in counts if began > stamped) >= HELD_ACROSS, timeout=60)
            seen = sum(1 for began in counts if began > stamped)
        line = {"workflow_id": workflow_id, "counts": seen, "held_secs": time.monotonic() - stamped}
        with open(path, "a", encoding="utf-8") as held:
            held.write(json.dumps(line) + "\n")

    SystemDatabase.get_workflow_aggregates = counted  # type: ignore[method-assign]
    SystemDatabase.update_workflow_outcome = written  # type: ignore[method-assign]
    sa.event.listen(sa.Engine, "commit", before_commit)


@DBOS.workflow()
def failing(n: int) -> int:
    raise RuntimeError(f"failed on purpose ({n})")


@DBOS.workflow()
def blocker() -> str:
    DBOS.recv("never", timeout_seconds=3600)
    return "unblocked"


@DBOS.workflow()
def job(n: int) -> int:
    return n


def fail(failures: int) -> None:
    for n in range(failures):
        try:
            DBOS.start_workflow(failing, n).get_result()
        except RuntimeError:
            pass


def fail_at_gate(path: str, failures: int) -> None:
    while not os.path.exists(path):
        time.sleep(0.01)
    fail(failures)


def main() -> None:
    config: DBOSConfig = {
        "name": ENV["RELAY_TEST_APP"],
        "system_database_url": ENV["RELAY_TEST_SYSDB"],
        "conductor_url": ENV["RELAY_TEST_CONDUCTOR_URL"],
        "conductor_key": ENV["RELAY_TEST_CONDUCTOR_KEY"],
        "application_version": ENV.get("RELAY_TEST_APP_VERSION", "v1"),
        "notification_listener_polling_interval_sec": 0.1,
        "sys_db_pool_size": 4,
    }
    prepare()
    DBOS(config=config)
    DBOS.alert_handler(take_alert)  # after DBOS(), before launch, as DBOS 3.2 wants
    DBOS.launch()
    failures = int(ENV.get("RELAY_TEST_FAILURES", "0"))
    if ENV.get("RELAY_TEST_FAILURES_GATE"):
        threading.Thread(target=fail_at_gate, args=(ENV["RELAY_TEST_FAILURES_GATE"], failures), daemon=True).start()
    else:
        fail(failures)
    held = int(ENV.get("RELAY_TEST_HOLD_QUEUE", "0"))
    if held:
        # Registered after launch, as DBOS 3.2 wants; queue names are the app's own in a shared system database.
        serial = DBOS.register_queue(ENV.get("RELAY_TEST_HOLD_QUEUE_NAME", "serial"), global_concurrency=1)
        with SetWorkflowID(f"blocker-{GlobalParams.executor_id}"):
            serial.enqueue(blocker)
        for n in range(held):
            serial.enqueue(job, n)
    if ENV.get("RELAY_TEST_HOLD_FAILURES"):
        hold_failures(ENV["RELAY_TEST_HOLD_FAILURES"])
    print(f"READY {GlobalParams.executor_id}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
