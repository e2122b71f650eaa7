"""Hostile HTTP: what a request costs before it is authenticated, slow clients, and what the
open endpoints give away. A real Relay, real sockets; raw ones where a well-behaved client
would not do what an attacker does."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import select
import socket
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import psutil
import psycopg
import pytest
import yaml
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import InvalidStatus

from harness.keys import API_KEYS, CONDUCTOR_KEYS, VIEWER_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, off_loop, open_socket
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.net.guard import BodyLimit, bearer_key, body_limit
from tests.prom import sample

StartRelay = Callable[..., RelayProcess]

MiB = 1024 * 1024
CAP = 2  # maxConcurrentRequests
HANDSHAKE_CAP = 5  # maxPendingHandshakes
KEEP_ALIVE = 3  # keepAliveSecs (headerTimeoutSecs is 1)
ADMIN = {"Authorization": f"Bearer {API_KEYS['acme']}"}
PROBLEM_KEYS = {"type", "title", "status", "detail"}


@pytest.fixture(scope="module")
def relay(
    postgres: Postgres, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RelayProcess]:
    """One Relay with tight limits for the whole module (each start costs seconds)."""
    config = relay_yaml(free_port(), handshake=2.0, instanceLeaseSecs=1.0)
    config["server"].update(
        headerTimeoutSecs=1, keepAliveSecs=KEEP_ALIVE, maxConcurrentRequests=CAP, maxPendingHandshakes=HANDSHAKE_CAP
    )
    relay = RelayProcess(tmp_path_factory.mktemp("guard"), postgres.create_database("relay"), config)
    failed_before = request.session.testsfailed
    relay.start()
    yield relay
    relay.stop()
    if request.session.testsfailed > failed_before:
        print(f"--- {relay.instance_id} log ---\n{relay.log()[-6000:]}")


# -- raw HTTP ---------------------------------------------------------------------------------


def connect(relay: RelayProcess, timeout: float = 5) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", relay.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(method: str, path: str, *headers: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: relay", *headers, "", ""]).encode()


def response(sock: socket.socket, method: str = "PATCH") -> tuple[http.client.HTTPResponse, bytes]:
    resp = http.client.HTTPResponse(sock, method=method)
    resp.begin()
    return resp, resp.read()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def pump(sock: socket.socket, total: int, piece: bytes) -> int:
    """Send ``piece`` until ``total`` bytes are sent or the peer stops taking them; bytes sent."""
    sent = 0
    try:
        while sent < total:
            sock.sendall(piece)
            sent += len(piece)
    except OSError:  # reset or broken pipe: Relay closed the connection
        pass
    return sent


def closed_within(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the peer sends until it closes, and when it closed (seconds from now)."""
    start = time.monotonic()
    sock.settimeout(timeout)
    received = b""
    try:
        while data := sock.recv(65536):
            received += data
    except ConnectionResetError:  # closed with some of what the client sent unread
        pass
    return received, time.monotonic() - start


def assert_problem(resp: http.client.HTTPResponse | httpx.Response, body: bytes, status: int) -> dict[str, object]:
    assert resp.status == status if isinstance(resp, http.client.HTTPResponse) else resp.status_code == status
    assert resp.headers["content-type"] == "application/problem+json"
    problem = json.loads(body)
    assert PROBLEM_KEYS <= problem.keys() and problem["type"] == "about:blank" and problem["status"] == status
    return dict(problem)


def rss(relay: RelayProcess) -> int:
    assert relay.proc is not None
    return psutil.Process(relay.proc.pid).memory_info().rss


# -- requests that cost nothing until authenticated ----------------------------------------------


def test_an_unauthenticated_64_mib_body_is_refused_before_it_is_sent(relay: RelayProcess) -> None:
    path = "/v2/orgs/acme/apps/ledger"
    for _ in range(3):  # warm up whatever a first request loads
        httpx.patch(f"{relay.http}{path}", json={"executorTimeoutSecs": 30}, verify=TLS)
    before = rss(relay)
    sent = []
    for framing in ("Content-Length: 67108864", "Transfer-Encoding: chunked"):
        with connect(relay) as sock:
            sock.sendall(head("PATCH", path, "Content-Type: application/json", framing))
            # The answer comes before a byte of the body has left: Relay cannot have read it.
            resp, body = response(sock)
            assert_problem(resp, body, 401)
            assert resp.headers["www-authenticate"] == "Bearer"
            assert resp.headers["connection"] == "close"
            piece = b"[" * MiB if framing.startswith("Content") else chunk(b"[" * MiB)
            sent.append(pump(sock, 64 * MiB, piece))
    growth = rss(relay) - before
    print(f"RSS growth after two unauthenticated 64 MiB requests: {growth / MiB:.2f} MiB; sent {sent}")
    assert growth < 16 * MiB
    assert all(n < 64 * MiB for n in sent), "Relay went on reading the body of a refused request"


