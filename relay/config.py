"""relay.yaml: the configuration file, validated with pydantic.

Field names are camelCase in the file (as the contract writes them) and
snake_case in Python. Unknown fields are errors, so that a typo never silently
falls back to a default.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import idna
import psycopg
import yaml
from psycopg.conninfo import conninfo_to_dict
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from relay.auth import Permission
from relay.core.alerts import MAX_SECRET, MIN_SECRET, PARAMS, SECRET_RULE, Kind, valid_secret
from relay.core.destinations import DestinationPolicy, parse_entry
from relay.core.ids import APP_NAME_RULE, valid_app_name
from relay.errors import ConfigError
from relay_protocol import MAX_QUEUE_OR_SCHEDULE_NAME_BYTES
from relay_protocol.limits import utf8_length

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
DEFAULT_EXECUTOR_TIMEOUT_SECS = 60.0
DEFAULT_MIN_INTERVAL_SECS = 300.0
# The longest duration an alert rule or Relay's own timing takes: ten years. PostgreSQL computes
# ``now()`` minus these (``make_interval``) and refuses an infinity (JSON's and YAML's 1e999), or
# an interval reaching back before its earliest timestamp (from about 2e11 s); every delivery of
# a rule with such a minIntervalSecs would fail. Finite, too (``allow_inf_nan=False``).
MAX_SECS = 10 * 365 * 24 * 3600
# The instance lease: at most a week, far beyond any use (an instance that dies is replaced a lease
# later). Its own connection runs under a statement_timeout of a quarter of it (relay/store/lease.py),
# in milliseconds, which PostgreSQL takes up to 2^31 - 1 (24.8 days): a lease of MAX_SECS would
# stop every start, with a traceback, at the first renewal.
MAX_LEASE_SECS = 7 * 24 * 3600
# Retention (``*Days``): at most a century, as near to keeping records for good as matters.
MAX_DAYS = 36_500.0
# Counts in alert rules (failed workflows, recovery attempts): what a 32-bit integer holds.
MAX_COUNT = 2**31 - 1
# Sizes in bytes (frames, bodies, relayed replies): at most 1 GiB, the most PostgreSQL holds in one
# value (a relayed reply passes through it), and more than one message should ever hold in memory.
MAX_BYTES = 2**30
# Thresholds in milliseconds stay within what every JSON client reads exactly (2^53 ms is 285,000 years).
MAX_MS = 2**53
# The floors of Relay's own intervals (README, "Configuration"). Only "more than 0" once let
# retention.appsIntervalSecs: 0.000001 start a round, with its audit entry and row, every few
# milliseconds (526 in 5 s for one app). A poll or retry (a ping, a read of what changed, a
# failed delivery's first retry) may come ten times a second; a round of work (retention, the
# reconciler, the alert rules, the repair sweep, the socket check, a heartbeat) four times a
# second at most; a lease, renewed every third of it with statements that must answer within a
# share of that, lasts half a second at least (a lease of a microsecond renews without pause, each
# renewal given 1 ms, and is lost at the first slow answer).
# The tests use sub-second timers at or above these (0.1 s event polls, 0.3 s reconciler runs).
MIN_POLL_SECS = 0.1
MIN_ROUND_SECS = 0.25
MIN_LEASE_SECS = 0.5

# The settings relay.yaml and the API both take (an app's grace period and retention, an alert rule's
# parameters), each bounded here once and used by both, so that a value one takes the other takes too.
Duration = Annotated[float, Field(gt=0, le=MAX_SECS, allow_inf_nan=False)]
DurationOrZero = Annotated[float, Field(ge=0, le=MAX_SECS, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
# relay.yaml's intervals (the API sets none: an alert rule's minIntervalSecs is a damping, 0 for none).
PollInterval = Annotated[float, Field(ge=MIN_POLL_SECS, le=MAX_SECS, allow_inf_nan=False)]
RoundInterval = Annotated[float, Field(ge=MIN_ROUND_SECS, le=MAX_SECS, allow_inf_nan=False)]
# An app's retention threshold (gcTimeThresholdMs, gcRowsThreshold, globalTimeoutMs).
RetentionThreshold = Annotated[int, Field(gt=0, le=MAX_MS)]


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class ServerConfig(_Model):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # An executor that has not answered executor_info by then is disconnected.
    handshake_timeout_secs: float = Field(default=10.0, gt=0, le=MAX_SECS, allow_inf_nan=False)
    # Replies can carry whole workflow lists; the contract asks for at least 64 MiB.
    max_frame_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, le=MAX_BYTES)
    # Connections accepted but not yet past executor_info; beyond it, 503.
    max_pending_handshakes: int = Field(default=10_000, ge=1, le=MAX_COUNT)
    # Requests about an app's workflows go to its executors: each executor gets this long to
    # answer before the next is asked, within a deadline for the whole request (Conductor's
    # clients give up at 30 s); at most this many requests per app are in flight (beyond: 429).
    executor_request_timeout_secs: float = Field(default=5.0, gt=0, le=MAX_SECS, allow_inf_nan=False)
    executor_request_deadline_secs: float = Field(default=25.0, gt=0, le=MAX_SECS, allow_inf_nan=False)
    max_executor_requests_per_app: int = Field(default=32, ge=1, le=MAX_COUNT)
    # The largest reply relayed between instances (through the database); a larger one is a 502.
    max_relayed_reply_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, le=MAX_BYTES)
    # The largest body of POST .../workflows/import (an exported workflow, children included).
    max_import_bytes: int = Field(default=64 * 1024 * 1024, ge=1, le=MAX_BYTES)
    # Executor sockets one key may hold open on one instance; beyond it, 429.
    max_sockets_per_key: int = Field(default=10_000, ge=1, le=MAX_COUNT)
    # HTTP request bodies beyond it get 413 (routes may have a larger limit, relay/net/guard.py).
    max_request_body_bytes: int = Field(default=1024 * 1024, ge=1, le=MAX_BYTES)
    # HTTP requests in progress (not WebSockets, not /healthz or /readyz); beyond it, 503.
    max_concurrent_requests: int = Field(default=200, ge=1, le=MAX_COUNT)
    # A connection whose request headers are not complete this long after it opened
    # (or after the request began, on a kept-alive connection) is closed: a slow client cannot hold it.
    header_timeout_secs: float = Field(default=10.0, gt=0, le=MAX_SECS, allow_inf_nan=False)
    # A request body not complete this long after its headers: 408, connection closed (a client
    # that announces a body and sends it slowly, or never, holds a request slot no longer).
    body_timeout_secs: float = Field(default=30.0, gt=0, le=MAX_SECS, allow_inf_nan=False)
    # An idle kept-alive HTTP connection is closed after this long. Longer than load balancers'
    # idle timeouts (AWS's 60 s) and clients' pools (httpx's 5 s), so that they close first: a
    # request is never sent on a connection Relay is closing at that moment.
    keep_alive_secs: int = Field(default=75, ge=1, le=MAX_SECS)
    # /metrics without a key (it names every org and app); otherwise a key with metric.read.
    public_metrics: bool = False
    # GET /v2/orgs/{org}/events (the console's live updates): how often each instance reads what
    # changed (only while a stream is open), how often an idle stream gets a heartbeat, and how
    # many streams one key, and all keys together, may hold open on one instance (beyond: 429, 503).
    event_poll_secs: PollInterval = 0.5
    event_heartbeat_secs: RoundInterval = 15.0
    max_event_streams_per_key: int = Field(default=8, ge=1, le=MAX_COUNT)
    max_event_streams: int = Field(default=256, ge=1, le=MAX_COUNT)


class DatabaseConfig(_Model):
    url: str | None = None

    @field_validator("url")
    @classmethod
    def _libpq_url(cls, url: str | None) -> str | None:
        """A URL libpq reads (``postgresql://...`` or ``key=value`` pairs), refused at start-up with
        libpq's own reason rather than failing deep inside (``postgresql+psycopg://`` is
        SQLAlchemy's, not libpq's; a query parameter libpq does not know is refused too)."""
        if url is not None and not url.strip():
            # libpq would read "" as "every default" (a local socket), where an operator most likely
            # meant no URL at all, which is the embedded PostgreSQL.
            raise ValueError("empty: leave database.url out for the embedded PostgreSQL, or give a URL")
        if url is not None:
            try:
                conninfo_to_dict(url)
            except psycopg.ProgrammingError as exc:
                reason = str(exc).replace(url, "the URL")  # which may hold a password
                raise ValueError(f"not a PostgreSQL connection URL that libpq reads: {reason}") from None
        return url


class LivenessConfig(_Model):
    ping_interval_secs: PollInterval = 20.0
    ping_wait_secs: float = Field(default=25.0, gt=0, le=MAX_SECS, allow_inf_nan=False)
    recovery_ack_timeout_secs: float = Field(default=30.0, gt=0, le=MAX_SECS, allow_inf_nan=False)
    failover_backoff_initial_secs: PollInterval = 1.0
    failover_backoff_max_secs: float = Field(default=30.0, gt=0, le=MAX_SECS, allow_inf_nan=False)
    instance_lease_secs: float = Field(default=15.0, ge=MIN_LEASE_SECS, le=MAX_LEASE_SECS, allow_inf_nan=False)
    # How often an instance compares its open sockets with the rows it owns (a lost
    # disconnection is recorded then; a socket another connection replaced is closed).
    socket_check_secs: RoundInterval = 10.0
    # How often each instance's repair sweep looks for executors it owns whose grace
    # period or recovery workflow is not running (ended in ERROR, cancelled, never started).
    repair_interval_secs: RoundInterval = 30.0

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


def _in_bytes(what: str, bound: int) -> AfterValidator:
    """A check that a name is given and within ``bound`` bytes of UTF-8: a rule's queue is bounded as
    the workflow API bounds a queue's name (relay_protocol.limits), so that a rule can watch any
    queue the API can read."""

    def sized(text: str) -> str:
        size = utf8_length(text)
        if not text or size > bound:
            raise ValueError(f"{what} is 1 to {bound} bytes in UTF-8; this one is {size}")
        return text

    return AfterValidator(sized)


class AlertRuleConfig(_Model):
    """An alert rule (README "Alerts"): its kind, its parameters, and where it goes: a ``webhook``
    or the alert handler of ``receiverApp``'s executors (with neither, the app's own)."""

    kind: Kind
    webhook: str | None = Field(default=None, min_length=1, max_length=2048)
    # The HMAC key of X-Relay-Signature, or the environment variable holding it; without either, unsigned.
    secret: str | None = Field(default=None, min_length=MIN_SECRET, max_length=MAX_SECRET)
    secret_env: str | None = Field(default=None, min_length=1)
    format: Literal["json", "slack"] = "json"
    receiver_app: str | None = Field(default=None, min_length=1, max_length=256)
    # At least this long between two alerts of the rule about the same subject (a flapping executor).
    min_interval_secs: DurationOrZero = DEFAULT_MIN_INTERVAL_SECS
    workflow_name: str | None = Field(default=None, min_length=1, max_length=1024)
    count: Count | None = None
    window_secs: Duration | None = None
    queue_name: Annotated[str, _in_bytes("a queue's name", MAX_QUEUE_OR_SCHEDULE_NAME_BYTES)] | None = None
    threshold_secs: Duration | None = None
    for_secs: DurationOrZero | None = None
    reason: Literal["no_healthy_peer", "version_upgrade_not_allowed", "no_peer_of_its_language"] | None = None
    attempts: Count | None = None

    @field_validator("webhook")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        problem = webhook_problem(value) if value is not None else None
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("secret")
    @classmethod
    def _secret(cls, value: str | None) -> str | None:
        if value is not None and not valid_secret(value):
            raise ValueError(SECRET_RULE)  # never the secret itself: the error is logged
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AlertRuleConfig:
        allowed = PARAMS[self.kind]
        for name in _PARAM_FIELDS:
            if getattr(self, name) is not None and to_camel(name) not in allowed:
                accepted = ", ".join(allowed) or "no parameters"
                raise ValueError(f"{to_camel(name)} does not apply to {self.kind.value} (it takes {accepted})")
        if self.webhook is not None and self.receiver_app is not None:
            raise ValueError("give a webhook or a receiverApp, not both")
        if self.webhook is None and (self.secret or self.secret_env or self.format != "json"):
            raise ValueError("secret, secretEnv and format apply to a webhook only")
        if self.secret is not None and self.secret_env is not None:
            raise ValueError("give a secret or a secretEnv, not both")
        if self.secret_env is not None and not os.environ.get(self.secret_env):
            raise ValueError(f"secretEnv: the environment variable {self.secret_env} is not set")
        if self.secret_env is not None and not valid_secret(os.environ[self.secret_env]):
            raise ValueError(f"secretEnv: the environment variable {self.secret_env} holds no secret: {SECRET_RULE}")
        return self

    def params(self) -> dict[str, Any]:
        """The kind's parameters, defaults filled in (camelCase, as relay.yaml and the API name them)."""
        return {name: _or(getattr(self, _snake(name)), default) for name, default in PARAMS[self.kind].items()}

    def signing_secret(self) -> str | None:
        return os.environ.get(self.secret_env) or None if self.secret_env is not None else self.secret


