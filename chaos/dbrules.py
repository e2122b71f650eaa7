"""Relay's promises around its database's faults (issue 14), judged from the faults as executed,
the audit log and what the runner watched (chaos/observe.py):

- (e) no executor stays HEALTHY in the registry more than ``pingWaitSecs`` (+
  :data:`HEALTHY_TOLERANCE_SECS`) after its process is gone or paused, or after Relay's database
  returned, whichever is later. Killed (``kill9``, ``sysdb_restart``'s kill): its id never comes
  back, so the rule holds for the rest of the run (so does a deploy's kill of each executor it retires, from
  its ``killed_at``). Paused (``sigstop``) or partitioned: only while
  the fault lasts (it is legitimately HEALTHY again once it reconnects). A partition counts as its
  socket gone (harness/proxy.py aborts both sides of every connection and refuses new ones), a
  pause as silent; both get ``pingWaitSecs``, the longest a silent executor may take to be noticed
  (between ``pingIntervalSecs`` and ``pingWaitSecs``). A Relay-database fault or an instance fault
  (its end + ``instanceLeaseSecs``: the executor's record waits for an adopter) that overlaps
  moves the start to its end.
- (f) every instance running when Relay's database returns is ready (``/readyz``) within
  ``instanceLeaseSecs`` + :data:`READY_SLACK_SECS`; one that exits meanwhile is judged by (h).
- (g) no lease is adopted during a Relay-database fault or within ``instanceLeaseSecs`` +
  :data:`ADOPTION_TOLERANCE_SECS` after it, unless the harness killed, paused or restarted that
  instance then, or it exited by itself (any code but 3, which (h) judges) before.
- (h) no instance exits unless the harness made it (those are in the faults, not in
  ``History.exits``), except with the fenced code (3) after its lease was adopted.
- and the watching itself: a run with an executor cut in which the registry was never read, or a
  Relay-database fault after which readiness was not polled, fails, so that a broken watcher
  cannot pass (e) and (f) by seeing nothing.

Tolerances: the machine may be two loaded cores. A sound Relay writes DISCONNECTED within a
fraction of a second of a closed socket, a second or two after its database returns; 2 s more than
``pingWaitSecs`` absorbs a slow write, while an executor left HEALTHY (the bug the issue found by
hand: a disconnection lost during an outage) stays so for the rest of the run, minutes. Readiness
needs one lease renewal (every ``instanceLeaseSecs / 3``) once the database answers; the bound is
the issue's, ten seconds more than a lease.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from chaos.semantics import at

if TYPE_CHECKING:
    from chaos.checker import History

HEALTHY_TOLERANCE_SECS = 2.0
# The runner drops a registry sample whose answer took longer (chaos/observe.py).
SAMPLE_TIMEOUT_SECS = 1.0
READY_SLACK_SECS = 10.0
ADOPTION_TOLERANCE_SECS = 2.0
EXIT_FENCED = 3

DATABASE_FAULTS = ("db_kill", "db_cut", "db_restart", "db_pause")
HARNESS_INSTANCE_FAULTS = ("relay_kill", "relay_sigstop", "relay_restart")
GONE = ("kill9", "sysdb_restart")  # the process is dead: its id never comes back
AWAY = ("sigstop", "partition")  # back when the fault ends
DEPLOYS = ("deploy",)  # kills every executor it retires, for good


def _ended(f: dict[str, Any]) -> float:
    return float(f.get("ended", float(f["at"]) + float(f.get("duration", 0.0))))


def _lease(h: History) -> float | None:
    return None if h.timing is None else h.timing.lease_secs


def _outages(h: History) -> list[tuple[float, float]]:
    """When an executor's record could not be changed: Relay's database out, or its instance lost
    until an adopter takes it over."""
    lease = _lease(h) or 0.0
    spans = [(float(f["at"]), _ended(f)) for f in h.faults if f["kind"] in DATABASE_FAULTS]
    spans += [(float(f["at"]), _ended(f) + lease) for f in h.faults if f["kind"] in HARNESS_INSTANCE_FAULTS]
    return sorted(spans)


def _executor_cuts(h: History) -> list[tuple[dict[str, Any], str, float]]:
    """(fault, executor, when it was cut off) of every executor fault, and of every executor a
    deploy retired (killed at its ``killed_at``)."""
    cuts = []
    for f in h.faults:
        if f["kind"] in GONE + AWAY and f.get("executor"):
            cuts.append((f, str(f["executor"]), float(f["at"])))
        elif f["kind"] in DEPLOYS and f.get("killed_at") is not None:
            cuts += [(f, str(executor), float(f["killed_at"])) for executor in f.get("retired", ())]
    return cuts


def healthy_cuts(h: History) -> list[dict[str, Any]]:
    """Per executor fault of (e): the executor, when it counts from (``base``), the window's end, and the
    latest HEALTHY sample in the window (None if none)."""
    if h.timing is None:
        return []
    wait = h.timing.ping_wait_secs
    cuts = []
    for f, executor, start in _executor_cuts(h):
        until = math.inf if f["kind"] in GONE + DEPLOYS else _ended(f)
        base = start
        for begin, end in _outages(h):
            if begin <= base + wait + HEALTHY_TOLERANCE_SECS and end >= start:
                base = max(base, end)
        # A sample's state held somewhere in [t, t + SAMPLE_TIMEOUT_SECS]: within the fault only if that is.
        healthy = [t for t, state in h.health.get(executor, []) if state == "HEALTHY"
                   and start <= t and t + SAMPLE_TIMEOUT_SECS <= until]  # fmt: skip
        # How many times the registry was read for it in the window's first seconds (the rule saw it).
        seen = sum(1 for t, _ in h.health.get(executor, []) if start <= t <= min(until, base + 2 * wait))
        cuts.append({"executor": executor, "kind": f["kind"], "start": start, "base": base, "until": until,
                     "last_healthy": max(healthy) if healthy else None, "samples": seen})  # fmt: skip
    return cuts


def _stayed_healthy(h: History) -> list[str]:
    if h.timing is None:
        return []
    bound = h.timing.ping_wait_secs + HEALTHY_TOLERANCE_SECS
    return [
        f"executor {c['executor']} was HEALTHY in the registry at {c['last_healthy']:.2f}, "
        f"{c['last_healthy'] - c['base']:.2f} s after its {c['kind']} at {c['start']:.2f} (or Relay's database "
        f"returned), more than pingWaitSecs + {HEALTHY_TOLERANCE_SECS} s"
        for c in healthy_cuts(h)
        if c["last_healthy"] is not None and c["last_healthy"] - c["base"] > bound
    ]


def _exited_between(h: History, instance: str, start: float, end: float, fenced: bool | None = None) -> bool:
    return any(
        x["instance"] == instance
        and start <= float(x["at"]) <= end
        and (fenced is None or (x["exit_code"] == EXIT_FENCED) == fenced)
        for x in h.exits
    )


def _ready_late(h: History) -> list[str]:
    lease = _lease(h)
    if lease is None:
        return []
    bound = lease + READY_SLACK_SECS
    problems = []
    for f in h.faults:
        if f["kind"] not in DATABASE_FAULTS:
            continue
        for instance, secs in sorted((f.get("ready_after") or {}).items()):
            if _exited_between(h, instance, float(f["at"]), _ended(f) + bound + 5.0):
                continue  # judged by (h)
            if secs is None or secs > bound:
                took = "was not ready" if secs is None else f"was ready only {secs:.2f} s"
                problems.append(
                    f"instance {instance} {took} after Relay's database returned from a {f['kind']} at "
                    f"{float(f['at']):.2f}, more than instanceLeaseSecs + {READY_SLACK_SECS:.0f} s"
                )
    return problems


def _not_watched(h: History) -> list[str]:
    if _lease(h) is None:
        return []  # a record from before the runner watched
    problems = []
    if healthy_cuts(h) and not any(h.health.values()):
        problems.append("the registry was never read during the run, though executors were cut off")
    for f in h.faults:
        if f["kind"] in DATABASE_FAULTS and not f.get("ready_after"):
            problems.append(
                f"no instance's readiness was polled after the {f['kind']} of Relay's database at {float(f['at']):.2f}"
            )
    return problems


def adoptions(h: History) -> list[tuple[str, float]]:
    """(instance, when) of every ``relay.instance_adopted`` entry."""
    entries = [e for e in h.audit if e["action"] == "relay.instance_adopted"]
    return [(str((e.get("detail") or {}).get("instance")), at(e)) for e in entries]


def _database_fault_at(h: History, when: float) -> dict[str, Any] | None:
    lease = _lease(h) or 0.0
    for f in h.faults:
        if f["kind"] in DATABASE_FAULTS and float(f["at"]) <= when <= _ended(f) + lease + ADOPTION_TOLERANCE_SECS:
            return f
    return None


def _adopted_in_database_faults(h: History) -> list[str]:
    lease = _lease(h)
    if lease is None:
        return []
    problems = []
    for instance, when in adoptions(h):
        fault = _database_fault_at(h, when)
        if fault is None:
            continue
        harness = any(
            f["kind"] in HARNESS_INSTANCE_FAULTS
            and f.get("instance") == instance
            and float(f["at"]) <= when <= _ended(f) + lease + ADOPTION_TOLERANCE_SECS
            for f in h.faults
        )
        crashed = _exited_between(h, instance, float(fault["at"]) - lease, when + 5.0, fenced=False)
        if not (harness or crashed):
            problems.append(
                f"instance {instance}'s lease was adopted at {when:.2f}, during or just after a {fault['kind']} "
                f"of Relay's database at {float(fault['at']):.2f}, though the harness had not stopped it"
            )
    return problems


def _unfenced_exits(h: History) -> list[str]:
    problems = []
    for x in sorted(h.exits, key=lambda x: float(x["at"])):
        instance, when, code = x["instance"], float(x["at"]), x["exit_code"]
        earlier = [float(y["at"]) for y in h.exits if y["instance"] == instance and float(y["at"]) < when]
        since = max(earlier, default=-math.inf)
        adopted = any(i == instance and since < t <= when + 1.0 for i, t in adoptions(h))
        if code == EXIT_FENCED and adopted:
            continue
        why = " (the fenced code, but its lease had not been adopted)" if code == EXIT_FENCED else ""
        problems.append(f"instance {instance} exited with code {code} at {when:.2f}, not made by the harness{why}")
    return problems


def database_violations(h: History) -> list[str]:
    return [
        *_stayed_healthy(h),
        *_ready_late(h),
        *_adopted_in_database_faults(h),
        *_unfenced_exits(h),
        *_not_watched(h),
    ]


def database_figures(h: History) -> dict[str, Any]:
    cuts = healthy_cuts(h)
    after = [c["last_healthy"] - c["base"] for c in cuts if c["last_healthy"] is not None]
    ready = [secs for f in h.faults if f["kind"] in DATABASE_FAULTS for secs in (f.get("ready_after") or {}).values()]
    known = [s for s in ready if s is not None]
    wait = h.timing.ping_wait_secs if h.timing else None
    lease = _lease(h)
    return {
        "registry_samples": sum(len(s) for s in h.health.values()),
        "healthy_after_cut_secs": {
            "cuts": len(cuts),
            "max": round(max(after), 2) if after else None,
            "bound": None if wait is None else wait + HEALTHY_TOLERANCE_SECS,
            "min_samples": min((c["samples"] for c in cuts), default=None),
        },
        "ready_after_database_secs": {
            "count": len(ready),
            "max": round(max(known), 2) if known else None,
            "never": len(ready) - len(known),
            "bound": None if lease is None else lease + READY_SLACK_SECS,
        },
        "adoptions_in_database_faults": sum(1 for _, t in adoptions(h) if _database_fault_at(h, t) is not None),
        "instance_exits": {
            "fenced": sum(1 for x in h.exits if x["exit_code"] == EXIT_FENCED),
            "other": sum(1 for x in h.exits if x["exit_code"] != EXIT_FENCED),
        },
    }
