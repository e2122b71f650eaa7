"""Retention of the applications' data: rounds of ``retention`` sent to a real DBOS 3.2 executor,
checked against its system database (read here directly; Relay never reads it)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from dbos import DBOSClient

from harness.executors import ExecutorProcess
from harness.keys import CONDUCTOR_KEYS, VIEWER_KEYS
from harness.ports import free_port
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from relay.config import RelayConfig
from relay.store.appretention import AppRetentionStore
from relay.store.apps import AppStore
from relay.store.db import Database
from relay.store.lease import Lease
from workflows.appretention import skip_audit_secs

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]
# What harness/workflow_app.py's seed leaves finished (its schedule fires only on the hour).
SEEDED_FINISHED = {"done-1", "done-1-child", "failed-1", "queued-0", "queued-1", "queued-2",
                   "odd/steps", "odd?x=1", "odd#frag"}  # fmt: skip


def ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def statuses(sysdb: str) -> dict[str, str]:
    with psycopg.connect(sysdb) as conn:
        return {w: s for w, s in conn.execute("SELECT workflow_uuid, status FROM dbos.workflow_status")}


def config(**app: Any) -> dict[str, Any]:
    settings = relay_yaml(free_port())
    settings["retention"] = {"appsIntervalSecs": 0.5}
    settings["metrics"] = {"appFigures": False}
    settings["orgs"][0]["apps"][0].update(app)
    return settings


@contextmanager
def client(sysdb: str) -> Iterator[DBOSClient]:
    dbos = DBOSClient(system_database_url=sysdb, application_name="ledger")
    try:
        yield dbos
    finally:
        dbos.destroy()


def hold(sysdb: str, workflow_ids: list[str]) -> None:
    """Workflows ENQUEUED on a queue no executor serves: they stay ENQUEUED."""
    with client(sysdb) as dbos:
        for workflow_id in workflow_ids:
            dbos.enqueue({"workflow_name": "job", "queue_name": "held", "workflow_id": workflow_id,
                          "app_version": "v1"}, 1)  # fmt: skip


def seeded(relay: RelayProcess, start_executor: StartExecutor) -> ExecutorProcess:
    executor = start_executor(relay.conductor_url, module="harness.workflow_app", env={"RELAY_TEST_SEED": "1"})
    assert_eventually(lambda: relay.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 10)
    return executor


def audit(relay: RelayProcess, action: str) -> list[dict[str, Any]]:
    with relay.api() as api:
        return [e for e in api.get("/audit", params={"app": "ledger", "limit": 10000}).json() if e["action"] == action]


def test_old_finished_workflows_go_after_a_round_and_unfinished_ones_never(
    start_relay: StartRelay, start_executor: StartExecutor, sysdb: str
) -> None:
    relay = start_relay(config())
    executor = seeded(relay, start_executor)
    hold(sysdb, ["held-1"])
    before = statuses(sysdb)
    assert SEEDED_FINISHED <= set(before) and before["waiting-1"] == "PENDING" and before["held-1"] == "ENQUEUED"
    with relay.api() as api:
        assert api.get("/apps/ledger").json()["gcTimeThresholdMs"] is None  # off until set
        resp = api.patch("/apps/ledger", json={"gcTimeThresholdMs": 1500})
        assert resp.status_code == 200, resp.text
        assert resp.json()["gcTimeThresholdMs"] == 1500 and resp.json()["globalTimeoutMs"] is None

    # The seed's finished workflows completed more than 1.5 s before some round: gone.
    assert_eventually(lambda: not SEEDED_FINISHED & set(statuses(sysdb)), 20, interval=0.2)
    sent = audit(relay, "retention.sent")
    assert sent and {e["peerExecutorId"] for e in sent} == {executor.executor_id}
    for entry in sent:
        detail = entry["detail"]
        cutoff = detail["gcCutoffEpochMs"] / 1000
        assert abs(ts(entry["at"]).timestamp() - 1.5 - cutoff) < 1.0, "cutoff: now - gcTimeThresholdMs"
        assert detail["gcRowsThreshold"] is None and detail["timeoutCutoffEpochMs"] is None
        assert detail["result"] == "dispatched"

    # Later rounds find nothing left of what an earlier one targeted, and unfinished workflows,
    # now older than any cutoff, stay.
    def checked_empty() -> list[dict[str, Any]]:
        done = [e for e in audit(relay, "retention.checked") if e["detail"]["remaining"]["finishedBeforeCutoff"] == 0]
        return done if len(done) >= 2 else []

    assert_eventually(checked_empty, 20, interval=0.2)
    after = statuses(sysdb)
    assert (after["waiting-1"], after["held-1"]) == ("PENDING", "ENQUEUED")

    # The rows threshold keeps the newest finished workflows.
    with relay.api() as api:
        resp = api.patch("/apps/ledger", json={"gcTimeThresholdMs": None, "gcRowsThreshold": 2})
        assert resp.status_code == 200 and resp.json()["gcTimeThresholdMs"] is None, resp.text
    with client(sysdb) as dbos:
        for n in range(4):
            dbos.enqueue({"workflow_name": "job", "queue_name": "serial", "workflow_id": f"fresh-{n}",
                          "app_version": "v1"}, n).get_result()  # fmt: skip

    def newest_two_left() -> bool:
        sql = "SELECT workflow_uuid, name FROM dbos.workflow_status WHERE status = ANY(%s)"
        with psycopg.connect(sysdb) as conn:
            left = dict(conn.execute(sql, (["SUCCESS", "ERROR", "CANCELLED"],)).fetchall())
        # The app's schedule fires on the hour (its workflow `tick`): a test that runs across one
        # finds that run among the newest two, in fresh-2's place or beside fresh-3.
        others = [(w, name) for w, name in left.items() if w != "fresh-3"]
        return len(left) == 2 and "fresh-3" in left and all(w == "fresh-2" or name == "tick" for w, name in others)

    assert_eventually(newest_two_left, 20, interval=0.2)
    assert (statuses(sysdb)["waiting-1"], statuses(sysdb)["held-1"]) == ("PENDING", "ENQUEUED")
    rows = [e["detail"] for e in audit(relay, "retention.sent") if e["detail"]["gcRowsThreshold"] == 2]
    assert rows and all(d["gcCutoffEpochMs"] is None for d in rows)


def test_global_timeout_cancels_old_unfinished_workflows_and_needs_application_write(
    start_relay: StartRelay, start_executor: StartExecutor, sysdb: str
) -> None:
    relay = start_relay(config(globalTimeoutMs=1000))  # from relay.yaml
    with relay.api() as api:
        assert api.get("/apps/ledger").json()["globalTimeoutMs"] == 1000
    with relay.api(key=VIEWER_KEYS["acme"]) as viewer:
        assert viewer.patch("/apps/ledger", json={"globalTimeoutMs": None}).status_code == 403
    seeded(relay, start_executor)
    hold(sysdb, ["held-1", "held-2"])

    unfinished = {"waiting-1", "held-1", "held-2"}
    assert_eventually(lambda: {w for w, s in statuses(sysdb).items() if s == "CANCELLED"} >= unfinished, 20, 0.2)
    # Finished workflows are not the global timeout's business.
    assert statuses(sysdb)["done-1"] == "SUCCESS"
    sent = audit(relay, "retention.sent")
    assert sent and all(e["detail"]["gcCutoffEpochMs"] is None for e in sent)
    assert all(abs(ts(e["at"]).timestamp() - 1.0 - e["detail"]["timeoutCutoffEpochMs"] / 1000) < 1.0 for e in sent)

    def nothing_left() -> bool:
        return any(e["detail"]["remaining"]["unfinishedBeforeTimeout"] == 0 for e in audit(relay, "retention.checked"))

    assert_eventually(nothing_left, 20, interval=0.2)
    with relay.api() as api:  # turned off again
        assert api.patch("/apps/ledger", json={"globalTimeoutMs": None}).json()["globalTimeoutMs"] is None
        assert api.patch("/apps/ledger", json={"globalTimeoutMs": 0}).status_code == 422
        assert api.patch("/apps/ledger", json={"executorTimeoutSecs": None}).status_code == 422


def test_rounds_that_overlap_check_a_round_once(start_relay: StartRelay) -> None:
    """A round outlasts its interval when the executor it asks is slow (each aggregate here takes
    1.5 s, rounds begin every 0.5 s), so the next rounds read the same previous round as unchecked
    before the first records its check. Each must not record it again: a round is checked once, and
    its one ``retention.checked`` entry says what its row says, not several entries with other
    figures for the same round (the row keeping the first, the audit log all of them)."""
    relay = start_relay(config(gcTimeThresholdMs=1000))
    asked: list[int] = []

    def aggregates(request: dict[str, Any]) -> dict[str, Any]:
        asked.append(len(asked) + 1)
        return {"output": [{"group": {"status": "SUCCESS"}, "count": len(asked)}]}  # a new figure each time

    replies: dict[str, Any] = {"get_workflow_aggregates": aggregates, "retention": {"success": True}}
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "ledger-1", "answer", replies=replies, slow={"get_workflow_aggregates": 1.5}):
        assert_eventually(lambda: relay.state_of("acme", "ledger", "ledger-1") == "HEALTHY", 10)
        assert_eventually(lambda: len(audit(relay, "retention.checked")) >= 4, 20, what="rounds checked")
    checks: dict[str, list[int]] = {}
    for entry in audit(relay, "retention.checked"):
        checks.setdefault(entry["detail"]["roundId"], []).append(entry["detail"]["remaining"]["finishedBeforeCutoff"])
    with psycopg.connect(relay.database_url) as conn:
        stored = conn.execute("""SELECT id, (remaining->>'finishedBeforeCutoff')::int FROM app_retention_rounds
                                 WHERE checked_at IS NOT NULL""").fetchall()  # fmt: skip
    rows: dict[str, int | None] = dict(stored)
    twice = {rid: (found, rows.get(rid)) for rid, found in checks.items() if len(found) > 1}
    assert not twice, f"rounds checked more than once (audited figures, the row's): {twice}"


# Holds DBOS's checkpoint of a round's check step, so that Relay can be killed after the check has
# committed and before DBOS has recorded the step: the step then runs again when Relay restarts.
HOLD_CHECKPOINT = """
    CREATE FUNCTION test_hold_checkpoint() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN PERFORM pg_sleep(600); RETURN NEW; END $$;
    CREATE TRIGGER test_hold_checkpoint BEFORE INSERT ON dbos.operation_outputs FOR EACH ROW
      WHEN (NEW.function_name = 'relay.app_retention.check') EXECUTE FUNCTION test_hold_checkpoint();
