"""Connection benchmark: Relay against a bare ``websockets`` server.

For each size N, each server is started fresh in its own process and one client
process (this one) opens N simulated DBOS executors that speak the conductor
handshake exactly like the SDK's client. Reported per server and size:

- handshakes/s: N / (first connect until the server holds all N executors),
  read from Relay's ``relay_connections`` gauge or the bare server's counter;
- KiB/conn: server process RSS once the N have settled, minus RSS before the
  first connect, over N;
- idle CPU %: server process user+sys CPU over ``--idle-secs`` with all N held
  and pinged every 20 s, as a percentage of one core.

The bare server (``--bare-server PORT``, started by the benchmark itself) does
the same work as Relay's hub minus Relay: it sends ``executor_info``, awaits
and parses the reply, keeps the socket by executor id and reads it until it
closes. It exposes ``GET /count`` on the same port. Like Relay it declines
permessage-deflate (which the SDK's client offers) and listens with a backlog
of 4096, so that neither difference is measured.

Usage, from the project root::

    python -m bench.connections [--sizes 1000,5000] [--idle-secs 20] [--concurrency 200] [--log-dir DIR]

Relay's databases live in an embedded PostgreSQL, or on the server at
``RELAY_TEST_DATABASE_URL`` if set. Lines of the servers' logs that look like
trouble (ERROR, WARNING, tracebacks) are printed after each run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import yaml
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.http11 import Request, Response
from websockets.protocol import State

from bench.common import (
    BenchError,
    cpu_secs,
    exit_on_sigterm,
    load_average,
    machine_busy_secs,
    print_machine,
    problem_lines,
    raise_open_files,
    work_directory,
)
from harness.keys import sha
from harness.ports import free_port
from harness.postgres import Postgres
from harness.procs import end
from harness.simulated import info_reply

ROOT = Path(__file__).resolve().parents[1]
ORG, APP = "bench", "app"
CONDUCTOR_KEY = "bench-conductor-key"
API_KEY = "bench-api-key"
PING_INTERVAL_SECS = 20.0
SETTLE_SECS = 2.0  # before the baseline RSS, and after the N are held (--settle-secs)
COUNT_TIMEOUT_SECS = 60.0
ABSORB_TIMEOUT_SECS = 120.0
POLL_SECS = 0.02
QUIET_CPU_PCT = 5.0  # below this, a server has finished the work that closing the sockets gave it
MAX_FRAME_BYTES = 64 * 1024 * 1024  # Relay's default maxFrameBytes


# -- the bare server (runs in its own process) ------------------------------------


async def bare_server(port: int) -> None:
    """Serve the executor handshake on ``port`` until killed; ``GET /count`` reports."""
    executors: dict[str, ServerConnection] = {}
    handshakes = 0

    async def handler(ws: ServerConnection) -> None:
        nonlocal handshakes
        request_id = uuid.uuid4().hex
        await ws.send(json.dumps({"type": "executor_info", "request_id": request_id}))
        async with asyncio.timeout(10):  # Relay's default handshakeTimeoutSecs
            reply = json.loads(await ws.recv())
        if reply.get("type") != "executor_info" or reply.get("request_id") != request_id:
            await ws.close(4400, "bad executor_info reply")
            return
        executor_id = str(reply["executor_id"])
        executors[executor_id] = ws
        handshakes += 1
        try:
            async for _ in ws:
                pass
        finally:
            if executors.get(executor_id) is ws:
                del executors[executor_id]

    def counter(ws: ServerConnection, request: Request) -> Response | None:
        if request.path != "/count":
            return None
        return ws.respond(HTTPStatus.OK, json.dumps({"open": len(executors), "handshakes": handshakes}))

    async with serve(
        handler, "127.0.0.1", port, process_request=counter, ping_interval=PING_INTERVAL_SECS, ping_timeout=None,
        compression=None, max_size=MAX_FRAME_BYTES, backlog=4096,
    ) as server:  # fmt: skip
        await server.serve_forever()


# -- the servers under test --------------------------------------------------------


class ServerProcess:
    """A server under test in its own process, with its output in a log file."""

    name = "?"

    def __init__(self, workdir: Path, label: str) -> None:
        self.port = free_port()
        self.log_path = workdir / f"{label}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def ws_url(self) -> str:
        raise NotImplementedError

    def launch(self) -> None:
        raise NotImplementedError

    async def ready(self, http: httpx.AsyncClient) -> bool:
        raise NotImplementedError

    async def held(self, http: httpx.AsyncClient) -> int:
        """How many executor connections the server holds right now."""
        raise NotImplementedError

    async def absorbed(self, n: int, since: float) -> Absorbed | None:
        """How long after ``since`` the server's records showed ``n`` closed sockets (None: it keeps none)."""
        return None

    def _popen(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    @property
    def process(self) -> psutil.Process:
        assert self.proc is not None
        return psutil.Process(self.proc.pid)

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise BenchError(f"{self.name} server is not running (exit code {code})")

    async def start(self, http: httpx.AsyncClient, timeout: float = 60.0) -> None:
        self.launch()
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if await self.ready(http):
                    return
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} server not ready within {timeout:g}s")
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        end(self.proc, 15)

    def problems(self) -> list[str]:
        """Log lines that look like trouble: errors, warnings, tracebacks."""
        return problem_lines(self.log_path)


