"""The ``relay`` command line as an on-call engineer uses it, against a real Relay with a real DBOS
3.2 executor (harness/workflow_app.py): what a reviewer found doing so after stop 35. Each test
failed on the code before its fix; its docstring says what the command did and what the README
promises. The commands run through the command line's own entry point (:func:`relay.cli.main`),
with RELAY_URL and RELAY_API_KEY in the environment, as tests/test_cli.py runs them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from harness.executors import ExecutorProcess
from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from relay.api.refusals import AUDITED_ROUTES
from relay.cli import main
from relay.cli.errors import EXIT_NOT_FOUND, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from relay.core.times import local_seconds
from relay.store.audit import ACTIONS

APP_MODULE = "harness.workflow_app"
FORTNIGHT_SECS = 14 * 24 * 3600  # 1209600: a grace period of two weeks


@dataclass
class World:
    workdir: Path
    sysdb: str
    relay: RelayProcess
    seeder: ExecutorProcess


@pytest.fixture(scope="module")
def world(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("cli-review")
    sysdb = postgres.create_database("sys")
    config = relay_yaml(free_port(), pingIntervalSecs=1.0, pingWaitSecs=10.0)
    # A second app of acme, with a long grace period (an app whose executors may be away for days).
    config["orgs"][0]["apps"].append({"name": "fortnight", "executorTimeoutSecs": FORTNIGHT_SECS})
    relay = RelayProcess(workdir, postgres.create_database("relay"), config)
    seeder: ExecutorProcess | None = None
    try:
        relay.start()
        seeder = ExecutorProcess(workdir, sysdb, relay.conductor_url, module=APP_MODULE, env={"RELAY_TEST_SEED": "1"})
        executor_id = seeder.executor_id
        assert_eventually(lambda: relay.state_of("acme", "ledger", executor_id) == "HEALTHY", 10)
        yield World(workdir, sysdb, relay, seeder)
    finally:
        if seeder is not None:
            seeder.stop()
        relay.stop()


@dataclass
class Run:
    code: int
    out: str
    err: str


Cli = Callable[..., Run]


@pytest.fixture
def cli(world: World, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    """``relay ARGS`` through its entry point, in this process."""

    def run(*args: str, key: str = API_KEYS["acme"]) -> Run:
        for name in [k for k in os.environ if k.startswith("RELAY_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("RELAY_URL", world.relay.http)
        monkeypatch.setenv("RELAY_API_KEY", key)
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


def table_rows(text: str) -> list[dict[str, str]]:
    """A table's rows as dicts, cut at the header's column starts."""
    header, *lines = text.rstrip("\n").split("\n")
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", header)]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return [
        dict(zip(names, (line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)), strict=True))
        for line in lines
    ]


def api_json(world: World, method: str, path: str, **kwargs: Any) -> Any:
    with world.relay.api("acme") as api:
        resp = api.request(method, path, **kwargs)
    resp.raise_for_status()
    return resp.json()


def test_apps_table_shows_a_long_grace_period_as_a_number_of_seconds(world: World, cli: Cli) -> None:
    """``relay apps`` formatted GRACE with ``f"{secs:g}s"``, and ``:g`` keeps six significant digits
    and switches to an exponent from 10**6 on: an app with a grace period of two weeks
    (executorTimeoutSecs 1209600, accepted by relay.yaml and PATCH) showed ``1.2096e+06s``, and one
    of 1234567 s ``1.23457e+06s``, a value that is not the setting. README: the apps table
    shows the "grace period" (``60s`` in the tour); the API answers ``1209600.0``."""
    assert api_json(world, "GET", "/apps/fortnight")["executorTimeoutSecs"] == FORTNIGHT_SECS
    run = cli("apps")
    assert run.code == EXIT_OK, run.err
    rows = {r["APP"]: r for r in table_rows(run.out)}
    assert rows["fortnight"]["GRACE"] == f"{FORTNIGHT_SECS}s", run.out


def test_json_lists_say_on_stderr_when_the_page_is_full(world: World, cli: Cli) -> None:
    """README (Command line): "A list shows one page (--limit, default 100, and --offset); when the
    page is full, stderr says how to get the next one. --json prints the API's JSON as it came ...
    for scripts and jq". The hint was printed for tables only: every list command returned right
    after ``print_json``. So ``relay workflows list ledger --status PENDING --json | jq`` (README's
    own example) silently stopped at 100 workflows. Here: ``relay tokens list --json --limit 1``
    with three keys in the org printed one and said nothing."""
    assert len(api_json(world, "GET", "/tokens")) >= 3
    table = cli("tokens", "list", "--limit", "1")
    assert table.code == EXIT_OK and "more with --offset 1" in table.err, table.err
    as_json = cli("tokens", "list", "--limit", "1", "--json")
    assert as_json.code == EXIT_OK and len(json.loads(as_json.out)) == 1
    assert "more with --offset 1" in as_json.err, f"stderr: {as_json.err!r}"


def test_an_empty_name_is_refused_not_taken_for_a_redirect_answer(world: World, cli: Cli) -> None:
    """An empty argument makes the path end in ``/`` (``DELETE /v2/orgs/acme/tokens/``); Relay
    answers ``307 Temporary Redirect`` to the path without it, httpx does not follow it, and
    ``Api.call`` took every status below 400 for success. So ``relay tokens delete ""`` printed
    "key '' deleted from org 'acme'" and exited 0 though nothing was deleted, and ``relay tokens
    create ""`` or ``relay workflows get ledger ""`` ended in "relay: internal error: TypeError"
    (exit 1). An empty name is now refused (exit 2), and a redirect is an error."""
    keys_before = api_json(world, "GET", "/tokens")
    deleted = cli("tokens", "delete", "", "--yes")
    assert api_json(world, "GET", "/tokens") == keys_before  # indeed nothing was deleted
    assert deleted.code in (EXIT_USAGE, EXIT_NOT_FOUND), (deleted.code, deleted.out, deleted.err)
    assert "deleted" not in deleted.out
    created = cli("tokens", "create", "")
    assert created.code == EXIT_USAGE and "internal error" not in created.err, (created.code, created.err)
    got = cli("workflows", "get", "ledger", "")
    assert got.code in (EXIT_USAGE, EXIT_NOT_FOUND) and "internal error" not in got.err, (got.code, got.err)


def insert_dot_workflow(sysdb: str, executor_id: str) -> None:
    """A finished workflow whose id is ``..``, as an executor records one (DBOS takes any string)."""
    with psycopg.connect(sysdb) as conn:
        conn.execute(
            "INSERT INTO dbos.workflow_status (workflow_uuid, status, name, created_at, updated_at, executor_id,"
            " application_version, application_id) VALUES ('..', 'CANCELLED', 'parent',"
            " (extract(epoch from now()) * 1000)::bigint, (extract(epoch from now()) * 1000)::bigint, %s, 'v1', '')"
            " ON CONFLICT DO NOTHING",
            (executor_id,),
        )


def test_a_workflow_whose_id_is_a_dot_segment_can_be_read(world: World, cli: Cli) -> None:
    """``segment()`` promised an id "percent-encoded whole", but ``quote("..", safe="")`` leaves dots
    alone, and httpx then resolves the dot segments of the URL: ``relay workflows get ledger ..``
    sent ``GET /v2/orgs/acme/apps/ledger``: the table form ended in "relay: internal error:
    KeyError: 'workflowId'" (exit 1), and ``--json`` printed the app's record as if it were the
    workflow, exit 0. ``relay workflows get ledger .`` read the workflow list instead. DBOS takes any string as a
    workflow id (here a cancelled workflow ``..`` as an executor records it), and Relay serves it at
    ``.../workflows/%2E%2E``.
    The same path rewriting sent ``cancel``/``resume``/``fork``/``steps`` of such an id, and
    ``recover APP ..`` or ``tokens delete ..``, to other routes."""
    insert_dot_workflow(world.sysdb, world.seeder.executor_id)
    assert api_json(world, "GET", "/apps/ledger/workflows/%2E%2E")["workflowId"] == ".."
    run = cli("workflows", "get", "ledger", "..", "--json")
    assert run.code == EXIT_OK, (run.code, run.err)
    answer = json.loads(run.out)
    assert answer.get("workflowId") == "..", f"not the workflow: {sorted(answer)[:6]}"


def test_workflows_of_an_app_that_does_not_exist_exit_not_found(world: World, cli: Cli) -> None:
    """A typo in the app name: ``relay executors ledgr`` and ``relay recoveries ledgr`` say
    "404 Not Found: no app 'ledgr' in org 'acme'" and exit 3, as README's exit-code table promises
    ("3 not found (404): no such app ...", with exactly this example line). But every ``relay
    workflows`` command said "503 Service Unavailable: app 'ledgr' has no healthy executor
    connected" and exited 5, "unavailable, try again": a script that retries on 5 retried a typo
    for ever. The workflow API now answers 404 for an app Relay does not know; an app it knows
    with no executor connected is still a 503 (tests/test_cli.py)."""
    executors = cli("executors", "ledgr")
    assert executors.code == EXIT_NOT_FOUND and "no app 'ledgr'" in executors.err
    listed = cli("workflows", "list", "ledgr")
    assert listed.code == EXIT_NOT_FOUND, (listed.code, listed.err)
    assert "no app 'ledgr'" in listed.err


def test_recover_says_whether_it_started_a_recovery_or_woke_the_one_running(world: World, cli: Cli) -> None:
    """``relay recover`` said "recovery ... started" also when a run of that death was live already
    (waiting for a healthy peer, or for an operator's permission without ``--to-latest``): nothing
    started, the run was only woken, and its status stayed as it was. The API's answer says which
    (``newRun``), and so does the command."""
    url = f"ws://127.0.0.1:{world.relay.port}/websocket/lonely/{CONDUCTOR_KEYS['acme']}"
    with world.relay.api() as api:
        assert api.put("/apps/lonely").status_code in (201, 204)
    victim = f"lonely-{uuid.uuid4()}"
    with SimulatedPeer(url, victim, "silent"):
        assert_eventually(lambda: world.relay.state_of("acme", "lonely", victim) == "HEALTHY", 10)
    assert_eventually(lambda: world.relay.state_of("acme", "lonely", victim) == "DISCONNECTED", 10)
    first = cli("recover", "lonely", victim)
    assert first.code == EXIT_OK and " started; follow it with: relay recoveries lonely " in first.out, first
    rid = first.out.split()[1]
    # No healthy peer of the app: the run waits for one, live.
    assert_eventually(lambda: world.relay.state_of("acme", "lonely", victim) == "DEAD", 10)
    again = cli("recover", "lonely", victim)
    assert again.code == EXIT_OK, again
    assert again.out.startswith(f"recovery {rid} was running already: woken to try again now;"), again.out
    as_json = cli("recover", "lonely", victim, "--json")
    assert json.loads(as_json.out) == {"recoveryId": rid, "newRun": False}


def test_a_key_limited_to_apps_counts_only_their_executors_on_the_instances(world: World) -> None:
    """``GET /instances`` counted every executor of the org for each instance, also for a key limited
    to apps (with ``organization.read``): it learned how many executors apps outside its scope
    have. It counts its apps' executors only (a reviewer's suspicion after the console review)."""
    with world.relay.api() as api:
        scope = {"appNames": ["fortnight"], "permissions": ["organization.read"]}
        made = api.post("/tokens/oncall-fortnight", json=scope)
        assert made.status_code == 201, made.text
        everyone = {i["instanceId"]: i["executors"] for i in api.get("/instances").json()}
    assert everyone["relay-1"] >= 1  # the ledger executor
    with world.relay.api(key=made.json()["token"]) as api:
        scoped = api.get("/instances")
    assert scoped.status_code == 200, scoped.text
    assert {i["instanceId"]: i["executors"] for i in scoped.json()} == {"relay-1": 0}


def test_audit_and_recoveries_list_newest_first_for_an_incident_under_way(world: World, cli: Cli) -> None:
    """``relay audit`` and ``relay recoveries`` listed oldest first only, with no way to turn the
    order round (the API has ``sortDesc``; ``relay workflows list`` has ``--desc``). With weeks of
    entries kept (``retention.auditDays`` 90), the first page is weeks old, and the entries of the
    mass failure under way are thousands of pages later, at an offset the engineer has to guess
    (``--since 1h`` starts with the oldest of that hour). Nor could ``relay audit`` filter by action,
    as the API and the console do. Here: 1,500 older entries, then the newest ones."""
    with psycopg.connect(world.relay.database_url) as conn:
        conn.execute(
            """INSERT INTO audit_log (org, app, action, executor_id, actor, detail, at)
               SELECT 'acme', 'ledger', 'executor.dead', 'old-' || g, 'relay', '{}'::jsonb,
                      now() - interval '30 days' + make_interval(secs => g)
               FROM generate_series(1, 1500) AS g"""
        )
        newest = [
            int(row[0])
            for row in conn.execute(
                """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
                   SELECT 'acme', 'ledger', 'recovery.dispatched', 'new-' || g, 'relay', '{}'::jsonb
                   FROM generate_series(1, 3) AS g RETURNING id"""
            ).fetchall()
        ]
    run = cli("audit", "--desc", "--limit", "2", "--json")
    assert run.code == EXIT_OK, run.err
    assert [e["id"] for e in json.loads(run.out)] == sorted(newest, reverse=True)[:2]
    # The next page, as the hint says to read it: where the first one ended, even with entries audited since.
    hint = re.search(r"more with (--offset \d+ --until-id \d+)", run.err)
    assert hint is not None, run.err
    with psycopg.connect(world.relay.database_url) as conn:
        conn.execute(
            "INSERT INTO audit_log (org, app, action, executor_id, actor)"
            " VALUES ('acme', 'ledger', 'executor.dead', 'later', 'relay')"
        )
    after = cli("audit", "--desc", "--limit", "2", "--json", *hint.group(1).split())
    assert after.code == EXIT_OK, after.err
    assert [e["id"] for e in json.loads(after.out)][:1] == [min(newest)]

    dispatched = cli("audit", "--action", "recovery.dispatched", "--app", "ledger", "--desc", "--json")
    assert dispatched.code == EXIT_OK, dispatched.err
    found = json.loads(dispatched.out)
    assert {e["action"] for e in found} == {"recovery.dispatched"} and found[0]["id"] == max(newest)

    with psycopg.connect(world.relay.database_url) as conn:
        conn.execute(
            """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status, run,
                                       created_at)
               SELECT 'cli-rec-' || g, 'acme', 'ledger', 'cli-ex-' || g, 'v1', 900000 + g, 'grace_period',
                      'succeeded', 1, now() - interval '20 days' + make_interval(secs => g)
               FROM generate_series(1, 150) AS g"""
        )
    recent = cli("recoveries", "ledger", "--desc", "--limit", "1", "--json")
    assert recent.code == EXIT_OK, recent.err
    listed = json.loads(recent.out)
    everything = api_json(world, "GET", "/apps/ledger/recoveries", params={"sortDesc": "true", "limit": 1})
    assert [r["recoveryId"] for r in listed] == [r["recoveryId"] for r in everything]
    oldest_first = json.loads(cli("recoveries", "ledger", "--limit", "1", "--json").out)
    assert oldest_first != listed


def test_a_relay_that_does_not_answer_is_given_up_on_after_the_timeout_given(world: World, cli: Cli) -> None:
    """A paused Relay (its port accepts, nothing answers) held every command for the fixed 60 s of
    the HTTP client before "did not answer in time". ``--timeout`` (``RELAY_TIMEOUT``) sets it: an
    on-call engineer checking several instances learns in seconds which one hangs."""
    assert cli("apps", "--timeout", "0").code == EXIT_USAGE
    world.relay.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        run = cli("apps", "--timeout", "1")
        took = time.monotonic() - started
    finally:
        world.relay.signal(signal.SIGCONT)
    assert run.code == EXIT_UNAVAILABLE and "did not answer in time" in run.err, run.err
    assert took < 20, took  # the default would have waited 60 s
    assert_eventually(lambda: cli("apps", "--timeout", "5").code == EXIT_OK, 30)


def test_an_audit_action_that_does_not_exist_is_refused_naming_the_actions(world: World, cli: Cli) -> None:
    """``relay audit --action executor.died`` (a typo of ``executor.dead``) exited 0 with "no audit
    entries", as ``GET /audit?action=`` took any action: on-call read it as "nothing died". The API
    refuses an action Relay does not audit (422, ``errors`` at ``query.action``, the message listing
    the actions, relay.store.audit.ACTIONS), the CLI says the API's words and exits 2; the OpenAPI
    document gives the actions as the parameter's values. A real action still filters."""
    with world.relay.api("acme") as api:
        typo = api.get("/audit", params={"action": "executor.died"})
        known = api.get("/audit", params={"action": "executor.dead"})
        document = api.get(f"{world.relay.http}/openapi.json")
    assert typo.status_code == 422, typo.text
    body = typo.json()
    assert [e["location"] for e in body["errors"]] == ["query.action"], body
    assert "executor.died" in body["detail"] and "executor.dead, recovery.dispatched" in body["detail"], body
    assert known.status_code == 200 and {e["action"] for e in known.json()} <= {"executor.dead"}
    (parameter,) = (p for p in document.json()["paths"]["/v2/orgs/{org}/audit"]["get"]["parameters"]
                    if p["name"] == "action")  # fmt: skip
    assert tuple(_enum_of(parameter["schema"])) == ACTIONS, parameter

    run = cli("audit", "--action", "executor.died")
    assert run.code == EXIT_USAGE, (run.code, run.out, run.err)
    assert "no audit action executor.died: one of executor.dead" in run.err and run.out == "", run.err


