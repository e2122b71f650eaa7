"""Adoption of an instance whose lease expired (contract rule 5).

Every instance looks, every ``instanceLeaseSecs / 3``, for another instance
whose lease ran out and that nobody adopted yet (once it has itself held its
lease for a whole lease period, so that a database outage that expired every
lease does not make the instances adopt each other). The takeover itself is
one transaction (:meth:`relay.store.instances.InstanceStore.adopt`), which asks
again, once it holds its connection, whether this instance has held its lease
that long: the look may have waited on a database that went away and came back
meanwhile (a chaos run saw an instance adopt a live one 0.3 s after a 4 s cut,
having checked its own lease before the cut).

After the commit the adopter asks the durable layer to resume the dead
instance's pending workflows (grace periods keep their deadlines, recoveries
go on from their last step) and to start the missing grace periods. Both are
idempotent, and an adopter that dies in between is adopted in turn, with those
of its adopted instances that still have a workflow pending under their id (its
takeover did not hand them all back to DBOS); an instance also resumes them for
the instances it adopted that still have one whenever it starts. An instance
whose workflows were all taken over is not passed on again, and retention
deletes its row once its adoption is ``executorIdsDays`` old
(:meth:`relay.store.retention.RetentionStore.prune`).
"""

from __future__ import annotations

import asyncio
import logging

from relay.domain.ports import Durable
from relay.errors import DatabaseError
from relay.store.instances import InstanceStore
from relay.store.lease import Lease

log = logging.getLogger("relay.adoption")


class Adopter:
    def __init__(self, instances: InstanceStore, lease: Lease, durable: Durable) -> None:
        self.instances = instances
        self.lease = lease
        self.durable = durable
        self.instance_id = lease.instance_id
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
        lease_secs = self.lease.lease_secs
        while True:
            await asyncio.sleep(lease_secs / 3)
            if not self.settled():
                continue
            try:
                # A recovery blocked on another instance is woken by a peer connecting here.
                await self.durable.refresh_blocked()
                await self.scan()
            except DatabaseError as exc:
                log.warning("instance %s: looking for expired leases failed: %s", self.instance_id, exc)
            except Exception:
                log.exception("instance %s: adoption failed", self.instance_id)

    def settled(self) -> bool:
        """Whether this instance may adopt now: it has held its lease for a whole lease without a gap.
        Just started, or back from losing the database, the others may have lost their leases the
        same way and will renew them within one lease."""
        return self.lease.held and self.lease.held_for() >= self.lease.lease_secs

    async def scan(self) -> list[str]:
        """Adopt every instance whose lease expired; returns the ids adopted."""
        adopted = []
        for instance, epoch in await self.instances.expired(self.instance_id):
            if await self.adopt(instance, epoch):
                adopted.append(instance)
        return adopted

    async def adopt(self, instance: str, epoch: int) -> bool:
        """Take over ``instance`` if its lease is still the expired ``epoch``; False if another moved first."""
        adoption = await self.instances.adopt(self.instance_id, instance, epoch, self.settled)
        if adoption is None:
            return False
        self.adopted += 1
        executors = sum(adoption.per_org.values())
        log.warning(
            "instance %s adopted instance %s (%s): %d %s, %d newly DISCONNECTED",
            self.instance_id, instance, "it released its lease" if adoption.released else "its lease expired",
            executors, "executor" if executors == 1 else "executors", adoption.dropped,
        )  # fmt: skip
        await self.durable.take_over([instance, *adoption.inherited])
        return True

    async def resume_adopted(self) -> None:
        """At start-up: the instances this one adopted that still have workflows left (a crash mid-adoption)."""
        instances = await self.instances.adopted_by(self.instance_id)
        if instances:
            await self.durable.take_over(instances)
