"""The stranded-workflow reconciler: the pure choice of what is stranded, and end to end with a
real Relay, real PostgreSQL and real DBOS 3.2 executors."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from harness.executors import Evidence, ExecutorProcess
from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.proxy import TcpProxy
from harness.relay import RelayProcess, audit_actions, relay_yaml
from harness.simulated import SimulatedPeer, requests_over_runs
from harness.waiting import assert_eventually
from relay.config import parse_config
from relay.core.stranded import PendingWorkflow, candidate_ids, find_stranded
from relay.errors import ConfigError
from tests.prom import scrape

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]

NOW = 1_000_000_000


def wf(workflow_id: str, executor_id: str, age_secs: float | None, version: str = "v1") -> PendingWorkflow:
    return PendingWorkflow(workflow_id, executor_id, version, None if age_secs is None else NOW - int(age_secs * 1000))


def test_only_old_work_of_executors_with_no_record_is_stranded() -> None:
    workflows = [
        wf("a", "deleted", 10),
        wf("b", "deleted", 0.5),  # moved within the grace period
        wf("c", "deleted", None),  # update time unknown
        wf("d", "registered", 10),  # has a record: not the reconciler's
        wf("e", "local", 10),
        wf("f", "stranger", 10),
    ]
    gone = {"deleted": True, "stranger": False, "local": False}
    assert candidate_ids(workflows) == ["deleted", "registered", "stranger"]
    found = find_stranded(workflows, gone, now_ms=NOW, grace_secs=2, include_unknown=False)
    assert [(s.executor_id, s.workflow_ids, s.registered) for s in found] == [("deleted", ("a",), True)]
    opted_in = find_stranded(workflows, gone, now_ms=NOW, grace_secs=2, include_unknown=True)
    assert [s.executor_id for s in opted_in] == ["deleted", "stranger"]  # never local


def test_an_executor_on_several_versions_is_recovered_on_the_most_common() -> None:
    workflows = [wf("a", "x", 9, "v1"), wf("b", "x", 9, "v2"), wf("c", "x", 9, "v2")]
    (found,) = find_stranded(workflows, {"x": True}, now_ms=NOW, grace_secs=1, include_unknown=False)
    assert found.application_version == "v2" and found.workflow_ids == ("a", "b", "c")


def reconciling_relay(start_relay: StartRelay, grace: float, interval: float = 0.5) -> RelayProcess:
    config: dict[str, Any] = relay_yaml(free_port(), grace=grace)
    config["reconciler"] = {"enabled": True, "intervalSecs": interval}
    relay: RelayProcess = start_relay(config)
    return relay


def ended_before(relay: RelayProcess, workflow_name: str, t: float) -> bool:
    """Whether every run of one of Relay's workflows begun before ``t`` has ended."""
    begun = relay.runs_of(workflow_name) - relay.runs_of(workflow_name, since=t)
    ended = relay.runs_of(workflow_name, "SUCCESS") - relay.runs_of(workflow_name, "SUCCESS", since=t)
    return begun > 0 and begun == ended


def steps_once(evidence: Evidence) -> Counter[tuple[str, str]]:
    return Counter((w, s) for w, s, _ in evidence.step_runs())