class RelayServer(ServerProcess):
    """``relay serve`` with a fresh database."""

    name = "relay"

    def __init__(self, workdir: Path, label: str, database_url: str) -> None:
        super().__init__(workdir, label)
        self.workdir = workdir
        self.database_url = database_url
        self.config_path = workdir / f"{label}.yaml"
        self.trace = False

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/websocket/{APP}/{CONDUCTOR_KEY}"

    def config(self) -> dict[str, Any]:
        return {
            "server": {"host": "127.0.0.1", "port": self.port, "maxPendingHandshakes": 10_000},
            "liveness": {"pingIntervalSecs": PING_INTERVAL_SECS, "pingWaitSecs": PING_INTERVAL_SECS + 5},
            "orgs": [
                {
                    "name": ORG,
                    "conductorKeys": [{"name": "k", "sha256": sha(CONDUCTOR_KEY)}],
                    "apiKeys": [{"name": "ops", "sha256": sha(API_KEY), "role": "admin"}],
                    "apps": [{"name": APP, "executorTimeoutSecs": 60}],
                }
            ],
        }

    def launch(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.config()))
        env = {**os.environ, "RELAY_INSTANCE_ID": "bench"}
        for name in ("RELAY_DATABASE_URL", "RELAY_CONFIG", "RELAY_LOG_LEVEL"):
            env.pop(name, None)
        argv = [sys.executable, "-m", "relay", "serve", "--config", str(self.config_path)]
        self._popen([*argv, "--database-url", self.database_url], env, self.workdir)

    async def ready(self, http: httpx.AsyncClient) -> bool:
        return (await http.get(f"http://127.0.0.1:{self.port}/readyz")).status_code == 200

    async def held(self, http: httpx.AsyncClient) -> int:
        resp = await http.get(f"http://127.0.0.1:{self.port}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        resp.raise_for_status()
        match = re.search(r"^relay_connections ([0-9.e+]+)$", resp.text, re.MULTILINE)
        if match is None:
            raise BenchError("relay /metrics has no relay_connections line")
        return int(float(match.group(1)))

    async def absorbed(self, n: int, since: float) -> Absorbed | None:
        """Read Relay's database (as only a benchmark may) until the n closes are in the registry,
        their grace periods are started (DBOS workflow rows, PENDING) and each one's durable
        timer is recorded (its ``DBOS.sleep`` checkpoint, written when ``DBOS.recv`` begins)."""
        marks: dict[str, float | None] = {"registry": None, "started": None, "timers": None}
        deadline = time.perf_counter() + ABSORB_TIMEOUT_SECS
        traced = -1.0
        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            while time.perf_counter() < deadline and any(v is None for v in marks.values()):
                cur = await conn.execute(
                    """SELECT (SELECT count(*) FROM executors WHERE state = 'DISCONNECTED'),
                              (SELECT count(*) FROM dbos.workflow_status WHERE name = 'relay.grace_period'),
                              (SELECT count(*) FROM dbos.operation_outputs o
                                 JOIN dbos.workflow_status w ON w.workflow_uuid = o.workflow_uuid
                                WHERE w.name = 'relay.grace_period' AND o.function_name = 'DBOS.sleep')"""
                )
                row = await cur.fetchone()
                assert row is not None
                now = time.perf_counter() - since
                if self.trace and now - traced >= 1.0:
                    traced = now
                    print(f"    {now:5.1f} s: {row[0]} DISCONNECTED, {row[1]} grace periods, {row[2]} timers;"
                          f" load {load_average()}", flush=True)  # fmt: skip
                for name, count in zip(marks, row, strict=True):
                    if marks[name] is None and count >= n:
                        marks[name] = now
                await asyncio.sleep(POLL_SECS * 5)
        return Absorbed(marks["registry"], marks["started"], marks["timers"])


class BareServer(ServerProcess):
    """The bare websockets server of this module, in a subprocess."""

    name = "bare"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/websocket/{APP}/{CONDUCTOR_KEY}"

    def launch(self) -> None:
        argv = [sys.executable, "-m", "bench.connections", "--bare-server", str(self.port)]
        self._popen(argv, dict(os.environ), ROOT)

    async def ready(self, http: httpx.AsyncClient) -> bool:
        return (await http.get(f"http://127.0.0.1:{self.port}/count")).status_code == 200

    async def held(self, http: httpx.AsyncClient) -> int:
        resp = await http.get(f"http://127.0.0.1:{self.port}/count")
        resp.raise_for_status()
        return int(resp.json()["open"])


async def wait_for_held(server: ServerProcess, http: httpx.AsyncClient, expected: int) -> int:
    """Poll until the server holds ``expected`` connections; returns the last count seen."""
    deadline = time.monotonic() + COUNT_TIMEOUT_SECS
    while True:
        server.check_alive()
        held = await server.held(http)
        if held == expected:
            return held
        if time.monotonic() > deadline:
            raise BenchError(f"{server.name} holds {held} connections, not {expected}, after {COUNT_TIMEOUT_SECS:g}s")
        await asyncio.sleep(POLL_SECS)


# -- the simulated executors (all in this process) ---------------------------------


async def answer_requests(ws: ClientConnection) -> None:
    """Answer whatever Relay asks after the handshake, as an executor that supports nothing."""
    with contextlib.suppress(ConnectionClosed):
        async for message in ws:
            request = json.loads(message)
            reply = {"type": request.get("type"), "request_id": request.get("request_id")}
            await ws.send(json.dumps({**reply, "error_message": "not supported"}))


@dataclass
class Fleet:
    """N simulated executors connected to one server."""

    url: str
    sockets: list[ClientConnection] = field(default_factory=list)
    readers: list[asyncio.Task[None]] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)

    @property
    def open_count(self) -> int:
        return sum(1 for ws in self.sockets if ws.state is State.OPEN)

    async def open(self, n: int, concurrency: int) -> None:
        gate = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(self._open_one(gate) for _ in range(n)))

    async def _open_one(self, gate: asyncio.Semaphore) -> None:
        async with gate:
            try:
                ws = await connect(self.url, ping_interval=None, proxy=None, max_size=None, open_timeout=60)
            except (OSError, TimeoutError, WebSocketException) as exc:
                self.failures[f"connect: {type(exc).__name__}: {exc}"] += 1
                return
            try:
                async with asyncio.timeout(60):
                    request = json.loads(await ws.recv())
                await ws.send(info_reply(request["request_id"], str(uuid.uuid4()), hostname="bench"))
            except (TimeoutError, WebSocketException, ValueError, KeyError) as exc:
                self.failures[f"handshake: {type(exc).__name__}: {exc}"] += 1
                await ws.close()
                return
        self.sockets.append(ws)
        self.readers.append(asyncio.create_task(answer_requests(ws)))

    async def close(self) -> None:
        await asyncio.gather(*(ws.close() for ws in self.sockets), return_exceptions=True)
        await asyncio.gather(*self.readers, return_exceptions=True)
        self.sockets.clear()
        self.readers.clear()


