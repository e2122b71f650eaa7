"""The ``relay`` operator commands against a real Relay with real DBOS 3.2 executors
(harness/workflow_app.py): their tables, their ``--json`` (the API's JSON, compared with what the
API answers to the same request), their exit codes, and what they changed, read from the
executors' system database.

The commands run in this process, through the command line's own entry point
(:func:`relay.cli.main`, with RELAY_URL and RELAY_API_KEY in the environment as an operator
sets them); starting a Python for each of some seventy commands would cost half a minute.
The exit codes and the help are checked on ``python -m relay`` itself, as a process.

One world for the module: one Relay, one executor of ``ledger`` that seeded the fixtures. The
tests that change things make workflows of their own (forks) or executors of their own.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import importlib
import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import termios
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, LiteralString

import httpx
import psycopg
import pytest
from websockets.sync.client import connect

from harness.executors import ExecutorProcess
from harness.keys import API_KEYS, CONDUCTOR_KEYS, VIEWER_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.receiver import WebhookReceiver
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer, info_reply
from harness.waiting import assert_eventually
from relay.cli import main, operate, output
from relay.cli.client import Api
from relay.cli.errors import EXIT_DENIED, EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from relay.cli.output import cell as table_cell
from relay.core.alerts import SECRET_RULE

APP_MODULE = "harness.workflow_app"
# The module (relay.cli.workflows, as an attribute, is its click group).
workflow_commands = importlib.import_module("relay.cli.workflows")


@dataclass
class World:
    workdir: Path
    sysdb: str
    relay: RelayProcess
    seeder: ExecutorProcess

    def api(self, key: str | None = None) -> httpx.Client:
        return self.relay.api("acme", key)


@pytest.fixture(scope="module")
def world(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("cli")
    sysdb = postgres.create_database("sys")
    # Pings spaced so that a loaded machine's executor is not dropped for a late pong (not tested here).
    config = relay_yaml(free_port(), pingIntervalSecs=1.0, pingWaitSecs=10.0)
    # For `relay alerts`: webhooks to this host may be made, and one rule of relay.yaml (read-only),
    # of a kind that never fires with one instance.
    config["alerts"] = {"allowedDestinations": ["127.0.0.1"]}
    config["orgs"][0]["apps"][0]["alerts"] = [{"kind": "InstanceAdopted"}]
    relay = RelayProcess(workdir, postgres.create_database("relay"), config)
    seeder: ExecutorProcess | None = None
    try:
        relay.start()
        seeder = ExecutorProcess(workdir, sysdb, relay.conductor_url, module=APP_MODULE, env={"RELAY_TEST_SEED": "1"})
        executor_id = seeder.executor_id
        assert_eventually(lambda: relay.state_of("acme", "ledger", executor_id) == "HEALTHY", 10)
        # Hold the database still: the queued jobs finish, the hourly schedule is paused.
        assert_eventually(lambda: not query(sysdb, "SELECT 1 FROM dbos.workflow_status WHERE status = 'ENQUEUED'"), 20)
        with psycopg.connect(sysdb) as conn:
            conn.execute("UPDATE dbos.workflow_schedules SET status = 'PAUSED'")
        yield World(workdir, sysdb, relay, seeder)
    finally:
        if seeder is not None:
            seeder.stop()
        relay.stop()


@pytest.fixture(autouse=True)
def logs_on_failure(request: pytest.FixtureRequest, world: World) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(f"--- relay log ---\n{world.relay.log()[-6000:]}")


def query(url: str, sql: LiteralString, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return list(conn.execute(sql, params).fetchall())


def db_status(world: World, workflow_id: str) -> str | None:
    rows = query(world.sysdb, "SELECT status FROM dbos.workflow_status WHERE workflow_uuid = %s", workflow_id)
    return str(rows[0][0]) if rows else None


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def table(self) -> list[dict[str, str]]:
        return table_rows(self.out)


Cli = Callable[..., Run]


def check(run: Run) -> Run:
    if run.code != 0:
        # An error is one line, from the API's problem details when there was one.
        assert run.err.startswith("relay: ") or run.err.startswith("Usage:"), run.err
    return run


@pytest.fixture
def cli(world: World, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    """``relay ARGS`` through its entry point, in this process."""

    def run(
        *args: str, key: str | None = API_KEYS["acme"], url: str | None = None, env: dict[str, str] | None = None
    ) -> Run:
        for name in [k for k in os.environ if k.startswith("RELAY_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("RELAY_URL", url or world.relay.http)
        if key is not None:
            monkeypatch.setenv("RELAY_API_KEY", key)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return check(Run(code, out, err))

    return run


def relay_process(
    world: World, *args: str, key: str | None = API_KEYS["acme"], url: str | None = None, stdin: str = ""
) -> Run:
    """``python -m relay ARGS``, a process of its own, ``stdin`` piped in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env["RELAY_URL"] = url or world.relay.http
    if key is not None:
        env["RELAY_API_KEY"] = key
    done = subprocess.run([sys.executable, "-m", "relay", *args], capture_output=True, text=True, env=env, timeout=60,
                          input=stdin)  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return check(Run(done.returncode, done.stdout, done.stderr))


def ok(run: Run) -> Run:
    assert run.code == EXIT_OK, f"exit {run.code}: {run.err}"
    return run


def table_rows(text: str) -> list[dict[str, str]]:
    """A table's rows as dicts, cut at the header's column starts: a cell out of line breaks this."""
    header, *lines = text.rstrip("\n").split("\n")
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", header)]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    rows = []
    for line in lines:
        cells = [line[a:b] for a, b in zip(starts, [*starts[1:], None], strict=True)]
        for cell, start in zip(cells[1:], starts[1:], strict=True):
            assert line[start - 2 : start] == "  ", f"column out of line at {start}: {line!r}"
            assert not cell.startswith(" ") or not cell.strip(), f"column out of line at {start}: {line!r}"
        rows.append(dict(zip(names, (c.strip() for c in cells), strict=True)))
    return rows


def api_json(world: World, method: str, path: str, **kwargs: Any) -> Any:
    with world.api() as api:
        resp = api.request(method, path, **kwargs)
    resp.raise_for_status()
    return resp.json()


# -- reading -----------------------------------------------------------------------------------


def test_whoami_and_apps_as_tables_and_as_the_apis_json(world: World, cli: Cli) -> None:
    me = ok(cli("whoami"))
    assert "org:         acme" in me.out and "key:         ops" in me.out
    assert ok(cli("whoami", "--json")).json() == api_json(world, "GET", "/whoami")
    # --url and --key given as options: they win over RELAY_URL (here nobody listens) and need no RELAY_API_KEY.
    nowhere = f"http://127.0.0.1:{free_port()}"
    flags = ok(cli("whoami", "--json", "--url", world.relay.http, "--key", API_KEYS["acme"], key=None, url=nowhere))
    assert flags.json()["org"] == "acme"
    # A base URL ending in /conductor, as for DBOS's managed Conductor, works as well.
    assert ok(cli("whoami", "--json", url=f"{world.relay.http}/conductor/")).json()["org"] == "acme"
    # And with /v2 too, the base Conductor's own clients are given (it was a 404).
    assert ok(cli("whoami", "--json", url=f"{world.relay.http}/conductor/v2")).json()["org"] == "acme"

    (row,) = ok(cli("apps")).table()
    assert row["APP"] == "ledger" and row["STATUS"] == "AVAILABLE" and row["HEALTHY"] == "1"
    assert row["GRACE"] == "30s" and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row["CREATED"])
    assert ok(cli("apps", "--json")).json() == api_json(world, "GET", "/apps")
    # --org names it; another org's is refused.
    assert ok(cli("apps", "--org", "acme", "--json")).json() == api_json(world, "GET", "/apps")
    assert cli("apps", "--org", "globex").code == EXIT_DENIED


