"""relay.yaml: the configuration file, validated with pydantic.

Field names are camelCase in the file (as the contract writes them) and
snake_case in Python. Unknown fields are errors, so that a typo never silently
falls back to a default.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from relay.auth import Permission
from relay.errors import ConfigError

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
DEFAULT_EXECUTOR_TIMEOUT_SECS = 60.0


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class ServerConfig(_Model):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # An executor that has not answered executor_info by then is disconnected.
    handshake_timeout_secs: float = Field(default=10.0, gt=0)
    # Replies can carry whole workflow lists; the contract asks for at least 64 MiB.
    max_frame_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # Connections accepted but not yet past executor_info; beyond it, 503.
    max_pending_handshakes: int = Field(default=10_000, ge=1)
    # Requests about an app's workflows go to its executors: each executor gets this long to
    # answer before the next is asked, within a deadline for the whole request (Conductor's
    # clients give up at 30 s); at most this many requests per app are in flight (beyond: 429).
    executor_request_timeout_secs: float = Field(default=5.0, gt=0)
    executor_request_deadline_secs: float = Field(default=25.0, gt=0)
    max_executor_requests_per_app: int = Field(default=32, ge=1)
    # The largest reply relayed between instances (through the database); a larger one is a 502.
    max_relayed_reply_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    # The largest body of POST .../workflows/import (an exported workflow, children included).
    max_import_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    # Executor sockets one key may hold open on one instance; beyond it, 429.
    max_sockets_per_key: int = Field(default=10_000, ge=1)
    # HTTP request bodies beyond it get 413 (routes may have a larger limit, relay/net/guard.py).
    max_request_body_bytes: int = Field(default=1024 * 1024, ge=1)
    # HTTP requests in progress (not WebSockets, not /healthz or /readyz); beyond it, 503.
    max_concurrent_requests: int = Field(default=200, ge=1)
    # A connection whose request headers are not complete this long after it opened
    # (or after its previous response) is closed: a slow client cannot hold it.
    header_timeout_secs: float = Field(default=10.0, gt=0)
    # /metrics without a key (it names every org and app); otherwise a key with metric.read.
    public_metrics: bool = False


class DatabaseConfig(_Model):
    url: str | None = None


class LivenessConfig(_Model):
    ping_interval_secs: float = Field(default=20.0, gt=0)
    ping_wait_secs: float = Field(default=25.0, gt=0)
    recovery_ack_timeout_secs: float = Field(default=30.0, gt=0)
    failover_backoff_initial_secs: float = Field(default=1.0, gt=0)
    failover_backoff_max_secs: float = Field(default=30.0, gt=0)
    instance_lease_secs: float = Field(default=15.0, gt=0)
    # How often an instance compares its open sockets with the rows it owns (a lost
    # disconnection is recorded then; a socket another connection replaced is closed).
    socket_check_secs: float = Field(default=10.0, gt=0)
    # How often each instance's repair sweep looks for executors it owns whose grace
    # period or recovery workflow is not running (ended in ERROR, cancelled, never started).
    repair_interval_secs: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> LivenessConfig:
        if self.ping_wait_secs <= self.ping_interval_secs:
            # A healthy but idle executor is only heard from when it answers a
            # ping, so a wait no longer than the interval would drop it.
            raise ValueError("pingWaitSecs must be greater than pingIntervalSecs")
        if self.failover_backoff_max_secs < self.failover_backoff_initial_secs:
            raise ValueError("failoverBackoffMaxSecs must be at least failoverBackoffInitialSecs")
        return self


class KeyConfig(_Model):
    name: str = Field(min_length=1, max_length=256)
    sha256: str
    # The apps the key may touch (default: every app of its org).
    apps: list[str] | None = None
    # Conductor's permissions; default: websocket.connect for a conductor key, the role's for an API key.
    permissions: list[Permission] | None = None

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        value = value.strip().lower()
        if not SHA256_HEX.match(value):
            raise ValueError("must be the 64 hex digits of a SHA-256 hash (see `relay keys new`)")
        return value


class ApiKeyConfig(KeyConfig):
    role: Literal["admin", "viewer"] = "viewer"


class AppConfig(_Model):
    name: str = Field(min_length=1, max_length=256)
    executor_timeout_secs: float = Field(default=DEFAULT_EXECUTOR_TIMEOUT_SECS, gt=0)
    recover_to_latest_version: bool = False


class OrgConfig(_Model):
    name: str = Field(min_length=1, max_length=255)
    conductor_keys: list[KeyConfig] = []
    api_keys: list[ApiKeyConfig] = []
    apps: list[AppConfig] = []

    @model_validator(mode="after")
    def _unique_apps(self) -> OrgConfig:
        names = [app.name for app in self.apps]
        if len(names) != len(set(names)):
            raise ValueError(f"app names must be unique within org {self.name!r}")
        return self


class RetentionConfig(_Model):
    """How long Relay keeps its own records (the applications' data has per-app settings)."""

    audit_days: float = Field(default=90.0, gt=0)
    # Finished recoveries and their attempts.
    recoveries_days: float = Field(default=30.0, gt=0)
    # Relay's own finished DBOS workflows (grace periods, recoveries, this job).
    relay_workflows_days: float = Field(default=7.0, gt=0)
    # Executor ids not seen for this long are forgotten (with the key each was bound to).
    executor_ids_days: float = Field(default=30.0, gt=0)
    interval_secs: float = Field(default=3600.0, gt=0)


class ReconcilerConfig(_Model):
    """The stranded-workflow reconciler (README, "Stranded work: the reconciler")."""

    enabled: bool = True
    # How often each app's PENDING workflows are looked over (one run per app and interval).
    interval_secs: float = Field(default=300.0, gt=0)
    # Apps it never looks at (the off switch per app).
    skip_apps: list[str] = []
    # Also recover the workflows of executor ids Relay never registered (never "local").
    include_unknown_executors: bool = False


class RelayConfig(_Model):
    server: ServerConfig = ServerConfig()
    database: DatabaseConfig = DatabaseConfig()
    liveness: LivenessConfig = LivenessConfig()
    retention: RetentionConfig = RetentionConfig()
    reconciler: ReconcilerConfig = ReconcilerConfig()
    # False: an executor may only connect to an app listed in relay.yaml (or registered through the API).
    auto_register_apps: bool = True
    orgs: list[OrgConfig] = []

    @model_validator(mode="after")
    def _unique(self) -> RelayConfig:
        org_names = [org.name for org in self.orgs]
        if len(org_names) != len(set(org_names)):
            raise ValueError("org names must be unique")
        # A key names exactly one org: the same hash twice would make it ambiguous.
        hashes = [k.sha256 for org in self.orgs for k in [*org.conductor_keys, *org.api_keys]]
        if len(hashes) != len(set(hashes)):
            raise ValueError("every conductor and API key hash must be unique across all orgs")
        return self

    def with_overrides(self, **changes: Any) -> RelayConfig:
        """A copy with server/database fields replaced (command-line options)."""
        server = self.server.model_copy(
            update={k: v for k, v in changes.items() if k in ("host", "port") and v is not None}
        )
        database = self.database
        if changes.get("database_url"):
            database = DatabaseConfig(url=changes["database_url"])
        return self.model_copy(update={"server": server, "database": database})


def _describe(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def parse_config(text: str, source: str = "relay.yaml") -> RelayConfig:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, not {type(raw).__name__}")
    try:
        return RelayConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from exc


def load_config(path: str | os.PathLike[str] | None) -> RelayConfig:
    """Read relay.yaml; ``None`` means no file, all defaults.

    ``RELAY_DATABASE_URL`` overrides ``database.url``.
    """
    if path is None:
        config = RelayConfig()
    else:
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read: {exc.strerror or exc}") from exc
        config = parse_config(text, str(file))
    env_url = os.environ.get("RELAY_DATABASE_URL")
    if env_url:
        config = config.with_overrides(database_url=env_url)
    return config
