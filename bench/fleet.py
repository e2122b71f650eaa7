"""Fleet benchmark: many simulated executors across several Relay instances behind a balancer.

``--executors`` simulated executors (bench/sim.py: all in this process, protocol-correct,
reconnecting with the same ``executor_id`` one second after their socket drops, as the SDK
does) connect through a TCP balancer to ``--instances`` Relay instances sharing one
PostgreSQL. The balancer is the harness's (harness/balancer.py, run in a process of its own
so that its CPU is counted apart) or, with ``--balancer haproxy``, Debian's haproxy in TCP
mode (round robin, a refused connection retried on another instance, health checks every
0.5 s), which costs the shared machine far less CPU. Liveness is production's: pings
every 20 s, ``executorTimeoutSecs`` 60 s. Three phases, each printed with the machine's
load average and the CPU used meanwhile by each instance, the balancer and this client
(user+sys over the phase, % of one core):

- connect: handshake rate (executors HEALTHY in the registry, over the seconds from the
  first connect), RSS per instance and per connection it holds, then idle CPU of each
  instance over ``--idle-secs`` with every connection held.
- instance loss: one instance is killed (``kill -9``). Reported: the time until every
  executor it held is HEALTHY again and owned by another instance (read from the
  registry through a surviving instance's API every ``POLL_SECS``; from the registry's
  own clock, the last such record's ``connected_at``, which leaves out the seconds that
  listing the whole fleet through the API takes the client; and from the simulated
  executors' own clocks), how many were seen DISCONNECTED or declared DEAD
  (target: none DEAD; the grace period is 60 s), and a trickle of API requests
  (``GET .../executors?limit=1`` every 100 ms, each on a new connection through the
  balancer) with how many failed (target: none).
- mass failure: ``--mass-share`` of the fleet (20 %) is killed at once (sockets aborted,
  no close frame). The grace period is a per-app setting read when a disconnection
  starts, and 60 s would make this phase a minute of waiting: before the abort the app's
  ``executorTimeoutSecs`` is set to ``--mass-grace`` (5 s) through the API
  (``PATCH /v2/orgs/{org}/apps/{app}``), which every instance reads from the database.
  Reported: the time from the abort until the registry holds none of the victims (each
  declared DEAD, recovered through a survivor, verified and deleted) beyond that grace
  (polled through the app's counts, then confirmed on the whole list), per-victim
  milestones (DEAD, recovered and deleted from the audit log; when a survivor answered
  the victim's recovery frame from the survivors' own clocks), and the recovery frames
  per survivor.

At the end, executors declared DEAD that were not among the mass failure's victims are
counted (target: none). The file descriptor soft limit is raised to what the run needs
(the balancer holds two sockets per executor), up to the hard limit. The limit is per
process: when one balancer process cannot hold two sockets per executor under it, several
listen on the same port (SO_REUSEPORT, the kernel spreading connections over them), as
several nodes of a production load balancer would; the client warns when its own share of
sockets does not fit. The benchmark prints figures beside their targets; it asserts none.

Usage, from the project root::

    python -m bench.fleet [--executors 15000] [--instances 3] [--idle-secs 20] [--balancer haproxy] [--log-dir DIR]
    python -m bench.fleet --executors 300 --idle-secs 3     # quick

PostgreSQL is embedded, or the server at ``RELAY_TEST_DATABASE_URL`` if set.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
    patiently,
    print_machine,
    raise_open_files,
    work_directory,
)
from bench.failover import fmt, iso_seconds, report_log
from bench.sim import SDK_RECONNECT_SECS, SimExecutor, kill_all, open_fleet
from harness.balancer import TcpBalancer
from harness.haproxy import Haproxy
from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.procs import end
from harness.relay import RelayProcess, list_all_async, relay_yaml
from harness.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
ORG, APP = "acme", "ledger"
GRACE_SECS = 60.0
FD_SPARE = 1000  # open files a process needs besides its sockets to executors
PING_INTERVAL_SECS = 20.0
PING_WAIT_SECS = 25.0
POLL_SECS = 0.5
TRICKLE_SECS = 0.1
SETTLE_SECS = 2.0
RECONNECT_TARGET_SECS = 10.0
MASS_TARGET_SECS = 5.0


# -- the balancer, in a process of its own -------------------------------------------


def serve_balancer(backends: str, port: int) -> None:
    """Run the harness's balancer in front of ``host:port,host:port...`` until SIGTERM, on ``port``
    (0: any) shared with the other balancer processes; prints its port."""
    pairs = [(hp.rsplit(":", 1)[0], int(hp.rsplit(":", 1)[1])) for hp in backends.split(",")]
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with TcpBalancer(pairs, port=port, reuse_port=True) as balancer:
        print(f"port {balancer.port}", flush=True)
        threading.Event().wait()


class BalancerProcess:
    """The harness's balancer (Python) in a process of its own."""

    def __init__(self, backends: list[RelayProcess], log_path: Path, port: int = 0) -> None:
        argv = [sys.executable, "-m", "bench.fleet", "--balancer-port", str(port), "--serve-balancer"]
        argv.append(",".join(f"127.0.0.1:{r.port}" for r in backends))
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, cwd=ROOT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("port "):
            raise BenchError(f"the balancer did not start (said {line!r}; see {log_path})")
        self.port = int(line.split()[1])

    def stop(self) -> None:
        end(self.proc)