def test_work_stranded_while_relay_was_down_is_completed_exactly_once(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, relay_db: str
) -> None:
    relay = reconciling_relay(start_relay, grace=1.0)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    peer = start_executor(relay.conductor_url, env=env)
    victim = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "6", "RELAY_TEST_JOB_SLEEP": "5"})
    assert_eventually(lambda: relay.state_of("acme", "ledger", victim.executor_id) == "HEALTHY", 10)
    evidence = Evidence(evidence_db)
    assert_eventually(lambda: len(evidence.step_runs()) >= 6 or None, 10)
    time.sleep(0.5)  # the first steps' checkpoints
    # Relay dies; the victim dies while it is down, and its record is lost with it.
    assert relay.proc is not None
    relay.proc.kill()
    relay.proc.wait()
    victim.kill()
    with psycopg.connect(relay_db, autocommit=True) as conn:
        conn.execute("DELETE FROM executors WHERE executor_id = %s", (victim.executor_id,))
    relay.start()

    outcomes = assert_eventually(lambda: (o := evidence.outcomes()) and len(o) >= 6 and o, 40)
    assert set(outcomes) == {f"job-{i}" for i in range(6)}
    assert set(outcomes.values()) == {peer.executor_id}
    runs = steps_once(evidence)
    assert set(runs.values()) == {1}, runs  # every step of every workflow ran once
    assert {e for _, s, e in evidence.step_runs() if s == "start"} == {victim.executor_id}
    # Found, brought back DEAD, recovered through the verified path, deleted again: once.
    assert_eventually(lambda: "executor.deleted" in audit_actions(relay, victim.executor_id), 20)
    actions = audit_actions(relay, victim.executor_id)
    for action in ("reconcile.found", "reconcile.recovered", "recovery.dispatched", "recovery.succeeded"):
        assert actions.count(action) == 1, (action, actions)
    assert actions.index("reconcile.found") < actions.index("reconcile.recovered") < actions.index("recovery.succeeded")
    with relay.api() as api:
        (recovery,) = api.get("/apps/ledger/recoveries", params={"executorId": victim.executor_id}).json()
    assert recovery["trigger"] == "reconcile" and recovery["status"] == "succeeded"
    assert scrape(relay.http, "relay_reconcile_workflows_found_total", org="acme", app="ledger") == 6
    assert scrape(relay.http, "relay_reconcile_recoveries_started_total", org="acme", app="ledger") == 1


def test_runs_that_overlap_recover_a_stranded_executor_once(start_relay: StartRelay) -> None:
    """A run outlasts its interval when the executor it asks is slow, so the next runs list the
    same stranded work before the first brings the executor back (CI met it with real executors):
    one claim, one pair of audit entries, one recovery, counted once."""
    config: dict[str, Any] = relay_yaml(free_port(), grace=1.0)
    config["reconciler"] = {"enabled": True, "intervalSecs": 0.3, "includeUnknownExecutors": True}
    relay: RelayProcess = start_relay(config)
    old = str(int((time.time() - 60) * 1000))
    stranded = {"WorkflowUUID": "job-0", "Status": "PENDING", "WasForkedFrom": False, "ExecutorID": "lost-1",
                "ApplicationVersion": "v1", "CreatedAt": old, "UpdatedAt": old}  # fmt: skip
    recovered = threading.Event()

    def listing(request: dict[str, Any]) -> dict[str, Any]:
        body = request["body"]
        at_work = body.get("start_time") or body.get("completed_after")  # none: lost-1 started nothing since
        return {"output": [] if at_work or recovered.is_set() else [stranded]}

    def recovery(request: dict[str, Any]) -> dict[str, Any]:
        recovered.set()
        return {"success": True}

    # Each listing takes a second, each run three of them: a run begun every 0.3 s overlaps the next nine.
    replies = {"list_workflows": listing, "recovery": recovery, "exist_pending_workflows": {"exist": False}}
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "peer-1", "answer", replies=replies, slow={"list_workflows": 1.0}) as peer:
        assert_eventually(lambda: "executor.deleted" in audit_actions(relay, "lost-1"), 30)
        # Every run that may have listed lost-1's work before its recovery has ended.
        deleted = time.time()
        assert_eventually(lambda: ended_before(relay, "relay.reconcile", deleted), 20, interval=0.2)
        assert peer.recovery_requests == 1
    actions = audit_actions(relay, "lost-1")
    assert [a for a in actions if a.startswith("reconcile.")] == ["reconcile.found", "reconcile.recovered"], actions
    assert actions.count("recovery.succeeded") == 1 and actions.count("executor.deleted") == 1, actions
    for metric in ("executors_found", "workflows_found", "recoveries_started"):
        assert scrape(relay.http, f"relay_reconcile_{metric}_total", org="acme", app="ledger") == 1, metric
    with relay.api() as api:
        (only,) = api.get("/apps/ledger/recoveries", params={"executorId": "lost-1"}).json()
    assert only["trigger"] == "reconcile" and only["status"] == "succeeded"


