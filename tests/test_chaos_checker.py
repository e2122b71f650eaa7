"""The chaos checker must reject broken histories, and accept a sound one."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest

from chaos.checker import RESOLUTION_MARGIN_SECS, History, Owner, check, figures
from chaos.schedule import FAULT_KINDS, INSTANCE_FAULTS, PROFILES, make_schedule


def audit(executor: str, *actions: str) -> list[dict[str, object]]:
    return [
        {"executorId": executor, "action": a, "at": f"2026-11-30T00:00:{i:02d}Z", "peerExecutorId": None}
        for i, a in enumerate(actions)
    ]


def sound() -> History:
    return History(
        workflows={"w1": ("SUCCESS", "ledger"), "w2": ("SUCCESS", "ledger"), "b1": ("SUCCESS", "billing")},
        outcomes=[("w1", "e2", "ledger"), ("w2", "e1", "ledger"), ("b1", "d1", "billing")],
        steps=[("w1", "one", "e1", "ledger"), ("w1", "one", "e2", "ledger"), ("b1", "one", "d1", "billing")],
        audit=audit("e1", "executor.dead", "recovery.dispatched", "recovery.succeeded", "executor.deleted"),
        registry={"e2": {"state": "HEALTHY"}},
        faults=[{"at": datetime(2026, 11, 30, tzinfo=UTC).timestamp() - 1, "kind": "kill9", "executor": "e1"}],
    )


def test_a_sound_history_passes_and_counts_reexecutions() -> None:
    h = sound()
    assert check(h) == []
    numbers = figures(h)
    assert numbers["workflows_started"] == 3 and numbers["outcomes"] == 3
    assert numbers["step_reexecutions"] == 1


def test_fault_to_recovery_takes_the_first_recovery_after_each_fault() -> None:
    h = sound()
    start = datetime(2026, 11, 30, tzinfo=UTC).timestamp()
    h.faults = [{"at": start - 5.0, "kind": "sigstop", "executor": "e1"}]
    h.audit += [{**h.audit[-1], "at": "2026-11-30T00:01:00Z"}]  # it came back and died again later
    assert figures(h)["fault_to_recovery_secs"]["max"] == 8.0  # deleted at 00:00:03, not 00:01:00


def test_a_fault_the_executor_survived_takes_no_recovery_of_a_later_fault() -> None:
    h = sound()
    start = datetime(2026, 11, 30, tzinfo=UTC).timestamp()
    # Paused at -60 s and resumed in time; killed at -1 s and recovered at 00:00:03: one recovery, 4 s.
    h.faults = [
        {"at": start - 60.0, "kind": "sigstop", "executor": "e1"},
        {"at": start - 1.0, "kind": "kill9", "executor": "e1"},
    ]
    assert figures(h)["fault_to_recovery_secs"] == {"count": 1, "p50": 4.0, "p99": 4.0, "max": 4.0}


def test_a_lost_workflow_is_rejected() -> None:
    h = sound()
    h.workflows["w3"] = ("PENDING", "ledger")
    assert any("w3 never finished" in p for p in check(h))
    h = sound()
    h.outcomes = [o for o in h.outcomes if o[0] != "w2"]
    assert any("w2 (SUCCESS) has 0 outcomes" in p for p in check(h))


def test_a_doubled_outcome_is_rejected() -> None:
    h = sound()
    h.outcomes.append(("w1", "e1", "ledger"))
    assert any("w1 (SUCCESS) has 2 outcomes" in p for p in check(h))


def test_a_cross_app_recovery_is_rejected() -> None:
    h = sound()
    h.steps.append(("w2", "two", "d1", "billing"))
    assert any("ledger workflow w2" in p and "billing executor d1" in p for p in check(h))
    h = sound()
    h.outcomes[0] = ("w1", "d1", "billing")
    assert any("finished on billing executor d1" in p for p in check(h))


@pytest.mark.parametrize("missing", ["recovery.dispatched", "recovery.succeeded", "executor.dead"])
def test_a_missing_audit_entry_is_rejected(missing: str) -> None:
    h = sound()
    h.audit = [e for e in h.audit if e["action"] != missing]
    problems = check(h)
    assert problems, missing
    assert any(missing in p for p in problems) or missing == "executor.dead"


def test_a_dead_executor_neither_recovered_nor_blocked_is_rejected() -> None:
    h = sound()
    h.audit = audit("e1", "executor.dead", "recovery.dispatched")
    h.registry["e1"] = {"state": "RECOVERING"}
    assert any("e1 was declared dead but neither recovered nor blocked" in p for p in check(h))
    h.registry["e1"] = {"state": "DEAD", "blockedReason": "no_healthy_peer"}
    assert check(h) == []


def test_an_instance_adopted_twice_is_rejected() -> None:
    h = sound()
    entry = {"action": "relay.instance_adopted", "executorId": None,
             "detail": {"instance": "relay-2", "leaseEpoch": 4}, "at": "2026-01-01T00:00:00Z"}  # fmt: skip
    h.audit = [entry]
    assert check(h) == []
    h.audit = [entry, {**entry, "detail": {"instance": "relay-2", "leaseEpoch": 5}}]
    assert check(h) == []
    h.audit = [entry, dict(entry)]
    assert check(h) == ["instance relay-2 lease epoch 4 adopted 2 times"]


def test_a_paused_instance_that_did_not_exit_fenced_is_rejected() -> None:
    h = sound()
    fault = {"kind": "relay_sigstop", "at": 1.0, "executor": None, "instance": "relay-1", "exit_code": 3}
    killed = h.faults
    h.faults = [*killed, fault]
    assert check(h) == []
    h.faults = [*killed, {**fault, "exit_code": None}]  # not adopted in time: it renewed its lease, which is fine
    assert check(h) == []
    h.faults = [*killed, {**fault, "exit_code": 1}]
    assert check(h) == ["instance relay-1 resumed after adoption and exited with 1, not 3"]


def test_schedules_are_reproducible_and_leave_a_peer() -> None:
    profile = PROFILES["ci"]
    a, b = make_schedule(7, profile), make_schedule(7, profile)
    assert a == b and a != make_schedule(8, profile)
    assert {f.kind for f in make_schedule(1, PROFILES["soak"])} >= set(FAULT_KINDS)
    assert {f.kind for f in a} >= set(INSTANCE_FAULTS)  # CI's profile plays the instance faults too
    for fault in a:
        if fault.kind in INSTANCE_FAULTS:
            assert 0 <= fault.target < profile.relay_instances
        if fault.kind in ("relay_kill", "relay_sigstop"):
            assert fault.duration > profile.lease_secs  # long enough for an adoption
    for earlier, later in itertools.pairwise(a):
        assert later.at >= earlier.at + earlier.duration  # one fault at a time


def run_entries(executor: str, *steps: tuple[str, str | None]) -> list[dict[str, object]]:
    """Audit entries ``(action, recoveryId)`` in order, one second apart."""
    return [
        {"executorId": executor, "action": a, "at": f"2026-11-30T00:01:{i:02d}Z", "peerExecutorId": None,
         "detail": {} if rid is None else {"recoveryId": rid}}
        for i, (a, rid) in enumerate(steps)
    ]  # fmt: skip


R1, R2 = "recovery:acme:ledger:e1:7", "recovery:acme:ledger:e1:7:2"


def test_a_recovery_finished_by_its_second_run_passes() -> None:
    h = sound()
    h.audit = run_entries(
        "e1",
        ("executor.dead", None),
        ("recovery.dispatched", R1),
        ("recovery.failed", R1),
        ("recovery.restarted", R2),
        ("recovery.dispatched", R2),
        ("recovery.succeeded", R2),
        ("executor.deleted", R2),
    )
    assert check(h) == []


def test_a_deletion_by_a_run_that_never_dispatched_is_rejected() -> None:
    """Run 1 dispatched and succeeded without deleting; run 2 deleted without doing either itself."""
    h = sound()
    h.audit = run_entries(
        "e1",
        ("executor.dead", None),
        ("recovery.dispatched", R1),
        ("recovery.succeeded", R1),
        ("recovery.restarted", R2),
        ("executor.deleted", R2),
    )
    assert check(h) == [
        f"executor e1 was deleted without recovery.dispatched of {R2} before it in the audit log",
        f"executor e1 was deleted without recovery.succeeded of {R2} before it in the audit log",
    ]


def test_a_deletion_with_nothing_pending_needs_no_dispatch_but_its_success() -> None:
    """A dead executor that left nothing PENDING is deleted without a recovery frame: its run's
    ``recovery.succeeded`` (and the deletion) say so; without that success it is still rejected."""
    h = sound()
    h.audit = run_entries("e1", ("executor.dead", None), ("recovery.succeeded", R1), ("executor.deleted", R1))
    for entry in h.audit[1:]:
        entry["detail"] = {"recoveryId": R1, "nothingPending": True}
    assert check(h) == []
    h.audit = [h.audit[0], h.audit[2]]
    assert check(h) == [f"executor e1 was deleted without recovery.succeeded of {R1} before it in the audit log"]
    h.audit = run_entries("e1", ("executor.dead", None), ("recovery.succeeded", R1), ("executor.deleted", R1))
    assert check(h) == [f"executor e1 was deleted without recovery.dispatched of {R1} before it in the audit log"]


def idle_deletion(owners: dict[str, Owner], statuses: dict[str, str]) -> History:
    """e1 declared dead at 00:01:00 and deleted with nothing pending at 00:01:02; ``owners`` are the
    system database's workflows (times in seconds after 00:01:00)."""
    h = sound()
    h.audit = run_entries("e1", ("executor.dead", None), ("recovery.succeeded", R1), ("executor.deleted", R1))
    for entry in h.audit[1:]:
        entry["detail"] = {"recoveryId": R1, "nothingPending": True, "verifiedBy": "e2"}
    base = datetime(2026, 11, 30, 0, 1, tzinfo=UTC).timestamp()
    h.owners = {w: Owner(o.executor, base + o.started, base + o.updated) for w, o in owners.items()}
    for workflow_id, status in statuses.items():
        h.workflows[workflow_id] = (status, "ledger")
        if status == "SUCCESS":
            h.outcomes.append((workflow_id, h.owners[workflow_id].executor or "", "ledger"))
    return h


