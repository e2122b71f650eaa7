"""Alert rules, the alerts fired, the conditions that hold, and what the rules read.

- ``alert_rules``: relay.yaml's rules (copied in at every start, ``source
  'config'``, with an id drawn from their content) and the API's. A webhook's
  URL and secret live here only: :class:`RuleRecord` carries them to the
  sender, and the API shows a host and whether a secret is set. A
  WorkflowFailure rule's row keeps when its failures were last counted
  (``counted_at``), for the next count, on any instance, to reach back to.
- ``alerts``: one row per idempotency key, claimed by the first step of its
  delivery workflow (which also applies the repeat interval) and finished by
  its last one, with the ``alert.sent`` or ``alert.failed`` audit entry. A
  condition's episode held back by the interval (``suppressed``) is claimed
  late once the interval has passed, if it still holds (:meth:`AlertStore.late`).
- ``alert_conditions``: for condition rules, each subject for which the
  condition holds and since when; a subject that stops holding loses its row,
  so holding again is a new episode (a new alert), and an episode that was
  alerted ends with ``alert.resolved`` in the audit log (its resolution).
- ``alert_cursor``: how far the audit log has been read for event rules.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from relay.config import MAX_SECS, AlertRuleConfig, AppConfig, RelayConfig
from relay.core.alerts import (
    CONDITION_KINDS,
    DEATH_END_ACTIONS,
    DEATH_KINDS,
    EVENT_ACTIONS,
    RESOLVED_ACTION,
    RULE_REMOVED,
    Alert,
    AuditFact,
    Kind,
    Rule,
    subject_of,
    why_over,
)
from relay.core.times import us_iso
from relay.errors import NotFound
from relay.store.audit import AuditAction, AuditEntry, write_audit
from relay.store.db import Database
from relay.store.instances import dbos_ran

log = logging.getLogger("relay.alerts")

Conn = psycopg.AsyncConnection[dict[str, Any]]


# How far back the alert poll reads for a transaction still open (AlertStore.open_since): Relay's
# own are short; an instance paused inside one for longer than this loses its entries' alerts.
OPEN_SINCE_MAX_SECS = 3600.0
# The advisory lock of :meth:`AlertStore.sync_config` (relay.store.keys and the migrations have their own).
CONFIG_RULES_LOCK_KEY = 7_215_420_113_003


@dataclass(frozen=True)
class RuleRecord:
    id: str
    org: str
    app: str
    kind: Kind
    params: dict[str, Any]
    min_interval_secs: float
    webhook_url: str | None
    secret: str | None
    format: str
    receiver_app: str | None
    source: str
    created_at: datetime
    created_by: str | None
    last_fired_at: datetime | None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> RuleRecord:
        return cls(**{**row, "kind": Kind(row["kind"])})

    def rule(self) -> Rule:
        return Rule(self.id, self.org, self.app, self.kind, self.params, self.created_at.timestamp())


@dataclass(frozen=True)
class Claim:
    send: bool
    reason: str


# What a relay.yaml rule watches for; where it sends (webhook, format, secret, receiving app) is not
# part of it, so that pointing a rule elsewhere keeps the rule (and its deliveries under way).
Identity = tuple[str, str, str, str, float]


def _identity(org: str, app: str, kind: str, params: dict[str, Any], min_interval_secs: float) -> Identity:
    return (org, app, kind, json.dumps(params, sort_keys=True), float(min_interval_secs))


def config_rule_id(org: str, app: str, rule: AlertRuleConfig, nth: int = 0) -> str:
    """relay.yaml's rules have no id of their own: one drawn from what the rule watches for (and
    ``nth``, its place among the file's rules that watch for the same thing), the same on every
    instance and at every start, and new when what it watches for changes. Ids drawn before also
    hashed the destination; :meth:`AlertStore.sync_config` keeps a rule's id whichever way it was drawn."""
    content = {"kind": rule.kind.value, "params": rule.params(), "minIntervalSecs": float(rule.min_interval_secs)}
    digest = hashlib.sha256(json.dumps([org, app, content, nth], sort_keys=True).encode()).hexdigest()
    return f"config-{digest[:20]}"


_COLUMNS = """id, org, app, kind, params, min_interval_secs, webhook_url, secret, format, receiver_app, source,
              created_at, created_by, last_fired_at"""

# The alerts of these death rules (a list of ids) that a rule's removal resolves: sent (or being
# sent), not resolved already, and their death not over (the executor DEAD or RECOVERING at its epoch).
_OPEN_DEATH_ALERTS = """FROM alerts a
    JOIN executors e ON e.org = a.org AND e.app = a.app AND e.executor_id = a.subject
     AND e.state IN ('DEAD', 'RECOVERING') AND a.idempotency_key = a.rule_id || ':' || a.subject || ':' || e.epoch
    WHERE a.rule_id = ANY(%s) AND a.status IN ('sending', 'sent') AND a.resolved_at IS NULL"""


class AlertStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    # -- rules -------------------------------------------------------------------------

    async def sync_config(self, config: RelayConfig, conn: Conn | None = None) -> None:
        """Make relay.yaml's rules in the database match the file (after the apps are synced; in
        ``conn``'s transaction, if given: :func:`relay.store.configsync.sync_config`).

        A rule of the file is the rule in the database that watches for the same thing (its kind,
        parameters and minimum interval), whatever its destination: a rule pointed at another
        webhook keeps its id, so an alert being delivered when Relay restarts goes on to where the
        rule says now, not to "its rule was deleted". A rule whose parameters or minimum interval
        were edited keeps the id of the file's earlier rule of its app and kind that the file no
        longer has: an incident it alerted goes on as the same episode under the edited rule (no
        second page for it, and its resolution when it ends), and its deliveries under way go on.
        Rules the file no longer has are deleted, the alerts they left open resolved (:meth:`removing`)."""
        async with self.db.transaction(conn) as conn:
            # One instance's sync at a time: two inserting the same new rules in another order (their
            # files list them so) each waited for the other's, and one failed to start.
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (CONFIG_RULES_LOCK_KEY,))
            # Locked by id, as every path that locks several rules does (:meth:`removing`, an app's
            # deletion): in order of creation, each of this and an app's deletion could hold a rule
            # the other waited for, and PostgreSQL failed one of them. Read in order of creation.
            cur = await conn.execute(
                """SELECT id, org, app, kind, params, min_interval_secs, created_at FROM alert_rules
                   WHERE source = 'config' ORDER BY id FOR UPDATE"""
            )
            held: dict[Identity, list[str]] = {}
            rows = sorted(await cur.fetchall(), key=lambda r: (r["created_at"], r["id"]))
            # Every id the file's rules hold now: an id drawn anew must be none of them (the id an
            # edited rule kept was drawn from its earlier parameters, which a rule added back has).
            taken = {str(r["id"]) for r in rows}
            taken_before = set(taken)
            for r in rows:
                ident = _identity(r["org"], r["app"], r["kind"], r["params"], r["min_interval_secs"])
                held.setdefault(ident, []).append(r["id"])
            seen: dict[Identity, int] = {}
            placed: list[tuple[str, AppConfig, AlertRuleConfig, str | None, int]] = []
            for org in config.orgs:
                for app in org.apps:
                    for rule in app.alerts:
                        ident = _identity(org.name, app.name, rule.kind.value, rule.params(), rule.min_interval_secs)
                        nth = seen.get(ident, 0)
                        seen[ident] = nth + 1
                        ids = held.get(ident, [])
                        placed.append((org.name, app, rule, ids.pop(0) if ids else None, nth))
            # Rules the file no longer has, by app and kind: the ids an edited rule takes over.
            spare: dict[tuple[str, str, str], list[str]] = {}
            for ident, ids in held.items():
                spare.setdefault(ident[:3], []).extend(ids)
            kept: list[str] = []
            for org_name, app, rule, found, nth in placed:
                edited = spare.get((org_name, app.name, rule.kind.value), [])
                rule_id = found or (edited.pop(0) if edited else None)
                while rule_id is None:
                    drawn = config_rule_id(org_name, app.name, rule, nth)
                    rule_id = None if drawn in taken else drawn
                    nth += 1
                taken.add(rule_id)
                kept.append(rule_id)
                receiver = None if rule.webhook else (rule.receiver_app or app.name)
                await conn.execute(
                    """INSERT INTO alert_rules (id, org, app, kind, params, min_interval_secs, webhook_url,
                                                secret, format, receiver_app, source)
                       VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 'config')
                       ON CONFLICT (id) DO UPDATE SET params = EXCLUDED.params,
                           min_interval_secs = EXCLUDED.min_interval_secs, webhook_url = EXCLUDED.webhook_url,
                           secret = EXCLUDED.secret, format = EXCLUDED.format,
                           receiver_app = EXCLUDED.receiver_app""",
                    (rule_id, org_name, app.name, rule.kind.value, Jsonb(rule.params()),
                     rule.min_interval_secs, rule.webhook, rule.signing_secret(), rule.format, receiver),
                )  # fmt: skip
            gone = sorted(taken_before - set(kept))
            if gone:
                await self.removing(conn, gone, "its rule was taken out of relay.yaml")
            await conn.execute("DELETE FROM alert_rules WHERE source = 'config' AND NOT (id = ANY(%s))", (kept,))
            # A receiving app Relay does not know (a typo, or an app whose executors never connected
            # yet): the API refuses such a rule (404); the file's is kept, since the app may come,
            # but said, or its alerts would fail unseen until then.
            cur = await conn.execute(
                """SELECT DISTINCT r.org, r.app, r.receiver_app FROM alert_rules r
                   WHERE r.source = 'config' AND r.receiver_app IS NOT NULL AND NOT EXISTS
                         (SELECT 1 FROM apps a WHERE a.org = r.org AND a.name = r.receiver_app)
                   ORDER BY 1, 2, 3"""
            )
            for r in await cur.fetchall():
                log.warning("relay.yaml: an alert rule of app %s/%s delivers to app %r, which org %s does not have "
                            "(yet): its alerts fail until executors of that app connect",
                            r["org"], r["app"], r["receiver_app"], r["org"])  # fmt: skip

    async def list_rules(self, org: str, app: str, limit: int, offset: int) -> list[RuleRecord]:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                f"""SELECT {_COLUMNS} FROM alert_rules WHERE org = %s AND app = %s
                    ORDER BY source = 'api', created_at, id LIMIT %s OFFSET %s""",
                (org, app, limit, offset),
            )
            return [RuleRecord.from_row(r) for r in await cur.fetchall()]

    async def get_rule(self, rule_id: str) -> RuleRecord | None:
        async with self.db.connection() as conn:
            cur = await conn.execute(f"SELECT {_COLUMNS} FROM alert_rules WHERE id = %s", (rule_id,))
            row = await cur.fetchone()
        return RuleRecord.from_row(row) if row else None

    @staticmethod
    async def create(conn: Conn, record: dict[str, Any]) -> RuleRecord:
        """The rule, in the caller's transaction; NotFound when its app is not there (deleted since the
        caller looked for it: the insert waited for the deletion, then found no app to belong to)."""
        try:
            cur = await conn.execute(
                f"""INSERT INTO alert_rules (id, org, app, kind, params, min_interval_secs, webhook_url, secret,
                                             format, receiver_app, source, created_by)
                    VALUES (%(id)s, %(org)s, %(app)s, %(kind)s, %(params)s, %(min_interval_secs)s, %(webhook_url)s,
                            %(secret)s, %(format)s, %(receiver_app)s, 'api', %(created_by)s)
                    RETURNING {_COLUMNS}""",
                {**record, "params": Jsonb(record["params"])},
            )
        except psycopg.errors.ForeignKeyViolation as exc:
            raise NotFound(f"no app {record['app']!r} in org {record['org']!r}") from exc
        row = await cur.fetchone()
        assert row is not None
        return RuleRecord.from_row(row)

    @staticmethod
    async def delete(conn: Conn, rule_id: str) -> bool:
        cur = await conn.execute("DELETE FROM alert_rules WHERE id = %s AND source = 'api'", (rule_id,))
        return cur.rowcount == 1

    @staticmethod
    async def removing(conn: Conn, rule_ids: list[str], why: str) -> None:
        """Rules about to be deleted (in the caller's transaction, which deletes them): the alerts each
        left open are resolved, to where the rule sent them. Its destination is kept
        (``alert_rules_removed``) for their deliveries, and ``alert.resolved`` written, ``why`` its
        reason and ``ended: rule_removed``, for each alert sent (or being sent) whose episode still
        holds (a condition's) or whose death is not over (an ExecutorDead or RecoveryFailed alert: the
        executor is still DEAD or RECOVERING at the death's epoch). Not for an alert that failed or was
        held back, nor an InstanceAdopted one (it has no end), nor one resolved already (a rule taken
        out of relay.yaml, put back and taken out again: the first entry may be gone by then). Written
        once per alert whatever runs this again (two instances syncing relay.yaml), by the entry's
        dedupe key."""
        cur = await conn.execute(
            f"SELECT {_COLUMNS} FROM alert_rules WHERE id = ANY(%s) ORDER BY id FOR UPDATE", (rule_ids,)
        )
        records = [RuleRecord.from_row(r) for r in await cur.fetchall()]
        if not records:
            return
        await conn.execute(
            f"""INSERT INTO alert_rules_removed ({_COLUMNS}, removed_why)
                SELECT {_COLUMNS}, %s FROM alert_rules WHERE id = ANY(%s) ORDER BY id
                ON CONFLICT (id) DO UPDATE SET org = EXCLUDED.org, app = EXCLUDED.app, kind = EXCLUDED.kind,
                    params = EXCLUDED.params, min_interval_secs = EXCLUDED.min_interval_secs,
                    webhook_url = EXCLUDED.webhook_url, secret = EXCLUDED.secret, format = EXCLUDED.format,
                    receiver_app = EXCLUDED.receiver_app, source = EXCLUDED.source,
                    created_at = EXCLUDED.created_at, created_by = EXCLUDED.created_by,
                    last_fired_at = EXCLUDED.last_fired_at, removed_at = now(),
                    removed_why = EXCLUDED.removed_why""",
            (why, [r.id for r in records]),
        )
        # The death alerts it may resolve, locked before any entry is written, in the order of their
        # keys, as retention locks those whose old ``alert.resolved`` it prunes (relay.store.retention),
        # and read again below once locked. Else, as retention deleted the old entry of an alert an
        # instance of the previous release had resolved (a rolling upgrade: the entry alone, no
        # resolved_at), this found the alert not marked yet and wrote its entry anew once retention
        # committed, a second resolution; or it held one such alert's row, which retention waited
        # for, while it waited for retention's deletion of another's entry (its dedupe key), and
        # PostgreSQL failed one of them (an instance failed to start: only relay.yaml puts a rule back
        # under its id).
        deaths = [r.id for r in records if r.kind in DEATH_KINDS]
        if deaths:
            await conn.execute(f"SELECT 1 {_OPEN_DEATH_ALERTS} ORDER BY a.idempotency_key FOR UPDATE OF a", (deaths,))
        for record in records:
            rule = record.rule()
            if rule.kind in CONDITION_KINDS:
                await AlertStore._end_episodes(conn, rule, [], why, RULE_REMOVED)
            elif rule.kind in DEATH_KINDS:
                cur = await conn.execute(
                    f"SELECT a.subject, a.idempotency_key {_OPEN_DEATH_ALERTS} ORDER BY a.subject", ([rule.id],)
                )
                for row in await cur.fetchall():
                    await _resolved(conn, rule, str(row["subject"]), str(row["idempotency_key"]), why, RULE_REMOVED)

    @staticmethod
    async def app_rule_ids(conn: Conn, org: str, app: str) -> list[str]:
        """The ids of an app's rules (deleting the app deletes them)."""
        cur = await conn.execute("SELECT id FROM alert_rules WHERE org = %s AND app = %s ORDER BY id", (org, app))
        return [str(r["id"]) for r in await cur.fetchall()]

    async def removed_rule(self, rule_id: str) -> RuleRecord | None:
        """A removed rule, as it was (:meth:`removing`): where the resolutions of its alerts go."""
        async with self.db.connection() as conn:
            cur = await conn.execute(f"SELECT {_COLUMNS} FROM alert_rules_removed WHERE id = %s", (rule_id,))
            row = await cur.fetchone()
        return RuleRecord.from_row(row) if row else None

    async def removed_rules(self, kinds: frozenset[Kind]) -> list[Rule]:
        """Removed rules of these kinds that no rule has taken the id of again."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                f"""SELECT {_COLUMNS} FROM alert_rules_removed d
                    WHERE kind = ANY(%s) AND NOT EXISTS (SELECT 1 FROM alert_rules r WHERE r.id = d.id)
                    ORDER BY id""",
                ([k.value for k in kinds],),
            )
            return [RuleRecord.from_row(r).rule() for r in await cur.fetchall()]

    async def rules_of(self, kinds: frozenset[Kind]) -> list[Rule]:
        """Every rule of these kinds, in every org."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                f"SELECT {_COLUMNS} FROM alert_rules WHERE kind = ANY(%s) ORDER BY id", ([k.value for k in kinds],)
            )
            return [RuleRecord.from_row(r).rule() for r in await cur.fetchall()]

    # -- the audit log, for event rules --------------------------------------------------

    async def cursor(self) -> int:
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT last_id FROM alert_cursor WHERE id = 1")
            row = await cur.fetchone()
        return int(row["last_id"]) if row else 0

    async def cursor_and_drawn(self) -> tuple[int, int, datetime]:
        """The cursor; the last audit id drawn from its sequence: never below an id read already,
        unless the database went back in time (a restore, a failover to a replica that lagged), which
        takes the sequence back with it and draws the ids again; and when the database server
        started (``pg_postmaster_start_time()``): a restore or a failover is another start, however
        many ids were drawn since."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT (SELECT last_id FROM alert_cursor WHERE id = 1) AS cursor,
                          (SELECT last_value FROM audit_log_id_seq) AS drawn,
                          pg_postmaster_start_time() AS server_started"""
            )
            row = await cur.fetchone()
        assert row is not None
        return int(row["cursor"] or 0), int(row["drawn"]), row["server_started"]

    async def advance(self, last_id: int) -> None:
        async with self.db.connection() as conn:
            await conn.execute("UPDATE alert_cursor SET last_id = greatest(last_id, %s) WHERE id = 1", (last_id,))

    async def open_since(self) -> datetime:
        """When the oldest transaction of Relay's open now began (now, if none is): an audit entry not
        committed yet is dated its transaction's start (``now()``), so none committed later is older.
        Read before the entries it is meant for, in a statement of its own. At most
        :data:`OPEN_SINCE_MAX_SECS` back: a session of the same user left open for hours (a
        ``pg_dump``, a psql idle in a transaction) would otherwise make every poll read that far."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT greatest(least(now(), min(xact_start)), now() - make_interval(secs => %s)) AS since
                   FROM pg_stat_activity
                   WHERE datname = current_database() AND usename = current_user
                     AND backend_type = 'client backend' AND pid <> pg_backend_pid()""",
                (OPEN_SINCE_MAX_SECS,),
            )
            row = await cur.fetchone()
        assert row is not None
        since: datetime = row["since"]
        return since

    async def audit_facts(
        self, after: int, overlap_secs: float, limit: int = 1000, not_before: datetime | None = None
    ) -> list[AuditFact]:
        """Entries that fire event rules: the first ``limit`` after ``after``, and again the latest
        ``limit`` of the last ``overlap_secs`` up to ``after`` (an entry's id is drawn before its
        transaction commits, so a later id can be seen first), or since ``not_before`` if that is
        earlier (a transaction open longer). The two are read apart: entries already read, however
        many, never stand in the way of new ones. A ``recovery.failed`` comes with the failed
        attempts of that death so far, it and an ``executor.deleted`` (either may end a death:
        :func:`relay.core.alerts.death_over`) with the epoch of the death their recovery is for."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """WITH picked AS (
                       (SELECT id FROM audit_log WHERE id > %(after)s AND action = ANY(%(actions)s)
                        ORDER BY id LIMIT %(limit)s)
                       UNION ALL
                       (SELECT id FROM audit_log
                        WHERE at >= least(now() - make_interval(secs => %(overlap)s), %(not_before)s::timestamptz)
                          AND id <= %(after)s
                          AND action = ANY(%(actions)s)
                        ORDER BY at DESC, id DESC LIMIT %(limit)s))
                   SELECT l.id, l.at, l.org, l.app, l.action, l.executor_id, l.peer_executor_id, l.detail,
                          r.epoch AS recovery_epoch,
                          (SELECT count(*) FROM recovery_attempts a JOIN recoveries r2 ON r2.id = a.recovery_id
                           WHERE r2.org = r.org AND r2.app = r.app AND r2.executor_id = r.executor_id
                             AND r2.epoch = r.epoch AND a.outcome = 'failed') AS failed_attempts
                   FROM picked p JOIN audit_log l ON l.id = p.id
                   LEFT JOIN recoveries r ON l.action = ANY(%(ends)s) AND r.id = l.detail->>'recoveryId'
                   ORDER BY l.id""",
                {
                    "after": after,
                    "overlap": overlap_secs,
                    "actions": sorted({*EVENT_ACTIONS, RESOLVED_ACTION, *DEATH_END_ACTIONS}),
                    "ends": sorted(DEATH_END_ACTIONS),
                    "limit": limit,
                    "not_before": not_before,
                },
            )
            rows = await cur.fetchall()
        return [
            AuditFact(
                id=int(r["id"]),
                at=us_iso(r["at"]),
                at_unix=r["at"].timestamp(),
                org=r["org"],
                app=r["app"],
                action=r["action"],
                executor_id=r["executor_id"],
                detail=r["detail"] or {},
                failed_attempts=int(r["failed_attempts"] or 0),
                recovery_epoch=None if r["recovery_epoch"] is None else int(r["recovery_epoch"]),
                peer=r["peer_executor_id"],
            )
            for r in rows
        ]

    # -- conditions ------------------------------------------------------------------------

    async def reading(self) -> int:
        """A number for an evaluation about to read its rule's condition: later readings draw larger
        ones, on every instance (:meth:`settle`)."""
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT nextval('alert_readings') AS n")
            row = await cur.fetchone()
            return int(row["n"]) if row else 0

    async def counted_at(self, rule_id: str) -> float | None:
        """When the rule's failures were last counted by an evaluation that settled (:meth:`settle`),
        on any instance; None if never (a new rule, or one of a release before migration 24)."""
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT counted_at FROM alert_rules WHERE id = %s", (rule_id,))
            row = await cur.fetchone()
        return None if row is None or row["counted_at"] is None else float(row["counted_at"].timestamp())

    async def settle(
        self,
        rule: Rule,
        holding: list[str],
        hold_secs: float,
        reading: int | None = None,
        over: str | None = None,
        counted_at: float | None = None,
    ) -> list[tuple[str, int, str]]:
        """Record which subjects the condition holds for now; returns (subject, episode, since) of
        those that have held for ``hold_secs``. A subject no longer holding ends its episode; if
        the episode was alerted (its alert sent, or being sent), ``alert.resolved`` is written with
        it, saying why (``over``, or the kind's own reason), for its resolution to be delivered.

        ``reading`` (:meth:`reading`, drawn before the condition was read): a reading older than
        one the rule has settled already changes nothing and returns nothing. Evaluations of one
        rule overlap (on two instances, or a slow executor's reply outlasting a round), and an
        old "not holding" would otherwise end an episode that a newer reading had alerted, so the
        next round alerted it again as a new one; an old "holding" would begin an episode that
        had ended. A rule whose recorded reading is ahead of the sequence itself (the sequence was
        reset: a restore, a copy by logical replication, which leaves sequences behind) takes the
        reading, rather than finding every later one stale for ever.

        ``counted_at``: when a WorkflowFailure rule's count was made (Relay's clock, before it
        asked), kept with what the count found, for the next count to reach back to
        (:meth:`counted_at`). Kept only here: a count whose evaluation fails before it settles (the
        database, the instance killed) leaves the previous time, and the next count reaches back
        over what it saw."""
        async with self.db.fenced() as conn:
            cur = await conn.execute(
                """SELECT settled_reading, settled_reading > (SELECT last_value FROM alert_readings) AS ahead
                   FROM alert_rules WHERE id = %s FOR UPDATE""",
                (rule.id,),
            )
            row = await cur.fetchone()
            if row is None:
                return []  # deleted meanwhile
            if reading is not None:
                if row["settled_reading"] is not None and row["settled_reading"] > reading and not row["ahead"]:
                    return []  # a newer reading settled first
                await conn.execute("UPDATE alert_rules SET settled_reading = %s WHERE id = %s", (reading, rule.id))
            if counted_at is not None:
                await conn.execute(
                    "UPDATE alert_rules SET counted_at = %s WHERE id = %s",
                    (datetime.fromtimestamp(counted_at, UTC), rule.id),
                )
            await self._end_episodes(conn, rule, holding, over)
            await conn.execute(
                """INSERT INTO alert_conditions (rule_id, subject) SELECT %s, unnest(%s::text[])
                   ON CONFLICT DO NOTHING""",
                (rule.id, holding),
            )
            cur = await conn.execute(
                """SELECT subject, episode, since FROM alert_conditions
                   WHERE rule_id = %s AND since <= now() - make_interval(secs => %s) ORDER BY subject""",
                (rule.id, hold_secs),
            )
            return [(r["subject"], int(r["episode"]), us_iso(r["since"])) for r in await cur.fetchall()]

    @staticmethod
    async def _end_episodes(
        conn: Conn, rule: Rule, holding: list[str], over: str | None, ended: str | None = None
    ) -> None:
        """End the episodes of the subjects no longer holding, with ``alert.resolved`` for each one
        alerted: in the same transaction, so that an episode that ends is resolved however the step
        that ended it fares (it may run again, and find it ended). ``ended``: why in one word, for
        ``metadata.ended`` (``rule_removed``), if not the condition's own end."""
        cur = await conn.execute(
            """WITH ended AS (DELETE FROM alert_conditions WHERE rule_id = %(rule)s AND NOT (subject = ANY(%(held)s))
                              RETURNING subject, since)
               SELECT DISTINCT ON (e.subject) e.subject, a.idempotency_key
               FROM ended e JOIN alerts a ON a.rule_id = %(rule)s AND a.subject = e.subject
                AND a.status IN ('sending', 'sent') AND a.created_at >= e.since
               ORDER BY e.subject, a.created_at DESC""",
            {"rule": rule.id, "held": holding},
        )
        for row in await cur.fetchall():
            await _resolved(conn, rule, str(row["subject"]), str(row["idempotency_key"]), over, ended)

    async def resolved(self, keys: list[str]) -> set[str]:
        """Which of these alerts were resolved already (``alert.resolved`` written for them: their
        rule removed while their death went on). Its row says so, or, for one an instance of the
        release before migration 20 resolved (a rolling upgrade: it writes the entry alone), the
        entry does, until retention prunes it and marks the row (relay.store.retention)."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT idempotency_key FROM alerts a WHERE idempotency_key = ANY(%s)
                   AND (resolved_at IS NOT NULL OR EXISTS (
                        SELECT 1 FROM audit_log l WHERE l.dedupe_key = 'alert.resolved:' || a.idempotency_key))""",
                (keys,),
            )
            return {str(r["idempotency_key"]) for r in await cur.fetchall()}

    async def claimed(self, keys: list[str]) -> set[str]:
        """Which of these idempotency keys a delivery has claimed already."""
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT idempotency_key FROM alerts WHERE idempotency_key = ANY(%s)", (keys,))
            return {str(r["idempotency_key"]) for r in await cur.fetchall()}

    async def late(self, keys: list[str]) -> set[str]:
        """Which of these keys were held back by their rule's ``minIntervalSecs`` and may go out now:
        no other alert about the subject went out within the interval. A condition's key stays the
        same while its episode lasts, so without this an episode that began within the interval
        of the last alert (an app down again a moment after it came back) would never be alerted."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT a.idempotency_key FROM alerts a JOIN alert_rules r ON r.id = a.rule_id
                   WHERE a.idempotency_key = ANY(%s) AND a.status = 'suppressed'
                     AND NOT EXISTS (
                         SELECT 1 FROM alerts o WHERE o.rule_id = a.rule_id AND o.subject = a.subject
                           AND o.status IN ('sending', 'sent')
                           AND o.created_at > now() - make_interval(secs => least(r.min_interval_secs, %s)))""",
                (keys, MAX_SECS),
            )
            return {str(r["idempotency_key"]) for r in await cur.fetchall()}

    async def app_executors(self, org: str, app: str) -> tuple[bool, int]:
        """(whether the app has had executors, its HEALTHY ones). It has had some while an executor
        of it is in the registry, or one's id is still remembered (``executor_ids``, kept after a
        record is deleted until retention prunes ids not seen for ``executorIdsDays``) and was seen
        since the app was created (not an earlier app of the same name, deleted)."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT count(*) FILTER (WHERE state = 'HEALTHY') AS healthy,
                          count(*) > 0 OR EXISTS (
                              SELECT 1 FROM executor_ids i JOIN apps a ON a.org = i.org AND a.name = i.app
                              WHERE i.org = %(org)s AND i.app = %(app)s AND i.last_seen_at >= a.created_at
                          ) AS had
                   FROM executors WHERE org = %(org)s AND app = %(app)s""",
                {"org": org, "app": app},
            )
            row = await cur.fetchone()
        return (bool(row["had"]), int(row["healthy"])) if row else (False, 0)

    async def blocked(self, org: str, app: str) -> list[tuple[str, int, str]]:
        """(executor id, epoch, reason) of the app's DEAD executors whose recovery waits."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT executor_id, epoch, blocked_reason FROM executors
                   WHERE org = %s AND app = %s AND state = 'DEAD' AND blocked_reason IS NOT NULL
                   ORDER BY executor_id""",
                (org, app),
            )
            return [(r["executor_id"], int(r["epoch"]), r["blocked_reason"]) for r in await cur.fetchall()]

    async def still_dead(self, rule_id: str, org: str, app: str) -> list[tuple[str, int]]:
        """(executor id, epoch) of the deaths a RecoveryBlocked rule alerted that are not over: the
        executor is still DEAD or RECOVERING at that epoch (a recovery under way may fail and wait
        again; its alert's key, the death's, cannot page again). Their episode lasts until then,
        so that its resolution says the death is over, not that a recovery was merely tried."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT e.executor_id, e.epoch FROM alert_conditions c
                   JOIN executors e ON e.org = %(org)s AND e.app = %(app)s
                    AND c.subject = e.executor_id || '@' || e.epoch AND e.state IN ('DEAD', 'RECOVERING')
                   WHERE c.rule_id = %(rule)s AND EXISTS (
                       SELECT 1 FROM alerts a WHERE a.rule_id = c.rule_id AND a.subject = c.subject
                       AND a.status IN ('sending', 'sent') AND a.created_at >= c.since)
                   ORDER BY 1""",
                {"rule": rule_id, "org": org, "app": app},
            )
            return [(r["executor_id"], int(r["epoch"])) for r in await cur.fetchall()]

    # -- deliveries ----------------------------------------------------------------------------

    async def claim(self, alert: Alert, late: bool = False, claimant: str | None = None) -> Claim:
        """The delivery's first step: whether to send. Not when the key was delivered (or held back)
        already, nor within the rule's repeat interval of another alert about the same subject.
        ``late``: the key was held back, and is claimed now if the interval has passed, and its
        episode still holds. ``claimant``: the delivery workflow's id, recorded with a claim to
        send; this step run again (after a crash) sends only for the workflow that claimed, so a
        first delivery resumed after its late one claimed the key does not send it a second time."""
        key = alert.idempotency_key
        async with self.db.fenced() as conn:
            # One claim at a time per rule, so two alerts about one subject cannot both pass the interval.
            cur = await conn.execute(
                "SELECT min_interval_secs FROM alert_rules WHERE id = %s FOR UPDATE", (alert.rule_id,)
            )
            rule = await cur.fetchone()
            cur = await conn.execute("SELECT status, claimed_by FROM alerts WHERE idempotency_key = %s", (key,))
            existing = await cur.fetchone()
            status = None if existing is None else str(existing["status"])
            if existing is not None and not (late and status == "suppressed"):
                # this step again after a crash, or the key delivered long ago (rows claimed by an
                # earlier release name no claimant)
                by = existing["claimed_by"]
                ours = by is None or claimant is None or by == claimant
                return Claim(status == "sending" and ours, f"already {status}" + ("" if ours else f" by {by}"))
            if rule is None:
                return Claim(False, "its rule was deleted")
            if late:
                # Its episode must still hold: the round found it holding, but the claim may come later
                # (a Relay restarted in between), and an alert about an outage already over pages
                # someone for nothing. An episode that ended is over for good (holding again is a new
                # one, under a new key), so the key stays held back.
                # (A RecoveryBlocked alert's epoch is its death's, in its subject too; the others' is the episode.)
                episode = None if alert.kind == Kind.RECOVERY_BLOCKED.value else alert.epoch
                cur = await conn.execute(
                    """SELECT 1 FROM alert_conditions WHERE rule_id = %s AND subject = %s
                       AND (%s::text IS NULL OR episode::text = %s)""",
                    (alert.rule_id, alert.subject_key, episode, episode),
                )
                if await cur.fetchone() is None:
                    return Claim(False, f"its condition no longer holds for {alert.subject_key}")
            cur = await conn.execute(
                """SELECT 1 FROM alerts WHERE rule_id = %s AND subject = %s AND status IN ('sending', 'sent')
                   AND created_at > now() - make_interval(secs => %s) LIMIT 1""",
                (alert.rule_id, alert.subject_key, interval_secs(rule["min_interval_secs"])),
            )
            held_back = await cur.fetchone() is not None
            if status is None:
                await conn.execute(
                    """INSERT INTO alerts (idempotency_key, rule_id, org, app, kind, subject, status, claimed_by)
                       VALUES (%s, %s, %s, %s, %s, %s, %s, %s)""",
                    (key, alert.rule_id, alert.org, alert.app, alert.kind, alert.subject_key,
                     "suppressed" if held_back else "sending", claimant),
                )  # fmt: skip
            elif not held_back:
                # Held back, and going out now: the next alert's interval counts from now.
                await conn.execute(
                    """UPDATE alerts SET status = 'sending', claimed_by = %s, created_at = now(), updated_at = now()
                       WHERE idempotency_key = %s""",
                    (claimant, key),
                )
            if held_back:
                return Claim(False, f"another alert about {alert.subject_key} went out within minIntervalSecs")
            await conn.execute("UPDATE alert_rules SET last_fired_at = now() WHERE id = %s", (alert.rule_id,))
            return Claim(True, "claimed")

    async def status_of(self, key: str) -> str | None:
        """Where the delivery of the alert ``key`` stands (``sending``, ``sent``, ``failed``,
        ``suppressed``; ``starting``: its workflow, ``alert:{key}``, runs and has not claimed it
        yet), None if no delivery claimed it or is about to."""
        async with self.db.connection() as conn:
            # The workflow first, then the claim: a delivery that claims and finishes between the two
            # reads is found by the second (read the other way round, it was found by neither).
            running = await _workflows(conn, [key], f"AND w.status IN {_RUNNING}")
            cur = await conn.execute("SELECT status FROM alerts WHERE idempotency_key = %s", (key,))
            row = await cur.fetchone()
        if row is not None:
            return str(row["status"])
        return "starting" if running else None

    async def fired(self, keys: list[str]) -> set[str]:
        """Which of these alert keys were fired: a delivery claimed the key, or its workflow
        (``alert:{key}``) was started. A death's resolutions are made for every ExecutorDead and
        RecoveryFailed rule of its app; only those of an alert that was fired are delivered."""
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT idempotency_key FROM alerts WHERE idempotency_key = ANY(%s)", (keys,))
            claimed = {str(r["idempotency_key"]) for r in await cur.fetchall()}
            rest = [k for k in keys if k not in claimed]
            return claimed | (await _workflows(conn, rest, "") if rest else set())

    async def finish(
        self, alert: Alert, sent: bool, attempts: int, error: str | None, destination: str, dedupe: str
    ) -> bool:
        """The delivery's outcome, and its ``alert.sent`` or ``alert.failed`` audit entry; False if
        that entry was written before (the step recording it ran again: count it once)."""
        status = "sent" if sent else "failed"
        action: AuditAction = "alert.sent" if sent else "alert.failed"
        async with self.db.fenced() as conn:
            await conn.execute(
                """UPDATE alerts SET status = %s, attempts = %s, error = %s, updated_at = now()
                   WHERE idempotency_key = %s""",
                (status, attempts, error, alert.idempotency_key),
            )
            detail: dict[str, Any] = {
                "ruleId": alert.rule_id,
                "kind": alert.kind,
                "idempotencyKey": alert.idempotency_key,
                "attempts": attempts,
                "destination": destination,
                **alert.subject,
            }
            if error is not None:
                detail["error"] = error
            if alert.resolves is not None:
                detail["resolves"] = alert.resolves  # a resolution, of the alert of that key
            entry = AuditEntry(action, "relay", alert.subject.get("executorId"), None, detail, dedupe)
            return await write_audit(conn, alert.org, alert.app, entry)