def _enum_of(schema: dict[str, Any]) -> list[str]:
    """The values a parameter's schema lists, through the ``anyOf`` of an optional one."""
    if "enum" in schema:
        return list(schema["enum"])
    return [v for option in schema.get("anyOf", []) for v in option.get("enum", [])]


def test_the_consoles_audit_actions_are_the_servers() -> None:
    """The console's Action filter (``ACTIONS`` in console-pages.js) lists its own copy of the audit
    actions: one the server has and the console lacks cannot be picked, and one the console has and
    the server does not is refused (422). They are the same list, in the same order."""
    source = (Path(__file__).parent.parent / "relay" / "static" / "console-pages.js").read_text()
    found = re.search(r"^const ACTIONS = \[(.*?)\];", source, re.S | re.M)
    assert found is not None, "console-pages.js has no ACTIONS list"
    assert tuple(re.findall(r'"([^"]+)"', found.group(1))) == ACTIONS
    # The actions of changes refused and audited (relay.api.refusals) are written through the same list.
    assert set(AUDITED_ROUTES.values()) - set(ACTIONS) == set()


def test_a_disconnected_executor_says_when_it_is_declared_dead(world: World, cli: Cli) -> None:
    """Nothing told on-call when a DISCONNECTED executor would be declared DEAD: not ``relay
    executors`` (its state, and since when), not the API (``disconnectedAt``, and the app's
    ``executorTimeoutSecs``, which may have changed since the grace period began), not the log
    ("is DISCONNECTED"). The API's executor has ``graceEndsAt``: the deadline its grace period
    workflow recorded (DBOS's timer of its ``recv``), which a change of the app's setting does not
    move; the CLI's state cell and the log line say it."""
    url = f"ws://127.0.0.1:{world.relay.port}/websocket/fortnight/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "fortnight-away", "answer"):
        assert_eventually(lambda: world.relay.state_of("acme", "fortnight", "fortnight-away") == "HEALTHY", 10)
        assert api_json(world, "GET", "/apps/fortnight/executors/fortnight-away")["graceEndsAt"] is None
    timer = "grace:acme:fortnight:fortnight-away:%"

    def recorded() -> float | None:
        with psycopg.connect(world.relay.database_url) as conn:
            row = conn.execute(
                """SELECT output FROM dbos.operation_outputs
                   WHERE workflow_uuid LIKE %s AND function_name = 'DBOS.sleep'""",
                (timer,),
            ).fetchone()
        return None if row is None else float(json.loads(row[0]))

    assert_eventually(lambda: recorded() is not None, 10, what="the grace period's timer recorded")
    deadline = datetime.fromtimestamp(recorded() or 0, UTC)
    away = api_json(world, "GET", "/apps/fortnight/executors/fortnight-away")
    assert away["state"] == "DISCONNECTED" and datetime.fromisoformat(away["graceEndsAt"]) == deadline, away
    disconnected = datetime.fromisoformat(away["disconnectedAt"])
    assert abs((deadline - disconnected).total_seconds() - FORTNIGHT_SECS) < 2, (deadline, disconnected)
    try:
        # The app's setting changed after the grace period began: its deadline stays the one it waits for.
        api_json(world, "PATCH", "/apps/fortnight", json={"executorTimeoutSecs": 60})
        (listed,) = [
            e for e in api_json(world, "GET", "/apps/fortnight/executors") if e["executorId"] == "fortnight-away"
        ]
        assert listed["graceEndsAt"] == away["graceEndsAt"], listed
    finally:
        api_json(world, "PATCH", "/apps/fortnight", json={"executorTimeoutSecs": FORTNIGHT_SECS})

    run = cli("executors", "fortnight", "--state", "DISCONNECTED")
    assert run.code == EXIT_OK, run.err
    (row,) = [r for r in table_rows(run.out) if r["EXECUTOR"] == "fortnight-away"]
    assert row["STATE"] == f"DISCONNECTED (dead at {local_seconds(deadline)})", run.out

    said = re.search(
        r"executor acme/fortnight/fortnight-away is DISCONNECTED: declared DEAD at (\S+ \S+) UTC unless it "
        r"reconnects \(grace period 1209600 s\)",
        world.relay.log(),
    )
    assert said is not None, world.relay.log()[-3000:]
    logged = datetime.strptime(said.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    assert abs((logged - deadline).total_seconds()) < 2, (logged, deadline)