def test_a_nothing_pending_deletion_is_checked_against_the_system_database() -> None:
    """Relay said e1 left nothing PENDING: a workflow of e1 begun before and unfinished at the
    deletion proves it wrong, whether it finished later or is left PENDING with nobody to recover it."""
    done_before = {"w9": Owner("e1", -5.0, 1.0)}  # finished before the deletion (at 2 s)
    begun_after = {"w8": Owner("e1", 1.5, 4.0)}  # started within the slack of the peer's answer
    others = {"w7": Owner("e2", -5.0, 4.0)}  # another executor's, finished after it
    h = idle_deletion({**done_before, **begun_after, **others}, {"w9": "SUCCESS", "w8": "SUCCESS", "w7": "SUCCESS"})
    assert check(h) == []
    assert figures(h)["nothing_pending_deletions"] == 1

    h = idle_deletion({**done_before, "w6": Owner("e1", -3.0, 9.0)}, {"w9": "SUCCESS", "w6": "SUCCESS"})
    assert check(h) == [
        "executor e1 was deleted at 00:01:02.000 with nothing pending, but its workflow w6 was unfinished "
        "then (finished later, status SUCCESS)"
    ]

    h = idle_deletion({"w5": Owner("e1", -3.0, -3.0)}, {"w5": "PENDING"})
    problems = check(h)
    assert "executor e1 was deleted at 00:01:02.000 with nothing pending, but its workflow w5 was unfinished " \
        "then (status PENDING), and is left PENDING with no executor to recover it" in problems  # fmt: skip
    assert "workflow w5 never finished (status PENDING)" in problems