def test_unauthenticated_requests_under_v2_and_conductor_v2_get_401_problems(relay: RelayProcess) -> None:
    for path in ("/v2/orgs/acme/apps", "/conductor/v2/orgs/acme/apps", "/v2/anything"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEYS["acme"]}):
            resp = httpx.get(f"{relay.http}{path}", headers=headers, verify=TLS)
            assert_problem(resp, resp.content, 401)
            assert resp.json()["title"] == "Unauthorized"
    # A valid key of another org passes the guard; the route refuses it (403).
    resp = httpx.get(f"{relay.http}/v2/orgs/globex/apps", headers=ADMIN, verify=TLS)
    assert resp.status_code == 403


def test_an_authenticated_body_over_the_limit_gets_413(relay: RelayProcess) -> None:
    path = "/v2/orgs/acme/apps/ledger"
    auth = f"Authorization: Bearer {API_KEYS['acme']}"
    with connect(relay) as sock:
        sock.sendall(head("PATCH", path, auth, "Content-Type: application/json", f"Content-Length: {2 * MiB}"))
        resp, body = response(sock)  # at once, on the length alone
    problem = assert_problem(resp, body, 413)
    assert problem["maxBytes"] == MiB

    with connect(relay) as sock:
        sock.sendall(head("PATCH", path, auth, "Content-Type: application/json", "Transfer-Encoding: chunked"))
        sent = 0
        while not select.select([sock], [], [], 0)[0] and sent < 16 * MiB:
            if not pump(sock, 1, chunk(b" " * 65536)):
                break
            sent += 65536
        resp, body = response(sock)
    assert_problem(resp, body, 413)
    assert MiB < sent < 16 * MiB, sent  # answered once past the limit (give or take socket buffers)

    with relay.api() as api:  # a body within the limit is served as before
        small = api.patch("/apps/ledger", json={"executorTimeoutSecs": 31})
        assert small.status_code == 200, small.text
        assert small.json()["executorTimeoutSecs"] == 31
        padded = b'{"executorTimeoutSecs": 30}'.ljust(MiB)
        at_limit = api.patch("/apps/ledger", content=padded, headers={"Content-Type": "application/json"})
        assert at_limit.status_code == 200, at_limit.text


def test_concurrent_requests_beyond_the_cap_get_503_and_the_probes_still_answer(relay: RelayProcess) -> None:
    body = json.dumps({"executorTimeoutSecs": 30}).encode().ljust(200)
    slow = [connect(relay) for _ in range(CAP)]
    try:
        for sock in slow:  # in progress until their bodies end
            sock.sendall(
                head("PATCH", "/v2/orgs/acme/apps/ledger", f"Authorization: Bearer {API_KEYS['acme']}",
                     "Content-Type: application/json", f"Content-Length: {len(body)}") + body[:10]
            )  # fmt: skip

        def refused() -> httpx.Response | None:
            resp = httpx.get(f"{relay.http}/v2/orgs/acme/apps", headers=ADMIN, verify=TLS)
            return resp if resp.status_code == 503 else None

        resp = assert_eventually(refused, 5, what="a third request refused")
        assert resp is not None
        assert_problem(resp, resp.content, 503)
        assert resp.headers["retry-after"] == "1"
        assert httpx.get(f"{relay.http}/readyz", verify=TLS).status_code == 200
        assert httpx.get(f"{relay.http}/healthz", verify=TLS).status_code == 200
        for sock in slow:
            sock.sendall(body[10:])
            answer, text = response(sock)
            assert answer.status == 200, text
    finally:
        for sock in slow:
            sock.close()
    assert httpx.get(f"{relay.http}/v2/orgs/acme/apps", headers=ADMIN, verify=TLS).status_code == 200