HAPROXY_CONFIG = """\
global
    maxconn {maxconn}
defaults
    mode tcp
    maxconn {maxconn}
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    timeout check 1s
    retries 3
    option redispatch 1
frontend relay
    bind 127.0.0.1:{port} backlog 4096
    default_backend instances
backend instances
    balance roundrobin
{servers}
"""


class HaproxyProcess(BalancerProcess):
    """Debian's haproxy in TCP mode, round robin over the instances. A connection refused by a
    killed instance is retried on another one (``option redispatch``), and the instance is taken
    out of the rotation by a health check every half second; each instance's port is checked
    by a TCP connect, as the Python balancer does."""

    def __init__(self, backends: list[RelayProcess], log_path: Path, maxconn: int, port: int = 0) -> None:
        self.port = port or free_port()  # haproxy binds with SO_REUSEPORT: several share a port
        self.log_path = log_path
        servers = "\n".join(
            f"    server {r.instance_id} 127.0.0.1:{r.port} check inter 500ms fall 1 rise 2" for r in backends
        )
        try:
            self.proc = Haproxy(HAPROXY_CONFIG.format(maxconn=maxconn, port=self.port, servers=servers),
                                self.port, log_path).proc  # fmt: skip
        except RuntimeError as exc:
            raise BenchError(f"--balancer haproxy: {exc}") from exc


# -- measuring -------------------------------------------------------------------------


