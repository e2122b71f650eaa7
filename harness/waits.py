"""A blocked recovery's history of waits, recorded as DBOS records it, for a test or a benchmark
to give a recovery the history of one that has waited for days without waiting for days.

A recovery blocked with no peer records, for each wait of ``relay.recover``'s wait loop, three
operations in Relay's DBOS system database: the ``DBOS.recv`` (its message: None, the wait timed
out), the ``DBOS.sleep`` that holds the recv's deadline, and the ``relay.gather`` step that looks
again (its facts: the same block). :func:`seed_waits` writes ``waits`` such turns after the run's
first two steps (``relay.open_and_gather``, ``relay.mark_blocked``), in place of what the run
recorded after them (its first wait, under way), with the facts its first step gathered: what a
run that waited that long with nothing changing holds, which a restart of Relay then replays.
Relay must be stopped.
"""

from __future__ import annotations

import base64
import json
import pickle
import time

import psycopg

# The operations a run blocked from its first round records before its first wait.
FIRST_OPS = ("relay.open_and_gather", "relay.mark_blocked")
OPS_PER_WAIT = 3
_NONE = base64.b64encode(pickle.dumps(None)).decode()


def recorded_ops(relay_db: str, rid: str) -> int:
    """How many operations DBOS recorded for the workflow ``rid``."""
    with psycopg.connect(relay_db) as conn:
        row = conn.execute("SELECT count(*) FROM dbos.operation_outputs WHERE workflow_uuid = %s", (rid,)).fetchone()
    return int(row[0]) if row else 0


def seed_waits(relay_db: str, rid: str, waits: int) -> int:
    """Replace what the blocked run ``rid`` recorded after its first steps by ``waits`` turns of
    its wait loop that found the same block (each wait's deadline in the past); returns how many
    operations the run then holds."""
    with psycopg.connect(relay_db) as conn:
        rows = conn.execute(
            """SELECT function_id, function_name, output, serialization FROM dbos.operation_outputs
               WHERE workflow_uuid = %s AND function_id IN (1, 2, 4) ORDER BY function_id""",
            (rid,),
        ).fetchall()
        names = tuple(r[1] for r in rows)
        if names != (*FIRST_OPS, "DBOS.sleep"):
            raise RuntimeError(f"{rid}: its first operations are {names}, not a run blocked at its first round")
        opened = pickle.loads(base64.b64decode(rows[0][2]))
        facts = base64.b64encode(pickle.dumps(opened["facts"])).decode()
        pickled, portable = rows[0][3], rows[2][3]  # a step's output, and the sleep's deadline
        conn.execute("DELETE FROM dbos.operation_outputs WHERE workflow_uuid = %s AND function_id > 2", (rid,))
        now_ms = int(time.time() * 1000)
        seeded = []
        for n in range(waits):
            at = now_ms - (waits - n) * 1000
            fid = 3 + OPS_PER_WAIT * n
            seeded += [
                (rid, fid, "DBOS.recv", _NONE, pickled, at, at),
                (rid, fid + 1, "DBOS.sleep", json.dumps(at / 1000), portable, at, at),
                (rid, fid + 2, "relay.gather", facts, pickled, at, at),
            ]
        with conn.cursor() as cur:
            cur.executemany(
                """INSERT INTO dbos.operation_outputs (workflow_uuid, function_id, function_name, output,
                       serialization, started_at_epoch_ms, completed_at_epoch_ms)
                   VALUES (%s, %s, %s, %s, %s, %s, %s)""",
                seeded,
            )
    return len(FIRST_OPS) + OPS_PER_WAIT * waits
