"""Conductor's HTTP API as its documentation (dbos-docs ``docs/production/``) has it, where a client
that follows a page with only the base URL changed would have found Relay answering otherwise.

Each test names the page and the words it relies on. A real Relay (its own PostgreSQL database),
called over HTTP.
"""

from __future__ import annotations

import base64
import gzip
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.keys import API_KEYS
from harness.relay import RelayProcess
from harness.web import TLS

# audit-logs.md: "https://cloud.dbos.dev/conductor/v1alpha1/api/{org}/audit-logs", the base
# (https://cloud.dbos.dev) changed to Relay's; and without /conductor, as a self-hosted
# Conductor's base has it (conductor-api.md, Base URL: "https://cloud.dbos.dev/conductor" or
# "http://<your-conductor-host>:8090").
AUDIT_LOGS = "/conductor/v1alpha1/api/acme/audit-logs"
SELF_HOSTED_AUDIT_LOGS = "/v1alpha1/api/acme/audit-logs"


def said(resp: httpx.Response) -> str:
    return f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text[:300]}"


def as_on_the_page(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry of ``/v2/orgs/{org}/audit-logs`` (Conductor's OpenAPI document: camelCase, ``details``
    null when there are none) as audit-logs.md shows it (snake_case, ``details`` left out then)."""
    names = {"emitTime": "emit_time", "sourceIp": "source_ip"}
    return {names.get(k, k): v for k, v in entry.items() if not (k == "details" and v is None)}


def test_the_audit_log_is_served_at_the_path_and_with_the_parameters_of_audit_logs_md(relay: RelayProcess) -> None:
    """audit-logs.md, "The Audit Logs Endpoint": ``GET .../conductor/v1alpha1/api/{org}/audit-logs``
    with the query parameters ``start`` ("inclusive"), ``end`` ("exclusive"), ``operation``,
    ``subject``, ``target``, ``page_size`` ("Defaults to `100`; the maximum is `1000`") and
    ``offset``; "The endpoint returns a JSON object with an `entries` array", "newest first";
    "Make sure the key has the `organization.read` permission". Relay served the log only at
    conductor-api.md's ``/v2/orgs/{org}/audit-logs`` (``startTime``, ``endTime``, ``limit``): the
    documented curl was a 404."""
    with relay.client() as api:
        for name in ("docs-a", "docs-b", "docs-c"):
            made = api.post(f"/v2/orgs/acme/tokens/{name}", json={"permissions": ["application.read"]})
            assert made.status_code == 201, said(made)

        def entries(**params: Any) -> list[dict[str, Any]]:
            resp = api.get(AUDIT_LOGS, params=params)
            assert resp.status_code == 200, said(resp)
            assert resp.headers["content-type"] == "application/json"
            return list(resp.json()["entries"])

        made = entries(operation="token.create", page_size=1000)
        mine = [e for e in made if e["target"]["id"].startswith("docs-")]
        assert [e["target"] for e in mine] == [{"type": "token", "id": n} for n in ("docs-c", "docs-b", "docs-a")]
        # The same entries as conductor-api.md's route gives them (in its document's shape), and without
        # /conductor.
        v2 = api.get("/v2/orgs/acme/audit-logs", params={"operation": "token.create", "limit": 1000})
        assert v2.status_code == 200, said(v2)
        assert [as_on_the_page(e) for e in v2.json()] == made
        self_hosted = api.get(SELF_HOSTED_AUDIT_LOGS, params={"operation": "token.create", "page_size": 1000})
        assert self_hosted.status_code == 200, said(self_hosted)
        assert self_hosted.json()["entries"] == made

        # page_size and offset page the newest-first list.
        assert [e["id"] for e in entries(operation="token.create", page_size=2)] == [e["id"] for e in made[:2]]
        paged = entries(operation="token.create", page_size=1, offset=1)
        assert [e["id"] for e in paged] == [made[1]["id"]]
        assert len(entries(page_size=1)) == 1

        _, b, a = mine
        assert [e["id"] for e in entries(target="docs-b")] == [b["id"]]
        subject = b["subject"]["id"]
        assert {e["subject"]["id"] for e in entries(subject=subject, page_size=1000)} == {subject}
        assert entries(subject="nobody-of-that-name") == []
        since_b = {e["id"] for e in entries(operation="token.create", start=b["emit_time"], page_size=1000)}
        assert b["id"] in since_b and a["id"] not in since_b, "start is inclusive"
        before_b = {e["id"] for e in entries(operation="token.create", end=b["emit_time"], page_size=1000)}
        assert b["id"] not in before_b and a["id"] in before_b, "end is exclusive"

        # The default page is 100 entries: more than 100 entries in the log, 100 on the page.
        for n in range(100 - len(entries(page_size=1000)) + 1):
            assert api.patch(f"/v2/orgs/acme/tokens/docs-{'a' if n % 2 == 0 else 'x'}",
                             json={"newName": f"docs-{'x' if n % 2 == 0 else 'a'}"}).status_code == 200  # fmt: skip
        assert len(entries(page_size=1000)) > 100
        assert len(entries()) == 100

        for bad in ({"page_size": 0}, {"page_size": 1001}, {"offset": -1}, {"start": "yesterday"}, {"end": "soon"}):
            resp = api.get(AUDIT_LOGS, params=bad)
            assert resp.status_code == 422, said(resp)
            assert resp.headers["content-type"] == "application/problem+json"
            [error] = resp.json()["errors"]
            assert error["location"] == f"query.{next(iter(bad))}"

        reader = api.post("/v2/orgs/acme/tokens/docs-no-org-read", json={"permissions": ["application.read"]})
        assert reader.status_code == 201, said(reader)

    for path in (AUDIT_LOGS, SELF_HOSTED_AUDIT_LOGS):
        with relay.client(key=None) as anonymous:
            assert anonymous.get(path).status_code == 401
        with relay.client(key=reader.json()["token"]) as lacking:
            resp = lacking.get(path)
            assert resp.status_code == 403, said(resp)
            assert "organization.read" in resp.json()["detail"]
        with relay.client(key=API_KEYS["globex"]) as other_org:
            assert other_org.get(path).status_code == 403


def test_audit_entries_carry_the_details_audit_logs_md_names(relay: RelayProcess) -> None:
    """audit-logs.md, "Details": "`permissions`, `applications` | `token.create`" and
    "`private_mode` | `application.create`". Relay's entries carried its own detail keys only:
    a key's apps as ``appNames``, and nothing about private mode (Relay has none: every app's
    ``privateMode`` is false)."""
    with relay.client() as api:
        body = {"permissions": ["application.read", "metric.read"], "appNames": ["ledger"]}
        assert api.post("/v2/orgs/acme/tokens/details-scoped", json=body).status_code == 201
        every = api.post("/v2/orgs/acme/tokens/details-every-app", json={"permissions": ["metric.read"]})
        assert every.status_code == 201
        assert api.put("/v2/orgs/acme/apps/details-app").status_code == 204
        assert api.get("/v2/orgs/acme/apps/details-app").json()["privateMode"] is False

        def entry(operation: str, target: str) -> dict[str, Any]:
            """The one entry, the same at both of Conductor's paths."""
            found = []
            for path in (AUDIT_LOGS, "/v2/orgs/acme/audit-logs"):
                resp = api.get(path, params={"operation": operation, "target": target})
                assert resp.status_code == 200, said(resp)
                body = resp.json()
                found += body if path.startswith("/v2/") else body["entries"]
            first, second = found
            assert first == as_on_the_page(second)
            return dict(first)

        scoped = entry("token.create", "details-scoped")["details"]
        assert (scoped["permissions"], scoped["applications"]) == (["application.read", "metric.read"], ["ledger"])
        every_app = entry("token.create", "details-every-app")["details"]
        assert every_app["permissions"] == ["metric.read"]
        assert "applications" in every_app and every_app["applications"] is None, "null: every app"
        created = entry("application.create", "details-app")
        assert created["details"]["private_mode"] is False
        assert created["details"]["application_name"] == "details-app"