# -- measuring ---------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """What was measured while the connections were open."""

    opened: int
    handshake_secs: float
    handshake_cpu: dict[str, float]  # CPU seconds spent in the handshake phase, by whom
    rss_held: int
    rss_after_idle: int
    idle_cpu_pct: float
    held_after_idle: int
    threads_held: int
    idle_covers_pings: bool  # every connection got its first ping inside the idle window


@dataclass(frozen=True)
class Absorbed:
    """Seconds from the first close until Relay's records held every close (None: not within the wait)."""

    registry: float | None  # every executor DISCONNECTED in the registry
    started: float | None  # every grace period's DBOS workflow exists
    timers: float | None  # every grace period's durable timer is recorded


@dataclass(frozen=True)
class Result:
    server: str
    conns: int
    failed: int
    handshakes_per_sec: float
    kib_per_conn: float
    kib_per_conn_after_idle: float
    idle_cpu_pct: float
    idle_covers_pings: bool
    dropped_while_idle: int
    close_secs: float
    busy_after_close_secs: float | None  # None: still busy when we gave up waiting
    max_threads_after_close: int
    absorbed: Absorbed | None  # None: a server that keeps no records (the bare one)
    handshake_cpu: dict[str, float]  # CPU seconds over the handshakes: server, client, machine
    round: int = 0


