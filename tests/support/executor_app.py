"""A real DBOS application for the tests: the SDK's own conductor client.

Run as ``python -m tests.support.executor_app`` with its settings in the
environment (RELAY_TEST_*); prints ``READY <executor_id>`` once DBOS has
launched, then keeps running until killed.
"""

from __future__ import annotations

import os
import sys
import time

from dbos import DBOS, DBOSConfig
from dbos._utils import GlobalParams


@DBOS.step()
def note_step(n: int) -> int:
    return n


@DBOS.workflow()
def sleeper(seconds: float) -> str:
    note_step(1)
    DBOS.sleep(seconds)
    return "slept"


def main() -> None:
    env = os.environ
    config: DBOSConfig = {
        "name": env["RELAY_TEST_APP"],
        "system_database_url": env["RELAY_TEST_SYSDB"],
        "conductor_url": env["RELAY_TEST_CONDUCTOR_URL"],
        "conductor_key": env["RELAY_TEST_CONDUCTOR_KEY"],
        "application_version": env.get("RELAY_TEST_APP_VERSION", "v1"),
        "conductor_executor_metadata": {"test": True},
        "notification_listener_polling_interval_sec": 0.1,
        "sys_db_pool_size": 4,
    }
    DBOS(config=config)
    DBOS.launch()
    for _ in range(int(env.get("RELAY_TEST_SLEEPERS", "0"))):
        DBOS.start_workflow(sleeper, 3600.0)
    print(f"READY {GlobalParams.executor_id}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
