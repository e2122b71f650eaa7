"""Everything one Relay instance holds while it runs, and its start and stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from relay import __version__
from relay.auth import KeyRing
from relay.config import RelayConfig
from relay.db import Database
from relay.durable import Durable
from relay.hub import Hub
from relay.lease import Lease
from relay.recoveries import RecoveryStore
from relay.registry import Registry

log = logging.getLogger("relay")


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
        await asyncio.to_thread(self.durable.launch, asyncio.get_running_loop())
        self.durable.start_workers()
        await self.durable.sweep()

    async def stop(self) -> None:
        await self.hub.close_all()
        try:
            await self.registry.disconnect_instance(self.instance_id)
            await self.durable.sweep()
        finally:
            await self.durable.stop_workers()
            await asyncio.to_thread(self.durable.destroy)
            try:
                await self.lease.stop()  # last: the lease covers every write above
            finally:
                await self.db.close()

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