"""
RELEASE_CHECKPOINT = """
    SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'PgSleep';
    DROP TRIGGER test_hold_checkpoint ON dbos.operation_outputs;
    DROP FUNCTION test_hold_checkpoint();
"""


def test_a_check_run_again_after_a_crash_checks_its_own_round_not_an_older_one(start_relay: StartRelay) -> None:
    """A round's check that committed and then lost its step to a crash (before DBOS recorded the
    step) runs again when Relay restarts. It must find the check it made: taking the previous round
    as unchecked again, it would have found an older unchecked round instead and checked it under
    the step's key, already used, so that round's row said it was checked and the audit log had no
    entry for it."""
    settings = config()  # no retention yet: the one round comes when it is turned on
    settings["retention"]["appsIntervalSecs"] = 20  # the next round after it, 20 s later
    relay = start_relay(settings)
    replies: dict[str, Any] = {
        "get_workflow_aggregates": {"output": [{"group": {"status": "SUCCESS"}, "count": 7}]},
        "retention": {"success": True},
    }
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        for round_id, hours in (("older", 2), ("newer", 1)):  # two rounds sent, neither checked yet
            conn.execute(
                """INSERT INTO app_retention_rounds (id, org, app, executor_id, status, gc_cutoff_epoch_ms, sent_at)
                   VALUES (%s, 'acme', 'ledger', 'gone', 'dispatched', 1, now() - %s * interval '1 hour')""",
                (round_id, hours),
            )
        conn.execute(HOLD_CHECKPOINT)
    with SimulatedPeer(url, "ledger-1", "answer", replies=replies):
        assert_eventually(lambda: relay.state_of("acme", "ledger", "ledger-1") == "HEALTHY", 10)
        with relay.api() as api:
            assert api.patch("/apps/ledger", json={"gcTimeThresholdMs": 1000}).status_code == 200

        def held() -> bool:  # the check of "newer" committed, its checkpoint waits
            with psycopg.connect(relay.database_url) as conn:
                row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'").fetchone()
            return bool(row and row[0]) and [e["detail"]["roundId"] for e in audit(relay, "retention.checked")] == [
                "newer"
            ]

        assert_eventually(held, 30, what="a check committed and its checkpoint held")
        assert relay.proc is not None
        relay.proc.kill()
        relay.proc.wait()
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute(RELEASE_CHECKPOINT)
    # The step runs again once Relay is back and an executor can answer it: until then its first
    # read waits on this lock (without an executor it would give up and check nothing).
    with psycopg.connect(relay.database_url) as lock:
        lock.execute("LOCK TABLE app_retention_rounds IN ACCESS EXCLUSIVE MODE")
        relay.start()
        with SimulatedPeer(url, "ledger-2", "answer", replies=replies):
            assert_eventually(lambda: relay.state_of("acme", "ledger", "ledger-2") == "HEALTHY", 10)
            lock.rollback()

            def the_round_ended() -> bool:
                with psycopg.connect(relay.database_url) as conn:
                    rows = conn.execute(
                        "SELECT status, recovery_attempts FROM dbos.workflow_status WHERE name = 'relay.app_retention'"
                    ).fetchall()
                return len(rows) == 1 and rows[0][0] == "SUCCESS" and rows[0][1] >= 2  # it ran again

            assert_eventually(the_round_ended, 20, what="the round run again and ended")
    with psycopg.connect(relay.database_url) as conn:
        checked = [r for (r,) in conn.execute("SELECT id FROM app_retention_rounds WHERE checked_at IS NOT NULL")]
    audited = [e["detail"]["roundId"] for e in audit(relay, "retention.checked")]  # read after: it has them all
    assert checked == ["newer"], (checked, audited)
    assert audited == ["newer"], audited


def test_thresholds_at_their_bound_are_checked(start_relay: StartRelay, start_executor: StartExecutor) -> None:
    """gcTimeThresholdMs and globalTimeoutMs take up to 2^53 ms (285,000 years): their cutoffs, now
    minus that, fell before the year 1. The SDK cannot read such a time, so every round's check of
    the one before it failed on every executor asked, and no round was ever checked."""
    relay = start_relay(config(gcTimeThresholdMs=2**53, globalTimeoutMs=2**53))
    executor = start_executor(relay.conductor_url)
    assert_eventually(lambda: relay.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 10)
    (checked, *_) = assert_eventually(lambda: audit(relay, "retention.checked"), 10, interval=0.2)
    remaining = checked["detail"]["remaining"]
    assert remaining == {"finishedBeforeCutoff": 0, "finished": None, "unfinishedBeforeTimeout": 0}, remaining
    assert all(e["detail"]["gcCutoffEpochMs"] == 0 for e in audit(relay, "retention.sent"))


# Fails the start of every retention round of app "aaa" (the first app a round starts), in the
# database, as a full disk or a broken row of DBOS's would.
FAIL_AAA_ROUNDS = """
    CREATE FUNCTION test_fail_aaa() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN RAISE EXCEPTION 'test: no rounds for aaa'; END $$;
    CREATE TRIGGER test_fail_aaa BEFORE INSERT ON dbos.workflow_status FOR EACH ROW
      WHEN (NEW.workflow_uuid LIKE 'relay-app-retention:acme:aaa:%') EXECUTE FUNCTION test_fail_aaa();