def test_bodies_that_never_come_hold_no_request_slot_past_the_body_timeout(start_relay: StartRelay) -> None:
    """Headers whole, a ``Content-Length``, then nothing (a client that died mid-upload, or one
    holding slots on purpose): each such request held one of ``maxConcurrentRequests`` for as long
    as its socket stayed open, and a few made Relay answer everyone 503. After ``bodyTimeoutSecs``
    each gets 408 and its connection is closed; the slots are free again."""
    config = relay_yaml(free_port())
    config["server"].update(maxConcurrentRequests=CAP, bodyTimeoutSecs=1.5)
    relay = start_relay(config)
    held = [connect(relay) for _ in range(CAP)]
    try:
        for sock in held:
            sock.sendall(
                head("PATCH", "/v2/orgs/acme/apps/ledger", f"Authorization: Bearer {API_KEYS['acme']}",
                     "Content-Type: application/json", "Content-Length: 100") + b"{"
            )  # fmt: skip
        assert_eventually(
            lambda: httpx.get(f"{relay.http}/v2/orgs/acme/apps", headers=ADMIN, verify=TLS).status_code == 503, 5
        )
        started = time.monotonic()
        for sock in held:
            received, _ = closed_within(sock, 10)
            assert received.startswith(b"HTTP/1.1 408 "), received[:200]
            assert b"not complete within 1.5s" in received
        assert time.monotonic() - started < 5
    finally:
        for sock in held:
            sock.close()
    assert httpx.get(f"{relay.http}/v2/orgs/acme/apps", headers=ADMIN, verify=TLS).status_code == 200
    with relay.api() as api:  # nothing was changed by the bodies that never came
        assert api.get("/apps/ledger").json()["executorTimeoutSecs"] != 100


# -- slow clients ------------------------------------------------------------------------------


def test_a_client_that_never_finishes_its_headers_is_closed(relay: RelayProcess) -> None:
    with connect(relay) as partial, connect(relay) as idle:
        partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        assert httpx.get(f"{relay.http}/healthz", verify=TLS).json() == {"status": "ok"}  # others are served meanwhile
        received, after = closed_within(partial, 3)
        assert received.startswith(b"HTTP/1.1 408 ")
        assert after < 2.0  # headerTimeoutSecs is 1
        received, _ = closed_within(idle, 3)
        assert received == b""  # nothing asked, nothing answered: just closed

    with connect(relay) as keep_alive:  # each request on a kept-alive connection has its own deadline
        keep_alive.sendall(head("GET", "/healthz"))
        resp, body = response(keep_alive, "GET")
        assert resp.status == 200 and json.loads(body) == {"status": "ok"}
        time.sleep(1.5)  # idle past headerTimeoutSecs: the connection is kept (keepAliveSecs)
        before = time.monotonic()  # the request's deadline starts when Relay reads its first bytes, after this
        keep_alive.sendall(b"GET /healthz HTTP/1.1\r\n")
        begun = time.monotonic()
        received, _ = closed_within(keep_alive, 3)
        closed = time.monotonic()
        assert received.startswith(b"HTTP/1.1 408 ")
        assert closed - before > 0.8 and closed - begun < 2.0


def test_a_request_pipelined_behind_a_long_response_gets_no_408_in_the_middle_of_it(relay: RelayProcess) -> None:
    """The header deadline of a request pipelined behind a response in progress starts when that
    response ends: a 408 written meanwhile would land inside the response before it. Here the
    response is an event stream, which does not end."""
    with connect(relay) as sock:
        stream = head("GET", "/v2/orgs/acme/events", f"Authorization: Bearer {API_KEYS['acme']}")
        sock.sendall(stream + b"GET /healthz HTTP/1.1\r\n")  # the second request's headers never end
        sock.settimeout(0.5)
        received = b""
        deadline = time.monotonic() + 2.5  # past headerTimeoutSecs (1 s)
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            assert data, "the connection was closed under the stream"
            received += data
        assert received.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in received
        assert b"408" not in received


def test_a_request_pipelined_behind_a_short_response_has_its_deadline_after_it(relay: RelayProcess) -> None:
    with connect(relay) as sock:
        before = time.monotonic()  # the deadline starts at the first response's end, after this
        sock.sendall(head("GET", "/healthz") + b"GET /healthz HTTP/1.1\r\n")
        received, after = closed_within(sock, 4)
        closed = time.monotonic()
    first, _, rest = received.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in rest
    assert closed - before > 0.8 and after < 2.5  # headerTimeoutSecs is 1, counted from the first response's end


