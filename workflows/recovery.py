"""Recovery of a dead executor's workflows: one durable workflow per death.

The loop: gather the facts (a step), let the pure :func:`relay.peers.choose_peer`
decide, then either wait durably for a peer or an operator (``DBOS.recv``,
woken by the hub or the API), or dispatch to the chosen peer. A peer on the
dead executor's version gets the SDK's ``recovery`` frame; a peer on the
latest version (only where allowed) gets each PENDING workflow cancelled and
rewound onto its version. Success is verified with ``exist_pending_workflows``
before the record is deleted; any failure moves on to the next candidate after
an exponential backoff (``DBOS.sleep``).

Every step is safe to run twice (a crash between a step's action and its
checkpoint repeats it): recovery frames are idempotent, database changes are
guarded updates, audit entries carry a dedupe key.
"""

from __future__ import annotations

import logging
from typing import Any

from dbos import DBOS

from relay.errors import ExecutorRequestError
from relay.peers import Mode, Peer, backoff, choose_peer
from relay.protocol import MessageType, Request, exist_pending_workflows, list_workflows, recovery
from relay.recoveries import AuditEntry
from relay.registry import ExecutorKey
from workflows.services import relay_step, services

log = logging.getLogger("relay.recovery")

WAKE_TOPIC = "wake"
# A blocked recovery is woken by the hub (a peer connected) or the API (settings, an
# operator); this fallback re-check only covers a wake-up lost to a crash.
BLOCKED_RECHECK_SECS = 30.0

Result = dict[str, Any]


def _dedupe() -> str:
    return f"{DBOS.workflow_id}:{DBOS.step_id}"


async def _ask(org: str, app: str, peer: str, request: Request, timeout: float) -> Result:
    """Send a request to a peer, through whichever instance holds its socket;
    ``{"ok": False, "error": ...}`` instead of raising."""
    svc = services()
    try:
        reply = await svc.call(
            svc.runtime.router.request(ExecutorKey(org, app, peer), request, timeout, await_connection=True)
        )
    except ExecutorRequestError as exc:
        return {"ok": False, "error": str(exc)}
    if reply.error_message:
        return {"ok": False, "error": f"{request.type.value}: {reply.error_message}"}
    return {"ok": True, "body": reply.body}


@relay_step("relay.open_recovery")
async def open_recovery(rid: str, org: str, app: str, executor_id: str, epoch: int, trigger: str) -> str | None:
    store = services().runtime.recoveries
    return await services().call(store.open(rid, ExecutorKey(org, app, executor_id), epoch, trigger))


@relay_step("relay.gather")
async def gather(
    org: str, app: str, executor_id: str, epoch: int, version: str, operator_allows_latest: bool
) -> Result:
    rt = services().runtime
    key = ExecutorKey(org, app, executor_id)
    dead = await services().call(rt.recoveries.still_dead(key, epoch))
    healthy = await services().call(rt.registry.healthy_peers(org, app))
    apps = await services().call(rt.registry.list_apps(org, app))
    allow_latest = operator_allows_latest or bool(apps and apps[0].recover_to_latest_version)
    latest = None
    others = [p for p in healthy if p[0] != executor_id]
    if allow_latest and others and not any(v == version for _, v in others):
        latest = await _latest_version(org, app, others, rt.config.liveness.recovery_ack_timeout_secs)
    liveness = rt.config.liveness
    return {
        "dead": dead,
        "peers": [list(p) for p in healthy],
        "allow_latest": allow_latest,
        "latest": latest,
        "ack_timeout": liveness.recovery_ack_timeout_secs,
        "backoff_initial": liveness.failover_backoff_initial_secs,
        "backoff_max": liveness.failover_backoff_max_secs,
    }


async def _latest_version(org: str, app: str, peers: list[tuple[str, str]], timeout: float) -> str | None:
    """The newest application version that a healthy peer runs, by the system database's timestamps."""
    running = {v for _, v in peers}
    for peer, _ in peers:
        answer = await _ask(org, app, peer, Request(MessageType.LIST_APPLICATION_VERSIONS), timeout)
        if not answer["ok"]:
            continue
        known = [v for v in answer["body"].get("output") or [] if isinstance(v, dict)]
        ranked = sorted(
            (v for v in known if v.get("version_name") in running),
            key=lambda v: (v.get("version_timestamp") or 0, v.get("created_at") or 0),
        )
        if ranked:
            return str(ranked[-1]["version_name"])
    return None