def cpu_meters(server: ServerProcess) -> dict[str, float]:
    """CPU seconds used so far by the server, this client, and the whole machine."""
    return {"server": cpu_secs(server.process), "client": cpu_secs(psutil.Process()), "machine": machine_busy_secs()}


async def handshakes(server: ServerProcess, fleet: Fleet, n: int, concurrency: int, http: httpx.AsyncClient) -> Held:
    """Open the fleet and wait until the server holds it; the rest of Held is left at zero."""
    gc.collect()  # so that the previous runs' garbage is not collected on this run's clock
    cpu0, started = cpu_meters(server), time.perf_counter()
    await fleet.open(n, concurrency)
    opened = fleet.open_count
    await wait_for_held(server, http, opened)
    secs = time.perf_counter() - started
    cpu = {name: used - cpu0[name] for name, used in cpu_meters(server).items()}
    return Held(opened, secs, cpu, 0, 0, 0.0, held_after_idle=0, threads_held=0, idle_covers_pings=False)


async def hold(server: ServerProcess, fleet: Fleet, n: int, args: argparse.Namespace, http: httpx.AsyncClient) -> Held:
    proc = server.process
    held = await handshakes(server, fleet, n, args.concurrency, http)
    await asyncio.sleep(args.settle_secs)
    rss_held = proc.memory_info().rss
    cpu0, wall0 = cpu_secs(proc), time.perf_counter()
    await asyncio.sleep(args.idle_secs)
    idle_cpu_pct = 100 * (cpu_secs(proc) - cpu0) / (time.perf_counter() - wall0)
    # Connections opened at 0..handshake_secs get their first ping PING_INTERVAL_SECS later.
    first_pings_end = held.handshake_secs + PING_INTERVAL_SECS
    idle_start = held.handshake_secs + args.settle_secs
    return replace(
        held,
        idle_covers_pings=idle_start <= PING_INTERVAL_SECS and idle_start + args.idle_secs >= first_pings_end,
        rss_held=rss_held,
        rss_after_idle=proc.memory_info().rss,
        idle_cpu_pct=idle_cpu_pct,
        held_after_idle=await server.held(http),
        threads_held=proc.num_threads(),
    )