"""


def test_one_apps_round_that_cannot_start_holds_up_no_other_and_a_skip_is_audited_once_per_reason(
    start_relay: StartRelay,
) -> None:
    """A failure to start app aaa's round (the first in order) once skipped every later app's
    round of that interval: ledger had none while aaa's failed. And ledger, with a retention
    setting and no executor, audited ``retention.skipped`` every interval (144 a day at the
    default); it is audited when the reason changes, and again while the skips go on once its entry is
    a day old or gone, every skip counted by the metric."""
    settings = config(gcRowsThreshold=10)
    settings["orgs"][0]["apps"].append({"name": "aaa", "gcRowsThreshold": 10})
    relay = start_relay(settings)
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute(FAIL_AAA_ROUNDS)
        since = conn.execute("SELECT now()").fetchone()

    def rounds(app: str) -> list[tuple[str, str]]:
        with psycopg.connect(relay.database_url) as conn:
            sql = "SELECT status, error FROM app_retention_rounds WHERE app = %s AND sent_at > %s ORDER BY sent_at"
            return conn.execute(sql, (app, since[0] if since else None)).fetchall()

    assert_eventually(lambda: len(rounds("ledger")) >= 3, 10, what="ledger's rounds while aaa's cannot start")
    assert "cannot start 1 retention round(s): relay-app-retention:acme:aaa:" in relay.log()
    assert {status for status, _ in rounds("ledger")} == {"skipped"}
    assert len(audit(relay, "retention.skipped")) == 1  # one reason: no executor
    # Skipped all along a day later (the entry moved back 25 hours): audited again, once, saying since
    # when; and at the next round once retention has pruned it. It was never written again, so after
    # auditDays nothing in the audit log said the app was being skipped.
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute("UPDATE audit_log SET at = at - interval '25 hours' WHERE action = 'retention.skipped'")
    assert_eventually(lambda: len(audit(relay, "retention.skipped")) == 2, 10, what="the skip audited a day later")
    again = audit(relay, "retention.skipped")[1]["detail"]
    with psycopg.connect(relay.database_url) as conn:
        (began, total), *_ = conn.execute(
            "SELECT min(sent_at), count(*) FROM app_retention_rounds WHERE app = 'ledger'"
        )
    assert again["repeated"] is True and ts(again["skippedSince"]) == began and 3 < again["skippedRounds"] <= total
    done = len(rounds("ledger"))
    assert_eventually(lambda: len(rounds("ledger")) >= done + 3, 10, what="more rounds")
    assert len(audit(relay, "retention.skipped")) == 2, "audited again at every round"
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM audit_log WHERE action = 'retention.skipped'")  # as retention prunes it
    assert_eventually(lambda: len(audit(relay, "retention.skipped")) == 1, 10, what="the skip audited once pruned")
    # An executor that refuses the request: a new reason, audited once too.
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    with SimulatedPeer(url, "ledger-1", "answer", others="error"):
        assert_eventually(lambda: len({error for _, error in rounds("ledger")[-3:]}) == 1 and
                          "retention" in rounds("ledger")[-1][1], 10, what="rounds the executor refused")  # fmt: skip
    first, second = audit(relay, "retention.skipped")[:2]
    assert len(audit(relay, "retention.skipped")) == 2 and first["detail"]["error"] != second["detail"]["error"]
    skipped = sum(1 for status, _ in rounds("ledger") if status == "skipped")
    metric = 'relay_app_retention_rounds_total{app="ledger",org="acme",result="skipped"} '

    def counted() -> float:
        with relay.client() as api:
            return sum(float(x[len(metric) :]) for x in api.get("/metrics").text.splitlines() if x.startswith(metric))

    assert skipped > 3 and assert_eventually(lambda: counted() >= skipped, 5, what="every skip counted")


def test_a_skip_that_goes_on_is_audited_again_before_retention_prunes_its_entry() -> None:
    """Once a day, or at half of auditDays when that is shorter: the entry is written again before
    retention prunes it."""
    assert skip_audit_secs(90.0) == 86400.0
    assert skip_audit_secs(1.0) == 43200.0 and skip_audit_secs(0.01) == 432.0


T = TypeVar("T")


def with_retention_store(relay_db: str, body: Callable[[Database, AppRetentionStore], Awaitable[T]]) -> T:
    """``body(db, store)`` against a real database holding relay.yaml's apps (:func:`config`), under a
    lease, as the rounds' writes are (fenced)."""

    async def scenario() -> T:
        db = Database(relay_db)
        await db.open()
        await db.migrate()
        lease = Lease(db, "relay-1", 30)
        await lease.acquire()
        try:
            await AppStore(db).sync_config(RelayConfig.model_validate(config()))
            return await body(db, AppRetentionStore(db))
        finally:
            await lease.stop()
            await db.close()

    return asyncio.run(scenario())