# -- Conductor's OpenAPI document (dbos-ctl's internal/api/openapi-3.1.json, from conductor main) --------

# listAuditLogs: an array of AuditLogEntry, whose members these are (``target`` when there is one).
AUDIT_LOG_ENTRY_REQUIRED = {"id", "emitTime", "operation", "status", "subject", "sourceIp", "details"}


def test_conductors_audit_log_is_an_array_of_its_documents_entries_with_the_callers_address(
    relay: RelayProcess,
) -> None:
    """Conductor's OpenAPI document, ``listAuditLogs``: a JSON array of entries with ``id``,
    ``emitTime``, ``operation``, ``status``, ``subject``, ``sourceIp`` and ``details`` (an object or
    null) required, ``target`` when there is one. Relay answered audit-logs.md's ``{"entries": [...]}``
    with ``emit_time`` and no source address, which a client generated from the document cannot
    read. ``sourceIp`` is the address the request came from (the client's socket here: from
    127.0.0.2; "" for the entries Relay made, tests/test_migration_indexes.py). The audit-logs.md
    page's route keeps its shape, with ``source_ip``."""
    transport = httpx.HTTPTransport(local_address="127.0.0.2", verify=TLS)
    headers = {"Authorization": f"Bearer {API_KEYS['acme']}"}
    with httpx.Client(base_url=relay.http, headers=headers, transport=transport, timeout=10, verify=TLS) as api:
        made = api.post("/v2/orgs/acme/tokens/from-elsewhere", json={"permissions": ["application.read"]})
        assert made.status_code == 201, said(made)
        listed = api.get("/v2/orgs/acme/audit-logs", params={"limit": 1000})
        page = api.get(SELF_HOSTED_AUDIT_LOGS, params={"target": "from-elsewhere"})
        document = api.get("/openapi.json").json()
    assert listed.status_code == 200, said(listed)
    entries = listed.json()
    assert isinstance(entries, list), entries
    for entry in entries:
        assert AUDIT_LOG_ENTRY_REQUIRED <= set(entry) <= AUDIT_LOG_ENTRY_REQUIRED | {"target"}, entry
        assert isinstance(entry["sourceIp"], str) and entry["status"] in ("success", "failure"), entry
        assert entry["details"] is None or isinstance(entry["details"], dict), entry
    [mine] = [e for e in entries if e.get("target") == {"type": "token", "id": "from-elsewhere"}]
    assert mine["sourceIp"] == "127.0.0.2" and mine["operation"] == "token.create", mine
    [on_the_page] = page.json()["entries"]
    assert on_the_page == as_on_the_page(mine) and on_the_page["source_ip"] == "127.0.0.2"
    # Relay's own document says so: what a client generated from it reads.
    answer = document["paths"]["/v2/orgs/{org}/audit-logs"]["get"]["responses"]["200"]["content"]
    schema = answer["application/json"]["schema"]
    assert schema["type"] == "array" and schema["items"] == {"$ref": "#/components/schemas/AuditLogEntry"}
    assert set(document["components"]["schemas"]["AuditLogEntry"]["required"]) == AUDIT_LOG_ENTRY_REQUIRED


