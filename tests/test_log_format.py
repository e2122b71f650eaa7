"""The JSON log (``RELAY_LOG_FORMAT=json``) and the request id (``X-Request-Id``): a real Relay, real
HTTP, a simulated executor over a real socket. One Relay for the module (a start costs seconds)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import uuid
from collections.abc import Iterator, MutableMapping
from typing import Any

import httpx
import pytest
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, StreamingResponse
from websockets.exceptions import InvalidStatus

from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer, open_socket
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.api import build_api
from relay.cli import main
from relay.config import ServerConfig
from relay.logs import LOG_FORMAT, EscapingFormatter, RequestIds
from relay.net.guard import HttpGuard
from relay.net.paths import PathKeeper
from relay.net.server import RelayApp
from relay.problem import INTERNAL_ERROR

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


def broken_relay() -> RelayApp:
    """The ASGI app as relay serve puts it together (relay.runtime), of an API with routes that fail
    as a defect of Relay's would, and a key ring whose lookup fails. Relay has no route or hook to
    fail on purpose, nor should it grow one for a test: these are added to the real app here."""
    api = build_api(None)

    @api.get("/broken/before")
    async def before() -> None:
        raise RuntimeError("a defect before the answer")

    @api.get("/broken/after")
    async def after() -> JSONResponse:
        return JSONResponse({"ok": True}, background=BackgroundTask(fail, "a defect after the answer"))

    @api.get("/broken/midway")
    async def midway() -> StreamingResponse:
        async def parts() -> Any:
            yield b"first part"
            fail("a defect in the middle of the answer")

        return StreamingResponse(parts())

    def lookup(key: str | None) -> None:
        fail("a defect in the key ring")

    def fail(why: str) -> None:
        raise RuntimeError(why)

    http = PathKeeper(HttpGuard(api, ServerConfig(), lookup))
    return RelayApp(http, http)  # no WebSocket is opened here


@pytest.fixture
def relay_log() -> Iterator[io.StringIO]:
    """Every line logged, as relay serve's handler writes it (the text format, with request ids)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    handler.addFilter(RequestIds())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield stream
    finally:
        root.removeHandler(handler)


@pytest.mark.parametrize(
    ("path", "status", "outcome", "raised"),
    [
        ("/broken/before", 500, "answered 500", "a defect before the answer"),
        ("/v2/orgs/acme/apps", 500, "answered 500", "a defect in the key ring"),
        ("/broken/after", 200, "answered 200", "a defect after the answer"),
    ],
    ids=["route", "guard", "after-the-answer"],
)
def test_an_internal_error_is_a_problem_with_its_request_id_logged_once_with_it(
    relay_log: io.StringIO, path: str, status: int, outcome: str, raised: str
) -> None:
    """An exception Relay did not expect (a defect of its own, in a route or below the routes) is
    answered 500 as every other error is, a problem with the request's id, and logged once at ERROR
    with the method, the path, the id and the traceback. Starlette answered it text/plain "Internal
    Server Error" and raised it again, for uvicorn to log "Exception in ASGI application" with the
    traceback and without the id (and close the connection). Served through httpx's ASGITransport,
    which raises what the app raises, as uvicorn would log it: no test serves an app in-process
    with uvicorn, and a Relay process has nothing that fails on purpose."""

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=broken_relay())
        async with httpx.AsyncClient(transport=transport, base_url="http://relay", verify=TLS) as client:
            return await client.get(path, headers={"X-Request-Id": "on-call-500"})

    resp = asyncio.run(get())
    assert resp.status_code == status and resp.headers["x-request-id"] == "on-call-500", resp.text
    if status == 500:
        assert resp.headers["content-type"] == "application/problem+json", resp.text
        assert resp.json() == {
            "type": "about:blank",
            "title": "Internal Server Error",
            "status": 500,
            "detail": INTERNAL_ERROR,
            "requestId": "on-call-500",
        }
    lines = relay_log.getvalue().splitlines()
    assert [line for line in lines if " ERROR " in line] == [lines[0]], lines
    assert lines[0].endswith(f" ERROR relay.http: GET {path}: an internal error, {outcome} [req=on-call-500]"), lines
    assert lines.count("Traceback (most recent call last):") == 1 and lines[1].startswith("Traceback"), lines
    assert lines[-1] == f"RuntimeError: {raised}", lines


def test_an_internal_error_in_the_middle_of_an_answer_is_logged_once_and_raised_no_further(
    relay_log: io.StringIO,
) -> None:
    """The answer begun (a stream's first part) cannot become a 500: the line says it was cut short,
    and the app returns, for the server to close the connection (uvicorn says so in a line of its
    own, without the traceback). ASGITransport refuses an answer left unfinished, so the app is
    served here as a server serves it: its messages collected."""
    sent: list[MutableMapping[str, Any]] = []
    received: list[dict[str, Any]] = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if received:
            return received.pop()
        await asyncio.Event().wait()  # the client stays connected: nothing more comes
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    headers = [(b"host", b"relay"), (b"x-request-id", b"on-call-cut")]
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/broken/midway",
        "raw_path": b"/broken/midway",
        "query_string": b"",
        "headers": headers,
        "scheme": "http",
        "http_version": "1.1",
        "server": ("relay", 80),
        "client": ("127.0.0.1", 1),
        "root_path": "",
        "asgi": {"version": "3.0"},
    }
    asyncio.run(broken_relay()(scope, receive, send))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"], sent
    assert sent[0]["status"] == 200 and sent[1]["more_body"] is True, sent
    lines = relay_log.getvalue().splitlines()
    assert [line for line in lines if " ERROR " in line] == [lines[0]], lines
    assert lines[0].endswith(
        " ERROR relay.http: GET /broken/midway: an internal error, its answer (200) cut short [req=on-call-cut]"
    ), lines
    assert lines.count("Traceback (most recent call last):") == 1, lines
    assert lines[-1] == "RuntimeError: a defect in the middle of the answer", lines


def test_a_recovery_an_operator_asks_for_is_no_part_of_the_request(relay: RelayProcess) -> None:
    """The request's own lines carry its id; the recovery it starts does not: a DBOS workflow, which
    runs as a task of the request's context, waits for hours and sends frames that serve others'
    recoveries too (its lines name it by ``recoveryId``). Without a peer it says it waits for one."""
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['globex']}"
    with relay.api("globex") as api:
        with SimulatedPeer(url, "lone", "answer"):
            assert_eventually(lambda: api.get("/apps/ledger/executors/lone").status_code == 200, 10)
        assert_eventually(
            lambda: api.get("/apps/ledger/executors/lone").json()["state"] == "DISCONNECTED", 10, what="DISCONNECTED"
        )
        resp = api.post("/apps/ledger/executors/lone/recover", headers={"X-Request-Id": "recover-7"})
    assert resp.status_code == 202, resp.text
    rid = resp.json()["recoveryId"]

    def about_it(words: str) -> list[dict[str, Any]]:
        return [line for line in log_lines(relay) if line.get("recoveryId") == rid and words in line["message"]]

    (waits,) = assert_eventually(lambda: about_it("waiting_for_peer"), 10, what="the recovery's wait for a peer")
    (requested,) = about_it("requested by")
    assert requested["requestId"] == "recover-7", requested
    assert "requestId" not in waits, waits
