"""Names with ``/`` or ``%`` in the API's paths: every path parameter is decoded once, the same way.

A key created as ``team/ops`` was stored as ``team%2Fops`` (its create route took the name as
routing saw it) and could then not be renamed or deleted by its name; an app named ``100%`` was
unreachable, and a key limited to it was refused on it.
"""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest

from harness.keys import API_KEYS
from harness.relay import RelayProcess
from harness.web import TLS


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
    app = "100%app"
    with client(relay) as api:
        assert api.put(f"/apps/{segment(app)}").status_code == 204
        one = api.get(f"/apps/{segment(app)}")
        assert one.status_code == 200, one.text
        assert one.json()["name"] == app
        created = api.post("/tokens/percent-reader", json={"permissions": ["application.read"], "appNames": [app]})
        assert created.status_code == 201, created.text
    with client(relay, created.json()["token"]) as limited:
        listed = limited.get(f"/apps/{segment(app)}/executors")
        assert listed.status_code == 200, listed.text
        assert limited.get("/apps/ledger/executors").status_code == 403
