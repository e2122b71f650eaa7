"""The checker's database rules (chaos/dbrules.py): each rejects a history that breaks it and
accepts one that keeps it. Timing: pingWaitSecs 2 s, instanceLeaseSecs 3 s."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from chaos.checker import History, Timing, check, figures
from chaos.dbrules import HEALTHY_TOLERANCE_SECS, READY_SLACK_SECS

T0 = datetime(2026, 11, 30, tzinfo=UTC).timestamp()
TIMING = Timing(grace_secs=2.0, ping_wait_secs=2.0, ping_interval_secs=0.5, lease_secs=3.0)
BOUND = 2.0 + HEALTHY_TOLERANCE_SECS


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def fault(kind: str, start: float, duration: float = 0.0, **more: Any) -> dict[str, Any]:
    if kind.startswith("db_"):
        more.setdefault("ready_after", {"relay-1": 0.5})  # the runner polled readiness after it
    return {"kind": kind, "at": T0 + start, "ended": T0 + start + duration, "duration": duration, **more}


def adopted(instance: str, t: float, epoch: int = 2) -> dict[str, Any]:
    detail = {"instance": instance, "leaseEpoch": epoch, "adoptedBy": "relay-2"}
    return {"executorId": None, "action": "relay.instance_adopted", "at": iso(T0 + t), "actor": "relay",
            "peerExecutorId": None, "detail": detail}  # fmt: skip


def healthy(*times: float, state: str = "HEALTHY") -> list[tuple[float, str]]:
    return [(T0 + t, state) for t in times]


def history(faults: list[dict[str, Any]], **more: Any) -> History:
    """A run in which nothing but the rules under test can fail: no workflow, no declaration."""
    return History(
        workflows={}, outcomes=[], steps=[], audit=[], registry={"e2": {"state": "HEALTHY"}},
        faults=faults, apps={"e1": "ledger", "e2": "ledger"}, alive=["e2"], timing=TIMING, **more,
    )  # fmt: skip


# (e) no executor stays HEALTHY more than pingWaitSecs after its process is gone or paused


def test_a_killed_executor_seen_healthy_long_after_is_rejected() -> None:
    h = history([fault("kill9", 10, executor="e1")], health={"e1": healthy(9.6, 10.2, 11.0, 60.0)})
    problems = check(h)
    assert len(problems) == 1 and "executor e1 was HEALTHY in the registry at" in problems[0], problems
    assert "50.00 s after its kill9" in problems[0]
    assert figures(h)["database_rules"]["healthy_after_cut_secs"]["max"] == 50.0


def test_a_killed_executor_no_longer_healthy_within_ping_wait_passes() -> None:
    samples = healthy(9.6, 10.2, 10 + BOUND - 0.1) + healthy(10 + BOUND + 0.3, 30.0, state="DISCONNECTED")
    h = history([fault("kill9", 10, executor="e1")], health={"e1": samples})
    assert check(h) == []
    assert figures(h)["database_rules"]["healthy_after_cut_secs"] == {
        "cuts": 1,
        "max": 3.9,
        "bound": BOUND,
        "min_samples": 2,
    }


def test_an_executor_a_deploy_retired_seen_healthy_long_after_is_rejected() -> None:
    """A deploy kills each executor it retires at its ``killed_at``: (e) holds for each of them."""
    deploy = fault("deploy", 5, executor=None, retired=["e1"], killed_at=T0 + 10)
    h = history([deploy], health={"e1": healthy(9.6, 10.2, 60.0)})
    problems = check(h)
    assert len(problems) == 1 and "50.00 s after its deploy" in problems[0], problems
    h = history([deploy], health={"e1": healthy(9.6, 10.2) + healthy(11.0, 60.0, state="DISCONNECTED")})
    assert check(h) == []


def test_a_database_outage_moves_the_bound_to_its_end() -> None:
    # Killed at 10 while Relay's database is out from 9 to 14: HEALTHY until 14 + pingWaitSecs is fine.
    faults = [fault("db_kill", 9, 5.0), fault("kill9", 10, executor="e1")]
    assert check(history(faults, health={"e1": healthy(15.0, 14 + BOUND - 0.1)})) == []
    problems = check(history(faults, health={"e1": healthy(14 + BOUND + 0.5)}))
    assert len(problems) == 1 and "4.50 s after its kill9" in problems[0], problems


def test_a_paused_executor_counts_while_the_pause_lasts_only() -> None:
    faults = [fault("sigstop", 10, 8.0, executor="e1")]
    # HEALTHY again once it resumed and reconnected: the legitimate end of the pause.
    assert check(history(faults, health={"e1": healthy(10.5, 18.5, 19.0, 25.0)})) == []
    problems = check(history(faults, health={"e1": healthy(10.5, 15.0)}))  # never noticed
    assert len(problems) == 1 and "after its sigstop" in problems[0], problems


def test_a_partitioned_executor_still_healthy_is_rejected() -> None:
    faults = [fault("partition", 10, 8.0, executor="e1")]
    assert check(history(faults, health={"e1": healthy(10.1, 12.0)})) == []
    assert check(history(faults, health={"e1": healthy(10.1, 16.5)}))


# (f) every instance ready within instanceLeaseSecs + 10 s after the database returns


def test_an_instance_never_ready_after_the_database_returns_is_rejected() -> None:
    h = history([fault("db_cut", 10, 3.0, ready_after={"relay-1": 1.2, "relay-2": None, "relay-3": 14.0})])
    problems = check(h)
    assert problems == [
        f"instance relay-2 was not ready after Relay's database returned from a db_cut at {T0 + 10:.2f}, "
        f"more than instanceLeaseSecs + {READY_SLACK_SECS:.0f} s",
        f"instance relay-3 was ready only 14.00 s after Relay's database returned from a db_cut at {T0 + 10:.2f}, "
        f"more than instanceLeaseSecs + {READY_SLACK_SECS:.0f} s",
    ]
    numbers = figures(h)["database_rules"]["ready_after_database_secs"]
    assert numbers == {"count": 3, "max": 14.0, "never": 1, "bound": 13.0}


def test_instances_ready_within_the_bound_pass_and_an_exit_is_judged_on_its_own() -> None:
    assert check(history([fault("db_kill", 10, 3.0, ready_after={"relay-1": 1.2, "relay-2": 12.9})])) == []
    # relay-2 crashed after the outage: not "never ready" but an unplanned exit.
    h = history(
        [fault("db_kill", 10, 3.0, ready_after={"relay-1": 1.2, "relay-2": None})],
        exits=[{"instance": "relay-2", "exit_code": 1, "at": T0 + 14.0}],
    )
    assert check(h) == [f"instance relay-2 exited with code 1 at {T0 + 14:.2f}, not made by the harness"]


# (g) no lease adopted during a database fault unless its instance was stopped by the harness


def test_a_live_instances_lease_adopted_after_a_database_pause_is_rejected() -> None:
    h = history([fault("db_pause", 10, 4.5)])
    h.audit = [adopted("relay-3", 15.0)]
    assert check(h) == [
        f"instance relay-3's lease was adopted at {T0 + 15:.2f}, during or just after a db_pause of Relay's "
        f"database at {T0 + 10:.2f}, though the harness had not stopped it"
    ]
    assert figures(h)["database_rules"]["adoptions_in_database_faults"] == 1


def test_an_adoption_of_a_killed_or_crashed_instance_or_long_after_the_fault_passes() -> None:
    h = history([fault("db_pause", 10, 4.5), fault("relay_kill", 30, 5.0, instance="relay-3")])
    h.audit = [adopted("relay-3", 34.0)]
    assert check(h) == []  # the harness's kill, nowhere near the database's fault
    h.faults = [fault("db_cut", 10, 4.0), fault("relay_kill", 14.5, 5.0, instance="relay-3")]
    assert check(h) == []  # killed just after the database returned
    h.faults = [fault("db_cut", 10, 4.0)]
    h.exits = [{"instance": "relay-3", "exit_code": 1, "at": T0 + 11.0}]
    problems = check(h)  # it crashed first: the adoption is right, the crash is the violation
    assert problems == [f"instance relay-3 exited with code 1 at {T0 + 11:.2f}, not made by the harness"]


# (h) no instance exits except the fenced ones


def test_exits_other_than_fenced_after_adoption_are_rejected() -> None:
    h = history([], exits=[{"instance": "relay-1", "exit_code": 3, "at": T0 + 20.0}])
    assert check(h) == [
        f"instance relay-1 exited with code 3 at {T0 + 20:.2f}, not made by the harness "
        "(the fenced code, but its lease had not been adopted)"
    ]
    h.audit = [adopted("relay-1", 19.2)]
    assert check(h) == []
    assert figures(h)["database_rules"]["instance_exits"] == {"fenced": 1, "other": 0}
    # A second fenced exit needs an adoption of its own, after the first exit.
    h.exits.append({"instance": "relay-1", "exit_code": 3, "at": T0 + 40.0})
    assert len(check(h)) == 1
    h.audit.append(adopted("relay-1", 39.0, epoch=4))
    assert check(h) == []


# the watching itself


def test_a_run_whose_registry_was_never_read_is_rejected() -> None:
    problems = check(history([fault("kill9", 10, executor="e1")]))
    assert problems == ["the registry was never read during the run, though executors were cut off"]


def test_a_database_fault_whose_readiness_was_not_polled_is_rejected() -> None:
    unpolled = fault("db_cut", 10, 3.0)
    del unpolled["ready_after"]
    problems = check(history([unpolled, fault("db_kill", 30, 3.0, ready_after={})]))
    assert problems == [
        f"no instance's readiness was polled after the db_cut of Relay's database at {T0 + 10:.2f}",
        f"no instance's readiness was polled after the db_kill of Relay's database at {T0 + 30:.2f}",
    ]
