"""A real DBOS 3.2 application with something of everything the workflow API serves.

Run as ``python -m harness.workflow_app`` with the same settings as
:mod:`harness.executor_app` (RELAY_TEST_APP, RELAY_TEST_SYSDB,
RELAY_TEST_CONDUCTOR_URL, RELAY_TEST_CONDUCTOR_KEY, RELAY_TEST_APP_VERSION),
plus RELAY_TEST_SEED: when "1", this executor creates the fixtures below once
(the other executors of the app only serve). Prints ``READY <executor_id>``.

The fixtures, with ids the tests can name:

- ``done-1``: a finished ``parent`` workflow: two steps, a child workflow
  (``done-1-child``), an event ``progress``, a stream ``log`` with two values,
  a message it received on topic ``go``;
- ``waiting-1``: a ``parent`` workflow waiting for its message (PENDING), so it
  can be cancelled and resumed;
- ``failed-1``: a workflow that raised (ERROR), for fork-from-failure;
- ``queued-N``: ``job`` workflows on the queue ``serial`` (concurrency 1);
- ids with ``/``, ``?`` and ``#`` in them: ``odd/steps``, ``odd?x=1``, ``odd#frag``;
- a schedule ``every-hour`` of the workflow ``tick``.

It also has a workflow and a step with names of 2,000 characters (harness.long_names), which it
runs only when a test enqueues the workflow.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Any

from dbos import DBOS, DBOSConfig, SetWorkflowID
from dbos._utils import GlobalParams

from harness.long_names import LONG_STEP_NAME, LONG_WORKFLOW_NAME

ENV = os.environ


@DBOS.step()
def add(a: int, b: int) -> int:
    return a + b


@DBOS.step()
def shout(text: str) -> str:
    return text.upper()


@DBOS.workflow()
def child(n: int) -> int:
    return add(n, 1)


@DBOS.workflow()
def parent(n: int, wait_secs: float) -> str:
    total = add(n, 1)
    word = shout(f"total {total}")
    DBOS.set_event("progress", f"step {total}")
    DBOS.write_stream("log", "first")
    DBOS.write_stream("log", "second")
    with SetWorkflowID(f"{DBOS.workflow_id}-child"):
        handle = DBOS.start_workflow(child, n)
    got = DBOS.recv("go", timeout_seconds=wait_secs)
    return f"{word} {handle.get_result()} {got}"


@DBOS.workflow()
def failing(n: int) -> int:
    add(n, 1)
    raise RuntimeError(f"failed on purpose with {n}")


@DBOS.workflow()
def job(n: int) -> int:
    return add(n, n)


@DBOS.workflow()
def tick(when: datetime, context: Any) -> None:
    add(int(when.timestamp()), 0)


@DBOS.workflow()
def odd() -> str:
    return shout("odd")


@DBOS.step(name=LONG_STEP_NAME)
def long_step(n: int) -> int:
    return n + 1


@DBOS.workflow(name=LONG_WORKFLOW_NAME)
def long_named(n: int) -> int:
    return long_step(n)


def seed() -> None:
    """Create the fixtures (idempotent: ids are fixed)."""
    with SetWorkflowID("done-1"):
        done = DBOS.start_workflow(parent, 1, 30.0)
    DBOS.send("done-1", "hello", topic="go")
    done.get_result()
    with SetWorkflowID("waiting-1"):
        DBOS.start_workflow(parent, 2, 3600.0)
    with SetWorkflowID("failed-1"):
        failed = DBOS.start_workflow(failing, 3)
    try:
        failed.get_result()
    except RuntimeError:
        pass
    serial = DBOS.retrieve_queue("serial")
    assert serial is not None
    for n in range(3):
        with SetWorkflowID(f"queued-{n}"):
            serial.enqueue(job, n)
    for workflow_id in ("odd/steps", "odd?x=1", "odd#frag"):
        with SetWorkflowID(workflow_id):
            DBOS.start_workflow(odd).get_result()
    if not [s for s in DBOS.list_schedules() if s["schedule_name"] == "every-hour"]:
        DBOS.create_schedule(schedule_name="every-hour", workflow_fn=tick, schedule="0 * * * *", context="ctx")


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
    DBOS(config=config)
    DBOS.launch()
    DBOS.register_queue("serial", global_concurrency=1)  # registered after launch, as DBOS 3.2 wants
    if ENV.get("RELAY_TEST_SEED") == "1":
        seed()
    print(f"READY {GlobalParams.executor_id}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