def test_work_left_pending_by_an_executor_deleted_with_nothing_pending_is_rejected() -> None:
    """A workflow of e1 begun just before its deletion (within the slack) and never finished: left
    PENDING with its executor's record gone, nobody will recover it."""
    h = idle_deletion({"w4": Owner("e1", 1.5, 1.5)}, {"w4": "PENDING"})
    assert (
        "workflow w4 of executor e1, deleted at 00:01:02.000 with nothing pending, is left PENDING with no "
        "executor to recover it"
    ) in check(h)
    h.registry["e1"] = {"state": "HEALTHY"}  # it came back: its own work, not stranded
    assert not any("no executor to recover it" in p for p in check(h))


def test_without_the_system_database_s_owners_nothing_pending_is_taken_on_relay_s_word() -> None:
    """A record from before the runner read owners: the rule has nothing to judge by."""
    h = idle_deletion({}, {})
    h.workflows["w3"] = ("SUCCESS", "ledger")
    h.outcomes.append(("w3", "e1", "ledger"))
    assert check(h) == []


def test_each_life_of_an_executor_needs_its_own_death_and_recovery() -> None:
    """An executor paused past its grace period is recovered, comes back, and is deleted again:
    its first life's entries do not vouch for the second."""
    first_life = [("executor.dead", None), ("recovery.dispatched", R1), ("recovery.succeeded", R1),
                  ("executor.deleted", R1)]  # fmt: skip
    h = sound()
    h.audit = run_entries("e1", *first_life, ("executor.deleted", "recovery:acme:ledger:e1:9"))
    problems = check(h)
    assert "executor e1 was deleted without executor.dead before it in the audit log" in problems
    assert len(problems) == 3
    third = "recovery:acme:ledger:e1:9"
    h.audit = run_entries("e1", *first_life, ("executor.dead", None), ("recovery.dispatched", third),
                          ("recovery.succeeded", third), ("executor.deleted", third))  # fmt: skip
    assert check(h) == []


