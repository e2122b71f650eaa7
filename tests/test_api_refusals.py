"""Requests the HTTP API must refuse by itself, as a client's mistake (4xx), rather than pass them
on to the database or an executor and answer 5xx. Found by fuzzing the OpenAPI document
(tests/test_openapi_fuzz.py); each case here is one it found."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from harness.keys import API_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml

ADMIN = {"Authorization": f"Bearer {API_KEYS['acme']}"}


@pytest.fixture(scope="module")
def relay(
    postgres: Postgres, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RelayProcess]:
    workdir, database = tmp_path_factory.mktemp("refusals"), postgres.create_database("relay")
    relay = RelayProcess(workdir, database, relay_yaml(free_port()))
    failed_before = request.session.testsfailed
    relay.start()
    yield relay
    relay.stop()
    if request.session.testsfailed > failed_before:
        print(f"--- {relay.instance_id} log ---\n{relay.log()[-6000:]}")


@pytest.fixture
def api(relay: RelayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=relay.http, headers=ADMIN, timeout=10) as client:
        yield client


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("TRACE", "/healthz", "GET"),
        ("POST", "/v2/orgs/acme/apps", "GET"),
        ("GET", "/v2/orgs/acme/apps/ledger/workflows/abc/cancel", "POST"),
        ("POST", "/v2/orgs/acme/apps/ledger", "GET, PUT, PATCH, DELETE"),  # four routes share the path
        ("PUT", "/conductor/v2/orgs/acme/tokens/abc", "POST, PATCH, DELETE"),
    ],
)
def test_a_method_not_allowed_says_which_are(api: httpx.Client, method: str, path: str, allowed: str) -> None:
    resp = api.request(method, path)
    assert resp.status_code == 405, resp.text
    assert resp.headers["content-type"] == "application/problem+json"
    assert resp.headers["allow"] == allowed, "RFC 9110: a 405 lists the methods of the resource"


@pytest.mark.parametrize("path", ["/apps", "/apps/ledger/executors", "/apps/ledger/recoveries", "/tokens", "/audit"])
def test_an_offset_past_a_bigint_is_refused(api: httpx.Client, path: str) -> None:
    assert api.get(f"/v2/orgs/acme{path}", params={"offset": 2**63 - 1}).status_code == 200
    resp = api.get(f"/v2/orgs/acme{path}", params={"offset": 2**63})
    assert resp.status_code == 422, resp.text  # not 503 "database error: bigint out of range"
    assert resp.json()["errors"][0]["location"] == "query.offset"