@dataclass(frozen=True)
class Quiet:
    """How long a server stayed busy after its sockets closed, and its peak thread count meanwhile."""

    busy_secs: float | None  # None: still busy when we gave up waiting
    max_threads: int


async def wait_quiet(proc: psutil.Process, timeout: float = 120.0, window: float = 1.0) -> Quiet:
    """Wait until ``proc`` uses under QUIET_CPU_PCT of a core over a whole window."""
    started, max_threads = time.perf_counter(), proc.num_threads()
    while time.perf_counter() - started < timeout:
        cpu0 = cpu_secs(proc)
        for _ in range(10):
            await asyncio.sleep(window / 10)
            max_threads = max(max_threads, proc.num_threads())
        if 100 * (cpu_secs(proc) - cpu0) / window < QUIET_CPU_PCT:
            return Quiet(time.perf_counter() - started - window, max_threads)
    return Quiet(None, max_threads)


async def measure(server: ServerProcess, n: int, args: argparse.Namespace, http: httpx.AsyncClient) -> Result:
    await asyncio.sleep(args.settle_secs)
    rss_before = server.process.memory_info().rss
    fleet = Fleet(server.ws_url)
    try:
        held = await hold(server, fleet, n, args, http)
    finally:
        profiler = start_profiler(server, args)
        closing = time.perf_counter()
        await fleet.close()
    try:
        await wait_for_held(server, http, 0)
        close_secs = time.perf_counter() - closing
        absorbed, quiet = await asyncio.gather(server.absorbed(held.opened, closing), wait_quiet(server.process))
    finally:
        stop_profiler(profiler)
    per_conn = max(held.opened, 1) * 1024
    result = Result(
        server=server.name,
        conns=n,
        failed=n - held.opened,
        handshakes_per_sec=held.opened / held.handshake_secs,
        kib_per_conn=(held.rss_held - rss_before) / per_conn,
        kib_per_conn_after_idle=(held.rss_after_idle - rss_before) / per_conn,
        idle_cpu_pct=held.idle_cpu_pct,
        idle_covers_pings=held.idle_covers_pings,
        dropped_while_idle=held.opened - held.held_after_idle,
        close_secs=close_secs,
        busy_after_close_secs=quiet.busy_secs,
        max_threads_after_close=quiet.max_threads,
        absorbed=absorbed,
        handshake_cpu=held.handshake_cpu,
    )
    report_run(result, held, rss_before, fleet.failures)
    return result


def start_profiler(server: ServerProcess, args: argparse.Namespace) -> subprocess.Popen[bytes] | None:
    """py-spy on Relay from the close on (``--profile-closes``), written when stopped: collapsed stacks
    of the thread holding the interpreter's lock (``flamegraph.pl`` or speedscope draw them)."""
    if args.profile_closes is None or not isinstance(server, RelayServer):
        return None
    out = Path(args.profile_closes) / f"{server.log_path.stem}-closes.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    py_spy = Path(sys.executable).with_name("py-spy")
    argv = [str(py_spy), "record", "--pid", str(server.process.pid), "--rate", "50", "--nonblocking", "--gil"]
    argv += ["--format", "raw", "--output", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profiler(profiler: subprocess.Popen[bytes] | None) -> None:
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)
        profiler.wait(timeout=60)