def test_a_live_executors_long_running_work_is_left_alone(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str
) -> None:
    relay = reconciling_relay(start_relay, grace=0.5, interval=0.3)
    env = {"RELAY_TEST_EVIDENCE": evidence_db}
    start_executor(relay.conductor_url, env=env)
    busy = start_executor(relay.conductor_url, env={**env, "RELAY_TEST_JOBS": "3", "RELAY_TEST_JOB_SLEEP": "5"})
    assert_eventually(lambda: relay.state_of("acme", "ledger", busy.executor_id) == "HEALTHY", 10)
    # Its workflows are older than the grace period while the reconciler runs over and over.
    time.sleep(1.0)
    before = scrape(relay.http, "relay_reconcile_runs_total", org="acme", app="ledger") or 0
    assert_eventually(lambda: (scrape(relay.http, "relay_reconcile_runs_total", org="acme", app="ledger") or 0)
                      >= before + 3, 15)  # fmt: skip
    evidence = Evidence(evidence_db)
    outcomes = assert_eventually(lambda: (o := evidence.outcomes()) and len(o) >= 3 and o, 20)
    assert set(outcomes.values()) == {busy.executor_id}
    assert set(steps_once(evidence).values()) == {1}
    actions = audit_actions(relay, busy.executor_id)
    assert not [a for a in actions if a.startswith(("reconcile.", "recovery."))], actions
    assert relay.state_of("acme", "ledger", busy.executor_id) == "HEALTHY"
    assert (scrape(relay.http, "relay_reconcile_workflows_found_total", org="acme", app="ledger") or 0) == 0


def test_an_executor_at_work_after_its_recovery_is_left_alone_until_it_stops(
    start_relay: StartRelay, start_executor: StartExecutor, tmp_path: Any
) -> None:
    """The soak of seed 25: an executor cut off from Relay past its grace period is declared dead,
    recovered and deleted, and goes on starting workflows under its id. Its old PENDING ones are
    not stranded while it is at work; once it stops, a later run recovers them."""
    relay = reconciling_relay(start_relay, grace=1.0, interval=0.3)
    gate = tmp_path / "tick"
    peer = start_executor(relay.conductor_url)
    with TcpProxy(("127.0.0.1", relay.port)) as proxy:
        cut_off = start_executor(f"ws://127.0.0.1:{proxy.port}/", env={"RELAY_TEST_TICK_GATE": str(gate)})
        assert_eventually(lambda: relay.state_of("acme", "ledger", cut_off.executor_id) == "HEALTHY", 10)
        assert_eventually(lambda: relay.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 10)
        search = {"workflowIdPrefix": [f"tick-{cut_off.executor_id}"], "status": ["PENDING"], "limit": 1000}
        proxy.partition()
        assert_eventually(lambda: "executor.deleted" in audit_actions(relay, cut_off.executor_id), 20)
        gate.touch()  # it starts a sleeper every 0.2 s, each PENDING for 600 s
        time.sleep(1.5)  # its first ones are older than the grace period now
        runs = scrape(relay.http, "relay_reconcile_runs_total", org="acme", app="ledger") or 0
        assert_eventually(lambda: (scrape(relay.http, "relay_reconcile_runs_total", org="acme", app="ledger") or 0)
                          >= runs + 3, 15)  # fmt: skip
        actions = audit_actions(relay, cut_off.executor_id)
        assert not [a for a in actions if a.startswith("reconcile.")], actions
        assert (scrape(relay.http, "relay_reconcile_executors_alive_total", org="acme", app="ledger") or 0) >= 1
        with relay.api() as api:
            ticks = api.post("/apps/ledger/workflows/search", json=search).json()
        assert ticks and {w["executorId"] for w in ticks} == {cut_off.executor_id}
        # It stops: its work ages past the grace period and is recovered as stranded.
        cut_off.kill()
        assert_eventually(lambda: "reconcile.recovered" in audit_actions(relay, cut_off.executor_id), 20)
    assert_eventually(lambda: audit_actions(relay, cut_off.executor_id)[-1] == "executor.deleted", 20)

    def moved() -> list[dict[str, Any]] | None:  # re-enqueued by the recovery, then dequeued by the peer
        with relay.api() as api:
            found: list[dict[str, Any]] = api.post("/apps/ledger/workflows/search", json=search).json()
        # Dequeued a few at a time: ENQUEUED ones are not listed yet (the search asks for PENDING).
        done = len(found) >= len(ticks) and {w["executorId"] for w in found} == {peer.executor_id}
        return found if done else None

    assert_eventually(moved, 30)