def test_an_idle_kept_alive_connection_lasts_keep_alive_secs_not_the_header_deadline(relay: RelayProcess) -> None:
    """A client's pool (httpx: 5 s) or a balancer (AWS: 60 s) must drop an idle connection before
    Relay does (keepAliveSecs, 75 s by default), or a request sent as Relay closes is lost. Here
    keepAliveSecs is 3 s and headerTimeoutSecs 1 s."""
    with connect(relay) as sock:
        for _ in range(2):  # idle past the header deadline between requests: the connection is kept
            asked = time.monotonic()  # Relay's idle time starts when its answer is written, after this
            sock.sendall(head("GET", "/healthz"))
            resp, body = response(sock, "GET")
            assert resp.status == 200 and json.loads(body) == {"status": "ok"}
            answered = time.monotonic()  # and before this
            time.sleep(1.5)
        received, _ = closed_within(sock, KEEP_ALIVE + 3)
        closed = time.monotonic()
        assert received == b""  # idle: closed without a word
        assert closed - asked > KEEP_ALIVE - 0.3 and closed - answered < KEEP_ALIVE + 1.5


def test_headers_over_the_size_limit_get_431(relay: RelayProcess) -> None:
    with connect(relay) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: ")
        time.sleep(0.1)  # the request has begun on Relay's side
        pump(sock, 1024 * 1024, b"a" * 16384)
        received, _ = closed_within(sock, 3)
    assert received.startswith(b"HTTP/1.1 431 ")


@pytest.mark.parametrize(
    "sent",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nNo-Colon-Here\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    ],
    ids=["request-line", "header-without-colon", "two-lengths"],
)
def test_a_request_that_cannot_be_parsed_gets_a_400_problem_with_a_request_id(relay: RelayProcess, sent: bytes) -> None:
    """uvicorn answered these text/plain "Invalid HTTP request received." without X-Request-Id; now
    a problem as the 408 and the 431 are, and the connection closed. The request's headers were
    not read whole: its id is a new one (the client's X-Request-Id, if it sent one, is not read)."""
    with connect(relay) as sock:
        sock.sendall(sent)
        resp, body = response(sock, "GET")
        assert resp.getheader("connection") == "close"
        received, _ = closed_within(sock, 3)
    assert received == b""
    problem = assert_problem(resp, body, 400)
    assert problem["requestId"] == resp.getheader("x-request-id"), problem
    assert str(uuid.UUID(str(problem["requestId"]))) == problem["requestId"], problem
    assert str(problem["detail"]).startswith("not a valid HTTP/1.1 request"), problem


def test_an_executor_handshake_outlives_the_header_deadline(relay: RelayProcess) -> None:
    async def connect_executor() -> None:
        ws = await open_socket(f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}")
        executor_id = await handshake(ws)
        await off_loop(assert_eventually, lambda: relay.state_of("acme", "ledger", executor_id) == "HEALTHY", 5)
        await asyncio.sleep(1.5)  # past headerTimeoutSecs: only HTTP requests have that deadline
        await asyncio.wait_for(await ws.ping(), 2)
        assert await off_loop(relay.state_of, "acme", "ledger", executor_id) == "HEALTHY"
        await ws.close()

    asyncio.run(connect_executor())


# -- executors' handshakes ----------------------------------------------------------------------


def test_simultaneous_handshakes_cannot_overshoot_the_pending_cap(relay: RelayProcess) -> None:
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"

    async def attempt() -> ClientConnection | int:
        try:
            return await open_socket(url)  # and never answer executor_info
        except InvalidStatus as exc:
            return exc.response.status_code

    async def crowd() -> tuple[int, list[int]]:
        results = await asyncio.gather(*(attempt() for _ in range(3 * HANDSHAKE_CAP)))
        accepted = [r for r in results if isinstance(r, ClientConnection)]
        for ws in accepted:
            await ws.close()
        return len(accepted), [r for r in results if isinstance(r, int)]

    accepted, refused = asyncio.run(crowd())
    assert 1 <= accepted <= HANDSHAKE_CAP
    assert refused == [503] * (3 * HANDSHAKE_CAP - accepted)

    def pending() -> float | None:
        return sample(httpx.get(f"{relay.http}/metrics", headers=ADMIN, verify=TLS).text, "relay_pending_handshakes")

    assert_eventually(lambda: pending() == 0, 5, what="every slot given back")