_PARAM_FIELDS = (
    "workflow_name", "count", "window_secs", "queue_name", "threshold_secs", "for_secs", "reason", "attempts"
)  # fmt: skip


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def ascii_host(host: str) -> str:
    """A host name as DNS, the Host header and TLS know it: an internationalised name
    (``bücher.example``) in its IDNA form (``xn--bcher-kva.example``, with the UTS 46 mapping
    browsers use). Raises ValueError (idna's errors are UnicodeErrors) for a name IDNA does not allow."""
    if host.isascii():
        return host
    return idna.encode(host, uts46=True).decode("ascii")


def webhook_problem(url: str) -> str | None:
    """What is wrong with a webhook URL as written (the allow-list is checked apart); None if nothing."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"not a URL: {exc}"
    if parts.scheme not in ("http", "https"):
        return "the scheme must be http or https"
    if not parts.hostname:
        return "the URL has no host"
    if port == 0:
        return "port 0 is not a destination"
    if any(c.isspace() or not c.isprintable() for c in url):
        return "the URL has spaces or control characters"
    return None


class AppConfig(_Model):
    name: str
    executor_timeout_secs: Duration = DEFAULT_EXECUTOR_TIMEOUT_SECS
    recover_to_latest_version: bool = False
    # Retention of the app's workflows in its system database, as DBOS Conductor's app settings
    # (None: off): finished workflows older than gcTimeThresholdMs, or beyond the newest
    # gcRowsThreshold, are deleted; unfinished ones older than globalTimeoutMs are cancelled.
    gc_time_threshold_ms: RetentionThreshold | None = None
    gc_rows_threshold: RetentionThreshold | None = None
    global_timeout_ms: RetentionThreshold | None = None
    alerts: list[AlertRuleConfig] = []

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not valid_app_name(value):
            raise ValueError(APP_NAME_RULE)
        return value

    @model_validator(mode="after")
    def _alerts(self) -> AppConfig:
        for n, rule in enumerate(self.alerts):
            if rule.kind is Kind.UNRESPONSIVE_APPLICATION and rule.webhook is None:
                if (rule.receiver_app or self.name) == self.name:
                    # An app with no executor cannot take an alert about itself.
                    raise ValueError(f"alerts.{n}: UnresponsiveApplication needs a webhook or another receiverApp")
        return self


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

    audit_days: float = Field(default=90.0, gt=0, le=MAX_DAYS, allow_inf_nan=False)
    # Finished recoveries and their attempts.
    recoveries_days: float = Field(default=30.0, gt=0, le=MAX_DAYS, allow_inf_nan=False)
    # Relay's own finished DBOS workflows (grace periods, recoveries, this job).
    relay_workflows_days: float = Field(default=7.0, gt=0, le=MAX_DAYS, allow_inf_nan=False)
    # Executor ids not seen for this long are forgotten (with the key each was bound to).
    executor_ids_days: float = Field(default=30.0, gt=0, le=MAX_DAYS, allow_inf_nan=False)
    interval_secs: RoundInterval = 3600.0
    # How often each app with a retention setting (gcTimeThresholdMs, gcRowsThreshold,
    # globalTimeoutMs) gets a round: a `retention` request to one of its healthy executors.
    apps_interval_secs: RoundInterval = 600.0
    # The per-window counts that GET .../apps/{app}/metrics serves.
    app_metrics_days: float = Field(default=7.0, gt=0, le=MAX_DAYS, allow_inf_nan=False)


class MetricsConfig(_Model):
    """The apps' workflow figures (``dbos_conductor_v1_*``), computed from their executors."""

    # False: no figures are asked of the executors (Relay's own metrics are unaffected).
    app_figures: bool = True
    # The clock-aligned window the rates and maxima cover (DBOS Conductor's: a minute).
    app_figures_window_secs: float = Field(default=60.0, ge=0.5, le=3600, allow_inf_nan=False)


