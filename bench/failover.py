"""Failover benchmark: how long after a failure Relay declares an executor DEAD,
has a peer recover its workflows, and sees them complete.

Part A, real executors (harness/executor_app.py: DBOS applications using
the SDK's own conductor client) against one Relay with sub-second timers. A pool
of ``--peers`` healthy executors stays up; victims fail ``--round`` at a time,
all of one kind, by ``kill -9`` (the socket closes at once) or ``SIGSTOP`` (the
process freezes; Relay notices only when its pings go unanswered). Every victim
of a round is connected before any fails, so no victim is ever chosen as the
peer of another. Each victim starts ``--jobs`` workflows that write evidence,
sleep ``--job-sleep`` seconds durably and record an outcome; it fails once all
of them are inside that sleep (the sleep's checkpoint is in the system
database), so that a frozen victim holds no database transaction open that
would stall its recovery, and the sleep (shorter than the floor) is over by the
time a peer resumes the workflow. ``--warmup`` kill -9 failures come first and
are reported apart (they pay for first uses in Relay, the peers and
PostgreSQL). Each figure is measured from the moment the signal was sent, minus the floor that the configuration imposes
(``executorTimeoutSecs`` for kill -9; ``pingWaitSecs + executorTimeoutSecs`` for
SIGSTOP):

- DEAD: the time of the ``executor.dead`` audit entry (written in the same
  transaction that sets ``deadAt``);
- recovery reply: when the peer sent its reply to Relay's ``recovery`` frame, as
  the peer logs it itself (RELAY_TEST_RECOVERY_LOG: the wall clock right after
  the SDK's ``_recover_pending_workflows`` returns, right before the reply goes out);
- recovered: the ``recovery.succeeded`` audit entry (after Relay's check with
  ``exist_pending_workflows``);
- workflows done: the last of the victim's workflows recording its outcome on a
  peer (``outcomes.at``, ``clock_timestamp()`` in PostgreSQL).

Part B, mass failure: a fresh Relay (``--mass-instances`` instances on one
database, the fleet spread over them in equal parts) and ``--mass`` simulated
executors (all in this process, protocol-correct: they answer ``recovery`` with
success and ``exist_pending_workflows`` with ``exist: false``), then the sockets
of half of them are aborted at the same moment. Reported: the time from the abort
until Relay's registry holds none of them (each declared DEAD, recovered through a
survivor, verified and deleted) minus ``executorTimeoutSecs``, per-victim
milestones from the audit log, the recovery frames the survivors received, and
the CPU of each instance, this client and the machine over the grace and after it.

All clocks are this machine's wall clock (PostgreSQL's timestamps included).
The benchmark prints figures; it asserts no target.

Usage, from the project root::

    python -m bench.failover [--kill9 30] [--sigstop 20] [--warmup 5] [--mass 400] [--log-dir DIR]
    python -m bench.failover --kill9 3 --sigstop 2 --mass 40     # quick

PostgreSQL is embedded, or the server at ``RELAY_TEST_DATABASE_URL`` if set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg

from bench.common import (
    BenchError,
    cpu_secs,
    exit_on_sigterm,
    load_average,
    machine_busy_secs,
    patiently,
    print_machine,
    work_directory,
)
from bench.sim import SimExecutor, kill_all, open_fleet
from harness.executors import ExecutorProcess
from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, list_all, list_all_async, relay_yaml
from harness.stats import percentile
from harness.waiting import assert_eventually

ORG, APP = "acme", "ledger"
# Polling adds load to Relay and PostgreSQL: it starts after the floor and stays slow. It sets no
# figure (all times come from the audit log, the outcomes table and the peers' logs).
POLL_SECS = 0.25
MASS_POLL_SECS = 0.5
PROBLEM_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback")
WARNING_LINE = re.compile(r"\bWARNING\b")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
KINDS = ("kill9", "sigstop")
MILESTONES = (
    ("dead_at", "DEAD"),
    ("reply_at", "recovery reply (peer sent)"),
    ("succeeded_at", "recovered (recovery.succeeded)"),
    ("done_at", "last workflow completed"),
)


# -- small helpers -----------------------------------------------------------------


def iso_seconds(value: str) -> float:
    """Seconds since the epoch of an ISO 8601 time as the API writes it (``...Z``)."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def fmt(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def log_problems(path: Path) -> tuple[list[str], Counter[str]]:
    """(error and traceback lines, warnings counted by message with ids blanked) of a log."""
    if not path.exists():
        return [], Counter()
    errors: list[str] = []
    warnings: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        if PROBLEM_LINE.search(line):
            errors.append(line)
        elif WARNING_LINE.search(line):
            message = line[line.index("WARNING") :]
            warnings[re.sub(r"\d+(\.\d+)?", "N", UUID.sub("<id>", message))] += 1
    return errors, warnings


