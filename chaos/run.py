"""One chaos run: start the fleet, play the fault schedule, heal, check, record.

The fleet: ``profile.executors`` executors of app ``ledger`` plus ``profile.decoys``
of the decoy app ``billing``, real DBOS 3.2 processes (chaos/app.py), the decoy on
a system database of its own and the same version string, as separate apps
usually are (so a cross-app recovery is not stopped by DBOS's version check
and shows); each talking through its own TCP proxy (so a partition can
cut one executor off while it keeps running) to a TCP load balancer (round
robin, skipping instances whose /readyz fails) in front of
``profile.relay_instances`` real Relay instances sharing one PostgreSQL.
Processes, proxies, the balancer and PostgreSQL come from ``harness/``, the
same ones the integration tests use. With ``client``, the executors are the
same application on dbos 3.4 using relay_client (harness/client_venv.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from chaos.checker import History, Owner, Timing, check, figures, unresolved
from chaos.dbrules import READY_SLACK_SECS
from chaos.observe import RegistryWatch, time_to_ready
from chaos.record import FORMAT, write_record
from chaos.schedule import (
    DEPLOY_FAULTS,
    SYSDB_LEAD_SECS,
    SYSTEM_DATABASE_FAULTS,
    Fault,
    Profile,
    faults_end,
    settle_secs,
)
from harness.balancer import TcpBalancer
from harness.client_venv import client_python
from harness.executors import await_ready
from harness.keys import CONDUCTOR_KEYS
from harness.pgserver import PostgresServer
from harness.ports import free_port
from harness.postgres import Postgres
from harness.proxy import TcpProxy
from harness.receiver import WebhookReceiver
from harness.relay import RelayProcess, list_all, relay_yaml

ROOT = Path(__file__).resolve().parents[1]
MAIN_APP, DECOY_APP = "ledger", "billing"


@dataclass
class Slot:
    """One executor place in the fleet: a proxy, and the process currently behind it."""

    index: int
    app: str
    version: str
    proxy: TcpProxy
    proc: subprocess.Popen[bytes] | None = None
    executor_id: str = ""
    ids: list[str] = field(default_factory=list)
    drain: Path | None = None  # the current process's CHAOS_DRAIN_FILE (chaos/app.py)


class Interrupted(BaseException):
    """SIGTERM or SIGHUP to a run (chaos/__main__.py turns them into this): not an ``Exception``, so
    that nothing on the way catches it, and every ``finally`` (Fleet.stop) and atexit hook runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.workdir: Path | None = None


class HarnessFailed(Exception):
    """The harness could not run (PostgreSQL unreachable, a process that did not start...): no verdict."""

    def __init__(self, workdir: Path, cause: BaseException) -> None:
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        super().__init__(f"{type(cause).__name__}: {first}" if first else type(cause).__name__)
        self.workdir = workdir


