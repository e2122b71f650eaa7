"""Workflow API benchmark: Relay's Conductor-compatible API against DBOS's own client, same run.

One Relay (embedded PostgreSQL) and ``--executors`` real DBOS executors of one
app share a system database holding ``--workflows`` finished workflows. Two
operations are measured both ways:

- search: ``POST /v2/orgs/{org}/apps/{app}/workflows/search`` with
  ``{"limit": 100}`` through Relay (Relay asks an executor ``list_workflows``
  over its WebSocket), against ``DBOSClient.list_workflows_async(limit=100)``
  reading the system database directly;
- get: ``GET .../workflows/{id}`` through Relay, against
  ``DBOSClient.retrieve_workflow_async(id).get_status()``.

A third column, "sdk", is the floor any conductor that serves the API through
its executors (Relay, DBOS Conductor) stands on: the same protocol request
Relay would send (``list_workflows`` with the same body, ``get_workflow``),
sent by a bare ``websockets`` server straight to one more executor of the same
app that connects to it instead of to Relay, and its reply read with
``json.loads``. Relay's overhead over it is Relay's own (HTTP, keys, the
registry, routing, the translation to Conductor's shapes); the rest of the
overhead over direct is the SDK's conductor client answering on its socket.

For each concurrency level c, after a warm-up, ``--requests`` operations are
made by c concurrent clients (Relay: each an ``httpx.AsyncClient`` with a
keep-alive connection; direct: c tasks over one DBOSClient). Reported: requests/s,
latency p50/p90/p99 in ms, and Relay's p50 overhead and throughput ratio
against direct (targets: overhead at c=1 at most 3 ms; throughput at least
0.5x). Every Relay request must answer 200 with the expected body; anything
else is counted as a failure.

Usage, from the project root::

    python -m bench.api [--requests 300] [--concurrency 1,20] [--executors 2] [--workflows 200]

PostgreSQL is embedded, or the server at ``RELAY_TEST_DATABASE_URL`` if set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from dbos import DBOSClient, WorkflowHandleAsync
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from bench.common import BenchError, exit_on_sigterm, print_machine, work_directory
from harness.executors import Evidence, ExecutorProcess
from harness.keys import API_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.stats import percentile
from harness.waiting import assert_eventually
from relay.api.workflows import WorkflowSearch
from relay_protocol import GetWorkflowRequest, ListWorkflowsRequest

ORG, APP = "acme", "ledger"
WARMUP = 20


@dataclass
class Run:
    path: str
    concurrency: int
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)

    def rate(self) -> float:
        return len(self.latencies) / self.wall if self.wall else 0.0

    def ms(self, q: float) -> float:
        value = percentile(self.latencies, q)
        return float("nan") if value is None else value * 1000


async def drive(run: Run, requests: int, operation: Callable[[int], Awaitable[str | None]]) -> Run:
    """``requests`` operations by ``run.concurrency`` workers; an operation returns a failure's name or None."""
    counter = iter(range(requests))

    async def worker() -> None:
        for n in counter:
            started = time.perf_counter()
            failure = await operation(n)
            if failure is None:
                run.latencies.append(time.perf_counter() - started)
            else:
                run.failures[failure] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(run.concurrency)))
    run.wall = time.perf_counter() - started
    return run