def report_log(name: str, path: Path, limit: int = 15) -> list[str]:
    errors, warnings = log_problems(path)
    print(f"{name} log {path}: {len(errors)} ERROR/CRITICAL/Traceback line(s), {sum(warnings.values())} warning(s)")
    for line in errors[:limit]:
        print(f"    {line[:300]}")
    for message, count in warnings.most_common(8):
        print(f"    {count:>5} x {message[:200]}")
    return errors


# -- part A: real executors ---------------------------------------------------------


@dataclass
class Failure:
    """One victim: when it failed and when each milestone of its failover came."""

    n: int
    kind: str
    floor: float
    prefix: str
    executor_id: str = ""
    in_sleep: bool = False
    fault_at: float = math.nan
    dead_at: float | None = None
    reply_at: float | None = None
    succeeded_at: float | None = None
    deleted_at: float | None = None
    done_at: float | None = None
    jobs_done: int = 0
    jobs_by_victim: int = 0
    attempts: int = 0
    peer: str | None = None

    def overhead(self, milestone: str) -> float | None:
        at: float | None = getattr(self, milestone)
        return None if at is None else at - self.fault_at - self.floor


class FailoverBench:
    """One Relay, a pool of healthy peers, and victims that fail round after round."""

    def __init__(self, args: argparse.Namespace, pg: Postgres, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.sysdb = pg.create_database("bench_sys")
        self.evidence_url = pg.create_database("bench_evidence")
        config = relay_yaml(
            free_port(), grace=args.grace, pingIntervalSecs=args.ping_interval, pingWaitSecs=args.ping_wait
        )
        self.relay = RelayProcess(workdir, pg.create_database("bench_relay"), config)
        self.floors = {"kill9": args.grace, "sigstop": args.ping_wait + args.grace}
        self.processes: list[ExecutorProcess] = []
        self.peers: list[ExecutorProcess] = []
        self.recovery_logs: list[Path] = []
        self.warmups: list[Failure] = []
        self._lock = threading.Lock()

    def api(self) -> httpx.Client:
        return self.relay.api(ORG)

    def run(self) -> list[Failure]:
        self.relay.start()
        try:
            self.start_peers()
            for start in range(0, self.args.warmup, self.args.round):
                # Not counted: the first failovers pay for first uses in Relay, the peers and PostgreSQL.
                self.warmups += self.run_round(
                    "kill9", list(range(start, min(self.args.warmup, start + self.args.round))), "w"
                )
            failures: list[Failure] = []
            kill9, sigstop = self.args.kill9, self.args.sigstop
            for kind, indices in (("kill9", range(kill9)), ("sigstop", range(kill9, kill9 + sigstop))):
                for start in range(0, len(indices), self.args.round):
                    failures += self.run_round(kind, list(indices[start : start + self.args.round]))
            return failures
        finally:
            for proc in self.processes:
                proc.stop()
            self.relay.stop()

    def start_peers(self) -> None:
        def start(i: int) -> ExecutorProcess:
            log = self.workdir / f"recoveries-peer-{i}.jsonl"
            self.recovery_logs.append(log)
            env = {
                "RELAY_TEST_EVIDENCE": self.evidence_url,
                "RELAY_TEST_RECOVERY_LOG": str(log),
                # One job of its own first, so that no failover pays for the peer's first use of the job's code.
                "RELAY_TEST_JOBS": "1",
                "RELAY_TEST_JOB_SLEEP": "0",
                "RELAY_TEST_JOB_PREFIX": f"warmup-peer{i}",
            }
            return self.spawn(env)

        with ThreadPoolExecutor(self.args.peers) as pool:
            self.peers = list(pool.map(start, range(self.args.peers)))
        ids = {p.executor_id for p in self.peers}
        try:
            assert_eventually(lambda: ids <= self.healthy(), 60, 0.1, what="the peers are HEALTHY")
        except AssertionError as exc:
            tail = "\n".join(self.relay.log().splitlines()[-30:])
            raise BenchError(f"{exc}\n--- the end of Relay's log ---\n{tail}") from None
        warmups = [f"warmup-peer{i}" for i in range(self.args.peers)]
        assert_eventually(
            lambda: all(self.outcomes(warmups).values()), 30, 0.1, what="the peers' warm-up jobs completed"
        )
        print(f"{len(self.peers)} healthy peers: {', '.join(sorted(ids))}", flush=True)

    def spawn(self, env: dict[str, str]) -> ExecutorProcess:
        proc = ExecutorProcess(self.workdir, self.sysdb, self.relay.conductor_url, env=env)
        with self._lock:
            self.processes.append(proc)
        return proc

    def healthy(self) -> set[str]:
        with self.api() as api:
            return {e["executorId"] for e in list_all(api, f"/apps/{APP}/executors", {"state": "HEALTHY"})}

    def run_round(self, kind: str, batch: list[int], tag: str = "f") -> list[Failure]:
        args = self.args
        gate = self.workdir / f"gate-{tag}{batch[0]:04d}"
        failures = [Failure(n, kind, self.floors[kind], f"bench-{tag}{n:04d}") for n in batch]
        peer_ids = {p.executor_id for p in self.peers}

        def victim(failure: Failure) -> ExecutorProcess:
            env = {
                "RELAY_TEST_EVIDENCE": self.evidence_url,
                "RELAY_TEST_JOBS": str(args.jobs),
                "RELAY_TEST_JOB_SLEEP": str(args.job_sleep),
                "RELAY_TEST_JOB_PREFIX": failure.prefix,
                "RELAY_TEST_JOBS_GATE": str(gate),
            }
            proc = self.spawn(env)  # returns once the victim's jobs have started (READY)
            failure.executor_id = proc.executor_id
            failure.in_sleep = self.wait_until_sleeping(failure.prefix)
            failure.fault_at = time.time()
            proc.proc.send_signal(signal.SIGKILL if kind == "kill9" else signal.SIGSTOP)
            return proc

        with ThreadPoolExecutor(len(failures)) as pool:
            futures = [pool.submit(victim, f) for f in failures]
            try:
                # All of the round connect before any of them fails: none can be another's peer.
                assert_eventually(
                    lambda: len(self.healthy() - peer_ids) >= len(batch), 120, 0.1, what="the victims are HEALTHY"
                )
            finally:
                gate.touch()
            victims = [f.result() for f in futures]
        if kind == "kill9":
            for proc in victims:
                proc.proc.wait()
        try:
            self.await_failover(failures)
        finally:
            for proc in victims:  # a frozen victim is killed as it is: never resumed
                proc.proc.kill()
                proc.proc.wait()
        self.collect(failures)
        self.print_round(kind, failures, tag)
        return failures

    def wait_until_sleeping(self, prefix: str, timeout: float = 10.0) -> bool:
        """Wait until each of the victim's jobs has checkpointed its durable sleep."""
        if self.args.job_sleep <= 0 or self.args.jobs <= 0:
            return False
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.sysdb, autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    """SELECT count(DISTINCT workflow_uuid) FROM dbos.operation_outputs
                       WHERE workflow_uuid LIKE %s AND function_name = 'DBOS.sleep'""",
                    (f"{prefix}-%",),
                ).fetchone()
                if row is not None and row[0] >= self.args.jobs:
                    return True
                time.sleep(0.01)
        return False

    def audit(self, executor_id: str) -> list[dict[str, Any]]:
        with self.api() as api:
            resp = api.get("/audit", params={"executorId": executor_id})
        resp.raise_for_status()
        entries: list[dict[str, Any]] = resp.json()
        return entries

    def outcomes(self, prefixes: list[str]) -> dict[str, list[tuple[str, float]]]:
        """Per job prefix: (executor id, completion time) of each job that recorded its outcome."""
        found: dict[str, list[tuple[str, float]]] = {p: [] for p in prefixes}
        with psycopg.connect(self.evidence_url) as conn:
            rows = conn.execute(
                "SELECT workflow_id, executor_id, extract(epoch FROM at)::float8 FROM outcomes "
                "WHERE workflow_id LIKE ANY(%s)",
                ([f"{p}-%" for p in prefixes],),
            ).fetchall()
        for workflow_id, executor_id, at in rows:
            prefix = str(workflow_id).rsplit("-", 1)[0]
            if prefix in found:
                found[prefix].append((str(executor_id), float(at)))
        return found

    def await_failover(self, failures: list[Failure]) -> None:
        """Until each victim's record is deleted and all of its jobs have an outcome."""
        pending = {f.n: f for f in failures}
        deadline = time.monotonic() + self.args.recovery_timeout
        time.sleep(max(0.0, max(f.fault_at + f.floor for f in failures) + 0.3 - time.time()))
        while pending:
            outcomes = self.outcomes([f.prefix for f in pending.values()])
            for f in list(pending.values()):
                if len(outcomes[f.prefix]) < self.args.jobs:
                    continue
                if "executor.deleted" in {e["action"] for e in self.audit(f.executor_id)}:
                    del pending[f.n]
            if not pending:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_SECS)
        print(f"  {len(pending)} failover(s) not finished within {self.args.recovery_timeout:g}s:", flush=True)
        for f in pending.values():
            record = self.relay.executor(ORG, APP, f.executor_id)
            history = [e["action"] for e in self.audit(f.executor_id)]
            with self.api() as api:
                recoveries = api.get(f"/apps/{APP}/recoveries", params={"executorId": f.executor_id}).json()
            print(
                f"    {f.kind} {f.executor_id}: state {record and record['state']}, audit {history}, "
                f"outcomes {len(outcomes[f.prefix])}/{self.args.jobs}, recoveries {json.dumps(recoveries)[:600]}"
            )

    def replies(self) -> dict[str, float]:
        """Dead executor id -> when a peer first sent a recovery reply that covered it."""
        first: dict[str, float] = {}
        for path in self.recovery_logs:
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                for executor_id in entry["executor_ids"]:
                    first[executor_id] = min(first.get(executor_id, math.inf), float(entry["at"]))
        return first

    def collect(self, failures: list[Failure]) -> None:
        outcomes = self.outcomes([f.prefix for f in failures])
        replies = self.replies()
        for f in failures:
            for entry in self.audit(f.executor_id):
                at = iso_seconds(entry["at"])
                if entry["action"] == "executor.dead" and f.dead_at is None:
                    f.dead_at = at
                elif entry["action"] == "recovery.succeeded":
                    f.succeeded_at = at
                    f.peer = entry["peerExecutorId"]
                elif entry["action"] == "executor.deleted":
                    f.deleted_at = at
            f.reply_at = replies.get(f.executor_id)
            done = outcomes[f.prefix]
            f.jobs_done = len(done)
            f.jobs_by_victim = sum(1 for executor_id, _ in done if executor_id == f.executor_id)
            if len(done) >= self.args.jobs:
                f.done_at = max(at for _, at in done)
            with self.api() as api:
                recoveries = api.get(f"/apps/{APP}/recoveries", params={"executorId": f.executor_id}).json()
            f.attempts = sum(len(r.get("attempts") or []) for r in recoveries)

    def print_round(self, kind: str, failures: list[Failure], tag: str) -> None:
        parts = []
        for attr, label in MILESTONES:
            values = [v for f in failures if (v := f.overhead(attr)) is not None]
            if values:
                parts.append(f"{label.split(' (')[0]} +{min(values):.3f}..{max(values):.3f}")
        name = f"warm-up round {failures[0].n}" if tag == "w" else f"round f{failures[0].n:04d}"
        print(f"{name} ({kind} x{len(failures)}, floor {self.floors[kind]:g} s): " + ", ".join(parts), flush=True)