# -- what the open endpoints give away -------------------------------------------------------------


def test_probes_say_nothing_but_their_status(relay: RelayProcess) -> None:
    healthz = httpx.get(f"{relay.http}/healthz", verify=TLS)
    assert healthz.json() == {"status": "ok"}
    readyz = httpx.get(f"{relay.http}/readyz", verify=TLS)
    assert readyz.json() == {"status": "ready"}
    for resp in (healthz, readyz):
        assert resp.headers["x-content-type-options"] == "nosniff"
        assert resp.headers["referrer-policy"] == "no-referrer"

    # Hold the lease row so that renewals wait: the lease (1 s here) runs out, /readyz turns 503.
    with psycopg.connect(relay.database_url) as conn:
        conn.execute("SELECT 1 FROM relay_instances WHERE instance_id = %s FOR UPDATE", (relay.instance_id,))

        def not_ready() -> httpx.Response | None:
            resp = httpx.get(f"{relay.http}/readyz", timeout=5, verify=TLS)
            return resp if resp.status_code == 503 else None

        unready = assert_eventually(not_ready, 5, what="/readyz 503 without the lease")
        conn.rollback()
    assert unready is not None
    problem = assert_problem(unready, unready.content, 503)
    assert problem == {
        "type": "about:blank",
        "title": "Service Unavailable",
        "status": 503,
        "detail": "not ready",
        "requestId": unready.headers["x-request-id"],
    }
    assert relay.instance_id not in unready.text
    assert_eventually(lambda: httpx.get(f"{relay.http}/readyz", verify=TLS).status_code == 200, 5)


def test_metrics_need_a_key_with_metric_read(relay: RelayProcess) -> None:
    url = f"{relay.http}/metrics"
    resp = httpx.get(url, verify=TLS)
    assert_problem(resp, resp.content, 401)
    assert "acme" not in resp.text
    resp = httpx.get(url, headers={"Authorization": f"Bearer {CONDUCTOR_KEYS['acme']}"}, verify=TLS)
    assert_problem(resp, resp.content, 403)
    assert "metric.read" in resp.json()["detail"]
    for key in (API_KEYS["acme"], VIEWER_KEYS["acme"], API_KEYS["globex"]):
        resp = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, verify=TLS)
        assert resp.status_code == 200
        assert sample(resp.text, "relay_lease_held") is not None


def test_public_metrics_need_no_key(start_relay: StartRelay) -> None:
    config = relay_yaml(free_port())
    config["server"]["publicMetrics"] = True
    relay = start_relay(config)
    resp = httpx.get(f"{relay.http}/metrics", verify=TLS)
    assert resp.status_code == 200 and sample(resp.text, "relay_lease_held") == 1