def report_run(result: Result, held: Held, rss_before: int, failures: Counter[str]) -> None:
    mib = 1024 * 1024
    cpu = ", ".join(f"{name} {secs:.2f}" for name, secs in held.handshake_cpu.items())
    print(
        f"  {held.opened} open, {result.failed} failed; all held after {held.handshake_secs:.2f} s"
        f" ({result.handshakes_per_sec:.0f}/s; CPU s meanwhile: {cpu})\n"
        f"  RSS {rss_before / mib:.1f} -> {held.rss_held / mib:.1f} MiB"
        f" ({held.rss_after_idle / mib:.1f} MiB after idle); idle CPU {result.idle_cpu_pct:.2f} %;"
        f" {result.dropped_while_idle} dropped while idle; all closed after {result.close_secs:.2f} s",
        flush=True,
    )
    busy = result.busy_after_close_secs
    print(
        f"  server threads: {held.threads_held} while holding, up to {result.max_threads_after_close} after the close;"
        + (" still busy 120 s after the close" if busy is None else f" busy for {busy:.1f} s more after the close"),
        flush=True,
    )
    if result.absorbed is not None:
        marks = result.absorbed

        def at(secs: float | None) -> str:
            return "not within the wait" if secs is None else f"{secs:.2f} s"

        print(
            f"  closes absorbed (target 2 s): registry up to date {at(marks.registry)},"
            f" grace periods started {at(marks.started)}, their durable timers recorded {at(marks.timers)}",
            flush=True,
        )
    if not held.idle_covers_pings:
        print("  note: the idle window did not cover the first ping round of every connection", flush=True)
    for reason, count in failures.most_common(5):
        print(f"  failure x{count}: {reason}", flush=True)


# -- the run -----------------------------------------------------------------------


def make_server(kind: str, n: int, workdir: Path, pg: Postgres, round_: int = 0) -> ServerProcess:
    suffix = f"_{round_}" if round_ else ""
    label = f"{kind}-{n}{suffix}"
    if kind == "relay":
        return RelayServer(workdir, label, pg.create_database(f"relay_bench_{n}{suffix}"))
    return BareServer(workdir, label)


def report_problems(server: ServerProcess, limit: int = 20) -> None:
    problems = server.problems()
    if problems:
        print(f"  {len(problems)} problem line(s) in the {server.name} log, e.g.:", flush=True)
        for line in problems[:limit]:
            print(f"    {line}", flush=True)


async def run_one(server: ServerProcess, n: int, args: argparse.Namespace, http: httpx.AsyncClient) -> Result | None:
    print(f"== {server.name}, {n} connections", flush=True)
    try:
        await server.start(http)
        return await measure(server, n, args, http)
    except BenchError as exc:
        print(f"  FAILED: {exc}", flush=True)
        return None
    finally:
        server.stop()
        report_problems(server)


async def run_all(args: argparse.Namespace, pg: Postgres, workdir: Path) -> list[Result]:
    results: list[Result] = []
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        for n in args.sizes:
            for round_ in range(args.rounds):
                if args.rounds > 1:
                    print(f"-- round {round_ + 1} of {args.rounds} at {n}", flush=True)
                # Each round starts both servers afresh; their order alternates (ABBA), so that a
                # machine that grows busier or quieter over the rounds favours neither.
                kinds = [kind for kind in ("relay", "bare") if kind in args.servers]
                for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
                    server = make_server(kind, n, workdir, pg, round_)
                    if isinstance(server, RelayServer):
                        server.trace = args.trace_closes
                    result = await run_one(server, n, args, http)
                    if result is not None:
                        results.append(replace(result, round=round_))
    return results


def run(args: argparse.Namespace) -> list[Result]:
    with work_directory(args.log_dir, "relay-bench-") as workdir:
        pg = Postgres(drop_databases=True)
        try:
            return asyncio.run(run_all(args, pg, workdir))
        finally:
            pg.close()