@relay_step("relay.mark_blocked")
async def mark_blocked(rid: str, org: str, app: str, executor_id: str, epoch: int, reason: str) -> None:
    status = "waiting_for_peer" if reason == "no_healthy_peer" else "awaiting_operator"
    services().runtime.durable.note_blocked(org, app)
    store = services().runtime.recoveries
    await services().call(store.set_blocked(rid, ExecutorKey(org, app, executor_id), epoch, reason, status, _dedupe()))


@relay_step("relay.dispatch")
async def dispatch(
    rid: str,
    org: str,
    app: str,
    executor_id: str,
    epoch: int,
    attempt: int,
    peer: str,
    mode: str,
    failover_from: str | None,
    backoff_secs: float,
) -> bool:
    store = services().runtime.recoveries
    key = ExecutorKey(org, app, executor_id)
    return await services().call(
        store.dispatch(rid, key, epoch, attempt, peer, mode, failover_from, backoff_secs, _dedupe())
    )


@relay_step("relay.recover_same_version")
async def recover_same_version(org: str, app: str, peer: str, executor_id: str, version: str, timeout: float) -> Result:
    answer = await _ask(org, app, peer, recovery([executor_id]), timeout)
    if not answer["ok"]:
        return answer
    if answer["body"].get("success") is not True:
        return {"ok": False, "error": "recovery: the peer answered success: false"}
    return {"ok": True}


@relay_step("relay.list_pending")
async def list_pending(org: str, app: str, peer: str, executor_id: str, version: str, timeout: float) -> Result:
    query = list_workflows(executor_id=executor_id, status="PENDING", application_version=version)
    answer = await _ask(org, app, peer, query, timeout)
    if not answer["ok"]:
        return answer
    rows = answer["body"].get("output")
    if not isinstance(rows, list):
        return {"ok": False, "error": "list_workflows: no output list"}
    return {"ok": True, "ids": [str(w["WorkflowUUID"]) for w in rows if isinstance(w, dict) and w.get("WorkflowUUID")]}


@relay_step("relay.move_workflow")
async def move_workflow(
    org: str, app: str, peer: str, executor_id: str, workflow_id: str, target: str, timeout: float
) -> Result:
    """Cancel a PENDING workflow, then rewind it onto ``target`` from its first unfinished step."""
    steps = await _ask(
        org, app, peer, Request(MessageType.LIST_STEPS, {"workflow_id": workflow_id, "load_output": False}), timeout
    )
    if not steps["ok"]:
        return steps
    start_step = first_unfinished_step(steps["body"].get("output") or [])
    cancel = await _ask(org, app, peer, Request(MessageType.CANCEL, {"workflow_id": workflow_id}), timeout)
    if not cancel["ok"]:
        return cancel
    body = {"workflow_id": workflow_id, "start_step": start_step, "application_version": target}
    rewind = await _ask(org, app, peer, Request(MessageType.REWIND_WORKFLOW, {"body": body}), timeout)
    if not rewind["ok"]:
        return rewind
    if rewind["body"].get("success") is not True:
        return {"ok": False, "error": f"rewind_workflow {workflow_id}: success: false"}
    store = services().runtime.recoveries
    entry = AuditEntry(
        "recovery.workflow_moved",
        "relay",
        executor_id,
        peer,
        {"workflowId": workflow_id, "toVersion": target, "fromStep": start_step},
        _dedupe(),
    )
    await services().call(store.audit(org, app, entry))
    return {"ok": True}


def first_unfinished_step(steps: list[Any]) -> int:
    """The first step without a recorded completion; after the last step if all completed."""
    done: list[int] = []
    unfinished: list[int] = []
    for s in steps:
        if not isinstance(s, dict) or not isinstance(s.get("function_id"), int):
            continue
        finished = s.get("completed_at_epoch_ms") is not None or s.get("output") is not None or s.get("error")
        (done if finished else unfinished).append(int(s["function_id"]))
    if unfinished:
        return max(1, min(unfinished))
    return max(done, default=0) + 1


@relay_step("relay.verify")
async def verify(org: str, app: str, peer: str, executor_id: str, version: str, timeout: float) -> Result:
    answer = await _ask(org, app, peer, exist_pending_workflows(executor_id, version), timeout)
    if not answer["ok"]:
        return answer
    if answer["body"].get("exist") is not False:
        return {"ok": False, "error": "verification failed: workflows of the dead executor are still PENDING"}
    return {"ok": True}