# dbosctl (github.com/dbos-inc/dbos-ctl at 7de0d90): what its client sends and reads. Every request
# has "Authorization: Bearer <token>" (internal/client/client.go:57), the token $DBOS_TOKEN as it is
# (internal/cli/common.go:175); the base URL is the profile's, to which the generated client adds
# /v2/... (internal/api/client.gen.go). A 200 is decoded only with a Content-Type containing "json"
# (client.gen.go:13385).
DBOSCTL_USERS_ME = "/v2/users/me"  # getCurrentUser, internal/api/client.gen.go:6569


def test_dbosctl_whoami_reads_the_calling_key_as_conductors_user_profile(relay: RelayProcess) -> None:
    """``dbosctl whoami`` on a bearer profile asks ``GET /v2/users/me`` (internal/cli/whoami.go:51)
    and prints the UserProfile's ``name``, ``email``, ``orgName``, ``subscriptionPlan`` and
    ``isDbosAdmin`` (whoami.go:76-80); every org-scoped command of a profile without ``--org`` takes
    its org from the same answer's ``orgName`` (internal/cli/common.go:135-142). Relay answered 404,
    so ``dbosctl whoami`` failed and ``dbosctl app list`` needed ``--org``. It answers for the
    calling key now: its name, org, permissions and apps; ``email`` and ``subscriptionPlan`` null
    (a key has neither); ``createdAt`` the key's."""
    with relay.client() as admin:
        made = admin.post(
            "/v2/orgs/acme/tokens/dbosctl-me", json={"permissions": ["application.read"], "appNames": ["ledger"]}
        )
        assert made.status_code == 201, said(made)
        [listed] = [t for t in admin.get("/v2/orgs/acme/tokens").json() if t["tokenName"] == "dbosctl-me"]
    secret = made.json()["token"]
    for base in ("", "/conductor"):  # a self-hosted Conductor's base, and managed Conductor's
        with httpx.Client(base_url=f"{relay.http}{base}", timeout=10, verify=TLS) as dbosctl:
            me = dbosctl.get(DBOSCTL_USERS_ME, headers={"Authorization": f"Bearer {secret}"})
            assert me.status_code == 200 and "json" in me.headers["content-type"], said(me)
            profile = me.json()
            assert profile == {
                "name": "dbosctl-me",
                "email": None,
                "orgName": "acme",
                "orgId": "acme",
                "subscriptionPlan": None,
                "createdAt": listed["createdAt"],
                "org": "acme",
                "tokenName": "dbosctl-me",
                "permissions": ["application.read"],
                "appNames": ["ledger"],
            }, profile
            # What dbosctl does next with it: the org of `dbosctl app list` (internal/cli/app.go:125).
            apps = dbosctl.get(f"/v2/orgs/{profile['orgName']}/apps", headers={"Authorization": f"Bearer {secret}"})
            assert apps.status_code == 200 and [a["name"] for a in apps.json()] == ["ledger"], said(apps)
            # relay.yaml's admin key: every app.
            admin_me = dbosctl.get(DBOSCTL_USERS_ME, headers={"Authorization": f"Bearer {API_KEYS['acme']}"})
            assert admin_me.status_code == 200, said(admin_me)
            assert (admin_me.json()["orgName"], admin_me.json()["appNames"]) == ("acme", None)
            # No key, or a wrong one: 401 with a problem dbosctl prints (internal/cli/errors.go:51-53).
            for headers in ({}, {"Authorization": "Bearer dbos_not-a-relay-key"}):
                refused = dbosctl.get(DBOSCTL_USERS_ME, headers=headers)
                assert refused.status_code == 401, said(refused)
                assert refused.headers["content-type"] == "application/problem+json", said(refused)
                assert "API key" in refused.json()["detail"], said(refused)
    document = httpx.get(f"{relay.http}/openapi.json", verify=TLS).json()
    schema = document["paths"][DBOSCTL_USERS_ME]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    profile_schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    assert {"name", "email", "orgName", "orgId", "subscriptionPlan", "createdAt"} <= set(profile_schema["required"])