def own_cpu_secs() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_secs(pid: int) -> float | None:
    """User+sys CPU seconds of a process (psutil reads /proc/<pid>/stat); None once it is gone."""
    try:
        return cpu_secs(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return None


@dataclass
class Meter:
    """CPU seconds of each process at the start of a phase, and the wall clock then."""

    pids: dict[str, int]
    started: float
    cpu: dict[str, float | None]

    @classmethod
    def start(cls, pids: dict[str, int]) -> Meter:
        return cls(pids, time.perf_counter(), cls._read(pids))

    @staticmethod
    def _read(pids: dict[str, int]) -> dict[str, float | None]:
        return {**{name: process_cpu_secs(pid) for name, pid in pids.items()}, "client": own_cpu_secs()}

    def line(self) -> str:
        """'CPU over N s (% of one core): relay-1 x, ..., client z'; a process gone meanwhile shows '-'."""
        wall = time.perf_counter() - self.started
        now = self._read(self.pids)
        parts = []
        for name, before in self.cpu.items():
            after = now.get(name)
            pct = "-" if before is None or after is None else f"{100 * (after - before) / wall:.1f}"
            parts.append(f"{name} {pct}")
        return f"CPU over {wall:.1f} s (% of one core): {', '.join(parts)}; load average {load_average()}"


def describe(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return type(exc).__name__


def rss_mib(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 1024**2


# -- the run ---------------------------------------------------------------------------


class Fleet:
    """The instances, the balancer, the simulated executors, and an API client for each route."""

    def __init__(self, args: argparse.Namespace, pg: Postgres, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        database = pg.create_database("bench_fleet")
        self.database_url = database
        self.relays = [
            RelayProcess(workdir, database, self._config(), instance_id=f"relay-{i + 1}") for i in range(args.instances)
        ]
        # One port; as many processes behind it as their open-file limit needs (two sockets each
        # executor), the kernel spreading connections over them (SO_REUSEPORT).
        self.balancers: list[BalancerProcess] = []
        self.sims: list[SimExecutor] = []
        self.killed: RelayProcess | None = None
        self.mass_victims: set[str] = set()
        self.started_at = time.time()

    def _config(self) -> dict[str, Any]:
        config = relay_yaml(
            free_port(), grace=GRACE_SECS, pingIntervalSecs=PING_INTERVAL_SECS, pingWaitSecs=PING_WAIT_SECS,
            instanceLeaseSecs=self.args.lease_secs,
        )  # fmt: skip
        config["server"]["maxPendingHandshakes"] = max(10_000, self.args.executors)
        return config

    @property
    def live(self) -> list[RelayProcess]:
        return [r for r in self.relays if r.proc is not None and r.proc.poll() is None]

    def pids(self) -> dict[str, int]:
        pids = {r.instance_id: r.proc.pid for r in self.relays if r.proc is not None}
        for i, balancer in enumerate(self.balancers):
            pids["balancer" if len(self.balancers) == 1 else f"balancer-{i + 1}"] = balancer.proc.pid
        return pids

    @contextmanager
    def running(self) -> Iterator[None]:
        try:
            threads = [threading.Thread(target=r.start) for r in self.relays]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if len(self.live) < len(self.relays):
                raise BenchError("not every Relay instance started (see their logs)")
            # haproxy refuses to start when its maxconn needs more open files than it may have.
            maxconn = min(self.args.executors + FD_SPARE, (self.args.open_files - FD_SPARE) // 2)
            balancer: BalancerProcess
            for i in range(self.args.balancers):
                port = self.balancers[0].port if self.balancers else 0
                if self.args.balancer == "haproxy":
                    balancer = HaproxyProcess(self.relays, self.workdir / f"haproxy-{i + 1}.log", maxconn, port)
                else:
                    balancer = BalancerProcess(self.relays, self.workdir / f"balancer-{i + 1}.log", port)
                self.balancers.append(balancer)
            yield
        finally:
            for balancer in self.balancers:
                balancer.stop()
            for relay in self.relays:
                relay.stop()

    @property
    def balancer_port(self) -> int:
        assert self.balancers, "the balancers are not running"
        return self.balancers[0].port

    def api(self, via_balancer: bool = False, **options: Any) -> httpx.AsyncClient:
        if via_balancer:
            base = f"http://127.0.0.1:{self.balancer_port}"
        else:
            base = self.live[0].http
        return httpx.AsyncClient(
            base_url=f"{base}/v2/orgs/{ORG}", headers={"Authorization": f"Bearer {API_KEYS[ORG]}"},
            timeout=30, trust_env=False, **options,
        )  # fmt: skip

    async def registry(self, api: httpx.AsyncClient, expected: set[str] | None = None) -> dict[str, dict[str, Any]]:
        """The app's executors by id. The list is paged in order of id; a record inserted or deleted
        between two pages shifts the later ones, so one can be skipped: those of ``expected`` that no
        page held are read one by one (missing only if that answers 404)."""
        rows = {e["executorId"]: e for e in await list_all_async(api, f"/apps/{APP}/executors")}
        for executor_id in sorted((expected or set()) - set(rows)):
            resp = await api.get(f"/apps/{APP}/executors/{executor_id}")
            if resp.status_code != 404:
                resp.raise_for_status()
                rows[executor_id] = resp.json()
        return rows

    async def counts(self, api: httpx.AsyncClient) -> dict[str, int]:
        """The app's executors by state, as the app's record gives them (no list)."""
        resp = await api.get(f"/apps/{APP}")
        resp.raise_for_status()
        return {str(state): int(n) for state, n in resp.json()["executors"].items()}

    async def healthy_count(self, api: httpx.AsyncClient) -> int:
        return (await self.counts(api)).get("HEALTHY", 0)

    async def record_count(self, api: httpx.AsyncClient) -> int:
        return sum((await self.counts(api)).values())

    # -- phase 1 --

    async def connect(self) -> None:
        args = self.args
        print(
            f"\n== connect: {args.executors} executors through the balancer to {args.instances} instances", flush=True
        )
        await asyncio.sleep(SETTLE_SECS)
        rss0 = {r.instance_id: rss_mib(r.proc.pid) for r in self.relays if r.proc is not None}
        url = f"ws://127.0.0.1:{self.balancer_port}/websocket/{APP}/{CONDUCTOR_KEYS[ORG]}"
        meter, started = Meter.start(self.pids()), time.perf_counter()
        async with self.api() as api:
            opening = asyncio.create_task(open_fleet(url, args.executors, args.concurrency, reconnect=True))
            deadline = started + 120 + args.executors / 50
            while (healthy := await self.healthy_count(api)) < args.executors or not opening.done():
                if time.perf_counter() > deadline:
                    opening.cancel()
                    raise BenchError(
                        f"only {healthy} of {args.executors} executors HEALTHY after {deadline - started:.0f} s"
                    )
                await asyncio.sleep(0.05)
            secs = time.perf_counter() - started
            self.sims = opening.result()
            print(
                f"all {args.executors} HEALTHY in the registry after {secs:.2f} s: "
                f"{args.executors / secs:.0f} handshakes/s"
            )
            print(f"  {meter.line()}", flush=True)
            await asyncio.sleep(SETTLE_SECS)
            owners = Counter(e["relayInstance"] for e in (await self.registry(api)).values())
        for relay in self.relays:
            assert relay.proc is not None
            rss, held = rss_mib(relay.proc.pid), owners.get(relay.instance_id, 0)
            per_conn = f"{(rss - rss0[relay.instance_id]) * 1024 / held:.1f} KiB" if held else "-"
            print(
                f"  {relay.instance_id}: holds {held}; RSS {rss0[relay.instance_id]:.1f} -> {rss:.1f} MiB, "
                f"{per_conn} per connection"
            )
        meter = Meter.start(self.pids())
        await asyncio.sleep(args.idle_secs)
        print(f"idle, every connection held, pings every {PING_INTERVAL_SECS:g} s: {meter.line()}", flush=True)
        if args.idle_secs < PING_INTERVAL_SECS:
            print(f"  note: an idle window shorter than {PING_INTERVAL_SECS:g} s may miss a whole ping round")

    # -- phase 2 --

    async def lose_instance(self) -> None:
        victim = self.relays[-1]
        assert victim.proc is not None
        async with self.api() as api:
            before = await self.registry(api)
        held = {e for e, rec in before.items() if rec["relayInstance"] == victim.instance_id}
        print(f"\n== instance loss: kill -9 {victim.instance_id}, which holds {len(held)} executors", flush=True)
        trickle = Trickle(self.api(via_balancer=True, limits=httpx.Limits(max_keepalive_connections=0)))
        trickle_task = asyncio.create_task(trickle.run())
        await asyncio.sleep(1.0)
        meter = Meter.start(self.pids())
        killed_at = time.time()
        victim.proc.kill()
        victim.proc.wait()
        self.killed = victim
        seen_states: Counter[str] = Counter()
        disconnected: set[str] = set()
        dead: set[str] = set()
        back: float | None = None
        poll_errors: Counter[str] = Counter()
        now: dict[str, dict[str, Any]] = {}
        async with self.api() as api:
            deadline = time.monotonic() + self.args.recovery_timeout
            while time.monotonic() < deadline:
                try:
                    now = await self.registry(api, held)
                except httpx.HTTPError as exc:  # e.g. a keep-alive connection closed as it was reused
                    poll_errors[describe(exc)] += 1
                    await asyncio.sleep(POLL_SECS)
                    continue
                for e in held:
                    state = now[e]["state"] if e in now else "missing"
                    if state == "DISCONNECTED":
                        disconnected.add(e)
                    elif state in ("DEAD", "RECOVERING", "missing"):
                        dead.add(e)
                owned = {
                    e
                    for e in held
                    if e in now and now[e]["state"] == "HEALTHY" and now[e]["relayInstance"] != victim.instance_id
                }
                if owned == held:
                    back = time.time() - killed_at
                    break
                await asyncio.sleep(POLL_SECS)
            else:
                seen_states.update(now[e]["state"] if e in now else "missing" for e in held)
        await asyncio.sleep(1.0)
        trickle.stop = True
        await trickle_task
        by_id = {s.executor_id: s for s in self.sims}
        last_handshake = max((t for e in held for t in by_id[e].reconnects if t >= killed_at), default=math.nan)
        retries = sum((by_id[e].reconnect_errors for e in held), Counter())
        if back is None:
            print(f"NOT all back after {self.args.recovery_timeout:g} s: {dict(seen_states)}")
        else:
            print(
                f"all {len(held)} HEALTHY on the other instances {back:.2f} s after the kill (registry polled every "
                f"{POLL_SECS:g} s; target <= {RECONNECT_TARGET_SECS:g} s); the last reconnect's handshake was answered "
                f"{last_handshake - killed_at:.2f} s after it (the executors wait {SDK_RECONNECT_SECS:g} s "
                "before reconnecting, as the SDK does)"
            )
            written = await self.last_connected(held)
            print(
                f"  by the registry's own clock, the last of them was written HEALTHY {written - killed_at:.2f} s after"
                f" the kill; each poll lists all {len(now)} executors through the API, which saw it"
                f" {back - (written - killed_at):.2f} s later"
            )
        print(f"  failed reconnect attempts: {dict(retries) or 0}")
        others = sum(1 for s in self.sims if s.executor_id not in held and any(t >= killed_at for t in s.reconnects))
        print(f"  other executors that reconnected meanwhile (their instance dropped them): {others}")
        if poll_errors:
            print(f"  polls of the registry that failed: {dict(poll_errors)}")
        print(
            f"  of those, seen by a poll DISCONNECTED: {len(disconnected)}; DEAD, RECOVERING or missing: {len(dead)} "
            "(target: none)"
        )
        print(
            f"  API requests through the balancer every {TRICKLE_SECS * 1000:.0f} ms: {trickle.sent} sent, "
            f"{sum(trickle.failed.values())} failed (target: none)"
            + (f": {dict(trickle.failed)}" if trickle.failed else "")
        )
        print(f"  {meter.line()}", flush=True)

    async def last_connected(self, executors: set[str]) -> float:
        """When the last of ``executors`` was written HEALTHY, by the registry's own ``connected_at``
        (the writing transaction's start, on this machine's clock), read as only a benchmark may."""
        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT extract(epoch FROM max(connected_at)) FROM executors WHERE app = %s AND executor_id = ANY(%s)",
                (APP, sorted(executors)),
            )
            row = await cur.fetchone()
        assert row is not None and row[0] is not None
        return float(row[0])

    # -- phase 3 --

    async def mass_failure(self) -> None:
        args = self.args
        async with self.api() as api:
            resp = await api.patch(f"/apps/{APP}", json={"executorTimeoutSecs": args.mass_grace})
            resp.raise_for_status()
            victims = random.Random(args.seed).sample(self.sims, round(len(self.sims) * args.mass_share))
            self.mass_victims = {v.executor_id for v in victims}
            survivors = [s for s in self.sims if s.executor_id not in self.mass_victims]
            print(
                f"\n== mass failure: {len(victims)} of {len(self.sims)} executors killed at once; "
                f"executorTimeoutSecs set to {args.mass_grace:g} s for this phase",
                flush=True,
            )
            meter = Meter.start(self.pids())
            aborted = time.time()
            for v in victims:
                v.kill()
            gone: float | None = None
            poll_errors: Counter[str] = Counter()
            deadline = time.monotonic() + args.mass_grace + args.recovery_timeout
            while time.monotonic() < deadline:
                # The app's counts are cheap to read; the whole list (thousands of records) only to confirm.
                try:
                    if await self.record_count(api) <= len(survivors) and not self.mass_victims & set(
                        await self.registry(api)
                    ):
                        gone = time.time() - aborted
                        break
                except httpx.HTTPError as exc:  # an overloaded instance may answer 503: poll again
                    poll_errors[describe(exc)] += 1
                await asyncio.sleep(POLL_SECS)
            cpu = meter.line()
            if poll_errors:
                print(f"  polls of the registry that failed meanwhile: {dict(poll_errors)}", flush=True)
            since = {"app": APP, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(aborted - 1))}
            audit: dict[str, list[dict[str, Any]]] = {}
            for action in MILESTONES:
                query = {**since, "action": action}
                audit[action] = await patiently(lambda: list_all_async(api, "/audit", query))  # noqa: B023
            registry = await patiently(lambda: self.registry(api))
            left = Counter(rec["state"] for e, rec in registry.items() if e in self.mass_victims)

        def times(action: str) -> list[float]:
            first: dict[str, float] = {}
            for entry in audit[action]:
                if entry["executorId"] in self.mass_victims:
                    at = iso_seconds(entry["at"]) - aborted - args.mass_grace
                    first[entry["executorId"]] = min(first.get(entry["executorId"], math.inf), at)
            return list(first.values())

        if gone is None:
            waited = args.mass_grace + args.recovery_timeout
            print(f"NOT all victims gone from the registry after {waited:.0f} s: {dict(left)}")
        else:
            print(
                f"the registry held none of them {gone:.2f} s after the abort, {gone - args.mass_grace:.2f} s beyond "
                f"executorTimeoutSecs (polled every {POLL_SECS:g} s; target <= {MASS_TARGET_SECS:g} s)"
            )
        print("  per victim, seconds beyond executorTimeoutSecs")
        print(f"  {'milestone':<32} {'n':>6} {'min':>7} {'p50':>7} {'p99':>7} {'max':>7}")
        answered: dict[str, float] = {}
        for s in survivors:
            for at, ids in s.recoveries:
                for e in set(ids) & self.mass_victims:
                    answered[e] = min(answered.get(e, math.inf), at - aborted - args.mass_grace)
        rows = [(label, times(action)) for action, label in MILESTONES.items()]
        rows.insert(1, ("recovery frame answered", list(answered.values())))
        for label, over in rows:
            print(
                f"  {label:<32} {len(over):>6} {fmt(min(over, default=math.nan)):>7} {fmt(percentile(over, 50)):>7} "
                f"{fmt(percentile(over, 99)):>7} "
                f"{fmt(max(over, default=math.nan)):>7}"
            )
        frames = sorted(sum(1 for at, _ in s.recoveries if at >= aborted) for s in survivors)
        covered = {e for s in survivors for at, ids in s.recoveries if at >= aborted for e in ids}
        print(
            f"  recovery frames: {sum(frames)} to {sum(1 for f in frames if f)} of {len(survivors)} survivors, "
            f"covering {len(covered & self.mass_victims)} of {len(victims)} victims; "
            f"per survivor max {max(frames, default=0)}"
        )
        print(f"  {cpu}", flush=True)

    async def wrongly_dead(self) -> None:
        async with self.api() as api:
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at - 1))
            entries = await list_all_async(api, "/audit", {"app": APP, "since": since, "action": "executor.dead"})
        wrong = {e["executorId"] for e in entries} - self.mass_victims
        print(f"\nexecutors declared DEAD that had not failed, over the whole run: {len(wrong)} (target: none)")


MILESTONES = {
    "executor.dead": "DEAD",
    "recovery.succeeded": "recovered (recovery.succeeded)",
    "executor.deleted": "record deleted",
}


class Trickle:
    """One API request every TRICKLE_SECS until ``stop``; counts those sent and those that failed, by reason."""

    def __init__(self, api: httpx.AsyncClient) -> None:
        self.api = api
        self.stop = False
        self.sent = 0
        self.failed: Counter[str] = Counter()

    async def run(self) -> None:
        async with self.api:
            while not self.stop:
                tick = time.perf_counter()
                self.sent += 1
                try:
                    resp = await self.api.get(f"/apps/{APP}/executors", params={"limit": 1})
                    if resp.status_code != 200:
                        self.failed[f"HTTP {resp.status_code}"] += 1
                except httpx.HTTPError as exc:
                    self.failed[type(exc).__name__] += 1
                await asyncio.sleep(max(0.0, tick + TRICKLE_SECS - time.perf_counter()))


async def run_phases(fleet: Fleet) -> None:
    try:
        await fleet.connect()
        if fleet.args.instances > 1:
            await fleet.lose_instance()
        else:
            print("\n(one instance: no instance loss phase)")
        await fleet.mass_failure()
        await fleet.wrongly_dead()
    finally:
        await kill_all(fleet.sims)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--executors", type=int, default=15_000, help="simulated executors (default 15000)")
    parser.add_argument("--instances", type=int, default=3, help="Relay instances (default 3)")
    parser.add_argument("--idle-secs", type=float, default=20.0, help="idle CPU window, s (default 20)")
    parser.add_argument("--concurrency", type=int, default=200, help="simultaneous opening handshakes (default 200)")
    parser.add_argument("--mass-share", type=float, default=0.2, help="share of the fleet that dies at once (0.2)")
    parser.add_argument("--mass-grace", type=float, default=5.0, help="executorTimeoutSecs in the mass failure, s (5)")
    parser.add_argument("--lease-secs", type=float, default=15.0, help="instanceLeaseSecs (default 15, as Relay's)")
    parser.add_argument("--recovery-timeout", type=float, default=120.0, help="give each phase's recovery this long, s")
    parser.add_argument("--seed", type=int, default=1, help="chooses the mass failure's victims")
    parser.add_argument(
        "--balancer", choices=("python", "haproxy"), default="python",
        help="the harness's balancer (default), or Debian's haproxy (apt-get install -y haproxy)",
    )  # fmt: skip
    parser.add_argument("--log-dir", help="keep logs and configs here (default: a temporary directory)")
    parser.add_argument("--serve-balancer", metavar="BACKENDS", help=argparse.SUPPRESS)
    parser.add_argument("--balancer-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.executors < 2 or args.instances < 1 or not 0 < args.mass_share < 1:
        parser.error("need --executors >= 2, --instances >= 1 and 0 < --mass-share < 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_balancer is not None:
        serve_balancer(args.serve_balancer, args.balancer_port)
        return 0
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # so that the finally blocks stop every process
    print_machine()
    # A balancer process holds two sockets per executor it carries; this process one per
    # executor; the instances a share each. The limit is per process: past half of it, the
    # executors are spread over several balancer processes on one port.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    wanted = 2 * args.executors + FD_SPARE
    limit = raise_open_files(wanted if hard == resource.RLIM_INFINITY else min(wanted, hard))
    if args.executors + FD_SPARE > limit:
        print(f"warning: open file limit {limit} is too low for {args.executors} executors in this process")
    args.open_files = limit
    args.balancers = max(1, math.ceil(2 * args.executors / max(1, limit - FD_SPARE)))
    kind = "haproxy" if args.balancer == "haproxy" else "balancer"
    print(
        f"open file limit {limit}; {args.executors} executors, {args.instances} instances,"
        f" {args.balancers} {kind} process(es) on one port",
        flush=True,
    )
    started = time.perf_counter()
    with work_directory(args.log_dir, "relay-fleet-") as workdir:
        print(f"logs in {workdir}", flush=True)
        pg = Postgres(drop_databases=True)
        try:
            fleet = Fleet(args, pg, workdir)
            try:
                with fleet.running():
                    asyncio.run(run_phases(fleet))
            finally:
                for relay in fleet.relays:
                    report_log(relay.instance_id, relay.log_path, limit=5)
        finally:
            pg.close()
    print(f"\ntotal runtime {time.perf_counter() - started:.1f} s; load average now {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