class BareConductor:
    """A ``websockets`` server that executors connect to as to a conductor, and nothing else: it
    sends protocol requests and hands back the replies, by request id (the floor under Relay)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sockets: list[ServerConnection] = []
        self.waiting: dict[str, asyncio.Future[dict[str, object]]] = {}
        self._turn = 0

    async def _serve(self, ws: ServerConnection) -> None:
        self.sockets.append(ws)
        with contextlib.suppress(ConnectionClosed):  # the executor stopped at the end of the run
            async for message in ws:
                frame = json.loads(message)
                future = self.waiting.pop(str(frame.get("request_id")), None)
                if future is not None and not future.done():
                    future.set_result(frame)

    async def ask(self, frame: dict[str, object]) -> dict[str, object]:
        ws = self.sockets[self._turn % len(self.sockets)]
        self._turn += 1
        future: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
        self.waiting[str(frame["request_id"])] = future
        await ws.send(json.dumps(frame))
        return await asyncio.wait_for(future, 30)


async def measure(
    workdir: Path, relay: RelayProcess, sysdb: str, ids: list[str], concurrency: list[int], requests: int
) -> list[tuple[Run, Run, Run]]:
    client = DBOSClient(system_database_url=sysdb)
    bare = BareConductor()
    triples: list[tuple[Run, Run, Run]] = []
    async with serve(bare._serve, "127.0.0.1", bare.port, max_size=None):
        executor = await asyncio.to_thread(ExecutorProcess, workdir, sysdb, f"ws://127.0.0.1:{bare.port}/")
        try:
            await asyncio.to_thread(assert_eventually, lambda: bare.sockets, 30, what="an executor at the bare server")
            for c in concurrency:
                triples += await measure_level(relay, client, bare, ids, c, requests)
        finally:
            executor.stop()
            client.destroy()
    return triples


async def measure_level(
    relay: RelayProcess, client: DBOSClient, bare: BareConductor, ids: list[str], c: int, requests: int
) -> list[tuple[Run, Run, Run]]:
    base = f"{relay.http}/v2/orgs/{ORG}/apps/{APP}"
    headers = {"Authorization": f"Bearer {API_KEYS[ORG]}"}
    https = [httpx.AsyncClient(base_url=base, headers=headers, timeout=30, trust_env=False) for _ in range(c)]
    turn = iter(range(10**9))
    expected = min(100, len(ids))

    def http() -> httpx.AsyncClient:
        return https[next(turn) % c]

    async def relay_search(_: int) -> str | None:
        resp = await http().post("/workflows/search", json={"limit": 100})
        if resp.status_code != 200:
            return f"search {resp.status_code}"
        return None if len(resp.json()) == expected else "search: wrong count"

    async def direct_search(_: int) -> str | None:
        rows = await client.list_workflows_async(limit=100, load_input=False, load_output=False)
        return None if len(rows) == expected else "direct search: wrong count"

    search_body = WorkflowSearch(limit=100).body()

    async def sdk_search(_: int) -> str | None:
        reply = await bare.ask(ListWorkflowsRequest(body=search_body).to_frame())
        output = reply.get("output")
        return None if isinstance(output, list) and len(output) == expected else "sdk search: wrong count"

    async def sdk_get(n: int) -> str | None:
        workflow_id = ids[n % len(ids)]
        reply = await bare.ask(GetWorkflowRequest(workflow_id=workflow_id).to_frame())
        output = reply.get("output")
        found = output.get("WorkflowUUID") if isinstance(output, dict) else None
        return None if found == workflow_id else "sdk get: wrong workflow"

    async def relay_get(n: int) -> str | None:
        workflow_id = ids[n % len(ids)]
        resp = await http().get(f"/workflows/{workflow_id}")
        if resp.status_code != 200:
            return f"get {resp.status_code}"
        return None if resp.json()["workflowId"] == workflow_id else "get: wrong workflow"

    async def direct_get(n: int) -> str | None:
        workflow_id = ids[n % len(ids)]
        handle: WorkflowHandleAsync[object] = await client.retrieve_workflow_async(workflow_id)
        status = await handle.get_status()
        return None if status.workflow_id == workflow_id else "direct get: wrong workflow"

    ways = {
        "search": (relay_search, direct_search, sdk_search),
        "get": (relay_get, direct_get, sdk_get),
    }
    triples: list[tuple[Run, Run, Run]] = []
    try:
        for name, (via_relay, direct, sdk) in ways.items():
            for operation in (via_relay, direct, sdk):
                await drive(Run(name, c), WARMUP, operation)
            relayed = await drive(Run(f"relay {name}", c), requests, via_relay)
            straight = await drive(Run(f"direct {name}", c), requests, direct)
            floor = await drive(Run(f"sdk {name}", c), requests, sdk)
            triples.append((relayed, straight, floor))
    finally:
        await asyncio.gather(*(h.aclose() for h in https))
    return triples


def report(triples: list[tuple[Run, Run, Run]]) -> None:
    print(f"{'path':<15} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'failures':>9}")
    for runs in triples:
        for run in runs:
            print(
                f"{run.path:<15} {run.concurrency:>4} {run.rate():>8.1f} {run.ms(50):>8.2f} {run.ms(90):>8.2f} "
                f"{run.ms(99):>8.2f} {sum(run.failures.values()):>9}"
            )
    for relayed, direct, floor in triples:
        overhead = relayed.ms(50) - direct.ms(50)
        ratio = relayed.rate() / direct.rate() if direct.rate() else float("nan")
        own = relayed.ms(50) - floor.ms(50)
        own_ratio = relayed.rate() / floor.rate() if floor.rate() else float("nan")
        print(
            f"{relayed.path.removeprefix('relay ')} at {relayed.concurrency}: p50 overhead {overhead:+.2f} ms, "
            f"throughput {ratio:.2f}x direct"
            + ("   (targets: overhead <= 3 ms at 1; throughput >= 0.5x)" if relayed.concurrency == 1 else "")
            + f"; over the sdk floor {own:+.2f} ms, {own_ratio:.2f}x"
        )
    for runs in triples:
        for run in runs:
            if run.failures:
                print(f"failures of {run.path} at {run.concurrency}: {dict(run.failures)}")


def run(args: argparse.Namespace) -> None:
    print_machine()
    with work_directory(args.log_dir, "relay-bench-api-") as workdir:
        pg = Postgres()
        relay: RelayProcess | None = None
        executors: list[ExecutorProcess] = []
        try:
            config = relay_yaml(free_port(), grace=60, pingIntervalSecs=20, pingWaitSecs=25)
            relay = RelayProcess(workdir, pg.create_database("bench_relay"), config).start()
            sysdb, evidence = pg.create_database("bench_sys"), pg.create_database("bench_evidence")
            jobs = {
                "RELAY_TEST_EVIDENCE": evidence,
                "RELAY_TEST_JOBS": str(args.workflows),
                "RELAY_TEST_JOB_SLEEP": "0",
            }
            executors.append(ExecutorProcess(workdir, sysdb, relay.conductor_url, env=jobs))
            executors += [
                ExecutorProcess(workdir, sysdb, relay.conductor_url, env={"RELAY_TEST_EVIDENCE": evidence})
                for _ in range(args.executors - 1)
            ]

            def finished() -> list[str]:
                outcomes = Evidence(evidence).outcomes()
                return sorted(outcomes) if len(outcomes) >= args.workflows else []

            ids = assert_eventually(finished, 60, what="the seeded workflows finished")
            print(f"{len(executors)} executors; {len(ids)} finished workflows; {args.requests} requests per path")
            triples = asyncio.run(measure(workdir, relay, sysdb, ids, args.concurrency, args.requests))
            report(triples)
        finally:
            for executor in executors:
                executor.stop()
            if relay is not None:
                relay.stop()
            pg.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.api", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 20])
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--workflows", type=int, default=200)
    parser.add_argument("--log-dir")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        run(parse_args(argv))
    except BenchError as exc:
        print(f"bench.api: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