# The members of dbosctl's Application (internal/api/client.gen.go, "type Application struct") and the
# JSON types Go's encoding/json decodes into their Go types (None: a pointer's null). A value of
# another type fails the whole answer's decoding: dbosctl prints the error and no app at all.
DBOSCTL_APPLICATION: dict[str, tuple[type | None, ...]] = {
    "name": (str,),
    "id": (str,),
    "status": (str,),
    "language": (str, None),
    "orgId": (str,),
    "dbosCloud": (bool,),
    "privateMode": (bool,),
    "executorTimeoutSecs": (int,),  # int64
    "gcRowsThreshold": (int, None),
    "gcTimeThresholdMs": (int, None),
    "globalTimeoutMs": (int, None),
}


def decodes_as_dbosctls_application(app: dict[str, Any]) -> bool:
    return all(
        type(app[name]) in types or (app[name] is None and None in types) for name, types in DBOSCTL_APPLICATION.items()
    )


def test_dbosctl_app_list_and_get_decode_an_app_whose_grace_period_has_a_fraction(relay: RelayProcess) -> None:
    """``dbosctl app list`` and ``app get`` (internal/cli/app.go:125, :213) decode each app into their
    Application, whose ``executorTimeoutSecs`` is an int64 (client.gen.go; conductor-api.md's
    generated spec has it ``"type": "integer"``), and print it (app.go:382). Relay allows a grace
    period with a fraction of a second and served it there as it was: an app set to 2.5 s made Go's
    decoding of the whole list fail, so dbosctl listed no app of the org. ``executorTimeoutSecs`` is
    the grace period rounded up to a whole second now, and Relay's ``gracePeriodSecs`` the one set."""
    app = "/v2/orgs/acme/apps/dbosctl-grace"
    with relay.client() as api:
        assert api.put(app, json={}).status_code == 204  # dbosctl app register (app.go:148) sends {}
        try:
            # As `relay apps set dbosctl-grace --grace 2.5s` sends it (Relay's own CLI: a fraction).
            set_to = api.patch(app, json={"executorTimeoutSecs": 2.5})
            assert set_to.status_code == 200, said(set_to)
            listed = api.get("/v2/orgs/acme/apps")  # no parameter, as dbosctl sends it
            assert listed.status_code == 200, said(listed)
            [in_list] = [a for a in listed.json() if a["name"] == "dbosctl-grace"]
            for answer in (in_list, api.get(app).json()):
                assert decodes_as_dbosctls_application(answer), answer
                assert (answer["executorTimeoutSecs"], answer["gracePeriodSecs"]) == (3, 2.5), answer
            assert all(decodes_as_dbosctls_application(a) for a in listed.json()), listed.json()
            # dbosctl app update --executor-timeout-secs 4 (app.go:306) sends an integer; it is kept as it is.
            updated = api.patch(app, json={"executorTimeoutSecs": 4})
            assert (updated.json()["executorTimeoutSecs"], updated.json()["gracePeriodSecs"]) == (4, 4), said(updated)
        finally:
            assert api.delete(app).status_code == 204  # dbosctl app delete --force (app.go:188)
    document = httpx.get(f"{relay.http}/openapi.json", verify=TLS).json()
    schema = document["components"]["schemas"]["Application"]["properties"]["executorTimeoutSecs"]
    assert schema["type"] == "integer", schema


