"""The authorization matrix, generated from the API's own route table.

Every route must have an entry below: a route added later without one fails
here. Each route is tried with no key, a wrong key, another org's key, a key
scoped to another app, a key lacking exactly the permission it needs, and an
admin key, and must answer the documented status.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, Mount
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from harness.keys import API_KEYS
from harness.ports import free_port
from harness.relay import RelayProcess, relay_yaml
from harness.web import TLS
from relay.api import build_api
from relay.api.refusals import AUDITED_ROUTES
from relay.auth import Permission

StartRelay = Callable[..., RelayProcess]
P = Permission
API_PERMISSIONS = [p for p in Permission if p is not P.WEBSOCKET_CONNECT]


@dataclass(frozen=True)
class Rule:
    permission: Permission | None  # None: public
    org: bool = True  # the path names an org
    app: bool = False  # the path names an app
    any_key: bool = False  # with neither permission nor org: any valid key, of any org


PUBLIC = Rule(None, org=False)
MEMBER = Rule(None)  # any valid key of the org
ANY_KEY = Rule(None, org=False, any_key=True)
READ, WRITE = Rule(P.APPLICATION_READ, app=True), Rule(P.APPLICATION_WRITE, app=True)

MATRIX: dict[tuple[str, str], Rule] = {
    ("GET", "/"): PUBLIC,
    ("GET", "/static/{name}"): PUBLIC,
    ("GET", "/static/swagger/{name}"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/openapi.yaml"): PUBLIC,
    ("GET", "/v2/openapi.json"): PUBLIC,  # /conductor/v2/openapi.json, as managed Conductor serves it
    ("GET", "/metrics"): Rule(P.METRIC_READ, org=False),
    ("GET", "/v1/metrics"): Rule(P.METRIC_READ, org=False),  # Conductor's scrape path
    ("GET", "/v2/whoami"): ANY_KEY,
    ("GET", "/v2/users/me"): ANY_KEY,  # Conductor's getCurrentUser, for the calling key (dbosctl whoami)
    ("GET", "/v2/orgs/{org}/whoami"): MEMBER,
    ("GET", "/v2/orgs/{org}/permissions"): MEMBER,
    ("GET", "/v2/orgs/{org}/events"): Rule(P.APPLICATION_READ),
    ("GET", "/v2/orgs/{org}/instances"): Rule(P.ORGANIZATION_READ),
    ("GET", "/v2/orgs/{org}/apps"): Rule(P.APPLICATION_READ),
    ("GET", "/v2/orgs/{org}/apps/{app}"): READ,
    ("PATCH", "/v2/orgs/{org}/apps/{app}"): WRITE,
    ("GET", "/v2/orgs/{org}/apps/{app}/executors"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/executors/{executor_id}"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/executors/{executor_id}/workflows"): READ,
    ("POST", "/v2/orgs/{org}/apps/{app}/executors/{executor_id}/recover"): WRITE,
    ("GET", "/v2/orgs/{org}/apps/{app}/recoveries"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/recoveries/{recovery_id}"): READ,
    ("PUT", "/v2/orgs/{org}/apps/{app}"): WRITE,
    ("DELETE", "/v2/orgs/{org}/apps/{app}"): WRITE,
    ("GET", "/v2/orgs/{org}/apps/{app}/workflows"): READ,
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/search"): READ,
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/aggregates"): READ,
    ("POST", "/v2/orgs/{org}/apps/{app}/steps/aggregates"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/workflows/{workflow_id}"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/workflows/{workflow_id}/steps"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/workflows/{workflow_id}/events"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/workflows/{workflow_id}/notifications"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/workflows/{workflow_id}/streams"): READ,
    # An export carries a pickle that an import unpickles: both need application.write.
    ("GET", "/v2/orgs/{org}/apps/{app}/workflows/{workflow_id}/export"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/import"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/{workflow_id}/cancel"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/{workflow_id}/resume"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/{workflow_id}/fork"): WRITE,
    ("DELETE", "/v2/orgs/{org}/apps/{app}/workflows/{workflow_id}"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/bulk-cancel"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/bulk-resume"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/bulk-delete"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/bulk-fork-from-failure"): WRITE,
    ("GET", "/v2/orgs/{org}/apps/{app}/queues"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/queues/{queue_name}"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/schedules"): READ,
    ("GET", "/v2/orgs/{org}/apps/{app}/schedules/{schedule_name}"): READ,
    ("POST", "/v2/orgs/{org}/apps/{app}/schedules/{schedule_name}/pause"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/schedules/{schedule_name}/resume"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/schedules/{schedule_name}/trigger"): WRITE,
    ("POST", "/v2/orgs/{org}/apps/{app}/schedules/{schedule_name}/backfill"): WRITE,
    ("GET", "/v2/orgs/{org}/apps/{app}/versions"): READ,
    ("PATCH", "/v2/orgs/{org}/apps/{app}/versions/latest"): WRITE,
    ("GET", "/v2/orgs/{org}/apps/{app}/metrics"): Rule(P.METRIC_READ, app=True),
    ("GET", "/v2/orgs/{org}/apps/{app}/alerting-rules"): READ,
    ("POST", "/v2/orgs/{org}/apps/{app}/alerting-rules"): WRITE,
    ("DELETE", "/v2/orgs/{org}/apps/{app}/alerting-rules/{rule_id}"): WRITE,
    ("GET", "/v2/orgs/{org}/audit"): Rule(P.ORGANIZATION_READ),
    ("GET", "/v2/orgs/{org}/audit-logs"): Rule(P.ORGANIZATION_READ),
    ("GET", "/v1alpha1/api/{org}/audit-logs"): Rule(P.ORGANIZATION_READ),  # audit-logs.md's path
    ("GET", "/v2/orgs/{org}/tokens"): Rule(P.TOKEN_READ),
    ("POST", "/v2/orgs/{org}/tokens/{token_name}"): Rule(P.TOKEN_WRITE),
    ("PATCH", "/v2/orgs/{org}/tokens/{token_name}"): Rule(P.TOKEN_WRITE),
    ("DELETE", "/v2/orgs/{org}/tokens/{token_name}"): Rule(P.TOKEN_WRITE),
}
VALUES = {
    "org": "acme",
    "app": "ledger",
    "executor_id": "nobody",
    "recovery_id": "none",
    "token_name": "matrix-x",
    "name": "console.js",
    "workflow_id": "no/such?workflow#",
    "queue_name": "no-queue",
    "schedule_name": "no-schedule",
    "rule_id": "no-rule",
}
# Paths whose admin call would change what the other routes are tried on.
OVERRIDES = {("DELETE", "/v2/orgs/{org}/apps/{app}"): {"app": "matrix-app"}}


def route_table() -> set[tuple[str, str]]:
    """(method, path) of every route the API serves, read from the application itself."""

    def walk(routes: list[BaseRoute], prefix: str = "") -> set[tuple[str, str]]:
        found: set[tuple[str, str]] = set()
        for route in routes:
            if isinstance(route, APIRoute):
                found |= {(m, prefix + route.path) for m in route.methods - {"HEAD"}}
            elif isinstance(route, Mount):
                found |= walk(route.routes, prefix + route.path)
            elif hasattr(route, "original_router"):  # an included router (FastAPI >= 0.16x keeps it whole)
                found |= walk(route.original_router.routes, prefix + route.include_context.prefix)
            elif hasattr(route, "path") and hasattr(route, "methods"):
                found |= {(m, prefix + route.path) for m in (route.methods or {"GET"}) - {"HEAD"}}
            else:
                raise AssertionError(f"a route of a kind this test cannot read: {route!r}")
        return found

    return walk(build_api(None).routes)


def test_every_route_has_an_entry_in_the_matrix() -> None:
    table = route_table()
    assert table - set(MATRIX) == set(), "routes without an authorization entry"
    assert set(MATRIX) - table == set(), "entries for routes that no longer exist"


# The routes that change nothing though they are not GETs: reads with a body.
READS_WITH_A_BODY = {
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/search"),
    ("POST", "/v2/orgs/{org}/apps/{app}/workflows/aggregates"),
    ("POST", "/v2/orgs/{org}/apps/{app}/steps/aggregates"),
}


def test_every_change_names_the_action_its_refusals_are_audited_under() -> None:
    """A refused change (403, 422) is audited under the action of the change (relay.api.refusals):
    a change added later without one would leave its refusals unaudited."""
    changes = {(m, p) for m, p in route_table() if m != "GET"} - READS_WITH_A_BODY
    assert changes - set(AUDITED_ROUTES) == set(), "changes whose refusals are not audited"
    assert set(AUDITED_ROUTES) - changes == set(), "audited routes that are no changes of the API"


def _route_shape(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "{}", path)


def test_readmes_route_table_names_the_permission_each_route_needs() -> None:
    """README's REST API table is what an operator reads to give a key its permissions: a row names
    the permission its route needs, or none when it is the table's rule (reads `application.read`,
    changes `application.write`). It once said "admin only" of routes any `application.write` key may
    call, and nothing of routes that need `token.write`."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    matrix = {(method, _route_shape(path)): rule for (method, path), rule in MATRIX.items()}
    checked, wrong = 0, []
    for line in readme.splitlines():
        row = re.match(r"\| `(GET|POST|PUT|PATCH|DELETE) (/[^`\[?]*)[^`]*` \|(.*)\|$", line)
        if row is None:
            continue
        method, path, what = row.group(1), row.group(2).removeprefix("/conductor"), row.group(3)
        rule = matrix.get((method, _route_shape(path)))
        if rule is None:
            continue  # another table's row (the workflow API's paths are under an app's)
        checked += 1
        named = {p for p in Permission if f"`{p.value}`" in what}
        if re.search(r"\badmin only\b", what):
            wrong.append(f"{method} {path}: says 'admin only', which is no permission (it needs {rule.permission})")
        elif rule.permission is None:
            if named:
                wrong.append(f"{method} {path}: names {sorted(p.value for p in named)}, but it needs none")
        elif named and rule.permission not in named:  # (a row may name others in passing)
            wrong.append(f"{method} {path}: names {sorted(p.value for p in named)}, not {rule.permission.value}")
        elif not named and rule.permission is not (P.APPLICATION_READ if method == "GET" else P.APPLICATION_WRITE):
            wrong.append(f"{method} {path}: names no permission, and it needs {rule.permission.value}")
    assert checked >= 25, f"only {checked} of README's route rows were found: has the table changed shape?"
    assert wrong == [], "\n".join(wrong)


