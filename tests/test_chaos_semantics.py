"""The checker's semantic invariants (chaos/semantics.py): each rejects a history that breaks
it and accepts one that keeps it. Timing: grace 2 s, pingWaitSecs 2 s, pingIntervalSecs 0.5 s."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from chaos.checker import History, Timing, check, figures
from chaos.semantics import RECONNECT_SECS, TOLERANCE_SECS

T0 = datetime(2026, 11, 30, tzinfo=UTC).timestamp()
TIMING = Timing(grace_secs=2.0, ping_wait_secs=2.0, ping_interval_secs=0.5)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def entry(action: str, t: float, executor: str = "e1", peer: str | None = None) -> dict[str, Any]:
    return {"executorId": executor, "action": action, "at": iso(T0 + t), "actor": "relay", "app": "ledger",
            "peerExecutorId": peer, "detail": {"recoveryId": "r1"}}  # fmt: skip


def recovered(dead_at: float, executor: str = "e1") -> list[dict[str, Any]]:
    """A whole death: declared, dispatched to e2, succeeded and deleted."""
    return [
        entry("executor.dead", dead_at, executor),
        entry("recovery.dispatched", dead_at + 0.1, executor, "e2"),
        entry("recovery.succeeded", dead_at + 0.3, executor, "e2"),
        entry("executor.deleted", dead_at + 0.3, executor, "e2"),
    ]


def fault(kind: str, start: float, duration: float = 0.0, executor: str | None = "e1") -> dict[str, Any]:
    return {"kind": kind, "at": T0 + start, "ended": T0 + start + duration, "duration": duration,
            "executor": executor}  # fmt: skip


def history(faults: list[dict[str, Any]], audit: list[dict[str, Any]]) -> History:
    return History(
        workflows={"w1": ("SUCCESS", "ledger")},
        outcomes=[("w1", "e2", "ledger")],
        steps=[("w1", "one", "e1", "ledger"), ("w1", "one", "e2", "ledger")],
        audit=audit,
        registry={"e2": {"state": "HEALTHY"}, "d1": {"state": "HEALTHY"}},
        faults=faults,
        apps={"e1": "ledger", "e2": "ledger", "d1": "billing"},
        alive=["e2", "d1"],
        timing=TIMING,
    )


# (a) declared dead only after the grace period of a cut-off


def test_a_kill_declared_dead_after_its_grace_period_passes() -> None:
    assert check(history([fault("kill9", 10)], recovered(10 + 2.1))) == []


def test_a_declaration_sooner_than_the_grace_period_is_rejected() -> None:
    problems = check(history([fault("kill9", 10)], recovered(10 + 0.1)))
    assert len(problems) == 1 and "before its grace period" in problems[0], problems


def test_a_silent_executor_needs_ping_wait_minus_interval_more() -> None:
    # A pause: 2 s of grace + 1.5 s before the missing pongs can be noticed.
    assert check(history([fault("sigstop", 10, 7.0)], recovered(10 + 3.6))) == []
    late_enough_if_it_were_a_kill = 10 + 2.2 - 0.0
    problems = check(history([fault("sigstop", 10, 7.0)], recovered(late_enough_if_it_were_a_kill)))
    assert any("before its grace period" in p for p in problems), problems


def test_the_tolerance_is_what_it_says() -> None:
    assert check(history([fault("kill9", 10)], recovered(10 + 2.0 - TOLERANCE_SECS + 0.05))) == []
    assert check(history([fault("kill9", 10)], recovered(10 + 2.0 - TOLERANCE_SECS - 0.05)))


def test_a_declaration_with_no_fault_at_all_is_rejected() -> None:
    problems = check(history([fault("kill9", 10, executor="e9")], recovered(20)))
    assert any("no fault cutting it off" in p for p in problems), problems


def test_an_instance_fault_excuses_any_executor_after_the_grace_period() -> None:
    assert check(history([fault("relay_restart", 10, 1.0, executor=None)], recovered(12.5))) == []
    problems = check(history([fault("relay_restart", 10, 1.0, executor=None)], recovered(10.2)))
    assert any("before its grace period" in p for p in problems), problems


# (b) no recovery dispatched for a connected executor


def test_a_recovery_dispatched_while_connected_is_rejected() -> None:
    audit = recovered(12.5)
    audit[1] = entry("recovery.dispatched", 10 + 5.0 + RECONNECT_SECS + 1, "e1", "e2")  # back for a second
    problems = check(history([fault("partition", 10, 5.0)], audit))
    assert problems == [f"recovery of executor e1 dispatched at {T0 + 19.0:.2f} while it was connected"]


def test_a_recovery_dispatched_during_the_partition_passes() -> None:
    assert check(history([fault("partition", 10, 5.0)], recovered(12.5))) == []


# (c) a fault shorter than the grace period is forgiven, and the executor is HEALTHY at the end


def test_a_blip_that_ends_in_a_death_is_rejected() -> None:
    h = history([fault("partition", 10, 0.3)], recovered(12.1))
    h.timing = Timing(grace_secs=6.0, ping_wait_secs=2.0, ping_interval_secs=0.5)
    problems = check(h)
    assert any("after a partition of 0.30 s, shorter than its grace period" in p for p in problems), problems
    h.audit, h.steps = [], [("w1", "one", "e2", "ledger")]
    h.alive.append("e1")
    h.registry["e1"] = {"state": "HEALTHY"}
    assert check(h) == []


def test_an_executor_that_runs_at_the_end_must_be_healthy() -> None:
    h = history([fault("partition", 10, 0.3)], [])
    h.timing = Timing(grace_secs=6.0, ping_wait_secs=2.0, ping_interval_secs=0.5)
    h.steps = [("w1", "one", "e2", "ledger")]
    h.alive.append("e1")
    h.registry["e1"] = {"state": "DISCONNECTED"}
    assert check(h) == ["executor e1 runs at the end but is DISCONNECTED in the registry"]
    del h.registry["e1"]
    assert check(h) == ["executor e1 runs at the end but is absent in the registry"]


# (d) re-executions only for the workflows of dead or killed executors


def test_a_step_run_twice_on_live_executors_is_rejected() -> None:
    h = history([], [])
    assert check(h) == ["step one of w1 ran 2 times on ['e1', 'e2'], none of them declared dead or killed"]
    h.faults = [fault("kill9", 10)]  # e1 killed; a recovery not yet audited still explains it
    assert check(h) == []
    h.faults = [fault("sysdb_restart", 10, 6.0)]  # the system database's fault kills its executor first
    assert check(h) == []


def test_the_system_database_fault_is_a_kill_of_its_executor_and_no_one_elses() -> None:
    # e1 killed at 10, the system database down from 12.5 to 16: e1 stays cut off for good.
    assert check(history([fault("sysdb_restart", 10, 6.0)], recovered(10 + 30))) == []
    problems = check(history([fault("sysdb_restart", 10, 6.0)], recovered(10 + 0.1)))
    assert len(problems) == 1 and "before its grace period" in problems[0], problems
    problems = check(history([fault("sysdb_restart", 10, 6.0, executor="e9")], recovered(13)))
    assert any("no fault cutting it off" in p for p in problems), problems


def test_the_figures_count_recoveries_dispatched_while_the_system_database_was_down() -> None:
    restart = {**fault("sysdb_restart", 10, 6.0), "sysdb_down": T0 + 11, "sysdb_up": T0 + 14}
    assert figures(history([restart], recovered(12.1)))["recoveries_dispatched_while_sysdb_down"] == 1
    assert figures(history([restart], recovered(14.5)))["recoveries_dispatched_while_sysdb_down"] == 0
    assert figures(history([fault("kill9", 10)], recovered(12.1)))["recoveries_dispatched_while_sysdb_down"] == 0


# rule 2 through the audit log: the recovering peer is of the same app


def test_a_recovery_dispatched_to_another_apps_executor_is_rejected() -> None:
    audit = recovered(12.1)
    audit[1] = entry("recovery.dispatched", 12.2, "e1", "d1")
    problems = check(history([fault("kill9", 10)], audit))
    assert "recovery of ledger executor e1 dispatched to billing executor d1" in problems


def test_a_deploy_counts_as_a_kill_of_each_executor_it_retired() -> None:
    """A deploy kills its ``retired`` executors at ``killed_at``: their deaths after the grace period
    pass, one declared sooner does not, and an executor it did not retire is not excused."""
    deploy = {**fault("deploy", 5, executor=None), "retired": ["e1"], "killed_at": T0 + 10}
    assert check(history([deploy], recovered(10 + 2.1))) == []
    assert any("before its grace period" in p for p in check(history([deploy], recovered(10 + 0.5))))
    assert any("no fault cutting it off" in p for p in check(history([{**deploy, "retired": ["e3"]}], recovered(12.1))))
