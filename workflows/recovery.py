"""Recovery of a dead executor's workflows: one durable workflow per death.

The loop: gather the facts (a step), let the pure failover policy
(:class:`relay.core.failover.FailoverPolicy`) decide, and carry the decision
out: wait durably for a peer or an operator (``DBOS.recv``, woken by the hub
or the API), or dispatch to the chosen peer. A peer on the dead executor's
version gets the SDK's ``recovery`` frame; a peer on the latest version (only
where allowed) gets each PENDING workflow cancelled and rewound onto its
version. Success is verified with ``exist_pending_workflows`` before the
record is deleted, asked of another executor of the app than the one that
recovered whenever one answers (:func:`relay.core.peers.verifiers`); a
failure moves on to the next candidate after the policy's backoff
(``DBOS.recv``, which an operator's ``recover`` ends at once; ``DBOS.sleep`` in
a run begun without ``nudgeable_backoff``). What an executor answers can fail an attempt, never the
workflow: a step that talks to executors turns any exception but database
trouble into a failed outcome with its reason (:func:`relay_step`'s
``on_error``).

A run works only during a turn (:mod:`workflows.ordering`): in a group failure at
most 40 runs work at once on an instance, the earliest deaths first, and a run
gives its turn back while it waits (``DBOS.recv``, ``DBOS.sleep``).

A death may take several runs of this workflow (:mod:`relay.core.ids`): the
repair sweep or an operator starts a new one when a run ended without
finishing, and the new run's first step marks the earlier ones superseded.

Every step is safe to run twice (a crash between a step's action and its
checkpoint repeats it): recovery frames are idempotent, database changes are
guarded events of the lifecycle table, audit entries carry a dedupe key.

Two shapes of steps. A run this release starts takes the merged steps, which
cost DBOS two checkpoints fewer per step saved (a group failure's time goes
mostly to DBOS's checkpoints): ``relay.open_and_gather`` (the record, then the
first facts), ``relay.dispatch_and_recover`` (the attempt recorded, then the
recovery frame) and ``relay.verify_and_succeed`` (the verification, then the
record deleted). A run Relay 0.2.0 started keeps that release's steps
(``relay.open_recovery``, ``relay.dispatch``, ``relay.recover_same_version``,
``relay.verify``, ``relay.succeed``): which shape a run has is read, before
its first step, from the first step DBOS recorded for it (none: a new run).
Merging is safe because each part is: a re-run of a merged step repeats an
idempotent write and an idempotent request.

The backoff's wait: a run started by an earlier release (or by this code before
``nudgeable_backoff``) recorded its backoffs as ``DBOS.sleep``, which a replay
cannot read back as a ``DBOS.recv`` (two recorded operations, not one); so only
a run started with ``nudgeable_backoff=True``, as every start now passes it,
waits in ``DBOS.recv``, and earlier runs keep sleeping.

Upgrades: the workflow's name is Relay 0.2.0's, and so are, for the runs it
started, its steps' names, their order and their outputs' shapes, so a
recovery that release started finishes under this one (a key added to an
output since is optional and read with ``.get``: a 0.2.0 checkpoint lacks it).
Step outputs are checkpointed with pickle, so they are plain dicts (typed below
as TypedDicts) rather than classes whose module path would be baked into old
checkpoints.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import NotRequired, TypedDict, TypeVar

from dbos import DBOS

from relay.core.failover import Abandon, Block, Dispatch, Facts, FailoverPolicy, NewRound, NothingPending
from relay.core.ids import ExecutorKey, RecoveryRef
from relay.core.peers import (
    AppVersion,
    BlockedReason,
    Mode,
    Peer,
    blocked_note,
    candidates,
    choose_peer,
    latest_version,
    newest_version,
    of_language,
    order_peers,
    verifiers,
)
from relay.errors import DatabaseError, ExecutorRequestError
from relay.store.audit import AuditEntry
from relay.store.recoveries import BlockedStatus
from relay_protocol import (
    CancelReply,
    CancelRequest,
    ExistPendingWorkflowsReply,
    ExistPendingWorkflowsRequest,
    ListApplicationVersionsReply,
    ListApplicationVersionsRequest,
    ListStepsReply,
    ListStepsRequest,
    ListWorkflowsBody,
    ListWorkflowsReply,
    ListWorkflowsRequest,
    RecoveryReply,
    RecoveryRequest,
    Reply,
    Request,
    RewindWorkflowBody,
    RewindWorkflowReply,
    RewindWorkflowRequest,
    WorkflowSteps,
    clean_text,
)
from relay_protocol.limits import has_unstorable
from workflows.ordering import Turn
from workflows.services import MAX_RECOVERY_ATTEMPTS, dedupe_key, relay_step, services, until_done

log = logging.getLogger("relay.recovery")

WAKE_TOPIC = "wake"
# A blocked recovery is woken by the hub (a peer that may unblock it connected) or the API
# (settings, an operator); this fallback re-check covers what sends no wake-up: a wake-up lost to a
# crash of the instance that was to send it, the dead executor's PENDING workflows ended by other
# means (a peer then says nothing is pending, and the recovery succeeds), peers that could not list
# the app's versions before. Each re-check records three operations (the ``DBOS.recv``, its deadline,
# the ``relay.gather``) that stay until the run ends, and a restart of Relay replays them all (about
# 1.3 ms of CPU each: bench/blocked_replay.py). So it backs off: 30 s, doubling at each re-check
# that finds the same block, up to 10 minutes for about a day (BLOCKED_RECHECKS_DENSE re-checks,
# ~440 operations); then doubling again, up to a day: a month's wait records ~550 operations,
# not ~13,000, and each further day three. The deadline of a recorded wait is replayed as recorded,
# so a run begun under the earlier schedule takes this one from its next wait on.
BLOCKED_RECHECK_SECS = 30.0
BLOCKED_RECHECK_MAX_SECS = 600.0
BLOCKED_RECHECK_SPARSE_MAX_SECS = 86_400.0
BLOCKED_DENSE_SECS = 86_400.0  # how long the 10-minute re-checks go on


def _dense_rechecks() -> int:
    """How many re-checks the first :data:`BLOCKED_DENSE_SECS` of a block take, none woken early."""
    waited, rechecks = 0.0, 0
    while waited < BLOCKED_DENSE_SECS:
        waited += min(BLOCKED_RECHECK_MAX_SECS, BLOCKED_RECHECK_SECS * 2 ** min(rechecks, 16))
        rechecks += 1
    return rechecks


BLOCKED_RECHECKS_DENSE = _dense_rechecks()


def blocked_recheck_secs(rechecks: int) -> float:
    """The wait before the next re-check of a blocked recovery, after ``rechecks`` waits that ran
    their whole course with no other outcome than the same block (a wait a wake-up ended early does
    not count: the dense re-checks last at least a day of the block's time)."""
    if rechecks < BLOCKED_RECHECKS_DENSE:
        return float(min(BLOCKED_RECHECK_MAX_SECS, BLOCKED_RECHECK_SECS * 2 ** min(rechecks, 16)))
    sparse = rechecks - BLOCKED_RECHECKS_DENSE + 1
    return float(min(BLOCKED_RECHECK_SPARSE_MAX_SECS, BLOCKED_RECHECK_MAX_SECS * 2 ** min(sparse, 16)))


# Peer choice and verification may use a list of the app's healthy executors read this long ago
# (or one being read): a group of deaths then shares its reads. Recording a block reads afresh,
# and so does the round after a wait: it was woken because the peers changed.
PEERS_MAX_AGE_SECS = 0.5
# The peers' errors that a recovery's note of an unknown latest version names (the rest are counted).
LATEST_ERRORS_SHOWN = 3


class FactsRecord(TypedDict):
    """The checkpoint of ``relay.gather``."""

    dead: bool
    peers: list[list[str]]  # [executor id, application version]: the round's candidates (all healthy in 0.2.0)
    allow_latest: bool
    latest: str | None  # the newest version the system database lists (0.2.0: the newest a peer ran)
    latest_unknown: NotRequired[str]  # why ``latest`` is None though it was needed (not in 0.2.0's)
    # No peer may be asked to recover, and this one found no PENDING workflow of the dead executor
    # (not in 0.2.0's, nor in any checkpoint of a round that had an eligible peer).
    nothing_pending_by: NotRequired[str]
    # The dead executor's language, and those of the app's healthy executors left out of ``peers``
    # as another language's (absent when not known, or none was; and in earlier releases').
    language: NotRequired[str]
    other_languages: NotRequired[list[str]]
    ack_timeout: float
    backoff_initial: float
    backoff_max: float


class Outcome(TypedDict):
    """The checkpoint of a step that asks a peer something: ``ok``, or the reason it is not."""

    ok: bool
    error: NotRequired[str]
    ids: NotRequired[list[str]]  # relay.list_pending: the PENDING workflows found
    verifier: NotRequired[str]  # relay.verify: the executor whose answer passed (not in 0.2.0's)
    gone: NotRequired[bool]  # relay.dispatch_and_recover: not dispatched, the executor is no longer dead


class Opened(TypedDict):
    """The checkpoint of ``relay.open_and_gather``: the dead executor's version (None: it is
    gone), and the first round's facts."""

    version: str | None
    facts: NotRequired[FactsRecord]


def facts_of(record: FactsRecord) -> Facts:
    return Facts(
        dead=record["dead"],
        peers=tuple(Peer(p[0], p[1]) for p in record["peers"]),
        allow_latest=record["allow_latest"],
        latest=record["latest"],
        ack_timeout=record["ack_timeout"],
        backoff_initial=record["backoff_initial"],
        backoff_max=record["backoff_max"],
        nothing_pending_by=record.get("nothing_pending_by"),
        language=record.get("language"),
        other_languages=tuple(record.get("other_languages", ())),
    )


R = TypeVar("R", bound=Reply)


def _failed(error: str) -> Outcome:
    return {"ok": False, "error": clean_text(error)}


def _step_failed(exc: Exception) -> Outcome:
    """A step that asks an executor raised: the attempt fails with the reason."""
    return _failed(f"{type(exc).__name__}: {exc}")


async def _ask(
    ref: RecoveryRef, peer: str, request: Request, expected: type[R], timeout: float, *, await_connection: bool = True
) -> R | str:
    """The peer's reply, through whichever instance holds its socket; the reason as a string if there
    is none, or if it carries an error. With ``await_connection``, a peer not connected anywhere right
    now (reconnecting after a restart of an instance) is waited for, within ``timeout``."""
    key = ExecutorKey(ref.key.org, ref.key.app, peer)
    try:
        reply = await services().ask(key, request, expected, timeout, await_connection=await_connection)
    except ExecutorRequestError as exc:
        return str(exc)
    if reply.error_message:
        return f"{request.type.value}: {reply.error_message}"
    return reply


@relay_step("relay.open_recovery")
async def open_recovery(ref: RecoveryRef, trigger: str) -> str | None:
    return await services().recoveries.open(ref, trigger, dedupe_key())


@relay_step("relay.open_and_gather")
async def open_and_gather(ref: RecoveryRef, trigger: str) -> Opened:
    version = await services().recoveries.open(ref, trigger, dedupe_key())
    if version is None:
        return {"version": None}
    return {"version": version, "facts": await _gather(ref, version, False)}


@relay_step("relay.gather")
async def gather(
    ref: RecoveryRef, version: str, operator_allows_latest: bool, peers_max_age: float = PEERS_MAX_AGE_SECS
) -> FactsRecord:
    return await _gather(ref, version, operator_allows_latest, peers_max_age)


async def _gather(
    ref: RecoveryRef, version: str, operator_allows_latest: bool, peers_max_age: float = PEERS_MAX_AGE_SECS
) -> FactsRecord:
    svc = services()
    dead, language = await svc.executors.dead_and_language(ref.key, ref.epoch)
    everyone = await svc.executors.healthy_peers(ref.key.org, ref.key.app, peers_max_age)
    # Only peers of its language may recover its workflows (of_language): the others would take them
    # and never run them.
    healthy = of_language(everyone, language)
    app = await svc.apps.settings_of(ref.key.org, ref.key.app)
    allow_latest = operator_allows_latest or bool(app and app.recover_to_latest_version)
    record: FactsRecord = {
        "dead": dead,
        "peers": [[p.executor_id, p.application_version] for p in candidates(ref.key.executor_id, healthy)],
        "allow_latest": allow_latest,
        "latest": None,
        "ack_timeout": svc.liveness.recovery_ack_timeout_secs,
        "backoff_initial": svc.liveness.failover_backoff_initial_secs,
        "backoff_max": svc.liveness.failover_backoff_max_secs,
    }
    if language:
        record["language"] = language
    if len(healthy) < len(everyone):
        fit = {p.executor_id for p in healthy}
        record["other_languages"] = sorted({str(p.language) for p in everyone if p.executor_id not in fit})
    if allow_latest:
        others = [p for p in healthy if p.executor_id != ref.key.executor_id]
        if others and not any(p.application_version == version for p in others):
            latest, unknown = await _latest_version(ref, version, others, svc.liveness.recovery_ack_timeout_secs)
            record["latest"] = latest
            if unknown is not None:
                record["latest_unknown"] = unknown
    peers = [Peer(p[0], p[1]) for p in record["peers"]]
    # Any executor of the app can say whether the dead one left anything PENDING (it reads the
    # system database), one of another language too.
    askable = peers or candidates(ref.key.executor_id, everyone)
    if askable:
        choice = choose_peer(
            ref.key.executor_id, version, peers, allow_latest=allow_latest, latest_version=record["latest"],
            other_languages="other_languages" in record,
        )  # fmt: skip
        if choice.blocked is not None:  # it would wait: is there anything to wait for?
            by = await _nothing_pending(ref, askable, svc.liveness.recovery_ack_timeout_secs)
            if by is not None:
                record["nothing_pending_by"] = by
    return record


# How many peers a blocked recovery asks whether the dead executor left anything PENDING, and how
# long it waits for them at most (the recovery holds its turn meanwhile: a deploy that retires many
# executors at once checks them all, and a peer that hangs must not hold each check for its
# ``recoveryAckTimeoutSecs``).
NOTHING_PENDING_ASKED = 3
NOTHING_PENDING_WAIT_SECS = 5.0


async def _nothing_pending(ref: RecoveryRef, peers: list[Peer], timeout: float) -> str | None:
    """A peer among a few ``peers`` (any version: they share the app's system database) that lists
    no PENDING workflow of the dead executor, of any version; None if one lists some, or none answers.

    Asked when no peer may recover its work (no peer on its version, and moving onto the latest is
    not allowed or not possible): an executor that left nothing then has nothing to wait for. Any
    workflow listed counts as pending, whatever its fields say: an SDK that ignored a filter makes
    the recovery wait, as before, never lose work.

    The peers are asked at once, each within ``min(timeout, NOTHING_PENDING_WAIT_SECS)``; the first
    to answer decides (they read the same database), and the others are no longer waited for. A
    peer that errs or does not answer in time counts for nothing."""
    body = ListWorkflowsBody(
        executor_id=ref.key.executor_id, status="PENDING", limit=1, load_input=False, load_output=False
    )
    wait = min(timeout, NOTHING_PENDING_WAIT_SECS)

    async def listed(peer: str) -> tuple[str, bool] | None:
        """(peer, whether it listed any workflow); None if it gave no usable answer."""
        try:
            reply = await _ask(
                ref, peer, ListWorkflowsRequest(body=body), ListWorkflowsReply, wait, await_connection=False
            )
        except DatabaseError:
            raise
        except Exception as exc:  # one peer's odd answer costs that peer, not the recovery
            log.info("recovery %s: %s could not list pending workflows: %s: %s", ref.rid, peer, type(exc).__name__, exc)
            return None
        if isinstance(reply, str):
            log.info("recovery %s: %s could not list pending workflows: %s", ref.rid, peer, reply)
            return None
        return peer, bool(reply.output)

    asked = order_peers(ref.key.executor_id, peers)[:NOTHING_PENDING_ASKED]
    tasks = [asyncio.ensure_future(listed(p.executor_id)) for p in asked]
    try:
        # The bound again around them all: a reply routed through another instance is bounded by
        # the request's own timeout, and this keeps the whole check within it whatever happens.
        for done in asyncio.as_completed(tasks, timeout=wait + 1.0):
            answer = await done
            if answer is not None:
                peer, any_listed = answer
                return None if any_listed else peer
    except TimeoutError:
        log.info("recovery %s: no peer said within %gs whether anything is pending", ref.rid, wait)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return None


async def _latest_version(
    ref: RecoveryRef, version: str, peers: list[Peer], timeout: float
) -> tuple[str | None, str | None]:
    """The version to move the dead executor's work onto (:func:`relay.core.peers.latest_version`),
    read from the first peer that lists the app's versions (they share its system database); or
    None and the reason."""
    errors: list[str] = []
    for peer in (p.executor_id for p in peers):
        try:
            reply = await _ask(ref, peer, ListApplicationVersionsRequest(), ListApplicationVersionsReply, timeout)
            if isinstance(reply, str):
                log.info("recovery %s: no versions from %s: %s", ref.rid, peer, reply)
                errors.append(f"{peer}: {reply}")
                continue
            listed = [AppVersion(v.version_name, v.version_timestamp, v.created_at) for v in reply.output]
        except DatabaseError:
            raise
        except Exception as exc:  # one peer's odd answer costs that peer, not the recovery
            log.warning("recovery %s: reading %s's versions failed: %s: %s", ref.rid, peer, type(exc).__name__, exc)
            errors.append(f"{peer}: {type(exc).__name__}: {exc}")
            continue
        if not listed:
            errors.append(f"{peer}: list_application_versions listed none")
            continue
        latest = latest_version(listed, version)
        if latest is None:
            newest = newest_version(listed).name
            return None, f"the version listed as latest, {newest}, is older than the executor's own, {version}"
        return latest, None
    more = f"; {len(errors) - LATEST_ERRORS_SHOWN} more" if len(errors) > LATEST_ERRORS_SHOWN else ""
    shown = "; ".join(errors[:LATEST_ERRORS_SHOWN]) + more
    return None, clean_text(f"no peer could list the application versions ({shown})", 1000)


@relay_step("relay.mark_blocked")
async def mark_blocked(ref: RecoveryRef, reason: BlockedReason, gathered: Facts, note: str | None = None) -> bool:
    """Record that the recovery waits (``note``: why, in words, as the recovery's error and in its
    audit entry); True if the peers changed since the facts were gathered.

    A peer that connected after the facts were gathered but before the block
    was recorded sent no wake-up (nothing was waiting yet), so the recovery
    looks again before it waits. (Relay 0.2.0's checkpoints of this step hold
    None: such a recovery simply waits, and the periodic re-check covers it.)
    """
    svc = services()
    waits_for_peer = reason in (BlockedReason.NO_HEALTHY_PEER, BlockedReason.NO_PEER_OF_ITS_LANGUAGE)
    status: BlockedStatus = "waiting_for_peer" if waits_for_peer else "awaiting_operator"
    svc.note_blocked(ref.key.org, ref.key.app)
    await svc.recoveries.set_blocked(ref, reason.value, status, dedupe_key(), note)
    healthy = of_language(await svc.executors.healthy_peers(ref.key.org, ref.key.app), gathered.language)
    return set(candidates(ref.key.executor_id, healthy)) != set(gathered.peers)


@relay_step("relay.dispatch")
async def dispatch(ref: RecoveryRef, plan: Dispatch) -> bool:
    return await services().recoveries.dispatch(ref, plan, dedupe_key())


@relay_step("relay.dispatch_and_recover", on_error=_step_failed)
async def dispatch_and_recover(ref: RecoveryRef, plan: Dispatch, timeout: float) -> Outcome:
    if not await services().recoveries.dispatch(ref, plan, dedupe_key()):
        return {"ok": False, "error": "the executor is no longer dead", "gone": True}
    return await _recover(ref, plan.peer.executor_id, timeout)


@relay_step("relay.recover_same_version", on_error=_step_failed)
async def recover_same_version(ref: RecoveryRef, peer: str, version: str, timeout: float) -> Outcome:
    return await _recover(ref, peer, timeout)


async def _recover(ref: RecoveryRef, peer: str, timeout: float) -> Outcome:
    """The peer recovers the dead executor's workflows (one recovery frame, perhaps shared)."""
    reply = await _ask(ref, peer, RecoveryRequest(executor_ids=[ref.key.executor_id]), RecoveryReply, timeout)
    if isinstance(reply, str):
        return _failed(reply)
    await services().recoveries.mark_replied(ref)  # for the pipeline's figures
    if not reply.success:
        return _failed("recovery: the peer answered success: false")
    return {"ok": True}


@relay_step("relay.list_pending", on_error=_step_failed)
async def list_pending(ref: RecoveryRef, peer: str, version: str, timeout: float) -> Outcome:
    body = ListWorkflowsBody(
        executor_id=ref.key.executor_id,
        status="PENDING",
        application_version=version,
        load_input=False,
        load_output=False,
    )
    reply = await _ask(ref, peer, ListWorkflowsRequest(body=body), ListWorkflowsReply, timeout)
    if isinstance(reply, str):
        return _failed(reply)
    ids = [w.workflow_id for w in reply.output]
    # Ids are remembered across attempts (_Moves): one that no request can carry would
    # fail every later attempt too, so the whole listing is refused.
    if any(not w or has_unstorable(w) for w in ids):
        return _failed(f"list_workflows: {peer} listed a workflow id that is empty or holds NUL")
    return {"ok": True, "ids": ids}


@relay_step("relay.move_workflow", on_error=_step_failed)
async def move_workflow(ref: RecoveryRef, peer: str, workflow_id: str, target: str, timeout: float) -> Outcome:
    """Cancel a PENDING workflow, then rewind it onto ``target`` from its first unfinished step."""
    steps = await _ask(ref, peer, ListStepsRequest(workflow_id=workflow_id, load_output=False), ListStepsReply, timeout)
    if isinstance(steps, str):
        return _failed(steps)
    start_step = first_unfinished_step(steps.output or [])
    cancel = await _ask(ref, peer, CancelRequest(workflow_id=workflow_id), CancelReply, timeout)
    if isinstance(cancel, str):
        return _failed(cancel)
    body = RewindWorkflowBody(workflow_id=workflow_id, start_step=start_step, application_version=target)
    rewind = await _ask(ref, peer, RewindWorkflowRequest(body=body), RewindWorkflowReply, timeout)
    if isinstance(rewind, str):
        return _failed(rewind)
    if not rewind.success:
        return _failed(f"rewind_workflow {workflow_id}: success: false")
    detail = {"workflowId": workflow_id, "toVersion": target, "fromStep": start_step}
    entry = AuditEntry("recovery.workflow_moved", "relay", ref.key.executor_id, peer, detail, dedupe_key())
    await services().audit.record(ref.key.org, ref.key.app, entry)
    return {"ok": True}


def first_unfinished_step(steps: list[WorkflowSteps]) -> int:
    """The first step without a recorded completion; after the last step if all completed.

    The TypeScript SDK numbers steps from 0, the Python SDK from 1: an unfinished step 0 (a
    TypeScript workflow's first) is where the rewind starts, since the rewind copies every step
    before it as done. With no step recorded, 1: nothing is copied in either SDK.
    """
    done: list[int] = []
    unfinished: list[int] = []
    for s in steps:
        finished = s.completed_at_epoch_ms is not None or s.output is not None or bool(s.error)
        (done if finished else unfinished).append(s.function_id)
    if unfinished:
        return min(unfinished)
    return max(done, default=0) + 1


@relay_step("relay.verify_and_succeed", on_error=_step_failed)
async def verify_and_succeed(
    ref: RecoveryRef, plan: Dispatch, version: str, timeout: float, first: tuple[Peer, ...] = ()
) -> Outcome:
    """:func:`verify` (asking the round's candidates ``first``), then, if it passed, :func:`succeed`
    (the record deleted)."""
    peer = plan.peer.executor_id
    replied = plan.mode is not Mode.SAME_VERSION
    result = await _verify(ref, peer, version, timeout, replied=replied, record=False, first=first)
    if result["ok"]:  # one write: the verification recorded with the success
        verifier = result.get("verifier")
        await services().recoveries.succeed(ref, plan.attempt, peer, dedupe_key(), verifier, verified_now=True)
    return result


@relay_step("relay.verify", on_error=_step_failed)
async def verify(ref: RecoveryRef, peer: str, version: str, timeout: float) -> Outcome:
    return await _verify(ref, peer, version, timeout)


async def _verify(
    ref: RecoveryRef,
    peer: str,
    version: str,
    timeout: float,
    *,
    replied: bool = True,
    record: bool = True,
    first: tuple[Peer, ...] = (),
) -> Outcome:
    """Nothing of the dead executor's left PENDING after ``peer``'s recovery (contract rule 4)?

    Asked of another healthy executor of the app first (a peer that lies
    about its recovery cannot vouch for itself while another one answers);
    the first usable answer decides. ``peer`` itself is asked only when no
    other executor answers. ``replied``: record the moment of the peer's reply here (not
    after a recovery frame, whose reply recorded it). ``record``: record the moment it passed
    (else the caller records it with the success). ``first``: the round's candidates, asked
    before the rest of the app (:func:`relay.core.peers.verifiers`).
    """
    svc = services()
    # The peer's work is done when its verification begins: on the latest-version path
    # (no recovery frame) that is the moment of its last reply.
    if replied:
        await svc.recoveries.mark_replied(ref)
    healthy = await svc.executors.healthy_peers(ref.key.org, ref.key.app, PEERS_MAX_AGE_SECS)
    query = ExistPendingWorkflowsRequest(executor_id=ref.key.executor_id, application_version=version)
    unanswered: list[str] = []
    for verifier in verifiers(ref.key.executor_id, version, peer, healthy, first):
        # Another executor that has just gone is not waited for: the next one is asked.
        reply = await _ask(ref, verifier, query, ExistPendingWorkflowsReply, timeout, await_connection=verifier == peer)
        if isinstance(reply, str):
            unanswered.append(f"{verifier}: {reply}")
            continue
        if reply.exist:
            return _failed(f"verification failed: {verifier} sees workflows of the dead executor still PENDING")
        if record:
            await svc.recoveries.mark_verified(ref)
        return {"ok": True, "verifier": verifier}
    return _failed("verification failed: no executor answered (" + "; ".join(unanswered) + ")")


@relay_step("relay.fail_attempt")
async def fail_attempt(ref: RecoveryRef, attempt: int, peer: str, error: str) -> float:
    """Record the failed attempt; returns when (``time.time()``), from which its backoff counts
    (a checkpoint of a release before ``nudgeable_backoff`` holds None: such a run sleeps)."""
    await services().recoveries.fail_attempt(ref, attempt, peer, error, dedupe_key())
    return time.time()


@relay_step("relay.succeed")
async def succeed(ref: RecoveryRef, attempt: int, peer: str, verifier: str | None = None) -> bool:
    return await services().recoveries.succeed(ref, attempt, peer, dedupe_key(), verifier)


@relay_step("relay.succeed_nothing_pending")
async def succeed_nothing_pending(ref: RecoveryRef, verified_by: str) -> bool:
    """Nothing to recover (``verified_by`` listed no PENDING workflow of the dead executor): the
    recovery succeeds and the record is deleted; False if the executor is no longer dead."""
    return await services().recoveries.succeed_idle(ref, verified_by, dedupe_key())


@relay_step("relay.abandon")
async def abandon(ref: RecoveryRef) -> None:
    """The executor is no longer dead: the run ends, its error saying whether the executor is back
    or its record is gone, as the record is when the run ends."""
    await services().recoveries.abandon(ref, dedupe_key())


class _Moves:
    """The latest-version path's memory across attempts: a workflow cancelled by a failed
    attempt is no longer PENDING to list, but must still be moved."""

    def __init__(self) -> None:
        self.known: list[str] = []
        self.moved: list[str] = []

    async def move_all(self, ref: RecoveryRef, plan: Dispatch, version: str, timeout: float) -> Outcome:
        peer, target = plan.peer.executor_id, plan.peer.application_version
        listed = await list_pending(ref, peer, version, timeout)
        if not listed["ok"]:
            return listed
        self.known.extend(w for w in listed.get("ids", []) if w not in self.known)
        for workflow_id in self.known:
            if workflow_id in self.moved:
                continue
            result = await move_workflow(ref, peer, workflow_id, target, timeout)
            if not result["ok"]:
                return result
            self.moved.append(workflow_id)
        return {"ok": True}


async def _attempt(ref: RecoveryRef, plan: Dispatch, version: str, timeout: float, moves: _Moves) -> Outcome:
    """Carry out one dispatched attempt, then verify it (Relay 0.2.0's steps)."""
    peer = plan.peer.executor_id
    if plan.mode is Mode.SAME_VERSION:
        result = await recover_same_version(ref, peer, version, timeout)
    else:
        result = await moves.move_all(ref, plan, version, timeout)
    if result["ok"]:
        result = await verify(ref, peer, version, timeout)
    return result


# The first step of a run that Relay 0.2.0 started (or one of this release's before the merged steps).
FIRST_STEP_OF_0_2_0 = "relay.open_recovery"


async def _first_step(rid: str) -> str | None:
    """:meth:`RecoveryStore.first_step`, read until the database answers. It runs before the first
    step, outside any: a database too busy to lend a connection (a group failure of thousands)
    must not end the run in ERROR, which only the repair sweep would notice."""
    svc = services()

    def read() -> Awaitable[str | None]:
        return svc.on_loop(svc.recoveries.first_step(rid))  # a new read at each try

    return await until_done(read, f"recovery {rid}: reading its first step", DatabaseError, log)


async def _wait_out_backoff(policy: FailoverPolicy, until: float) -> None:
    """The backoff after a failed attempt, until ``until`` (``time.time()``), ended at once by an
    operator's nudge, which is read as a blocked wait reads it (:meth:`FailoverPolicy.woken`).

    Other wake-ups found here were sent while the run was blocked (peers and settings wake only
    a blocked run) and were left over: they are consumed and the wait goes on. Whether to wait
    again depends only on what each ``DBOS.recv`` returned, never on the clock, so a replay makes
    the same calls; the clock only sets each one's timeout (the first one's is recorded by DBOS).
    """
    while True:
        message = await DBOS.recv_async(WAKE_TOPIC, timeout_seconds=max(0.0, until - time.time()))
        if message is None or policy.woken(message):
            return


@DBOS.workflow(name="relay.recover", max_recovery_attempts=MAX_RECOVERY_ATTEMPTS)
async def recover(
    org: str, app: str, executor_id: str, epoch: int, trigger: str, nudgeable_backoff: bool = False
) -> str:
    """``nudgeable_backoff``: wait out a backoff in ``DBOS.recv`` (an operator's nudge ends it); every
    start passes True, and a run begun without it (an earlier release's) keeps its ``DBOS.sleep``."""
    turn = Turn()
    await turn.take()
    try:
        return await _run(org, app, executor_id, epoch, trigger, turn, nudgeable_backoff)
    finally:
        turn.give_back()


async def _run(
    org: str, app: str, executor_id: str, epoch: int, trigger: str, turn: Turn, nudgeable_backoff: bool
) -> str:
    rid = DBOS.workflow_id
    assert rid is not None
    ref = RecoveryRef(ExecutorKey(org, app, executor_id), epoch, rid)
    merged = await _first_step(rid) != FIRST_STEP_OF_0_2_0
    first: FactsRecord | None = None
    if merged:
        opened = await open_and_gather(ref, trigger)
        version, first = opened["version"], opened.get("facts")
    else:
        version = await open_recovery(ref, trigger)
    if version is None:
        return "gone"
    policy = FailoverPolicy(executor_id, version)
    moves = _Moves()
    waited = False
    rechecks = 0  # waits of the current block (each doubles the next re-check's wait)
    noted: str | None = None  # the block's note last written
    while True:
        if first is not None:
            record = first
        else:
            record = await gather(ref, version, policy.operator_allows_latest, 0.0 if waited else PEERS_MAX_AGE_SECS)
        first, waited = None, False
        facts = facts_of(record)
        decision = policy.decide(facts)
        if isinstance(decision, Abandon):
            await abandon(ref)
            return "abandoned"
        if isinstance(decision, NothingPending):
            if await succeed_nothing_pending(ref, decision.verified_by):
                return "succeeded"
            await abandon(ref)
            return "abandoned"
        if isinstance(decision, Block):
            languages = (str(facts.language), *facts.other_languages)
            note = blocked_note(decision.reason, facts.peers, facts.latest, record.get("latest_unknown"), languages)
            if decision.record:
                noted, rechecks = note, 0
                if await mark_blocked(ref, decision.reason, facts, note):
                    continue
            elif note != noted:
                # The same reason with other peers: the recovery's error says why anew. Not a step
                # (a recovery an earlier release began keeps its steps' order when it resumes here);
                # an idempotent write, run again on a replay.
                noted = note
                await services().recoveries.renote_blocked(ref, note)
            turn.give_back()
            message = await DBOS.recv_async(WAKE_TOPIC, timeout_seconds=blocked_recheck_secs(rechecks))
            policy.woken(message)
            await turn.take()
            # Only a wait that ran its whole course counts towards the next one's length: each such
            # wait took the time it was given, so the re-check grows sparse only once the block is
            # truly old, however many wake-ups (a rolling restart, an executor crash-looping) came.
            waited, rechecks = True, rechecks + (message is None)
            continue
        rechecks = 0
        if isinstance(decision, NewRound):
            continue
        peer = decision.peer.executor_id
        if merged:
            if decision.mode is Mode.SAME_VERSION:
                result = await dispatch_and_recover(ref, decision, facts.ack_timeout)
            elif await dispatch(ref, decision):
                result = await moves.move_all(ref, decision, version, facts.ack_timeout)
            else:
                result = {"ok": False, "gone": True}
            if result.get("gone"):
                await abandon(ref)
                return "abandoned"
            if result["ok"]:
                result = await verify_and_succeed(ref, decision, version, facts.ack_timeout, facts.peers)
                if result["ok"]:
                    return "succeeded"
        else:
            if not await dispatch(ref, decision):
                await abandon(ref)
                return "abandoned"
            result = await _attempt(ref, decision, version, facts.ack_timeout, moves)
            if result["ok"]:
                await succeed(ref, decision.attempt, peer, result.get("verifier"))
                return "succeeded"
        failed_at = await fail_attempt(ref, decision.attempt, peer, result.get("error", "failed"))
        delay = policy.failed(decision, facts)
        turn.give_back()
        if nudgeable_backoff:  # a run begun with it recorded when each attempt failed
            await _wait_out_backoff(policy, failed_at + delay)
        else:
            await DBOS.sleep_async(delay)
        await turn.take()
