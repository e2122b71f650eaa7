"""The grace period: one durable workflow per disconnection.

It waits ``executorTimeoutSecs`` (the app's value when the executor
disconnected) in ``DBOS.recv``, whose deadline survives a crash of Relay. The
hub ends it early with a message when the same executor reconnects. When the
wait runs out, the executor is declared DEAD (a guarded update on its state
and epoch: a reconnect in the meantime makes it a no-op) and its recovery
workflow is started.
"""

from __future__ import annotations

from dbos import DBOS, SetWorkflowID

from relay.recoveries import recovery_id
from relay.registry import ExecutorKey
from workflows.recovery import recover
from workflows.services import relay_step, services

RECONNECTED_TOPIC = "reconnected"


@relay_step("relay.declare_dead")
async def declare_dead(org: str, app: str, executor_id: str, epoch: int) -> bool:
    dedupe = f"{DBOS.workflow_id}:{DBOS.step_id}"
    store = services().runtime.recoveries
    return await services().call(store.declare_dead(ExecutorKey(org, app, executor_id), epoch, "relay", dedupe))


@DBOS.workflow(name="relay.grace_period")
async def grace_period(org: str, app: str, executor_id: str, epoch: int, timeout_secs: float) -> str:
    woken = await DBOS.recv_async(RECONNECTED_TOPIC, timeout_seconds=timeout_secs)
    if woken is not None:
        return f"ended early: {woken}"
    if not await declare_dead(org, app, executor_id, epoch):
        return "not dead: it reconnected or was handled already"
    key = ExecutorKey(org, app, executor_id)
    with SetWorkflowID(recovery_id(key, epoch)):
        await DBOS.start_workflow_async(recover, org, app, executor_id, epoch, "grace_period")
    return "dead"
