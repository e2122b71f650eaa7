"""The stranded-workflow reconciler: one durable run per app and ``reconciler.intervalSecs``.

Every protocol step of a recovery can say "success" and still leave work
behind: a peer's re-enqueue lost to a crash of its database, a record deleted
by hand, an executor that died while Relay itself was down and whose record
went with it. Nothing would ever look at those workflows again. Once per
interval, for each app with a healthy executor, every instance starts the run
``reconcile:{org}:{app}:{interval number}``; DBOS runs an id once, so one
instance does the work. The run:

1. asks a healthy executor of the app (through the router) for its PENDING
   workflows, and keeps those that are stranded (:mod:`relay.core.stranded`:
   an owner with no record in the registry, not updated for the grace period).
   It writes nothing;
2. brings each such executor's record back DEAD (the lifecycle's STRANDED
   event), owned by the instance that runs the step, audits
   ``reconcile.found`` and ``reconcile.recovered`` (with the recovery's id) in
   the same transaction, and starts that recovery: the same workflow as for
   any death, so the peer is one of the same version (or the version policy
   blocks it, as usual) and success is verified with
   ``exist_pending_workflows`` before the record is deleted again.

Runs of one app may overlap (a run outlasts its interval when an executor is
slow to answer, or two instances' clocks straddle an interval's end). Step 2
therefore acts only if nothing was audited about the executor since step 1
began: a run whose listing predates another run's claim, or the recovery that
followed it, leaves the executor to that one (and to later runs).

An executor id with a workflow created or completed within the grace period is
left alone, however old its PENDING ones: a process under that id is at work,
cut off from Relay but not from its database (a network cut longer than the
grace period; the soak of seed 25 met one, starting workflows 4 s after its
recovery). Once it stops, its work ages past the grace period and a later run
recovers it.

The risk: an executor alive but not connected to Relay (a network cut longer
than the grace period, after which Relay deleted its record) has its work
re-run by a peer. The guards are those of a death: its record is gone only
after Relay declared it dead and recovered it (or an operator deleted it), its
workflows have not moved for the grace period, ids Relay never registered
count only by opt-in and ``local`` never; and if it connects again, its
record becomes HEALTHY and the recovery stops (as for any executor back from
the dead).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import NotRequired, TypedDict

from dbos import DBOS, SetWorkflowID

from relay.core.ids import ExecutorKey, app_part, recovery_id
from relay.core.stranded import PendingWorkflow, candidate_ids, find_stranded
from relay.core.times import sdk_time
from relay.errors import ExecutorRequestError
from relay.store.audit import audit_executor, audited_detail
from relay_protocol import ListWorkflowsBody, ListWorkflowsReply, ListWorkflowsRequest, WorkflowsOutput, clean_text
from workflows.recovery import recover
from workflows.services import dedupe_key, first_answer, relay_step, services

log = logging.getLogger("relay.reconcile")

PAGE = 1000
# Workflow ids named in one audit entry (the count is always complete).
AUDITED_IDS = 100


class StrandedRecord(TypedDict):
    executorId: str
    version: str
    workflowIds: list[str]
    registered: bool


class FindRecord(TypedDict):
    """The checkpoint of ``relay.reconcile.find``."""

    ok: bool
    error: NotRequired[str]
    stranded: list[StrandedRecord]
    # The newest audit entry's id before the listing (absent in runs begun by a build before this
    # guard; 0.2.0 has no reconciler).
    auditMark: NotRequired[int]


def reconcile_id(org: str, app: str, interval_secs: float, now: float | None = None) -> str:
    """The id of this interval's run for the app: the same on every instance (org and app escaped by
    :func:`app_part`: one app's run is never another's)."""
    return f"reconcile:{app_part(org, app)}:{int((time.time() if now is None else now) // interval_secs)}"


def count(org: str, app: str, what: str, n: int = 1) -> None:
    if n:
        services().reconciled[(org, app, what)] += n


def _find_failed(exc: Exception) -> FindRecord:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "stranded": []}


async def _pending(org: str, app: str, peer: str, timeout: float) -> list[WorkflowsOutput]:
    """Every PENDING workflow of the app, as ``peer`` reads them from the system database."""
    found: list[WorkflowsOutput] = []
    while True:
        body = ListWorkflowsBody(status="PENDING", load_input=False, load_output=False, limit=PAGE, offset=len(found))
        reply = await services().ask(
            ExecutorKey(org, app, peer), ListWorkflowsRequest(body=body), ListWorkflowsReply, timeout
        )
        if reply.error_message:
            raise ExecutorRequestError(f"list_workflows: {clean_text(reply.error_message, 300)}")
        found.extend(reply.output)
        if len(reply.output) < PAGE:
            return found


async def _at_work(org: str, app: str, peer: str, executor_ids: list[str], since_ms: int, timeout: float) -> set[str]:
    """Those of ``executor_ids`` with a workflow (of any status) created or completed since
    ``since_ms``, as ``peer`` reads them: a process under that id is alive. Two requests for all of
    them; only when one fills its page (a busy executor may hide the others) is each id not seen
    yet asked for on its own."""
    since = sdk_time(datetime.fromtimestamp(since_ms / 1000, UTC))

    async def seen(ids: list[str], created: bool, limit: int) -> tuple[set[str], bool]:
        body = ListWorkflowsBody(executor_id=ids, start_time=since if created else None,
                                 completed_after=None if created else since, limit=limit, load_input=False,
                                 load_output=False)  # fmt: skip
        reply = await services().ask(
            ExecutorKey(org, app, peer), ListWorkflowsRequest(body=body), ListWorkflowsReply, timeout
        )
        if reply.error_message:
            raise ExecutorRequestError(f"list_workflows: {clean_text(reply.error_message, 300)}")
        return {w.executor_id for w in reply.output if w.executor_id in ids}, len(reply.output) >= limit

    alive: set[str] = set()
    for created in (True, False):
        left = [i for i in executor_ids if i not in alive]
        if not left:
            break
        found, full = await seen(left, created, PAGE)
        alive |= found
        if full:
            for executor_id in [i for i in left if i not in alive]:
                alive |= (await seen([executor_id], created, 1))[0]
    return alive


def _updated_ms(w: WorkflowsOutput) -> int | None:
    try:
        return int(w.updated_at) if w.updated_at is not None else None
    except ValueError:
        return None


@relay_step("relay.reconcile.find", on_error=_find_failed)
async def find(org: str, app: str) -> FindRecord:
    found = await _find(org, app)
    # Once its reads are done: an attempt that database trouble cut short is tried again, and a run
    # counted as it began counted once per attempt.
    count(org, app, "runs")
    return found


async def _find(org: str, app: str) -> FindRecord:
    svc = services()
    settings = await svc.apps.settings_of(org, app)
    if settings is None:
        return {"ok": True, "stranded": []}
    timeout, spread = svc.liveness.recovery_ack_timeout_secs, DBOS.workflow_id or ""  # runs take turns
    mark = await svc.executors.audit_mark()
    try:
        _, outputs = await first_answer(org, app, lambda peer: _pending(org, app, peer, timeout), spread)
    except ExecutorRequestError as exc:
        return {"ok": False, "error": clean_text(str(exc), 1000), "stranded": []}
    workflows = [
        PendingWorkflow(w.workflow_id, w.executor_id or "", w.application_version or "", _updated_ms(w))
        for w in outputs
        if w.status == "PENDING"
    ]
    gone = await svc.executors.gone(org, app, candidate_ids(workflows))
    now_ms = int(time.time() * 1000)
    stranded = find_stranded(
        workflows,
        gone,
        now_ms=now_ms,
        grace_secs=settings.executor_timeout_secs,
        include_unknown=svc.reconciler.include_unknown_executors,
    )
    if stranded:
        since_ms = now_ms - int(settings.executor_timeout_secs * 1000)
        ids = [s.executor_id for s in stranded]
        try:
            _, alive = await first_answer(
                org, app, lambda peer: _at_work(org, app, peer, ids, since_ms, timeout), spread
            )
        except ExecutorRequestError as exc:
            return {"ok": False, "error": clean_text(str(exc), 1000), "stranded": []}
        for executor_id in sorted(alive):
            log.warning("reconcile %s/%s: executor %s has no record but is at work (a workflow created or "
                        "completed within the grace period): left alone", org, app, executor_id)  # fmt: skip
        count(org, app, "executors_alive", len(alive))
        stranded = [s for s in stranded if s.executor_id not in alive]
    return {
        "ok": True,
        "stranded": [
            {"executorId": s.executor_id, "version": s.application_version, "workflowIds": list(s.workflow_ids),
             "registered": s.registered}
            for s in stranded
        ],
        "auditMark": mark,
    }  # fmt: skip


@relay_step("relay.reconcile.reinstate")
async def reinstate(org: str, app: str, stranded: StrandedRecord, audit_mark: int | None = None) -> int | None:
    """The executor's record back DEAD, owned by this instance, and ``reconcile.found`` and
    ``reconcile.recovered`` audited; its epoch. None if it has a record now (it connected, or
    another run brought it back), its app was deleted since it was found, or anything was audited
    about it since ``audit_mark``."""
    svc = services()
    key = ExecutorKey(org, app, stranded["executorId"])
    async with svc.executors.db.fenced() as conn:
        done = await audited_detail(conn, dedupe_key())
        if done is not None:  # this step, run again after a crash
            return int(done["epoch"])
        epoch = await svc.executors.stranded(conn, key, stranded["version"], svc.instance_id, audit_mark)
        if epoch is None:
            return None
        ids = stranded["workflowIds"]
        found = {"workflows": len(ids), "workflowIds": ids[:AUDITED_IDS], "applicationVersion": stranded["version"],
                 "registered": stranded["registered"]}  # fmt: skip
        await audit_executor(conn, key, "reconcile.found", f"{dedupe_key()}:found", detail=found)
        detail = {"epoch": epoch, "recoveryId": recovery_id(key, epoch), "applicationVersion": stranded["version"],
                  "workflows": len(ids), "workflowIds": ids[:AUDITED_IDS]}  # fmt: skip
        await audit_executor(conn, key, "reconcile.recovered", dedupe_key(), detail=detail)
    count(org, app, "executors_found")
    count(org, app, "workflows_found", len(ids))
    count(org, app, "recoveries_started")
    return epoch


@DBOS.workflow(name="relay.reconcile")
async def reconcile(org: str, app: str) -> dict[str, int]:
    found = await find(org, app)
    if not found["ok"]:
        log.warning("reconcile %s/%s: %s", org, app, found.get("error"))
    started = 0
    for stranded in found["stranded"]:
        epoch = await reinstate(org, app, stranded, found.get("auditMark"))
        if epoch is None:
            continue
        with SetWorkflowID(recovery_id(ExecutorKey(org, app, stranded["executorId"]), epoch)):
            await DBOS.start_workflow_async(
                recover, org, app, stranded["executorId"], epoch, "reconcile", nudgeable_backoff=True
            )
        started += 1
    if started:
        log.info("reconcile %s/%s: recovering %d stranded executors", org, app, started)
    return {"found": len(found["stranded"]), "recovered": started}