def fill(path: str, **override: str) -> str:
    values = {**VALUES, **override}
    return re.sub(r"\{(\w+)(:path)?\}", lambda m: quote(values[m.group(1)], safe=""), path)


def call(relay: RelayProcess, method: str, path: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {} if method in ("POST", "PATCH") else None
    with httpx.Client(base_url=relay.http, headers=headers, timeout=10, verify=TLS) as client:
        # Streamed: the status is all that is read (the event stream's body never ends).
        with client.stream(method, path, json=body) as resp:
            status = resp.status_code
        if method == "GET":
            # RFC 9110: HEAD is the GET without its body, so it is allowed and refused as the GET is
            # (it was 405 but on the probes). The event stream's HEAD ends too (timeout above).
            head = client.head(path)
            assert (head.status_code, head.content) == (status, b""), f"HEAD {path} with the key of the GET {status}"
        return status


def answer(relay: RelayProcess, method: str, path: str, key: str, app: str) -> tuple[int, str]:
    """The status and body of a call that names ``app``, with the app's name taken out of the body."""
    body = {} if method in ("POST", "PATCH") else None
    # One request id for every call: answers told apart by anything but it tell something.
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": "authorization-matrix"}
    resp = httpx.request(method, relay.http + path, json=body, headers=headers, timeout=10, verify=TLS)
    return resp.status_code, resp.text.replace(app, "<app>")


@pytest.fixture(scope="module")
def keys(relay_for_matrix: RelayProcess) -> dict[str, str]:
    """An admin-made key lacking each permission, and one scoped to another app."""
    made: dict[str, str] = {}
    with httpx.Client(
        base_url=f"{relay_for_matrix.http}/v2/orgs/acme",
        headers={"Authorization": f"Bearer {API_KEYS['acme']}"},
        verify=TLS,
    ) as admin:
        for missing in API_PERMISSIONS:
            body = {"permissions": [p.value for p in API_PERMISSIONS if p is not missing]}
            made[missing.value] = admin.post(f"/tokens/lacks-{missing.value}", json=body).json()["token"]
        body = {"permissions": [p.value for p in API_PERMISSIONS], "appNames": ["other-app"]}
        made["other-app"] = admin.post("/tokens/other-app", json=body).json()["token"]
        made["websocket-only"] = admin.post("/tokens/websocket-only", json=None).json()["token"]
        made["websocket-other-app"] = admin.post("/tokens/ws-other-app", json={"appNames": ["other-app"]}).json()[
            "token"
        ]
    return made


@pytest.fixture(scope="module")
def relay_for_matrix(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> RelayProcess:

    postgres = request.getfixturevalue("postgres")
    relay = RelayProcess(tmp_path_factory.mktemp("matrix"), postgres.create_database("matrix"), relay_yaml(free_port()))
    relay.start()
    request.addfinalizer(relay.stop)
    return relay


@pytest.mark.parametrize(("method", "path"), sorted(MATRIX), ids=lambda v: str(v))
def test_the_route_answers_each_kind_of_caller_as_documented(
    relay_for_matrix: RelayProcess, keys: dict[str, str], method: str, path: str
) -> None:
    relay, rule = relay_for_matrix, MATRIX[(method, path)]
    url = fill(path, **OVERRIDES.get((method, path), {}))
    admin = call(relay, method, url, API_KEYS["acme"])
    assert admin not in (401, 403), f"admin got {admin}"
    if rule.any_key:
        assert call(relay, method, url, None) == 401
        assert call(relay, method, url, "not-a-key") == 401
        assert call(relay, method, url, API_KEYS["globex"]) not in (401, 403), "another org's key"
        assert call(relay, method, url, keys["websocket-only"]) not in (401, 403)
        return
    if rule.permission is None and not rule.org:
        assert call(relay, method, url, None) not in (401, 403)
        return
    if rule.permission is None:  # any key of the org: one without any permission of the API too
        assert call(relay, method, url, None) == 401
        assert call(relay, method, url, "not-a-key") == 401
        assert call(relay, method, url, API_KEYS["globex"]) == 403, "another org's key"
        assert call(relay, method, url, keys["websocket-only"]) not in (401, 403)
        return
    assert call(relay, method, url, None) == 401
    assert call(relay, method, url, "not-a-key") == 401
    assert call(relay, method, url, keys[rule.permission.value]) == 403, "a key lacking the permission"
    if rule.org:
        assert call(relay, method, url, API_KEYS["globex"]) == 403, "another org's key"
    if rule.app:
        assert call(relay, method, url, keys["other-app"]) == 403, "a key scoped to another app"
        # Before anything is looked up: an app outside the key's scope that exists (ledger) and one
        # that does not get the same answer, so a key limited to apps cannot tell which apps exist.
        exists, missing = (answer(relay, method, fill(path, app=a), keys["other-app"], a) for a in ("ledger", "no-app"))
        assert exists == missing, "a key scoped to another app tells an app that exists from one that does not"


@pytest.mark.parametrize("path", ["/", "/docs", "/static/console.js", "/openapi.json", "/metrics", "/healthz"])
def test_head_answers_the_headers_of_the_get_without_its_body(relay_for_matrix: RelayProcess, path: str) -> None:
    """HEAD of the console, its files, the API browser, the document and the scrape (what a load
    balancer or a monitor probes): the GET's status and headers, no body. It was 405 but on the probes."""
    headers = {"Authorization": f"Bearer {API_KEYS['acme']}"}
    with httpx.Client(base_url=relay_for_matrix.http, headers=headers, timeout=10, verify=TLS) as client:
        get, head = client.get(path), client.head(path)
    assert (head.status_code, head.content) == (get.status_code, b"") == (200, b"")
    for name in ("content-type", "content-security-policy", "x-content-type-options"):
        assert head.headers.get(name) == get.headers.get(name), name
    if path != "/metrics":  # a scrape's length changes from one scrape to the next
        assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))