def test_executors_with_and_without_a_state(world: World, cli: Cli) -> None:
    (row,) = ok(cli("executors", "ledger")).table()
    assert (row["EXECUTOR"], row["STATE"], row["VERSION"], row["INSTANCE"]) == (
        world.seeder.executor_id, "HEALTHY", "v1", "relay-1")  # fmt: skip
    assert re.fullmatch(r"\d+(s|m|h\d+m)", row["SINCE"]) and row["BLOCKED"] == "-"
    assert ok(cli("executors", "ledger", "--json")).json() == api_json(world, "GET", "/apps/ledger/executors")
    dead = ok(cli("executors", "ledger", "--state", "dead"))
    assert dead.out == "" and "no executors in state DEAD in acme/ledger" in dead.err
    assert ok(cli("executors", "ledger", "--state", "DEAD", "--json")).json() == []


def test_exit_codes_scripts_can_rely_on(world: World) -> None:
    unknown_app = relay_process(world, "executors", "no-such-app")
    assert (
        unknown_app.code == EXIT_NOT_FOUND
        and unknown_app.err == "relay: 404 Not Found: no app 'no-such-app' in org 'acme'\n"
    )
    assert relay_process(world, "workflows", "get", "ledger", "no-such-workflow").code == EXIT_NOT_FOUND
    bad_key = relay_process(world, "apps", key="not-a-key")
    assert bad_key.code == EXIT_DENIED and "401 Unauthorized" in bad_key.err
    viewer = relay_process(world, "workflows", "cancel", "ledger", "waiting-1", key=VIEWER_KEYS["acme"])
    assert viewer.code == EXIT_DENIED and "403 Forbidden" in viewer.err and "application.write" in viewer.err
    no_key = relay_process(world, "apps", key=None)
    assert no_key.code == EXIT_USAGE and "no API key" in no_key.err
    unreachable = relay_process(world, "apps", url=f"http://127.0.0.1:{free_port()}")
    assert unreachable.code == EXIT_UNAVAILABLE and "cannot reach Relay" in unreachable.err
    # An app Relay knows, none of whose executors is connected: try again later. One it does not
    # know (a typo) is not found, like its executors.
    with world.relay.api() as api:
        assert api.put("/apps/nobody-home").status_code in (201, 204)
    no_executor = relay_process(world, "workflows", "list", "nobody-home")
    assert no_executor.code == EXIT_UNAVAILABLE and "503" in no_executor.err
    assert "(none has connected)" in no_executor.err
    typo = relay_process(world, "workflows", "list", "nobody-hom")
    assert typo.code == EXIT_NOT_FOUND and typo.err == "relay: 404 Not Found: no app 'nobody-hom' in org 'acme'\n"
    healthy = relay_process(world, "recover", "ledger", world.seeder.executor_id)
    assert healthy.code == EXIT_ERROR and "409 Conflict" in healthy.err
    assert relay_process(world, "audit", "--since", "last tuesday").code == EXIT_USAGE
    assert relay_process(world, "executors", "ledger", "--state", "ASLEEP").code == EXIT_USAGE
    assert relay_process(world, "no-such-command").code == EXIT_USAGE


def test_a_key_with_spaces_or_a_line_end_is_used_and_a_bad_key_is_never_printed(world: World, cli: Cli) -> None:
    """A key read from a file edited on Windows ends in \\r, one pasted may carry spaces: httpx refused
    the header, and the line was "cannot reach Relay ... b'Bearer <the key>\\r'", exit 5 (try again)."""
    secret = API_KEYS["acme"]
    with_cr = relay_process(world, "whoami", "--json", key=secret + "\r")
    assert with_cr.code == EXIT_OK and with_cr.json()["org"] == "acme", with_cr.err
    for key in (f" {secret} ", secret + "\r\n", f"\t{secret}"):
        assert ok(cli("whoami", "--json", key=key)).json()["org"] == "acme"
    assert ok(cli("whoami", "--json", "--key", secret + "\r", key=None)).json()["org"] == "acme"
    # A character no key has: refused before any request (exit 2), and the key is not in the line.
    for key in ("kéy-" + secret, secret[:12] + "\x01" + secret[12:], secret + "\x1b]0;x\x07", "a\rb" + secret):
        refused = cli("apps", key=key)
        assert refused.code == EXIT_USAGE and "not printable ASCII" in refused.err, refused.err
        assert secret not in refused.err and secret[12:] not in refused.err, refused.err


def test_help_lists_every_command() -> None:
    done = subprocess.run([sys.executable, "-m", "relay", "--help"], capture_output=True, text=True, timeout=30)
    for command in ("serve", "init", "keys", "whoami", "apps", "executors", "recover", "recoveries", "audit",
                    "instances", "workflows", "tokens", "alerts"):  # fmt: skip
        assert re.search(rf"^\s+{command}\s", done.stdout, re.M), command
    done = subprocess.run([sys.executable, "-m", "relay", "workflows", "--help"], capture_output=True, text=True)
    for command in ("list", "get", "steps", "cancel", "resume", "fork"):
        assert re.search(rf"^\s+{command}\s", done.stdout, re.M), command


# -- workflows ---------------------------------------------------------------------------------


def db_ids(world: World, where: LiteralString = "TRUE", *params: Any) -> list[str]:
    sql: LiteralString = "SELECT workflow_uuid FROM dbos.workflow_status WHERE " + where + " ORDER BY created_at"
    return [str(r[0]) for r in query(world.sysdb, sql, *params)]


@pytest.mark.parametrize(
    ("options", "where", "params"),
    [
        ((), "TRUE", ()),
        (("--status", "error"), "status = 'ERROR'", ()),
        (("--status", "SUCCESS", "--status", "PENDING"), "status IN ('SUCCESS', 'PENDING')", ()),
        (("--name", "parent"), "name = 'parent'", ()),
        (("--queue", "serial"), "queue_name = 'serial'", ()),
        (("--version", "v1"), "application_version = 'v1'", ()),
        (("--prefix", "odd"), "workflow_uuid LIKE 'odd%%'", ()),
        (("--since", "1h"), "created_at >= (extract(epoch from now() - interval '1 hour') * 1000)", ()),
        (("--until", "2000-01-01T00:00:00Z"), "FALSE", ()),
    ],
)
def test_workflows_list_filters_as_the_system_database_has_them(
    world: World, cli: Cli, options: tuple[str, ...], where: LiteralString, params: tuple[Any, ...]
) -> None:
    expected = db_ids(world, where + " AND NOT workflow_uuid LIKE 'cli-%%'", *params)
    got = ok(cli("workflows", "list", "ledger", *options, "--limit", "1000", "--json")).json()
    assert [w["workflowId"] for w in got if not w["workflowId"].startswith("cli-")] == expected


def test_workflows_list_as_a_table_paged_and_by_executor(world: World, cli: Cli) -> None:
    rows = ok(cli("workflows", "list", "ledger", "--status", "ERROR")).table()
    assert [(r["WORKFLOW"], r["STATUS"], r["NAME"], r["VERSION"]) for r in rows] == [
        ("failed-1", "ERROR", "failing", "v1")
    ]
    assert rows[0]["EXECUTOR"] == world.seeder.executor_id and rows[0]["QUEUE"] == "-"
    everything = db_ids(world)
    page = ok(cli("workflows", "list", "ledger", "--limit", "2", "--offset", "1"))
    assert [r["WORKFLOW"] for r in page.table()] == everything[1:3]
    assert "more with --offset 3" in page.err
    newest = ok(cli("workflows", "list", "ledger", "--desc", "--limit", "1", "--json")).json()
    assert newest[0]["workflowId"] == db_ids(world)[-1]
    mine = ok(cli("workflows", "list", "ledger", "--executor", world.seeder.executor_id, "--json")).json()
    assert {w["workflowId"] for w in mine} >= {"done-1", "failed-1"}
    body = {"status": ["ERROR"], "limit": 100, "offset": 0, "sortDesc": False}
    assert ok(cli("workflows", "list", "ledger", "--status", "ERROR", "--json")).json() == api_json(
        world, "POST", "/apps/ledger/workflows/search", json=body
    )


