"""A real DBOS application for the tests: the SDK's own conductor client.

Run as ``python -m harness.executor_app`` with its settings in the
environment (RELAY_TEST_*); prints ``READY <executor_id>`` once DBOS has
launched (and its jobs are started), then keeps running until killed.

Evidence (RELAY_TEST_EVIDENCE, a PostgreSQL URL):
- ``step_evidence``: one row per execution of a step, keyed by (workflow id,
  step) but not unique: a step is at-least-once, so repeats show up as extra rows;
- ``outcomes``: written by a datasource transaction, which commits together with
  its checkpoint, so a workflow's outcome appears exactly once (primary key).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import sqlalchemy as sa
from dbos import DBOS, DBOSConfig, SetWorkflowID, SQLAlchemyDatasource
from dbos._utils import GlobalParams

ENV = os.environ
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
def note_step(n: int) -> int:
    return n


@DBOS.workflow()
def sleeper(seconds: float) -> str:
    note_step(1)
    DBOS.sleep(seconds)
    return "slept"


@DBOS.step()
def evidence(step: str) -> None:
    with _engine().begin() as conn:
        conn.execute(
            sa.text("INSERT INTO step_evidence (workflow_id, step, executor_id, app, version) "
                    "VALUES (:w, :s, :e, :a, :v)"),
            {"w": DBOS.workflow_id, "s": step, "e": GlobalParams.executor_id,
             "a": GlobalParams.app_name, "v": GlobalParams.app_version},
        )  # fmt: skip


def record_outcome(workflow_id: str) -> None:
    assert ds is not None
    ds.sql_session().execute(
        sa.text("INSERT INTO outcomes (workflow_id, executor_id, app, version) VALUES (:w, :e, :a, :v)"),
        {"w": workflow_id, "e": GlobalParams.executor_id, "a": GlobalParams.app_name, "v": GlobalParams.app_version},
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


def hold_recovery(gate: str) -> None:
    """Make this executor hold each recovery request until the file ``gate`` exists: a recovery in
    flight for as long as a test needs it, where a delay would end at a time a loaded machine moves."""
    original = DBOS._recover_pending_workflows

    def held(cls: type[DBOS], executor_ids: list[str] = ["local"]) -> Any:  # noqa: B006 - the SDK's signature
        wait_for_gate(gate)
        return original(executor_ids)

    DBOS._recover_pending_workflows = classmethod(held)  # type: ignore[method-assign,assignment]


def log_recoveries(path: str) -> None:
    """Append a JSON line (wall-clock time, executor ids, workflows recovered) to ``path``
    each time this executor has served a recovery request, right before it replies."""
    original = DBOS._recover_pending_workflows

    def logged(cls: type[DBOS], executor_ids: list[str] = ["local"]) -> Any:  # noqa: B006 - the SDK's signature
        handles = original(executor_ids)
        line = json.dumps({"at": time.time(), "executor_ids": list(executor_ids), "workflows": len(handles)})
        with open(path, "a", encoding="utf-8") as log:
            log.write(line + "\n")
        return handles

    DBOS._recover_pending_workflows = classmethod(logged)  # type: ignore[method-assign,assignment]


def wait_for_gate(path: str) -> None:
    """Hold the jobs back until the file ``path`` exists (a benchmark starts several executors' jobs at once)."""
    while not os.path.exists(path):
        time.sleep(0.01)


def tick(gate: str, every: float) -> None:
    """Once the file ``gate`` exists, start a long sleeper every ``every`` seconds (``tick-{n}``): a
    process visibly at work, as a live executor cut off from Relay is."""
    wait_for_gate(gate)
    n = 0
    while True:
        with SetWorkflowID(f"tick-{GlobalParams.executor_id}-{n}"):
            DBOS.start_workflow(sleeper, 600.0)
        n += 1
        time.sleep(every)


def main() -> None:
    config: DBOSConfig = {
        "name": ENV["RELAY_TEST_APP"],
        "system_database_url": ENV["RELAY_TEST_SYSDB"],
        "conductor_url": ENV["RELAY_TEST_CONDUCTOR_URL"],
        "conductor_key": ENV["RELAY_TEST_CONDUCTOR_KEY"],
        "application_version": ENV.get("RELAY_TEST_APP_VERSION", "v1"),
        "conductor_executor_metadata": {"test": True},
        "notification_listener_polling_interval_sec": 0.1,
        "sys_db_pool_size": 4,
    }
    if EVIDENCE_URL:
        prepare_evidence()
    if ENV.get("RELAY_TEST_RECOVERY_GATE"):
        hold_recovery(ENV["RELAY_TEST_RECOVERY_GATE"])
    if ENV.get("RELAY_TEST_RECOVERY_LOG"):
        log_recoveries(ENV["RELAY_TEST_RECOVERY_LOG"])
    DBOS(config=config)
    DBOS.launch()
    for _ in range(int(ENV.get("RELAY_TEST_SLEEPERS", "0"))):
        DBOS.start_workflow(sleeper, 3600.0)
    if ENV.get("RELAY_TEST_JOBS_GATE"):
        wait_for_gate(ENV["RELAY_TEST_JOBS_GATE"])
    prefix = ENV.get("RELAY_TEST_JOB_PREFIX", "job")
    for i in range(int(ENV.get("RELAY_TEST_JOBS", "0"))):
        with SetWorkflowID(f"{prefix}-{i}"):
            DBOS.start_workflow(job, float(ENV.get("RELAY_TEST_JOB_SLEEP", "2")))
    if ENV.get("RELAY_TEST_TICK_GATE"):
        args = (ENV["RELAY_TEST_TICK_GATE"], float(ENV.get("RELAY_TEST_TICK_SECS", "0.2")))
        threading.Thread(target=tick, args=args, daemon=True).start()
    print(f"READY {GlobalParams.executor_id}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