def test_the_api_document_has_no_head_operations(relay_for_matrix: RelayProcess) -> None:
    """HEAD is implied by GET (RFC 9110), not a second operation of each GET route in the document."""
    document = httpx.get(f"{relay_for_matrix.http}/openapi.json", timeout=10, verify=TLS).json()
    assert [path for path, item in document["paths"].items() if "head" in item] == []


def test_a_conductor_key_limited_to_an_app_cannot_tell_which_other_apps_exist(
    relay_for_matrix: RelayProcess, keys: dict[str, str]
) -> None:
    """An executor's socket to an app outside its key's apps is refused before the app is looked for:
    to ledger (which exists) and to an app that does not, the same status and reason."""
    answers = []
    for app in ("ledger", "no-app"):
        url = f"ws://127.0.0.1:{relay_for_matrix.port}/websocket/{app}/{keys['websocket-other-app']}"
        with pytest.raises(InvalidStatus) as refused:
            connect(url, open_timeout=10).close()
        answers.append(
            (refused.value.response.status_code, (refused.value.response.body or b"").replace(app.encode(), b"<app>"))
        )
    assert answers[0] == answers[1]
    assert answers[0][0] == 403


def test_a_socket_without_a_key_for_the_app_learns_nothing_of_its_name(
    relay_for_matrix: RelayProcess, keys: dict[str, str]
) -> None:
    """The hub looked at the name's form (1 to 256 printable characters) before the key: a caller
    with no key, a wrong one or one limited to another app got 400 ``bad_app`` for a name with a
    control character or of 257 characters, 403 for another. The key comes first now: one answer
    for every name, an app's, no app's, one the rule refuses."""
    apps = ("ledger", "no-app", "a%0Ab", "x" * 257, "..", "100%41")
    for key in ("", "not-a-key", keys["websocket-other-app"]):
        answers = set()
        for app in apps:
            url = f"ws://127.0.0.1:{relay_for_matrix.port}/websocket/{app}/{key}"
            with pytest.raises(InvalidStatus) as refused:
                connect(url, open_timeout=10).close()
            answers.add((refused.value.response.status_code, bytes(refused.value.response.body or b"")))
        assert len(answers) == 1, (key[:6], answers)
        assert answers.pop()[0] == 403