# More than the 100 a Relay list holds by default: what dbosctl showed of each list it cannot page.
PAST_A_PAGE = 101


def test_dbosctls_lists_that_send_no_limit_are_answered_up_to_a_pages_maximum(relay: RelayProcess) -> None:
    """Conductor's document (the one dbos-ctl vendors, internal/api/openapi-3.1.json) gives
    ``listApps``, ``listTokens`` and ``listAlertingRules`` no query parameter: Conductor answers them
    whole, and ``dbosctl app list`` and ``api-key list`` send none (internal/cli/app.go:125,
    apikey.go:68; client.gen.go's NewListAppsRequest and NewListTokensRequest add no query) and have
    no flag to page. Relay answered its first 100, so dbosctl showed 100 apps of 101 and said
    nothing of the rest. Without a ``limit`` these lists now hold a page's maximum (1,000), as a
    workflow search without one does; a ``limit`` given is kept, and the maximum stays 1,000. (The
    executors, dbosctl's ``app executors``: tests/test_api.py's crowd of 151.) In globex, which no
    other test of this module lists."""
    apps = [f"dbosctl-many-{n:03}" for n in range(PAST_A_PAGE)]
    with relay.client(key=API_KEYS["globex"]) as api:
        for app in apps:
            assert api.put(f"/v2/orgs/globex/apps/{app}", json={}).status_code == 204
            made = api.post(f"/v2/orgs/globex/tokens/{app}", json={"permissions": ["application.read"]})
            assert made.status_code == 201, said(made)
            rule = {"ruleType": "WorkflowFailure", "receivingAppName": apps[0]}
            made = api.post(f"/v2/orgs/globex/apps/{apps[0]}/alerting-rules", json=rule)
            assert made.status_code == 201, said(made)
        lists = {
            "/v2/orgs/globex/apps": lambda found: {a["name"] for a in found} >= set(apps),
            "/v2/orgs/globex/tokens": lambda found: {t["tokenName"] for t in found} >= set(apps),
            f"/v2/orgs/globex/apps/{apps[0]}/alerting-rules": lambda found: len(found) == PAST_A_PAGE,
        }
        for path, whole in lists.items():
            listed = api.get(path)  # no parameter, as dbosctl sends it
            assert listed.status_code == 200 and whole(listed.json()), said(listed)
            assert len(api.get(path, params={"limit": 5}).json()) == 5
            assert api.get(path, params={"limit": 1001}).status_code == 422
    document = httpx.get(f"{relay.http}/openapi.json", verify=TLS).json()
    for path in (
        "/v2/orgs/{org}/apps",
        "/v2/orgs/{org}/apps/{app}/executors",
        "/v2/orgs/{org}/tokens",
        "/v2/orgs/{org}/apps/{app}/alerting-rules",
    ):
        [limit] = [p for p in document["paths"][path]["get"]["parameters"] if p["name"] == "limit"]
        assert (limit["schema"]["default"], limit["schema"]["maximum"]) == (1000, 1000), limit


