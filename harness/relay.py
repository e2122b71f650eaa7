"""``relay serve`` in a subprocess, with the configuration the harness gives it.

Relay runs as it does in production, in its own process, with its log in a file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import yaml

from harness import zygote
from harness.keys import API_KEYS, CONDUCTOR_KEYS, VIEWER_KEYS, sha
from harness.procs import Child, end, listens
from harness.waiting import assert_eventually
from harness.web import TLS


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

    def __init__(
        self,
        workdir: Path,
        database_url: str,
        config: dict[str, Any],
        instance_id: str = "relay-1",
        env: dict[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.env = env or {}  # more of relay serve's environment (RELAY_LOG_FORMAT, say)
        self.database_url = database_url
        self.config = config
        self.instance_id = instance_id
        self.port: int = config["server"]["port"]
        self.config_path = workdir / f"{instance_id}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"{instance_id}.log"
        self.proc: Child | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def conductor_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    def start(self) -> RelayProcess:
        env = {**os.environ, "RELAY_INSTANCE_ID": self.instance_id, "RELAY_LOG_LEVEL": "INFO", **self.env}
        env.pop("RELAY_DATABASE_URL", None)
        args = ["serve", "--config", str(self.config_path), "--database-url", self.database_url]
        with open(self.log_path, "ab") as log:
            # The zygote has this checkout's Relay imported; a working directory with a tree of its
            # own (an old release's, which ``python -m relay`` runs from there) needs an exec.
            if zygote.wanted(env) and not (self.workdir / "relay").is_dir():
                self.proc = zygote.zygote(zygote.RELAY).start(
                    "relay", args, env, self.workdir, stdout=log, stderr=subprocess.STDOUT
                )
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "relay", *args],
                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                )  # fmt: skip
        # A loaded machine (CI on two cores running two workers) may take long over a start.
        assert_eventually(self._ready, 60, what="relay /readyz")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"relay exited with {self.proc.returncode}:\n{self.log()}")
        # This process answering, not another that holds the port (another run's server, handed the
        # same port): that one's 200 let a test go on while this one had not started, nor migrated.
        # This one, failing to listen there, exits, and the check above tells why.
        if not listens(self.proc.pid, self.port):
            return False
        try:
            return httpx.get(f"{self.http}/readyz", timeout=1, verify=TLS).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        end(self.proc, stopped=True)

    def api(self, org: str = "acme", key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.http}/v2/orgs/{org}",
            headers={"Authorization": f"Bearer {key or API_KEYS[org]}"},
            timeout=10,
            verify=TLS,
        )

    def client(self, key: str | None = API_KEYS["acme"]) -> httpx.Client:
        """A client of the whole server (paths from the root), with ``key`` (None: without one)."""
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.Client(base_url=self.http, headers=headers, timeout=10, verify=TLS)

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

    def runs_of(self, workflow_name: str, status: str | None = None, since: float = 0.0) -> int:
        """How many runs of one of Relay's own DBOS workflows its database holds, of ``status`` or any,
        created at or after ``since`` (``time.time()``)."""
        sql = """SELECT count(*) FROM dbos.workflow_status
                 WHERE name = %s AND (%s::text IS NULL OR status = %s) AND created_at >= %s"""
        with psycopg.connect(self.database_url) as conn:
            row = conn.execute(sql, (workflow_name, status, status, int(since * 1000))).fetchone()
        return int(row[0]) if row else 0


PAGE = 1000


def list_all(api: httpx.Client, path: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every item of a paged list of Relay's API (``limit``/``offset``)."""
    rows: list[dict[str, Any]] = []
    while True:
        resp = api.get(path, params={**(params or {}), "limit": PAGE, "offset": len(rows)})
        resp.raise_for_status()
        page: list[dict[str, Any]] = resp.json()
        rows += page
        if len(page) < PAGE:
            return rows


@contextlib.contextmanager
def listeners_paused(database_url: str, instances: int) -> Iterator[None]:
    """The instances' connections listening for blocked recoveries (``LISTEN relay_blocked``, one
    per instance) stop reading until the block ends (SIGSTOP of their PostgreSQL backends, SIGCONT in
    any case): a notification meanwhile is held in PostgreSQL, so an instance learns of a blocked
    recovery only after what the test does in the block."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        listeners = [
            int(pid)
            for (pid,) in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query = 'LISTEN relay_blocked'"
            )
        ]
    assert len(listeners) == instances, listeners
    for pid in listeners:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in listeners:
            os.kill(pid, signal.SIGCONT)


def healthy_instances(relay: RelayProcess, app: str = "ledger") -> dict[str, str]:
    """The app's HEALTHY executors, each one's id to the instance it is connected to."""
    with relay.api() as api:
        return {
            e["executorId"]: e["relayInstance"] for e in list_all(api, f"/apps/{app}/executors", {"state": "HEALTHY"})
        }


def one_more_healthy(relay: RelayProcess, known: Collection[str], app: str = "ledger") -> dict[str, str]:
    """:func:`healthy_instances` once they are the ``known`` ones and one more (empty till then): an
    executor holding its jobs back (harness.executors.jobs_held), whose READY comes only past them, so
    that a test learns its id here."""
    healthy = healthy_instances(relay, app)
    return healthy if len(healthy) == len(known) + 1 and healthy.keys() > set(known) else {}


async def list_all_async(
    api: httpx.AsyncClient, path: str, params: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    while True:
        resp = await api.get(path, params={**(params or {}), "limit": PAGE, "offset": len(rows)})
        resp.raise_for_status()
        page: list[dict[str, Any]] = resp.json()
        rows += page
        if len(page) < PAGE:
            return rows


def audit_actions(relay: RelayProcess, executor_id: str, org: str = "acme") -> list[str]:
    with relay.api(org) as api:
        entries = api.get("/audit", params={"executorId": executor_id}).json()
    return [e["action"] for e in entries]
