"""harness.executors.jobs_held, on which eleven tests of a death mid-job rely: the executor's jobs
wait for the gate, which opens at the end of the block, failed or not; its id is learned from the
registry before its READY, and checked against READY's at the end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from harness.executors import Evidence, ExecutorProcess, jobs_held
from harness.relay import RelayProcess
from harness.waiting import assert_eventually

StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


def test_the_jobs_wait_for_the_end_and_an_id_the_registry_did_not_give_fails_it(
    start_relay: StartRelay, start_executor: StartExecutor, evidence_db: str, tmp_path: Path
) -> None:
    relay = start_relay()
    evidence = Evidence(evidence_db)
    jobs = {"RELAY_TEST_EVIDENCE": evidence_db, "RELAY_TEST_JOBS": "2", "RELAY_TEST_JOB_SLEEP": "0"}
    with jobs_held(start_executor, relay.conductor_url, tmp_path, jobs) as held:
        everyone = held.await_healthy(relay, [], 20, what="the executor HEALTHY, its jobs held back")
        assert everyone == {held.executor_id: "relay-1"}, everyone
        # READY comes only past the jobs, which wait for the gate.
        assert not held.launching.done() and evidence.step_runs() == []
    first = held.release()
    assert_eventually(lambda: evidence.outcomes() == {"job-0": first.executor_id, "job-1": first.executor_id}, 20)

    # The id a test learned is not the one READY gave: the block fails at its end.
    with (
        pytest.raises(AssertionError, match="READY gave"),
        jobs_held(start_executor, relay.conductor_url, tmp_path, {}) as held,
    ):
        held.await_healthy(relay, [first.executor_id], 20, what="the second executor HEALTHY")
        held.executor_id = first.executor_id
    assert held.launching.result().executor_id not in ("", first.executor_id)


def test_a_block_that_fails_opens_the_gate_all_the_same(
    start_relay: StartRelay, start_executor: StartExecutor, tmp_path: Path
) -> None:
    """Else the launch, waiting for the gate, would never print READY: the block's end would wait for
    it until the harness gave up on the executor (a minute), and the failure would read as that."""
    relay = start_relay()
    with (
        pytest.raises(RuntimeError, match="the test failed"),
        jobs_held(start_executor, relay.conductor_url, tmp_path, {}) as held,
    ):
        raise RuntimeError("the test failed")
    assert held.gate.exists()
    assert held.launching.result().executor_id