def test_rounds_skipped_together_for_a_new_reason_audit_it_once(relay_db: str) -> None:
    """Rounds outlast their interval on a loaded machine, so two of an app's may end together. Each
    compared its reason with the app's previous round, read before either had written its own: both
    saw the older reason and both audited the new one (a full run at load 8 audited it twice). The
    skips of an app now take their turn: the second sees the first's round."""

    async def scenario(db: Database, store: AppRetentionStore) -> list[str]:
        assert await store.skipped("r0", "acme", "ledger", "no executor", "d0", 86400.0)
        await asyncio.gather(
            *(store.skipped(f"r{i}", "acme", "ledger", "refused", f"d{i}", 86400.0) for i in range(1, 9))
        )
        async with db.connection() as conn:
            cur = await conn.execute(
                "SELECT detail->>'error' AS error FROM audit_log WHERE action = 'retention.skipped' ORDER BY id"
            )
            return [str(r["error"]) for r in await cur.fetchall()]

    assert with_retention_store(relay_db, scenario) == ["no executor", "refused"]


def test_a_repeated_skips_since_has_six_fraction_digits_even_on_a_whole_second(relay_db: str) -> None:
    """``skippedSince`` is one of Relay's own times, written as every other (README "API"): six fraction
    digits and ``Z``. It was ``isoformat()``'s, which leaves the fraction out on a whole second, so
    ``...:00Z`` sorted after ``...:00.250000Z``."""

    async def scenario(db: Database, store: AppRetentionStore) -> dict[str, Any]:
        assert await store.skipped("r1", "acme", "ledger", "no executor", "d1", 86400.0)
        async with db.connection() as conn:  # the run began on a whole second; its entry is a day old
            await conn.execute(
                "UPDATE app_retention_rounds SET sent_at = date_trunc('second', now()) - interval '1 hour'"
            )
            await conn.execute("UPDATE audit_log SET at = at - interval '25 hours'")
        assert await store.skipped("r2", "acme", "ledger", "no executor", "d2", 86400.0)
        async with db.connection() as conn:
            cur = await conn.execute("SELECT detail FROM audit_log WHERE dedupe_key = 'd2'")
            row = await cur.fetchone()
        assert row is not None
        return dict(row["detail"])

    detail = with_retention_store(relay_db, scenario)
    assert detail["repeated"] is True and detail["skippedRounds"] == 2
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.000000Z", detail["skippedSince"]), detail
