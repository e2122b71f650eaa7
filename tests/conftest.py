from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import zygote
from harness.client_venv import client_python
from harness.executors import ExecutorProcess
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.schedule import ordered


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    pg = Postgres()
    yield pg
    pg.close()


@pytest.fixture
def relay_db(postgres: Postgres) -> str:
    return postgres.create_database("relay")


@pytest.fixture
def sysdb(postgres: Postgres) -> str:
    """One DBOS system database shared by the test's executors (as in production)."""
    return postgres.create_database("sys")


@pytest.fixture
def evidence_db(postgres: Postgres) -> str:
    """Where the test executors write step evidence and outcomes."""
    return postgres.create_database("evidence")


@pytest.fixture
def start_relay(tmp_path: Path, relay_db: str, request: pytest.FixtureRequest) -> Iterator[Callable[..., RelayProcess]]:
    started: list[RelayProcess] = []

    def start(config: dict[str, Any] | None = None, instance_id: str = "relay-1", **liveness: Any) -> RelayProcess:
        relay = RelayProcess(tmp_path, relay_db, config or relay_yaml(free_port(), **liveness), instance_id)
        started.append(relay)
        return relay.start()

    yield start
    for relay in started:
        relay.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(f"--- {relay.instance_id} log ---\n{relay.log()[-6000:]}")


@pytest.fixture(scope="module")
def relay(
    postgres: Postgres, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RelayProcess]:
    """One Relay with relay_yaml's defaults for a whole module (each start costs seconds); its log is
    printed when a test of the module failed. A module that needs other settings defines its own."""
    relay = RelayProcess(tmp_path_factory.mktemp("relay"), postgres.create_database("relay"), relay_yaml(free_port()))
    failed_before = request.session.testsfailed
    relay.start()
    try:
        yield relay
    finally:
        relay.stop()
        if request.session.testsfailed > failed_before:
            print(f"--- {relay.instance_id} log ---\n{relay.log()[-6000:]}")


@pytest.fixture
def start_executor(tmp_path: Path, sysdb: str) -> Iterator[Callable[..., ExecutorProcess]]:
    started: list[ExecutorProcess] = []

    def start(conductor_url: str, **kwargs: Any) -> ExecutorProcess:
        executor = ExecutorProcess(tmp_path, kwargs.pop("sysdb", sysdb), conductor_url, **kwargs)
        started.append(executor)
        return executor

    yield start
    for executor in started:
        executor.stop()


@pytest.fixture(scope="session")
def client_py() -> Path:
    """The dbos 3.4 client venv's python (built once, then cached under .venv-client)."""
    return client_python()


@pytest.fixture
def start_client_executor(
    start_executor: Callable[..., ExecutorProcess], client_py: Path
) -> Callable[..., ExecutorProcess]:
    """A dbos 3.4 application connected through relay_client (harness/client_app.py)."""

    def start(conductor_url: str, **kwargs: Any) -> ExecutorProcess:
        return start_executor(conductor_url, python=client_py, module="harness.client_app", **kwargs)

    return start


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # The files about how Relay, its CLI or a chaos run starts keep exec'd starts; the others' Relay
    # instances and executors start from harness/zygote.py's fork server, without their imports.
    zygote.use(zygote.for_file(item.path.name))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ./test.sh's xdist workers, the slowest files first (harness/schedule.py says why); a run
    without workers keeps pytest's order."""
    if hasattr(config, "workerinput"):
        items[:] = [items[i] for i in ordered([item.nodeid for item in items])]