def test_a_life_brought_back_by_the_reconciler_has_reconcile_recovered_as_its_death() -> None:
    """A record deleted after its recovery and brought back DEAD by the reconciler (its work found
    stranded) is a new life; ``reconcile.recovered`` declares it dead, and its recovery must still
    dispatch, succeed and end in a deletion or a block."""
    first_life = [("executor.dead", None), ("recovery.dispatched", R1), ("recovery.succeeded", R1),
                  ("executor.deleted", R1)]  # fmt: skip
    third = "recovery:acme:ledger:e1:9"
    h = sound()
    h.audit = run_entries("e1", *first_life, ("reconcile.found", None), ("reconcile.recovered", third),
                          ("recovery.dispatched", third), ("recovery.succeeded", third),
                          ("executor.deleted", third))  # fmt: skip
    assert check(h) == []
    h.audit = run_entries("e1", *first_life, ("reconcile.found", None), ("recovery.dispatched", third),
                          ("recovery.succeeded", third), ("executor.deleted", third))  # fmt: skip
    assert check(h) == ["executor e1 was deleted without executor.dead before it in the audit log"]
    h.audit = run_entries("e1", *first_life, ("reconcile.recovered", third), ("recovery.dispatched", third))
    h.registry["e1"] = {"state": "RECOVERING"}
    assert check(h) == ["executor e1 was declared dead but neither recovered nor blocked (RECOVERING)"]


def test_each_death_must_produce_exactly_one_alert_key() -> None:
    h = sound()
    h.audit[0]["detail"] = {"epoch": 3}
    alert = {"kind": "ExecutorDead", "executorId": "e1", "epoch": "3", "idempotencyKey": "r:e1:3"}
    h.alerts = [alert, dict(alert)]  # a repeat of the same key: at least once is allowed
    assert check(h) == []
    h.alerts = []
    assert check(h) == [
        "executor e1 declared dead (epoch 3) produced 0 distinct ExecutorDead idempotency keys at the receiver, "
        "not exactly one"
    ]
    h.alerts = [alert, {**alert, "idempotencyKey": "r:e1:3-again"}]
    assert any("produced 2 distinct" in p for p in check(h))
    h.alerts = [alert, {**alert, "epoch": "4", "idempotencyKey": "r:e1:4"}]
    assert check(h) == ["an ExecutorDead alert for executor e1 epoch 4, which was not declared dead"]
    h.alerts = None  # a run without a receiver (an older recording) is not judged on alerts
    assert check(h) == []


def test_a_deaths_resolution_is_not_a_second_alert_and_must_follow_its_alert() -> None:
    h = sound()
    h.audit[0]["detail"] = {"epoch": 3}
    alert = {"kind": "ExecutorDead", "executorId": "e1", "epoch": "3", "idempotencyKey": "r:e1:3"}
    resolution = {**alert, "idempotencyKey": "r:e1:3:resolved", "status": "resolved", "resolves": "r:e1:3"}
    h.alerts = [alert, resolution, dict(resolution)]  # a repeat of the resolution: at least once
    assert check(h) == []
    assert figures(h)["executor_dead_alerts"] == 1 and figures(h)["executor_dead_resolutions"] == 2
    h.alerts = [resolution, alert]
    assert check(h) == [
        "a resolution (r:e1:3:resolved) of executor e1 epoch 3 came before the alert it resolves (r:e1:3), "
        "or resolves none"
    ]
    h.alerts = [alert, resolution, {**resolution, "idempotencyKey": "r:e1:3:resolved-again"}]
    problems = check(h)
    assert "executor e1 declared dead (epoch 3) was resolved under more than one key" in problems
    h.alerts = [resolution]  # no alert, only its resolution
    assert any("produced 0 distinct" in p for p in check(h)) and any("came before" in p for p in check(h))


