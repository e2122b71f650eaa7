"""What the HTTP API reaches: the stores, the router, the operator actions, the lease.

Built by the composition root (:mod:`relay.runtime`) and kept in the FastAPI
app's state; route handlers receive it through :func:`relay.api.common.context`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from relay.appmetrics import ScrapeView
from relay.auth import KeyRing
from relay.config import RelayConfig
from relay.domain.alerts import AlertRules
from relay.domain.events import EventHub
from relay.domain.gateway import ExecutorGateway
from relay.domain.operator import Operator
from relay.domain.tokens import Tokens
from relay.net.router import Router
from relay.store.appfigures import AppFiguresStore
from relay.store.apps import AppStore
from relay.store.audit import AuditStore
from relay.store.db import Database
from relay.store.executors import ExecutorStore
from relay.store.instances import InstanceStore
from relay.store.keys import KeyStore
from relay.store.lease import Lease
from relay.store.probe import DatabaseProbe
from relay.store.recoveries import RecoveryStore


@dataclass(frozen=True)
class ApiContext:
    config: RelayConfig
    instance_id: str
    version: str
    db: Database
    keyring: KeyRing
    apps: AppStore
    executors: ExecutorStore
    recoveries: RecoveryStore
    audit: AuditStore
    router: Router
    gateway: ExecutorGateway
    operator: Operator
    keys: KeyStore
    instances: InstanceStore
    tokens: Tokens
    lease: Lease
    probe: DatabaseProbe  # /readyz's look at the database, off the pool
    events: EventHub  # the console's live updates
    metrics: Callable[[ScrapeView, str], Awaitable[tuple[bytes, str]]]  # this instance's exposition, its type
    figures: AppFiguresStore  # the apps' stored figures (GET .../apps/{app}/metrics)
    alert_rules: AlertRules