def test_a_401_says_what_to_send_where_dbosctl_prints_it(relay: RelayProcess) -> None:
    """dbosctl prints a 401's problem as "<title>: <detail>" and adds "— run `dbosctl login`"
    (internal/cli/errors.go:51-52, :71-78), an OIDC login Relay cannot take. The detail said only
    "a valid API key is required", the same for a key never sent (a profile of ``--auth none``) as
    for a key Relay does not know (DBOS Cloud's ``dbos_...``). It says which now, what to send, and
    that Relay has no user logins."""
    sent = {
        "no API key was sent as a bearer token": ({}, {"Authorization": "Basic YTpi"}),
        "the API key sent is not a key of this Relay": ({"Authorization": "Bearer dbos_not-a-relay-key"},),
    }
    with relay.client(key=None) as dbosctl:
        for what, headers_sent in sent.items():
            for headers in headers_sent:
                refused = dbosctl.get("/v2/orgs/acme/apps", headers=headers)
                assert refused.status_code == 401, said(refused)
                assert refused.headers["content-type"] == "application/problem+json", said(refused)
                problem = refused.json()
                assert problem["title"] == "Unauthorized", said(refused)
                assert problem["detail"] == (
                    f"{what}: send a Relay API key as Authorization: Bearer <apiKey> (Relay has no user logins)"
                ), said(refused)


