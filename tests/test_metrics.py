"""Metrics: the recovery pipeline's figures against the audit log, the apps' figures
(``dbos_conductor_v1_*``) against the executors' system database, served by every instance,
Conductor's ``GET .../apps/{app}/metrics``, and the Grafana dashboard's expressions against a scrape."""

from __future__ import annotations

import json
import re
import signal
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from dbos import DBOSClient
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from harness.executors import ExecutorProcess
from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer, requests_over_runs
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.core.times import us_iso
from relay.net.hub import HUB_EVENT_KINDS
from tests.prom import sample
from tests.promql import PromQLError, metric_names

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]
DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "relay.json"
PREFIX = "dbos_conductor_v1_"


def ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def scrape(relay: RelayProcess, key: str = API_KEYS["acme"], **params: str | list[str]) -> str:
    resp = httpx.get(
        f"{relay.http}/metrics", headers={"Authorization": f"Bearer {key}"}, params=params, timeout=5, verify=TLS
    )
    resp.raise_for_status()
    return resp.text


def samples(text: str, prefix: str = "") -> list[Sample]:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith(prefix)]


# -- the recovery pipeline --------------------------------------------------------------------------


def test_recovery_pipeline_figures_match_the_audit_log(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    config = relay_yaml(free_port(), grace=0.5, recoveryAckTimeoutSecs=1.0, failoverBackoffInitialSecs=0.3)
    config["metrics"] = {"appFigures": False}
    relay = start_relay(config)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    dead = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "3", "RELAY_TEST_JOB_SLEEP": "2"})
    assert_eventually(lambda: relay.state_of("acme", "ledger", dead.executor_id) == "HEALTHY", 10)
    dead.kill()
    # Alone, it waits for a peer; its record keeps the moment it disconnected.
    record = assert_eventually(
        lambda: (r := relay.executor("acme", "ledger", dead.executor_id)) and r["blockedReason"] and r, 10
    )
    assert record["blockedReason"] == "no_healthy_peer"
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    # A peer that never answers a recovery (each attempt times out), then a real one: a failover.
    with SimulatedPeer(url, str(uuid.uuid4()), "silent") as silent:
        assert_eventually(lambda: silent.recovery_requests >= 1, 10)
        peer = start_executor(relay.conductor_url, env=env)
        assert_eventually(lambda: relay.executor("acme", "ledger", dead.executor_id) is None, 30)
        # The success's stages are observed once the write that deleted the record has committed: awaited,
        # not read the moment the record is gone. Read before the silent peer goes: it would die after
        # its 0.5 s grace period, and its death and recovery be counted in the instance's histograms.
        last = ("dispatched_to_reply", "reply_to_verified", "dead_to_deleted")
        text = assert_eventually(
            lambda: (t := scrape(relay)) and all(sample(t, f"relay_recovery_{s}_seconds_count") for s in last) and t,
            10,
            what="the success's stages observed",
        )
        other = scrape(relay, API_KEYS["globex"])  # another org's key (below)
    with relay.api() as api:
        audit = api.get("/audit", params={"executorId": dead.executor_id}).json()
    at = {e["action"]: ts(e["at"]) for e in audit}  # the last of each action
    dispatches = [e for e in audit if e["action"] == "recovery.dispatched"]
    assert dispatches[-1]["peerExecutorId"] == peer.executor_id

    def histogram(stage: str) -> tuple[float, float]:
        name = f"relay_recovery_{stage}_seconds"
        count, total = sample(text, f"{name}_count"), sample(text, f"{name}_sum")
        assert count is not None and total is not None, name
        return count, total

    tolerance = 0.002  # both sides are the database's timestamps
    assert histogram("disconnect_to_dead") == (1, pytest.approx(at["executor.dead"] - ts(record["disconnectedAt"]),
                                                                abs=tolerance))  # fmt: skip
    # The death's first dispatch (to the silent peer) only.
    assert histogram("dead_to_dispatched") == (1, pytest.approx(ts(dispatches[0]["at"]) - at["executor.dead"],
                                                                abs=tolerance))  # fmt: skip
    # Only the real peer replied; its reply and verification fall between its dispatch and the success.
    (replies, to_reply), (verified, to_verified) = histogram("dispatched_to_reply"), histogram("reply_to_verified")
    assert (replies, verified) == (1, 1)
    attempt = at["recovery.succeeded"] - ts(dispatches[-1]["at"])
    assert attempt - 0.3 <= to_reply + to_verified <= attempt + tolerance
    assert histogram("dead_to_deleted") == (1, pytest.approx(at["executor.deleted"] - at["executor.dead"],
                                                             abs=tolerance))  # fmt: skip
    failovers = [e for e in audit if e["action"] == "recovery.failover"]
    waits = [e for e in audit if e["action"] == "recovery.waiting_for_peer"]
    assert failovers and failovers[-1]["peerExecutorId"] == peer.executor_id
    assert sample(text, "relay_recovery_failovers_total", org="acme", app="ledger") == len(failovers)
    assert sample(text, "relay_recoveries_blocked_total", org="acme", app="ledger", reason="no_healthy_peer") == len(
        waits
    )
    # Another org's key: this instance's figures, but no series of acme's (its families still described).
    assert [s for s in samples(other) if "org" in s.labels or "app" in s.labels] == []
    assert sample(other, "relay_recovery_dead_to_deleted_seconds_count") == 1, "instance-wide: every key's"
    assert sample(other, "relay_lease_held") == 1
    for family in (
        "relay_recovery_failovers_total counter",
        "relay_recoveries_blocked_total counter",
        "relay_executors gauge",
    ):
        assert f"# TYPE {family}\n" in other, family
    opened = httpx.get(f"{relay.http}/v1/metrics", headers={"Authorization": f"Bearer {API_KEYS['globex']}",
                       "Accept": "application/openmetrics-text"}, timeout=5, verify=TLS)  # fmt: skip
    # A key limited to the app sees its series.
    with relay.api() as admin:
        made = admin.post("/tokens/ledger-metrics", json={"permissions": ["metric.read"], "appNames": ["ledger"]})
        assert made.status_code == 201, made.text
    mine = scrape(relay, made.json()["token"])
    assert sample(mine, "relay_recovery_failovers_total", org="acme", app="ledger") == len(failovers)
    assert opened.text.endswith("# EOF\n") and not [
        s for f in openmetrics_families(opened.text) for s in f.samples if s.labels.get("org") == "acme"
    ]