def stats_row(head: str, label: str, values: list[float]) -> str:
    return (
        f"{head}  {label:<32} {len(values):>3} {fmt(percentile(values, 50)):>7} {fmt(percentile(values, 99)):>7} "
        f"{fmt(max(values, default=math.nan)):>7} {fmt(min(values, default=math.nan)):>7}"
    )


def print_failover_table(failures: list[Failure], warmups: list[Failure], args: argparse.Namespace) -> None:
    floors = {"kill9": args.grace, "sigstop": args.ping_wait + args.grace}
    print()
    print(
        f"== failover of real executors: executorTimeoutSecs {args.grace:g}, pingIntervalSecs {args.ping_interval:g}, "
        f"pingWaitSecs {args.ping_wait:g}; {args.peers} peers, {args.round} victims at once, "
        f"{args.jobs} jobs each (durable sleep {args.job_sleep:g} s)"
    )
    print("overhead beyond the floor, seconds (measured from the signal)")
    print(f"{'kind':<8} {'floor':>5}  {'milestone':<32} {'n':>3} {'p50':>7} {'p99':>7} {'max':>7} {'min':>7}")
    groups = [(kind, [f for f in failures if f.kind == kind]) for kind in KINDS]
    for kind, group in groups:
        if not group:
            continue
        for i, (attr, label) in enumerate(MILESTONES):
            values = [v for f in group if (v := f.overhead(attr)) is not None]
            print(stats_row(f"{kind:<8} {floors[kind]:>5.2f}" if i == 0 else " " * 14, label, values))
        after = [f.done_at - f.reply_at for f in group if f.done_at is not None and f.reply_at is not None]
        print(stats_row(" " * 14, "after the reply: last workflow", after))
    if warmups:
        print(
            stats_row(
                f"{'warm-up':<8} {floors['kill9']:>5.2f}",
                "recovery reply (not counted)",
                [v for f in warmups if (v := f.overhead("reply_at")) is not None],
            )
        )
    replies = [v for f in failures if (v := f.overhead("reply_at")) is not None]
    print(
        f"recovery reply overhead over all {len(replies)} failures: p50 {fmt(percentile(replies, 50))} s, "
        f"p99 {fmt(percentile(replies, 99))} s (target: p99 < 0.3 s, issue 15; 0.5 s before it)"
    )
    missing = {label: sum(1 for f in failures if getattr(f, attr) is None) for attr, label in MILESTONES}
    if any(missing.values()):
        print("milestones never seen: " + ", ".join(f"{label}: {n}" for label, n in missing.items() if n))
    not_sleeping = sum(1 for f in failures if not f.in_sleep)
    by_victim = sum(f.jobs_by_victim for f in failures)
    retried = sum(1 for f in failures if f.attempts > 1)
    jobs = sum(f.jobs_done for f in failures)
    peers = Counter(f.peer for f in failures if f.peer)
    print(
        f"{len(failures)} failures; jobs completed {jobs}/{len(failures) * args.jobs}, {by_victim} of them by the "
        f"victim itself; {not_sleeping} victim(s) failed before all their jobs were asleep; "
        f"{retried} recover(ies) needed more than one attempt; recoveries per peer: {sorted(peers.values())}"
    )


