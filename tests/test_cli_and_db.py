"""The command line, the embedded database and the migrations, for real."""

from __future__ import annotations

import asyncio
import base64
import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from harness.ports import free_port
from harness.postgres import Postgres
from harness.procs import end
from relay.cli import main, without_secrets
from relay.config import load_config
from relay.errors import ConfigError, DatabaseError
from relay.store.db import Database, patiently
from relay.store.migrations import MIGRATIONS


def run_relay(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, input=input,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("content", "field", "reason"),
    [
        ("server: {port: -5}\n", "server.port", "greater than or equal to 0"),
        ("liveness: {pingWaitSecs: fast}\n", "liveness.pingWaitSecs", "valid number"),
        ("orgz: []\n", "orgz", "Extra inputs are not permitted"),
        ("orgs: [{name: a, conductorKeys: [{name: k, sha256: xyz}]}]\n", "sha256", "64 hex digits"),
        # libpq reads "" as every default (a local socket); the embedded PostgreSQL is meant by no URL.
        ('database: {url: ""}\n', "database.url", "leave database.url out for the embedded PostgreSQL"),
    ],
)
def test_bad_config_gets_one_clear_message_and_exit_2(tmp_path: Path, content: str, field: str, reason: str) -> None:
    config = tmp_path / "relay.yaml"
    config.write_text(content)
    result = run_relay("serve", "--config", str(config))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert str(config) in result.stderr and field in result.stderr and reason in result.stderr