# Every body of an operation of Conductor's that Relay serves, each as small as it may be; acme's
# ledger has no executor in this module, so those asked of an executor answer 503 once taken.
SCHEMA_URL = "https://conductor.example/schemas/Body.json"
EXPORT = base64.b64encode(gzip.compress(b"{}")).decode()  # an export's form; never unpacked (no executor)
ORG_PATH = "/v2/orgs/acme"
APP_PATH = f"{ORG_PATH}/apps/ledger"
CONDUCTOR_BODIES: list[tuple[str, str, dict[str, Any], int]] = [
    ("PUT", f"{ORG_PATH}/apps/schema-{{n}}", {}, 204),
    ("PATCH", f"{ORG_PATH}/apps/ledger", {"executorTimeoutSecs": 30}, 200),
    ("POST", f"{APP_PATH}/alerting-rules", {"ruleType": "WorkflowFailure", "receivingAppName": "ledger"}, 201),
    ("POST", f"{ORG_PATH}/tokens/schema-{{n}}", {"permissions": ["application.read"]}, 201),
    ("PATCH", f"{APP_PATH}/versions/latest", {"versionName": "v1"}, 503),
    (
        "POST",
        f"{APP_PATH}/schedules/nightly/backfill",
        {"startTime": "2026-01-01T00:00:00Z", "endTime": "2026-01-02T00:00:00Z"},
        503,
    ),
    ("POST", f"{APP_PATH}/workflows/search", {}, 503),
    ("POST", f"{APP_PATH}/workflows/aggregates", {"groupByStatus": True}, 503),
    ("POST", f"{APP_PATH}/steps/aggregates", {"groupByStatus": True}, 503),
    ("POST", f"{APP_PATH}/workflows/wf-1/cancel", {}, 503),
    ("POST", f"{APP_PATH}/workflows/wf-1/resume", {}, 503),
    ("POST", f"{APP_PATH}/workflows/wf-1/fork", {}, 503),
    ("POST", f"{APP_PATH}/workflows/import", {"serializedWorkflow": EXPORT}, 503),
    ("POST", f"{APP_PATH}/workflows/bulk-cancel", {"workflowIds": ["wf-1"]}, 503),
    ("POST", f"{APP_PATH}/workflows/bulk-resume", {"workflowIds": ["wf-1"]}, 503),
    ("POST", f"{APP_PATH}/workflows/bulk-delete", {"workflowIds": ["wf-1"]}, 503),
    ("POST", f"{APP_PATH}/workflows/bulk-fork-from-failure", {"workflowIds": ["wf-1"], "fromLastFailure": True}, 503),
]


def test_every_body_of_conductors_operations_takes_and_ignores_its_schema_member(relay: RelayProcess) -> None:
    """Conductor's OpenAPI document lists ``$schema`` (the URL of the body's JSON Schema) in the body
    of each of its operations, and its answers carry one: a client that sends back what it read
    sends it too. Relay refused every such body, 422 "Extra inputs are not permitted". Each is now
    answered as the same body without it, and Relay's document lists it; a ``$schema`` that is not
    a string is refused, as the document's type says."""
    with relay.client() as api:
        for n, (method, path, body, status) in enumerate(CONDUCTOR_BODIES):
            answers = []
            for sent in (body, {**body, "$schema": SCHEMA_URL}):
                resp = api.request(method, path.format(n=f"{n}-{len(answers)}"), json=sent)
                answers.append(resp.status_code)
                assert resp.status_code == status, said(resp)
        bad = api.post(f"{APP_PATH}/workflows/search", json={"$schema": 7})
        assert bad.status_code == 422 and bad.json()["errors"][0]["location"] == "body.$schema", said(bad)
        document = api.get("/openapi.json").json()
    for method, path, _, _ in CONDUCTOR_BODIES:
        templated = path.replace("ledger", "{app}").replace("acme", "{org}")
        templated = templated.replace("schema-{n}", "{app}" if "/apps/" in templated else "{token_name}")
        operation = document["paths"][templated.replace("wf-1", "{workflow_id}").replace("nightly", "{schedule_name}")]
        schema = operation[method.lower()]["requestBody"]["content"]["application/json"]["schema"]
        # A body that may be left out is its shape or null.
        [ref] = [s["$ref"] for s in schema.get("anyOf", [schema]) if "$ref" in s]
        body_schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
        # Its members, or (the alerting rules') those of each of its shapes.
        shapes = [body_schema] if "properties" in body_schema else body_schema["oneOf"]
        assert all(shape["properties"]["$schema"]["type"] == "string" for shape in shapes), (method, path)