class Fleet:
    def __init__(self, profile: Profile, seed: int, workdir: Path, client: bool = False) -> None:
        """Provisions the databases, the receiver and the instances' configuration; on any failure
        meanwhile (a signal too), stops what it had made before raising."""
        self.profile = profile
        self.seed = seed
        self.workdir = workdir
        self.client = client
        self.slots: list[Slot] = []
        self.relays: list[RelayProcess] = []
        try:
            self._provision()
        except BaseException:
            self.stop()
            raise

    def _provision(self) -> None:
        profile, workdir = self.profile, self.workdir
        self.python = str(client_python()) if self.client else sys.executable
        # On RELAY_TEST_DATABASE_URL's server, the databases made here are dropped at the end.
        self.pg = Postgres(drop_databases=True)
        # With the system database's fault, both apps' system databases are on a server of their own
        # (restarting it fails no other database); the evidence stays on the session's server, so
        # that what the checker reads never goes through a fault.
        self.sys_pg: PostgresServer | None = None
        if profile.db_faults and set(profile.db_kinds) & set(SYSTEM_DATABASE_FAULTS):
            self.sys_pg = PostgresServer("chaos-sys-db")
            self.sysdb = self.sys_pg.url(self.sys_pg.create_database("chaos_sys"))
            self.decoy_sysdb = self.sys_pg.url(self.sys_pg.create_database("chaos_decoy_sys"))
        else:
            self.sysdb = self.pg.create_database("chaos_sys")
            self.decoy_sysdb = self.pg.create_database("chaos_decoy_sys")
        self.evidence = self.pg.create_database("chaos_evidence")
        relay_db = self.pg.create_database("chaos_relay")
        # Every death must reach it as exactly one ExecutorDead idempotency key (the checker).
        self.receiver = WebhookReceiver().__enter__()
        # With database faults, Relay's PostgreSQL is a server of its own behind a TCP proxy,
        # so that it fails alone; the executors' databases stay on self.pg.
        self.relay_pg: PostgresServer | None = None
        self.db_proxy: TcpProxy | None = None
        if profile.db_faults:
            self.relay_pg = PostgresServer("chaos-relay-db")
            self.db_proxy = TcpProxy(("127.0.0.1", self.relay_pg.port)).__enter__()
            relay_db = self.relay_pg.url(self.relay_pg.create_database("chaos_relay"), port=self.db_proxy.port)
        self.relays = [
            RelayProcess(workdir, relay_db, self._config(), instance_id=f"relay-{i + 1}")
            for i in range(profile.relay_instances)
        ]
        self.balancer = TcpBalancer([("127.0.0.1", r.port) for r in self.relays])
        # The registry as the run goes, and when an instance was first seen exited (chaos/dbrules.py).
        self.watch = RegistryWatch(self.relays, (MAIN_APP, DECOY_APP))
        # When the workload stops (a Unix time), read by every executor as it goes: known only
        # once the fleet is up, since starting it may take longer than the warm-up on a loaded machine.
        self.until_file = workdir / "until"

    def _config(self) -> dict[str, Any]:
        profile = self.profile
        config = relay_yaml(
            free_port(), grace=profile.grace_secs,
            pingIntervalSecs=profile.ping_interval_secs, pingWaitSecs=profile.ping_wait_secs,
            recoveryAckTimeoutSecs=10, failoverBackoffInitialSecs=0.5, failoverBackoffMaxSecs=4,
            instanceLeaseSecs=profile.lease_secs,
        )  # fmt: skip
        # Resolutions on (the default): the checker requires every ended death's (checker.death_ends).
        config["alerts"] = {"allowedDestinations": ["127.0.0.1"], "pollIntervalSecs": 0.5,
                            "retryInitialSecs": 0.5, "retryMaxSecs": 2.0, "sendResolutions": True}  # fmt: skip
        if profile.reconcile_secs is not None:  # the reconciler runs among the faults, and must find nothing wrong
            config["reconciler"] = {"enabled": True, "intervalSecs": profile.reconcile_secs}
        rule = {"kind": "ExecutorDead", "webhook": self.receiver.url(), "minIntervalSecs": 0}
        config["orgs"][0]["apps"][0]["alerts"] = [rule]
        return config

    def alerts(self) -> list[dict[str, Any]]:
        return self.receiver.payloads("ExecutorDead")

    def revive(self) -> list[dict[str, Any]]:
        """The process manager's part: start again any instance that exited outside a fault
        (one fenced out because it missed its renewals under load, say); returns those."""
        revived = []
        for relay in self.relays:
            if relay.proc is not None and relay.proc.poll() is not None:
                seen = self.watch.exited.get(relay.proc.pid, time.time())
                revived.append({"instance": relay.instance_id, "exit_code": relay.proc.returncode, "at": seen})
                relay.start()
        return revived

    @property
    def relay(self) -> RelayProcess:
        """An instance that is up, for the API (they all answer for the whole registry)."""
        return next(r for r in self.relays if r.proc is not None and r.proc.poll() is None)

    def stop_workload_at(self, until: float) -> None:
        tmp = self.until_file.with_suffix(".tmp")
        tmp.write_text(repr(until))
        tmp.replace(self.until_file)

    def start(self, until: float) -> None:
        self.stop_workload_at(until)
        for relay in self.relays:
            relay.start()
        self.balancer.__enter__()
        apps = [(MAIN_APP, "v1")] * self.profile.executors + [(DECOY_APP, "v1")] * self.profile.decoys
        for index, (app, version) in enumerate(apps):
            proxy = TcpProxy(("127.0.0.1", self.balancer.port)).__enter__()
            slot = Slot(index, app, version, proxy)
            self.slots.append(slot)
            self.launch(slot)
        self.watch.start()

    def launch(self, slot: Slot) -> None:
        env = {
            **os.environ,
            "CHAOS_APP": slot.app, "CHAOS_VERSION": slot.version,
            "CHAOS_SYSDB": self.sysdb if slot.app == MAIN_APP else self.decoy_sysdb,
            "CHAOS_LIAR": "1" if liar(self.profile, slot.index) else "",
            "CHAOS_EVIDENCE": self.evidence, "CHAOS_CONDUCTOR_URL": f"ws://127.0.0.1:{slot.proxy.port}/",
            "CHAOS_CONDUCTOR_KEY": CONDUCTOR_KEYS["acme"], "CHAOS_UNTIL_FILE": str(self.until_file),
            "CHAOS_INTERVAL": str(self.profile.workload_interval_secs), "CHAOS_SEED": str(self.seed),
            "CHAOS_DRAIN_FILE": str(self.workdir / f"drain-{slot.index}-{len(slot.ids)}"),
            **({"CHAOS_CLIENT": "1"} if self.client else {}),
        }  # fmt: skip
        slot.drain = Path(env["CHAOS_DRAIN_FILE"])
        log = open(self.workdir / f"executor-{slot.index}-{len(slot.ids)}.log", "wb")
        slot.proc = subprocess.Popen(
            [self.python, "-m", "chaos.app"], stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT
        )
        log.close()
        executor_id = await_ready(slot.proc)
        if executor_id is None:
            raise RuntimeError(f"chaos executor {slot.index} ({slot.app}) did not start; see {self.workdir}")
        slot.executor_id = executor_id
        slot.ids.append(slot.executor_id)

    def stop(self) -> None:
        """Stops whatever was started, also of a fleet whose construction or start failed halfway.
        Each part on its own: one that raises is logged and the others are stopped all the same; a
        signal or interrupt that came meanwhile is raised again once everything is stopped."""
        pending: list[BaseException] = []

        def attempt(what: str, stop: Any, *args: Any) -> None:
            try:
                stop(*args)
            except BaseException as exc:  # everything else must still stop
                print(f"chaos: stopping {what} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                if not isinstance(exc, Exception):
                    pending.append(exc)

        parts = self.__dict__
        if "watch" in parts:
            attempt("the registry watch", self.watch.stop)
        for slot in self.slots:
            attempt(f"executor {slot.index}", _end_executor, slot)
        if "balancer" in parts:
            attempt("the balancer", self.balancer.__exit__, None, None, None)
        for relay in self.relays:
            attempt(relay.instance_id, relay.stop)
        if "receiver" in parts:
            attempt("the webhook receiver", self.receiver.__exit__, None, None, None)
        if parts.get("db_proxy") is not None:
            attempt("Relay's database proxy", parts["db_proxy"].__exit__, None, None, None)
        for name in ("relay_pg", "sys_pg", "pg"):
            if parts.get(name) is not None:
                attempt(f"PostgreSQL ({name})", parts[name].close)
        if pending:
            raise pending[0]


def _end_executor(slot: Slot) -> None:
    if slot.proc is not None and slot.proc.poll() is None:
        slot.proc.send_signal(signal.SIGCONT)
        slot.proc.kill()
        slot.proc.wait()
    if slot.proc is not None and slot.proc.stdout is not None:
        slot.proc.stdout.close()
    slot.proxy.__exit__(None, None, None)


def inject(fleet: Fleet, fault: Fault) -> dict[str, Any]:
    """Carry out one fault (blocking for its duration); returns what happened, with times."""
    # Wall time to compare with the audit log's; monotonic for the fault's true length.
    record: dict[str, Any] = {**fault.to_json(), "at": time.time(), "at_mono": time.monotonic(), "executor": None}
    if fault.kind.startswith("db_"):
        _database_fault(fleet, fault)
        record.update(ended=time.time(), ended_mono=time.monotonic())
        # Every running instance must be ready within a lease and ten seconds; a few more to see it late.
        cap = fleet.profile.lease_secs + READY_SLACK_SECS + 5.0
        record["ready_after"] = time_to_ready(fleet.relays, record["ended"], cap)
        return record
    if fault.kind in DEPLOY_FAULTS:
        record.update(_deploy(fleet))
        record.update(ended=time.time(), ended_mono=time.monotonic())
        return record
    if fault.kind.startswith("relay_"):
        relay = fleet.relays[max(fault.target, 0)]
        record["instance"] = relay.instance_id
        record.update(_instance_fault(fleet, relay, fault))
        record.update(ended=time.time(), ended_mono=time.monotonic())
        return record
    slot = fleet.slots[fault.target]
    assert slot.proc is not None
    record["executor"] = slot.executor_id
    if fault.kind == "kill9":
        slot.proc.kill()
        slot.proc.wait()
        fleet.launch(slot)  # its process manager restarts it: a new executor id
    elif fault.kind in SYSTEM_DATABASE_FAULTS:
        record.update(_system_database_fault(fleet, slot, fault))
    elif fault.kind == "sigstop":
        slot.proc.send_signal(signal.SIGSTOP)
        time.sleep(fault.duration)
        slot.proc.send_signal(signal.SIGCONT)
    elif fault.kind == "partition":
        slot.proxy.partition()
        time.sleep(fault.duration)
        slot.proxy.heal()
    record.update(ended=time.time(), ended_mono=time.monotonic())
    return record


def _database_fault(fleet: Fleet, fault: Fault) -> None:
    assert fleet.relay_pg is not None and fleet.db_proxy is not None, "database faults need profile.db_faults"
    if fault.kind == "db_kill":
        fleet.relay_pg.kill9()
        time.sleep(fault.duration)
        fleet.relay_pg.start()
    elif fault.kind == "db_cut":
        fleet.db_proxy.partition()
        time.sleep(fault.duration)
        fleet.db_proxy.heal()
    elif fault.kind == "db_restart":
        fleet.relay_pg.stop()
        time.sleep(fault.duration)
        fleet.relay_pg.start()
    elif fault.kind == "db_pause":
        fleet.relay_pg.pause()
        time.sleep(fault.duration)
        fleet.relay_pg.resume()


def _system_database_fault(fleet: Fleet, slot: Slot, fault: Fault) -> dict[str, Any]:
    """Kill the executor, then stop the system databases' server from just before its grace period
    runs out until after: its recovery is dispatched to a peer whose system database is down."""
    assert fleet.sys_pg is not None and slot.proc is not None, "the system database's fault needs its server"
    slot.proc.kill()
    slot.proc.wait()
    time.sleep(max(0.0, fleet.profile.grace_secs - SYSDB_LEAD_SECS))
    down = time.time()
    fleet.sys_pg.stop()
    time.sleep(fault.duration)
    fleet.sys_pg.start()
    up = time.time()
    fleet.launch(slot)
    return {"sysdb_down": down, "sysdb_up": up}


# How long a deploy waits for each of its stages (the v1 queues drained, the idle executors idle,
# the busy ones' recoveries blocked) before going on regardless (what it found is in its record).
DEPLOY_STAGE_SECS = 30.0


def _deploy(fleet: Fleet) -> dict[str, Any]:
    """A second version of the main app replaces the first (:data:`chaos.schedule.DEPLOY_FAULTS`):
    v2 executors start, the v1 ones are drained (half of them idle), then all killed at once; the
    busy ones' blocked recoveries are then recovered onto the latest version, as an operator would."""
    main = [slot for slot in fleet.slots if slot.app == MAIN_APP]
    old = [(slot.proc, slot.executor_id, slot.drain) for slot in main]
    idle_count = max(1, len(main) // 2)
    for slot in main:
        slot.version = "v2"
        fleet.launch(slot)
    for _, _, drain in old:
        _write(drain, "noqueue")
    queues_drained = _wait(lambda: _count(fleet, "status = 'ENQUEUED' AND application_version = 'v1'") == 0)
    idle = [executor for _, executor, _ in old[:idle_count]]
    busy = [executor for _, executor, _ in old[idle_count:]]
    for _, _, drain in old[:idle_count]:
        _write(drain, "idle")
    quiet = _wait(lambda: all(_count(fleet, "status = 'PENDING' AND executor_id = %s", e) == 0 for e in idle))
    # The busy ones still run some workflow each, so that their recoveries have something to block on.
    _wait(lambda: all(_count(fleet, "status = 'PENDING' AND executor_id = %s", e) > 0 for e in busy))
    pending = {executor: _count(fleet, "status = 'PENDING' AND executor_id = %s", executor) for _, executor, _ in old}
    killed_at = time.time()
    for proc, _, _ in old:
        assert proc is not None
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    recovered: dict[str, Any] = {}
    for executor in busy:
        state = _wait_blocked(fleet, executor)
        recovered[executor] = state
        if state == "blocked":
            with fleet.relay.api() as api:
                resp = api.post(f"/apps/{MAIN_APP}/executors/{executor}/recover", json={"toLatestVersion": True})
            recovered[executor] = resp.status_code
    return {"retired": idle + busy, "killed_at": killed_at, "idle": idle, "busy": busy,
            "queues_drained": queues_drained, "idle_quiet": quiet, "pending_at_kill": pending,
            "recovered_to_latest": recovered}  # fmt: skip


def _write(path: Path | None, text: str) -> None:
    assert path is not None
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _wait(condition: Any, secs: float = DEPLOY_STAGE_SECS) -> bool:
    deadline = time.monotonic() + secs
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _count(fleet: Fleet, where: str, *params: str) -> int:
    with psycopg.connect(fleet.sysdb) as conn:
        row = conn.execute(f"SELECT count(*) FROM dbos.workflow_status WHERE {where}", params).fetchone()
    return int(row[0]) if row else 0


def _wait_blocked(fleet: Fleet, executor: str) -> str:
    """``blocked`` once the executor's record is DEAD with a blocked recovery, ``gone`` once it is
    deleted, else its last state when the wait ends."""
    seen = "unknown"

    def settled() -> bool:
        nonlocal seen
        with fleet.relay.api() as api:
            resp = api.get(f"/apps/{MAIN_APP}/executors/{executor}")
        if resp.status_code == 404:
            seen = "gone"
            return True
        if resp.status_code != 200:
            return False
        record = resp.json()
        seen = "blocked" if record.get("state") == "DEAD" and record.get("blockedReason") else str(record.get("state"))
        return seen == "blocked"

    _wait(settled, fleet.profile.grace_secs + DEPLOY_STAGE_SECS)
    return seen


def _instance_fault(fleet: Fleet, relay: RelayProcess, fault: Fault) -> dict[str, Any]:
    assert relay.proc is not None
    if fault.kind == "relay_kill":
        relay.proc.kill()
        relay.proc.wait()
        time.sleep(fault.duration)
    elif fault.kind == "relay_sigstop":
        relay.signal(signal.SIGSTOP)
        time.sleep(fault.duration)
        relay.signal(signal.SIGCONT)
        # Adopted meanwhile, it must find out at its next renewal and exit.
        try:
            code = relay.proc.wait(fleet.profile.lease_secs + 10)
        except subprocess.TimeoutExpired:
            return {"exit_code": None}  # nobody adopted it in time: it renewed and carries on
        relay.start()
        return {"exit_code": code}
    elif fault.kind == "relay_restart":
        relay.stop()
    relay.start()
    return {}


def gather(fleet: Fleet, faults: list[dict[str, Any]], exits: list[dict[str, Any]]) -> History:
    fleet.watch.stop()  # what it saw is final
    apps = {eid: slot.app for slot in fleet.slots for eid in slot.ids}
    rows = []
    for sysdb in (fleet.sysdb, fleet.decoy_sysdb):
        with psycopg.connect(sysdb) as conn:
            rows += conn.execute(
                """SELECT workflow_uuid, status, executor_id,
                          GREATEST(created_at, COALESCE(started_at_epoch_ms, created_at)), updated_at
                   FROM dbos.workflow_status"""
            ).fetchall()
    workflows = {w: (status, w.split(":", 1)[0]) for w, status, _, _, _ in rows}
    owners = {w: Owner(executor, started / 1000, updated / 1000) for w, _, executor, started, updated in rows}
    with psycopg.connect(fleet.evidence) as conn:
        outcomes = [(w, e, apps.get(e, str(a))) for w, e, a in conn.execute(
            "SELECT workflow_id, executor_id, app FROM outcomes ORDER BY id").fetchall()]  # fmt: skip
        steps = [(w, s, e, apps.get(e, str(a))) for w, s, e, a in conn.execute(
            "SELECT workflow_id, step, executor_id, app FROM step_evidence").fetchall()]  # fmt: skip
    with fleet.relay.api() as api:
        audit = list_all(api, "/audit")  # every entry, oldest first (a page is bounded)
        registry: dict[str, dict[str, Any]] = {}
        for app in (MAIN_APP, DECOY_APP):
            registry.update({e["executorId"]: e for e in list_all(api, f"/apps/{app}/executors")})
    alerts_read_at = time.time()  # after the audit log: every end read has had until now to be resolved
    alerts = fleet.alerts()
    # A workflow id names its app ("ledger:<executor>:<n>", children "<parent>.childN").
    alive = [slot.executor_id for slot in fleet.slots if slot.proc is not None and slot.proc.poll() is None]
    p = fleet.profile
    timing = Timing(p.grace_secs, p.ping_wait_secs, p.ping_interval_secs, p.lease_secs)
    return History(
        workflows, outcomes, steps, audit, registry, faults,
        alerts=alerts, apps=apps, alive=alive, timing=timing, health=fleet.watch.samples, exits=exits,
        owners=owners, alerts_read_at=alerts_read_at,
    )  # fmt: skip


def liar(profile: Profile, index: int) -> bool:
    """The last ``profile.liars`` executor places of the main app answer recovery with success
    without recovering anything: Relay's verification must catch them."""
    return profile.executors - profile.liars <= index < profile.executors


def alerted(fleet: Fleet) -> bool:
    """Whether every death in the audit log has reached the receiver, and the resolution of every
    one of them alerted whose end the log shows (for the wait before gathering)."""
    with fleet.relay.api() as api:
        audit = list_all(api, "/audit")  # every entry, oldest first (a page is bounded)
    alerts = fleet.alerts()
    died = {(e["executorId"], str(e["detail"].get("epoch"))) for e in audit if e["action"] == "executor.dead"}
    return died <= {(p.get("executorId"), str(p.get("epoch"))) for p in alerts} and not unresolved(audit, alerts)


def unfinished(fleet: Fleet) -> list[dict[str, Any]]:
    """What the system database says of workflows that did not finish, for the record."""
    with psycopg.connect(fleet.sysdb) as conn:
        rows = conn.execute(
            """SELECT workflow_uuid, status, name, executor_id, application_version, queue_name
               FROM dbos.workflow_status WHERE status IN ('PENDING', 'ENQUEUED') ORDER BY created_at"""
        ).fetchall()
    keys = ("workflow_id", "status", "name", "executor_id", "application_version", "queue_name")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def settled(fleet: Fleet) -> bool:
    for sysdb in (fleet.sysdb, fleet.decoy_sysdb):
        with psycopg.connect(sysdb) as conn:
            row = conn.execute(
                "SELECT count(*) FROM dbos.workflow_status WHERE status IN ('PENDING', 'ENQUEUED')"
            ).fetchone()
        if row is None or row[0] != 0:
            return False
    return True


def run(
    profile: Profile, seed: int, schedule: list[Fault], out: Path, client: bool = False, replay: bool = False
) -> dict[str, Any]:
    """One run, recorded in ``out`` (chaos/record.py names it); returns the record, with its path as
    ``record``. Raises HarnessFailed when the harness could not run, Interrupted on a signal: both
    after stopping the fleet, and both carry the run's folder."""
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="chaos-", dir=out)).resolve()
    print(f"chaos: run folder {workdir}", flush=True)
    started = time.time()
    fleet: Fleet | None = None
    try:
        try:
            fleet = Fleet(profile, seed, workdir, client)
            history, stuck, clock = _play(fleet, schedule, started)
        finally:
            if fleet is not None:
                fleet.stop()
        violations = check(history)
        result = {
            "format": FORMAT,
            "seed": seed,
            "client": client,
            "profile": profile.to_json(),
            "schedule": [f.to_json() for f in schedule],
            "faults": history.faults,
            "figures": figures(history),
            "violations": violations,
            "unfinished": stuck,
            "unplanned_instance_exits": history.exits,
            "audit": history.audit,  # what the checker judged, to read again after the run
            "ok": not violations,
            "duration_secs": round(time.time() - started, 1),
            "fleet_start_overrun_secs": round(clock.origin - started, 1),
            "schedule_shift_secs": round(clock.shift, 1),
            "workdir": str(workdir),
        }
        path = write_record(out, result, replay)
    except Interrupted as exc:
        exc.workdir = workdir
        raise
    except Exception as exc:
        (workdir / "harness-error.txt").write_text(traceback.format_exc())
        raise HarnessFailed(workdir, exc) from exc
    return {**result, "record": str(path)}