def test_workflows_get_and_steps(world: World, cli: Cli) -> None:
    lines = ok(cli("workflows", "get", "ledger", "done-1")).out
    assert re.search(r"^status:\s+SUCCESS$", lines, re.M) and re.search(r"^name:\s+parent$", lines, re.M)
    assert re.search(r"^output:\s+\S", lines, re.M) and re.search(r"^error:\s+-$", lines, re.M)
    assert ok(cli("workflows", "get", "ledger", "done-1", "--json")).json() == api_json(
        world, "GET", "/apps/ledger/workflows/done-1"
    )
    no_data = ok(cli("workflows", "get", "ledger", "done-1", "--no-data", "--json")).json()
    assert no_data["input"] is None and no_data["output"] is None
    # Ids with /, ? and # go into the path percent-encoded.
    assert ok(cli("workflows", "get", "ledger", "odd?x=1", "--json")).json()["workflowId"] == "odd?x=1"

    rows = ok(cli("workflows", "steps", "ledger", "done-1")).table()
    db_steps = query(world.sysdb, "SELECT function_id, function_name, child_workflow_id FROM dbos.operation_outputs "
                     "WHERE workflow_uuid = 'done-1' ORDER BY function_id")  # fmt: skip
    assert [(int(r["STEP"]), r["NAME"]) for r in rows] == [(s[0], s[1]) for s in db_steps]
    assert any(r["CHILD"] == "done-1-child" for r in rows) and rows[0]["OUTCOME"] == "SUCCESS"
    assert ok(cli("workflows", "steps", "ledger", "done-1", "--json")).json() == api_json(
        world, "GET", "/apps/ledger/workflows/done-1/steps"
    )
    assert ok(cli("workflows", "steps", "ledger", "odd/steps", "--json")).json()[0]["stepName"].endswith("shout")


def test_tables_show_control_characters_escaped_and_json_keeps_them(world: World, cli: Cli) -> None:
    """A workflow's name, error or output (an exception's message may quote a caller's input) is the
    executor's data: OSC sequences in it set the terminal's title or write its clipboard (OSC 52), an
    8-bit CSI (0x9b) clears the screen. Tables and the key/value lines show them escaped."""
    evil = "boom\x1b]0;pwned\x07\x1b]52;c;ZWNobyBwd25lZA==\x07 \x9b2J\x7fend"
    shown = r"boom\x1b]0;pwned\x07\x1b]52;c;ZWNobyBwd25lZA==\x07 \x9b2J\x7fend"
    with psycopg.connect(world.sysdb) as conn:
        # A cancelled workflow as an executor records it, out of the other tests' selections.
        conn.execute(
            "INSERT INTO dbos.workflow_status (workflow_uuid, status, name, created_at, updated_at, executor_id,"
            " application_version, application_id) SELECT 'esc-1', 'CANCELLED', %s, now_ms, now_ms, executor_id,"
            " 'v1', '' FROM dbos.workflow_status, (SELECT (extract(epoch from now()) * 1000)::bigint AS now_ms) t"
            " WHERE workflow_uuid = 'done-1' ON CONFLICT DO NOTHING",
            (evil,),
        )
    got = ok(cli("workflows", "get", "ledger", "esc-1")).out
    assert f"\nname:        {shown}\n" in got, got
    (row,) = ok(cli("workflows", "list", "ledger", "--prefix", "esc-")).table()
    assert row["NAME"] == shown
    # --json: the same values, exact; no control character written raw either (DEL and C1 escaped too).
    raw = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
    one = ok(cli("workflows", "get", "ledger", "esc-1", "--json")).out
    assert not raw.search(one) and json.loads(one) == api_json(world, "GET", "/apps/ledger/workflows/esc-1")
    listed = ok(cli("workflows", "list", "ledger", "--prefix", "esc-", "--json")).out
    assert not raw.search(listed) and [w["workflowName"] for w in json.loads(listed)] == [evil]
    # A JSON value in a cell (an audit entry's detail), and a NUL.
    assert table_cell({"detail": "\x1b]0;x\x07\x9b"}) == r'{"detail":"\u001b]0;x\u0007\x9b"}'
    assert table_cell("a\x00b\x85c\td") == r"a\x00b c d"


def test_tables_and_json_show_bidirectional_controls_escaped(world: World, cli: Cli) -> None:
    """An override or an isolate (U+202E, U+2066...) in a workflow's name (or its error) makes a terminal
    show the text after it reordered (Trojan Source): ``ok\u202egnp.exe`` reads as ``okexe.png``.
    Tables, the key/value lines and ``--json`` show them escaped, the values unchanged."""
    bidi = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
    evil = f"ok\u202egnp.exe{bidi}end"
    shown = r"ok\u202egnp.exe\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069end"
    with psycopg.connect(world.sysdb) as conn:
        conn.execute(
            "INSERT INTO dbos.workflow_status (workflow_uuid, status, name, created_at, updated_at,"
            " executor_id, application_version, application_id) SELECT 'bidi-1', 'CANCELLED', %s, now_ms,"
            " now_ms, executor_id, 'v1', '' FROM dbos.workflow_status,"
            " (SELECT (extract(epoch from now()) * 1000)::bigint AS now_ms) t"
            " WHERE workflow_uuid = 'done-1' ON CONFLICT DO NOTHING",
            (evil,),
        )
    (row,) = ok(cli("workflows", "list", "ledger", "--prefix", "bidi-")).table()
    assert row["NAME"] == shown
    got = ok(cli("workflows", "get", "ledger", "bidi-1")).out
    assert f"\nname:        {shown}\n" in got, got
    raw = re.compile(f"[{bidi}]")
    listed = ok(cli("workflows", "list", "ledger", "--prefix", "bidi-", "--json")).out
    assert not raw.search(listed) and r"ok\u202egnp.exe" in listed
    assert [w["workflowName"] for w in json.loads(listed)] == [evil]


