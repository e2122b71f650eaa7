"""Profiles and the seeded fault schedule (pure: a seed gives the same schedule)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import asdict, dataclass
from typing import Any

EXECUTOR_FAULTS = ("kill9", "sigstop", "partition")
# kill -9 of a Relay instance (restarted after ``duration``), SIGSTOP of one past its
# lease (it finds itself adopted and exits; it is started again), and a graceful restart.
INSTANCE_FAULTS = ("relay_kill", "relay_sigstop", "relay_restart")
FAULT_KINDS = EXECUTOR_FAULTS + INSTANCE_FAULTS
# Relay's PostgreSQL (a server of its own): kill -9 of the postmaster, started again on the same
# data after ``duration``; a network cut between every instance and it (a TCP proxy); a graceful
# restart (down for ``duration``); a pause (SIGSTOP of the postmaster and its backends) longer
# than instanceLeaseSecs. Played only by profiles with ``db_faults`` (the others' schedules are
# unchanged).
DATABASE_FAULTS = ("db_kill", "db_cut", "db_restart", "db_pause")
# The executors' system databases (a server of their own, both apps'): an executor is killed and,
# SYSDB_LEAD_SECS before its grace period runs out, the server is stopped (pg_ctl -m fast) for
# ``duration`` (longer than the lead), so that its death is declared and its recovery dispatched
# to a peer while the server is down (a recovery takes a few tens of milliseconds: a restart
# timed after the declaration would find it done). Started again, and then the executor.
# Played, like DATABASE_FAULTS, with ``db_faults`` only.
SYSTEM_DATABASE_FAULTS = ("sysdb_restart",)
SYSDB_LEAD_SECS = 1.0
# A deploy of a second version of the main app: as many executors of version v2 start (each slot's
# v2 behind the slot's proxy), every v1 executor stops enqueueing and the queues' v1 work is drained;
# then the first half of them (at least one) stop starting workflows and finish what they run (idle),
# the others keep starting ones (busy), and every v1 executor is killed at once. With only v2 peers,
# an idle one's recovery finds nothing pending (its record is deleted, nothing recovered); a busy
# one's blocks, and the operator then recovers it onto the latest version. Never in a generated
# schedule (a fleet's later faults would hit v2 executors); played from recordings
# (chaos/runs/mutants/deploy.json). Its target is -1.
DEPLOY_FAULTS = ("deploy",)


@dataclass(frozen=True)
class Profile:
    name: str
    executors: int  # of the main app; ``decoys`` more run the decoy app
    fault_secs: float  # faults happen in [warmup, fault_secs)
    warmup_secs: float
    heal_timeout_secs: float  # after the faults: how long every workflow may take to finish
    workload_interval_secs: float  # each executor starts a workflow this often
    grace_secs: float
    ping_interval_secs: float
    ping_wait_secs: float
    fault_gap_secs: tuple[float, float]  # quiet time between one fault's end and the next
    relay_instances: int = 3  # behind one load balancer, sharing one PostgreSQL
    lease_secs: float = 3.0  # instanceLeaseSecs
    db_faults: bool = False  # Relay's and the apps' PostgreSQL on servers of their own, and db_kinds played
    db_kinds: tuple[str, ...] = DATABASE_FAULTS + SYSTEM_DATABASE_FAULTS  # the database faults it plays
    liars: int = 0  # main-app executors that answer recovery with success and recover nothing
    decoys: int = 1  # executors of the decoy app
    reconcile_secs: float | None = None  # the reconciler's interval (None: Relay's default, 300 s)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        """A recorded profile, checked field by field (ValueError names the first wrong one).

        A record from before several instances has no ``relay_instances``: it was played on one
        Relay, and is again. One from before ``db_kinds`` played the four faults of Relay's database.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown profile field {', '.join(map(repr, unknown))}")
        data = {"relay_instances": 1, "db_kinds": DATABASE_FAULTS, **data}
        missing = [name for name, f in fields.items() if name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"profile field {', '.join(map(repr, missing))} missing")
        for name, value in data.items():
            if not _of_type(value, str(fields[name].type)):
                raise ValueError(f"profile field {name!r} is {value!r}, not {fields[name].type}")
        for name in ("executors", "relay_instances"):
            if data[name] < 1:
                raise ValueError(f"profile field {name!r} is {data[name]}, less than 1")
        unknown_kinds = sorted(set(data["db_kinds"]) - set(DATABASE_FAULTS + SYSTEM_DATABASE_FAULTS))
        if unknown_kinds:
            raise ValueError(f"profile field 'db_kinds' holds unknown fault kind {', '.join(map(repr, unknown_kinds))}")
        return cls(**{**data, "fault_gap_secs": tuple(data["fault_gap_secs"]), "db_kinds": tuple(data["db_kinds"])})