@relay_step("relay.fail_attempt")
async def fail_attempt(
    rid: str, org: str, app: str, executor_id: str, epoch: int, attempt: int, peer: str, error: str
) -> None:
    store = services().runtime.recoveries
    await services().call(
        store.fail_attempt(rid, ExecutorKey(org, app, executor_id), epoch, attempt, peer, error, _dedupe())
    )


@relay_step("relay.succeed")
async def succeed(rid: str, org: str, app: str, executor_id: str, epoch: int, attempt: int, peer: str) -> bool:
    store = services().runtime.recoveries
    return await services().call(
        store.succeed(rid, ExecutorKey(org, app, executor_id), epoch, attempt, peer, _dedupe())
    )


@relay_step("relay.abandon")
async def abandon(rid: str, org: str, app: str, executor_id: str, reason: str) -> None:
    store = services().runtime.recoveries
    await services().call(store.abandon(rid, ExecutorKey(org, app, executor_id), reason, _dedupe()))


async def _move_all(
    org: str,
    app: str,
    peer: str,
    executor_id: str,
    version: str,
    target: str,
    timeout: float,
    known: list[str],
    moved: list[str],
) -> Result:
    """Move every PENDING workflow of the dead executor; ``known`` remembers ids across attempts,
    since a workflow cancelled by a failed attempt is no longer PENDING to list."""
    listed = await list_pending(org, app, peer, executor_id, version, timeout)
    if not listed["ok"]:
        return listed
    known.extend(w for w in listed["ids"] if w not in known)
    for workflow_id in known:
        if workflow_id in moved:
            continue
        result = await move_workflow(org, app, peer, executor_id, workflow_id, target, timeout)
        if not result["ok"]:
            return result
        moved.append(workflow_id)
    return {"ok": True}


@DBOS.workflow(name="relay.recover")
async def recover(org: str, app: str, executor_id: str, epoch: int, trigger: str) -> str:
    rid = DBOS.workflow_id
    assert rid is not None
    version = await open_recovery(rid, org, app, executor_id, epoch, trigger)
    if version is None:
        return "gone"
    attempt, delay = 0, 0.0
    tried: list[str] = []
    blocked: str | None = None
    last_failed: str | None = None
    operator_allows_latest = False
    known: list[str] = []
    moved: list[str] = []
    while True:
        facts = await gather(org, app, executor_id, epoch, version, operator_allows_latest)
        if not facts["dead"]:
            await abandon(rid, org, app, executor_id, "the executor reconnected or its record is gone")
            return "abandoned"
        choice = choose_peer(
            executor_id,
            version,
            [Peer(p[0], p[1]) for p in facts["peers"]],
            tried=frozenset(tried),
            allow_latest=facts["allow_latest"],
            latest_version=facts["latest"],
        )
        if choice.blocked is not None:
            if choice.blocked.value != blocked:
                blocked = choice.blocked.value
                await mark_blocked(rid, org, app, executor_id, epoch, blocked)
                # A peer that connected after the facts were gathered but before the
                # block was recorded sent no wake-up: look once more before waiting.
                continue
            message = await DBOS.recv_async(WAKE_TOPIC, timeout_seconds=BLOCKED_RECHECK_SECS)
            if isinstance(message, dict) and message.get("toLatestVersion"):
                operator_allows_latest = True
            continue
        blocked = None
        if choice.peer is None or choice.mode is None:  # every candidate failed once: start the round again
            tried = []
            continue
        attempt += 1
        peer = choice.peer.executor_id
        if not await dispatch(rid, org, app, executor_id, epoch, attempt, peer, choice.mode.value, last_failed, delay):
            await abandon(rid, org, app, executor_id, "the executor reconnected during recovery")
            return "abandoned"
        timeout = facts["ack_timeout"]
        if choice.mode is Mode.SAME_VERSION:
            result = await recover_same_version(org, app, peer, executor_id, version, timeout)
        else:
            result = await _move_all(
                org, app, peer, executor_id, version, choice.peer.application_version, timeout, known, moved
            )
        if result["ok"]:
            result = await verify(org, app, peer, executor_id, version, timeout)
        if result["ok"]:
            await succeed(rid, org, app, executor_id, epoch, attempt, peer)
            return "succeeded"
        await fail_attempt(rid, org, app, executor_id, epoch, attempt, peer, str(result["error"]))
        tried.append(peer)
        last_failed = peer
        delay = backoff(attempt, facts["backoff_initial"], facts["backoff_max"])
        await DBOS.sleep_async(delay)
