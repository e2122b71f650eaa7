"""Relay instances as rows: which leases expired, and adopting one (contract rule 5).

Taking over an expired lease is one fenced transaction guarded on the dead
lease's epoch, so exactly one survivor wins:

* the lease row gets a new epoch and ``adopted_by``: if the dead instance was
  only paused, its next renewal (and every fenced write) fails and it exits;
* instances the dead one had itself adopted pass to the adopter, those that still have work for
  it: a pending DBOS workflow under their id (:func:`still_to_take_over`). One whose workflows were
  taken over already (the dead instance's takeover finished) stays where it is, so that an
  adoption carries only what a takeover cut short left, not every instance adopted since the
  first start (with a new instance id at each start, that history grows by one a deploy);
* its executors move to the adopter (the ADOPTED event, written by the
  executor store): those still HEALTHY become DISCONNECTED;
* ``relay.instance_adopted`` is audited in every org (``released``: the lease was
  given up by a clean stop, not run out; such an adoption fires no alert).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relay.store.audit import AuditEntry, write_audit
from relay.store.bounded import Conn
from relay.store.db import Database
from relay.store.executors import ExecutorStore


async def dbos_ran(conn: Conn) -> bool:
    """Whether DBOS ever ran on Relay's database: its ``dbos`` schema (Relay's own system database)
    holds ``workflow_status``."""
    cur = await conn.execute("SELECT to_regclass('dbos.workflow_status') IS NOT NULL AS present")
    row = await cur.fetchone()
    return row is not None and bool(row["present"])


async def still_to_take_over(conn: Conn) -> str:
    """An SQL query of the ids of the instances that have work an adopter still has to take over:
    the executor ids under which a DBOS workflow is ``PENDING`` in Relay's own system database (the
    ``dbos`` schema of Relay's database; none before DBOS ever ran on it). A statement reads it once,
    as a materialized CTE it joins against (``WITH to_take_over AS MATERIALIZED (...)``): DBOS has
    no index on ``executor_id``, so a condition per row would read every PENDING workflow per row.

    That is exactly what ``DBOS._recover_pending_workflows`` looks for (:meth:`relay.domain.ports.
    Durable.take_over`): once it has handed a workflow back, the workflow is ``ENQUEUED`` (on
    DBOS's internal queue, which every instance serves, or on the dead instance's grace-period
    queue, which the repair sweep of the executor's owner empties), and ``PENDING`` again only
    under the executor id of the instance that runs it. An instance whose takeover was cut short
    keeps the workflows it had not handed back yet, so it still counts; any version's count, also
    one this code cannot run (kept, not lost)."""
    if not await dbos_ran(conn):
        return "SELECT NULL::text AS executor_id WHERE false"
    return """SELECT DISTINCT executor_id FROM dbos.workflow_status
              WHERE status = 'PENDING' AND executor_id IS NOT NULL"""


@dataclass(frozen=True)
class Adoption:
    instance: str
    lease_epoch: int
    inherited: list[str] = field(default_factory=list)
    dropped: int = 0  # executors that were HEALTHY and became DISCONNECTED
    per_org: dict[str, int] = field(default_factory=dict)  # executors moved, by org
    released: bool = False  # the lease was given up by a clean stop, not run out


@dataclass(frozen=True)
class Unleased:
    """An instance that holds executors or pending workflows and has never held a lease: one of
    Relay 0.2.0, which predates leases. No instance adopts it (README "Upgrading")."""

    instance: str
    executors: int
    healthy: int
    pending_workflows: int


class InstanceStore:
    def __init__(self, db: Database, executors: ExecutorStore) -> None:
        self.db = db
        self.executors = executors

    async def unleased(self) -> list[Unleased]:
        """The instances without a lease row that own executors' records or pending DBOS workflows."""
        async with self.db.connection() as conn:
            pending = (
                """SELECT executor_id AS instance, count(*) AS n FROM dbos.workflow_status
                   WHERE status = 'PENDING' AND executor_id IS NOT NULL GROUP BY 1"""
                if await dbos_ran(conn)
                else "SELECT NULL::text AS instance, 0::bigint AS n WHERE false"
            )
            cur = await conn.execute(
                f"""WITH owners AS (
                        SELECT relay_instance AS instance, count(*) AS executors,
                               count(*) FILTER (WHERE state = 'HEALTHY') AS healthy
                        FROM executors GROUP BY 1),
                    pending AS MATERIALIZED ({pending})
                    SELECT coalesce(o.instance, p.instance) AS instance, coalesce(o.executors, 0) AS executors,
                           coalesce(o.healthy, 0) AS healthy, coalesce(p.n, 0) AS pending
                    FROM owners o FULL JOIN pending p ON p.instance = o.instance
                    WHERE NOT EXISTS (SELECT 1 FROM relay_instances i
                                      WHERE i.instance_id = coalesce(o.instance, p.instance))
                    ORDER BY 1"""
            )
            rows = await cur.fetchall()
        return [Unleased(str(r["instance"]), int(r["executors"]), int(r["healthy"]), int(r["pending"])) for r in rows]

    async def expired(self, instance_id: str) -> list[tuple[str, int]]:
        """(instance, lease epoch) of the others whose lease expired and that nobody adopted yet."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT instance_id, lease_epoch FROM relay_instances
                   WHERE instance_id <> %s AND adopted_by IS NULL AND lease_expires_at < now()
                   ORDER BY instance_id""",
                (instance_id,),
            )
            return [(str(r["instance_id"]), int(r["lease_epoch"])) for r in await cur.fetchall()]

    async def adopt(
        self, adopter: str, instance: str, epoch: int, settled: Callable[[], bool] | None = None
    ) -> Adoption | None:
        """Take over ``instance`` if its lease is still the expired ``epoch``; None if another moved first,
        or if ``settled``, asked once the transaction holds its connection, says the adopter may not
        adopt now (:meth:`relay.domain.adoption.Adopter.settled`)."""
        async with self.db.fenced() as conn:
            if settled is not None and not settled():
                return None
            # Waits for the fenced writes that instance still has in flight (they hold its row
            # FOR KEY SHARE, which a plain UPDATE would not wait for: relay.store.db.Database.fenced).
            await conn.execute("SELECT 1 FROM relay_instances WHERE instance_id = %s FOR UPDATE", (instance,))
            cur = await conn.execute(
                """UPDATE relay_instances SET lease_epoch = lease_epoch + 1, adopted_by = %s, adopted_at = now()
                   WHERE instance_id = %s AND lease_epoch = %s AND adopted_by IS NULL
                     AND lease_expires_at < now()
                   RETURNING lease_epoch, released_at IS NOT NULL AS released""",
                (adopter, instance, epoch),
            )
            row = await cur.fetchone()
            if row is None:
                return None
            new_epoch = int(row["lease_epoch"])
            released = bool(row["released"])
            pending = await still_to_take_over(conn)
            cur = await conn.execute(
                f"""WITH to_take_over AS MATERIALIZED ({pending})
                    UPDATE relay_instances o SET adopted_by = %s
                    WHERE o.adopted_by = %s AND o.instance_id IN (SELECT executor_id FROM to_take_over)
                    RETURNING o.instance_id""",
                (adopter, instance),
            )
            inherited = [str(r["instance_id"]) for r in await cur.fetchall()]
            dropped, per_org = await self.executors.adopted(conn, instance, adopter)
            cur = await conn.execute("SELECT name FROM orgs ORDER BY name")
            for org_row in await cur.fetchall():
                org = str(org_row["name"])
                detail = {
                    "instance": instance,
                    "adoptedBy": adopter,
                    "leaseEpoch": new_epoch,
                    "executors": per_org.get(org, 0),
                    "inherited": inherited,
                    "released": released,  # given up by a clean stop, not run out
                }
                entry = AuditEntry(
                    "relay.instance_adopted", "relay", detail=detail, dedupe_key=f"adopt:{instance}:{new_epoch}:{org}"
                )
                await write_audit(conn, org, None, entry)
        return Adoption(instance, new_epoch, inherited, dropped, per_org, released)

    async def list_with_executors(self, org: str, among: frozenset[str] | None = None) -> list[dict[str, Any]]:
        """Every instance's lease, and how many of ``org``'s executors name it (of the apps ``among``,
        if given: a key limited to apps counts only theirs)."""
        apps = sorted(among) if among is not None else None
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT i.*, i.lease_expires_at > now() AS live,
                          (SELECT count(*) FROM executors e WHERE e.org = %s AND e.relay_instance = i.instance_id
                             AND (%s::text[] IS NULL OR e.app = ANY(%s))) AS executors
                   FROM relay_instances i ORDER BY i.instance_id""",
                (org, apps, apps),
            )
            return list(await cur.fetchall())

    async def adopted_by(self, adopter: str) -> list[str]:
        """The instances ``adopter`` took over (and that have not started again since) that still have
        workflows to take over (:func:`still_to_take_over`): a takeover cut short by a crash."""
        async with self.db.connection() as conn:
            pending = await still_to_take_over(conn)
            cur = await conn.execute(
                f"""WITH to_take_over AS MATERIALIZED ({pending})
                    SELECT instance_id FROM relay_instances
                    WHERE adopted_by = %s AND instance_id IN (SELECT executor_id FROM to_take_over)
                    ORDER BY instance_id""",
                (adopter,),
            )
            return [str(r["instance_id"]) for r in await cur.fetchall()]