def test_fork_cancel_and_resume_one_many_and_by_filter(world: World, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    # Forks of the waiting workflow from its first step wait too: PENDING workflows of our own.
    forked = ok(cli("workflows", "fork", "ledger", "waiting-1", "--from-step", "1", "--new-id", "cli-a"))
    assert forked.out.strip() == "forked waiting-1 from step 1: cli-a"
    made = ok(cli("workflows", "fork", "ledger", "waiting-1", "--new-id", "cli-b", "--json")).json()
    assert made == {"workflowId": "cli-b"}
    for workflow_id in ("cli-a", "cli-b"):
        assert_eventually(lambda: db_status(world, workflow_id) == "PENDING", 20, what=f"{workflow_id} PENDING")  # noqa: B023
    assert query(world.sysdb, "SELECT forked_from FROM dbos.workflow_status WHERE workflow_uuid = 'cli-a'") == [
        ("waiting-1",)
    ]

    # Several ids, one per bulk request: the progress bar's label on stderr.
    cancelled = ok(cli("workflows", "cancel", "ledger", "cli-a", "cli-b", "--batch-size", "1"))
    assert cancelled.out == "cancelled 2 workflows:\n  cli-a\n  cli-b\n" and "cancel 2 workflows" in cancelled.err
    assert [db_status(world, w) for w in ("cli-a", "cli-b")] == ["CANCELLED", "CANCELLED"]

    # By filter: refused without --yes when nobody can be asked; then done, all of the matches.
    filters = ("--prefix", "cli-", "--status", "CANCELLED")
    refused = cli("workflows", "resume", "ledger", *filters)
    assert refused.code == EXIT_USAGE and "select 2 workflows; give --yes" in refused.err
    assert db_status(world, "cli-a") == "CANCELLED"
    # Read a page at a time (one workflow a page here), with the count so far on stderr.
    monkeypatch.setattr(workflow_commands, "SEARCH_PAGE", 1)
    resumed_run = ok(cli("workflows", "resume", "ledger", *filters, "--yes", "--json"))
    assert resumed_run.json() == {"action": "resume", "workflowIds": ["cli-a", "cli-b"]}
    assert "selecting the workflows to resume: 1 so far\n" in resumed_run.err
    assert "selecting the workflows to resume: 2 so far\n" in resumed_run.err
    for workflow_id in ("cli-a", "cli-b"):
        assert_eventually(lambda: db_status(world, workflow_id) == "PENDING", 20, what=f"{workflow_id} resumed")  # noqa: B023
    nothing = ok(cli("workflows", "resume", "ledger", "--prefix", "no-such-", "--yes"))
    assert nothing.out == "" and "nothing to do" in nothing.err

    # One id goes through the single route, audited as such.
    assert ok(cli("workflows", "cancel", "ledger", "cli-b")).out == "cancelled 1 workflow:\n  cli-b\n"
    assert db_status(world, "cli-b") == "CANCELLED"
    entries = api_json(world, "GET", "/audit", params={"app": "ledger"})
    actions = [(e["action"], e["detail"]["workflowIds"]) for e in entries if e["action"].startswith("workflow.")]
    assert ("workflow.cancel", ["cli-b"]) in actions and ("workflow.bulk_cancel", ["cli-a"]) in actions
    assert ("workflow.bulk_resume", ["cli-a", "cli-b"]) in actions and ("workflow.fork", ["waiting-1"]) in actions
    ok(cli("workflows", "cancel", "ledger", "cli-a"))
    assert cli("workflows", "cancel", "ledger").code == EXIT_USAGE  # neither ids nor filters


def test_a_selection_by_filter_loses_no_workflow_that_changes_while_it_is_read(
    world: World, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four PENDING workflows, read two a page; the first finishes once the first page is read.
    Paged by offset, the second page (offset 2 of the three still PENDING) would start past the
    third, which is never cancelled. Each page starts at the last one's creation time instead."""
    ids = [f"sel-{n}" for n in range(1, 5)]
    with psycopg.connect(world.sysdb) as conn:
        for n, workflow_id in enumerate(ids):
            conn.execute(
                "INSERT INTO dbos.workflow_status (workflow_uuid, status, name, created_at, updated_at,"
                " executor_id, application_version, application_id) SELECT %s, 'PENDING', 'parent', now_ms + %s,"
                " now_ms, executor_id, 'v1', '' FROM dbos.workflow_status,"
                " (SELECT (extract(epoch from now()) * 1000)::bigint AS now_ms) t WHERE workflow_uuid = 'done-1'",
                (workflow_id, n),
            )
    monkeypatch.setattr(workflow_commands, "SEARCH_PAGE", 2)
    searches: list[Any] = []
    real_call = Api.call

    def call(api: Api, method: str, path: str, **kwargs: Any) -> Any:
        answer = real_call(api, method, path, **kwargs)
        if path.endswith("/workflows/search"):
            searches.append(kwargs["body"])
            if len(searches) == 1:  # sel-1 finishes while the selection is being read
                query(world.sysdb, "UPDATE dbos.workflow_status SET status = 'SUCCESS' WHERE workflow_uuid = 'sel-1'"
                      " RETURNING 1")  # fmt: skip
        return answer

    monkeypatch.setattr(Api, "call", call)
    done = ok(cli("workflows", "cancel", "ledger", "--prefix", "sel-", "--status", "PENDING", "--yes", "--json"))
    assert done.json() == {"action": "cancel", "workflowIds": ids}
    assert [db_status(world, w) for w in ids] == ["SUCCESS", "CANCELLED", "CANCELLED", "CANCELLED"]
    assert len(searches) > 1 and "selecting the workflows to cancel: 2 so far" in done.err


# -- recovery and the audit log ------------------------------------------------------------------


def disconnected_victim(world: World) -> ExecutorProcess:
    """A new executor of the app, killed: DISCONNECTED, in its grace period."""
    victim = ExecutorProcess(world.workdir, world.sysdb, world.relay.conductor_url, module=APP_MODULE)
    try:
        assert_eventually(lambda: world.relay.state_of("acme", "ledger", victim.executor_id) == "HEALTHY", 10)
        victim.kill()
        assert_eventually(lambda: world.relay.state_of("acme", "ledger", victim.executor_id) == "DISCONNECTED", 10)
    finally:
        victim.stop()
    return victim


def test_recover_then_recoveries_and_the_audit_log(world: World, cli: Cli) -> None:
    victim = disconnected_victim(world)
    (row,) = ok(cli("executors", "ledger", "--state", "DISCONNECTED")).table()
    assert row["EXECUTOR"] == victim.executor_id

    started = ok(cli("recover", "ledger", victim.executor_id, "--to-latest"))
    rid = re.fullmatch(r"recovery (\S+) started; follow it with: relay recoveries ledger \1\n", started.out)
    assert rid, started.out
    recovery_id = rid.group(1)

    def succeeded() -> bool:
        return bool(api_json(world, "GET", f"/apps/ledger/recoveries/{recovery_id}")["status"] == "succeeded")

    assert_eventually(succeeded, 30, what="the recovery succeeded")
    (listed,) = [r for r in ok(cli("recoveries", "ledger")).table() if r["RECOVERY"] == recovery_id]
    assert (listed["EXECUTOR"], listed["TRIGGER"], listed["STATUS"]) == (victim.executor_id, "operator", "succeeded")
    assert (listed["LAST PEER"], listed["OUTCOME"]) == (world.seeder.executor_id, "succeeded")
    assert ok(cli("recoveries", "ledger", "--json")).json() == api_json(world, "GET", "/apps/ledger/recoveries")
    one = ok(cli("recoveries", "ledger", recovery_id)).out
    assert re.search(r"^status:\s+succeeded$", one, re.M) and "\nattempts:\n" in one
    assert re.search(r"^language:\s+python$", one, re.M), one  # kept as the run opened, its record gone
    (attempt,) = table_rows(one.split("\nattempts:\n")[1])
    assert (attempt["PEER"], attempt["OUTCOME"]) == (world.seeder.executor_id, "succeeded")
    assert ok(cli("recoveries", "ledger", recovery_id, "--json")).json() == api_json(
        world, "GET", f"/apps/ledger/recoveries/{recovery_id}"
    )
    assert cli("recoveries", "ledger", "no-such-recovery").code == EXIT_NOT_FOUND

    rows = ok(cli("audit", "--app", "ledger", "--executor", victim.executor_id)).table()
    actions = [r["ACTION"] for r in rows]
    assert "recovery.manual_requested" in actions and "recovery.succeeded" in actions
    assert all(r["APP"] == "ledger" and r["EXECUTOR"] == victim.executor_id for r in rows)
    params = {"app": "ledger", "executorId": victim.executor_id}
    assert ok(cli("audit", "--app", "ledger", "--executor", victim.executor_id, "--json")).json() == api_json(
        world, "GET", "/audit", params=params
    )
    assert ok(cli("audit", "--since", "2000-01-01", "--limit", "1", "--json")).json() == api_json(
        world, "GET", "/audit", params={"limit": 1}
    )
    future = ok(cli("audit", "--since", "2999-01-01T00:00:00Z"))
    assert future.out == "" and "no audit entries" in future.err


def test_the_command_recover_says_to_follow_with_reads_back_as_the_recovery_id(world: World, cli: Cli) -> None:
    """``relay recover`` ends with the command that follows the recovery, to copy into a shell. It wrote
    the recovery id as a table cell: U+202E in the executor's id (and so in the recovery's) as the
    characters ``\\u202e``, its spaces and quotes as they were, so that the command named another
    recovery or none. Its words are quoted as bash reads them back now. (The SDKs name executors by
    UUID; the protocol takes any id, as this handshake's.)"""
    executor_id = "cut\u202e it's $HOME"
    url = f"ws://127.0.0.1:{world.relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with connect(url, open_timeout=10) as ws:
        request = json.loads(ws.recv(timeout=10))
        ws.send(info_reply(request["request_id"], executor_id))
        assert_eventually(lambda: world.relay.state_of("acme", "ledger", executor_id) == "HEALTHY", 10)
    assert_eventually(lambda: world.relay.state_of("acme", "ledger", executor_id) == "DISCONNECTED", 10)
    started = ok(cli("recover", "ledger", executor_id))
    assert "\u202e" not in started.out, started.out  # nothing raw for the terminal
    _, command = started.out.rstrip("\n").split("; follow it with: ")
    (recovery,) = api_json(world, "GET", "/apps/ledger/recoveries", params={"executorId": executor_id})
    read = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, text=True, check=True)
    assert read.stdout.split("\0")[:-1] == ["relay", "recoveries", "ledger", recovery["recoveryId"]], command


@pytest.mark.parametrize("app", ["-x", "--help", "-", "it's -x", "ledger"])
def test_a_command_to_copy_reads_back_as_its_arguments_when_one_starts_with_a_dash(app: str) -> None:
    """An app may be named ``-x`` (an executor's first connection registers any printable name): the
    command ``relay recover`` says to follow with, ``relay recoveries -x <id>``, was read by click as
    an unknown option. ``--`` comes before such arguments now, as the console's commands have it."""
    rid = f"recovery:acme/{app}:e-1:1"
    command = output.shell_command("relay recoveries", [app, rid], ["--desc"])
    read = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, text=True, check=True)
    words = read.stdout.split("\0")[:-1]
    assert words[:2] == ["relay", "recoveries"] and ("--" in words) == app.startswith("-"), words
    params = operate.recoveries.make_context("recoveries", words[2:]).params
    assert (params["app"], params["recovery_id"], params["desc"]) == (app, rid, True)