# -- part B: mass failure of simulated executors --------------------------------------


@dataclass
class MassResult:
    executors: int
    victims: int
    grace: float
    abort_secs: float
    gone_polled: float | None  # abort -> the first poll that found none of the victims
    dead: list[float]  # per victim, abort -> milestone
    replies: list[float]
    succeeded: list[float]
    deleted: list[float]
    recovery_frames: int
    victims_covered: int
    frames_per_survivor: list[int]
    other_requests: Counter[str]
    survivors_healthy: int
    polls: int
    poll_failures: Counter[str]
    survivors: int
    # CPU seconds used by each instance, this client and the whole machine, read once the fleet was
    # HEALTHY (the settle's start), at the abort, at the grace's end, and when the registry held
    # none of the victims (or at the timeout); and the victims whose sockets each instance held.
    meters: dict[str, Meters]
    held: dict[str, int]


@dataclass
class Meters:
    at: float  # time.monotonic()
    cpu: dict[str, float]  # CPU seconds so far: each instance's, "client" and "machine"


def read_meters(processes: list[tuple[str, psutil.Process]]) -> Meters:
    """CPU seconds so far of each instance, of this client and of the whole machine."""
    cpu = {name: cpu_secs(proc) for name, proc in processes}
    cpu["client"] = cpu_secs(psutil.Process())
    cpu["machine"] = machine_busy_secs()
    return Meters(time.monotonic(), cpu)


