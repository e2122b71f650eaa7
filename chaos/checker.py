"""The checker: a pure function from what a run left behind to its verdict.

The runner gathers a :class:`History` from the evidence tables, the executors'
system database and Relay's API; :func:`check` finds the violations and
:func:`figures` the numbers. Its own tests feed it broken histories.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from chaos.dbrules import database_figures, database_violations
from chaos.semantics import semantic_violations, timing_figures
from harness.stats import percentile
from relay.core.ids import ExecutorKey, recovery_run

TERMINAL = ("SUCCESS", "ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED")


@dataclass
class History:
    # workflow id -> (status, app) from the system database
    workflows: dict[str, tuple[str, str]]
    # (workflow id, executor id, app of that executor) per outcome row
    outcomes: list[tuple[str, str, str]]
    # (workflow id, step, executor id, app of that executor) per step execution
    steps: list[tuple[str, str, str, str]]
    # Relay's audit log (API entries), oldest first
    audit: list[dict[str, Any]]
    # Relay's registry at the end: executor id -> record (API)
    registry: dict[str, dict[str, Any]]
    # faults as executed: {"at": unix time, "ended": unix time, "kind": ..., "executor": id or None,
    # "duration": seconds}; "at" and "ended" are wall time, as the audit log's (PostgreSQL's) are
    faults: list[dict[str, Any]] = field(default_factory=list)
    # The ExecutorDead payloads the run's webhook receiver accepted (one rule, on the main app), in
    # the order they came: alerts, and their resolutions (``status: resolved``) once each death is
    # over; None for a run without a receiver.
    alerts: list[dict[str, Any]] | None = None
    # executor id -> its app, for every executor the run started
    apps: dict[str, str] = field(default_factory=dict)
    # executors whose process still runs at the end (not killed)
    alive: list[str] = field(default_factory=list)
    # the run's timing: grace, pingWaitSecs and pingIntervalSecs (no timing checks without it)
    timing: Timing | None = None
    # What the runner read of the registry during the run: executor id -> (wall time, state), oldest
    # first (chaos/observe.py); nothing while no instance could answer.
    health: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    # Relay instance exits the harness did not cause: {"instance", "exit_code", "at" (wall time, when
    # first seen)}
    exits: list[dict[str, Any]] = field(default_factory=list)
    # From the system databases at the end: workflow id -> its executor_id, when it started (a queued
    # one's dequeue, started_at_epoch_ms; else created_at) and its updated_at (for a finished one, when
    # its terminal status was written), as Unix times. Empty for a record from before (no
    # nothing-pending checks then).
    owners: dict[str, Owner] = field(default_factory=dict)
    # When the runner read the receiver's payloads (wall time), after the audit log: a death that ended
    # less than RESOLUTION_MARGIN_SECS before it may not be resolved yet. None: the newest audit
    # entry's time stands for it.
    alerts_read_at: float | None = None


@dataclass(frozen=True)
class Owner:
    executor: str | None
    started: float
    updated: float


@dataclass(frozen=True)
class Timing:
    grace_secs: float
    ping_wait_secs: float
    ping_interval_secs: float
    lease_secs: float | None = None  # instanceLeaseSecs (no readiness or adoption checks without it)


def check(h: History) -> list[str]:
    return [
        *_every_workflow_once(h),
        *_no_cross_app(h),
        *_dead_were_handled(h),
        *_audit_is_complete(h),
        *_instances_adopted_once(h),
        *_paused_instances_fenced(h),
        *_one_alert_per_death(h),
        *_ended_deaths_resolved(h),
        *_recovered_within_the_app(h),
        *_nothing_was_pending(h),
        *semantic_violations(h),
        *database_violations(h),
    ]


def _every_workflow_once(h: History) -> list[str]:
    problems = []
    counts = Counter(w for w, _, _ in h.outcomes)
    for workflow_id, (status, _) in sorted(h.workflows.items()):
        if status not in TERMINAL:
            problems.append(f"workflow {workflow_id} never finished (status {status})")
        elif counts[workflow_id] != 1:
            problems.append(f"workflow {workflow_id} ({status}) has {counts[workflow_id]} outcomes, not exactly one")
    for workflow_id in sorted(set(counts) - set(h.workflows)):
        problems.append(f"outcome for workflow {workflow_id}, which the system database does not know")
    return problems


def _no_cross_app(h: History) -> list[str]:
    problems = []
    apps = {w: app for w, (_, app) in h.workflows.items()}
    for workflow_id, step, executor, app in h.steps:
        if workflow_id in apps and apps[workflow_id] != app:
            problems.append(
                f"step {step} of {apps[workflow_id]} workflow {workflow_id} ran on {app} executor {executor}"
            )
    for workflow_id, executor, app in h.outcomes:
        if workflow_id in apps and apps[workflow_id] != app:
            problems.append(f"{apps[workflow_id]} workflow {workflow_id} finished on {app} executor {executor}")
    return problems


# What declares an executor's life over: its grace period's end, or the reconciler bringing a
# deleted record back DEAD because its work was found stranded (a new life of the same id).
DEATHS = ("executor.dead", "reconcile.recovered")


def _dead_were_handled(h: History) -> list[str]:
    """The last life of every executor declared dead ended: recovered (deleted), blocked, or back."""
    problems = []
    for executor in sorted({e["executorId"] for e in h.audit if e["action"] in DEATHS}):
        mine = [e["action"] for e in h.audit if e["executorId"] == executor]
        later = mine[max(i for i, a in enumerate(mine) if a in DEATHS) :]
        record = h.registry.get(executor)
        recovered = "executor.deleted" in later
        blocked = record is not None and record["state"] == "DEAD" and record.get("blockedReason")
        came_back = record is not None and record["state"] == "HEALTHY"
        if not (recovered or blocked or came_back):
            state = record["state"] if record else "deleted without executor.deleted"
            problems.append(f"executor {executor} was declared dead but neither recovered nor blocked ({state})")
    return problems


def _audit_is_complete(h: History) -> list[str]:
    """Every deletion has, since the executor's previous deletion (one life, which may have taken
    several recovery runs), its death (:data:`DEATHS`), and the ``recovery.dispatched`` and
    ``recovery.succeeded`` of the very run that deleted it (by ``recoveryId``, when the entries
    name it); no ``recovery.dispatched`` when that deletion says nothing was pending (a peer
    found no PENDING workflow of an executor none could recover: nothing was sent). An executor
    that died more than once, or whose recovery took a second run, is checked life by life and
    run by run, not against its whole history."""
    problems = []
    life: dict[str, list[dict[str, Any]]] = {}
    for entry in h.audit:
        executor, action = entry["executorId"] or "", entry["action"]
        before = life.setdefault(executor, [])
        if action == "executor.deleted":
            run = _recovery_id(entry)
            if not any(e["action"] in DEATHS for e in before):
                problems.append(f"executor {executor} was deleted without executor.dead before it in the audit log")
            idle = bool((entry.get("detail") or {}).get("nothingPending"))
            for needed in ("recovery.succeeded",) if idle else ("recovery.dispatched", "recovery.succeeded"):
                if not any(e["action"] == needed and (run is None or _recovery_id(e) in (run, None)) for e in before):
                    which = f" of {run}" if run else ""
                    problems.append(
                        f"executor {executor} was deleted without {needed}{which} before it in the audit log"
                    )
            life[executor] = []  # a later death of the same executor id is a new life
            continue
        before.append(entry)
    return problems


def _recovery_id(entry: dict[str, Any]) -> str | None:
    detail = entry.get("detail") or {}
    rid = detail.get("recoveryId")
    return rid if isinstance(rid, str) else None


def _instances_adopted_once(h: History) -> list[str]:
    """An expired lease is adopted by exactly one instance (one audit entry per lease epoch)."""
    adoptions = Counter(
        (e["detail"].get("instance"), e["detail"].get("leaseEpoch"))
        for e in h.audit
        if e["action"] == "relay.instance_adopted"
    )
    return [f"instance {i} lease epoch {epoch} adopted {n} times" for (i, epoch), n in adoptions.items() if n > 1]


def _paused_instances_fenced(h: History) -> list[str]:
    """An instance paused past its lease and adopted exits with the fenced code (3) when it resumes."""
    return [
        f"instance {f.get('instance')} resumed after adoption and exited with {f['exit_code']}, not 3"
        for f in h.faults
        if f["kind"] == "relay_sigstop" and f.get("exit_code") not in (None, 3)
    ]


def _one_alert_per_death(h: History) -> list[str]:
    """Every executor declared dead produced exactly one distinct ExecutorDead idempotency key at
    the receiver (repeats of it are allowed: webhooks are at least once), and nothing else did.
    Resolutions (``status: resolved``) are not alerts: each resolves an alert that arrived before
    it, and a death has at most one (its key, ``{the alert's key}:resolved``)."""
    if h.alerts is None:
        return []
    died = {
        (str(e["executorId"]), str((e.get("detail") or {}).get("epoch")))
        for e in h.audit
        if e["action"] == "executor.dead"
    }
    keys: dict[tuple[str, str], set[str]] = {}
    resolved: dict[tuple[str, str], set[str]] = {}
    arrived: set[str] = set()  # the alert keys arrived so far, in the receiver's order
    problems = []
    for payload in h.alerts:
        death = (str(payload.get("executorId")), str(payload.get("epoch")))
        key = str(payload.get("idempotencyKey"))
        if payload.get("status") != "resolved":
            keys.setdefault(death, set()).add(key)
            arrived.add(key)
            continue
        resolves = str(payload.get("resolves"))
        resolved.setdefault(death, set()).add(key)
        if key != f"{resolves}:resolved" or resolves not in arrived:
            problems.append(
                f"a resolution ({key}) of executor {death[0]} epoch {death[1]} came before the alert "
                f"it resolves ({resolves}), or resolves none"
            )
    for executor, epoch in sorted(died):
        found = keys.get((executor, epoch), set())
        if len(found) != 1:
            problems.append(
                f"executor {executor} declared dead (epoch {epoch}) produced {len(found)} distinct "
                "ExecutorDead idempotency keys at the receiver, not exactly one"
            )
        if len(resolved.get((executor, epoch), set())) > 1:
            problems.append(f"executor {executor} declared dead (epoch {epoch}) was resolved under more than one key")
    for executor, epoch in sorted(set(keys) - died):
        problems.append(f"an ExecutorDead alert for executor {executor} epoch {epoch}, which was not declared dead")
    return problems


# How long before the runner read the receiver a death may have ended without its resolution there
# yet: Relay reads the end every alerts.pollIntervalSecs (0.5 s in chaos), then delivers the
# resolution as a workflow (a second or so on a loaded machine). The runner waits for outstanding
# resolutions before it gathers (chaos/run.py, alerted), so only an end written after that wait is
# excused.
RESOLUTION_MARGIN_SECS = 5.0


def death_ends(audit: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[float, str]]:
    """(executor id, epoch) of each death declared by ``executor.dead`` whose end the audit log shows
    -> (when, the entry's action), the first entry that ends it: an ``executor.deleted``, a
    ``recovery.succeeded`` (its record deleted with it, or kept: the executor connected again
    meanwhile) or a final ``recovery.failed`` (the executor connected again), of a run of that
    death's recovery (its ``recoveryId`` names one: ``recovery:{org}:{app}:{executor}:{epoch}[:{run}]``).
    Read from the contract, not from Relay's own reading of its log (relay.core.alerts.death_over):
    a success that ended nothing there is an end here."""
    deaths: dict[str, dict[str, ExecutorKey]] = {}  # executor id -> epoch -> its key
    for e in audit:
        epoch = str((e.get("detail") or {}).get("epoch"))
        if e["action"] == "executor.dead" and epoch.isdigit():
            executor = str(e["executorId"])
            key = ExecutorKey(str(e.get("org") or ""), str(e.get("app") or ""), executor)
            deaths.setdefault(executor, {}).setdefault(epoch, key)
    ends: dict[tuple[str, str], tuple[float, str]] = {}
    for e in audit:
        detail = e.get("detail") or {}
        rid = detail.get("recoveryId")
        final = e["action"] == "recovery.failed" and detail.get("final")
        if not isinstance(rid, str) or not (final or e["action"] in ("executor.deleted", "recovery.succeeded")):
            continue
        for epoch, key in deaths.get(str(e["executorId"]), {}).items():
            death = (key.executor_id, epoch)
            if death not in ends and recovery_run(key, int(epoch), rid) is not None:
                ends[death] = (_unix(e), e["action"])
    return ends


def unresolved(audit: list[dict[str, Any]], alerts: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[float, str]]:
    """The deaths of :func:`death_ends` whose ExecutorDead alert reached the receiver and its
    resolution did not (the run's one rule sends resolutions: alerts.sendResolutions is left on)."""
    alerted: set[tuple[str, str]] = set()
    resolved: set[tuple[str, str]] = set()
    for payload in alerts:
        death = (str(payload.get("executorId")), str(payload.get("epoch")))
        (resolved if payload.get("status") == "resolved" else alerted).add(death)
    return {d: end for d, end in death_ends(audit).items() if d in alerted and d not in resolved}


def _ended_deaths_resolved(h: History) -> list[str]:
    """Every death that ended (:func:`death_ends`) and was alerted has its alert resolved at the
    receiver by the end of the run, unless it ended within :data:`RESOLUTION_MARGIN_SECS` of when
    the receiver was read. A death never alerted is :func:`_one_alert_per_death`'s to report; one
    whose end the audit log does not show (its executor came back and no run of its recovery has
    found out yet) is not over for Relay either."""
    if h.alerts is None:
        return []
    until = h.alerts_read_at if h.alerts_read_at is not None else max(map(_unix, h.audit), default=0.0)
    problems = []
    for (executor, epoch), (at, action) in sorted(unresolved(h.audit, h.alerts).items()):
        if at > until - RESOLUTION_MARGIN_SECS:
            continue
        stamp = datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S.%f")[:-3]
        problems.append(
            f"executor {executor} declared dead (epoch {epoch}) ended at {stamp} ({action}), "
            f"{until - at:.1f} s before the run's end, but its ExecutorDead alert was never resolved at the receiver"
        )
    return problems


def _recovered_within_the_app(h: History) -> list[str]:
    """Contract rule 2: the peer asked to recover is of the dead executor's app."""
    problems = []
    for e in h.audit:
        peer = e.get("peerExecutorId")
        if e["action"] != "recovery.dispatched" or not peer or peer not in h.apps:
            continue
        app = e.get("app") or h.apps.get(e["executorId"] or "")
        if app is not None and h.apps[peer] != app:
            problems.append(
                f"recovery of {app} executor {e['executorId']} dispatched to {h.apps[peer]} executor {peer}"
            )
    return problems


# A workflow started this little before a nothing-pending deletion may have started after the peer's
# answer (a partitioned executor keeps running): only those started earlier are judged. Relay
# writes the deletion within milliseconds of the answer; a workflow pending across this whole span
# was there to be listed.
NOTHING_PENDING_SLACK_SECS = 1.0


def _nothing_was_pending(h: History) -> list[str]:
    """A recovery that found nothing pending (``detail.nothingPending``: a peer listed no PENDING
    workflow of the dead executor, and its record was deleted with nothing recovered) is checked
    against the system database: no workflow of that executor (its ``executor_id`` at the end)
    started before the deletion (:data:`NOTHING_PENDING_SLACK_SECS`) was still unfinished at it, and
    none is left PENDING at the end while that executor's record is gone."""
    if not h.owners:
        return []
    problems = []
    for entry in h.audit:
        if entry["action"] != "executor.deleted" or not (entry.get("detail") or {}).get("nothingPending"):
            continue
        executor, when = entry["executorId"], _unix(entry)
        stamp = datetime.fromtimestamp(when, UTC).strftime("%H:%M:%S.%f")[:-3]
        for workflow_id, owner in sorted(h.owners.items()):
            if owner.executor != executor:
                continue
            status = h.workflows.get(workflow_id, ("?", ""))[0]
            finished = status in TERMINAL
            stranded = status == "PENDING" and executor not in h.registry
            if owner.started < when - NOTHING_PENDING_SLACK_SECS and (not finished or owner.updated > when):
                problems.append(
                    f"executor {executor} was deleted at {stamp} with nothing pending, but its workflow "
                    f"{workflow_id} was unfinished then ({'finished later, ' if finished else ''}status {status})"
                    + (", and is left PENDING with no executor to recover it" if stranded else "")
                )
            elif stranded:
                problems.append(
                    f"workflow {workflow_id} of executor {executor}, deleted at {stamp} with nothing pending, "
                    "is left PENDING with no executor to recover it"
                )
    return problems


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def figures(h: History) -> dict[str, Any]:
    step_runs = Counter((w, s) for w, s, _, _ in h.steps)
    recovery_secs = []
    deletions = [
        (e["executorId"], datetime.fromisoformat(e["at"].replace("Z", "+00:00")).timestamp())
        for e in h.audit
        if e["action"] == "executor.deleted"
    ]
    for fault in h.faults:
        # The first recovery of that executor after the fault, before the next fault on it: one that
        # survived the fault (a pause shorter than the grace, a partition healed) and was recovered
        # after a later fault is that fault's (the soak of seed 50 counted 244 s for such a pause).
        executor = fault.get("executor")
        until = min(
            (f["at"] for f in h.faults if f.get("executor") == executor and f["at"] > fault["at"]), default=None
        )
        after = [at for e, at in deletions if e == executor and at >= fault["at"] and (until is None or at < until)]
        if after:
            recovery_secs.append(min(after) - fault["at"])
    return {
        "workflows_started": len(h.workflows),
        "workflows_finished": sum(1 for status, _ in h.workflows.values() if status in TERMINAL),
        "outcomes": len(h.outcomes),
        "step_reexecutions": sum(n - 1 for n in step_runs.values()),
        "faults": dict(Counter(f["kind"] for f in h.faults)),
        "executor_dead_alerts": None if h.alerts is None else sum(a.get("status") != "resolved" for a in h.alerts),
        "executor_dead_resolutions": None if h.alerts is None else sum(a.get("status") == "resolved" for a in h.alerts),
        # Deaths whose end the audit log shows (each must be resolved if it was alerted)
        "deaths_ended": len(death_ends(h.audit)),
        "instances_adopted": sum(1 for e in h.audit if e["action"] == "relay.instance_adopted"),
        "paused_instances_fenced": sum(1 for f in h.faults if f.get("exit_code") == 3),
        "fault_to_recovery_secs": {
            "count": len(recovery_secs),
            "p50": _seconds(percentile(recovery_secs, 50)),
            "p99": _seconds(percentile(recovery_secs, 99)),
            "max": round(max(recovery_secs), 2) if recovery_secs else None,
        },
        "dead_declarations": timing_figures(h),
        "recoveries_dispatched_while_sysdb_down": _during_sysdb_outages(h, "recovery.dispatched"),
        # Deletions after a peer found nothing pending (checked against the system database)
        "nothing_pending_deletions": sum(
            1 for e in h.audit if e["action"] == "executor.deleted" and (e.get("detail") or {}).get("nothingPending")
        ),
        "reconciler": {
            "found": sum(1 for e in h.audit if e["action"] == "reconcile.found"),
            "recovered": sum(1 for e in h.audit if e["action"] == "reconcile.recovered"),
        },
        "database_rules": database_figures(h),
    }


def _during_sysdb_outages(h: History, action: str) -> int:
    """How many ``action`` entries fell while the system databases' server was down (sysdb_restart)."""
    outages = [(f["sysdb_down"], f["sysdb_up"]) for f in h.faults if "sysdb_down" in f]
    return sum(1 for e in h.audit if e["action"] == action and any(down <= _unix(e) <= up for down, up in outages))


def _unix(entry: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(entry["at"]).replace("Z", "+00:00")).timestamp()
