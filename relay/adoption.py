"""Adoption of an instance whose lease expired (contract rule 5).

Every instance looks, every ``instanceLeaseSecs / 3``, for another instance
whose lease ran out and that nobody adopted yet (once it has itself held its
lease for a whole lease period, so that a database outage that expired every
lease does not make the instances adopt each other). Taking it over is one fenced
transaction guarded on the dead lease's epoch, so exactly one survivor wins:

* the lease row gets a new epoch and ``adopted_by``: if the dead instance was
  only paused, its next renewal (and every fenced write) fails and it exits;
* instances the dead one had itself adopted pass to the adopter;
* its executors still HEALTHY (their sockets died with it, and they have not
  reconnected elsewhere: a reconnect moves the row to its new instance) become
  DISCONNECTED, and all its executors' rows name the adopter, which now runs
  their timers;
* ``relay.instance_adopted`` is audited in every org.

After the commit the adopter asks DBOS to recover the dead instance's pending
workflows (grace periods keep their deadlines, recoveries go on from their
last step) and starts the missing grace periods. Both are idempotent, and an
adopter that dies in between is adopted in turn, its adopted instances with it;
an instance also re-runs them for the instances it adopted whenever it starts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from dbos import DBOS

from relay.errors import DatabaseError
from relay.lifecycle import ExecutorEvent, states_allowing
from relay.recoveries import AuditEntry, write_audit

if TYPE_CHECKING:
    from relay.runtime import Runtime

log = logging.getLogger("relay.adoption")


class Adopter:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.instance_id = runtime.instance_id
        self._task: asyncio.Task[None] | None = None
        self.adopted = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        lease_secs = self.runtime.config.liveness.instance_lease_secs
        while True:
            await asyncio.sleep(lease_secs / 3)
            if not self.runtime.lease.held:
                continue
            if self.runtime.lease.held_for() < lease_secs:
                # Just started, or back from losing the database: the others may have lost
                # their leases the same way and will renew them within one lease.
                continue
            try:
                # A recovery blocked on another instance is woken by a peer connecting here.
                await self.runtime.durable.refresh_blocked()
                await self.scan()
            except DatabaseError as exc:
                log.warning("instance %s: looking for expired leases failed: %s", self.instance_id, exc)
            except Exception:
                log.exception("instance %s: adoption failed", self.instance_id)

    async def scan(self) -> list[str]:
        """Adopt every instance whose lease expired; returns the ids adopted."""
        async with self.runtime.db.connection() as conn:
            cur = await conn.execute(
                """SELECT instance_id, lease_epoch FROM relay_instances
                   WHERE instance_id <> %s AND adopted_by IS NULL AND lease_expires_at < now()
                   ORDER BY instance_id""",
                (self.instance_id,),
            )
            expired = [(str(r["instance_id"]), int(r["lease_epoch"])) for r in await cur.fetchall()]
        adopted = []
        for instance, epoch in expired:
            if await self.adopt(instance, epoch):
                adopted.append(instance)
        return adopted

    async def adopt(self, instance: str, epoch: int) -> bool:
        """Take over ``instance`` if its lease is still the expired ``epoch``; False if another moved first."""
        lost = [s.value for s in states_allowing(ExecutorEvent.LOST)]
        async with self.runtime.db.fenced() as conn:
            cur = await conn.execute(
                """UPDATE relay_instances SET lease_epoch = lease_epoch + 1, adopted_by = %s, adopted_at = now()
                   WHERE instance_id = %s AND lease_epoch = %s AND adopted_by IS NULL
                     AND lease_expires_at < now()
                   RETURNING lease_epoch""",
                (self.instance_id, instance, epoch),
            )
            row = await cur.fetchone()
            if row is None:
                return False
            cur = await conn.execute(
                "UPDATE relay_instances SET adopted_by = %s WHERE adopted_by = %s RETURNING instance_id",
                (self.instance_id, instance),
            )
            inherited = [str(r["instance_id"]) for r in await cur.fetchall()]
            cur = await conn.execute(
                """UPDATE executors SET state = 'DISCONNECTED', disconnected_at = now()
                   WHERE relay_instance = %s AND state = ANY(%s)""",
                (instance, lost),
            )
            dropped = cur.rowcount
            cur = await conn.execute(
                "UPDATE executors SET relay_instance = %s WHERE relay_instance = %s RETURNING org",
                (self.instance_id, instance),
            )
            per_org: dict[str, int] = {}
            for r in await cur.fetchall():
                per_org[str(r["org"])] = per_org.get(str(r["org"]), 0) + 1
            cur = await conn.execute("SELECT name FROM orgs ORDER BY name")
            for org_row in await cur.fetchall():
                org = str(org_row["name"])
                detail = {
                    "instance": instance,
                    "adoptedBy": self.instance_id,
                    "leaseEpoch": int(row["lease_epoch"]),
                    "executors": per_org.get(org, 0),
                    "inherited": inherited,
                }
                entry = AuditEntry(
                    "relay.instance_adopted", "relay", detail=detail,
                    dedupe_key=f"adopt:{instance}:{row['lease_epoch']}:{org}",
                )  # fmt: skip
                await write_audit(conn, org, None, entry)
        self.adopted += 1
        log.warning(
            "instance %s adopted instance %s (its lease expired): %d executors, %d newly DISCONNECTED",
            self.instance_id, instance, sum(per_org.values()), dropped,
        )  # fmt: skip
        await self.recover_workflows([instance, *inherited])
        await self.runtime.durable.sweep()
        return True

    async def recover_workflows(self, instances: list[str]) -> None:
        """Hand the pending DBOS workflows of ``instances`` to DBOS's recovery (idempotent)."""
        handles = await asyncio.to_thread(DBOS._recover_pending_workflows, instances)
        log.info("instance %s: recovering %d workflows of %s", self.instance_id, len(handles), instances)

    async def recover_adopted(self) -> None:
        """At start-up: the instances this one adopted may have workflows left (a crash mid-adoption)."""
        async with self.runtime.db.connection() as conn:
            cur = await conn.execute(
                "SELECT instance_id FROM relay_instances WHERE adopted_by = %s", (self.instance_id,)
            )
            instances = [str(r["instance_id"]) for r in await cur.fetchall()]
        if instances:
            await self.recover_workflows(instances)