QUERY_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    params=st.dictionaries(
        st.sampled_from(["start", "end", "operation", "subject", "target", "page_size", "offset", "bogus"]),
        st.one_of(QUERY_TEXT, st.integers(-(2**70), 2**70).map(str)),
        max_size=5,
    ),
    org=st.one_of(st.just("acme"), QUERY_TEXT.filter(lambda s: s and "/" not in s and s not in (".", ".."))),
)
def test_any_query_of_the_audit_log_page_is_answered_or_refused_and_harms_no_other_client(
    relay: RelayProcess, params: dict[str, str], org: str
) -> None:
    """Bad input to the audit-logs.md route gets a clear answer (200, or a 4xx problem), never a
    server error; and the next client is answered as before."""
    with relay.client() as api:
        resp = api.get(f"/v1alpha1/api/{quote(org, safe='')}/audit-logs", params=params)
        assert resp.status_code < 500, said(resp)
        if resp.status_code >= 400:
            assert resp.headers["content-type"].startswith("application/problem+json"), said(resp)
        after = api.get(SELF_HOSTED_AUDIT_LOGS, params={"page_size": 1})
        assert after.status_code == 200, said(after)


def test_a_metrics_window_is_two_rfc_3339_times(relay: RelayProcess) -> None:
    """conductor-api.md, "Listing and Filtering": "Time windows are given as `startTime` and `endTime`
    in RFC 3339 format". Relay's ``GET .../metrics`` took a number for a time too (seconds or
    milliseconds since 1970, as pydantic guesses: ``1767225600000`` was 2026-01-01), where every other
    route refuses one; and refused a time without its offset with no ``errors`` naming it."""
    path = "/v2/orgs/acme/apps/ledger/metrics"
    window = {"startTime": "2026-01-01T00:00:00Z", "endTime": "2026-01-02T00:00:00+01:00"}
    with relay.client() as api:
        resp = api.get(path, params=window)
        assert resp.status_code == 200, said(resp)
        assert resp.json() == [], "no executor has connected: no figures"
        for name, value in (("startTime", "1767225600000"), ("startTime", "1767225600"), ("endTime", "1767312000"),
                            ("startTime", "2026-01-01T00:00:00"), ("endTime", "2026-01-02")):  # fmt: skip
            resp = api.get(path, params={**window, name: value})
            assert resp.status_code == 422, said(resp)
            assert resp.headers["content-type"] == "application/problem+json"
            [error] = resp.json()["errors"]
            assert error["location"] == f"query.{name}", said(resp)


def test_every_422_has_errors_locating_its_problem(relay: RelayProcess) -> None:
    """conductor-api.md, "Errors": "Validation failures add an `errors` array locating each individual
    problem" (and the contract: "422 adds `errors` with `location` and `message`"). The 422s of
    Relay's own checks, after the request's types had passed, had none: a client reading ``errors``
    found nothing to point at. None of these requests reaches an executor (the module's Relay has
    none): each is refused first."""
    ledger = "/v2/orgs/acme/apps/ledger"
    refusals = [
        ("GET", f"{ledger}/workflows?status=FAILED", None, ["query.status"]),
        ("GET", f"{ledger}/workflows?startTime=2026-01-01T00:00:00Z&user=x", None, ["query.startTime", "query.user"]),
        ("GET", f"{ledger}/workflows?limit=1&limit=2", None, ["query.limit"]),
        ("GET", f"{ledger}/executors/x/workflows?status=FAILED", None, ["query.status"]),
        ("POST", f"{ledger}/workflows/aggregates", {"selectCount": True}, ["body"]),
        ("POST", f"{ledger}/steps/aggregates", {"selectCount": True}, ["body"]),
        ("POST", f"{ledger}/workflows/bulk-fork-from-failure", {"workflowIds": ["x"]}, ["body"]),
        ("PATCH", ledger, {}, ["body"]),
        ("GET", "/metrics?scope=everything", None, ["query.scope"]),
    ]
    with relay.client() as api:
        for method, path, body, locations in refusals:
            resp = api.request(method, path, json=body)
            assert resp.status_code == 422, said(resp)
            assert resp.headers["content-type"] == "application/problem+json", said(resp)
            problem = resp.json()
            assert [e["location"] for e in problem.get("errors", [])] == locations, said(resp)
            assert {e["message"] for e in problem["errors"]} == {problem["detail"]}, said(resp)