def ended(*entries: tuple[str, dict[str, object]], read_after: float = 60.0) -> History:
    """A death of e1 (epoch 3) of acme/ledger, alerted, then ``entries`` one second apart from
    00:00:01, the receiver read ``read_after`` seconds after 00:00:00."""
    h = sound()
    h.audit = [
        {"org": "acme", "app": "ledger", "executorId": "e1", "action": action, "detail": detail,
         "at": f"2026-11-30T00:00:{i:02d}Z", "peerExecutorId": "e2"}
        for i, (action, detail) in enumerate([("executor.dead", {"epoch": 3}), *entries])
    ]  # fmt: skip
    h.registry["e1"] = {"state": "HEALTHY"}  # (a death whose record was deleted passes either way)
    h.alerts = [{"kind": "ExecutorDead", "executorId": "e1", "epoch": "3", "idempotencyKey": "r:e1:3"}]
    h.alerts_read_at = datetime(2026, 11, 30, tzinfo=UTC).timestamp() + read_after
    return h


RUN = "recovery:acme:ledger:e1:3"
RECOVERED = [("recovery.dispatched", {"recoveryId": RUN}), ("recovery.succeeded", {"recoveryId": RUN}),
             ("executor.deleted", {"recoveryId": RUN})]  # fmt: skip
RESOLUTION = {
    "kind": "ExecutorDead", "executorId": "e1", "epoch": "3", "idempotencyKey": "r:e1:3:resolved",
    "status": "resolved", "resolves": "r:e1:3",
}  # fmt: skip


def test_every_ended_death_must_have_its_alert_resolved() -> None:
    h = ended(*RECOVERED)
    h.alerts = [*(h.alerts or []), RESOLUTION]
    assert check(h) == [] and figures(h)["deaths_ended"] == 1
    h = ended(*RECOVERED)  # recovered at 00:00:02 (recovery.succeeded, with its deletion), never resolved
    assert check(h) == [
        "executor e1 declared dead (epoch 3) ended at 00:00:02.000 (recovery.succeeded), 58.0 s before the "
        "run's end, but its ExecutorDead alert was never resolved at the receiver"
    ]
    # An end within the margin of when the receiver was read may not be resolved yet; one before it must.
    assert check(ended(*RECOVERED, read_after=2.0 + RESOLUTION_MARGIN_SECS - 0.5)) == []
    assert len(check(ended(*RECOVERED, read_after=2.0 + RESOLUTION_MARGIN_SECS + 0.5))) == 1
    h = ended(*RECOVERED)
    h.alerts_read_at = None  # (a history without the time: its newest audit entry's stands for it)
    assert check(h) == []
    h.audit.append({**h.audit[0], "action": "executor.connected", "detail": {}, "at": "2026-11-30T00:00:30Z"})
    assert len(check(h)) == 1


def test_each_end_of_a_death_calls_for_its_resolution_and_nothing_else_does() -> None:
    # The soak's miss: the executor connected again just before its recovery's success (record kept).
    kept = ("recovery.succeeded", {"recoveryId": RUN, "recordKept": True})
    assert any("(recovery.succeeded)" in p for p in check(ended(("recovery.dispatched", {"recoveryId": RUN}), kept)))
    unmarked = ("recovery.succeeded", {"recoveryId": RUN})  # as the release before recordKept wrote it
    assert any(
        "(recovery.succeeded)" in p for p in check(ended(("recovery.dispatched", {"recoveryId": RUN}), unmarked))
    )
    final = ("recovery.failed", {"recoveryId": RUN, "final": True, "error": "connected again"})
    assert any("(recovery.failed)" in p for p in check(ended(final)))
    second_run = [(a, {"recoveryId": f"{RUN}:2"}) for a, _ in RECOVERED]
    assert any("(recovery.succeeded)" in p for p in check(ended(*second_run)))
    # Not ends of this death: a failed attempt, another death's recovery, an entry naming no run.
    attempt = ("recovery.failed", {"recoveryId": RUN, "attempt": 1, "error": "timed out"})
    other = [(a, {"recoveryId": "recovery:acme:ledger:e1:4"}) for a, _ in RECOVERED]
    for entries in ([attempt], other, [(a, {}) for a, _ in RECOVERED]):
        assert not [p for p in check(ended(*entries)) if "never resolved" in p], entries
    # A death never alerted is the alert rule's to report, once.
    h = ended(*RECOVERED)
    h.alerts = []
    assert [p for p in check(h) if "e1" in p] == [
        "executor e1 declared dead (epoch 3) produced 0 distinct ExecutorDead idempotency keys at the receiver, "
        "not exactly one"
    ]
    h.alerts = None  # a run without a receiver is not judged on alerts
    assert check(h) == []
