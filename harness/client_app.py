"""A real DBOS 3.4 application that reaches Relay through relay_client, for the tests.

It runs in the client's venv (harness/client_venv.py), so it imports nothing
of Relay. Run as ``python -m harness.client_app`` with the same RELAY_TEST_*
settings as :mod:`harness.executor_app`; it prints ``READY <executor_id>`` once
DBOS has launched and the client has started (and its jobs are started), then
runs until killed. With RELAY_TEST_JOBS_GATE set, the jobs are started only
once that file exists, as in executor_app: a test opens it just before it
kills the executor mid-job.

Evidence (RELAY_TEST_EVIDENCE), as in executor_app: ``step_evidence`` gets a row
per execution of a step (at least once), ``outcomes`` one row per workflow from
a datasource transaction committed with its checkpoint (exactly once).

With RELAY_TEST_FINISH_FILE set, it waits for that file to appear, calls
``DBOS.destroy()``, and prints a ``FINISHED {json}`` line saying whether
dbos_enterprise was ever imported or can be found, and whether the client had
stopped, then exits.

With RELAY_TEST_ATEXIT_DESTROY=N, the application registers
``atexit.register(DBOS.destroy, workflow_completion_timeout_sec=N)`` before it
connects (so that handler runs after the client's own). With
RELAY_TEST_EXIT_FILE set, it waits for that file to appear, prints ``EXITING``,
then returns from ``main``: the interpreter exits normally, its jobs perhaps
still running.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import sys
import time
from typing import Any

import sqlalchemy as sa
from dbos import DBOS, DBOSConfig, SetWorkflowID, SQLAlchemyDatasource

# Imported by name: Relay's type checker runs on dbos 3.2, where relay_client is not installed.
relay_client: Any = importlib.import_module("relay_client")

ENV = os.environ
APP = ENV["RELAY_TEST_APP"]
VERSION = ENV.get("RELAY_TEST_APP_VERSION", "v1")
EVIDENCE_URL = ENV.get("RELAY_TEST_EVIDENCE")
ds = SQLAlchemyDatasource.create(EVIDENCE_URL) if EVIDENCE_URL else None


def _engine() -> sa.Engine:
    assert EVIDENCE_URL is not None
    return sa.create_engine(EVIDENCE_URL.replace("postgresql://", "postgresql+psycopg://", 1))


def prepare_evidence() -> None:
    with _engine().begin() as conn:
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(42)"))
        conn.execute(sa.text(
            """CREATE TABLE IF NOT EXISTS step_evidence (
                   workflow_id text NOT NULL, step text NOT NULL, executor_id text NOT NULL,
                   app text NOT NULL, version text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"""
        ))  # fmt: skip
        conn.execute(sa.text(
            """CREATE TABLE IF NOT EXISTS outcomes (
                   workflow_id text PRIMARY KEY, executor_id text NOT NULL, app text NOT NULL,
                   version text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"""
        ))  # fmt: skip


@DBOS.step()
def evidence(step: str) -> None:
    with _engine().begin() as conn:
        conn.execute(
            sa.text("INSERT INTO step_evidence (workflow_id, step, executor_id, app, version) "
                    "VALUES (:w, :s, :e, :a, :v)"),
            {"w": DBOS.workflow_id, "s": step, "e": DBOS.executor_id, "a": APP, "v": VERSION},
        )  # fmt: skip


def record_outcome(workflow_id: str) -> None:
    assert ds is not None
    ds.sql_session().execute(
        sa.text("INSERT INTO outcomes (workflow_id, executor_id, app, version) VALUES (:w, :e, :a, :v)"),
        {"w": workflow_id, "e": DBOS.executor_id, "a": APP, "v": VERSION},
    )


if ds is not None:
    record_outcome = ds.transaction()(record_outcome)


@DBOS.workflow()
def job(sleep_secs: float) -> str:
    evidence("start")
    DBOS.sleep(sleep_secs)
    evidence("after_sleep")
    record_outcome(DBOS.workflow_id or "")
    return "done"


def wait_for_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)


def finish(path: str, connection: Any) -> None:
    """Wait for ``path``, destroy DBOS, report, exit."""
    wait_for_file(path)
    DBOS.destroy()
    deadline = time.monotonic() + 10
    while connection.running and time.monotonic() < deadline:
        time.sleep(0.05)
    report = {
        "enterprise_imported": "dbos_enterprise" in sys.modules,
        "enterprise_found": importlib.util.find_spec("dbos_enterprise") is not None,
        "client_running": connection.running,
    }
    print(f"FINISHED {json.dumps(report)}", flush=True)
    sys.exit(0)


def main() -> None:
    config: DBOSConfig = {
        "name": APP,
        "system_database_url": ENV["RELAY_TEST_SYSDB"],
        "application_version": VERSION,
        "executor_id": relay_client.new_executor_id(),
        "notification_listener_polling_interval_sec": 0.1,
        "sys_db_pool_size": 4,
    }
    if EVIDENCE_URL:
        prepare_evidence()
    DBOS(config=config)
    DBOS.launch()
    exit_timeout = ENV.get("RELAY_TEST_ATEXIT_DESTROY")
    if exit_timeout:
        atexit.register(DBOS.destroy, workflow_completion_timeout_sec=int(exit_timeout))
    connection = relay_client.connect(
        ENV["RELAY_TEST_CONDUCTOR_URL"], key=ENV["RELAY_TEST_CONDUCTOR_KEY"], app=APP, metadata={"test": True}
    )
    if ENV.get("RELAY_TEST_JOBS_GATE"):
        wait_for_file(ENV["RELAY_TEST_JOBS_GATE"])
    prefix = ENV.get("RELAY_TEST_JOB_PREFIX", "job")
    sleep_secs = float(ENV.get("RELAY_TEST_JOB_SLEEP", "2"))
    for i in range(int(ENV.get("RELAY_TEST_JOBS", "0"))):
        with SetWorkflowID(f"{prefix}-{i}"):
            DBOS.start_workflow(job, sleep_secs)
    print(f"READY {DBOS.executor_id}", flush=True)
    if ENV.get("RELAY_TEST_FINISH_FILE"):
        finish(ENV["RELAY_TEST_FINISH_FILE"], connection)
    if ENV.get("RELAY_TEST_EXIT_FILE"):
        wait_for_file(ENV["RELAY_TEST_EXIT_FILE"])
        print("EXITING", flush=True)
        return
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
