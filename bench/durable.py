"""What a durable step costs: DBOS 3.2's workflows and steps against the same writes made bare.

A group failure's time is bound by the CPU an instance spends per death, and most of that is
DBOS's: each death is two workflows of a few steps, and each step is DBOS transactions run
through SQLAlchemy in DBOS's worker threads (see the README's Benchmarks). This benchmark
measures that cost alone, with nothing of Relay's around it, and beside it, in the same run,
a reference that makes transactions of the same shape with the same driver and no framework:

- ``dbos``: ``--workflows`` async DBOS workflows of ``--steps`` async steps each (their bodies do
  nothing), ``--concurrency`` at a time, DBOS configured as Relay configures it (its system
  database pool, its worker threads, no pre-ping);
- ``dbos-1``: the same with one DBOS worker thread instead of Relay's 20, so that what many
  threads cost shows (their context switches; each call is still handed to a thread);
- ``bare``: per workflow, the transactions of DBOS's shape (the workflow's row inserted, each
  step's check and record, the row updated), each committed alone, with psycopg's async
  connections (one per concurrent workflow) on the event loop, as Relay's own stores make theirs.

Each variant runs in a process of its own (DBOS launches once per process) on a database of
its own, a first round to warm up and a second that is measured. Printed per workflow: the
process's CPU (user and system), its context switches, and the transactions PostgreSQL counted
(``--stats-wait`` lets its counters catch up; with 0, the count is rough).

Usage, from the project root::

    python -m bench.durable [--workflows 1000] [--steps 3] [--concurrency 40]

PostgreSQL is embedded, or the server at ``RELAY_TEST_DATABASE_URL`` if set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import psycopg

from bench.common import BenchError, load_average, print_machine
from harness.postgres import Postgres

VARIANTS = ("dbos", "dbos-1", "bare")
# An idle backend reports its counters after 10 s (PostgreSQL's PGSTAT_IDLE_INTERVAL).
STATS_SETTLE_SECS = 11.0


@dataclass
class Figures:
    variant: str
    workflows: int
    wall: float
    user: float  # CPU seconds
    system: float
    switches: int  # voluntary and involuntary context switches
    transactions: int  # committed in the variant's database, as PostgreSQL counts them

    def per(self, value: float) -> float:
        return value / self.workflows


def meters() -> tuple[float, float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime, usage.ru_nvcsw + usage.ru_nivcsw


def committed(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()
        assert row is not None
        return int(row[0])


# Each count of committed() is two transactions of its own in the count after it: its
# connection's start and its SELECT.
COUNT_OWN_XACTS = 2


def until_no_backends(url: str, timeout: float = 30.0) -> None:
    """Wait until no other backend is connected to the database: each one that exits reports
    its counters."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
            if row is not None and row[0] == 0:
                return
            if time.monotonic() > deadline:
                raise BenchError(f"{row[0] if row else '?'} connections still open {timeout:g} s after the close")
            time.sleep(0.05)


async def measured(
    variant: str,
    url: str,
    args: argparse.Namespace,
    run: Callable[[int], Awaitable[None]],
    close: Callable[[], Awaitable[None]],
) -> Figures:
    """``run(round)`` twice, the second measured, then ``close()``. PostgreSQL's counters come from
    each backend at most once a second, and from an idle one after 10 s: the count before the
    measured round waits ``--stats-wait`` s for the first round's (with less, it may include some
    of them); the one after follows the close, once every backend has exited."""
    await run(0)
    await asyncio.sleep(args.stats_wait)
    xacts = committed(url)
    user, system, switches = meters()
    started = time.perf_counter()
    await run(1)
    wall = time.perf_counter() - started
    user2, system2, switches2 = meters()
    await close()
    until_no_backends(url)  # blocking: nothing else runs now (and DBOS.destroy shut the loop's executor)
    transactions = committed(url) - xacts - COUNT_OWN_XACTS
    return Figures(variant, args.workflows, wall, user2 - user, system2 - system, switches2 - switches, transactions)


# -- the DBOS variants ------------------------------------------------------------------------


def run_dbos(url: str, args: argparse.Namespace, threads: int, variant: str) -> Figures:
    from dbos import DBOS, DBOSConfig, SetWorkflowID

    from workflows.engine import SYS_DB_POOL_SIZE

    @DBOS.step(name="bench.durable.step")
    async def step(i: int) -> int:
        return i + 1

    @DBOS.workflow(name="bench.durable.workflow")
    async def workflow(steps: int) -> int:
        total = 0
        for i in range(steps):
            total += await step(i)
        return total

    config: DBOSConfig = {
        "name": "bench-durable",
        "system_database_url": url,
        "log_level": "WARNING",
        "sys_db_pool_size": SYS_DB_POOL_SIZE,
        "max_executor_threads": threads,
        "db_engine_kwargs": {"pool_pre_ping": False},
    }
    DBOS(config=config)
    DBOS.launch()
    destroyed = False

    async def close() -> None:
        nonlocal destroyed
        await asyncio.to_thread(DBOS.destroy)
        destroyed = True

    async def run(round_: int) -> None:
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int) -> None:
            async with gate:
                with SetWorkflowID(f"r{round_}-{i}"):
                    handle = await DBOS.start_workflow_async(workflow, args.steps)
                await handle.get_result()

        await asyncio.gather(*(one(i) for i in range(args.workflows)))

    try:
        return asyncio.run(measured(variant, url, args, run, close))
    finally:
        if not destroyed:
            DBOS.destroy()


