"""Relay's schema: versioned migrations, applied forward at start-up.

They run under a session-level advisory lock, held by the migrating instance
on a connection of its own, so two instances starting at once apply each
migration exactly once: the second waits (polling for the lock, outside any
transaction), then finds it already recorded. The migrations of SQL
(:attr:`Migration.sql`) that follow one another run in one transaction, with
their versions. A migration that adds indexes to a table that may be large
(:attr:`Migration.indexes`) builds each with ``CREATE INDEX CONCURRENTLY``
instead, outside any transaction, so the writes of the instances still running
(a rolling upgrade) are not held up for the length of the build; its version is
recorded once every index is built and valid. A build cut short (the process
killed, its backend terminated) leaves an ``INVALID`` index and no version: the
next start drops that index and builds it again. A migration is never edited once
released; a change is a new one, appended. Upgrades run forward from the schema
the last release left.

**The compatibility floor.** Relay is upgraded in place, often rolling: the
instances of the previous release keep running on the schema a newer one
migrated. So a release does not refuse a database for holding migrations it does
not know; it refuses one whose *floor* it is below. The floor is the oldest
schema version a release must know (as its own newest migration) to operate on
the database; it is kept in the one-row table ``relay_schema_floor`` (migration
15). At start, after the advisory lock, :meth:`relay.store.db.Database.migrate`
looks for recorded versions it does not know; if there are some, a release whose
newest version is below the floor refuses to start
(:class:`relay.errors.StartupError`, ``relay serve`` exits 1) and writes
nothing, and one at or above it logs a warning and runs.

Each migration declares whether it breaks code that predates it
(:attr:`Migration.breaks_older`): it drops or renames what older code reads or
writes, adds a ``NOT NULL`` column without a default to a table older code
inserts into, narrows a ``CHECK`` older code writes, or changes what a stored
value means. Adding tables, nullable columns, indexes, or widening a ``CHECK``
does not. ``Database.migrate`` raises the floor to the version of each breaking
migration it applies, in the same transaction, and never lowers it.

Migration 15 records the floor 14, the schema it follows: code that knows
version 14 ignores the new table, and every release that reads the floor knows
15, so every such release may run on today's schema. The floor says nothing of
releases before it, which do not read it: 0.2.0 (versions 1 and 2) stops working
at migration 7, which is marked breaking for the record (README "Upgrading").

A future migration that breaks older code is appended with
``breaks_older=True``: the first instance of its release that starts raises the
floor to its version, and from then on no release before it starts on that
database, with an error that says to upgrade Relay. Instances of older releases
that are already running are not stopped by it: such a release cannot be rolled
out one instance at a time, and its CHANGELOG entry must say to stop every
instance of the older releases before the first instance of it starts.
"""

from __future__ import annotations

from typing import NamedTuple

# Any fixed 64-bit number; it only has to differ from other users' advisory locks.
MIGRATION_LOCK_KEY = 7_215_420_113_001


class Index(NamedTuple):
    """An index built with ``CREATE INDEX CONCURRENTLY``: its name, and what follows ``ON`` (the
    table, and the columns in parentheses)."""

    name: str
    on: str


class Migration(NamedTuple):
    version: int
    # Run in the migrations' transaction. Empty for a migration of indexes.
    sql: str
    # Whether code that predates it cannot operate on the schema it leaves: applying it raises the
    # database's compatibility floor (relay_schema_floor) to its version.
    breaks_older: bool = False
    # Built one after the other outside any transaction, after the migrations before it are
    # committed; a migration has SQL or indexes, not both, and adding an index breaks nothing.
    indexes: tuple[Index, ...] = ()