def test_the_grantable_permissions_are_what_a_key_may_be_given(
    relay_for_matrix: RelayProcess, keys: dict[str, str]
) -> None:
    """Conductor's GET /v2/orgs/{org}/permissions (``dbosctl permission list``), under /conductor too:
    every permission of Conductor's catalogue, by name, to any key of the org."""
    catalogue = [
        "organization.read", "organization.write", "application.read", "application.write",
        "metric.read", "token.read", "token.write", "websocket.connect",
    ]  # fmt: skip
    for base in ("", "/conductor"):
        for key in (API_KEYS["acme"], keys["websocket-only"]):
            resp = httpx.get(
                f"{relay_for_matrix.http}{base}/v2/orgs/acme/permissions",
                headers={"Authorization": f"Bearer {key}"},
                verify=TLS,
            )
            assert (resp.status_code, resp.json()) == (200, catalogue), base
    with httpx.Client(
        base_url=relay_for_matrix.http, headers={"Authorization": f"Bearer {API_KEYS['acme']}"}, verify=TLS
    ) as admin:
        made = admin.post("/v2/orgs/acme/tokens/all-grantable", json={"permissions": catalogue})
        assert made.status_code == 201, made.text
        assert admin.delete("/v2/orgs/acme/tokens/all-grantable").status_code == 204