class AlertsConfig(_Model):
    """Alert delivery (README "Alerts"); the rules themselves are under each app."""

    # Hosts (hooks.internal, *.example.com) and networks (10.0.0.0/8, 127.0.0.1) webhooks may reach
    # besides public addresses; private, loopback and link-local addresses need listing.
    allowed_destinations: list[str] = []
    # False: only what allowedDestinations lists.
    allow_public_destinations: bool = True
    # How often each instance reads the audit log for ExecutorDead, RecoveryFailed, InstanceAdopted.
    poll_interval_secs: PollInterval = 1.0
    # How often the other rules are evaluated (once per interval, by one instance).
    check_interval_secs: RoundInterval = 30.0
    # A failed delivery is tried again after retryInitialSecs, doubling up to retryMaxSecs, maxAttempts in all.
    retry_initial_secs: PollInterval = 1.0
    retry_max_secs: float = Field(default=300.0, gt=0, le=MAX_SECS, allow_inf_nan=False)
    max_attempts: int = Field(default=30, ge=1, le=MAX_COUNT)
    # One webhook request (connection, sending, the response's status line).
    timeout_secs: float = Field(default=10.0, gt=0, le=MAX_SECS, allow_inf_nan=False)
    # False: an alerted condition's end is audited (alert.resolved) but no resolution is delivered,
    # for receivers that take every call as a new alert (as Conductor, which sends none).
    send_resolutions: bool = True

    @field_validator("allowed_destinations")
    @classmethod
    def _entries(cls, value: list[str]) -> list[str]:
        for entry in value:
            parse_entry(entry, ascii_host)
        return value

    @model_validator(mode="after")
    def _retries(self) -> AlertsConfig:
        if self.retry_max_secs < self.retry_initial_secs:
            raise ValueError("retryMaxSecs must be at least retryInitialSecs")
        return self

    def policy(self) -> DestinationPolicy:
        return DestinationPolicy.from_entries(self.allowed_destinations, self.allow_public_destinations, ascii_host)