def test_the_api_browser_loads_everything_from_relay_under_a_strict_policy(relay: RelayProcess) -> None:
    page = httpx.get(f"{relay.http}/docs", verify=TLS)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = dict(part.strip().split(" ", 1) for part in page.headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'" and csp["frame-ancestors"] == "'none'"
    for directive in ("script-src", "style-src", "connect-src"):
        assert csp[directive] == "'self'", directive  # no other origin, no inline code, no eval
    assert csp["img-src"] == "'self' data:"
    assert page.headers["x-frame-options"] == "DENY"
    assert "<script>" not in page.text and "<style" not in page.text and " style=" not in page.text
    references = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(references) == [  # relative: Relay may be served below a path prefix
        "static/docs.js",
        "static/swagger/swagger-ui-bundle.js",
        "static/swagger/swagger-ui.css",
    ]
    assert "//" not in page.text.replace("<!doctype html>", ""), "no URL of another origin"

    types = {".js": ("text/javascript", "application/javascript"), ".css": ("text/css",)}
    for path in references:
        resp = httpx.get(f"{relay.http}/{path}", verify=TLS)
        assert resp.status_code == 200, path
        assert resp.headers["content-type"].split(";")[0] in types[path[path.rindex(".") :]], path
        assert resp.headers["x-content-type-options"] == "nosniff"
    script = httpx.get(f"{relay.http}/static/docs.js", verify=TLS).text
    assert '"openapi.json"' in script and "validatorUrl: null" in script
    assert httpx.get(f"{relay.http}/openapi.json", verify=TLS).json()["info"]["title"] == "Relay"
    assert httpx.get(f"{relay.http}/redoc", verify=TLS).status_code == 404


def test_the_api_document_where_conductors_clients_fetch_it_and_no_key_needed(relay: RelayProcess) -> None:
    """Self-hosted Conductor serves /openapi.yaml besides /openapi.json; managed Conductor serves
    /conductor/v2/openapi.json, its servers entry at /conductor."""
    document = httpx.get(f"{relay.http}/openapi.json", verify=TLS).json()
    resp = httpx.get(f"{relay.http}/openapi.yaml", verify=TLS)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/yaml"
    assert yaml.safe_load(resp.text) == document
    also = ("/healthz", "/readyz", "/metrics")
    api_paths = {path: item for path, item in document["paths"].items() if path.startswith("/v2/") or path in also}
    assert "/v2/orgs/{org}/apps" in api_paths and all(path in api_paths for path in also)
    for path in ("/conductor/v2/openapi.json", "/v2/openapi.json"):
        resp = httpx.get(f"{relay.http}{path}", verify=TLS)
        assert resp.status_code == 200, path
        assert resp.json() == {**document, "paths": api_paths, "servers": [{"url": "/conductor"}]}, path
    # A client made from it resolves every path it lists under /conductor, where Relay serves them
    # (the contract: every path of the API, the probes and /metrics also under /conductor).
    base = httpx.URL(f"{relay.http}/conductor/v2/openapi.json").join(resp.json()["servers"][0]["url"])
    assert httpx.get(f"{base}/v2/orgs/acme/apps", headers=ADMIN, verify=TLS).status_code == 200
    assert (
        httpx.get(f"{base}/healthz", verify=TLS).json()
        == httpx.get(f"{relay.http}/healthz", verify=TLS).json()
        == {"status": "ok"}
    )
    assert httpx.get(f"{base}/readyz", verify=TLS).json() == {"status": "ready"}
    assert (
        httpx.get(f"{base}/metrics", verify=TLS).status_code
        == httpx.get(f"{relay.http}/metrics", verify=TLS).status_code
        == 401
    )
    for scrape in ("/metrics", "/v1/metrics"):
        resp = httpx.get(f"{base}{scrape}", headers=ADMIN, verify=TLS)
        assert resp.status_code == 200 and "relay_lease_held" in resp.text, scrape
    # Not the console or the API's document at the root.
    assert httpx.get(f"{base}/openapi.json", verify=TLS).status_code == 404
    # Nothing else under the API's prefixes opened with it.
    assert httpx.get(f"{relay.http}/conductor/v2/openapi.yaml", verify=TLS).status_code == 401


def test_the_conductor_api_documents_prefix_is_checked(relay: RelayProcess) -> None:
    """X-Forwarded-Prefix (a proxy serving Relay below a path) starts the servers entry of
    /v2/openapi.json, a final ``/`` or none (empty: the host's root); a value that is not one path of URL characters (no
    leading ``/``, a ``..`` segment, another origin, a list, twice given) is refused with a 400 naming
    the header, and the document of the next request is as before."""
    url = f"{relay.http}/conductor/v2/openapi.json"
    for given, server in (
        ("/relay", "/relay/conductor"),
        ("/a/b-c/", "/a/b-c/conductor"),
        ("/", "/conductor"),
        ("", "/conductor"),
    ):
        resp = httpx.get(url, headers={"X-Forwarded-Prefix": given}, verify=TLS)
        assert resp.status_code == 200 and resp.json()["servers"] == [{"url": server}], (given, resp.text)
        # A cache keys the document by the header too: one request's prefix is not served to another.
        assert "x-forwarded-prefix" in resp.headers.get("vary", "").lower(), resp.headers
    for bad in ("relay", "/a/../b", "/..", "//evil.example", "https://evil.example/x", "/a,/b", "/a b"):
        resp = httpx.get(url, headers={"X-Forwarded-Prefix": bad}, verify=TLS)
        assert resp.status_code == 400 and "X-Forwarded-Prefix" in resp.json()["detail"], (bad, resp.text)
    twice = httpx.get(url, headers=[("X-Forwarded-Prefix", "/a"), ("X-Forwarded-Prefix", "/b")], verify=TLS)
    assert twice.status_code == 400, twice.text
    assert httpx.get(url, verify=TLS).json()["servers"] == [{"url": "/conductor"}]


UNSAFE_JS = re.compile(r"\.(?:inner|outer)HTML\s*\+?=|insertAdjacentHTML|document\.write|\beval\(|new Function\(")


def test_the_console_runs_under_a_strict_content_security_policy(relay: RelayProcess) -> None:
    page = httpx.get(f"{relay.http}/", verify=TLS)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "connect-src 'self'" in csp  # the API and its event stream, on this origin only
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "<style>" not in page.text and "<script>" not in page.text  # nothing inline: CSP would block it
    # Relative, so that Relay may be served below a path prefix (test_console.py).
    assert '<script type="module" src="static/console.js"></script>' in page.text
    assert '<link rel="stylesheet" href="static/console.css">' in page.text

    for module in ("console.js", "console-api.js", "console-ui.js", "console-pages.js"):
        script = httpx.get(f"{relay.http}/static/{module}", verify=TLS)
        assert script.status_code == 200, module
        assert script.headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript")
        # Modules import only this origin's files: nothing from a CDN, nothing built at run time.
        assert "http://" not in script.text and "https://" not in script.text, module
        # Markup never built from strings (the elements are made with textContent), nothing evaluated.
        assert not UNSAFE_JS.findall(script.text), module
    assert "Authorization" in httpx.get(f"{relay.http}/static/console-api.js", verify=TLS).text
    styles = httpx.get(f"{relay.http}/static/console.css", verify=TLS)
    assert styles.status_code == 200 and styles.headers["content-type"].startswith("text/css")
    assert "@import" not in styles.text and "url(http" not in styles.text


@pytest.mark.parametrize(
    "path",
    [
        "/static/../config.py",
        "/static/%2e%2e/config.py",
        "/static/..%2fconfig.py",
        "/static/%2e%2e%2fconfig.py",
        "/static/..%2f..%2fpyproject.toml",
        "/static/..",
        "/static/console.html",
        "/static/",
        "/static/swagger/README.md",
        "/static/swagger/LICENSE",
        "/static/swagger/../dashboard.html",
        "/static/swagger/..%2f..%2fconfig.py",
        "/static/swagger/%2e%2e%2f%2e%2e%2fpyproject.toml",
        "/static/swagger%2fswagger-ui.css",
    ],
)
def test_static_files_cannot_be_reached_around(relay: RelayProcess, path: str) -> None:
    with connect(relay) as sock:  # raw, so that no client normalizes the path first
        sock.sendall(head("GET", path))
        resp, body = response(sock, "GET")
    assert resp.status == 404, body
    assert b"ServerConfig" not in body and b"[project]" not in body and b"<html" not in body


# -- pure parts ---------------------------------------------------------------------------------


def test_body_limits_by_route_pattern() -> None:
    table = (
        BodyLimit("/v2/orgs/*/apps/*/workflows/import", 64 * MiB),
        BodyLimit("/v2/orgs/*/apps/*/workflows", 2 * MiB),
    )
    assert body_limit("/v2/orgs/acme/apps/ledger/workflows/import", MiB, table) == 64 * MiB
    assert body_limit("/conductor/v2/orgs/acme/apps/ledger/workflows/import", MiB, table) == 64 * MiB
    assert body_limit("/v2/orgs/acme/apps/ledger/workflows/abc/cancel", MiB, table) == 2 * MiB
    assert body_limit("/v2/orgs/acme/apps/ledger", MiB, table) == MiB
    assert body_limit("/v2/orgs//apps/ledger/workflows/import", MiB, table) == MiB  # "*" is one whole segment
    assert body_limit("/v2/orgs/acme/apps/ledger/workflows/import", MiB) == MiB  # no table: the default


def test_bearer_key() -> None:
    assert bearer_key("Bearer abc") == "abc"
    assert bearer_key("bearer  abc ") == "abc"
    assert bearer_key("Basic abc") == ""
    assert bearer_key("abc") == ""
    assert bearer_key("") == ""