def test_the_audit_tables_detail_is_cut_and_its_help_says_json_has_it_whole(world: World, cli: Cli) -> None:
    """An entry's detail longer than the table's DETAIL column (a settings change: before and after)
    is cut there; ``--help`` says so, and ``--json`` has it whole."""
    timeout = api_json(world, "GET", "/apps/ledger")["gracePeriodSecs"]
    api_json(world, "PATCH", "/apps/ledger", json={"executorTimeoutSecs": timeout})  # as it is: an entry
    args = ("audit", "--app", "ledger", "--action", "settings.updated", "--desc", "--limit", "1")
    (row,) = ok(cli(*args)).table()
    (entry,) = ok(cli(*args, "--json")).json()
    whole = json.dumps(entry["detail"], separators=(",", ":"))
    assert len(whole) > 80 and len(row["DETAIL"]) == 80, row
    assert row["DETAIL"] == whole[:79] + "…"
    helped = " ".join(ok(cli("audit", "--help")).out.split())
    assert "The DETAIL column is cut at 80 characters (ending in …); --json prints each entry's detail whole" in helped


def test_a_manual_recovery_is_readable_as_soon_as_its_id_is_answered(world: World) -> None:
    """The id that POST .../recover answers (202) reads as a recovery at once, even while its
    workflow is slow to write the record: here a lock holds the record's insert for 1.5 s. (Before,
    the answer came first, and a client that followed it at once could get 404; seen in CI.)"""
    victim = disconnected_victim(world)
    with psycopg.connect(world.relay.database_url) as lock:
        lock.execute("LOCK TABLE recoveries IN SHARE MODE")  # reads pass, the run's insert waits
        releaser = threading.Timer(1.5, lock.commit)
        releaser.start()
        try:
            answered = api_json(world, "POST", f"/apps/ledger/executors/{victim.executor_id}/recover")
            record = api_json(world, "GET", f"/apps/ledger/recoveries/{answered['recoveryId']}")
        finally:
            releaser.join()
    assert (record["executorId"], record["trigger"]) == (victim.executor_id, "operator")


# -- keys --------------------------------------------------------------------------------------


def test_tokens_list_create_use_and_delete(world: World, cli: Cli) -> None:
    made = ok(cli("tokens", "create", "cli-viewer", "--role", "viewer"))
    secret = re.search(r"^\s+(relay_\S+)$", made.out, re.M)
    assert secret and "shown this once" in made.out
    rows = {r["NAME"]: r for r in ok(cli("tokens", "list")).table()}
    assert (rows["cli-viewer"]["PERMISSIONS"], rows["cli-viewer"]["APPS"], rows["cli-viewer"]["SOURCE"]) == (
        "viewer", "*", "api")  # fmt: skip
    assert (rows["ops"]["PERMISSIONS"], rows["ops"]["SOURCE"]) == ("admin", "config")
    assert ok(cli("tokens", "list", "--json")).json() == api_json(world, "GET", "/tokens")

    # The new key reads, and may not change.
    assert ok(cli("apps", key=secret.group(1))).table()[0]["APP"] == "ledger"
    assert cli("tokens", "create", "x", key=secret.group(1)).code == EXIT_DENIED

    scoped = ok(cli("tokens", "create", "cli-scoped", "--permission", "application.read", "--app", "ledger",
                      "--json")).json()  # fmt: skip
    assert scoped["tokenName"] == "cli-scoped" and scoped["token"].startswith("relay_")
    listed = {t["tokenName"]: t for t in api_json(world, "GET", "/tokens")}
    assert listed["cli-scoped"]["permissions"] == ["application.read"] and listed["cli-scoped"]["appNames"] == [
        "ledger"
    ]
    assert cli("tokens", "create", "cli-scoped").code == EXIT_ERROR  # 409: the name is taken
    assert cli("tokens", "create", "y", "--role", "admin", "--permission", "token.read").code == EXIT_USAGE

    # Asked first, as the other deletes: with no terminal to ask, refused without --yes, the key kept.
    unasked = cli("tokens", "delete", "cli-viewer")
    assert unasked.code == EXIT_USAGE and "give --yes" in unasked.err, unasked.err
    assert "cli-viewer" in {t["tokenName"] for t in api_json(world, "GET", "/tokens")}
    deleted = ok(cli("tokens", "delete", "cli-viewer", "--yes"))
    assert deleted.out == "key 'cli-viewer' deleted from org 'acme'\n"
    assert_eventually(lambda: cli("apps", key=secret.group(1)).code == EXIT_DENIED, 10, what="key refused")
    assert cli("tokens", "delete", "cli-viewer", "--yes").code == EXIT_NOT_FOUND
    assert cli("tokens", "delete", "ops", "--yes").code == EXIT_ERROR  # relay.yaml's: 409
    assert ok(cli("tokens", "delete", "cli-scoped", "--yes", "--json")).json() == {
        "tokenName": "cli-scoped",
        "deleted": True,
    }


# -- apps, alerting rules, instances -----------------------------------------------------------


def at_a_terminal(world: World, answer: str, *args: str) -> Run:
    """``python -m relay ARGS`` with a terminal (a pseudo-terminal) for stdin, ``answer`` typed in it."""
    leader, follower = pty.openpty()
    try:
        os.write(leader, answer.encode())
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        env.update(RELAY_URL=world.relay.http, RELAY_API_KEY=API_KEYS["acme"])
        done = subprocess.run(
            [sys.executable, "-m", "relay", *args], stdin=follower, capture_output=True, text=True, env=env, timeout=60
        )
    finally:
        os.close(leader)
        os.close(follower)
    return Run(done.returncode, done.stdout, done.stderr)  # stderr has the question before any error