async def _resolved(conn: Conn, rule: Rule, subject: str, key: str, over: str | None, ended: str | None) -> None:
    """``alert.resolved`` for the alert ``key`` of ``rule`` about ``subject``: its resolution is due."""
    detail = {
        "ruleId": rule.id,
        "kind": rule.kind.value,
        "resolves": key,
        "subjectKey": subject,
        "epoch": key.removeprefix(f"{rule.id}:{subject}:"),
        "reason": over or why_over(rule, subject),
        **subject_of(rule.kind, subject),
        **({"ended": ended} if ended else {}),
    }
    entry = AuditEntry(RESOLVED_ACTION, "relay", detail.get("executorId"), None, detail, f"{RESOLVED_ACTION}:{key}")
    await write_audit(conn, rule.org, rule.app, entry)
    # On the alert's row too, which outlives the entry and Relay's workflow of the resolution while a
    # death goes on: its end makes no second resolution (AlertLoops.poll_events), nor does its rule's
    # removal again (:meth:`AlertStore.removing`).
    await conn.execute(
        "UPDATE alerts SET resolved_at = now() WHERE idempotency_key = %s AND resolved_at IS NULL", (key,)
    )


# The statuses of a DBOS workflow that has not finished.
_RUNNING = "('PENDING', 'ENQUEUED', 'DELAYED')"


async def _workflows(conn: Conn, keys: list[str], status: str) -> set[str]:
    """The alert keys whose delivery workflow (``alert:{key}``) Relay's DBOS has (``status``: an SQL
    condition on it, ``w.status``); none if DBOS never ran on this database."""
    if not await dbos_ran(conn):
        return set()
    cur = await conn.execute(
        f"""SELECT k FROM unnest(%s::text[]) AS k
            WHERE EXISTS (SELECT 1 FROM dbos.workflow_status w WHERE w.workflow_uuid = 'alert:' || k {status})""",
        (keys,),
    )
    return {str(r["k"]) for r in await cur.fetchall()}


def interval_secs(min_interval_secs: float) -> float:
    """A rule's repeat interval as PostgreSQL can take it: rules made before it was bounded may have
    an infinity (JSON's 1e999), or more than PostgreSQL can subtract from now()."""
    return min(min_interval_secs, float(MAX_SECS))
