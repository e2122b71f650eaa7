"""Relay's own promises, judged from the faults as executed and the audit log.

DBOS makes every workflow finish once even when Relay misbehaves, so the
checker's outcome checks cannot see a broken grace period. These can:

- (a) no executor is declared DEAD unless it had been cut off (killed, paused,
  partitioned, or its Relay instance lost) for at least its grace period, plus
  ``pingWaitSecs - pingIntervalSecs`` for a silent one (a paused process is
  noticed only when its pongs have been missing that long);
- (b) no recovery is dispatched for an executor that is connected at that moment
  (no fault of its own or of an instance under way);
- (c) an executor whose fault ended before its grace period ran out is not
  declared dead nor recovered for it, and every executor still running at the
  end is HEALTHY in the registry;
- (d) a step runs more than once only for workflows of an executor that was
  declared dead or killed.

Instance faults count as cutting off every executor (which executors an
instance held is not recorded): that only ever excuses, so it cannot make a
sound run fail. Times: fault ``at``/``ended`` are the harness's wall clock,
audit ``at`` is PostgreSQL's ``now()``; both read the same host clock.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chaos.checker import History

# How much earlier than its bound a declaration may come: the harness records a fault's
# start just before it signals, DBOS's durable timer is not exact, and a pong written just
# before a pause may be read late on a loaded machine. Well under the grace periods the
# profiles use (2 s), so a grace period cut to nothing is still far outside it.
TOLERANCE_SECS = 0.75
# How long after its fault ends an executor may take to be connected again: the SDK waits
# 1 s between attempts, then the handshake; more on a loaded machine.
RECONNECT_SECS = 3.0

# sysdb_restart kills its executor first (then restarts the apps' system databases).
EXECUTOR_CUTS = ("kill9", "sigstop", "partition", "sysdb_restart")
KILLS = ("kill9", "sysdb_restart")
# A deploy (chaos/schedule.py) kills every executor of the old version at once (its ``retired``, at
# ``killed_at``): a kill of each.
DEPLOYS = ("deploy",)
# Relay's database failing (profile db) may fence instances out, and their executors with them.
INSTANCE_CUTS = ("relay_kill", "relay_sigstop", "relay_restart", "db_kill", "db_cut", "db_restart", "db_pause")


@dataclass(frozen=True)
class Cut:
    """An interval in which an executor was not reachable through a live instance."""

    start: float
    end: float  # when it may be connected again (inf for a killed process)
    silent: bool  # its socket stayed open: noticed only by missing pongs
    fault: dict[str, Any]


def at(entry: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(entry["at"]).replace("Z", "+00:00")).timestamp()


def _ended(f: dict[str, Any]) -> float:
    return float(f.get("ended", float(f["at"]) + float(f.get("duration", 0.0))))


def _length(f: dict[str, Any]) -> float:
    """How long the fault lasted, by the monotonic clock when it was recorded."""
    if "at_mono" in f and "ended_mono" in f:
        return float(f["ended_mono"]) - float(f["at_mono"])
    return _ended(f) - float(f["at"])


def cuts_of(h: History, executor: str) -> list[Cut]:
    cuts = []
    for f in h.faults:
        if f["kind"] in INSTANCE_CUTS or (f["kind"] in EXECUTOR_CUTS and f.get("executor") == executor):
            end = math.inf if f["kind"] in KILLS else _ended(f) + RECONNECT_SECS
            cuts.append(Cut(float(f["at"]), end, f["kind"] == "sigstop", f))
        elif f["kind"] in DEPLOYS and executor in f.get("retired", ()) and f.get("killed_at") is not None:
            cuts.append(Cut(float(f["killed_at"]), math.inf, False, f))
    return cuts


def killed(h: History) -> set[str]:
    """Every executor the harness killed (by itself, or retired by a deploy)."""
    return {str(f.get("executor")) for f in h.faults if f["kind"] in KILLS} | {
        str(e) for f in h.faults if f["kind"] in DEPLOYS for e in f.get("retired", ())
    }


def _declarations(h: History) -> list[tuple[str, float]]:
    return [(e["executorId"], at(e)) for e in h.audit if e["action"] == "executor.dead" and e.get("actor") == "relay"]


def dead_margins(h: History) -> dict[str, float | None]:
    """Per declaration: how long after its bound it came (negative: too soon); None if no cut explains it."""
    if h.timing is None:
        return {}
    t = h.timing
    margins: dict[str, float | None] = {}
    for executor, when in _declarations(h):
        best = None
        for cut in cuts_of(h, executor):
            if cut.start <= when + TOLERANCE_SECS and when <= cut.end:
                need = t.grace_secs + (t.ping_wait_secs - t.ping_interval_secs if cut.silent else 0.0)
                margin = when - cut.start - need
                best = margin if best is None else max(best, margin)
        margins[f"{executor}@{when:.2f}"] = best
    return margins


def _declared_too_soon(h: History) -> list[str]:
    problems = []
    for key, margin in dead_margins(h).items():
        executor, when = key.rsplit("@", 1)
        if margin is None:
            problems.append(f"executor {executor} was declared dead at {when} with no fault cutting it off then")
        elif margin < -TOLERANCE_SECS:
            problems.append(
                f"executor {executor} was declared dead at {when}, {-margin:.2f} s before its grace period "
                f"(tolerance {TOLERANCE_SECS} s)"
            )
    return problems


def _recovered_while_connected(h: History) -> list[str]:
    problems = []
    for e in h.audit:
        if e["action"] != "recovery.dispatched":
            continue
        executor, when = e["executorId"], at(e)
        if not any(c.start <= when <= c.end for c in cuts_of(h, executor)):
            problems.append(f"recovery of executor {executor} dispatched at {when:.2f} while it was connected")
    return problems


def _short_faults_forgiven(h: History) -> list[str]:
    if h.timing is None:
        return []
    problems = []
    faults = sorted(h.faults, key=lambda f: float(f["at"]))
    for i, f in enumerate(faults):
        if f["kind"] not in ("sigstop", "partition"):
            continue
        if _length(f) + RECONNECT_SECS > h.timing.grace_secs:
            continue  # it may have outlasted the grace period
        start = float(f["at"])
        until = float(faults[i + 1]["at"]) if i + 1 < len(faults) else math.inf
        for e in h.audit:
            if e["executorId"] == f["executor"] and e["action"] in ("executor.dead", "recovery.dispatched"):
                if start <= at(e) < until:
                    problems.append(
                        f"executor {f['executor']} {e['action']} at {at(e):.2f} after a {f['kind']} of "
                        f"{_length(f):.2f} s, shorter than its grace period"
                    )
    for executor in h.alive:
        state = (h.registry.get(executor) or {}).get("state", "absent")
        if state != "HEALTHY":
            problems.append(f"executor {executor} runs at the end but is {state} in the registry")
    return problems


def _reexecutions_explained(h: History) -> list[str]:
    dead = {e["executorId"] for e in h.audit if e["action"] == "executor.dead"}
    gone = killed(h)
    ran: dict[tuple[str, str], set[str]] = defaultdict(set)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for workflow_id, step, executor, _ in h.steps:
        ran[(workflow_id, step)].add(executor)
        counts[(workflow_id, step)] += 1
    return [
        f"step {step} of {workflow_id} ran {counts[(workflow_id, step)]} times on {sorted(executors)}, "
        f"none of them declared dead or killed"
        for (workflow_id, step), executors in sorted(ran.items())
        if counts[(workflow_id, step)] > 1 and not executors & (dead | gone)
    ]


def semantic_violations(h: History) -> list[str]:
    return [
        *_declared_too_soon(h),
        *_recovered_while_connected(h),
        *_short_faults_forgiven(h),
        *_reexecutions_explained(h),
    ]


def timing_figures(h: History) -> dict[str, Any]:
    known = [m for m in dead_margins(h).values() if m is not None]
    return {
        "declarations": len(_declarations(h)),
        "min_margin_secs": round(min(known), 2) if known else None,
        "tolerance_secs": TOLERANCE_SECS,
    }
