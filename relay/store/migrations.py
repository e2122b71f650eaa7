"""Relay's schema: versioned migrations, applied forward at start-up.

They run inside one transaction that first takes a transaction-level advisory
lock, so two instances starting at once apply each migration exactly once: the
second waits, then finds it already recorded. A migration is never edited once
released; a change is a new one.
"""

from __future__ import annotations

# Any fixed 64-bit number; it only has to differ from other users' advisory locks.
MIGRATION_LOCK_KEY = 7_215_420_113_001

MIGRATIONS: list[tuple[int, str]] = [
    (
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
    (
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
    (
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
    (
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
    (
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
    (
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
    (
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
        CREATE INDEX audit_by_at ON audit_log (at);
        CREATE INDEX recoveries_by_updated ON recoveries (updated_at);
        """,
    ),
    (
        8,
        """
        -- A recovery started by the stranded-workflow reconciler says so.
        ALTER TABLE recoveries DROP CONSTRAINT recoveries_trigger_check;
        ALTER TABLE recoveries ADD CONSTRAINT recoveries_trigger_check
            CHECK (trigger IN ('grace_period', 'operator', 'repair', 'reconcile'));
        """,
    ),
]