def print_table(results: list[Result]) -> None:
    print()
    print(f"{'server':<7} {'conns':>6} {'failed':>6} {'handshakes/s':>12} {'KiB/conn':>9} {'idle CPU %':>10}")
    for r in results:
        print(
            f"{r.server:<7} {r.conns:>6} {r.failed:>6} {r.handshakes_per_sec:>12.0f}"
            f" {r.kib_per_conn:>9.1f} {r.idle_cpu_pct:>10.2f}{'' if r.idle_covers_pings else ' *'}"
        )
    if not all(r.idle_covers_pings for r in results):
        print("* the idle window did not cover a whole ping round")
    by_key = {(r.server, r.conns, r.round): r for r in results}
    for n in sorted({r.conns for r in results}):
        pairs = [
            (relay, bare)
            for round_ in sorted({r.round for r in results})
            if (relay := by_key.get(("relay", n, round_))) and (bare := by_key.get(("bare", n, round_)))
        ]
        if not pairs:
            continue
        rates = [relay.handshakes_per_sec / bare.handshakes_per_sec for relay, bare in pairs]
        memories = [relay.kib_per_conn / bare.kib_per_conn if bare.kib_per_conn > 0 else float("nan")
                    for relay, bare in pairs]  # fmt: skip
        spread = f"median of {len(pairs)} rounds, {min(rates):.2f} to {max(rates):.2f}; " if len(pairs) > 1 else ""
        print(
            f"ratios at {n}: relay/bare handshake rate {statistics.median(rates):.2f} ({spread}target >= 0.8),"
            f" memory {statistics.median(memories):.2f} (target <= 1.5)"
        )
        # On a machine shared by client, servers and PostgreSQL, the rate follows the CPU that a
        # handshake costs all of them together, not the server's alone.
        for i, kind in enumerate(("relay", "bare")):
            ms = {
                who: statistics.median(
                    1000 * pair[i].handshake_cpu[who] / max(pair[i].conns - pair[i].failed, 1) for pair in pairs
                )
                for who in ("server", "client", "machine")
            }
            print(f"  CPU ms per handshake, {kind}: server {ms['server']:.2f}, client {ms['client']:.2f},"
                  f" whole machine {ms['machine']:.2f}" + (" (medians)" if len(pairs) > 1 else ""))  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.connections", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,5000", type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--idle-secs", default=20.0, type=float, help="idle CPU window (default 20)")
    settle = f"pause before the baseline RSS and once all are held (default {SETTLE_SECS:g})"
    parser.add_argument("--settle-secs", default=SETTLE_SECS, type=float, help=settle)
    parser.add_argument("--concurrency", default=200, type=int, help="simultaneous opening handshakes")
    parser.add_argument("--rounds", default=1, type=int, help="rounds of both servers per size, alternating (ABBA)")
    parser.add_argument("--log-dir", help="keep the servers' logs and configs here (default: a temporary directory)")
    parser.add_argument("--servers", default="relay,bare", type=lambda s: [x for x in s.split(",") if x],
                        help="which servers to run (default relay,bare; relay alone for the closes)")  # fmt: skip
    parser.add_argument("--profile-closes", metavar="DIR",
                        help="record py-spy samples of Relay from the close until it is quiet, into DIR")  # fmt: skip
    parser.add_argument("--trace-closes", action="store_true",
                        help="print Relay's closes absorbed so far each second after the close")  # fmt: skip
    parser.add_argument("--bare-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bare_server is not None:
        asyncio.run(bare_server(args.bare_server))
        return 0
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # so that the finally blocks stop the servers
    print_machine()
    print(f"websockets {version('websockets')}, psutil {psutil.__version__}")
    print(f"sizes {args.sizes}, idle window {args.idle_secs:g} s, {args.concurrency} concurrent handshakes,"
          f" {args.rounds} round(s)", flush=True)  # fmt: skip
    raise_open_files(2 * max(args.sizes) + 1000)
    started = time.perf_counter()
    results = run(args)
    print_table(results)
    print(f"total runtime {time.perf_counter() - started:.1f} s; load average now {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
