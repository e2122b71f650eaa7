"""Routing benchmark: what it costs to ask an executor through a Relay instance
that does not hold its socket.

Two Relay instances, ``relay-1`` and ``relay-2``, share one PostgreSQL; one
simulated executor is connected to ``relay-1``. The REST endpoint
``GET /v2/orgs/{org}/apps/{app}/executors/{executorId}/workflows`` asks the
executor ``list_workflows`` through :class:`relay.router.Router`:

- local: the request goes to ``relay-1``, which holds the socket and asks its
  hub directly;
- routed: the request goes to ``relay-2``, which writes a ``relay_rpc`` row and
  notifies ``relay-1``; ``relay-1`` claims the row, asks the executor, writes the
  reply back and notifies ``relay-2``.

The executor (a thread of this process with its own asyncio loop) answers every
``list_workflows`` at once with an empty ``output``, so what is measured is
Relay and PostgreSQL, not the executor. For each concurrency level c, after a
warm-up of 20 requests per path, ``--requests`` GETs are sent per path by c
concurrent clients (each an ``httpx.AsyncClient`` with a keep-alive connection).
Reported per path and level: requests/s (successful requests over the wall time
of the run), client-side latency p50, p90, p99 and max in ms (the whole HTTP
round trip, successful requests only), and the routed minus local p50 and p99.
Every request must return 200 with a JSON list; any other outcome is counted
and printed as a failure. ``relay-1``'s ``relay_requests_relayed_total`` shows
that the routed requests really went through it.

Usage, from the project root::

    python -m bench.routing [--requests 300] [--concurrency 1,20] [--log-dir DIR]

PostgreSQL is embedded, or the server at ``RELAY_TEST_DATABASE_URL`` if set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from bench.common import (
    BenchError,
    exit_on_sigterm,
    load_average,
    print_machine,
    problem_lines,
    work_directory,
)
from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, open_socket
from harness.stats import percentile
from harness.waiting import assert_eventually

ORG, APP = "acme", "ledger"
WARMUP = 20
REQUEST_TIMEOUT_SECS = 40.0  # longer than the router's own timeout (recoveryAckTimeoutSecs, 30 s)
PATHS = (("local", "relay-1"), ("routed", "relay-2"))


# -- the simulated executor -----------------------------------------------------------


class Executor:
    """One executor on its own thread and asyncio loop: it answers ``list_workflows``
    at once with no workflows, and anything else with an ``error_message``."""

    def __init__(self, url: str, executor_id: str) -> None:
        self.url = url
        self.executor_id = executor_id
        self.requests: Counter[str] = Counter()
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="simulated-executor", daemon=True)
        self._ws: ClientConnection | None = None

    def start(self, timeout: float = 10.0) -> Executor:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise BenchError(f"the simulated executor did not connect within {timeout:g} s")
        if self.error is not None:
            raise BenchError(f"the simulated executor failed to connect: {self.error!r}")
        return self

    def stop(self) -> None:
        if self._thread.is_alive() and self._ws is not None:
            self._loop.call_soon_threadsafe(self._ws.transport.abort)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def _main(self) -> None:
        try:
            self._loop.run_until_complete(self._run())
        except BaseException as exc:  # reported by start() or after the run
            self.error = exc
        finally:
            self._ready.set()

    async def _run(self) -> None:
        self._ws = ws = await open_socket(self.url, proxy=None)
        await handshake(ws, self.executor_id)
        self._ready.set()
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                request = json.loads(frame)
                kind, request_id = request.get("type"), request.get("request_id")
                self.requests[str(kind)] += 1
                reply: dict[str, Any] = {"type": kind, "request_id": request_id}
                if kind == "list_workflows":
                    reply["output"] = []
                else:
                    reply["error_message"] = f"{kind} is not supported by the simulated executor"
                await ws.send(json.dumps(reply))


# -- measuring ---------------------------------------------------------------------------


@dataclass
class Run:
    """One path at one concurrency level."""

    path: str
    concurrency: int
    requests: int
    elapsed: float = 0.0
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests only
    failures: Counter[str] = field(default_factory=Counter)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed > 0 else math.nan

    def ms(self, q: float) -> float:
        value = percentile(self.latencies, q)
        return math.nan if value is None else value * 1000


async def drive(clients: list[httpx.AsyncClient], url: str, run: Run) -> None:
    """Send ``run.requests`` GETs of ``url``, one client per concurrent worker."""
    issued = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal issued
        while issued < run.requests:
            issued += 1
            started = time.perf_counter()
            try:
                resp = await client.get(url)
                body: Any = resp.json() if resp.status_code == 200 else None
            except httpx.HTTPError as exc:
                run.failures[f"{type(exc).__name__}: {exc}"[:160]] += 1
                continue
            except ValueError:
                run.failures[f"HTTP 200 with a body that is not JSON: {resp.text[:100]!r}"] += 1
                continue
            took = time.perf_counter() - started
            if resp.status_code != 200:
                run.failures[f"HTTP {resp.status_code}: {resp.text[:120]}"] += 1
            elif not isinstance(body, list):
                run.failures[f"HTTP 200 with a {type(body).__name__}, not a list"] += 1
            else:
                run.latencies.append(took)

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients))
    run.elapsed = time.perf_counter() - started


async def measure(relay: RelayProcess, path: str, concurrency: int, requests: int, executor_id: str) -> Run:
    """A warm-up, then the measured run, over ``concurrency`` keep-alive clients of ``relay``."""
    url = f"/apps/{APP}/executors/{executor_id}/workflows"
    headers = {"Authorization": f"Bearer {API_KEYS[ORG]}"}
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=f"{relay.http}/v2/orgs/{ORG}",
                    headers=headers,
                    timeout=REQUEST_TIMEOUT_SECS,
                    trust_env=False,
                    limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                )
            )
            for _ in range(concurrency)
        ]
        warmup = Run(path, concurrency, max(WARMUP, concurrency))
        await drive(clients, url, warmup)
        for reason, count in warmup.failures.items():
            print(f"  warm-up failure x{count} ({path}, c={concurrency}): {reason}", flush=True)
        run = Run(path, concurrency, requests)
        await drive(clients, url, run)
    print(
        f"  {path:<6} c={concurrency:<3} {len(run.latencies)}/{requests} ok in {run.elapsed:.2f} s, "
        f"p50 {run.ms(50):.2f} ms",
        flush=True,
    )
    return run


def relayed_total(relay: RelayProcess) -> int:
    headers = {"Authorization": f"Bearer {API_KEYS['acme']}"}
    for line in httpx.get(f"{relay.http}/metrics", headers=headers, timeout=5, trust_env=False).text.splitlines():
        if line.startswith("relay_requests_relayed_total "):
            return int(float(line.split()[1]))
    raise BenchError(f"{relay.instance_id} exposes no relay_requests_relayed_total")


# -- setting up ---------------------------------------------------------------------------


def start_executor(relays: dict[str, RelayProcess]) -> Executor:
    owner = relays["relay-1"]
    executor = Executor(f"ws://127.0.0.1:{owner.port}/websocket/{APP}/{CONDUCTOR_KEYS[ORG]}", f"routing-{uuid.uuid4()}")
    executor.start()

    def healthy_on_relay_1() -> bool:
        for relay in relays.values():  # both must agree: they read the same registry
            record = relay.executor(ORG, APP, executor.executor_id) or {}
            if (record.get("state"), record.get("relayInstance")) != ("HEALTHY", "relay-1"):
                return False
        return True

    assert_eventually(healthy_on_relay_1, 20, 0.05, what="the executor is HEALTHY on relay-1")
    return executor


def run(args: argparse.Namespace, workdir: Path) -> tuple[list[Run], int, Executor | None]:
    """(the runs, the requests relay-1 relayed for relay-2 meanwhile, the executor)."""
    pg = Postgres()
    relays: dict[str, RelayProcess] = {}
    executor: Executor | None = None
    try:
        database = pg.create_database("bench_routing")
        for instance_id in ("relay-1", "relay-2"):  # one after the other: the first applies the migrations
            relays[instance_id] = RelayProcess(workdir, database, relay_yaml(free_port()), instance_id=instance_id)
            relays[instance_id].start()
        executor = start_executor(relays)
        print(f"executor {executor.executor_id} HEALTHY on relay-1", flush=True)
        relayed_before = relayed_total(relays["relay-1"])
        runs: list[Run] = []
        for concurrency in args.concurrency:
            for path, instance_id in PATHS:
                runs.append(
                    asyncio.run(measure(relays[instance_id], path, concurrency, args.requests, executor.executor_id))
                )
        relayed = relayed_total(relays["relay-1"]) - relayed_before
        return runs, relayed, executor
    finally:
        # Relay first: an executor dropped before would start a grace period the instance must wind down.
        for relay in relays.values():
            relay.stop()
        if executor is not None:
            executor.stop()
        for relay in relays.values():
            report_log(relay)
        pg.close()


# -- reporting ---------------------------------------------------------------------------


def report_log(relay: RelayProcess, limit: int = 10) -> None:
    problems = problem_lines(relay.log_path)
    print(f"{relay.instance_id} log {relay.log_path}: {len(problems)} ERROR/WARNING/Traceback line(s)")
    for line in problems[:limit]:
        print(f"    {line[:300]}")


def print_table(runs: list[Run]) -> None:
    print()
    print(
        f"{'path':<7} {'conc':>4} {'requests':>8} {'failed':>6} {'req/s':>8} "
        f"{'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}"
    )
    for r in runs:
        print(
            f"{r.path:<7} {r.concurrency:>4} {r.requests:>8} {r.failed:>6} {r.rate:>8.1f} "
            f"{r.ms(50):>8.2f} {r.ms(90):>8.2f} {r.ms(99):>8.2f} {r.ms(100):>8.2f}"
        )
    by_key = {(r.path, r.concurrency): r for r in runs}
    for concurrency in sorted({r.concurrency for r in runs}):
        local, routed = by_key.get(("local", concurrency)), by_key.get(("routed", concurrency))
        if local is None or routed is None:
            continue
        print(
            f"routed - local at concurrency {concurrency}: p50 {routed.ms(50) - local.ms(50):+.2f} ms, "
            f"p99 {routed.ms(99) - local.ms(99):+.2f} ms"
        )
    for r in runs:
        for reason, count in r.failures.most_common():
            print(f"failure x{count} ({r.path}, concurrency {r.concurrency}): {reason}")


# -- main -------------------------------------------------------------------------------


def concurrency_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers, e.g. 1,20")
    return levels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="measured requests per path and level (default 300)")
    parser.add_argument(
        "--concurrency", type=concurrency_levels, default=[1, 20], help="concurrent clients, levels (default 1,20)"
    )
    parser.add_argument("--log-dir", help="keep Relay's logs and configs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # so that the finally blocks stop every process
    print_machine()
    print(
        f"{args.requests} requests per path and level (after {WARMUP} of warm-up), concurrency {args.concurrency}",
        flush=True,
    )
    started = time.perf_counter()
    with work_directory(args.log_dir, "relay-routing-") as workdir:
        print(f"logs in {workdir}", flush=True)
        runs, relayed, executor = run(args, workdir)
    print_table(runs)
    routed = sum(r.requests + max(WARMUP, r.concurrency) for r in runs if r.path == "routed")
    print(f"relay-1 relayed {relayed} request(s) for relay-2 (routed requests sent, warm-up included: {routed})")
    if executor is not None:
        print(f"the executor received: {dict(executor.requests)}")
        if executor.error is not None:
            print(f"the executor failed: {executor.error!r}")
    print(f"total runtime {time.perf_counter() - started:.1f} s; load average now {load_average()}")
    return 1 if any(r.failed for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