def test_apps_show_set_create_and_delete(world: World, cli: Cli) -> None:
    """An app's settings and its registration through the CLI, checked against the API's own answer."""
    made = ok(cli("apps", "create", "cli-app", "--gc-rows", "1000", "--gc-time", "7d"))
    assert made.out == "app 'cli-app' registered in org 'acme'\n"
    app = api_json(world, "GET", "/apps/cli-app")
    assert (app["gcRowsThreshold"], app["gcTimeThresholdMs"], app["globalTimeoutMs"]) == (1000, 604_800_000, None)
    assert ok(cli("apps", "create", "cli-app", "--json")).json() == {"name": "cli-app", "registered": True}

    shown = ok(cli("apps", "show", "cli-app")).out
    grace = output.seconds(app["gracePeriodSecs"])  # the server's default for an app registered so
    for line in ("app:       cli-app", "status:    UNAVAILABLE", f"grace:     {grace}", "gc time:   604800s",
                 "gc rows:   1000", "timeout:   -"):  # fmt: skip
        assert f"\n{line}\n" in f"\n{shown}", (line, shown)
    assert ok(cli("apps", "show", "cli-app", "--json")).json() == api_json(world, "GET", "/apps/cli-app")

    changed = ok(cli("apps", "set", "cli-app", "--grace", "2m", "--recover-to-latest", "--gc-time", "off",
                     "--global-timeout", "1h", "--json")).json()  # fmt: skip
    assert changed == api_json(world, "GET", "/apps/cli-app")
    assert (changed["executorTimeoutSecs"], changed["recoverToLatestVersion"]) == (120, True)
    assert (changed["gcTimeThresholdMs"], changed["gcRowsThreshold"], changed["globalTimeoutMs"]) == (
        None, 1000, 3_600_000)  # fmt: skip
    table = ok(cli("apps", "set", "cli-app", "--no-recover-to-latest", "--gc-rows", "off")).out
    assert re.search(r"^to latest: no$", table, re.M) and re.search(r"^gc rows:   -$", table, re.M), table
    assert api_json(world, "GET", "/apps/cli-app")["gcRowsThreshold"] is None
    # `relay apps` alone lists as it did, the new app among them.
    assert {r["APP"] for r in ok(cli("apps")).table()} >= {"ledger", "cli-app"}
    # A grace period with a fraction shows as set, where the API's executorTimeoutSecs (Conductor's
    # integer) has it rounded up to 3.
    table = ok(cli("apps", "set", "cli-app", "--grace", "2.5s")).out
    assert re.search(r"^grace:     2\.5s$", table, re.M), table
    assert api_json(world, "GET", "/apps/cli-app")["executorTimeoutSecs"] == 3
    assert [r["GRACE"] for r in ok(cli("apps")).table() if r["APP"] == "cli-app"] == ["2.5s"]
    assert ok(cli("apps", "set", "cli-app", "--grace", "2m")).code == 0  # as it was, for what follows

    # Refusals: nothing to change, a value the API refuses (one line, exit 2), no such app, a viewer key.
    assert cli("apps", "set", "cli-app").code == EXIT_USAGE
    bad = cli("apps", "set", "cli-app", "--grace", "0")
    assert bad.code == EXIT_USAGE and bad.err.startswith("relay: 422 ") and bad.err.count("\n") == 1, bad.err
    assert "executorTimeoutSecs" in bad.err, bad.err
    assert cli("apps", "create", "cli-app-2", "--gc-rows", "0").code == EXIT_USAGE
    assert cli("apps", "set", "cli-app", "--grace", "soon").code == EXIT_USAGE
    assert cli("apps", "show", "no-such-app").code == EXIT_NOT_FOUND
    assert cli("apps", "set", "no-such-app", "--grace", "1m").code == EXIT_NOT_FOUND
    viewer = cli("apps", "set", "cli-app", "--grace", "1m", key=VIEWER_KEYS["acme"])
    assert viewer.code == EXIT_DENIED and "403 Forbidden" in viewer.err, viewer.err
    assert api_json(world, "GET", "/apps/cli-app")["executorTimeoutSecs"] == 120

    # Delete asks first: with no terminal to ask, it is refused without --yes, and nothing is deleted.
    unasked = cli("apps", "delete", "cli-app")
    assert unasked.code == EXIT_USAGE and "give --yes" in unasked.err, unasked.err
    assert api_json(world, "GET", "/apps/cli-app")["name"] == "cli-app"
    # At a terminal it asks, and "n" deletes nothing.
    declined = at_a_terminal(world, "n\n", "apps", "delete", "cli-app")
    assert declined.code == EXIT_ERROR and "Delete app 'cli-app' of org 'acme'" in declined.err, declined.err
    assert declined.err.endswith("relay: aborted\n"), declined.err
    assert api_json(world, "GET", "/apps/cli-app")["name"] == "cli-app"
    assert cli("apps", "delete", "ledger", "--yes").code == EXIT_ERROR  # relay.yaml's: 409
    assert ok(cli("apps", "delete", "cli-app", "--yes", "--json")).json() == {"name": "cli-app", "deleted": True}
    with world.api() as api:
        assert api.get("/apps/cli-app").status_code == 404
    assert cli("apps", "delete", "cli-app", "--yes").code == EXIT_NOT_FOUND


