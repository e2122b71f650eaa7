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
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from dbos import DBOSClient, WorkflowHandleAsync

from bench.common import BenchError, exit_on_sigterm, print_machine, work_directory
from harness.executors import Evidence, ExecutorProcess
from harness.keys import API_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.stats import percentile
from harness.waiting import assert_eventually

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


async def measure(
    relay: RelayProcess, sysdb: str, ids: list[str], concurrency: list[int], requests: int
) -> list[tuple[Run, Run]]:
    client = DBOSClient(system_database_url=sysdb)
    pairs: list[tuple[Run, Run]] = []
    try:
        for c in concurrency:
            pairs += await measure_level(relay, client, ids, c, requests)
    finally:
        client.destroy()
    return pairs


async def measure_level(
    relay: RelayProcess, client: DBOSClient, ids: list[str], c: int, requests: int
) -> list[tuple[Run, Run]]:
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

    pairs: list[tuple[Run, Run]] = []
    try:
        for name, via_relay, direct in (("search", relay_search, direct_search), ("get", relay_get, direct_get)):
            await drive(Run(name, c), WARMUP, via_relay)
            await drive(Run(name, c), WARMUP, direct)
            relayed = await drive(Run(f"relay {name}", c), requests, via_relay)
            straight = await drive(Run(f"direct {name}", c), requests, direct)
            pairs.append((relayed, straight))
    finally:
        await asyncio.gather(*(h.aclose() for h in https))
    return pairs


def report(pairs: list[tuple[Run, Run]]) -> None:
    print(f"{'path':<15} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'failures':>9}")
    for relayed, direct in pairs:
        for run in (relayed, direct):
            print(
                f"{run.path:<15} {run.concurrency:>4} {run.rate():>8.1f} {run.ms(50):>8.2f} {run.ms(90):>8.2f} "
                f"{run.ms(99):>8.2f} {sum(run.failures.values()):>9}"
            )
    for relayed, direct in pairs:
        overhead = relayed.ms(50) - direct.ms(50)
        ratio = relayed.rate() / direct.rate() if direct.rate() else float("nan")
        print(
            f"{relayed.path.removeprefix('relay ')} at {relayed.concurrency}: p50 overhead {overhead:+.2f} ms, "
            f"throughput {ratio:.2f}x direct"
            + ("   (targets: overhead <= 3 ms at 1; throughput >= 0.5x)" if relayed.concurrency == 1 else "")
        )
    for relayed, _ in pairs:
        if relayed.failures:
            print(f"failures of {relayed.path} at {relayed.concurrency}: {dict(relayed.failures)}")


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
            pairs = asyncio.run(measure(relay, sysdb, ids, args.concurrency, args.requests))
            report(pairs)
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