def test_a_run_asks_three_executors_of_an_app_whose_executors_all_fail(start_relay: StartRelay) -> None:
    """A run asked every executor of the app in turn while each failed the listing (and named each
    one in its checkpoint and its warning): one request to every executor of a fleet, each run."""
    relay = reconciling_relay(start_relay, grace=30, interval=0.3)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    peers = [SimulatedPeer(url, f"failing-{i}", "answer") for i in range(8)]  # an error reply to the listing
    finished, requests, started = requests_over_runs(relay, peers, "relay.reconcile")
    asked = sum(r["list_workflows"] for r in requests)
    assert 3 * finished <= asked <= 3 * started, (finished, asked, started)
    warnings = [line for line in relay.log().splitlines() if "reconcile acme/ledger:" in line]
    # The latest run's warning names the three it asked, and what each answered.
    assert "(3 asked)" in warnings[-1] and warnings[-1].count(": list_workflows: ") == 3, warnings[-1]
    assert len({name for name in (f"failing-{i}: " for i in range(8)) if name in warnings[-1]}) == 3, warnings[-1]


def test_the_reconciler_is_configured_in_relay_yaml() -> None:
    config = parse_config("reconciler: {enabled: false, intervalSecs: 0.5, skipApps: [ledger]}")
    assert not config.reconciler.enabled and config.reconciler.interval_secs == 0.5
    assert config.reconciler.skip_apps == ["ledger"] and not config.reconciler.include_unknown_executors
    assert parse_config("").reconciler.enabled and parse_config("").reconciler.interval_secs == 300
    with pytest.raises(ConfigError):
        parse_config("reconciler: {intervalSecs: 0}")
    with pytest.raises(ConfigError):
        parse_config("reconciler: {interval: 5}")


def test_skip_apps_names_one_orgs_app_as_org_slash_app_and_a_bare_name_every_orgs() -> None:
    """skipApps matched the app's name only: ``ledger`` in it was skipped in every org, and no entry
    could name one org's. ``org/app`` names one; a bare name keeps its meaning (every org), so that a
    relay.yaml written before goes on skipping what it skipped."""
    config = parse_config("reconciler: {skipApps: [acme/ledger, audit, a/b/c]}").reconciler
    assert config.skips("acme", "ledger") and not config.skips("globex", "ledger")
    assert config.skips("acme", "audit") and config.skips("globex", "audit")
    assert config.skips("a/b", "c") and not config.skips("a", "b/c")  # an app's name has no "/": the last splits
    for entry in ("/ledger", "acme/", ""):
        with pytest.raises(ConfigError, match=r"reconciler\.skipApps: .*give an app \(every org\) or org/app"):
            parse_config(f"reconciler: {{skipApps: ['{entry}']}}")


def test_a_run_whose_first_read_is_retried_through_database_trouble_counts_once(start_relay: StartRelay) -> None:
    """relay_reconcile_runs_total counted each attempt of a run's first step: a run retried through
    a few seconds of database trouble (here its app's table is away) counted four or five times."""
    relay = reconciling_relay(start_relay, grace=30, interval=0.5)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "peer-1", "answer", replies={"list_workflows": {"output": []}}):
        assert_eventually(lambda: relay.runs_of("relay.reconcile", "SUCCESS") >= 1, 15, interval=0.2)
        with psycopg.connect(relay.database_url, autocommit=True) as conn:
            conn.execute("ALTER TABLE apps RENAME TO apps_away")
            time.sleep(2.5)  # the runs begun meanwhile retry their first read (0.5 s, then 1.5 times longer)
            conn.execute("ALTER TABLE apps_away RENAME TO apps")
        after = time.time()
        assert_eventually(lambda: relay.runs_of("relay.reconcile", "SUCCESS", since=after) >= 2, 15, interval=0.2)

        def counted_and_ran() -> tuple[int, int] | None:  # read between runs: every one begun has ended
            ran = relay.runs_of("relay.reconcile")
            counted = scrape(relay.http, "relay_reconcile_runs_total", org="acme", app="ledger") or 0
            done = relay.runs_of("relay.reconcile", "SUCCESS") == ran == relay.runs_of("relay.reconcile")
            return (int(counted), ran) if done else None

        counted, ran = assert_eventually(counted_and_ran, 10, interval=0.05)
    assert counted == ran, f"{counted} runs counted, {ran} ran"
