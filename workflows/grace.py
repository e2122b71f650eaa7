"""The grace period: one durable workflow per disconnection.

It waits ``executorTimeoutSecs`` (the app's value when the executor
disconnected) in ``DBOS.recv``, whose deadline survives a crash of Relay. The
hub ends it early with a message when the same executor reconnects. When the
wait runs out, the executor is declared DEAD (the GRACE_EXPIRED event, guarded
on its state and epoch: a reconnect in the meantime makes it a no-op) and its
recovery workflow is started.

Upgrades: the workflow's name, its steps' names and their order are those of
Relay 0.2.0, so a grace period that release started finishes under this one.
"""

from __future__ import annotations

from dbos import DBOS, SetWorkflowID

from relay.core.ids import ExecutorKey, recovery_id
from relay.core.lifecycle import ExecutorEvent
from workflows.recovery import recover
from workflows.services import MAX_RECOVERY_ATTEMPTS, dedupe_key, relay_step, services

RECONNECTED_TOPIC = "reconnected"


@relay_step("relay.declare_dead")
async def declare_dead(org: str, app: str, executor_id: str, epoch: int) -> bool:
    key = ExecutorKey(org, app, executor_id)
    return await services().recoveries.declare_dead(key, epoch, ExecutorEvent.GRACE_EXPIRED, "relay", dedupe_key())


@DBOS.workflow(name="relay.grace_period", max_recovery_attempts=MAX_RECOVERY_ATTEMPTS)
async def grace_period(org: str, app: str, executor_id: str, epoch: int, timeout_secs: float) -> str:
    woken = await DBOS.recv_async(RECONNECTED_TOPIC, timeout_seconds=timeout_secs)
    if woken is not None:
        return f"ended early: {woken}"
    if not await declare_dead(org, app, executor_id, epoch):
        return "not dead: it reconnected or was handled already"
    with SetWorkflowID(recovery_id(ExecutorKey(org, app, executor_id), epoch)):
        await DBOS.start_workflow_async(recover, org, app, executor_id, epoch, "grace_period")
    return "dead"