async def mass_failure(args: argparse.Namespace, relays: list[RelayProcess]) -> MassResult:
    relay = relays[0]  # the API's listings go through the first instance; the registry is shared
    headers = {"Authorization": f"Bearer {API_KEYS[ORG]}"}
    async with httpx.AsyncClient(
        base_url=f"{relay.http}/v2/orgs/{ORG}", headers=headers, timeout=30, trust_env=False
    ) as api:

        async def listed(state: str | None = None) -> dict[str, str]:
            rows = await list_all_async(api, f"/apps/{APP}/executors", {"state": state} if state else {})
            return {e["executorId"]: e["state"] for e in rows}

        started = time.monotonic()
        fleet: list[SimExecutor] = []
        held_by: dict[str, str] = {}
        try:
            # The fleet is spread over the instances in equal parts, each part connected to its instance.
            parts = await asyncio.gather(
                *(
                    open_fleet(f"ws://127.0.0.1:{r.port}/websocket/{APP}/{CONDUCTOR_KEYS[ORG]}", n, 50)
                    for r, n in zip(relays, shares(args.mass, len(relays)), strict=True)
                ),
                return_exceptions=True,
            )
            for r, part in zip(relays, parts, strict=True):
                if not isinstance(part, BaseException):
                    fleet.extend(part)
                    held_by.update((sim.executor_id, r.instance_id) for sim in part)
            for part in parts:
                if isinstance(part, BaseException):
                    raise part  # the parts that opened are closed below
            processes = [(r.instance_id, psutil.Process(r.proc.pid)) for r in relays if r.proc is not None]
            deadline = time.monotonic() + 60
            while len(await listed("HEALTHY")) < args.mass:
                if time.monotonic() > deadline:
                    raise BenchError(f"not all {args.mass} simulated executors became HEALTHY within 60 s")
                await asyncio.sleep(0.1)
            print(f"{args.mass} simulated executors HEALTHY in {time.monotonic() - started:.1f} s", flush=True)
            meters = {"settled": read_meters(processes)}
            await asyncio.sleep(args.settle)
            victims = random.Random(args.seed).sample(fleet, args.mass // 2)
            victim_ids = {v.executor_id for v in victims}
            survivors = [s for s in fleet if s.executor_id not in victim_ids]
            meters["abort"] = read_meters(processes)
            aborted = time.time()
            for v in victims:
                v.kill()  # as if the process died: no close frame
            abort_secs = time.time() - aborted

            async def at_grace_end() -> None:
                await asyncio.sleep(aborted + args.grace - time.time())
                meters["grace"] = read_meters(processes)

            grace_end = asyncio.create_task(at_grace_end())
            gone: float | None = None
            deadline = time.monotonic() + args.recovery_timeout
            polls, poll_failures = 0, Counter[str]()
            while time.monotonic() < deadline:
                polls += 1
                try:
                    remaining = victim_ids & set(await listed())
                except httpx.HTTPError as exc:  # reported: an operator's listing failed during the failure
                    failed = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
                    poll_failures[f"HTTP {failed}" if failed else type(exc).__name__] += 1
                    await asyncio.sleep(MASS_POLL_SECS)
                    continue
                if not remaining:
                    gone = time.time() - aborted
                    break
                await asyncio.sleep(MASS_POLL_SECS)
            meters["end"] = read_meters(processes)
            if not grace_end.done():  # all gone within the grace: no time after it
                grace_end.cancel()
                meters["grace"] = meters["end"]
            if gone is None:
                states = Counter(s for e, s in (await patiently(listed)).items() if e in victim_ids)
                print(f"  victims still listed after {args.recovery_timeout:g} s: {dict(states)}", flush=True)

            async def audit_entries() -> list[dict[str, Any]]:
                resp = await api.get("/audit", params={"app": APP, "limit": 10_000})
                resp.raise_for_status()
                entries: list[dict[str, Any]] = resp.json()
                return entries

            audit = await patiently(audit_entries)
            # Only the HEALTHY ones: pages of the whole list would shift under the victims' deletions
            # going on meanwhile, and skip survivors.
            now_healthy = await patiently(lambda: listed("HEALTHY"))
        finally:
            # Relay first: survivors dropped before it stops would each start a grace period it must wind down.
            await asyncio.gather(*(asyncio.to_thread(r.stop) for r in relays))
            await kill_all(fleet)

    def times(action: str) -> list[float]:
        first: dict[str, float] = {}
        for e in audit:
            if e["action"] == action and e["executorId"] in victim_ids:
                first[e["executorId"]] = min(first.get(e["executorId"], math.inf), iso_seconds(e["at"]) - aborted)
        return list(first.values())

    replied: dict[str, float] = {}
    for s in survivors:
        for at, ids in s.recoveries:
            for executor_id in ids:
                replied[executor_id] = min(replied.get(executor_id, math.inf), at - aborted)
    return MassResult(
        executors=args.mass,
        victims=len(victims),
        grace=args.grace,
        abort_secs=abort_secs,
        gone_polled=gone,
        dead=times("executor.dead"),
        replies=[t for e, t in replied.items() if e in victim_ids],
        succeeded=times("recovery.succeeded"),
        deleted=times("executor.deleted"),
        recovery_frames=sum(len(s.recoveries) for s in survivors),
        victims_covered=len(victim_ids & set(replied)),
        frames_per_survivor=sorted(len(s.recoveries) for s in survivors),
        other_requests=sum((s.others for s in fleet), Counter()),
        survivors_healthy=sum(1 for s in survivors if s.executor_id in now_healthy),
        polls=polls,
        poll_failures=poll_failures,
        survivors=len(survivors),
        meters=meters,
        held=Counter(held_by[v] for v in victim_ids),
    )


def shares(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal whole shares, the larger first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def print_mass(result: MassResult, args: argparse.Namespace) -> None:
    r = result
    print()
    print(
        f"== mass failure: {r.executors} simulated executors, {r.victims} sockets aborted at once "
        f"(in {r.abort_secs * 1000:.1f} ms); executorTimeoutSecs {r.grace:g}, pingIntervalSecs "
        f"{args.mass_ping_interval:g}, pingWaitSecs {args.mass_ping_wait:g}"
    )
    last = max(r.deleted, default=math.nan)
    if len(r.deleted) == r.victims:
        print(
            f"every victim recovered and deleted {last:.3f} s after the abort (last executor.deleted entry), "
            f"{last - r.grace:.3f} s beyond executorTimeoutSecs (target: <= 5 s)"
        )
    else:
        print(f"only {len(r.deleted)} of {r.victims} victims were deleted (last {fmt(last)} s after the abort)")
    if r.gone_polled is not None:
        print(
            f"  (the registry was first seen without any victim {r.gone_polled:.3f} s after the abort;"
            f" polled every {MASS_POLL_SECS:g} s)"
        )
    print("per victim, seconds after the abort beyond executorTimeoutSecs")
    print(f"  {'milestone':<32} {'n':>4} {'min':>7} {'p50':>7} {'p99':>7} {'max':>7}")
    for label, values in (
        ("DEAD", r.dead),
        ("recovery reply (survivor sent)", r.replies),
        ("recovered (recovery.succeeded)", r.succeeded),
        ("record deleted", r.deleted),
    ):
        over = [v - r.grace for v in values]
        print(
            f"  {label:<32} {len(over):>4} {fmt(min(over, default=math.nan)):>7} {fmt(percentile(over, 50)):>7} "
            f"{fmt(percentile(over, 99)):>7} {fmt(max(over, default=math.nan)):>7}"
        )
    spread = r.frames_per_survivor
    median = percentile(spread, 50)
    print(
        f"recovery frames received by the {r.survivors} survivors: {r.recovery_frames}, covering "
        f"{r.victims_covered} of {r.victims} victims; per survivor min {min(spread, default=0)}, "
        f"median {'-' if median is None else f'{median:g}'}, max {max(spread, default=0)}"
    )
    if r.other_requests:
        print(f"other requests answered with an error: {dict(r.other_requests)}")
    print(f"API listings of the app's executors while it recovered: {r.polls}, failed: {dict(r.poll_failures) or 0}")
    print(f"survivors still HEALTHY afterwards: {r.survivors_healthy}/{r.survivors}")
    print_cpu(r)


def print_cpu(r: MassResult) -> None:
    """CPU in % of a core before the abort, over the grace and after it; and each instance's
    milliseconds per victim it held, as they are and net of what it used before the abort."""
    m = r.meters
    names = [n for n in m["abort"].cpu if n not in ("client", "machine")]
    print(f"CPU, % of a core ({psutil.cpu_count()} CPUs on the machine)")
    print(f"  {'phase':<34} {'secs':>6} " + " ".join(f"{n:>8}" for n in m["abort"].cpu))
    for label, a, b in (
        ("before the abort (the settle)", m["settled"], m["abort"]),
        ("the grace (abort to its end)", m["abort"], m["grace"]),
        ("after it (to the last gone)", m["grace"], m["end"]),
    ):
        secs = b.at - a.at
        cells = " ".join(f"{(b.cpu[n] - a.cpu[n]) * 100 / secs:>8.0f}" if secs > 0 else f"{'-':>8}" for n in a.cpu)
        print(f"  {label:<34} {secs:>6.1f} {cells}")
    settle, window = m["abort"].at - m["settled"].at, m["end"].at - m["abort"].at
    per_victim = []
    for n in names:
        if r.held.get(n):
            used = m["end"].cpu[n] - m["abort"].cpu[n]
            before = (m["abort"].cpu[n] - m["settled"].cpu[n]) / settle * window if settle > 0 else 0.0
            per_victim.append(
                f"{n} {used * 1000 / r.held[n]:.1f} ms, {(used - before) * 1000 / r.held[n]:.1f} net ({r.held[n]})"
            )
    label = "instance CPU per victim it held, abort to the last gone (net: less its rate before the abort)"
    print(f"  {label}: {', '.join(per_victim)}")


def run_mass(args: argparse.Namespace, pg: Postgres, workdir: Path) -> MassResult:
    workdir.mkdir(parents=True, exist_ok=True)
    liveness = {"pingIntervalSecs": args.mass_ping_interval, "pingWaitSecs": args.mass_ping_wait}
    database = pg.create_database("bench_mass")
    relays: list[RelayProcess] = []
    try:
        for i in range(args.mass_instances):
            config = relay_yaml(free_port(), grace=args.grace, **liveness)
            relays.append(RelayProcess(workdir, database, config, instance_id=f"relay-{i + 1}").start())
        return asyncio.run(mass_failure(args, relays))
    finally:
        for relay in relays:
            relay.stop()
            report_log(f"{relay.instance_id} (mass failure)", relay.log_path)


# -- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill9", type=int, default=30, help="kill -9 failures of real executors (default 30)")
    parser.add_argument("--sigstop", type=int, default=20, help="SIGSTOP failures of real executors (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="kill -9 failures first, not counted (default 5)")
    parser.add_argument("--round", type=int, default=5, help="victims that fail at the same moment (default 5)")
    parser.add_argument("--peers", type=int, default=3, help="healthy real executors that recover (default 3)")
    parser.add_argument("--jobs", type=int, default=2, help="workflows per victim (default 2)")
    parser.add_argument("--job-sleep", type=float, default=0.3, help="their durable sleep, s (default 0.3)")
    parser.add_argument("--grace", type=float, default=0.5, help="executorTimeoutSecs (default 0.5)")
    parser.add_argument("--ping-interval", type=float, default=0.1, help="pingIntervalSecs (default 0.1)")
    parser.add_argument("--ping-wait", type=float, default=0.5, help="pingWaitSecs (default 0.5)")
    parser.add_argument("--mass", type=int, default=400, help="simulated executors, half of which die (default 400)")
    parser.add_argument(
        "--mass-ping-interval", type=float, help="pingIntervalSecs in part B (default: --ping-interval)"
    )
    parser.add_argument("--mass-ping-wait", type=float, help="pingWaitSecs in part B (default: --ping-wait)")
    parser.add_argument(
        "--mass-instances", type=int, default=1, help="Relay instances in part B, on one database (default 1)"
    )
    parser.add_argument("--settle", type=float, default=2.0, help="s between part B's fleet being up and the abort")
    parser.add_argument("--recovery-timeout", type=float, default=60.0, help="give a failover up this long, s")
    parser.add_argument("--seed", type=int, default=1, help="chooses part B's victims")
    parser.add_argument("--log-dir", help="keep logs and configs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.mass_ping_interval is None:
        args.mass_ping_interval = args.ping_interval
    if args.mass_ping_wait is None:
        args.mass_ping_wait = args.ping_wait
    if args.round < 1 or args.peers < 1 or args.mass_instances < 1:
        parser.error("--round, --peers and --mass-instances must be at least 1")
    if args.mass > 1 and args.mass_instances > args.mass:
        parser.error("--mass-instances must not exceed --mass")
    return args


def timed(what: str, fn: Callable[[], Any]) -> Any:
    print(f"== {what}; load average now {load_average()}", flush=True)
    started = time.perf_counter()
    try:
        return fn()
    finally:
        print(f"({what} took {time.perf_counter() - started:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # so that the finally blocks stop every process
    print_machine()
    started = time.perf_counter()
    failures: list[Failure] = []
    warmups: list[Failure] = []
    mass: MassResult | None = None
    with work_directory(args.log_dir, "relay-failover-") as workdir:
        print(f"logs in {workdir}", flush=True)
        pg = Postgres()
        try:
            if args.kill9 + args.sigstop > 0:
                if args.job_sleep >= args.grace:
                    print("note: --job-sleep >= --grace, so the jobs' own sleep may delay their completion")
                bench = FailoverBench(args, pg, workdir / "failover")
                try:
                    failures = timed("part A", bench.run)
                finally:
                    warmups = bench.warmups
                    report_log("relay (failover)", bench.relay.log_path)
                    for i, peer in enumerate(bench.peers):
                        errors, _ = log_problems(peer.log_path)
                        if errors:
                            print(f"peer {i} log {peer.log_path}: {len(errors)} ERROR/Traceback line(s), e.g.")
                            for line in errors[:5]:
                                print(f"    {line[:300]}")
            if args.mass > 1:
                mass = timed("part B", lambda: run_mass(args, pg, workdir / "mass"))
        finally:
            pg.close()
    if failures:
        print_failover_table(failures, warmups, args)
    if mass is not None:
        print_mass(mass, args)
    print(f"\ntotal runtime {time.perf_counter() - started:.1f} s; load average now {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
