"""The grace period: one durable workflow per disconnection.

It waits ``executorTimeoutSecs`` (the app's value when the executor
disconnected), counted from the disconnection, in ``DBOS.recv``, whose deadline
survives a crash of Relay. The hub ends it early with a message when the same
executor reconnects. When the wait runs out, the executor is declared DEAD (the
GRACE_EXPIRED event, guarded on its state and epoch: a reconnect in the meantime
makes it a no-op) and its recovery workflow is started.

Upgrades: the workflow's name, its steps' names and their order are those of
Relay 0.2.0, so a grace period that release started finishes under this one (its
inputs lack ``lost_at``, added after 0.2.0 with a default).
"""

from __future__ import annotations

import logging
import time

from dbos import DBOS, SetWorkflowID

from relay.core.ids import ExecutorKey, recovery_id
from relay.core.lifecycle import ExecutorEvent
from relay.errors import DatabaseError
from workflows import ordering
from workflows.recovery import recover
from workflows.services import MAX_RECOVERY_ATTEMPTS, dedupe_key, relay_step, services

RECONNECTED_TOPIC = "reconnected"
log = logging.getLogger("relay.grace")


def remaining(timeout_secs: float, lost_at: float | None) -> float:
    """What is left of the grace period when its timer is first recorded.

    ``lost_at`` (``time.time()`` when the hub found the socket gone) makes the grace period
    end ``timeout_secs`` after the disconnection, however long the workflow waited to start:
    behind a group of disconnections, or a slow database. The repair sweep gives the
    disconnection's time too. Runs that 0.2.0 started have none: :func:`lost_at_of` reads it from
    the executor's row, and without one they wait ``timeout_secs`` from here. On a replay, DBOS
    keeps the deadline it recorded the first time, so reading the clock here is safe.
    """
    if lost_at is None:
        return timeout_secs
    return min(timeout_secs, max(0.0, lost_at + timeout_secs - time.time()))


async def lost_at_of(org: str, app: str, executor_id: str, epoch: int) -> float | None:
    """The disconnection's time of a run that 0.2.0 started (its inputs have no ``lost_at``), from
    the executor's row. Such a run stopped (0.2.0 killed) before it recorded its timer, which it
    does as it first waits, would otherwise wait a whole ``timeout_secs`` more here. Not a step, so the
    run's steps are 0.2.0's: when the timer was recorded, DBOS keeps it and this is not used. None
    when the row is not DISCONNECTED at ``epoch`` or the database does not answer (the wait is then
    ``timeout_secs``, as before; the step after it checks the state anyway)."""
    try:
        secs = await services().executors.disconnected_secs(ExecutorKey(org, app, executor_id), epoch)
    except DatabaseError:  # only a shorter wait is at stake, never the run
        log.warning("grace period of %s/%s/%s: its disconnection's time could not be read", org, app, executor_id)
        return None
    return None if secs is None else time.time() - secs


@relay_step("relay.declare_dead")
async def declare_dead(org: str, app: str, executor_id: str, epoch: int) -> bool:
    key = ExecutorKey(org, app, executor_id)
    return await services().recoveries.declare_dead(key, epoch, ExecutorEvent.GRACE_EXPIRED, "relay", dedupe_key())


@DBOS.workflow(name="relay.grace_period", max_recovery_attempts=MAX_RECOVERY_ATTEMPTS)
async def grace_period(
    org: str, app: str, executor_id: str, epoch: int, timeout_secs: float, lost_at: float | None = None
) -> str:
    if lost_at is None:
        lost_at = await lost_at_of(org, app, executor_id, epoch)
    woken = await DBOS.recv_async(RECONNECTED_TOPIC, timeout_seconds=remaining(timeout_secs, lost_at))
    if woken is not None:
        return f"ended early: {woken}"
    # Its recovery (a task of this one's) takes its turn among the others by the moment of this
    # death: a group's earliest deaths recover first, not all together at the end.
    ordering.rank_by(time.time() if lost_at is None else lost_at + timeout_secs)
    if not await declare_dead(org, app, executor_id, epoch):
        return "not dead: it reconnected or was handled already"
    with SetWorkflowID(recovery_id(ExecutorKey(org, app, executor_id), epoch)):
        await DBOS.start_workflow_async(recover, org, app, executor_id, epoch, "grace_period", nudgeable_backoff=True)
    return "dead"