def _play(fleet: Fleet, schedule: list[Fault], started: float) -> tuple[History, list[dict[str, Any]], ScheduleClock]:
    """Starts the fleet, plays the schedule, heals and gathers the history; returns it, the workflows
    left unfinished, and the schedule's clock (its origin, and how far overruns pushed it back)."""
    profile = fleet.profile
    unplanned: list[dict[str, Any]] = []
    end = faults_end(profile, schedule)
    fleet.start(until=started + end)
    # The schedule's clock: the run's start, or later if starting the fleet outlasted the warm-up
    # (faults would otherwise come all at once, before any workload).
    clock = ScheduleClock(max(started, time.time() - profile.warmup_secs))
    fleet.stop_workload_at(clock.origin + end)

    def carry_out(fault: Fault) -> dict[str, Any]:
        unplanned.extend(fleet.revive())
        print(f"[{time.time() - clock.origin:7.1f}s] {fault.kind} {fault.target}", flush=True)
        return inject(fleet, fault)

    done = play_faults(schedule, clock, end, lambda f: settle_secs(profile, f.kind), carry_out, fleet.stop_workload_at)
    print(f"[{time.time() - clock.origin:7.1f}s] heal: no more faults", flush=True)
    deadline = time.time() + profile.heal_timeout_secs
    while time.time() < deadline and not settled(fleet):
        unplanned += fleet.revive()
        time.sleep(1.0)
    unplanned += fleet.revive()
    time.sleep(2 * profile.grace_secs)  # let the last recoveries write their audit entries
    deadline = time.time() + 15.0  # and the last deaths' alerts arrive, and the resolutions of those over
    while time.time() < deadline and not alerted(fleet):
        time.sleep(0.5)
    unplanned += fleet.revive()  # an instance fenced out at the very end counts too
    return gather(fleet, done, unplanned), unfinished(fleet), clock


