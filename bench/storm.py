"""Reconnect storm: a whole app dies, then every executor comes back at once.

N simulated executors of one app connect to one Relay and lose their sockets together; with
no peer left, each is declared DEAD after a short grace and its recovery waits for a peer
(``waiting_for_peer``). Then all N reconnect at once, under the same ids (a network split
that healed). Each reconnection is a peer for the others' recoveries and the end of its own
executor's death. Reported: how long until no recovery record waits any more, and Relay's
CPU meanwhile.

Usage, from the project root::

    python -m bench.storm [--executors 1000] [--wait 200] [--log-dir DIR]

Relay's database lives in an embedded PostgreSQL, or on the server at
``RELAY_TEST_DATABASE_URL`` if set.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

import psutil
import psycopg
from websockets.asyncio.client import ClientConnection

from bench.common import (
    BenchError,
    cpu_secs,
    exit_on_sigterm,
    load_average,
    print_machine,
    raise_open_files,
    work_directory,
)
from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import handshake, open_socket

GRACE_SECS = 0.5
BLOCK_TIMEOUT_SECS = 600.0
POLL_SECS = 0.2
WAITING = "SELECT count(*) FROM recoveries WHERE status = 'waiting_for_peer'"


def waiting(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(WAITING).fetchone()
    return int(row[0]) if row else 0


async def connect(relay: RelayProcess, ids: list[str], at_once: int) -> list[ClientConnection]:
    gate = asyncio.Semaphore(at_once)
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"

    async def one(executor_id: str) -> ClientConnection:
        async with gate:
            ws = await open_socket(url)
            await handshake(ws, executor_id)
            return ws

    return list(await asyncio.gather(*(one(e) for e in ids)))


async def die(relay: RelayProcess, ids: list[str]) -> None:
    for ws in await connect(relay, ids, 100):
        ws.transport.abort()


def wait_blocked(url: str, n: int) -> float:
    started = time.perf_counter()
    while waiting(url) < n:
        if time.perf_counter() - started > BLOCK_TIMEOUT_SECS:
            raise BenchError(f"fewer than {n} recoveries waiting for a peer after {BLOCK_TIMEOUT_SECS:g} s")
        time.sleep(POLL_SECS * 5)
    return time.perf_counter() - started


async def storm(relay: RelayProcess, ids: list[str], wait: float, proc: psutil.Process) -> None:
    cpu = cpu_secs(proc)
    started = time.perf_counter()
    sockets = await connect(relay, ids, 200)
    print(f"all {len(ids)} reconnected within {time.perf_counter() - started:.2f} s", flush=True)
    left = len(ids)
    try:
        while time.perf_counter() - started < wait:
            left = await asyncio.to_thread(waiting, relay.database_url)
            if left == 0:
                break
            await asyncio.sleep(POLL_SECS)
        secs = time.perf_counter() - started
        ended = f"{secs:.2f} s" if left == 0 else f"not within {wait:g} s ({left} still waiting)"
        print(f"every recovery record ended: {ended}; Relay CPU {cpu_secs(proc) - cpu:.1f} s;"
              f" load average now {load_average()}", flush=True)  # fmt: skip
    finally:
        for ws in sockets:
            ws.transport.abort()
    if left:
        raise BenchError(f"{left} recoveries still waiting for a peer")


def run(args: argparse.Namespace) -> None:
    with work_directory(args.log_dir, "relay-storm-") as workdir:
        pg = Postgres(drop_databases=True)
        relay = None
        try:
            url = pg.create_database("relay_bench_storm")
            config = relay_yaml(free_port(), grace=GRACE_SECS, repairIntervalSecs=3600,
                                pingIntervalSecs=5, pingWaitSecs=10)  # fmt: skip
            relay = RelayProcess(workdir, url, config).start()
            assert relay.proc is not None
            proc = psutil.Process(relay.proc.pid)
            ids = [f"storm-{i}" for i in range(args.executors)]
            asyncio.run(die(relay, ids))
            blocked = wait_blocked(url, len(ids))
            print(f"{len(ids)} executors DEAD, each recovery waiting for a peer, {blocked:.1f} s after the loss;"
                  f" load average {load_average()}", flush=True)  # fmt: skip
            asyncio.run(storm(relay, ids, args.wait, proc))
        finally:
            if relay is not None:
                relay.stop()
            pg.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.storm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--executors", default=1000, type=int)
    parser.add_argument("--wait", default=200.0, type=float, help="seconds to wait for the records to end")
    parser.add_argument("--log-dir", help="keep Relay's log and config here (default: a temporary directory)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    print_machine()
    raise_open_files(2 * args.executors + 1000)
    try:
        run(args)
    except BenchError as exc:
        print(f"FAILED: {exc}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