class ReconcilerConfig(_Model):
    """The stranded-workflow reconciler (README, "Stranded work: the reconciler")."""

    enabled: bool = True
    # How often each app's PENDING workflows are looked over (one run per app and interval).
    interval_secs: RoundInterval = 300.0
    # Apps it never looks at (the off switch per app): "org/app" for one org's app, a bare "app"
    # for the apps of that name in every org (what every entry meant before "org/app").
    skip_apps: list[str] = []
    # Also recover the workflows of executor ids Relay never registered (never "local"); their
    # workflows may be another app's that shares the system database (README).
    include_unknown_executors: bool = False

    @field_validator("skip_apps")
    @classmethod
    def _skip_entries(cls, value: list[str]) -> list[str]:
        for entry in value:
            org, _, app = entry.rpartition("/")
            if not app or (entry.count("/") and not org):
                raise ValueError(f"{entry!r}: give an app (every org) or org/app (one org)")
        return value

    def skips(self, org: str, app: str) -> bool:
        """Whether ``skipApps`` names ``app`` of ``org``: as ``org/app``, or as a bare name (every org).
        The last "/" splits an entry: an app whose name holds one has no executor (the name is a
        segment of the executors' URL), so the reconciler never looks at it."""
        for entry in self.skip_apps:
            skipped_org, _, skipped_app = entry.rpartition("/")
            if skipped_app == app and skipped_org in ("", org):
                return True
        return False