def _of_type(value: Any, annotation: str) -> bool:
    """Whether a JSON value fits a field of Profile or Fault, by its annotation's text."""
    if annotation.endswith(" | None"):
        return value is None or _of_type(value, annotation.removesuffix(" | None"))
    if annotation == "tuple[float, float]":
        return isinstance(value, (list, tuple)) and len(value) == 2 and all(_of_type(v, "float") for v in value)
    if annotation == "tuple[str, ...]":
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    kinds: dict[str, tuple[type, ...]] = {"str": (str,), "bool": (bool,), "int": (int,), "float": (int, float)}
    return isinstance(value, kinds[annotation]) and (annotation == "bool" or not isinstance(value, bool))


PROFILES = {
    "ci": Profile("ci", executors=3, fault_secs=150, warmup_secs=10, heal_timeout_secs=150,
                  workload_interval_secs=0.5, grace_secs=2.0, ping_interval_secs=0.5, ping_wait_secs=2.0,
                  fault_gap_secs=(2.0, 6.0), db_faults=True, db_kinds=("db_kill", "db_cut", "sysdb_restart")),
    "quick": Profile("quick", executors=3, fault_secs=45, warmup_secs=8, heal_timeout_secs=90,
                     workload_interval_secs=0.5, grace_secs=2.0, ping_interval_secs=0.5, ping_wait_secs=2.0,
                     fault_gap_secs=(1.0, 3.0)),
    "db": Profile("db", executors=3, fault_secs=90, warmup_secs=8, heal_timeout_secs=90,
                  workload_interval_secs=0.5, grace_secs=2.0, ping_interval_secs=0.5, ping_wait_secs=2.0,
                  fault_gap_secs=(1.0, 3.0), db_faults=True),
    "soak": Profile("soak", executors=4, fault_secs=1800, warmup_secs=15, heal_timeout_secs=300,
                    workload_interval_secs=0.5, grace_secs=2.0, ping_interval_secs=0.5, ping_wait_secs=2.0,
                    fault_gap_secs=(3.0, 12.0), db_faults=True, reconcile_secs=60.0),
}  # fmt: skip


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the start of the run
    kind: str
    target: int  # executor slot, or Relay instance index for instance faults (-1: an old record's one Relay)
    duration: float  # how long a SIGSTOP or a partition lasts; 0 otherwise

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Fault:
        """A recorded fault, checked field by field (ValueError names the first wrong one)."""
        if not isinstance(data, dict):
            raise ValueError(f"{data!r} is not a fault (an object of at, kind, target and duration)")
        fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        unknown, missing = sorted(set(data) - set(fields)), sorted(set(fields) - set(data))
        if unknown or missing:
            raise ValueError(f"fault fields unknown {unknown}, missing {missing}")
        for name, value in data.items():
            if not _of_type(value, fields[name]):
                raise ValueError(f"fault field {name!r} is {value!r}, not {fields[name]}")
        return cls(**data)


def unplayable(profile: Profile, fault: Fault) -> str | None:
    """Why ``fault`` cannot be played as written on ``profile``'s fleet, or None if it can."""
    database = DATABASE_FAULTS + SYSTEM_DATABASE_FAULTS
    if fault.kind not in FAULT_KINDS + database + DEPLOY_FAULTS:
        known = ", ".join(FAULT_KINDS + database + DEPLOY_FAULTS)
        return f"unknown fault kind {fault.kind!r} (known: {known})"
    if fault.at < 0 or fault.duration < 0:
        return f"{fault.kind} at {fault.at} s for {fault.duration} s: a time is negative"
    if fault.kind in database and not profile.db_faults:
        return (f"{fault.kind} is a database fault and profile {profile.name!r} has no db_faults "
                "(no server of its own to fail)")  # fmt: skip
    if fault.kind in SYSTEM_DATABASE_FAULTS and fault.kind not in profile.db_kinds:
        return (f"{fault.kind} needs the system databases on a server of their own, and profile "
                f"{profile.name!r} does not list it in db_kinds")  # fmt: skip
    if fault.kind in DATABASE_FAULTS + DEPLOY_FAULTS and fault.target != -1:
        what = "deploy" if fault.kind in DEPLOY_FAULTS else "database fault"
        return f"{fault.kind} target {fault.target}: a {what}'s target is -1"
    if fault.kind in INSTANCE_FAULTS and not -1 <= fault.target < profile.relay_instances:
        return (f"{fault.kind} target {fault.target} out of range: profile {profile.name!r} has "
                f"Relay instances 0 to {profile.relay_instances - 1}")  # fmt: skip
    slots = profile.executors + profile.decoys
    if fault.kind in EXECUTOR_FAULTS + SYSTEM_DATABASE_FAULTS and not 0 <= fault.target < slots:
        return (f"{fault.kind} target {fault.target} out of range: profile {profile.name!r} has "
                f"executor slots 0 to {slots - 1}")  # fmt: skip
    return None


