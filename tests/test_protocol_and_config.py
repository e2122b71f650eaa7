"""Frame parsing, executor URL paths and relay.yaml validation (no I/O)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from harness.ports import free_port
from relay.api.shapes import text_iso
from relay.auth import ADMIN, KeyRing, Permission, hash_key, new_key
from relay.config import parse_config
from relay.core.times import ms_iso, sdk_ms_time, sdk_time, us_iso
from relay.domain.alerts import _sdk_time
from relay.errors import ConfigError, ProtocolError
from relay.net.hub import parse_websocket_path
from relay.net.wire import clean_frame, executor_info
from relay.store.keys import grants_from_config
from relay_protocol import ExecutorInfoReply, ExecutorInfoRequest, MessageType, RecoveryRequest, decode_frame
from relay_protocol import ProtocolError as WireError


def test_requests_carry_type_and_a_fresh_request_id() -> None:
    a, b = json.loads(ExecutorInfoRequest().to_json()), json.loads(RecoveryRequest(executor_ids=["x"]).to_json())
    assert a["type"] == "executor_info" and b["type"] == "recovery"
    assert b["executor_ids"] == ["x"]
    assert a["request_id"] != b["request_id"]
    assert RecoveryRequest(executor_ids=["x"]).type is MessageType.RECOVERY


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{nope", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"type": "x"}', "request_id: required field missing"),
        ('{"type": 1, "request_id": "r"}', "type: expected str"),
        ("[" * 100_000, "nested too deeply|not valid JSON"),
    ],
)
def test_bad_frames_raise_protocol_error(text: str, why: str) -> None:
    with pytest.raises(WireError, match=why):
        decode_frame(text)


def test_executor_info_reply_as_the_python_sdk_sends_it() -> None:
    frame = {
        "type": "executor_info",
        "request_id": "r1",
        "executor_id": "e1",
        "application_version": "v1",
        "hostname": "h",
        "language": "python",
        "dbos_version": "3.2.0",
        "executor_metadata": {"k": "v"},
        "error_message": None,
    }
    info = executor_info(decode_frame(json.dumps(frame)), "r1")
    assert info == ExecutorInfoReply(
        request_id="r1",
        executor_id="e1",
        application_version="v1",
        hostname="h",
        language="python",
        dbos_version="3.2.0",
        executor_metadata={"k": "v"},
    )


@pytest.mark.parametrize(
    "change",
    [{"executor_id": None}, {"executor_id": ""}, {"application_version": 3}, {"error_message": "boom"},
     {"executor_metadata": "not a dict"}],
)  # fmt: skip
def test_executor_info_reply_missing_or_wrong_fields(change: dict[str, object]) -> None:
    frame = {"type": "executor_info", "request_id": "r", "executor_id": "e", "application_version": "v1"}
    with pytest.raises(ProtocolError):
        executor_info(decode_frame(json.dumps({**frame, **change})), "r")


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/websocket/ledger/k", ("ledger", "k")),
        ("/conductor/v1alpha1/websocket/ledger/k", ("ledger", "k")),
        ("/websocket/ledger/", ("ledger", "")),
        ("/websocket/ledger", ("ledger", "")),
        ("/websocket//k", None),
        ("/websocket/a/b/c", None),
        ("/other/ledger/k", None),
    ],
)
def test_websocket_paths(path: str, expected: tuple[str, str] | None) -> None:
    assert parse_websocket_path(path) == expected


GOOD = """
server: {host: 127.0.0.1, port: 9000}
liveness: {pingIntervalSecs: 0.2, pingWaitSecs: 0.5}
orgs:
  - name: acme
    conductorKeys: [{name: prod, sha256: "CONDUCTOR"}]
    apiKeys: [{name: ops, sha256: "API", role: admin}]
    apps:
      - {name: ledger, executorTimeoutSecs: 0.5, recoverToLatestVersion: true}