# -- the apps' figures ------------------------------------------------------------------------------

WINDOW = 1.0


def sysdb_rows(sysdb: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(sysdb) as conn:
        return list(conn.execute(sql, args).fetchall())  # type: ignore[call-overload]


def expected_rates(sysdb: str, start_ms: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the figures of the window starting at ``start_ms`` must say, from the system database."""
    end_ms = start_ms + int(WINDOW * 1000)
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def put(family: str, labels: dict[str, str], value: float) -> None:
        found[(family, tuple(sorted(labels.items())))] = value

    for name, queue, n in sysdb_rows(sysdb, """SELECT name, coalesce(queue_name, ''), count(*) FROM dbos.workflow_status
            WHERE created_at >= %s AND created_at < %s GROUP BY 1, 2""", start_ms, end_ms):  # fmt: skip
        put("workflow_started_rate", {"workflow_name": name, "queue_name": queue}, n / WINDOW)
    for status, name, queue, n, latency in sysdb_rows(sysdb, """SELECT status, name, coalesce(queue_name, ''),
            count(*), max(completed_at - created_at) FROM dbos.workflow_status
            WHERE completed_at >= %s AND completed_at < %s GROUP BY 1, 2, 3""", start_ms, end_ms):  # fmt: skip
        family = {"SUCCESS": "workflow_success_rate", "ERROR": "workflow_failed_rate",
                  "CANCELLED": "workflow_cancelled_rate"}[status]  # fmt: skip
        put(family, {"workflow_name": name, "queue_name": queue}, n / WINDOW)
        if status == "SUCCESS":
            put("workflow_max_total_latency_seconds", {"workflow_name": name, "queue_name": queue}, latency / 1000)
    for step, failed, n in sysdb_rows(sysdb, """SELECT function_name, error IS NOT NULL, count(*)
            FROM dbos.operation_outputs WHERE completed_at_epoch_ms >= %s AND completed_at_epoch_ms < %s
            GROUP BY 1, 2""", start_ms, end_ms):  # fmt: skip
        put("step_failed_rate" if failed else "step_success_rate", {"step_name": step}, n / WINDOW)
    return found


def served_rates(text: str) -> tuple[int, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """The window (start, ms) and the rate and latency series a scrape serves for acme/ledger."""
    wanted = {"workflow_started_rate", "workflow_success_rate", "workflow_failed_rate", "workflow_cancelled_rate",
              "workflow_max_total_latency_seconds", "step_success_rate", "step_failed_rate"}  # fmt: skip
    found, stamps = {}, set()
    for s in samples(text, PREFIX):
        family = s.name.removeprefix(PREFIX)
        if family in wanted and s.labels["application"] == "ledger":
            labels = {k: v for k, v in s.labels.items() if k not in ("org", "application")}
            found[(family, tuple(sorted(labels.items())))] = s.value
            assert s.timestamp is not None, "rates and windowed figures carry their window's time"
            stamps.add(round(float(s.timestamp) * 1000))
    assert len(stamps) <= 1
    return (stamps.pop() if stamps else 0), found


def point_in_time(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    families = {"workflow_enqueued_count", "workflow_pending_count", "workflow_oldest_enqueued_timestamp_seconds",
                "workflow_oldest_pending_timestamp_seconds", "executor_count"}  # fmt: skip
    found = {}
    for s in samples(text, PREFIX):
        if s.name.removeprefix(PREFIX) in families and s.labels["application"] == "ledger":
            assert s.timestamp is None, "point-in-time figures carry no time"
            found[(s.name.removeprefix(PREFIX), tuple(sorted(s.labels.items())))] = s.value
    return found


def test_app_figures_match_the_system_database_on_every_instance(
    start_relay: StartRelay, start_executor: StartExecutor, sysdb: str
) -> None:
    config = relay_yaml(free_port(), instanceLeaseSecs=2.0)
    config["metrics"] = {"appFiguresWindowSecs": WINDOW}
    r1 = start_relay(config, "relay-1")
    r2 = start_relay({**config, "server": {**config["server"], "port": free_port()}}, "relay-2")
    executor = start_executor(r2.conductor_url, module="harness.workflow_app", env={"RELAY_TEST_SEED": "1"})
    assert_eventually(lambda: r2.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 10)
    dbos = DBOSClient(system_database_url=sysdb, application_name="ledger")
    try:
        for n in range(2):
            dbos.enqueue({"workflow_name": "job", "queue_name": "held", "workflow_id": f"held-{n}",
                          "app_version": "v1"}, n)  # fmt: skip

        # Jobs run through the queue "serial", then a window in which they succeeded is served.
        seen: list[str] = []

        def window_with_jobs() -> tuple[int, dict[Any, float]] | None:
            seen.append(scrape(r1))
            start_ms, rates = served_rates(seen[-1])
            return (start_ms, rates) if any(k[0] == "workflow_success_rate" for k in rates) else None

        for n in range(6):
            dbos.enqueue({"workflow_name": "job", "queue_name": "serial", "app_version": "v1"}, n)
        start_ms, rates = assert_eventually(window_with_jobs, 15, interval=0.1)
        serial = "SELECT DISTINCT status FROM dbos.workflow_status WHERE queue_name = 'serial'"
        # DBOS's queue thread starts one job of "serial" (concurrency 1) per poll, once a second: the
        # seed's three and these six take nine polls or more, and longer on a loaded machine.
        assert_eventually(lambda: sysdb_rows(sysdb, serial) == [("SUCCESS",)], 40)
    finally:
        dbos.destroy()
    assert start_ms % int(WINDOW * 1000) == 0, "clock-aligned"
    assert rates == pytest.approx(expected_rates(sysdb, start_ms))

    # Point-in-time: what the system database holds now (nothing changes any more).
    held = sysdb_rows(sysdb, "SELECT min(created_at) FROM dbos.workflow_status WHERE queue_name = 'held'")[0][0]
    waiting = sysdb_rows(sysdb, "SELECT created_at FROM dbos.workflow_status WHERE workflow_uuid = 'waiting-1'")[0][0]
    base = {"application": "ledger", "org": "acme"}
    job_held = tuple(sorted({**base, "queue_name": "held", "workflow_name": "job"}.items()))
    parent = tuple(sorted({**base, "workflow_name": "parent"}.items()))
    executors = tuple(sorted({**base, "application_version": "v1", "status": "HEALTHY"}.items()))
    expected = {
        ("workflow_enqueued_count", job_held): 2,
        ("workflow_oldest_enqueued_timestamp_seconds", job_held): held / 1000,
        ("workflow_pending_count", parent): 1,
        ("workflow_oldest_pending_timestamp_seconds", parent): waiting / 1000,
        ("executor_count", executors): 1,
    }
    # (The window's own scrape may have been computed while the last jobs were still queued.)
    assert_eventually(lambda: point_in_time(scrape(r1)) == {k: pytest.approx(v) for k, v in expected.items()}, 5)
    # Any instance serves them, whichever computed them.
    assert point_in_time(scrape(r2)) == point_in_time(scrape(r1))
    # OpenMetrics to a scraper that asks for it, at Conductor's path, as Conductor's documentation scrapes.
    resp = httpx.get(f"{r1.http}/v1/metrics", headers={"Authorization": f"Bearer {API_KEYS['acme']}",
                     "Accept": "application/openmetrics-text"}, timeout=5, verify=TLS)  # fmt: skip
    assert resp.headers["content-type"].startswith("application/openmetrics-text") and resp.text.endswith("# EOF\n")
    opened = {(s.name.removeprefix(PREFIX), tuple(sorted(s.labels.items()))): s.value
              for f in openmetrics_families(resp.text) for s in f.samples if s.name.startswith(PREFIX)}  # fmt: skip
    assert {k: v for k, v in opened.items() if k in expected} == {k: pytest.approx(v) for k, v in expected.items()}

    # What a scrape shows: the key's org, Conductor's filters, Relay's or the apps' families.
    assert not samples(scrape(r1, API_KEYS["globex"]), PREFIX)
    # Concurrent scrapes of two orgs each see their own org only.
    keys = [API_KEYS["acme"], API_KEYS["globex"]] * 10
    with ThreadPoolExecutor(len(keys)) as pool:
        seen_by = list(pool.map(lambda key: (key, samples(scrape(r1, key), PREFIX)), keys))
    assert all(bool(found) == (key == API_KEYS["acme"]) for key, found in seen_by)
    assert not samples(scrape(r1, applications="billing"), PREFIX)
    assert {s.labels["workflow_name"] for s in samples(scrape(r1, workflow_names="parent"), PREFIX + "workflow")} <= {
        "parent"
    }
    only = samples(scrape(r1, metrics=f"{PREFIX}executor_count"))
    assert only and {s.name for s in only} == {f"{PREFIX}executor_count"}
    assert not samples(scrape(r1, scope="instance"), PREFIX)
    assert {s.name.split("_")[0] for s in samples(scrape(r1, scope="apps"))} == {"dbos"}
    check_dashboard([*seen, scrape(r1)])

    # Conductor's Metric[]: the workflow and step counts of each stored window.
    since = datetime.fromtimestamp(start_ms / 1000 - 30, UTC).isoformat()
    until = datetime.fromtimestamp(start_ms / 1000 + 30, UTC).isoformat()
    with r1.api() as api:
        assert api.get("/apps/ledger/metrics", params={"startTime": since}).status_code == 422
        metrics = api.get("/apps/ledger/metrics", params={"startTime": since, "endTime": until}).json()
        assert api.get("/apps/ledger/metrics", params={"startTime": until, "endTime": since}).json() == []
    jobs = [m for m in metrics if m["timeBucket"] == us_iso(datetime.fromtimestamp(start_ms / 1000, UTC))
            and m["metricType"] == "workflow_count" and m["metricName"] == "job"]  # fmt: skip
    # By workflow name, whatever the queue; the window that served successes may have started none (under
    # load the jobs are created in one window and succeed in the next): then it has no workflow_count.
    started = sum(
        v for (f, labels), v in rates.items() if f == "workflow_started_rate" and ("workflow_name", "job") in labels
    )
    assert sum(m["value"] for m in jobs) == started * WINDOW
    assert any(m["metricType"] == "workflow_count" and m["metricName"] == "job" for m in metrics)
    assert {m["granularity"] for m in metrics} == {1} and {m["appId"] for m in metrics} == {"ledger"}
    for m in metrics:
        if m["metricType"] == "workflow_count":
            bucket = round(ts(m["timeBucket"]) * 1000)
            (n,) = sysdb_rows(sysdb, "SELECT count(*) FROM dbos.workflow_status WHERE name = %s AND created_at >= %s "
                              "AND created_at < %s", m["metricName"], bucket, bucket + 1000)[0]  # fmt: skip
            assert m["value"] == n, m

    # The instance that computes may die: the figures go on (every instance starts each window's job).
    r1.signal(signal.SIGKILL)
    killed = time.time()

    def newer_window() -> bool:
        with psycopg.connect(r2.database_url) as conn:
            row = conn.execute("SELECT extract(epoch FROM max(window_start)) FROM app_figures").fetchone()
        return row is not None and float(row[0]) > killed + WINDOW

    assert_eventually(newer_window, 10, interval=0.2)
    assert point_in_time(scrape(r2)) == {k: pytest.approx(v) for k, v in expected.items()}


def peers_url(relay: RelayProcess) -> str:
    return f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"


def test_app_figures_ask_three_executors_of_an_app_whose_executors_all_fail(start_relay: StartRelay) -> None:
    """Each window's job asked every executor of the app in turn while they failed: one request to
    each executor of a fleet, every minute. It gives up after three."""
    config = relay_yaml(free_port())
    config["metrics"] = {"appFiguresWindowSecs": WINDOW}
    relay = start_relay(config)
    peers = [SimulatedPeer(peers_url(relay), f"failing-{i}", "answer") for i in range(8)]  # errors to the rest
    finished, requests, started = requests_over_runs(relay, peers, "relay.app_figures")
    asked = sum(r["get_workflow_aggregates"] for r in requests)
    # Every job since all eight were HEALTHY asked three (its first request failed, so the app had
    # no figures); the earlier ones asked as many as were connected, three at most.
    assert 3 * finished <= asked <= 3 * started, (finished, asked, started)
    assert "no executor of app 'ledger' answered (3 asked)" in relay.log()
    assert sum(r["get_step_aggregates"] for r in requests) == 0


def test_app_figures_skip_the_executors_of_a_version_whose_sdk_lacks_the_message(start_relay: StartRelay) -> None:
    """An SDK that does not know the message answers so for every executor of its build: the others
    of that version are not asked (nor counted), and an executor of another version answers."""
    config = relay_yaml(free_port())
    config["metrics"] = {"appFiguresWindowSecs": WINDOW}
    relay = start_relay(config)
    empty = {"get_workflow_aggregates": {"output": []}, "get_step_aggregates": {"output": []}}
    # In id order the five old executors come first: most windows' turn begins among them.
    old = [SimulatedPeer(peers_url(relay), f"a-old-{i}", "answer", version="v0", others="unknown") for i in range(5)]
    new = SimulatedPeer(peers_url(relay), "b-new", "answer", version="v1", replies=empty)
    # The new one is HEALTHY before the old ones connect: from the first run on, the app has an
    # executor that answers.
    finished, requests, started = requests_over_runs(relay, [new, *old], "relay.app_figures")
    asked = [r["get_workflow_aggregates"] + r["get_step_aggregates"] for r in requests]
    asked_new, asked_old = asked[0], sum(asked[1:])
    # Each job's five requests: every one answered by the new executor, after at most one old one.
    assert 5 * finished <= asked_new <= 5 * started, (finished, asked_new, started)
    assert asked_old <= asked_new
    assert "no figures for the window" not in relay.log()
    with psycopg.connect(relay.database_url) as conn:
        row = conn.execute("SELECT window_start FROM app_figures WHERE org = 'acme' AND app = 'ledger'").fetchone()
    assert row is not None and row[0].timestamp() > time.time() - 10 * WINDOW, row  # a recent window's


# -- the dashboard --------------------------------------------------------------------------------


def dashboard_expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    found = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    found += [t["expr"] for p in board["panels"] for sub in p.get("panels", []) for t in sub.get("targets", [])]
    for variable in board["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            # Grafana's label_values(selector, label): the selector is PromQL.
            inner = query["query"].removeprefix("label_values(").removesuffix(")")
            found.append(inner.rsplit(",", 1)[0])
    return found


def check_dashboard(texts: list[str]) -> None:
    """Every metric the dashboard uses is one the scrapes declare (a family, or a sample of one)."""
    known: set[str] = set()
    for family in (f for text in texts for f in text_string_to_metric_families(text)):
        known.add(family.name)
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}.get(family.type, [])
        known.update(family.name + suffix for suffix in suffixes)
        known.update(s.name for s in family.samples)
    used = set().union(*(metric_names(e) for e in dashboard_expressions()))
    assert used <= known, sorted(used - known)
    # Each of the apps' figures it uses was served (this scenario has no failures and no cancellations).
    served = {s.name for text in texts for s in samples(text, PREFIX)}
    assert {n for n in used if n.startswith(PREFIX)} <= served | {
        f"{PREFIX}workflow_{k}" for k in ("dequeued_rate", "failed_rate", "cancelled_rate", "max_queue_wait_seconds")
    } | {f"{PREFIX}step_failed_rate"}


def test_the_dashboard_parses_and_the_parser_refuses_what_is_not_promql() -> None:
    expressions = dashboard_expressions()
    assert len(expressions) > 20
    names = set().union(*(metric_names(e) for e in expressions))
    assert {"relay_recovery_dead_to_deleted_seconds_bucket", "relay_recovery_failovers_total",
            "dbos_conductor_v1_workflow_oldest_enqueued_timestamp_seconds"} <= names  # fmt: skip
    assert metric_names('sum by (le) (rate(x_bucket{a=~"$b"}[$__rate_interval])) * on (k) group_left y offset 5m') == {
        "x_bucket",
        "y",
    }
    for broken in ("sum(rate(x[5m])", "rate(x[5m]", "x{a=b}", "nosuchfn(x)", "x +", "x[5]", "sum by (a x)"):
        with pytest.raises(PromQLError):
            metric_names(broken)


def test_every_hub_event_is_declared_and_listed_in_the_readme() -> None:
    """relay_hub_events_total exports the kinds Hub declares, from the start: a kind counted but not
    declared would appear only once it happened (an alert on its increase misses the first), and one
    the README does not list is unknown to the operator."""
    root = Path(__file__).resolve().parents[1]
    counted = set()
    for module in (root / "relay" / "net").glob("*.py"):
        counted |= set(re.findall(r'counters\["(\w+)"\]', module.read_text()))
    assert counted == set(HUB_EVENT_KINDS)
    (row,) = [line for line in (root / "README.md").read_text().splitlines() if "`relay_hub_events_total`" in line]
    assert [kind for kind in HUB_EVENT_KINDS if f"`{kind}`" not in row] == []