MIGRATIONS: list[Migration] = [
    Migration(
        1,
        """
        CREATE TABLE orgs (
            name        text PRIMARY KEY,
            created_at  timestamptz NOT NULL DEFAULT now()
        );
        CREATE TABLE keys (
            sha256      text PRIMARY KEY,
            org         text NOT NULL REFERENCES orgs(name),
            kind        text NOT NULL CHECK (kind IN ('conductor', 'api')),
            name        text NOT NULL,
            role        text CHECK (role IN ('admin', 'viewer')),
            updated_at  timestamptz NOT NULL DEFAULT now()
        );
        CREATE TABLE apps (
            org                         text NOT NULL REFERENCES orgs(name),
            name                        text NOT NULL,
            executor_timeout_secs       double precision NOT NULL CHECK (executor_timeout_secs > 0),
            recover_to_latest_version   boolean NOT NULL DEFAULT false,
            from_config                 boolean NOT NULL DEFAULT false,
            created_at                  timestamptz NOT NULL DEFAULT now(),
            updated_at                  timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (org, name)
        );
        CREATE TABLE executors (
            org                 text NOT NULL,
            app                 text NOT NULL,
            executor_id         text NOT NULL,
            state               text NOT NULL
                CHECK (state IN ('HEALTHY', 'DISCONNECTED', 'DEAD', 'RECOVERING')),
            epoch               bigint NOT NULL DEFAULT 1,
            application_version text NOT NULL,
            hostname            text,
            language            text,
            dbos_version        text,
            metadata            jsonb,
            connected_at        timestamptz NOT NULL,
            disconnected_at     timestamptz,
            dead_at             timestamptz,
            relay_instance      text NOT NULL,
            blocked_reason      text,
            PRIMARY KEY (org, app, executor_id),
            FOREIGN KEY (org, app) REFERENCES apps(org, name)
        );
        CREATE INDEX executors_by_state ON executors (org, app, state);
        CREATE INDEX executors_by_instance ON executors (relay_instance, state);
        CREATE TABLE audit_log (
            id                  bigserial PRIMARY KEY,
            at                  timestamptz NOT NULL DEFAULT now(),
            org                 text NOT NULL,
            app                 text,
            action              text NOT NULL,
            executor_id         text,
            peer_executor_id    text,
            actor               text NOT NULL,
            detail              jsonb NOT NULL DEFAULT '{}'::jsonb
        );
        CREATE INDEX audit_by_org ON audit_log (org, id);
        """,
    ),
    Migration(
        2,
        """
        -- A workflow step that writes an audit entry may run again after a crash;
        -- its key (workflow id, step, action) makes the second insert a no-op.
        ALTER TABLE audit_log ADD COLUMN dedupe_key text UNIQUE;
        CREATE TABLE recoveries (
            id                  text PRIMARY KEY,
            org                 text NOT NULL,
            app                 text NOT NULL,
            executor_id         text NOT NULL,
            application_version text NOT NULL,
            epoch               bigint NOT NULL,
            trigger             text NOT NULL CHECK (trigger IN ('grace_period', 'operator')),
            status              text NOT NULL CHECK (status IN ('dispatching', 'waiting_for_peer',
                                    'awaiting_operator', 'succeeded', 'failed')),
            error               text,
            created_at          timestamptz NOT NULL DEFAULT now(),
            updated_at          timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX recoveries_by_app ON recoveries (org, app, status);
        CREATE TABLE recovery_attempts (
            recovery_id         text NOT NULL REFERENCES recoveries(id),
            attempt             integer NOT NULL,
            peer_executor_id    text NOT NULL,
            mode                text NOT NULL,
            outcome             text NOT NULL CHECK (outcome IN ('dispatched', 'succeeded', 'failed')),
            error               text,
            at                  timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (recovery_id, attempt)
        );
        """,
    ),
    Migration(
        3,
        """
        -- An epoch names one connection of an executor and, through them, its grace and
        -- recovery workflows. A per-row counter would start again at 1 for an executor
        -- whose record was deleted after a recovery and that then came back (a paused
        -- process resumed), reusing ids of finished workflows; a sequence never repeats.
        -- It starts above any epoch a per-row counter can have handed out.
        CREATE SEQUENCE executor_epochs START WITH 1000000;
        ALTER TABLE executors ALTER COLUMN epoch SET DEFAULT nextval('executor_epochs');
        ALTER TABLE executors ADD COLUMN previous_epoch bigint;
        """,
    ),
    Migration(
        4,
        """
        CREATE TABLE relay_instances (
            instance_id         text PRIMARY KEY,
            lease_epoch         bigint NOT NULL,
            lease_expires_at    timestamptz NOT NULL,
            started_at          timestamptz NOT NULL,
            renewed_at          timestamptz NOT NULL
        );
        """,
    ),
    Migration(
        5,
        """
        -- Adoption: the instance that took over an expired lease. It (or whoever adopts
        -- it in turn) recovers the adopted instance's DBOS workflows.
        ALTER TABLE relay_instances ADD COLUMN adopted_by text;
        ALTER TABLE relay_instances ADD COLUMN adopted_at timestamptz;
        CREATE INDEX relay_instances_adopted_by ON relay_instances (adopted_by);
        -- Requests to an executor whose socket another instance holds, and their replies.
        CREATE TABLE relay_rpc (
            id                  bigserial PRIMARY KEY,
            target_instance     text NOT NULL,
            requester_instance  text NOT NULL,
            org                 text NOT NULL,
            app                 text NOT NULL,
            executor_id         text NOT NULL,
            request             jsonb NOT NULL,
            timeout_secs        double precision NOT NULL,
            reply               jsonb,
            error_kind          text,
            error               text,
            created_at          timestamptz NOT NULL DEFAULT now(),
            picked_at           timestamptz,
            answered_at         timestamptz
        );
        CREATE INDEX relay_rpc_unpicked ON relay_rpc (target_instance) WHERE picked_at IS NULL;
        """,
    ),
    Migration(
        6,
        """
        -- A death may need several runs of its recovery workflow: one that ended without
        -- finishing (in ERROR, cancelled, dead-lettered) is followed by a new run. Run 1 keeps
        -- the id of earlier releases (recovery:{org}:{app}:{executor}:{epoch}), run n > 1 adds
        -- ":{n}". Rows written before this migration are first runs.
        ALTER TABLE recoveries ADD COLUMN run integer NOT NULL DEFAULT 1 CHECK (run >= 1);
        CREATE UNIQUE INDEX recoveries_runs ON recoveries (org, app, executor_id, epoch, run);
        -- A run started by the repair sweep says so.
        ALTER TABLE recoveries DROP CONSTRAINT recoveries_trigger_check;
        ALTER TABLE recoveries ADD CONSTRAINT recoveries_trigger_check
            CHECK (trigger IN ('grace_period', 'operator', 'repair'));
        """,
    ),
    Migration(
        7,
        """
        -- Keys as DBOS Conductor has them (the tokens API): a permanent id that a rename
        -- keeps, Conductor's permissions and an optional list of apps. relay.yaml's keys
        -- are copied in at every start (source 'config'); the API's are source 'api'.
        CREATE TABLE tokens (
            id           text PRIMARY KEY,
            org          text NOT NULL REFERENCES orgs(name),
            name         text NOT NULL,
            sha256       text NOT NULL UNIQUE,
            permissions  text[] NOT NULL,
            apps         text[],
            source       text NOT NULL CHECK (source IN ('config', 'api', 'generated')),
            created_at   timestamptz NOT NULL DEFAULT now(),
            created_by   text
        );
        CREATE UNIQUE INDEX tokens_by_name ON tokens (org, name) WHERE source <> 'config';
        INSERT INTO tokens (id, org, name, sha256, permissions, source)
            SELECT 'config:' || org || ':' || kind || ':' || name, org, name, sha256,
                   CASE WHEN kind = 'conductor' THEN ARRAY['websocket.connect']
                        WHEN role = 'admin' THEN ARRAY['organization.read', 'organization.write',
                            'application.read', 'application.write', 'metric.read', 'token.read',
                            'token.write']
                        ELSE ARRAY['organization.read', 'application.read', 'metric.read', 'token.read']
                   END,
                   'config'
            FROM keys;
        DROP TABLE keys;
        -- Every executor id Relay has seen, bound to the key that first presented it: another
        -- key cannot take the id over. Kept after the executor's record is deleted (retention
        -- prunes ids not seen for a while).
        CREATE TABLE executor_ids (
            org           text NOT NULL,
            app           text NOT NULL,
            executor_id   text NOT NULL,
            key_id        text NOT NULL,
            first_seen_at timestamptz NOT NULL DEFAULT now(),
            last_seen_at  timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (org, app, executor_id)
        );
        CREATE INDEX executor_ids_last_seen ON executor_ids (last_seen_at);
        -- (Executors already registered are bound to the key they present at their next connection.)
        -- Replies relayed between instances are kept as JSON text: jsonb cannot hold
        -- a NUL character, which an executor may send inside a string.
        ALTER TABLE relay_rpc ALTER COLUMN request TYPE text USING request::text;
        ALTER TABLE relay_rpc ALTER COLUMN reply TYPE text USING reply::text;
        -- (Its indexes audit_by_at and recoveries_by_updated are built by migration 16.)
        """,
        # 0.2.0 reads and writes the table keys, dropped here (it predates the floor and does not
        # read it: it fails with 'relation "keys" does not exist').
        breaks_older=True,
    ),
    Migration(
        8,
        """
        -- Alert rules (README "Alerts"): relay.yaml's, copied in at every start (source 'config'),
        -- and the API's. A webhook's URL and secret are kept here only, never shown or logged.
        CREATE TABLE alert_rules (
            id                  text PRIMARY KEY,
            org                 text NOT NULL,
            app                 text NOT NULL,
            kind                text NOT NULL,
            params              jsonb NOT NULL DEFAULT '{}'::jsonb,
            min_interval_secs   double precision NOT NULL CHECK (min_interval_secs >= 0),
            webhook_url         text,
            secret              text,
            format              text NOT NULL DEFAULT 'json' CHECK (format IN ('json', 'slack')),
            receiver_app        text,
            source              text NOT NULL CHECK (source IN ('config', 'api')),
            created_at          timestamptz NOT NULL DEFAULT now(),
            created_by          text,
            last_fired_at       timestamptz,
            CHECK ((webhook_url IS NULL) <> (receiver_app IS NULL)),
            FOREIGN KEY (org, app) REFERENCES apps(org, name) ON DELETE CASCADE
        );
        CREATE INDEX alert_rules_by_app ON alert_rules (org, app);
        -- Every alert Relay set out to deliver, by its idempotency key (rule, subject, epoch): the
        -- repeat interval reads it, and the delivery workflow records its outcome in it.
        CREATE TABLE alerts (
            idempotency_key     text PRIMARY KEY,
            rule_id             text NOT NULL,
            org                 text NOT NULL,
            app                 text NOT NULL,
            kind                text NOT NULL,
            subject             text NOT NULL,
            status              text NOT NULL CHECK (status IN ('sending', 'sent', 'failed', 'suppressed')),
            attempts            integer NOT NULL DEFAULT 0,
            error               text,
            created_at          timestamptz NOT NULL DEFAULT now(),
            updated_at          timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX alerts_by_subject ON alerts (rule_id, subject, created_at);
        CREATE INDEX alerts_by_created ON alerts (created_at);
        -- Conditions that hold (a queue held up, no healthy executor...), since when: one episode each.
        CREATE SEQUENCE alert_episodes;
        CREATE TABLE alert_conditions (
            rule_id     text NOT NULL REFERENCES alert_rules(id) ON DELETE CASCADE,
            subject     text NOT NULL,
            episode     bigint NOT NULL DEFAULT nextval('alert_episodes'),
            since       timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (rule_id, subject)
        );
        -- How far the audit log has been read for event rules (one row; every instance reads on).
        CREATE TABLE alert_cursor (
            id          integer PRIMARY KEY CHECK (id = 1),
            last_id     bigint NOT NULL
        );
        INSERT INTO alert_cursor (id, last_id) SELECT 1, coalesce(max(id), 0) FROM audit_log;
        """,
    ),
    Migration(
        9,
        """
        -- The console's live updates (GET /v2/orgs/{org}/events) tail the audit log by id and
        -- the executors table by this number: every insert or update of a row takes the next one.
        CREATE SEQUENCE executor_changes;
        ALTER TABLE executors ADD COLUMN change_seq bigint NOT NULL DEFAULT nextval('executor_changes');
        CREATE FUNCTION relay_executor_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            NEW.change_seq := nextval('executor_changes');
            RETURN NEW;
        END $$;
        CREATE TRIGGER executors_changed BEFORE UPDATE ON executors
            FOR EACH ROW EXECUTE FUNCTION relay_executor_changed();
        CREATE INDEX executors_by_change ON executors (change_seq);
        -- (Its index audit_by_executor is built by migration 16.)
        """,
    ),
    Migration(
        10,
        """
        -- Retention of the applications' data, as DBOS Conductor's app settings (null: off).
        ALTER TABLE apps ADD COLUMN gc_time_threshold_ms bigint CHECK (gc_time_threshold_ms > 0);
        ALTER TABLE apps ADD COLUMN gc_rows_threshold bigint CHECK (gc_rows_threshold > 0);
        ALTER TABLE apps ADD COLUMN global_timeout_ms bigint CHECK (global_timeout_ms > 0);
        -- One row per retention round of an app: what was sent, to whom, and what the next
        -- round found left of it (the SDK runs a round in the background and answers at once).
        CREATE TABLE app_retention_rounds (
            id                       text PRIMARY KEY,
            org                      text NOT NULL,
            app                      text NOT NULL,
            executor_id              text,
            status                   text NOT NULL CHECK (status IN ('dispatched', 'skipped')),
            error                    text,
            gc_cutoff_epoch_ms       bigint,
            gc_rows_threshold        bigint,
            gc_batch_size            bigint,
            timeout_cutoff_epoch_ms  bigint,
            sent_at                  timestamptz NOT NULL DEFAULT now(),
            checked_at               timestamptz,
            remaining                jsonb
        );
        CREATE INDEX app_retention_rounds_by_app ON app_retention_rounds (org, app, sent_at);
        -- The moments of a recovery attempt that the recovery pipeline's histograms measure.
        -- (The column "at" is the moment of the latest outcome.) Rows of earlier releases have none.
        ALTER TABLE recovery_attempts ADD COLUMN dispatched_at timestamptz;
        ALTER TABLE recovery_attempts ALTER COLUMN dispatched_at SET DEFAULT now();
        ALTER TABLE recovery_attempts ADD COLUMN replied_at timestamptz;
        ALTER TABLE recovery_attempts ADD COLUMN verified_at timestamptz;
        -- The apps' workflow figures (dbos_conductor_v1_*), computed once per window by one
        -- instance and served by every instance: the latest window of each app...
        CREATE TABLE app_figures (
            org            text NOT NULL,
            app            text NOT NULL,
            window_start   timestamptz NOT NULL,
            window_secs    double precision NOT NULL,
            computed_at    timestamptz NOT NULL DEFAULT now(),
            series         jsonb NOT NULL,
            PRIMARY KEY (org, app)
        );
        -- ... and the counts per window that GET .../metrics serves (Conductor's Metric).
        CREATE TABLE app_metric_counts (
            org            text NOT NULL,
            app            text NOT NULL,
            time_bucket    timestamptz NOT NULL,
            granularity    integer NOT NULL,
            metric_type    text NOT NULL,
            metric_name    text NOT NULL,
            value          bigint NOT NULL,
            PRIMARY KEY (org, app, time_bucket, metric_type, metric_name)
        );
        CREATE INDEX app_metric_counts_by_bucket ON app_metric_counts (time_bucket);
        """,
    ),
    Migration(
        11,
        """
        -- A recovery started by the stranded-workflow reconciler says so.
        ALTER TABLE recoveries DROP CONSTRAINT recoveries_trigger_check;
        ALTER TABLE recoveries ADD CONSTRAINT recoveries_trigger_check
            CHECK (trigger IN ('grace_period', 'operator', 'repair', 'reconcile'));
        """,
    ),
    Migration(
        12,
        """
        -- Each evaluation of an alert rule draws a number before it reads; the rule remembers the
        -- newest reading it settled, and an older one that comes back later changes nothing.
        CREATE SEQUENCE alert_readings;
        ALTER TABLE alert_rules ADD COLUMN settled_reading bigint;
        """,
    ),
    Migration(
        13,
        """
        -- A lease its instance gave up as it stopped cleanly (a rolling restart, a scale-in): its
        -- adoption is expected, not an instance lost, and fires no InstanceAdopted alert.
        ALTER TABLE relay_instances ADD COLUMN released_at timestamptz;
        """,
    ),
    Migration(
        14,
        """
        -- The delivery workflow that claimed an alert's key: its claim step run again after a crash
        -- sends only for that workflow (a first delivery resumed after its late one claimed sends
        -- nothing). NULL for keys claimed by an earlier release.
        ALTER TABLE alerts ADD COLUMN claimed_by text;
        """,
    ),
    Migration(
        15,
        """
        -- The compatibility floor: the oldest schema version a release must know to operate on this
        -- database (the module's docstring). One row. 14: every release that reads it may run here.
        CREATE TABLE relay_schema_floor (
            id          integer PRIMARY KEY CHECK (id = 1),
            version     integer NOT NULL
        );
        INSERT INTO relay_schema_floor (id, version) VALUES (1, 14);
        """,
    ),
    Migration(
        16,
        "",
        indexes=(
            # First written in migrations 7 and 9, unreleased, which built them in the transaction:
            # upgrading from 0.2.0 held its running instances' writes (ALTER TABLE executors locks
            # the table until the commit) for as long as the audit log took to index, twice. A
            # database migrated by those builds has them already; each is built only if missing.
            # Retention by age (relay.store.retention) reads the log and the recoveries by time.
            Index("audit_by_at", "audit_log (at)"),
            Index("recoveries_by_updated", "recoveries (updated_at)"),
            # A recovery's timeline, and the audit log of one executor, without reading the org's
            # whole log.
            Index("audit_by_executor", "audit_log (org, app, executor_id, id)"),
            # The recoveries listing's order: a page is read along it, not sorted out of every run
            # of the app (relay.store.recoveries.recovery_page).
            Index("recoveries_by_created", "recoveries (org, app, created_at, run, id)"),
            # The audit log by action (the console's Action filter, GET /audit?action=): an action
            # rare in a log of recoveries is found among its own entries, not the whole log.
            Index("audit_by_action", "audit_log (org, action, id)"),
        ),
    ),
    Migration(
        17,
        "",
        indexes=(
            # The audit log of one executor without its app (GET /audit?executor=, the CLI's
            # --executor): audit_by_executor leads with the app and serves only a filter that names it.
            Index("audit_by_executor_id", "audit_log (org, executor_id, id)"),
        ),
    ),
    Migration(
        18,
        """
        -- Where a removed alert rule (deleted through the API, taken out of relay.yaml, or gone with its
        -- app) sent its alerts: the resolutions of the alerts it left open go there (README "Alerts").
        -- Kept as Relay's own workflows are (retention.relayWorkflowsDays).
        CREATE TABLE alert_rules_removed (
            id                  text PRIMARY KEY,
            org                 text NOT NULL,
            app                 text NOT NULL,
            kind                text NOT NULL,
            params              jsonb NOT NULL DEFAULT '{}'::jsonb,
            min_interval_secs   double precision NOT NULL,
            webhook_url         text,
            secret              text,
            format              text NOT NULL,
            receiver_app        text,
            source              text NOT NULL,
            created_at          timestamptz NOT NULL,
            created_by          text,
            last_fired_at       timestamptz,
            removed_at          timestamptz NOT NULL DEFAULT now(),
            removed_why         text NOT NULL
        );
        """,
    ),
    Migration(
        19,
        """
        -- An id is last seen when its record is deleted (relay.store.executors), not only when it
        -- connects. The ids whose records earlier releases deleted kept their last connection's
        -- time, which retention took for their last sighting: an executor connected for longer
        -- than executorIdsDays was forgotten as soon as its record went. Each is seen last at its
        -- latest audit entry (its deletion, as a rule), read along audit_by_executor.
        UPDATE executor_ids i SET last_seen_at = latest.at
        FROM executor_ids x
        CROSS JOIN LATERAL (SELECT a.at FROM audit_log a
                            WHERE a.org = x.org AND a.app = x.app AND a.executor_id = x.executor_id
                            ORDER BY a.id DESC LIMIT 1) latest
        WHERE i.org = x.org AND i.app = x.app AND i.executor_id = x.executor_id
          AND latest.at > i.last_seen_at
          AND NOT EXISTS (SELECT 1 FROM executors e
                          WHERE e.org = x.org AND e.app = x.app AND e.executor_id = x.executor_id);
        """,
    ),
    Migration(
        20,
        """
        -- When an alert's resolution was made (its ``alert.resolved`` written): the alert's row is
        -- what outlives Relay's workflow of that resolution (relayWorkflowsDays) and the entry
        -- (auditDays) while its death goes on, and a death's end, or its rule's removal again,
        -- resolved a second time an alert its rule's removal had resolved. The alerts resolved
        -- before are those whose entry is still in the audit log, looked up by its unique key, one
        -- alert at a time: joined, PostgreSQL hashed the whole audit log while alerts stayed locked.
        ALTER TABLE alerts ADD COLUMN resolved_at timestamptz;
        WITH resolved AS MATERIALIZED (
            SELECT idempotency_key, (SELECT l.at FROM audit_log l
                                     WHERE l.dedupe_key = 'alert.resolved:' || a.idempotency_key) AS at
            FROM alerts a)
        UPDATE alerts a SET resolved_at = r.at FROM resolved r
        WHERE r.at IS NOT NULL AND a.idempotency_key = r.idempotency_key;
        """,
    ),
    Migration(
        21,
        "",
        indexes=(
            # The recoveries listing's executorDeleted (relay.store.recoveries): whether a run deleted
            # its executor's record is its executor.deleted entry, found by the run's id. Along
            # audit_by_executor, each run read every entry of its executor id: an id that comes back
            # (a pod's name) and dies again leaves hundreds, and the console's count of the last
            # hour's recoveries read them for each run. One entry per run here.
            Index(
                "audit_deleted_by_recovery",
                "audit_log ((detail->>'recoveryId'), org, app, executor_id) WHERE action = 'executor.deleted'",
            ),
        ),
    ),
    Migration(
        22,
        """
        -- The address an entry's API request came from (Conductor's sourceIp). Null for the entries
        -- Relay and executors' connections make, and for those written before: earlier releases
        -- still running leave it out, and the listings answer "" for it. A nullable column without
        -- a default: PostgreSQL adds it without rewriting the audit log.
        ALTER TABLE audit_log ADD COLUMN source_ip text;
        """,
    ),
    Migration(
        23,
        """
        -- The id of the HTTP request a relayed request serves (its X-Request-Id), so that the lines
        -- the instance holding the socket logs about it carry the id too. Null for requests of no
        -- HTTP request (a recovery's) and for those of earlier releases, which leave it out and
        -- ignore it: a nullable column without a default.
        ALTER TABLE relay_rpc ADD COLUMN request_id text;
        """,
    ),
    Migration(
        24,
        """
        -- When a WorkflowFailure rule's failures were last counted, by the evaluation that settled
        -- (relay.store.alerts.AlertStore.settle): the next count, on whichever instance, reaches back
        -- to it. Kept in one instance's memory, a count by another instance, or after a restart,
        -- reached back one check interval only, and failures in between were counted by neither.
        -- Null for the rules of earlier releases, which leave it out: one check interval back, as
        -- before. A nullable column without a default.
        ALTER TABLE alert_rules ADD COLUMN counted_at timestamptz;
        """,
    ),
    Migration(
        25,
        """
        -- The dead executor's language (its handshake's), kept for each recovery run as it opens: the
        -- executor's record, which had it, is deleted by the run that succeeds (or replaced as the
        -- executor reconnects), and a run listed afterwards could no longer say which language it
        -- waited for or recovered. A table of its own, not a column of recoveries: the release before
        -- reads its runs with SELECT * into a row type that takes no other column, and an instance of
        -- it in a rolling upgrade would fail every listing of recoveries. It deletes runs (retention)
        -- without knowing of this table: their languages go with them. None for the runs of earlier
        -- releases: the listing falls back on the executor's record while it is there.
        CREATE TABLE recovery_languages (
            recovery_id text PRIMARY KEY REFERENCES recoveries(id) ON DELETE CASCADE,
            language    text NOT NULL
        );
        """,
    ),
]
