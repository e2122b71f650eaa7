"""The bookkeeping of a run of requests refused for the database (relay.core.outage): no I/O."""

from __future__ import annotations

from relay.core.outage import FailureRun, Recovered, RefusalRun, RunEnded


def test_only_the_first_refusal_of_a_run_is_to_be_logged() -> None:
    run = RefusalRun()
    assert run.refuse(10.0, answered=5)
    assert not run.refuse(11.0, answered=5)
    assert not run.refuse(12.0, answered=5)
    assert run.refused == 3


def test_the_run_ends_at_a_request_served_after_the_database_answered_again() -> None:
    run = RefusalRun()
    run.refuse(10.0, answered=5)
    run.refuse(12.0, answered=5)
    # Served without the database (a health check, a static file): the outage may go on.
    assert run.serve(13.0, answered=5) is None
    assert run.serve(14.5, answered=6) == RunEnded(refused=2, secs=4.5)
    assert run.serve(15.0, answered=7) is None  # told once
    assert run.refuse(20.0, answered=7)  # a new run is logged again


def test_a_refusal_after_the_database_answered_again_keeps_the_run_going() -> None:
    run = RefusalRun()
    run.refuse(10.0, answered=5)
    run.refuse(11.0, answered=8)  # a request that had waited through the outage, refused late
    assert run.serve(11.5, answered=8) is None
    ended = run.serve(12.0, answered=9)
    assert ended is not None and ended.refused == 2


def test_nothing_to_tell_without_a_refusal() -> None:
    assert RefusalRun().serve(1.0, answered=100) is None


def test_a_run_no_request_saw_end_ends_when_a_request_begun_after_the_database_came_back_is_refused() -> None:
    run = RefusalRun()
    assert run.refuse(10.0, answered=5)
    assert run.refuse(11.0, answered=5) is False
    # The database came back at 20 (nothing served since); a request begun at 30 is refused: another outage.
    assert run.ended_unseen(started=30.0, recovered_at=20.0) == RunEnded(refused=2, secs=1.0)
    assert run.refuse(31.0, answered=9)  # the first of a new run: logged


def test_a_request_that_waited_through_the_outage_stays_in_its_run() -> None:
    run = RefusalRun()
    run.refuse(10.0, answered=5)
    # It began at 12, the database came back at 15, it was refused at 22 (the pool's wait): same outage.
    assert run.ended_unseen(started=12.0, recovered_at=15.0) is None
    assert run.refuse(22.0, answered=6) is False
    assert run.ended_unseen(started=23.0, recovered_at=None) is None  # never unreachable since it began


def test_a_loops_failures_are_told_once_and_the_first_success_after_them_ends_the_run() -> None:
    run = FailureRun()
    assert run.succeed(5.0) is None  # no run under way: nothing to tell
    assert run.fail(10.0)
    assert not run.fail(21.0)
    assert not run.fail(32.0)
    assert run.succeed(40.0) == Recovered(failed=3, secs=30.0)
    assert run.succeed(41.0) is None
    assert run.fail(100.0)  # the next outage is told again