""".replace("CONDUCTOR", hash_key("c")).replace("API", hash_key("a"))


def test_a_good_file_with_fractional_durations() -> None:
    config = parse_config(GOOD)
    assert config.server.port == 9000
    assert config.liveness.ping_wait_secs == 0.5
    assert config.liveness.recovery_ack_timeout_secs == 30  # defaults fill the rest
    app = config.orgs[0].apps[0]
    assert (app.executor_timeout_secs, app.recover_to_latest_version) == (0.5, True)
    ring = KeyRing(grants_from_config(config))
    grant = ring.lookup("c")
    assert grant is not None and grant.org == "acme"
    assert grant.permissions == {Permission.WEBSOCKET_CONNECT}  # a conductor key is not an API key
    api = ring.lookup("a")
    assert api is not None and api.permissions == ADMIN  # role admin
    assert Permission.WEBSOCKET_CONNECT not in api.permissions  # ...and not a conductor key
    assert ring.lookup("") is None


def test_a_key_of_relay_yaml_with_an_empty_list_of_apps_reaches_no_app() -> None:
    """``apps: []`` is a key for no app, as the tokens API's ``appNames: []`` is and as the database's
    copy of the key reads (relay.store.keys.TokenRecord.grant); the ring an instance starts with, from
    relay.yaml before it reads the database, read it as every app."""
    config = parse_config(
        GOOD.replace("role: admin}", "role: admin, apps: []}").replace(
            'sha256: "' + hash_key("c") + '"}', 'sha256: "' + hash_key("c") + '", apps: []}'
        )
    )
    ring = KeyRing(grants_from_config(config))
    for key, permission in (("c", Permission.WEBSOCKET_CONNECT), ("a", Permission.APPLICATION_READ)):
        grant = ring.lookup(key)
        assert grant is not None and grant.apps == frozenset(), (key, grant)
        assert not grant.allows(permission, "ledger"), key


def test_an_empty_file_is_all_defaults() -> None:
    config = parse_config("")
    assert (config.server.port, config.liveness.ping_interval_secs, config.liveness.ping_wait_secs) == (8080, 20, 25)
    assert config.database.url is None


@pytest.mark.parametrize(
    ("text", "where", "why"),
    [
        ("server: {prot: 1}", "server.prot", "Extra inputs are not permitted"),
        ("server: {port: many}", "server.port", "valid integer"),
        ("liveness: {pingWaitSecs: -1}", "liveness.pingWaitSecs", "greater than 0"),
        ("liveness: {pingIntervalSecs: 30, pingWaitSecs: 25}", "liveness", "greater than pingIntervalSecs"),
        ("orgs: [{name: a, conductorKeys: [{name: k, sha256: abc}]}]", "orgs.0.conductorKeys.0.sha256", "64 hex"),
        ("orgs: [{name: a, apiKeys: [{name: k, sha256: '" + "0" * 64 + "', role: root}]}]", "role", "admin"),
        ("orgs: [{name: a, apps: [{name: x}, {name: x}]}]", "orgs.0", "unique"),
        ("- just\n- a list", "top level", "mapping"),
        # Days and seconds that PostgreSQL would compute now() minus: finite, and not beyond the bound.
        ("retention: {auditDays: .inf}", "retention.auditDays", "finite number"),
        ("retention: {auditDays: 1e7}", "retention.auditDays", "less than or equal to 36500"),
        ("retention: {executorIdsDays: .nan}", "retention.executorIdsDays", "finite number"),
        (
            "orgs: [{name: a, apps: [{name: x, alerts: [{kind: ExecutorDead, minIntervalSecs: .inf}]}]}]",
            "orgs.0.apps.0.alerts.0.minIntervalSecs",
            "finite number",
        ),
        (
            "orgs: [{name: a, apps: [{name: x, alerts: [{kind: ExecutorDead, minIntervalSecs: 2e11}]}]}]",
            "orgs.0.apps.0.alerts.0.minIntervalSecs",
            "less than or equal to 315360000",
        ),
        (
            "orgs: [{name: a, apps: [{name: x, alerts: [{kind: WorkflowFailure, windowSecs: 1e999}]}]}]",
            "orgs.0.apps.0.alerts.0.windowSecs",
            "finite number",
        ),
        ("orgs: [{name: a, apps: [{name: x, executorTimeoutSecs: .inf}]}]", "executorTimeoutSecs", "finite"),
        # Every duration of every section: an infinite handshake timeout or ping wait would never fire.
        ("server: {handshakeTimeoutSecs: .inf}", "server.handshakeTimeoutSecs", "finite number"),
        ("server: {eventHeartbeatSecs: 1e999}", "server.eventHeartbeatSecs", "finite number"),
        ("server: {keepAliveSecs: 1000000000000}", "server.keepAliveSecs", "less than or equal to 315360000"),
        ("liveness: {pingWaitSecs: .inf}", "liveness.pingWaitSecs", "finite number"),
        # A quarter of the lease, in milliseconds, is a PostgreSQL statement_timeout (at most 2^31 - 1).
        ("liveness: {instanceLeaseSecs: 1e7}", "liveness.instanceLeaseSecs", "less than or equal to 604800"),
        ("liveness: {repairIntervalSecs: 1.0e10}", "liveness.repairIntervalSecs", "less than or equal to 315360000"),
        ("reconciler: {intervalSecs: .inf}", "reconciler.intervalSecs", "finite number"),
        ("metrics: {appFiguresWindowSecs: .nan}", "metrics.appFiguresWindowSecs", "finite number"),
        # Sizes and counts: finite, and within what one message or a 32-bit count holds.
        ("server: {maxFrameBytes: 100000000000000000000}", "server.maxFrameBytes", "less than or equal to 1073741824"),
        ("server: {maxEventStreams: 4294967296}", "server.maxEventStreams", "less than or equal to 2147483647"),
        ("alerts: {maxAttempts: 4294967296}", "alerts.maxAttempts", "less than or equal to 2147483647"),
        ("server: {port: [", "", "not valid YAML"),
        # A key given twice: YAML keeps one silently (a second `orgs:` appended would drop the first).
        ("server: {port: 1}\nliveness: {}\nserver: {host: x}", "line 3", "the key 'server' is given twice"),
        ("orgs: [{name: a, apps: [{name: x,\n  name: y}]}]", "line 2", "'name' is given twice"),
        # An app's name as the API takes it (relay.core.ids.APP_NAME_RULE): a path segment, readable.
        *[
            (f"orgs: [{{name: a, apps: [{{name: {name}}}]}}]", "orgs.0.apps.0.name", "not '.' or '..'")
            for name in (
                *('""', '".."', "'.'", '"a/b"', '"a\\nb"', '" x"', '"x "', '"' + "x" * 257 + '"'),
                *('"100%41"', '"a?b"', '"a#b"', '"a\\\\b"'),  # "%", "?", "#" and "\" mean something in SDKs' URLs
            )
        ],
        # A webhook's secret with a control character: its receiver would refuse every delivery as forged.
        *[
            (
                f"orgs: [{{name: a, apps: [{{name: x, alerts: [{{kind: ExecutorDead, webhook: 'https://h.example/r', "
                f'secret: "{secret}"}}]}}]}}]',
                "orgs.0.apps.0.alerts.0.secret",
                "none of them a control character",
            )
            for secret in ("0123456789abcdef\\n", "0123456789\\r\\nabcdef", "0123456789abcdef\\x00")
        ],
    ],
)
def test_bad_files_name_the_field_and_the_reason(text: str, where: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "conf/relay.yaml")
    message = str(info.value)
    assert message.startswith("conf/relay.yaml: ")
    assert where in message and why in message


def test_a_secret_from_the_environment_is_checked_as_one_in_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """secretEnv's value was taken as it was: a newline (``$(cat secret-file)`` keeps none, an editor's
    export may), or a secret shorter than a secret given in the file may be."""
    text = """orgs: [{name: a, apps: [{name: x, alerts: [{kind: ExecutorDead, webhook: 'https://hooks.example/r',
                                                         secretEnv: RELAY_TEST_HOOK_SECRET}]}]}]"""
    for bad in ("0123456789abcdef\n", "0123456789abcdef\r", "short"):
        monkeypatch.setenv("RELAY_TEST_HOOK_SECRET", bad)
        with pytest.raises(ConfigError) as info:
            parse_config(text)
        assert "RELAY_TEST_HOOK_SECRET holds no secret" in str(info.value) and bad not in str(info.value)
    monkeypatch.setenv("RELAY_TEST_HOOK_SECRET", "0123456789 abcdef")
    assert parse_config(text).orgs[0].apps[0].alerts[0].signing_secret() == "0123456789 abcdef"


def test_command_line_overrides_are_validated_as_the_file_is() -> None:
    """``relay serve --host/--port/--database-url`` (and RELAY_DATABASE_URL) replace fields of the
    loaded file: the result is checked as the file was, with the same error."""
    config = parse_config(GOOD)
    changed = config.with_overrides(host="0.0.0.0", port=9001, database_url="postgresql://db/relay")
    assert (changed.server.host, changed.server.port, changed.database.url) == (
        "0.0.0.0",
        9001,
        "postgresql://db/relay",
    )
    assert changed.orgs == config.orgs and changed.liveness == config.liveness  # the rest as it was
    assert config.with_overrides() == config
    with pytest.raises(ConfigError) as info:
        config.with_overrides(port=70000)
    assert "server.port" in str(info.value) and "less than or equal to 65535" in str(info.value)
    with pytest.raises(ConfigError, match=r"server\.host"):
        config.with_overrides(host=["not", "a", "host"])  # type: ignore[arg-type]


def test_new_keys_are_random_and_hashed() -> None:
    (k1, h1), (k2, h2) = new_key(), new_key()
    assert k1 != k2 and len(k1) >= 40
    assert h1 == hash_key(k1) and h2 == hash_key(k2) and len(h1) == 64


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1700000000123", "2023-11-14T22:13:20.123Z"),
        (1700000000000, "2023-11-14T22:13:20.000Z"),  # a whole second sorts among the others
        (9141256440926, "2259-09-04T13:54:00.926Z"),  # through a float: .926001
        (-1, "1969-12-31T23:59:59.999Z"),
        (253402300799999, "9999-12-31T23:59:59.999Z"),
        (253402300800000, None),  # past year 9999
        ("soon", None),
        (None, None),
    ],
)
def test_epoch_milliseconds_as_iso_8601_exactly(value: str | int | None, expected: str | None) -> None:
    assert ms_iso(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (datetime(2026, 12, 6, 4, 21, 27, tzinfo=UTC), "2026-12-06T04:21:27.000000Z"),  # a whole second
        (datetime(2026, 12, 6, 4, 21, 27, 80000, tzinfo=UTC), "2026-12-06T04:21:27.080000Z"),
        (datetime(2026, 12, 6, 5, 21, 27, 1, tzinfo=timezone(timedelta(hours=1))), "2026-12-06T04:21:27.000001Z"),
        (datetime(2026, 12, 6, 4, 21, 27), "2026-12-06T04:21:27.000000Z"),  # no zone: UTC
        (datetime(1, 1, 1, tzinfo=UTC), "0001-01-01T00:00:00.000000Z"),
        (datetime.max.replace(tzinfo=UTC), "9999-12-31T23:59:59.999999Z"),
        (datetime(1, 1, 1, 0, 30, tzinfo=timezone(timedelta(hours=1))), "0001-01-01T00:00:00.000000Z"),  # before year 1
        (None, None),
    ],
)
def test_relays_own_times_always_carry_six_fraction_digits(value: datetime | None, expected: str | None) -> None:
    assert us_iso(value) == expected


def test_times_of_each_kind_sort_as_strings_as_they_do_as_times() -> None:
    moments = [datetime(2026, 12, 6, 4, 21, 27, us, tzinfo=UTC) for us in (0, 80000, 999999)]
    moments += [datetime(2026, 12, 6, 4, 21, 28, tzinfo=UTC), datetime(9999, 1, 1, tzinfo=UTC)]
    assert sorted(moments, key=us_iso) == moments
    millis = [1700000000000, 1700000000080, 1700000000999, 1700000001000]
    assert sorted(millis, key=lambda ms: ms_iso(ms) or "") == millis


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2026-12-06T05:21:27+01:00", "2026-12-06T04:21:27.000000Z"),  # a schedule's last run, in its zone
        ("2026-12-06T04:21:27.5", "2026-12-06T04:21:27.500000Z"),  # no offset: UTC, as the SDK reads it
        ("yesterday", None),
        (None, None),
    ],
)
def test_a_time_the_sdk_keeps_as_text_is_served_as_relays_own(value: str | None, expected: str | None) -> None:
    assert text_iso(value) == expected


def test_an_alert_rules_bounds_reach_the_executor_as_the_sdk_parses_them() -> None:
    # Python 3.10's fromisoformat, which dbos 3.2 allows, takes no "Z": the form of the API's filters.
    assert _sdk_time(1700000000.0) == sdk_time(datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC))
    assert _sdk_time(1700000000.0) == "2023-11-14T22:13:20.000000+00:00"


@pytest.mark.parametrize(
    "epoch_ms", [0, 1, 999, 1000, 1_700_000_000_080, 1_764_979_199_999, 253_402_300_799_999, -1, -86_400_001]
)
def test_epoch_milliseconds_reach_the_sdk_as_they_always_did(epoch_ms: int) -> None:
    """The app figures' and retention checks' bounds, once written by workflows/services.sdk_iso with
    strftime: the same string, character for character (and one the SDK parses)."""
    seconds, millis = divmod(epoch_ms, 1000)
    before = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}+00:00"
    assert sdk_ms_time(epoch_ms) == before
    assert datetime.fromisoformat(before) == datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=epoch_ms)


def test_lone_surrogates_are_replaced_where_frames_arrive() -> None:
    workflow = '{"WorkflowUUID": "a\\ud800b", "Name": "\\ud83d\\ude00"}'
    text = '{"type": "list_workflows", "request_id": "r", "output": [' + workflow + "]}"
    frame = clean_frame(text, decode_frame(text))
    assert frame["output"][0] == {"WorkflowUUID": "a\ufffdb", "Name": "\U0001f600"}
    plain = '{"type": "list_workflows", "request_id": "r", "output": []}'
    decoded = decode_frame(plain)
    assert clean_frame(plain, decoded) is decoded  # no escape, nothing to look at


def test_a_frame_nested_as_deep_as_the_decoder_takes_is_cleaned() -> None:
    depth = 900  # the decoder's limit is the interpreter's (1000), less this test's own frames
    text = '{"type": "list_workflows", "request_id": "r", "output": ' + "[" * depth + '"\\ud800"' + "]" * depth + "}"
    frame = clean_frame(text, decode_frame(text))
    inner = frame["output"]
    for _ in range(depth - 1):
        inner = inner[0]
    assert inner == ["\ufffd"]


# -- Reviewer's confirmations (ops): each fails on the code as it is. ------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "liveness: {instanceLeaseSecs: .inf}",  # int(inf) in the lease's statement timeout: OverflowError
        "liveness: {instanceLeaseSecs: 1e12}",  # a statement_timeout PostgreSQL refuses
        # Within ten years (MAX_SECS), but a quarter of it in milliseconds (the lease connection's
        # statement_timeout) is beyond PostgreSQL's 2^31 - 1.
        "liveness: {instanceLeaseSecs: 1e7}",
    ],
)
def test_relay_serve_refuses_an_unusable_duration_as_a_bad_file(text: str, tmp_path: Path, relay_db: str) -> None:
    """README, Configuration: "A bad file gets one message naming the file, the field and the reason,
    and exit code 2". The liveness and server durations have no upper bound and take .inf (the
    retention and alert ones are bounded, MAX_SECS, and finite): such a file is accepted, and the start
    then fails with a traceback and uvicorn's exit code 3, the code of an instance fenced out."""
    path = tmp_path / "relay.yaml"
    path.write_text(text + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RELAY_CONFIG", "RELAY_DATABASE_URL")}
    result = subprocess.run(
        [sys.executable, "-m", "relay", "serve", "--config", str(path), "--database-url", relay_db,
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    assert result.returncode == 2, result.stderr[-1500:]
    assert "liveness.instanceLeaseSecs" in result.stderr


def test_a_merge_may_still_override_what_it_brings() -> None:
    """YAML's merge key (``<<: *base``) is for overriding: a key it brings, given again, is no duplicate."""
    merged = parse_config("server: {<<: {port: 1, host: a.example}, port: 2}").server
    assert (merged.port, merged.host) == (2, "a.example")


def test_a_key_given_twice_is_an_error_not_a_silent_override() -> None:
    """Unknown fields are errors "so that a typo never silently falls back to a default" (relay/config.py);
    a section written twice (a second `orgs:` appended to a file) silently drops the first: here the org
    acme and its keys, which then stop working at the next start."""
    text = GOOD + "orgs: [{name: globex}]\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, "relay.yaml")
    assert "orgs" in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://relay:s3%40cret@db.internal:5433/relay?sslmode=require",
        "host=db.internal port=5433 user=relay password='s3 cret' dbname=relay sslmode=disable",
        "postgresql://relay@primary:5432,standby:5433/relay?target_session_attrs=read-write",
        "host=primary,standby port=5432,5433 dbname=relay",
        "postgresql:///relay?host=/var/run/postgresql",
        "postgresql://relay@[::1]:5432/relay",
    ],
    ids=["url", "key-value", "multi-host-url", "multi-host-pairs", "socket-folder", "ipv6"],
)
def test_the_database_url_reaches_sqlalchemy_as_libpq_reads_it(url: str) -> None:
    """DBOS's engine and the grace-period starter take the database URL as SQLAlchemy reads it:
    libpq's key=value pairs and several hosts included (SQLAlchemy refused the first and took a
    host list for one host with a bad port), every parameter as libpq has it, TCP settings added."""
    import sqlalchemy as sa
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from relay.store.db import with_tcp_settings
    from workflows.dburl import sqlalchemy_url_text

    conninfo = with_tcp_settings(url)
    assert conninfo_to_dict(conninfo)["tcp_user_timeout"] == "30000"
    dialect = sa.dialects.registry.load("postgresql.psycopg")()
    _, kwargs = dialect.create_connect_args(sa.make_url(sqlalchemy_url_text(conninfo)))
    given = {name: str(value) for name, value in conninfo_to_dict(conninfo).items()}
    assert conninfo_to_dict(make_conninfo("", **kwargs)) == given