def test_a_key_limited_to_an_app_sees_nothing_of_an_app_added_outside_it(
    relay_for_matrix: RelayProcess, keys: dict[str, str]
) -> None:
    """The org's listings (apps, keys, audit log, instances' executor counts) read by a key limited to
    other-app are the same before and after an app outside its scope is registered, given a rule and
    a key of its own: nothing in them counts or names it."""

    def seen() -> list[object]:
        with httpx.Client(
            base_url=f"{relay_for_matrix.http}/v2/orgs/acme",
            headers={"Authorization": f"Bearer {keys['other-app']}"},
            verify=TLS,
        ) as scoped:
            reads = [scoped.get(path) for path in ("/apps", "/tokens", "/audit-logs", "/instances")]
            assert [r.status_code for r in reads] == [200] * 4, [r.text for r in reads]
            apps, tokens, audit, instances = (r.json() for r in reads)
            return [apps, tokens, audit, [(i["instanceId"], i["executors"]) for i in instances]]

    before = seen()
    with httpx.Client(
        base_url=f"{relay_for_matrix.http}/v2/orgs/acme",
        headers={"Authorization": f"Bearer {API_KEYS['acme']}"},
        verify=TLS,
    ) as admin:
        assert admin.put("/apps/hidden-app").status_code == 204
        rule = {"ruleType": "UnresponsiveApplication", "receivingAppName": "ledger"}
        assert admin.post("/apps/hidden-app/alerting-rules", json=rule).status_code == 201
        made = admin.post("/tokens/hidden-app-fleet", json={"appNames": ["hidden-app"]})
        assert made.status_code == 201, made.text
    assert seen() == before
