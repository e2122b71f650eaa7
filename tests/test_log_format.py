"""The JSON log (``RELAY_LOG_FORMAT=json``) and the request id (``X-Request-Id``): a real Relay, real
HTTP, a simulated executor over a real socket. One Relay for the module (a start costs seconds)."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus

from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer, open_socket
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.cli import main

# An executor id that would forge a line, retitle the terminal (OSC 0), and reorder the text after it.
HOSTILE = "ex\x1b]0;owned\x07\nCRITICAL forged\u202e\x85\x7f-1"
# Its bad reply to list_workflows: the API answers 502 and relay.gateway warns, within the request.
BAD_REPLY = {"list_workflows": {"output": 5}}
TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
# A line of the text format, which the JSON format must not leave anywhere.
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")


@pytest.fixture(scope="module")
def relay(
    postgres: Postgres, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RelayProcess]:
    workdir = tmp_path_factory.mktemp("jsonlog")
    config = relay_yaml(free_port())
    relay = RelayProcess(workdir, postgres.create_database("relay"), config, env={"RELAY_LOG_FORMAT": "json"})
    failed_before = request.session.testsfailed
    relay.start()
    try:
        yield relay
    finally:
        relay.stop()
        if request.session.testsfailed > failed_before:
            print(f"--- {relay.instance_id} log ---\n{relay.log()[-6000:]}")


def log_lines(relay: RelayProcess) -> list[dict[str, Any]]:
    """The log's objects; the file also has ``relay serve``'s stdout (its banner), which is not the log."""
    lines = relay.log().splitlines()
    assert not [line for line in lines if TEXT_LINE.match(line)], "a line in the text format"
    return [json.loads(line) for line in lines if line.startswith("{")]


def until_answered(api: httpx.Client, path: str, headers: dict[str, str]) -> httpx.Response:
    """The answer once the executor is served (a 503 until the app's serving executors are read)."""

    def answered() -> httpx.Response | None:
        resp = api.get(path, headers=headers)
        return resp if resp.status_code != 503 else None

    found: httpx.Response = assert_eventually(answered, 10, what=f"{path} served")
    return found


def test_the_json_log_is_an_object_a_line_with_its_fields_and_an_executors_hostile_text_escaped(
    relay: RelayProcess,
) -> None:
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, HOSTILE, "answer", replies=BAD_REPLY), relay.api() as api:
        resp = until_answered(api, "/apps/ledger/workflows", {"X-Request-Id": "on-call-42"})
    assert resp.status_code == 502, resp.text
    assert resp.headers["x-request-id"] == "on-call-42" and resp.json()["requestId"] == "on-call-42", resp.text

    def about_it(message: str) -> list[dict[str, Any]]:
        return [line for line in log_lines(relay) if message in line["message"]]

    (disconnected,) = assert_eventually(lambda: about_it("is DISCONNECTED"), 10, what="the DISCONNECTED line")
    (connected,) = about_it(" connected (version v1")
    # Every line is one object of printable ASCII: the executor's line end, ESC, BEL, C1, DEL and
    # bidi control are JSON escapes (\u001b...), none of them raw for a terminal or a line reader.
    raw = relay.log_path.read_bytes()
    assert not re.search(rb"[\x00-\x09\x0b-\x1f\x7f-\xff]", raw), "a raw control or non-ASCII byte in the log"
    for line in (connected, disconnected):
        assert TIME.fullmatch(line["time"]) and line["level"] == "INFO" and line["logger"] == "relay.hub", line
        assert line["instance"] == relay.instance_id, line
        assert (line["org"], line["app"], line["executorId"]) == ("acme", "ledger", HOSTILE), line
        assert "requestId" not in line, "an executor's connection is no request's"
    assert "\\u001b]0;owned\\u0007\\nCRITICAL forged\\u202e\\u0085\\u007f-1" in raw.decode(), "JSON's own escapes"
    (warned,) = about_it("sent a bad list_workflows reply")
    assert warned["requestId"] == "on-call-42" and warned["level"] == "WARNING", warned
    assert warned["logger"] == "relay.gateway" and warned["instance"] == relay.instance_id, warned