class RelayConfig(_Model):
    server: ServerConfig = ServerConfig()
    database: DatabaseConfig = DatabaseConfig()
    liveness: LivenessConfig = LivenessConfig()
    retention: RetentionConfig = RetentionConfig()
    metrics: MetricsConfig = MetricsConfig()
    alerts: AlertsConfig = AlertsConfig()
    reconciler: ReconcilerConfig = ReconcilerConfig()
    # False: an executor may only connect to an app listed in relay.yaml (or registered through the API).
    auto_register_apps: bool = True
    orgs: list[OrgConfig] = []
    # The file it was read from (load_config); None: no file, the built-in defaults.
    _file: str | None = PrivateAttr(default=None)

    @property
    def file(self) -> str | None:
        return self._file

    @property
    def orgs_given(self) -> bool:
        """Whether the file has ``orgs`` at all (``orgs: []`` too). A file without it (or no file)
        says nothing of keys and alert rules: those an earlier file put in the shared database are
        left as they are, not removed from every instance (:func:`relay.store.configsync.sync_config`)."""
        return "orgs" in self.model_fields_set

    @model_validator(mode="after")
    def _unique(self) -> RelayConfig:
        org_names = [org.name for org in self.orgs]
        if len(org_names) != len(set(org_names)):
            raise ValueError("org names must be unique")
        # A key names exactly one org: the same hash twice would make it ambiguous.
        hashes = [k.sha256 for org in self.orgs for k in [*org.conductor_keys, *org.api_keys]]
        if len(hashes) != len(set(hashes)):
            raise ValueError("every conductor and API key hash must be unique across all orgs")
        policy = self.alerts.policy()
        for org in self.orgs:
            for app in org.apps:
                for n, rule in enumerate(app.alerts):
                    refused = literal_refusal(policy, rule.webhook) if rule.webhook else None
                    if refused:
                        raise ValueError(f"orgs.{org.name}.apps.{app.name}.alerts.{n}.webhook: {refused}")
        return self

    def with_overrides(
        self,
        *,
        host: str | None = None,
        port: int | None = None,
        database_url: str | None = None,
        source: str = "the command line's options",
    ) -> RelayConfig:
        """A copy with server/database fields replaced (command-line options, RELAY_DATABASE_URL),
        validated as the file is: an option cannot give what relay.yaml would be refused for.
        Raises ConfigError naming ``source``, where the values came from."""
        data = self.model_dump()
        if not self.orgs_given:
            del data["orgs"]  # still not given: an override does not make "no orgs" an empty list
        if host is not None:
            data["server"]["host"] = host
        if port is not None:
            data["server"]["port"] = port
        if database_url:
            data["database"]["url"] = database_url
        try:
            copy = RelayConfig.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_describe(exc, source)) from exc
        copy._file = self._file
        return copy


