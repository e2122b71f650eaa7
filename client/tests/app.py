"""Workflows the client's tests run, and launching DBOS for them on a SQLite system database."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from dbos import DBOS, DBOSConfig

alerts: list[tuple[str, str, dict[str, str]]] = []


@DBOS.step()
def add(x: int, y: int) -> int:
    return x + y


@DBOS.step()
def fail(message: str) -> None:
    raise ValueError(message)


@DBOS.workflow()
def adder(x: int) -> int:
    DBOS.set_event("seen", x)
    return add(x, 1) + add(x, 2)


@DBOS.workflow()
def failing(message: str) -> None:
    add(1, 1)
    fail(message)


@DBOS.workflow()
def waiter(seconds: float) -> Any:
    return DBOS.recv("go", timeout_seconds=seconds)


@DBOS.workflow()
def ticker(scheduled_at: datetime, context: Any) -> None:
    add(0, 0)


def launch(tmp: Path, executor_id: str | None, name: str = "clienttest", alert_handler: bool = False) -> None:
    config: DBOSConfig = {
        "name": name,
        "system_database_url": f"sqlite:///{tmp / 'sys.sqlite'}",
        "application_version": "v1",
        "executor_id": executor_id,
    }
    DBOS(config=config)
    if alert_handler:

        @DBOS.alert_handler
        def handle(name: str, message: str, metadata: dict[str, str]) -> None:
            alerts.append((name, message, metadata))

    DBOS.launch()