@pytest.mark.parametrize(
    "sent",
    [b"x" * 129, b"with space", b"tab\there", b"caf\xc3\xa9", b"caf\xe9", b""],
    ids=["too-long", "space", "tab", "utf-8", "latin-1", "empty"],
)
def test_a_request_id_not_sane_is_replaced_not_echoed(relay: RelayProcess, sent: bytes) -> None:
    """Refused (a 401 of the guard, before any route): the id answered is a new one, in the header
    and the body alike; never the client's text, never an error for it."""
    resp = httpx.get(f"{relay.http}/v2/orgs/acme/apps", headers={"X-Request-Id": sent}, verify=TLS)
    assert resp.status_code == 401, resp.text
    answered = resp.headers["x-request-id"]
    assert answered.encode() != sent and str(uuid.UUID(answered)) == answered, answered
    assert resp.json()["requestId"] == answered, resp.text


def test_a_request_id_is_answered_by_every_kind_of_answer(relay: RelayProcess) -> None:
    """The guard's 401, a route's 404 and 422, a success, an unrouted path's 404, and a refused
    executor handshake: each answers the client's id (the longest allowed, every visible character)."""
    sent = ("".join(chr(c) for c in range(0x21, 0x7F)) * 2)[:128]
    cases = [
        ("/v2/orgs/acme/apps", "bad key", 401),
        ("/v2/orgs/acme/apps/nope", API_KEYS["acme"], 404),
        ("/v2/orgs/acme/audit?limit=-1", API_KEYS["acme"], 422),
        ("/v2/orgs/acme/apps", API_KEYS["acme"], 200),
        ("/nowhere", API_KEYS["acme"], 404),
    ]
    for path, key, status in cases:
        headers = {"X-Request-Id": sent, "Authorization": f"Bearer {key}"}
        resp = httpx.get(f"{relay.http}{path}", headers=headers, verify=TLS)
        assert (resp.status_code, resp.headers.get("x-request-id")) == (status, sent), (path, resp.text)
        if status >= 400:
            assert resp.json()["requestId"] == sent, (path, resp.text)

    async def refused_handshake() -> httpx.Headers | None:
        try:
            url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/bad-key"
            ws = await open_socket(url, additional_headers={"X-Request-Id": "handshake-1"})
        except InvalidStatus as exc:
            assert exc.response.status_code == 403
            return httpx.Headers(dict(exc.response.headers.raw_items()))
        await ws.close()
        return None

    refused = asyncio.run(refused_handshake())
    assert refused is not None and refused.get("x-request-id") == "handshake-1", refused


def test_the_cli_sends_a_request_id_and_names_it_in_a_5xx_error(
    relay: RelayProcess, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On-call holding the CLI's error line greps the log for the id it names: the id the CLI sent,
    which Relay's line about the failure carries."""
    for name in ("RELAY_URL", "RELAY_API_KEY", "RELAY_ORG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RELAY_URL", relay.http)
    monkeypatch.setenv("RELAY_API_KEY", API_KEYS["acme"])
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "cli-peer", "answer", replies=BAD_REPLY):

        def failed() -> str | None:
            capsys.readouterr()
            main(["workflows", "list", "ledger"])
            err = capsys.readouterr().err
            return err if err.startswith("relay: 502 ") else None

        err = assert_eventually(failed, 10, what="the CLI's 502")
    found = re.search(r" \(request id ([0-9a-f-]{36})\)$", err.strip())
    assert found, err
    request_id = found.group(1)
    warned = [line for line in log_lines(relay) if line.get("requestId") == request_id]
    assert [line["logger"] for line in warned] == ["relay.gateway"], warned
    assert "cli-peer sent a bad list_workflows reply" in warned[0]["message"], warned