@dataclass
class ScheduleClock:
    """When each fault of a schedule is due: ``origin`` (a Unix time) plus the fault's ``at``, plus
    ``shift``, how far faults that ran over pushed the rest back. make_schedule puts a random gap and
    a settle time (chaos.schedule.settle_secs) after each fault; a fault that ends later than
    planned (an instance slow to start again, an executor slow to relaunch) may eat into the gap,
    but the next fault comes no sooner than the settle time after it ended, and every later one is
    pushed back as much. Played at its written time, it came at once after the overrun: seed 682129
    under a load of 26 killed a partitioned executor 0.4 ms after the partition healed, before it
    could reconnect, with its newer workflows stranded."""

    origin: float
    shift: float = 0.0

    def due(self, fault: Fault) -> float:
        return self.origin + self.shift + fault.at

    def not_before(self, fault: Fault, earliest: float) -> float:
        """Pushes ``fault`` (and every later one) back so that it is not due before ``earliest``;
        returns by how much (0 when it was not)."""
        push = max(0.0, earliest - self.due(fault))
        self.shift += push
        return push


def play_faults(
    schedule: list[Fault],
    clock: ScheduleClock,
    end: float,
    settle: Callable[[Fault], float],
    carry_out: Callable[[Fault], dict[str, Any]],
    move_workload_end: Callable[[float], None],
) -> list[dict[str, Any]]:
    """Plays ``schedule`` on ``clock``, each fault through ``carry_out`` (which blocks for the fault)
    and no sooner than ``settle`` of the one before after that one ended, then waits for the faults'
    end, ``end`` seconds after the clock's origin and moved with it; returns what ``carry_out``
    returned for each.

    The workload's end moves with the schedule (``move_workload_end``), so that the faults pushed
    back still find the executors at work (a kill of an executor running nothing tests nothing)
    and the heal phase starts as long after the last fault as planned. It moves only while the
    workload runs: an executor that has seen its end pass starts nothing more (chaos/app.py), so a
    later end would restart only the executors launched after it."""
    done = []
    before: tuple[Fault, float, float] | None = None  # the fault before, when it was due and when it ended
    for fault in schedule:
        if before is not None:
            previous, was_due, ended = before
            workload_end = clock.origin + clock.shift + end
            push = clock.not_before(fault, ended + settle(previous))
            if push >= 0.05:  # less is the sleeps' own lateness: pushed back all the same, not worth a line
                over = ended - (was_due + previous.duration)
                print(f"[{time.time() - clock.origin:7.1f}s] {previous.kind} {previous.target} ran {over:.1f} s "
                      f"over: later faults pushed back {push:.1f} s", flush=True)  # fmt: skip
            if push > 0 and time.time() < workload_end:
                move_workload_end(clock.origin + clock.shift + end)
        was_due = clock.due(fault)
        time.sleep(max(0.0, was_due - time.time()))
        done.append(carry_out(fault))
        before = (fault, was_due, time.time())
    time.sleep(max(0.0, clock.origin + clock.shift + end - time.time()))
    return done


def relay_errors(workdir: Path) -> list[str]:
    """ERROR lines of every instance's log, except the expected ones of an instance fenced out."""
    lines = []
    for log in sorted(workdir.glob("relay-*.log")):
        text = log.read_text(errors="replace")
        lines += [f"{log.stem}: {line}" for line in text.splitlines() if " ERROR " in line and "its lease" not in line]
    return lines[:20]