def test_missing_config_file_exit_2(tmp_path: Path) -> None:
    result = run_relay("serve", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "nope.yaml: cannot read: No such file or directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_relay_config_env_is_read(tmp_path: Path) -> None:
    config = tmp_path / "env.yaml"
    config.write_text("server: {port: banana}\n")
    result = run_relay("serve", env={"RELAY_CONFIG": str(config)})
    assert result.returncode == 2 and "env.yaml" in result.stderr


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_relay_database_url_is_a_configuration_error(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not taken for unset (the embedded PostgreSQL): compose's ``RELAY_DATABASE_URL: ${DB_URL}``
    with DB_URL unset would otherwise keep Relay's state in a throwaway local database."""
    message = "RELAY_DATABASE_URL is set but empty: unset it for the embedded PostgreSQL, or give a PostgreSQL URL"
    monkeypatch.setenv("RELAY_DATABASE_URL", value)
    with pytest.raises(ConfigError) as refused:
        load_config(None)
    assert str(refused.value) == message

    home = tmp_path / "home"
    env = {"RELAY_DATABASE_URL": value, "RELAY_HOME": str(home)}
    assert refused_serve(["--port", str(free_port())], env, tmp_path) == (2, f"relay: {message}\n")
    assert not home.exists()  # no embedded PostgreSQL was started


def test_an_empty_database_url_option_is_a_configuration_error(tmp_path: Path) -> None:
    """``--database-url "$DB_URL"`` with DB_URL unset: refused as the variable is, not the embedded
    PostgreSQL (nor RELAY_DATABASE_URL, which the option overrides)."""
    home = tmp_path / "home"
    args = ["--port", str(free_port()), "--database-url", ""]
    assert refused_serve(args, {"RELAY_HOME": str(home)}, tmp_path) == (
        2,
        "relay: --database-url is empty: leave it out for the embedded PostgreSQL, or give a PostgreSQL URL\n",
    )
    assert not home.exists()


def refused_serve(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """``relay serve`` with ``args`` in only this environment of Relay's, expected to exit at once:
    its exit code and stderr. One that runs instead is stopped (SIGTERM: an embedded PostgreSQL it
    started is stopped with it) and the test fails."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "serve", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**environ, **env}, cwd=cwd,
    )  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        end(proc, timeout=30)
        pytest.fail("relay serve did not exit: it started")
    return proc.returncode, stderr


def test_keys_new_prints_a_key_and_its_hash() -> None:
    result = run_relay("keys", "new")
    assert result.returncode == 0
    key = re.search(r"key:\s+(\S+)", result.stdout)
    digest = re.search(r"sha256:\s+([0-9a-f]{64})", result.stdout)
    assert key and digest
    import hashlib

    assert hashlib.sha256(key.group(1).encode()).hexdigest() == digest.group(1)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("postgresql+psycopg://relay:s3cret@db.example/relay", 'missing "=" after "the URL"'),  # SQLAlchemy's
        ("postgresql://relay:s3cret@db.example/relay?pool_size=4", 'invalid URI query parameter: "pool_size"'),
    ],
)
def test_a_database_url_libpq_cannot_read_is_a_config_error_that_shows_no_password(url: str, reason: str) -> None:
    """Refused before anything starts, with libpq's reason, exit 2 and no traceback (it was an
    "internal error" with one), and without echoing the URL, whose password libpq's message holds."""
    result = run_relay("serve", "--port", str(free_port()), "--database-url", url)
    assert result.returncode == 2, result.stderr
    assert "database.url" in result.stderr and reason in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "s3cret" not in result.stderr


def test_unreachable_database_fails_cleanly(tmp_path: Path) -> None:
    result = run_relay(
        "serve", "--port", str(free_port()), "--database-url", "postgresql://nobody@127.0.0.1:1/none", timeout=60
    )
    assert result.returncode != 0
    assert "cannot connect to PostgreSQL" in result.stderr


def test_two_instances_migrating_at_once_apply_each_migration_once(postgres: Postgres) -> None:
    url = postgres.create_database("migrate")

    async def both() -> list[list[int]]:
        dbs = [Database(url, min_size=1, max_size=2) for _ in range(4)]
        for db in dbs:
            await db.open()
        try:
            return list(await asyncio.gather(*(db.migrate() for db in dbs)))
        finally:
            for db in dbs:
                await db.close()

    results = asyncio.run(both())
    assert sorted(map(len, results)) == [0, 0, 0, len(MIGRATIONS)]
    again = asyncio.run(_migrate_once(url))
    assert again == []


async def _migrate_once(url: str) -> list[int]:
    db = Database(url, min_size=1, max_size=1)
    await db.open()
    try:
        return await db.migrate()
    finally:
        await db.close()


def test_a_workflow_step_waits_longer_for_a_connection_than_the_pool_does(relay_db: str) -> None:
    """In a group failure the pool's queue can outlast its timeout: a step's reads wait (they are
    retried anyway, at a higher cost), the others still fail after the pool's timeout."""

    async def scenario() -> tuple[bool, float, float, float]:
        db = Database(relay_db, min_size=1, max_size=1)
        db.pool.timeout = 0.5  # the pool's 10 s, shortened for the test
        await db.open()
        taken, release = asyncio.Event(), asyncio.Event()
        try:

            async def hold() -> float:
                async with db.connection():
                    taken.set()
                    await release.wait()
                    released = time.monotonic()  # the connection goes back to the pool after this
                return released

            asked: list[float] = []

            async def read() -> float:
                asked.append(time.monotonic())
                async with db.connection() as conn:
                    await conn.execute("SELECT 1")
                return time.monotonic()

            # Held until the test lets go (not for a time that a slow start of the test could use up).
            held = asyncio.create_task(hold())
            await taken.wait()
            try:
                await read()
                refused = False
            except DatabaseError:
                refused = True
            patient = asyncio.create_task(patiently(read(), 5.0))
            await asyncio.sleep(0)  # the task runs up to its wait for a connection
            assert len(asked) == 2
            await asyncio.sleep(1.0)  # twice the pool's timeout, counted from when the read asked
            release.set()
            return refused, asked[1], await held, await patient
        finally:
            release.set()
            await db.close()

    refused, started, released, answered = asyncio.run(scenario())
    assert refused  # past the pool's timeout
    # The patient read waited for the held connection, longer than the pool would.
    assert answered >= released and released - started >= 1.0


def test_serve_refuses_a_port_out_of_range() -> None:
    """--port 99999 listened on 99999 - 65536 = 34463 and printed :99999."""
    for port in ("99999", "65536", "-1"):
        result = run_relay("serve", "--port", port, "--database-url", "postgresql://nobody@127.0.0.1:1/none")
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("relay: Invalid value for '--port'") and "0<=x<=65535" in result.stderr


@pytest.mark.parametrize(
    ("org", "host"),
    [("1234", "127.0.0.1"), ("on", "127.0.0.1"), ("null", "0.0.0.0"), ("ops: east", "127.0.0.1"), ("acme", "::"),
     ("#1 'x' \"y\"", "::1")],
)  # fmt: skip
def test_relay_init_writes_what_it_was_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], org: str, host: str
) -> None:
    """Unquoted, 1234, on and null were read back as an int, a boolean and null (refused by
    ``relay serve``), and ``ops: east`` or ``::`` made a file that is not YAML."""
    path = tmp_path / "relay.yaml"
    assert main(["init", "--path", str(path), "--org", org, "--host", host]) == 0, capsys.readouterr().err
    config = load_config(path)
    assert (config.orgs[0].name, config.server.host, config.server.port) == (org, host, 8080)
    assert "# 0.0.0.0 to accept executors from other machines" in path.read_text()


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["serve", "--log-level", "bogus"], {}, "Invalid value for '--log-level'"),
        (["serve"], {"RELAY_LOG_LEVEL": "loud"}, "Invalid value for RELAY_LOG_LEVEL"),
        (["serve", "--log-format", "xml"], {}, "Invalid value for '--log-format': 'xml' is not one of text, json"),
        (["serve"], {"RELAY_LOG_FORMAT": "logfmt"}, "Invalid value for RELAY_LOG_FORMAT"),
        (["apps", "--url", "http://[::1"], {"RELAY_API_KEY": "k"}, "not a URL: 'http://[::1'"),
        (["apps", "--url", "relay:8080"], {"RELAY_API_KEY": "k"}, "not an http(s) URL"),
        (["audit", "--since", "1000000d"], {"RELAY_API_KEY": "k"}, "not a time: '1000000d' is out of range"),
        (["audit", "--since", "0001-01-01"], {"RELAY_API_KEY": "k"}, "not a time: '0001-01-01' is out of range"),
        (["apps"], {"RELAY_API_KEY": "kéy"}, "the API key is not printable ASCII"),
        (["no-such-command"], {}, "No such command 'no-such-command' (see 'relay -h')"),
    ],
    ids=[
        "log-level",
        "log-level-env",
        "log-format",
        "log-format-env",
        "malformed-url",
        "no-scheme",
        "huge-age",
        "year-0",
        "non-ascii-key",
        "command",
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], env: dict[str, str], said: str) -> None:
    """Each of these was a traceback and exit 1 (ValueError, httpx.InvalidURL, OverflowError,
    UnicodeEncodeError), or exit 5 "cannot reach Relay" for a URL without http://."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    result = subprocess.run([sys.executable, "-m", "relay", *args], capture_output=True, text=True, timeout=30,
                            env={**clean, **env})  # fmt: skip
    err = result.stderr
    assert result.returncode == 2 and err.startswith("relay: ") and err.count("\n") == 1 and said in err, err
    assert "kéy" not in err


def test_an_unexpected_error_is_one_line_and_exit_1_never_a_traceback() -> None:
    """An answer the command does not expect (here a server that answers {} to everything, not
    Relay): one line naming the error, no traceback, and no key."""

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = run_relay(
            "apps",
            "show",
            "ledger",
            "--org",
            "acme",
            "--url",
            url,
            "--key",
            "relay_secret-key",
            env={"RELAY_API_KEY": ""},
        )
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 1 and result.stderr == "relay: internal error: KeyError: 'executors'\n", result.stderr


class NotRelay(BaseHTTPRequestHandler):
    """Another server at the address given as Relay's: ``python -m http.server`` (a 404 page for every
    path), a web page for everything, or another service's JSON API, as the server's ``answer`` says."""

    def do_GET(self) -> None:
        status, content_type, body = self.server.answer  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("answer", "code", "said"),
    [
        ((404, "text/html", b"<!DOCTYPE HTML><html><title>Error response</title><p>File not found.</html>"), 2,
         "404 Not Found: GET /v2/whoami answered by a server that is not Relay (a page, not problem details)"),
        ((200, "text/html", b"<html>Welcome to nginx!</html>"), 1,
         "GET /v2/whoami: the answer is not JSON: '<html>Welcome to nginx!</html>'"),
        ((200, "application/json", b'{"status": "ok"}'), 2, "GET /v2/whoami: the answer has no org"),
    ],
)  # fmt: skip
def test_a_server_that_is_not_relay_is_said_to_be_so_and_the_url_named_to_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], answer: Any, code: int, said: str
) -> None:
    """RELAY_URL at another server, as an on-call engineer's shell may have it: a 404 page was exit 3,
    "not found", which a script reads as "no such app", and its line was the page's markup; another
    API's JSON was "internal error: KeyError: 'org'". Each says now that the server is not Relay and
    to check --url, in one line without the page."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotRelay)
    server.answer = answer  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in [k for k in os.environ if k.startswith("RELAY_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("RELAY_URL", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("RELAY_API_KEY", "relay_secret-key")
        capsys.readouterr()
        assert main(["executors", "ledger"]) == code
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert err.startswith(f"relay: {said}") and err.count("\n") == 1, err
    assert err.rstrip().endswith("is --url (or RELAY_URL) Relay's address, with its path prefix behind a proxy?"), err
    assert "DOCTYPE" not in err and "internal error" not in err, err


def test_an_internal_error_line_leaves_out_the_keys_and_passwords(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_API_KEY", "relay_k2")
    text = "boom relay_k1, relay_k2, relay_k3\nat postgresql://me:pw@db/x"
    assert without_secrets(text, ["apps", "--key=relay_k1"]) == "boom ***, ***, relay_k3 at postgresql://me:***@db/x"
    assert without_secrets("relay_k3 \x1b]0;x\x07", ["--key", "relay_k3"]) == r"*** \x1b]0;x\x07"


class Echo(BaseHTTPRequestHandler):
    """A server in front of Relay's address that quotes each request back in its error: a proxy's
    or a framework's error page that echoes the body and the headers. The app in the path says how:
    ``problem`` a 422 problem+json, ``text`` a 502 in plain text, ``moved`` a redirect whose address
    has them in its query."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
        echoed = f"refused {body} sent with {self.headers.get('Authorization')}"
        how = self.path.split("/")[5]
        if how == "problem":
            self.answer(422, "application/problem+json", json.dumps({"title": "Unprocessable", "detail": echoed}))
        elif how == "text":
            self.answer(502, "text/plain", echoed)
        else:
            self.send_response(302)
            self.send_header(
                "Location", f"http://elsewhere/?body={quote(body)}&auth={quote(self.headers['Authorization'])}"
            )
            self.send_header("Content-Length", "0")
            self.end_headers()

    def answer(self, status: int, content_type: str, text: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(text.encode())))
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args: object) -> None:
        pass


def test_no_error_line_prints_a_secret_the_command_was_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error line masked the API key of an internal error only: a webhook's secret, the key or a
    URL's password quoted back by an answer (its problem's detail, its text, a redirect's address)
    was printed, and a URL's password was shown whole when it had a / (``//u:s3cr/et@host``) and in
    part when it had an @ (``//u:p@ss@host`` as ``//u:***@ss@host``). None is printed now, whether
    given as an option, in the environment or on stdin. A URL with a user or password is refused:
    HTTP sent them as Basic authentication in place of the API key, which never reached Relay."""
    secret, key, password = "stdin-secret-1f4e8a2b9c", "relay_key-7d3c5b1a0e9f", "pa%40ss-W0rd-62b1"
    basic = base64.b64encode(b"ops:pa@ss-W0rd-62b1").decode()  # as httpx sends a URL's user and password
    hidden = (secret, key, "pa@ss-W0rd-62b1", password, "ss-W0rd", basic, "cli-secret-88e0d2f4a6")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]

    def run(url: str, app: str, *options: str, stdin: str = secret) -> tuple[int, str]:
        for name in [k for k in os.environ if k.startswith("RELAY_")]:
            monkeypatch.delenv(name)
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        code = main(["alerts", "create", app, "--kind", "ExecutorDead", "--webhook", "http://127.0.0.1:9/hook",
                     "--org", "acme", "--url", url, *options])  # fmt: skip
        out, err = capsys.readouterr()
        return code, out + err

    try:
        plain = f"http://127.0.0.1:{port}"
        for app, exit_code in (("problem", 2), ("text", 5), ("moved", 1)):
            for options in (["--key", key, "--secret", "cli-secret-88e0d2f4a6"], ["--key", key, "--secret-stdin"]):
                code, printed = run(plain, app, *options)
                assert code == exit_code and printed.count("\n") == 1, (app, printed)
                assert "refused" in printed or "redirected" in printed, printed  # the answer was read
                assert not [s for s in hidden if s in printed], (app, plain, printed)
        # A URL's user and password would have gone as Basic authentication in place of the key
        # (httpx sends them so), which was never sent: refused before anything is sent.
        code, printed = run(f"http://ops:{password}@127.0.0.1:{port}", "problem", "--key", key, "--secret-stdin")
        assert code == 2 and "carries a user or password" in printed and printed.count("\n") == 1, printed
        assert not [s for s in hidden if s in printed], printed
        # The environment's key and secret too, and the real command with its stdin piped.
        done = run_relay("alerts", "create", "problem", "--kind", "ExecutorDead", "--webhook", "http://127.0.0.1:9/h",
                         "--org", "acme", "--url", plain, "--secret-stdin", input=secret,
                         env={"RELAY_API_KEY": key, "RELAY_WEBHOOK_SECRET": "cli-secret-88e0d2f4a6"})  # fmt: skip
        assert done.returncode == 2 and "refused" in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert not [s for s in hidden if s in done.stdout + done.stderr], done.stderr
    finally:
        server.shutdown()
        server.server_close()
    # No Relay to reach: the URL's password, however typed, is not in the line.
    nowhere = free_port()
    for url in (f"http://ops:pa@ss-W0rd-62b1@127.0.0.1:{nowhere}", f"http://ops:s3cr/et-W0rd@127.0.0.1:{nowhere}",
                f"http://ops:{password}@127.0.0.1:{nowhere}"):  # fmt: skip
        code, printed = run(url, "any", "--key", key)
        assert code == 2 and printed.startswith("relay: ") and printed.count("\n") == 1, printed
        assert not [s for s in (*hidden, "s3cr", "et-W0rd") if s in printed], printed


def test_an_at_sign_in_a_path_is_not_taken_for_a_password_and_a_webhooks_password_is_masked_encoded_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A URL with an @ in its path (``https://h//docs/x@y``) was masked from its first // to that @,
    host and path (``https://***@y``), as if they were a user and password; a host's port before its
    path (``//h:8080/x@y``) too. Only a real user information is masked now. And a webhook's password
    was masked where an answer quoted it as typed only: quoted percent-encoded (``p%40ss`` for
    ``p@ss``, a redirect's address here), it was printed."""
    kept = "boom at https://h//docs/x@y, http://h:8080/a@b and [http://[::1]:8080/c@d]"
    assert without_secrets(kept, []) == kept
    assert without_secrets("to https://ops:p@ss/w0rd@h//docs/x@y", []) == "to https://ops:***@y"  # to the last @
    assert without_secrets("at //tok@h/x@y and 'sftp://me:pw@h'", []) == "at //***@h/x@y and 'sftp://me:***@h'"

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    password = "p@ss-W3bh00k-4e1a"
    try:
        for app, hook in (("text", "http://127.0.0.1:9//docs/x@y"), ("moved", f"http://hook:{password}@127.0.0.1:9/h")):
            for name in [k for k in os.environ if k.startswith("RELAY_")]:
                monkeypatch.delenv(name)
            capsys.readouterr()
            url = f"http://127.0.0.1:{server.server_address[1]}"
            code = main(["alerts", "create", app, "--kind", "ExecutorDead", "--webhook", hook, "--org", "acme",
                         "--url", url, "--key", "relay_key-0c9d"])  # fmt: skip
            printed = capsys.readouterr().err
            assert code in (1, 5) and printed.count("\n") == 1, printed
            if app == "text":  # the answer quotes the body, the webhook's address in it whole
                assert "refused" in printed and hook in printed, printed
            else:  # the redirect's address quotes the body percent-encoded
                assert "redirected" in printed and "%3A//hook%3A" in printed, printed
                assert quote(password, safe="") not in printed and "ss-W3bh00k" not in printed, printed
    finally:
        server.shutdown()
        server.server_close()


def test_a_webhooks_token_given_as_its_user_is_masked_where_an_answer_quotes_it_encoded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A webhook's URL with a token as its user and no password (``http://TOKEN@host/h``) showed as
    ``http://***@host/h`` where an answer quoted it as typed, but whole where it quoted the URL
    percent-encoded (a redirect's address here): only a password was taken from the URL to mask."""
    token = "w3bh00k-t0ken-81c4"
    for name in [k for k in os.environ if k.startswith("RELAY_")]:
        monkeypatch.delenv(name)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        capsys.readouterr()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code = main(["alerts", "create", "moved", "--kind", "ExecutorDead", "--webhook", f"http://{token}@127.0.0.1:9/h",
                     "--org", "acme", "--url", url, "--key", "relay_key-7d2e"])  # fmt: skip
        printed = capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()
    assert code in (1, 5) and "redirected" in printed and "%3A//" in printed and printed.count("\n") == 1, printed
    assert token not in printed, printed


class HeldEcho(Echo):
    """Echo, holding each answer until ``release`` is set (``arrived`` says a request came)."""

    arrived = threading.Event()
    release = threading.Event()

    def do_POST(self) -> None:
        HeldEcho.arrived.set()
        HeldEcho.release.wait(20)
        super().do_POST()


def test_a_command_keeps_its_secrets_while_another_runs_in_the_same_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The secrets to mask that no option shows (here a webhook's secret read from stdin) were kept
    in module state, which each ``main`` cleared as it started: a command that started while another
    waited for its answer took them from it, and an answer that quoted the secret had it printed. Each
    command keeps its own now, on its click context."""
    secret = "stdin-secret-held-7a2c9e4b"
    for name in [k for k in os.environ if k.startswith("RELAY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "stdin", io.StringIO(secret))
    server = ThreadingHTTPServer(("127.0.0.1", 0), HeldEcho)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    HeldEcho.arrived.clear()
    HeldEcho.release.clear()
    codes: list[int] = []
    args = ["alerts", "create", "problem", "--kind", "ExecutorDead", "--webhook", "http://127.0.0.1:9/hook", "--org",
            "acme", "--url", f"http://127.0.0.1:{server.server_address[1]}", "--key", "relay_key-5b8e",
            "--secret-stdin"]  # fmt: skip
    first = threading.Thread(target=lambda: codes.append(main(args)))
    try:
        capsys.readouterr()
        first.start()
        assert HeldEcho.arrived.wait(20), "the first command's request never came"
        assert main(["--version"]) == 0  # another command, while the first waits for its answer
        HeldEcho.release.set()
        first.join(20)
    finally:
        HeldEcho.release.set()
        server.shutdown()
        server.server_close()
    printed = capsys.readouterr().err
    assert codes == [2] and "refused" in printed and printed.count("\n") == 1, (codes, printed)
    assert secret not in printed, printed


# Runs ``python -m relay ARGS`` as it is run, with an importer that holds the import of httpx (which
# the CLI makes as it starts) until the process is interrupted; it says so on stdout first.
_HELD_AT_START = """
import importlib.abc, runpy, sys, time
class Held(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "httpx":
            print("importing httpx", flush=True)
            time.sleep(60)
        return None
sys.meta_path.insert(0, Held())
runpy.run_module("relay", run_name="__main__", alter_sys=True)
"""


def _interrupted(command: list[str], held: Callable[[subprocess.Popen[str]], None], **kwargs: Any) -> tuple[int, str]:
    """Run ``command``, wait with ``held`` until it is blocked, Ctrl-C it (SIGINT); its exit code and stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env["RELAY_API_KEY"] = "relay_key-3f7a"
    then = kwargs.pop("preexec_fn", None)

    def as_at_a_terminal() -> None:
        # A shell runs a command at its terminal with SIGINT's default action. This test's process may
        # have it ignored (a background job of a non-interactive shell, as CI's runner may start it),
        # which a child inherits, and a process that inherits it ignores Ctrl-C, as it should.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if then is not None:
            then()

    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=as_at_a_terminal,
        **kwargs,
    ) as proc:  # fmt: skip
        try:
            held(proc)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=20)
        finally:
            end(proc)
    return proc.returncode, err


def test_ctrl_c_is_one_line_and_exit_130_never_a_traceback() -> None:
    """Ctrl-C during a command was click's Abort: a blank line, ``relay: aborted`` and exit 1, which
    a script could not tell from a failure; during the CLI's start (its imports), Python's traceback.
    Now ``relay: interrupted`` and exit 130, as a shell reports a command Ctrl-C ended."""
    # Blocked on a request to a server that does not answer: the connection is accepted, never answered.
    silent = socket.create_server(("127.0.0.1", 0))
    relay = [sys.executable, "-m", "relay"]

    def requested(proc: subprocess.Popen[str]) -> None:
        silent.settimeout(20)
        conn, _ = silent.accept()
        conn.settimeout(20)
        assert conn.recv(4096).startswith(b"GET /v2/whoami"), "no request came"
        held.append(conn)

    held: list[socket.socket] = []
    try:
        code, err = _interrupted([*relay, "apps", "--url", f"http://127.0.0.1:{silent.getsockname()[1]}"], requested)
    finally:
        silent.close()
        for conn in held:
            conn.close()
    assert (code, err) == (130, "relay: interrupted\n"), (code, err)

    # Blocked as it starts, importing.
    def importing(proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None and proc.stdout.readline() == "importing httpx\n"

    code, err = _interrupted([sys.executable, "-c", _HELD_AT_START, "apps"], importing)
    assert (code, err) == (130, "relay: interrupted\n"), (code, err)

    # Blocked at the --secret-stdin question, at a terminal: the terminal is left echoing.
    leader, follower = pty.openpty()

    def asked(proc: subprocess.Popen[str]) -> None:
        shown = b""
        while not shown.endswith(b"Webhook secret: "):
            assert select.select([leader], [], [], 20)[0], shown
            shown += os.read(leader, 1024)

    def terminal() -> None:  # getpass asks on the process's terminal (/dev/tty)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        code, err = _interrupted(
            [*relay, "alerts", "create", "ledger", "--kind", "ExecutorDead", "--webhook", "http://127.0.0.1:9/h",
             "--secret-stdin"], asked, stdin=follower, start_new_session=True, preexec_fn=terminal)  # fmt: skip
        assert termios.tcgetattr(follower)[3] & termios.ECHO, "the terminal was left without echo"
    finally:
        os.close(leader)
        os.close(follower)
    # click.prompt ends the question's line (getpass leaves it open); no other line.
    assert code == 130 and err.strip() == "relay: interrupted" and "Traceback" not in err, (code, err)
