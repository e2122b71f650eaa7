"""The chaos fleet's executor: a real DBOS 3.2 application using the SDK's own
conductor client, with a workload whose every step leaves evidence. With
CHAOS_CLIENT=1 it is the same application on dbos 3.4 (run by the client's
venv, harness/client_venv.py) reaching Relay through relay_client instead.

Run as ``python -m chaos.app`` with CHAOS_* settings in the environment. It
starts a workflow every ``CHAOS_INTERVAL`` seconds until the Unix time in the
file ``CHAOS_UNTIL_FILE`` (the runner sets it once the fleet is up), cycling
through four kinds (a deploy, chaos/schedule.py, drains it through the file ``CHAOS_DRAIN_FILE``:
once it says ``noqueue``, ``queued`` is started as ``short``; once it says ``idle``, nothing more
is started):

- ``short``: two steps;
- ``long``: a step, a durable sleep, a step;
- ``queued``: enqueued on ``<app>-serial`` (concurrency 1) or ``<app>-pool`` (concurrency 4);
- ``parent``: starts two ``short`` children and waits for them.

Every step appends a row to ``step_evidence`` (at least once: a step re-run
after a recovery shows as an extra row); every workflow's last act is a
datasource transaction appending to ``outcomes``, which commits together with
its checkpoint, so a second row for a workflow is a real double execution.
"""

from __future__ import annotations

import importlib
import os
import random
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from dbos import DBOS, DBOSConfig, Queue, SetWorkflowID, SQLAlchemyDatasource
from dbos._utils import GlobalParams

ENV = os.environ
EVIDENCE_URL = ENV["CHAOS_EVIDENCE"]
ds = SQLAlchemyDatasource.create(EVIDENCE_URL)
engine = sa.create_engine(EVIDENCE_URL.replace("postgresql://", "postgresql+psycopg://", 1), pool_size=4)
queues: dict[str, Queue] = {}  # registered after launch, named per app: apps share one system database

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS step_evidence (
           workflow_id text NOT NULL, step text NOT NULL, executor_id text NOT NULL, app text NOT NULL,
           at timestamptz NOT NULL DEFAULT clock_timestamp())""",
    """CREATE TABLE IF NOT EXISTS outcomes (
           id bigserial PRIMARY KEY, workflow_id text NOT NULL, executor_id text NOT NULL, app text NOT NULL,
           at timestamptz NOT NULL DEFAULT clock_timestamp())""",
]


def prepare() -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(4242)"))
        for statement in SCHEMA:
            conn.execute(sa.text(statement))


@DBOS.step()
def step(name: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO step_evidence (workflow_id, step, executor_id, app) VALUES (:w, :s, :e, :a)"),
            {"w": DBOS.workflow_id, "s": name, "e": GlobalParams.executor_id, "a": GlobalParams.app_name},
        )


@ds.transaction()
def outcome() -> None:
    ds.sql_session().execute(
        sa.text("INSERT INTO outcomes (workflow_id, executor_id, app) VALUES (:w, :e, :a)"),
        {"w": DBOS.workflow_id, "e": GlobalParams.executor_id, "a": GlobalParams.app_name},
    )


@DBOS.workflow()
def short() -> None:
    step("one")
    step("two")
    outcome()


@DBOS.workflow()
def long(seconds: float) -> None:
    step("before")
    DBOS.sleep(seconds)
    step("after")
    outcome()


@DBOS.workflow()
def queued(seconds: float) -> None:
    step("work")
    DBOS.sleep(seconds)
    outcome()


@DBOS.workflow()
def parent() -> None:
    me = DBOS.workflow_id
    handles = []
    for i in range(2):
        with SetWorkflowID(f"{me}.child{i}"):
            handles.append(DBOS.start_workflow(short))
    for handle in handles:
        handle.get_result()
    step("joined")
    outcome()


def drain(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def start_one(n: int, rng: random.Random, enqueue: bool = True) -> None:
    workflow_id = f"{GlobalParams.app_name}:{GlobalParams.executor_id}:{n}"
    kind = n % 4
    if kind == 2 and not enqueue:
        kind = 0
    with SetWorkflowID(workflow_id):
        if kind == 0:
            DBOS.start_workflow(short)
        elif kind == 1:
            DBOS.start_workflow(long, rng.uniform(1.0, 6.0))
        elif kind == 2:
            queues["serial" if n % 8 == 2 else "pool"].enqueue(queued, rng.uniform(0.1, 1.0))
        else:
            DBOS.start_workflow(parent)


def main() -> None:
    app = ENV["CHAOS_APP"]
    config: DBOSConfig = {
        "name": app,
        "system_database_url": ENV["CHAOS_SYSDB"],
        "application_version": ENV["CHAOS_VERSION"],
        "notification_listener_polling_interval_sec": 0.1,
        "sys_db_pool_size": 6,
    }
    client: Any = None
    if ENV.get("CHAOS_CLIENT"):
        # By name: this file is type-checked on dbos 3.2, where relay_client is not installed.
        client = importlib.import_module("relay_client")
        config["executor_id"] = client.new_executor_id()
    else:
        config["conductor_url"] = ENV["CHAOS_CONDUCTOR_URL"]
        config["conductor_key"] = ENV["CHAOS_CONDUCTOR_KEY"]
    prepare()
    dbos = DBOS(config=config)
    if ENV.get("CHAOS_LIAR"):
        # A liar for Relay's verification: the SDK's recovery handler then answers success: true.
        def recover_nothing(executor_ids: list[str]) -> list[Any]:
            return []

        dbos._recover_pending_workflows = recover_nothing  # type: ignore[method-assign, assignment]
    DBOS.launch()
    if client is not None:
        client.connect(ENV["CHAOS_CONDUCTOR_URL"], key=ENV["CHAOS_CONDUCTOR_KEY"], app=app)
    queues["serial"] = DBOS.register_queue(f"{app}-serial", global_concurrency=1)
    queues["pool"] = DBOS.register_queue(f"{app}-pool", global_concurrency=4)
    print(f"READY {GlobalParams.executor_id}", flush=True)
    rng = random.Random(ENV.get("CHAOS_SEED", "0") + GlobalParams.executor_id)
    until_file, interval = Path(ENV["CHAOS_UNTIL_FILE"]), float(ENV["CHAOS_INTERVAL"])
    drain_file = Path(ENV.get("CHAOS_DRAIN_FILE") or until_file.with_name("no-drain"))
    n = 0
    while time.time() < float(until_file.read_text()) and (mode := drain(drain_file)) != "idle":
        start_one(n, rng, enqueue=mode != "noqueue")
        n += 1
        time.sleep(interval)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