def literal_refusal(policy: DestinationPolicy, url: str) -> str | None:
    """Why a webhook whose host is an address is refused by the allow-list (names are resolved at send time)."""
    host = urlsplit(url).hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return policy.refusal(host, address)


def _describe(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is an error. YAML says a
    mapping's keys are unique, but PyYAML keeps the last silently: a second ``orgs:`` appended to the
    file would drop the first, with its keys. Keys a merge (``<<: *base``) brings may still be
    overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # a key that is not hashable: the constructor below refuses it
            if first is not None:
                raise _DuplicateKey(f"line {line}: the key {key!r} is given twice in a mapping (first on line {first})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_config(text: str, source: str = "relay.yaml") -> RelayConfig:
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only
    except _DuplicateKey as exc:
        raise ConfigError(f"{source}: {exc}") from exc
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


# An empty database URL, from the environment or the command line: not taken for "none given".
EMPTY_DATABASE_URL = "{given}: {it} for the embedded PostgreSQL, or give a PostgreSQL URL"


def load_config(path: str | os.PathLike[str] | None) -> RelayConfig:
    """Read relay.yaml; ``None`` (or an empty path, as an empty ``RELAY_CONFIG`` gives) means no
    file, all defaults.

    ``RELAY_DATABASE_URL`` overrides ``database.url``; a bad one is reported as that variable's. Set
    but empty (or blank) it is refused, unlike Relay's other variables: taken for unset, it would
    start the embedded PostgreSQL, where a deployment whose URL did not come through (compose's
    ``RELAY_DATABASE_URL: ${DB_URL}`` with ``DB_URL`` unset) would keep its state in a throwaway
    local database.
    """
    if path is None or not os.fspath(path):
        config = RelayConfig()
    else:
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read: {exc.strerror or exc}") from exc
        config = parse_config(text, str(file))
        config._file = str(file)
    env_url = os.environ.get("RELAY_DATABASE_URL")
    if env_url is not None and not env_url.strip():
        raise ConfigError(EMPTY_DATABASE_URL.format(given="RELAY_DATABASE_URL is set but empty", it="unset it"))
    if env_url:
        config = config.with_overrides(database_url=env_url, source="RELAY_DATABASE_URL")
    return config