def faults_end(profile: Profile, schedule: list[Fault]) -> float:
    """Until when the workload runs, in seconds after the start: ``fault_secs``, or the end of the
    last fault when a profile that must play every kind started faults past it."""
    return max([profile.fault_secs, *(f.at + f.duration for f in schedule if f.at >= profile.fault_secs)])


def settle_secs(profile: Profile, kind: str) -> float:
    """How long the schedule leaves after a fault of ``kind`` ends (beside a random gap) for Relay to
    be back to its steady state: an executor's fault, the grace period (it is declared dead and
    recovered, or it is back); any other, an instance's lease and the grace period (adopted, or ready
    again, and the deaths it caused over). The runner keeps it even when a fault runs over."""
    if kind in EXECUTOR_FAULTS:
        return profile.grace_secs
    return profile.lease_secs + profile.grace_secs


def make_schedule(seed: int, profile: Profile) -> list[Fault]:
    """One fault at a time, so a peer of the main app and a Relay instance are always there."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    # Every fourth fault (every other one with db_faults, which owes twice as many) is an instance or
    # database fault not played yet, until each kind has been. With db_faults the faults go on past
    # fault_secs until each has been, so that every seed plays all of them (CI's 150 s always did;
    # the db profile's 90 s did for four seeds in two hundred).
    owed = rng.sample(INSTANCE_FAULTS, len(INSTANCE_FAULTS))
    kinds: tuple[str, ...] = FAULT_KINDS
    weights = [4, 2, 2, 1, 1, 1]
    every = 4
    if profile.db_faults:
        owed = rng.sample(profile.db_kinds, len(profile.db_kinds)) + owed
        kinds, weights = kinds + profile.db_kinds, [*weights, *[1] * len(profile.db_kinds)]
        every = 2
    t = profile.warmup_secs
    while t < profile.fault_secs or (profile.db_faults and owed):
        kind = rng.choices(kinds, weights=weights)[0]
        if len(faults) % every == every - 1 and owed:
            kind = owed[0]
        if kind in owed:
            owed.remove(kind)
        if kind in SYSTEM_DATABASE_FAULTS:
            # Its executor's death, then the server down past the SDK's first reconnect attempts.
            target = rng.randrange(profile.executors)
            duration = round(rng.uniform(2.0, 4.0), 2)
        elif kind in DATABASE_FAULTS:
            # A few seconds: past a lease renewal and the SDK's reconnect, within the grace period's
            # reach; then time for every instance to be ready again.
            target = -1
            duration = round(rng.uniform(2.0, 5.0), 2)
            if kind == "db_pause":
                duration = round(profile.lease_secs + rng.uniform(1.0, 2.0), 2)
        elif kind in INSTANCE_FAULTS:
            target = rng.randrange(profile.relay_instances)
            # Down (or paused) past its lease, so that another instance adopts it.
            duration = round(profile.lease_secs + rng.uniform(1.0, 3.0), 2) if kind != "relay_restart" else 0.0
        else:
            target = rng.randrange(profile.executors)
            # A pause or a partition outlasts the grace period, so the executor is declared dead.
            duration = round(profile.grace_secs + profile.ping_wait_secs + rng.uniform(1.0, 4.0), 2)
            duration = duration if kind in ("sigstop", "partition") else 0.0
        faults.append(Fault(round(t, 2), kind, target, duration))
        t += duration + rng.uniform(*profile.fault_gap_secs) + settle_secs(profile, kind)
    return faults
