"""What a Relay restart costs to resume one blocked recovery, by the length of its wait.

A recovery that cannot proceed (no eligible peer) waits in ``relay.recover``'s wait loop, and each
wait records three DBOS operations (the ``DBOS.recv``, its deadline, the ``relay.gather`` that
looks again). When Relay restarts, DBOS resumes the workflow by replaying every one of them.

For each size, on a database of its own: Relay starts, an executor connects and goes away, its
recovery blocks (no peer at all); Relay stops, the run's history is replaced by that of a run that
has waited ``waits`` times (:func:`harness.waits.seed_waits`: the operations DBOS would have
recorded), and Relay starts again. Printed side by side: the operations replayed, the seconds from
the restart to /readyz and to the run waiting again (its next wait's deadline recorded), the Relay
process's CPU seconds by then, and how long that next wait is (the re-check it has come to).

The reference is a run with ~50 operations (16 waits: ~an hour's re-checks at the start of a
block); the long one has ~13,000 (4,332 waits: a month of ten-minute re-checks).

Usage, from the project root::

    python -m bench.blocked_replay [--waits 16 4332]

PostgreSQL is embedded. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import psycopg

from bench.common import BenchError, cpu_secs, print_machine
from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer
from harness.waiting import assert_eventually
from harness.waits import OPS_PER_WAIT, recorded_ops, seed_waits

DEAD = "dead-1"
RESUME_TIMEOUT_SECS = 600.0


@dataclass
class Resumed:
    waits: int
    ops: int
    ready_secs: float
    resumed_secs: float
    cpu_secs: float
    next_wait_secs: float


def _deadline_of(relay_db: str, rid: str, function_id: int) -> float | None:
    with psycopg.connect(relay_db) as conn:
        row = conn.execute(
            "SELECT output FROM dbos.operation_outputs WHERE workflow_uuid = %s AND function_id = %s",
            (rid, function_id),
        ).fetchone()
    return None if row is None else float(json.loads(row[0]))


def measure(pg: Postgres, workdir: Path, waits: int) -> Resumed:
    relay_db = pg.create_database("bench_replay")
    relay = RelayProcess(workdir, relay_db, relay_yaml(free_port(), grace=0.5), f"relay-{waits}").start()
    rid = f"recovery:acme:ledger:{DEAD}:1000000"
    try:
        url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
        with SimulatedPeer(url, DEAD, "answer"):
            assert_eventually(lambda: relay.state_of("acme", "ledger", DEAD) == "HEALTHY", 20)
        # Blocked, and in its first wait (the wait's deadline, operation 4, is recorded).
        assert_eventually(lambda: _deadline_of(relay_db, rid, 4) is not None, 60, what="the first wait")
    finally:
        relay.stop()
    ops = seed_waits(relay_db, rid, waits)
    live_wait = 3 + OPS_PER_WAIT * waits + 1  # the deadline of the wait the run resumes into
    started = time.monotonic()
    relay.start()
    ready = time.monotonic() - started
    assert relay.proc is not None
    proc = psutil.Process(relay.proc.pid)
    try:
        while (deadline := _deadline_of(relay_db, rid, live_wait)) is None:
            if time.monotonic() - started > RESUME_TIMEOUT_SECS:
                raise BenchError(f"the recovery did not resume within {RESUME_TIMEOUT_SECS}s")
            time.sleep(0.02)
        resumed = time.monotonic() - started
        cpu = cpu_secs(proc)
        next_wait = deadline - time.time()
        if recorded_ops(relay_db, rid) < ops:
            raise BenchError("the run's history shrank")
    finally:
        relay.stop()
    return Resumed(waits, ops, ready, resumed, cpu, next_wait)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--waits", type=int, nargs="+", default=[16, 183, 518, 4332], help="waits recorded per run (first: reference)"
    )
    args = parser.parse_args(argv)
    print_machine()
    results: list[Resumed] = []
    with tempfile.TemporaryDirectory(prefix="relay-replay-") as tmp:
        pg = Postgres()
        try:
            for waits in args.waits:
                results.append(measure(pg, Path(tmp), waits))
                r = results[-1]
                print(f"  measured {r.waits} waits: resumed in {r.resumed_secs:.2f}s", flush=True)
        finally:
            pg.close()
    ref = results[0]
    heads = ("waits", 7), ("ops", 7), ("ready s", 8), ("resumed s", 10), ("x ref", 6), ("CPU s", 7), ("x ref", 6)
    print(" ".join(f"{h:>{w}}" for h, w in heads), f"{'next wait s':>12}")
    for r in results:
        print(f"{r.waits:>7} {r.ops:>7} {r.ready_secs:>8.2f} {r.resumed_secs:>10.2f} "
              f"{r.resumed_secs / ref.resumed_secs:>6.1f} {r.cpu_secs:>7.2f} {r.cpu_secs / ref.cpu_secs:>6.1f} "
              f"{r.next_wait_secs:>12.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