# -- the bare reference -------------------------------------------------------------------------


def run_bare(url: str, args: argparse.Namespace) -> Figures:
    """Per workflow, the transactions of DBOS's shape: an INSERT of the workflow's row, per step a
    SELECT and an INSERT (its check and its record), an UPDATE of the row; each committed alone."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE runs (id text PRIMARY KEY, status text NOT NULL, output text)")
        conn.execute("CREATE TABLE outputs (run_id text, n int, output text, PRIMARY KEY (run_id, n))")

    async def main() -> Figures:
        conns = [await psycopg.AsyncConnection.connect(url) for _ in range(args.concurrency)]
        free: asyncio.Queue[psycopg.AsyncConnection[Any]] = asyncio.Queue()
        for c in conns:
            free.put_nowait(c)

        async def one(rid: str) -> None:
            conn = await free.get()
            try:
                async with conn.transaction():
                    await conn.execute("INSERT INTO runs (id, status) VALUES (%s, 'PENDING')", (rid,))
                for n in range(args.steps):
                    async with conn.transaction():
                        cur = await conn.execute("SELECT output FROM outputs WHERE run_id = %s AND n = %s", (rid, n))
                        await cur.fetchall()
                    async with conn.transaction():
                        await conn.execute("INSERT INTO outputs VALUES (%s, %s, %s)", (rid, n, json.dumps(n)))
                async with conn.transaction():
                    await conn.execute("UPDATE runs SET status = 'SUCCESS', output = %s WHERE id = %s", ("1", rid))
            finally:
                free.put_nowait(conn)

        async def run(round_: int) -> None:
            await asyncio.gather(*(one(f"r{round_}-{i}") for i in range(args.workflows)))

        async def close() -> None:
            for c in conns:
                await c.close()

        try:
            return await measured("bare", url, args, run, close)
        finally:
            await close()

    return asyncio.run(main())


# -- the driver -----------------------------------------------------------------------------


def one_variant(args: argparse.Namespace, pg: Postgres, variant: str) -> Figures:
    url = pg.create_database("bench_durable")
    cmd = [sys.executable, "-m", "bench.durable", "--variant", variant, "--url", url,
           "--workflows", str(args.workflows), "--steps", str(args.steps), "--concurrency", str(args.concurrency),
           "--stats-wait", str(args.stats_wait)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    if done.returncode != 0:
        raise BenchError(f"{variant} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return Figures(**json.loads(done.stdout.strip().splitlines()[-1]))


def report(rows: list[Figures], args: argparse.Namespace) -> None:
    print(f"\n{args.workflows} workflows of {args.steps} steps, {args.concurrency} at a time; per workflow:")
    print(f"{'variant':<8} {'wall ms':>8} {'CPU ms':>8} {'user':>7} {'system':>7} {'switches':>9} {'xacts':>6} "
          f"{'CPU/xact':>9}")  # fmt: skip
    for r in rows:
        cpu = r.per(r.user + r.system) * 1000
        xacts = r.per(r.transactions)
        per_xact = cpu / xacts if xacts > 0 else float("nan")
        print(
            f"{r.variant:<8} {r.per(r.wall) * 1000:>8.2f} {cpu:>8.2f} {r.per(r.user) * 1000:>7.2f} "
            f"{r.per(r.system) * 1000:>7.2f} {r.per(r.switches):>9.1f} {xacts:>6.1f} {per_xact:>9.3f}"
        )
    if args.stats_wait < STATS_SETTLE_SECS:
        print(f"(--stats-wait below {STATS_SETTLE_SECS:g} s: the xacts may include some of the warm-up round's)")
    by = {r.variant: r for r in rows}
    dbos, bare = by["dbos"], by["bare"]
    ratio = (dbos.user + dbos.system) / (bare.user + bare.system) if bare.user + bare.system else float("inf")
    print(f"DBOS's CPU per workflow is {ratio:.1f}x the bare transactions' (the same shape, the same driver)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.durable", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workflows", type=int, default=1000, help="workflows per round (default 1000)")
    parser.add_argument("--steps", type=int, default=3, help="steps per workflow (default 3)")
    parser.add_argument("--concurrency", type=int, default=40, help="workflows at once (default 40)")
    parser.add_argument("--timeout", type=float, default=600.0, help="give each variant this long, s")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child process
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument(
        "--stats-wait",
        type=float,
        default=STATS_SETTLE_SECS,
        help=f"s for PostgreSQL's counters before a count (default {STATS_SETTLE_SECS:g})",
    )
    args = parser.parse_args(argv)
    if args.workflows < 1 or args.steps < 1 or args.concurrency < 1:
        parser.error("--workflows, --steps and --concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.variant is not None:  # a child: one variant, its figures as one JSON line
        from workflows.engine import DBOS_THREADS

        if args.variant == "bare":
            figures = run_bare(args.url, args)
        else:
            figures = run_dbos(args.url, args, DBOS_THREADS if args.variant == "dbos" else 1, args.variant)
        print(json.dumps(asdict(figures)))
        return 0
    print_machine()
    pg = Postgres()
    try:
        rows = [one_variant(args, pg, variant) for variant in VARIANTS]
    finally:
        pg.close()
    report(rows, args)
    print(f"load average now {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
