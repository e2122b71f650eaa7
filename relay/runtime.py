"""Everything one Relay instance holds while it runs, and its start and stop."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from relay import __version__
from relay.adoption import Adopter
from relay.auth import KeyRing
from relay.config import RelayConfig
from relay.db import Database
from relay.durable import Durable
from relay.hub import Hub
from relay.lease import Lease
from relay.recoveries import RecoveryStore
from relay.registry import Registry
from relay.router import Router

log = logging.getLogger("relay")

EXIT_FENCED = 3


class Runtime:
    def __init__(self, config: RelayConfig, database_url: str, instance_id: str) -> None:
        self.config = config
        self.instance_id = instance_id
        self.version = __version__
        self.database_url = database_url
        self.db = Database(database_url)
        self.registry = Registry(self.db)
        self.recoveries = RecoveryStore(self.db)
        self.keyring = KeyRing(config)
        self.hub = Hub(config, self.keyring, self.registry, instance_id)
        self.durable = Durable(self)
        self.lease = Lease(self.db, instance_id, config.liveness.instance_lease_secs)
        self.lease.on_fenced = self._fenced
        self.router = Router(self.db, self.hub, instance_id)
        self.adopter = Adopter(self)
        self.hub.events = self.durable

    async def start(self) -> None:
        await self.db.open()
        await self.db.migrate()
        await self.registry.sync_config(self.config)
        await self.lease.acquire()
        self.lease.start()
        # Sockets do not survive a restart: whatever this instance held before is gone.
        stale = await self.registry.disconnect_instance(self.instance_id)
        if stale:
            log.info("marked %d executors of a previous run of instance %s DISCONNECTED", stale, self.instance_id)
        # DBOS resumes this instance's pending workflows (grace periods, recoveries)
        # as it launches; then every DISCONNECTED executor gets its grace period.
        self.router.start()
        await asyncio.to_thread(self.durable.launch, asyncio.get_running_loop())
        self.durable.start_workers()
        await self.adopter.recover_adopted()
        await self.durable.sweep()
        self.adopter.start()

    async def stop(self) -> None:
        await self.adopter.stop()
        await self.hub.close_all()
        try:
            await self.registry.disconnect_instance(self.instance_id)
            await self.durable.sweep()
        finally:
            await self.durable.stop_workers()
            await self.router.stop()
            await asyncio.to_thread(self.durable.destroy)
            try:
                await self.lease.stop()  # last: the lease covers every write above
            finally:
                await self.db.close()

    def _fenced(self) -> None:
        """Another instance adopted this one's lease (it was paused or cut off past it).

        Whatever this process still believes it owns belongs to the adopter now;
        every fenced write already fails. It stops at once, without the graceful
        shutdown's writes, and its process manager starts it again with a new
        lease epoch.
        """
        log.critical("instance %s: lease taken over by another instance; exiting (code %d)",
                     self.instance_id, EXIT_FENCED)  # fmt: skip
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(EXIT_FENCED)

    @asynccontextmanager
    async def lifespan(self, _app: Any) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def metrics_text(self) -> str:
        lines = [
            "# HELP relay_connections Executor sockets open on this instance.",
            "# TYPE relay_connections gauge",
            f"relay_connections {len(self.hub.connections)}",
            "# HELP relay_pending_handshakes Sockets accepted but not yet past executor_info.",
            "# TYPE relay_pending_handshakes gauge",
            f"relay_pending_handshakes {self.hub.pending_handshakes}",
            "# HELP relay_lease_held Whether this instance holds its lease (1) or not (0).",
            "# TYPE relay_lease_held gauge",
            f"relay_lease_held {int(self.lease.held)}",
            "# HELP relay_requests_relayed_total Requests this instance sent to its executors for another instance.",
            "# TYPE relay_requests_relayed_total counter",
            f"relay_requests_relayed_total {self.router.relayed}",
            "# HELP relay_instances_adopted_total Instances whose expired lease this instance adopted.",
            "# TYPE relay_instances_adopted_total counter",
            f"relay_instances_adopted_total {self.adopter.adopted}",
            "# HELP relay_hub_events_total Hub events on this instance, by kind.",
            "# TYPE relay_hub_events_total counter",
        ]
        for kind, n in sorted(self.hub.counters.items()):
            lines.append(f'relay_hub_events_total{{kind="{kind}"}} {n}')
        lines += [
            "# HELP relay_executors Executors in the registry, by org, app and state.",
            "# TYPE relay_executors gauge",
        ]
        for (org, app, state), n in sorted((await self.registry.count_by_state()).items()):
            lines.append(f'relay_executors{{org="{_esc(org)}",app="{_esc(app)}",state="{state}"}} {n}')
        lines += [
            "# HELP relay_executors_blocked DEAD executors whose recovery waits, by reason.",
            "# TYPE relay_executors_blocked gauge",
        ]
        for (org, app, reason), n in sorted((await self.registry.count_blocked()).items()):
            lines.append(f'relay_executors_blocked{{org="{_esc(org)}",app="{_esc(app)}",reason="{reason}"}} {n}')
        return "\n".join(lines) + "\n"


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
