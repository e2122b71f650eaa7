"""Names with ``/`` or ``%`` in the API's paths: every path parameter is decoded once, the same way.

A key created as ``team/ops`` was stored as ``team%2Fops`` (its create route took the name as
routing saw it) and could then not be renamed or deleted by its name; an app named ``100%`` was
unreachable, and a key limited to it was refused on it.

And the rule for a new app's name (relay.core.ids.APP_NAME_RULE), where apps are made: ``PUT
/apps/{app}``, relay.yaml (tests/test_protocol_and_config.py) and an executor's connection. ``..``,
``a/b``, a name with a control character or a space at either end were taken, and the console, the
CLI and dbos-mcp, which put the name in URL paths, reached another resource or none. An app an older
Relay made under such a name stays listable, readable and deletable. ``%``, ``?`` and ``#`` were
taken too, though the DBOS SDKs put the name in their WebSocket URL as it is: an executor of
``100%41`` joined the app ``100A``; so was ``\\``, which the TypeScript SDK's URL parser reads as
``/``. And ``PUT`` with settings is one transaction.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest
from websockets.exceptions import InvalidStatus

from harness.executors import ExecutorProcess
from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.relay import RelayProcess
from harness.simulated import SimulatedPeer, open_socket
from harness.ts_executor import start_ts_executor
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.core.ids import APP_NAME_RULE
from tests.prom import scrape


def client(relay: RelayProcess, key: str = API_KEYS["acme"]) -> httpx.Client:
    return httpx.Client(
        base_url=f"{relay.http}/v2/orgs/acme", headers={"Authorization": f"Bearer {key}"}, timeout=10, verify=TLS
    )


def segment(name: str) -> str:
    """``name`` as one path segment: ``/`` and ``%`` escaped, as a client sends them."""
    return quote(name, safe="")


@pytest.mark.parametrize("name", ["team/ops", "100%ops", "caf\u00e9 %41"])
def test_a_key_named_with_a_slash_or_a_percent_sign_is_created_renamed_and_deleted_by_that_name(
    relay: RelayProcess, name: str
) -> None:
    with client(relay) as api:
        created = api.post(f"/tokens/{segment(name)}", json={"permissions": ["application.read"]})
        assert created.status_code == 201, created.text
        assert created.json()["tokenName"] == name
        assert name in [t["tokenName"] for t in api.get("/tokens").json()]
        renamed = api.patch(f"/tokens/{segment(name)}", json={"newName": name + "/2"})
        assert renamed.status_code == 200, renamed.text
        deleted = api.delete(f"/tokens/{segment(name + '/2')}")
        assert deleted.status_code == 204, deleted.text
        assert not [t for t in api.get("/tokens").json() if t["tokenName"].startswith(name)]


def test_an_app_named_with_a_percent_sign_is_reached_by_its_name_and_by_a_key_limited_to_it(
    relay: RelayProcess,
) -> None:
    """Made as an older Relay made it: a new app's name has no ``%`` now (the rule, below), but one
    made before is still reached by its name, decoded once."""
    app = "100%app"
    made_by_an_older_relay(relay, app)
    with client(relay) as api:
        one = api.get(f"/apps/{segment(app)}")
        assert one.status_code == 200, one.text
        assert one.json()["name"] == app
        created = api.post("/tokens/percent-reader", json={"permissions": ["application.read"], "appNames": [app]})
        assert created.status_code == 201, created.text
    with client(relay, created.json()["token"]) as limited:
        listed = limited.get(f"/apps/{segment(app)}/executors")
        assert listed.status_code == 200, listed.text
        assert limited.get("/apps/ledger/executors").status_code == 403


# -- the rule for a new app's name ------------------------------------------------------------------


def escaped(name: str) -> str:
    """``name`` as one path segment, every character but letters and digits escaped (dots too, so
    that ``..`` reaches Relay rather than being resolved by the client)."""
    return "".join(c if c.isascii() and c.isalnum() else quote(c, safe="").replace(".", "%2E") for c in name)


def names(api: httpx.Client) -> list[str]:
    return [a["name"] for a in api.get("/apps", params={"limit": 1000}).json()]


def made_by_an_older_relay(relay: RelayProcess, name: str) -> None:
    """An app of a name the rule refuses, as an older Relay registered it (an upgrade in place)."""
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO apps (org, name, executor_timeout_secs) VALUES ('acme', %s, 30)", (name,))


@pytest.mark.parametrize(
    "name",
    [
        *(".", "..", "a/b", "/", "a\nb", "a\tb", "a\x7fb", "a\x85b", "\u2028", " lead", "trail ", "x" * 257),
        *("100%41", "50%off", "%", "a?b", "?", "a#b", "#", "a\\b", "\\"),
    ],
)
def test_put_refuses_a_name_breaking_the_rule_with_the_rule(relay: RelayProcess, name: str) -> None:
    with relay.api() as api:
        refused = api.put(f"/apps/{escaped(name)}", json={"gcRowsThreshold": 5})
        assert refused.status_code == 422, (name, refused.status_code, refused.text)
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["detail"] == APP_NAME_RULE
        assert name not in names(api)


@pytest.mark.parametrize(
    "name",
    ["my.app", "My_App-2", "...", ".hidden", "a b", "a:b", "100 percent!", "caf\u00e9", "x" * 256, 'a|^[]"<>`{}b'],
)
def test_put_takes_the_names_dbos_apps_use(relay: RelayProcess, name: str) -> None:
    with relay.api() as api:
        made = api.put(f"/apps/{escaped(name)}")
        assert made.status_code == 204, (name, made.text)
        assert api.get(f"/apps/{escaped(name)}").json()["name"] == name
        assert api.delete(f"/apps/{escaped(name)}").status_code == 204


def test_the_document_gives_the_rule_as_a_pattern(relay: RelayProcess) -> None:
    document = httpx.get(f"{relay.http}/openapi.json", verify=TLS, timeout=10).json()
    (app,) = [p for p in document["paths"]["/v2/orgs/{org}/apps/{app}"]["put"]["parameters"] if p["name"] == "app"]
    assert app["schema"]["pattern"].startswith("^(?!") and app["description"] == APP_NAME_RULE
    assert re.fullmatch(app["schema"]["pattern"], "a\\b") is None and re.fullmatch(app["schema"]["pattern"], "a|b")


@pytest.mark.parametrize("name", ["..", " spaced ", "100%41", "a?b", "a#b", "a\\b"])
def test_an_app_an_older_relay_made_under_such_a_name_is_listed_read_changed_and_deleted(
    relay: RelayProcess, name: str
) -> None:
    made_by_an_older_relay(relay, name)
    with relay.api() as api:
        assert name in names(api)
        assert api.get(f"/apps/{escaped(name)}").json()["name"] == name
        changed = api.patch(f"/apps/{escaped(name)}", json={"executorTimeoutSecs": 5})
        assert changed.status_code == 200 and changed.json()["executorTimeoutSecs"] == 5, changed.text
        assert api.put(f"/apps/{escaped(name)}").status_code == 422  # the rule, even for one that exists
        assert api.delete(f"/apps/{escaped(name)}").status_code == 204
        assert name not in names(api)


def test_an_executor_makes_no_app_of_such_a_name_and_keeps_one_an_older_relay_made(relay: RelayProcess) -> None:
    """The SDK puts its app's name in its WebSocket URL as it is: ``..`` reaches Relay as such, and
    registered the app ``..``. Now it is refused (400, the rule); the executors of an app ``..``
    that an older Relay made still connect."""
    url = f"ws://127.0.0.1:{relay.port}/websocket/../{CONDUCTOR_KEYS['acme']}"

    async def refused() -> int:
        with pytest.raises(InvalidStatus) as info:
            await open_socket(url)
        assert json.loads(info.value.response.body)["error"]["message"].endswith(APP_NAME_RULE)
        return info.value.response.status_code

    assert asyncio.run(refused()) == 400
    with relay.api() as api:
        assert ".." not in names(api)
    made_by_an_older_relay(relay, "..")
    with SimulatedPeer(url, "dots-1", "answer"), relay.api() as api:
        executor = f"/apps/{escaped('..')}/executors/dots-1"
        assert_eventually(lambda: api.get(executor).json().get("state") == "HEALTHY", 10)


def refused(relay: RelayProcess, reason: str) -> float:
    """How many sockets Relay refused for ``reason`` (``bad_app``: the app's name; ``bad_key``)."""
    return scrape(relay.http, "relay_hub_events_total", kind=f"rejected_{reason}") or 0


@pytest.fixture
def start_ts(tmp_path: Path, sysdb: str) -> Iterator[Callable[..., ExecutorProcess]]:
    """Executors on the TypeScript SDK (5.2, its own conductor client): it takes any app name, where
    the Python SDK refuses all but 3 to 256 of ``a-z0-9-_`` before it connects."""
    started: list[ExecutorProcess] = []

    def start(**kwargs: Any) -> ExecutorProcess:
        started.append(start_ts_executor(tmp_path, sysdb, kwargs.pop("conductor_url"), **kwargs))
        return started[-1]

    yield start
    for executor in started:
        executor.stop()


def test_an_sdk_executor_named_with_a_percent_escape_joins_no_other_app(
    relay: RelayProcess, start_ts: Callable[..., ExecutorProcess]
) -> None:
    """The DBOS SDK puts its app's name in its WebSocket URL as it is, and the server decodes the
    path: an executor of the app ``100%41`` registered the app ``100A`` and joined it. Its name has
    ``%`` (the rule), so it is refused now (400) and registers nothing; an app ``100A`` that an
    older Relay registered from it keeps it."""
    before = refused(relay, "bad_app")
    executor = start_ts(conductor_url=relay.conductor_url, app="100%41")
    assert_eventually(lambda: refused(relay, "bad_app") >= before + 2, 10, what="the executor refused, twice")
    with relay.api() as api:
        assert not {"100A", "100%41"} & set(names(api))
    made_by_an_older_relay(relay, "100A")
    with relay.api() as api:
        joined = f"/apps/100A/executors/{executor.executor_id}"
        assert_eventually(lambda: api.get(joined).json().get("state") == "HEALTHY", 10, what="100A joined")


def test_a_name_sent_with_its_characters_escaped_makes_the_app_of_that_name(relay: RelayProcess) -> None:
    """What the raw path's check leaves alone: an escape of a character a client does escape, as
    relay_client (every character but letters, digits and ``-._~``) and the SDKs (a name with
    non-ASCII characters) send one, makes the app of the name the executor gave."""
    name = "caf\u00e9 au lait:2"
    url = f"ws://127.0.0.1:{relay.port}/websocket/{segment(name)}/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "escaped-1", "answer"), relay.api() as api:
        executor = f"/apps/{escaped(name)}/executors/escaped-1"
        assert_eventually(lambda: api.get(executor).json().get("state") == "HEALTHY", 10, what="the app joined")
        assert name in names(api)


def test_an_sdk_executor_named_with_a_question_mark_cannot_connect(
    relay: RelayProcess, start_ts: Callable[..., ExecutorProcess]
) -> None:
    """Why ``?`` is refused in a new app's name: the SDK's URL for the app ``a?b`` is
    ``/websocket/a?b/KEY``, whose path names the app ``a`` and no key (``b/KEY`` is its query), so
    its executor is refused as one without a key, whatever apps there are. (``#`` never leaves the
    SDK: its WebSocket library refuses a URL with a fragment.)"""
    made_by_an_older_relay(relay, "a?b")
    before = refused(relay, "bad_key")
    start_ts(conductor_url=relay.conductor_url, app="a?b")
    assert_eventually(
        lambda: refused(relay, "bad_key") >= before + 2, 10, what="the executor refused for its key, twice"
    )
    with relay.api() as api:
        assert api.get(f"/apps/{escaped('a?b')}/executors").json() == []
        assert "a" not in names(api)
        assert api.delete(f"/apps/{escaped('a?b')}").status_code == 204


def test_an_sdk_executor_reaches_relay_under_its_name_with_any_character_but_a_backslash(
    relay: RelayProcess, start_ts: Callable[..., ExecutorProcess]
) -> None:
    """The TypeScript SDK's URL parser (Node's) sends ``|``, ``^``, ``[``, ``]`` and most punctuation
    as they are, escapes a space, ``"<>`{}`` and non-ASCII characters (which the server decodes back),
    and reads ``\\`` as ``/``: the executor of ``a\\b`` asks for ``/websocket/a/b/KEY``, no endpoint,
    and never joins its app, even one an older Relay made. The rule takes the first names and
    refuses ``a\\b`` (PUT took it)."""
    given = ["a|^[]'!$&()*+,;=@:~b", 'a "<>`{}b', "caf\u00e9 \u65e5\U0001f600"]
    backslashed = "a\\b"
    before = refused(relay, "not_found")
    made_by_an_older_relay(relay, backslashed)
    # One at a time: the first one's start makes the system database, which two at once deadlock on.
    executors = [start_ts(conductor_url=relay.conductor_url, app=name, version=f"v{i}") for i, name in enumerate(given)]
    stranded = start_ts(conductor_url=relay.conductor_url, app=backslashed, version="v-backslashed")
    with relay.api() as api:
        joined = [f"/apps/{escaped(e.app)}/executors/{e.executor_id}" for e in executors]
        assert_eventually(
            lambda: all(api.get(p).json().get("state") == "HEALTHY" for p in joined), 10, what="each under its name"
        )
        assert_eventually(lambda: refused(relay, "not_found") > before, 10, what="a\\b's executor found no endpoint")
        assert api.get(f"/apps/{escaped(backslashed)}/executors").json() == [] and stranded.proc.poll() is None
        assert "a" not in names(api)
        made = api.put(f"/apps/{escaped(backslashed)}")
        assert made.status_code == 422 and made.json()["detail"] == APP_NAME_RULE, made.text
        assert api.delete(f"/apps/{escaped(backslashed)}").status_code == 204


# Fails the second step of PUT's old two (the settings' update), as a full disk or a lost connection
# would, for the app "torn" only.
FAIL_TORN_UPDATE = """
    CREATE FUNCTION test_fail_torn() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN RAISE EXCEPTION 'test: no update of torn'; END $$;
    CREATE TRIGGER test_fail_torn BEFORE UPDATE ON apps FOR EACH ROW
      WHEN (NEW.name = 'torn') EXECUTE FUNCTION test_fail_torn();
"""


def test_put_with_settings_that_cannot_be_written_registers_no_app(relay: RelayProcess) -> None:
    """PUT registered the app, committed, then set its settings: when that failed, the answer was
    an error and the app was left registered without them (and audited as created)."""
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute(FAIL_TORN_UPDATE)
    try:
        with relay.api() as api:
            failed = api.put("/apps/torn", json={"gcRowsThreshold": 5})
            assert failed.status_code >= 500, failed.text
            assert api.get("/apps/torn").status_code == 404
            created = api.get("/audit", params={"app": "torn", "action": "application.create"}).json()
            assert created == []
    finally:
        with psycopg.connect(relay.database_url, autocommit=True) as conn:
            conn.execute("DROP TRIGGER test_fail_torn ON apps; DROP FUNCTION test_fail_torn()")
    with relay.api() as api:
        assert api.put("/apps/torn", json={"gcRowsThreshold": 5}).status_code == 204
        assert api.get("/apps/torn").json()["gcRowsThreshold"] == 5
        actions = [e["action"] for e in api.get("/audit", params={"app": "torn"}).json()]
        assert actions == ["application.create", "settings.updated"], actions


def waiting_for_apps(relay: RelayProcess) -> int:
    """How many statements of Relay's database on the apps table wait for a lock."""
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchall()
    return sum(re.search(r"\bapps\b", str(row[0])) is not None for row in rows)


def test_put_with_settings_beside_a_delete_of_the_app_is_one_or_the_other(relay: RelayProcess) -> None:
    """A PUT with settings of an app that exists, with a DELETE of it ordered first (it held the
    app's row): PUT found the app there, the DELETE removed it, and PUT's update of the settings
    found no row: 404 "no app", an answer of neither order, and nothing registered. Either order
    gives a 204: PUT after the DELETE makes the app again, with its settings."""
    with relay.api() as api:
        assert api.put("/apps/contested").status_code == 204
    # A transaction holding the app's row (as a PATCH of it does for a moment) lines up the DELETE,
    # then the PUT, behind it: the DELETE takes the row first.
    with psycopg.connect(relay.database_url) as holder, ThreadPoolExecutor(2) as pool:
        holder.execute("SELECT 1 FROM apps WHERE org = 'acme' AND name = 'contested' FOR UPDATE")
        with relay.api() as deleter, relay.api() as putter:
            deleted = pool.submit(deleter.delete, "/apps/contested")
            assert_eventually(lambda: waiting_for_apps(relay) == 1, 10, what="the DELETE waiting")
            put = pool.submit(putter.put, "/apps/contested", json={"gcRowsThreshold": 7})
            assert_eventually(lambda: waiting_for_apps(relay) == 2, 10, what="the PUT waiting")
            holder.rollback()
            assert deleted.result(timeout=10).status_code == 204
            answer = put.result(timeout=10)
    assert answer.status_code == 204, answer.text
    with relay.api() as api:
        assert api.get("/apps/contested").json()["gcRowsThreshold"] == 7
        assert api.delete("/apps/contested").status_code == 204