def test_a_retention_duration_under_a_millisecond_is_refused_before_any_request(world: World, cli: Cli) -> None:
    """``--gc-time`` and ``--global-timeout`` go to the API in milliseconds: ``0.0001s`` was sent rounded
    to 0, and the API's 422 said it must be greater than 0, of a duration given positive. Refused by
    the CLI now, naming the option and the smallest it takes (exit 2), with no request made (here to a
    Relay that cannot be reached: exit 5 had it tried). A millisecond is taken, as 1."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    for command in (["apps", "set", "cli-ms"], ["apps", "create", "cli-ms"]):
        for option in ("--gc-time", "--global-timeout"):
            for value in ("0.0001s", "0.0009", "0.00001m"):
                refused = cli(*command, option, value, url=nowhere)
                assert refused.code == EXIT_USAGE and refused.out == "", refused
                said = f"relay: Invalid value for '{option}': '{value}' is less than 0.001s, the smallest it takes"
                assert refused.err.startswith(said) and refused.err.count("\n") == 1, refused.err
    made = ok(cli("apps", "create", "cli-ms", "--gc-time", "0.001s", "--global-timeout", "0.0015"))
    assert made.code == EXIT_OK
    app = api_json(world, "GET", "/apps/cli-ms")
    assert (app["gcTimeThresholdMs"], app["globalTimeoutMs"]) == (1, 2)
    # 0 and below are the user's own, and the API's to refuse in its words.
    zero = cli("apps", "set", "cli-ms", "--gc-time", "0")
    assert zero.code == EXIT_USAGE and zero.err.startswith("relay: 422 ") and "gcTimeThresholdMs" in zero.err, zero
    ok(cli("apps", "delete", "cli-ms", "--yes"))


def test_api_names_are_shown_as_the_api_spells_them_and_taken_in_any_case(world: World, cli: Cli) -> None:
    """A choice of the API's names (``--kind``, ``--state``, ``--status``) is taken in any case; click
    showed the choices casefolded (``executordead``) in the error for a wrong one, in the one for a
    missing one (over eight lines) and in shell completion, names neither the API nor README uses."""
    kinds = "WorkflowFailure, SlowQueue, UnresponsiveApplication, ExecutorDead, RecoveryBlocked, RecoveryFailed, " \
        "InstanceAdopted"  # fmt: skip
    helped = ok(relay_process(world, "alerts", "create", "--help"))
    assert kinds in " ".join(helped.out.split()), helped.out
    wrong = cli("alerts", "create", "ledger", "--kind", "ExecutorDied", "--webhook", "http://127.0.0.1:9/h")
    assert wrong.code == EXIT_USAGE and wrong.err == (
        f"relay: Invalid value for '--kind': 'ExecutorDied' is not one of {kinds} (see 'relay alerts create -h')\n"
    ), wrong.err
    missing = cli("alerts", "create", "ledger")
    assert missing.code == EXIT_USAGE and missing.err == (
        f"relay: Missing option '--kind'. Choose from {kinds} (see 'relay alerts create -h')\n"
    ), missing.err
    state = cli("executors", "ledger", "--state", "asleep")
    assert state.code == EXIT_USAGE and "is not one of HEALTHY, DISCONNECTED, DEAD, RECOVERING" in state.err, state
    status = cli("workflows", "list", "ledger", "--status", "done")
    assert status.code == EXIT_USAGE and "not one of PENDING, ENQUEUED, DELAYED, SUCCESS, ERROR," in status.err, status
    # Any case is taken, and the API is sent its own spelling.
    made = ok(cli("alerts", "create", "ledger", "--kind", "instanceADOPTED", "--json")).json()
    assert made["kind"] == "InstanceAdopted"
    ok(cli("alerts", "delete", "ledger", made["id"], "--yes"))
    assert ok(cli("executors", "ledger", "--state", "healthy", "--json")).json()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(_RELAY_COMPLETE="bash_complete", COMP_WORDS="relay alerts create ledger --kind exec", COMP_CWORD="5")
    completed = subprocess.run([sys.executable, "-m", "relay"], capture_output=True, text=True, env=env, timeout=60)
    assert completed.stdout.split() == ["plain,ExecutorDead"], completed


def test_options_given_to_relay_apps_before_its_command_are_refused_not_ignored(world: World, cli: Cli) -> None:
    """``relay apps`` takes the shared options to list; before ``show``, ``set`` or ``delete`` they
    were taken and dropped: ``relay apps --url X delete APP --yes`` deleted the app on RELAY_URL's
    Relay, not X's, and ``relay apps --json show APP`` printed a table. Refused now (exit 2), naming
    where they go, and nothing is done."""
    ok(cli("apps", "create", "cli-kept"))
    nowhere = f"http://127.0.0.1:{free_port()}"
    for options in (["--url", nowhere], ["--org", "globex"], ["--key", VIEWER_KEYS["acme"]], ["--json"]):
        run = cli("apps", *options, "delete", "cli-kept", "--yes")
        assert run.code == EXIT_USAGE and run.out == "", (options, run)
        where = f"(relay apps delete {options[0]} ...)"
        assert run.err.startswith(f"relay: {options[0]} goes after the command {where}"), run.err
        assert run.err.count("\n") == 1, run.err
        assert api_json(world, "GET", "/apps/cli-kept")["name"] == "cli-kept"
    both = cli("apps", "--json", "--limit", "5", "show", "cli-kept")
    where = "(relay apps show --limit ...)"
    assert both.code == EXIT_USAGE and f"relay: --limit, --json go after the command {where}" in both.err, both.err
    # After the command, or with no command (the list), they are taken.
    assert ok(cli("apps", "show", "cli-kept", "--json")).json()["name"] == "cli-kept"
    assert len(ok(cli("apps", "--json", "--limit", "1")).json()) == 1
    assert ok(cli("apps", "delete", "cli-kept", "--yes", "--json")).json() == {"name": "cli-kept", "deleted": True}


def test_alerts_list_create_and_delete(world: World, cli: Cli) -> None:
    """An app's alerting rules through the CLI: the table shows a webhook's host only, never its path,
    query or secret; a secret Relay draws is printed once, by create."""
    hook = f"http://127.0.0.1:{free_port()}/hooks/path-secret?token=query-secret"
    made = ok(cli("alerts", "create", "ledger", "--kind", "RecoveryBlocked", "--param", "reason=no_healthy_peer",
                  "--param", "forSecs=10m", "--webhook", hook, "--format", "slack",
                  "--min-interval", "1m"))  # fmt: skip
    first = re.fullmatch(
        r"rule (\S+) created in acme/ledger: RecoveryBlocked to http://127\.0\.0\.1:\d+ \(slack\)\n"
        r"its webhook's signing secret \(X-Relay-Signature\), shown this once:\n  (\S+)\n",
        made.out,
    )
    assert first, made.out
    rule_id, drawn = first.groups()
    # A secret given is not printed back.
    given = ok(cli("alerts", "create", "ledger", "--kind", "InstanceAdopted", "--webhook", hook,
                   "--secret", "given-secret-0123456789", "--json")).json()  # fmt: skip
    assert "secret" not in given and given["secretSet"] is True
    to_app = ok(cli("alerts", "create", "ledger", "--kind", "WorkflowFailure", "--param", "workflowName=nightly",
                    "--param", "threshold=3", "--param", "period_secs=90s", "--receiver-app", "ledger",
                    "--json")).json()  # fmt: skip
    assert to_app["ruleMetadata"] == {"workflowName": "nightly", "count": 3, "windowSecs": 90}
    assert to_app["receiverApp"] == "ledger" and to_app["minIntervalSecs"] == 300

    listed = ok(cli("alerts", "list", "ledger"))
    rows = {r["ID"]: r for r in listed.table()}
    assert (rows[rule_id]["KIND"], rows[rule_id]["PARAMETERS"], rows[rule_id]["MIN INTERVAL"]) == (
        "RecoveryBlocked", "reason=no_healthy_peer forSecs=600s", "60s")  # fmt: skip
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+ \(slack\)", rows[rule_id]["DESTINATION"])
    assert (rows[rule_id]["SOURCE"], rows[rule_id]["LAST FIRED"]) == ("api", "-")
    assert (rows[to_app["id"]]["DESTINATION"], rows[to_app["id"]]["PARAMETERS"]) == (
        "app ledger", "workflowName=nightly count=3 windowSecs=90s")  # fmt: skip
    (from_yaml,) = [r for r in rows.values() if r["SOURCE"] == "config"]
    assert (from_yaml["KIND"], from_yaml["PARAMETERS"], from_yaml["DESTINATION"]) == (
        "InstanceAdopted", "-", "app ledger")  # fmt: skip
    as_json = ok(cli("alerts", "list", "ledger", "--json"))
    assert as_json.json() == api_json(world, "GET", "/apps/ledger/alerting-rules")
    for secret in ("path-secret", "query-secret", drawn, "given-secret-0123456789"):
        assert secret not in listed.out + listed.err + as_json.out, secret

    # Refusals: a parameter of another kind (the API's 422, one line, exit 2), no such app, a viewer key.
    bad = cli("alerts", "create", "ledger", "--kind", "ExecutorDead", "--param", "count=3", "--webhook", hook)
    assert bad.code == EXIT_USAGE and bad.err.startswith("relay: 422 ") and bad.err.count("\n") == 1, bad.err
    assert "ruleMetadata.count" in bad.err and "not a parameter of ExecutorDead" in bad.err, bad.err
    assert cli("alerts", "create", "ledger", "--kind", "ExecutorDead", "--param", "count").code == EXIT_USAGE
    assert cli("alerts", "list", "ledgr").code == EXIT_NOT_FOUND
    assert cli("alerts", "create", "ledgr", "--kind", "ExecutorDead", "--webhook", hook).code == EXIT_NOT_FOUND
    viewer = cli("alerts", "create", "ledger", "--kind", "ExecutorDead", "--webhook", hook, key=VIEWER_KEYS["acme"])
    assert viewer.code == EXIT_DENIED and "403 Forbidden" in viewer.err, viewer.err
    assert ok(cli("alerts", "list", "ledger", key=VIEWER_KEYS["acme"])).table()  # a viewer reads them

    # Delete asks first: refused without --yes when stdin is not a terminal, and nothing is deleted.
    unasked = cli("alerts", "delete", "ledger", rule_id)
    assert unasked.code == EXIT_USAGE and "give --yes" in unasked.err, unasked.err
    deleted = ok(cli("alerts", "delete", "ledger", rule_id, "--yes"))
    assert deleted.out == f"alerting rule '{rule_id}' deleted from acme/ledger\n"
    for other in (given["id"], to_app["id"]):
        assert ok(cli("alerts", "delete", "ledger", other, "--yes", "--json")).json() == {"id": other, "deleted": True}
    remaining = api_json(world, "GET", "/apps/ledger/alerting-rules")
    assert [r["source"] for r in remaining] == ["config"]
    assert cli("alerts", "delete", "ledger", rule_id, "--yes").code == EXIT_NOT_FOUND
    assert cli("alerts", "delete", "ledger", remaining[0]["id"], "--yes").code == EXIT_ERROR  # relay.yaml's: 409


def test_alerts_create_takes_relay_webhook_secret_for_a_webhook_rule_only(world: World, cli: Cli) -> None:
    """RELAY_WEBHOOK_SECRET keeps a webhook's secret off the command line. It was sent with every
    rule: with it set, one to an app's executors (the default destination) was refused (422, a secret
    applies to a webhook only) until it was unset. It goes with a webhook rule only now; ``--secret``
    given for an app's rule is still the API's to refuse."""
    env = {"RELAY_WEBHOOK_SECRET": "from-the-environment-0123"}
    hook = f"http://127.0.0.1:{free_port()}/hook"
    to_hook = ok(cli("alerts", "create", "ledger", "--kind", "InstanceAdopted", "--webhook", hook, "--json", env=env))
    assert "secret" not in to_hook.json() and to_hook.json()["secretSet"] is True  # given, so not drawn
    to_app = ok(cli("alerts", "create", "ledger", "--kind", "InstanceAdopted", "--json", env=env)).json()
    assert to_app["receiverApp"] == "ledger" and "secret" not in to_app, to_app
    given = cli("alerts", "create", "ledger", "--kind", "InstanceAdopted", "--secret", "given-secret-0123456789")
    assert given.code == EXIT_USAGE and "apply to a webhook only" in given.err, given.err
    for rule in (to_hook.json()["id"], to_app["id"]):
        ok(cli("alerts", "delete", "ledger", rule, "--yes"))


def test_alerts_create_reads_the_webhook_secret_from_stdin_and_the_rule_signs_with_it(
    world: World, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--secret S`` puts the secret in the shell's history, RELAY_WEBHOOK_SECRET in the environment;
    ``--secret-stdin`` reads it from stdin (as ``docker login --password-stdin``), and the rule made
    signs its deliveries with it. What cannot be used is refused (exit 2) before any rule is made,
    the secret in no line."""
    secret = "from-stdin-5e3b9f0a7c2d4e61"
    with world.relay.api() as api:
        assert api.put("/apps/signed").status_code in (201, 204)
        assert api.patch("/apps/signed", json={"executorTimeoutSecs": 0.2}).status_code == 200
    with WebhookReceiver() as receiver:
        hook = receiver.url("/hooks/signed")
        create = ("alerts", "create", "signed", "--kind", "ExecutorDead", "--webhook", hook, "--min-interval", "0")
        # In this process, stdin a pipe's text (a process each would cost a second).
        refusals = [
            ([*create, "--secret-stdin", "--secret", "given-secret-0123456789"], secret, "not both"),
            ([*create, "--secret-stdin"], "", "stdin is empty"),
            ([*create, "--secret-stdin"], "\n", "stdin is empty"),
            ([*create, "--secret", ""], "", "secret is blank"),
            # A secret signs a webhook's deliveries only.
            (["alerts", "create", "signed", "--kind", "ExecutorDead", "--secret-stdin"], secret, "goes with --webhook"),
        ]
        for args, stdin, said in refusals:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
            refused = cli(*args)
            assert refused.code == EXIT_USAGE and said in refused.err and refused.err.count("\n") == 1, refused
            assert secret not in refused.out + refused.err, refused
        # The real command, stdin piped.
        two_lines = relay_process(world, *create, "--secret-stdin", stdin=f"{secret}\nsecond-line-0123456789\n")
        assert two_lines.code == EXIT_USAGE and "more than one line" in two_lines.err, two_lines
        assert secret not in two_lines.err and "second-line" not in two_lines.err, two_lines
        assert api_json(world, "GET", "/apps/signed/alerting-rules") == []

        made = relay_process(world, *create, "--secret-stdin", "--json", stdin=secret + "\r\n")
        assert made.code == EXIT_OK, made
        assert made.json()["secretSet"] is True and "secret" not in made.json() and secret not in made.out
        victim = f"signed-{uuid.uuid4()}"
        url = f"ws://127.0.0.1:{world.relay.port}/websocket/signed/{CONDUCTOR_KEYS['acme']}"
        with SimulatedPeer(url, victim, "silent"):
            assert_eventually(lambda: world.relay.state_of("acme", "signed", victim) == "HEALTHY", 10)
        (delivery,) = assert_eventually(lambda: receiver.deliveries("ExecutorDead"), 15)
        assert delivery.payload["executorId"] == victim
        expected = "sha256=" + hmac.new(secret.encode(), delivery.body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(delivery.headers["x-relay-signature"], expected)
    with world.api() as api:
        for rule in api.get("/apps/signed/alerting-rules").json():
            assert api.delete(f"/apps/signed/alerting-rules/{rule['id']}").status_code == 204


def test_alerts_create_refuses_a_bad_param_before_it_reads_the_secret(
    world: World, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``--param`` that is not NAME=VALUE, or one given twice, was refused after ``--secret-stdin``
    had read stdin: at a terminal, once the secret had been typed twice. Now before. So is a webhook
    given with a receiving app (the API's refusal came once the secret was read)."""
    create = ("alerts", "create", "ledger", "--kind", "WorkflowFailure", "--webhook", "http://127.0.0.1:9/hook")
    for params, said in [
        (("--param", "count"), "give it as NAME=VALUE"),
        (("--param", "=3"), "give it as NAME=VALUE"),
        (("--param", "count=3", "--param", "count=4"), "--param count is given twice"),
        (("--receiver-app", "signed"), "give --webhook or --receiver-app, not both"),
    ]:
        stdin = io.StringIO("stdin-secret-0123456789\n")
        monkeypatch.setattr(sys, "stdin", stdin)
        refused = cli(*create, *params, "--secret-stdin")
        assert refused.code == EXIT_USAGE and said in refused.err, refused
        assert stdin.tell() == 0, f"stdin read before the refusal of {params}"


def test_alerts_create_states_the_webhook_secrets_rule_in_the_apis_words(cli: Cli) -> None:
    """``--secret``'s help and the refusal of a blank secret said "16 to 256 characters" in words of
    their own, and not that a control character is refused: they say relay.core.alerts' rule now, in
    the words of the API's and relay.yaml's refusals."""
    helped = ok(cli("alerts", "create", "-h"))
    assert SECRET_RULE in " ".join(helped.out.split()), helped.out
    hook = "http://127.0.0.1:9/hook"
    blank = cli("alerts", "create", "ledger", "--kind", "InstanceAdopted", "--webhook", hook, "--secret", "  ")
    assert blank.code == EXIT_USAGE and SECRET_RULE in blank.err and blank.err.count("\n") == 1, blank


def test_alerts_create_asks_for_the_webhook_secret_without_echo_at_a_terminal(world: World) -> None:
    """``--secret-stdin`` at a terminal asks for the secret twice, without echoing it, as ``docker
    login`` asks for a password; the rule keeps the secret typed."""
    secret = "typed-secret-9c1e2f7a40b3"
    leader, follower = pty.openpty()

    def terminal() -> None:  # stdin, the pseudo-terminal, as the process's terminal (getpass opens /dev/tty)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(RELAY_URL=world.relay.http, RELAY_API_KEY=API_KEYS["acme"])
    hook = f"http://127.0.0.1:{free_port()}/hook"
    args = ["alerts", "create", "ledger", "--kind", "InstanceAdopted", "--webhook", hook, "--secret-stdin", "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "relay", *args], stdin=follower, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, start_new_session=True, preexec_fn=terminal)  # fmt: skip
    os.close(follower)
    shown = b""
    try:
        for question in (b"Webhook secret: ", b"Repeat for confirmation: "):
            while not shown.endswith(question):  # the answer waits for its question: echo is off by then
                assert select.select([leader], [], [], 30)[0], shown
                shown += os.read(leader, 1024)
            os.write(leader, secret.encode() + b"\n")
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_OK, (out, err)
    rule = json.loads(out)
    assert rule["secretSet"] is True and secret.encode() not in shown + out + err, (shown, out, err)
    kept = query(world.relay.database_url, "SELECT secret FROM alert_rules WHERE id = %s", rule["id"])
    assert kept == [(secret,)]
    with world.api() as api:
        assert api.delete(f"/apps/ledger/alerting-rules/{rule['id']}").status_code == 204


def test_instances_with_their_leases(world: World, cli: Cli) -> None:
    (row,) = ok(cli("instances")).table()
    (instance,) = api_json(world, "GET", "/instances")
    assert (row["INSTANCE"], row["LEASE"], row["EPOCH"], row["EXECUTORS"]) == (
        "relay-1", "held", str(instance["leaseEpoch"]), str(instance["executors"]))  # fmt: skip
    assert instance["executors"] >= 1 and (row["ADOPTED BY"], row["ADOPTED"]) == ("-", "-")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row["STARTED"]) and re.fullmatch(r"\d+s", row["RENEWED"])
    # The lease is renewed as the test runs: the JSON is the API's, its renewal times aside.
    renewal = {"renewedAt", "leaseExpiresAt"}
    (as_json,) = ok(cli("instances", "--json")).json()
    assert {k: v for k, v in as_json.items() if k not in renewal} == {
        k: v for k, v in instance.items() if k not in renewal
    }
    assert set(as_json) == set(instance)
    assert cli("instances", "--org", "globex").code == EXIT_DENIED
