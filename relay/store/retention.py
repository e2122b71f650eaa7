"""Retention of Relay's own records: what is old enough to forget (relay.yaml's ``retention:``)."""

from __future__ import annotations

from dataclasses import dataclass

from relay.config import MAX_SECS, RetentionConfig
from relay.core.alerts import DEATH_END_ACTIONS, DEATH_KINDS
from relay.store.db import Database
from relay.store.instances import dbos_ran, still_to_take_over


@dataclass(frozen=True)
class Pruned:
    audit: int
    recoveries: int
    executor_ids: int
    app_metric_counts: int = 0
    instances: int = 0


class RetentionStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def prune(self, settings: RetentionConfig) -> Pruned:
        """Delete audit entries, finished recoveries, forgotten executor ids, instances adopted long
        ago (with the executor ids' age), the apps' retention rounds (with the audit log's age) and
        their metric counts past their age.

        A recovery still running, the id of an executor still in the registry, an instance that
        still has something (below), and an alert whose key may still be found due (:meth:`prune`'s
        comment) are kept whatever their age.
        """
        async with self.db.transaction() as conn:
            # The rows the statement below marks, locked first, in the order of their keys, as a rule's
            # removal locks the alerts it resolves (AlertStore.removing) before it writes their entries.
            # Locked as the statement came to them, the round could hold one while the removal, holding
            # another the round went on to, waited for the round's deletion of that one's entry (its
            # dedupe key): PostgreSQL failed one of them. Locked first, the removal waits for the round
            # and finds the rows marked.
            await conn.execute(
                """SELECT 1 FROM audit_log l JOIN alerts a
                     ON a.idempotency_key = substr(l.dedupe_key, length('alert.resolved:') + 1)
                   WHERE l.at < now() - make_interval(secs => %s * 86400) AND l.action = 'alert.resolved'
                     AND starts_with(l.dedupe_key, 'alert.resolved:') AND a.resolved_at IS NULL
                   ORDER BY a.idempotency_key FOR UPDATE OF a""",
                (settings.audit_days,),
            )
            # An alert whose ``alert.resolved`` goes now, and whose row does not say it was resolved:
            # an instance of the release before migration 20 resolved it (its rule removed, in a
            # rolling upgrade) and wrote the entry alone. The row keeps the fact, as this release
            # writes it (relay.store.alerts): else its death's end, or its rule's removal again,
            # resolved it a second time once the entry was gone. Read from the entries deleted.
            cur = await conn.execute(
                """WITH gone AS (DELETE FROM audit_log WHERE at < now() - make_interval(secs => %s * 86400)
                                 RETURNING at, action, dedupe_key),
                        marked AS (UPDATE alerts a SET resolved_at = g.at FROM gone g
                                   WHERE g.action = 'alert.resolved' AND starts_with(g.dedupe_key, 'alert.resolved:')
                                     AND a.idempotency_key = substr(g.dedupe_key, length('alert.resolved:') + 1)
                                     AND a.resolved_at IS NULL)
                   SELECT count(*) AS n FROM gone""",
                (settings.audit_days,),
            )
            row = await cur.fetchone()
            audit = int(row["n"]) if row else 0
            finished = """SELECT id FROM recoveries WHERE status IN ('succeeded', 'failed')
                          AND updated_at < now() - make_interval(secs => %s * 86400)"""
            await conn.execute(
                f"DELETE FROM recovery_attempts WHERE recovery_id IN ({finished})", (settings.recoveries_days,)
            )
            cur = await conn.execute(f"DELETE FROM recoveries WHERE id IN ({finished})", (settings.recoveries_days,))
            recoveries = cur.rowcount
            # Alerts claimed long ago: the audit log has forgotten them too (their ids stay distinct). A
            # row is what keeps its idempotency key from being delivered again (Relay's own workflows,
            # which also carry the key, are gone after relayWorkflowsDays), so it is kept, whatever its
            # age, while anything may still find that key due: its condition still holds (an episode
            # longer than auditDays, or one held back by minIntervalSecs and waiting to go out late),
            # its delivery is still under way, or the rule's repeat interval still counts from it.
            # A delivery is under way while its workflow (the claimant it recorded, or the ids a row
            # of an earlier release may have: ``alert:{key}`` and ``alert:{key}:late``) is PENDING,
            # ENQUEUED or DELAYED in Relay's own system database; one that never finished (DBOS
            # dead-lettered it, or it is gone) leaves its row ``sending`` for good. A death's alert
            # (ExecutorDead, RecoveryFailed: its key's epoch is the death's) is kept while the death goes
            # on, the executor DEAD or RECOVERING at that epoch: its resolution, when the death ends, is
            # sent only for an alert whose row says it was. And a row is kept while the entry that ends
            # it is in the audit log (auditDays): its ``alert.resolved``, or an entry that may end its
            # death. Its resolution, started when the audit poll reads that entry, is sent once the row
            # says the alert was; a job that ran between the end and the poll left nothing to say so.
            deaths = sorted(k.value for k in DEATH_KINDS)
            running = "false"
            if await dbos_ran(conn):
                running = """EXISTS (SELECT 1 FROM dbos.workflow_status w
                                     WHERE w.workflow_uuid IN (a.claimed_by, 'alert:' || a.idempotency_key,
                                                               'alert:' || a.idempotency_key || ':late')
                                       AND w.status IN ('PENDING', 'ENQUEUED', 'DELAYED'))"""
            await conn.execute(
                f"""DELETE FROM alerts a WHERE a.created_at < now() - make_interval(secs => %s * 86400)
                    AND NOT (a.status = 'sending' AND {running})
                    AND NOT EXISTS (SELECT 1 FROM alert_conditions c
                                    WHERE c.rule_id = a.rule_id AND c.subject = a.subject)
                    AND NOT (a.kind = ANY(%s) AND EXISTS (
                        SELECT 1 FROM executors e
                        WHERE e.org = a.org AND e.app = a.app AND e.executor_id = a.subject
                          AND e.state IN ('DEAD', 'RECOVERING')
                          AND a.idempotency_key = a.rule_id || ':' || a.subject || ':' || e.epoch))
                    AND NOT EXISTS (SELECT 1 FROM audit_log l
                                    WHERE l.dedupe_key = 'alert.resolved:' || a.idempotency_key)
                    AND NOT (a.kind = ANY(%s) AND EXISTS (
                        SELECT 1 FROM audit_log l
                        WHERE l.org = a.org AND l.app = a.app AND l.executor_id = a.subject
                          AND l.action = ANY(%s) AND l.at >= a.created_at))
                    AND NOT EXISTS (
                        SELECT 1 FROM alert_rules r WHERE r.id = a.rule_id
                        AND a.created_at > now() - make_interval(secs => least(r.min_interval_secs, %s)))""",
                (settings.audit_days, deaths, deaths, sorted(DEATH_END_ACTIONS), MAX_SECS),
            )
            # Where removed rules sent their alerts, for those alerts' resolutions: kept as long as
            # Relay's own workflows (those deliveries) are. A row another transaction holds is left
            # for the next round: the holder is a rule's removal (AlertStore.removing), which upserts
            # the row by id as the rule is removed again and leaves it recent (or, rolled back, as
            # old as it was, for the next round). Deleted in the table's order, as this was, the
            # round could take one of two rules removed again and wait for the other while the
            # removal, holding that one, waited for the first: PostgreSQL failed one of them (an
            # app's deletion answered 503, or an instance failed to start).
            old = "removed_at < now() - make_interval(secs => %(days)s * 86400)"
            await conn.execute(
                f"""DELETE FROM alert_rules_removed WHERE {old} AND id IN (
                        SELECT id FROM alert_rules_removed WHERE {old} ORDER BY id FOR UPDATE SKIP LOCKED)""",
                {"days": settings.relay_workflows_days},
            )
            # An id is seen last when its record is deleted: this code marks it so (relay.store.executors),
            # migration 19 marked the ids deleted before it ran, and the deletion's audit entry says it
            # for a record an instance of an earlier release deleted after that (a rolling upgrade: the
            # floor lets schema 17's code run on 19, and it deletes records as it always did). An id
            # another transaction holds is left for the next round, as above: a batch of handshakes
            # (relay.store.executors) upserts its ids in the batch's order and sees them now; deleted
            # in the table's order, two ids coming back at once could deadlock with it.
            cur = await conn.execute(
                """DELETE FROM executor_ids d WHERE (d.org, d.app, d.executor_id) IN (
                       SELECT i.org, i.app, i.executor_id FROM executor_ids i
                       WHERE i.last_seen_at < now() - make_interval(secs => %(days)s * 86400)
                         AND NOT EXISTS (SELECT 1 FROM executors e
                                         WHERE e.org = i.org AND e.app = i.app AND e.executor_id = i.executor_id)
                         AND NOT EXISTS (SELECT 1 FROM audit_log a
                                         WHERE a.org = i.org AND a.app = i.app AND a.executor_id = i.executor_id
                                           AND a.action = 'executor.deleted'
                                           AND a.at >= now() - make_interval(secs => %(days)s * 86400))
                       FOR UPDATE OF i SKIP LOCKED)""",
                {"days": settings.executor_ids_days},
            )
            executor_ids = cur.rowcount
            # Instances adopted long ago. Every start under a new RELAY_INSTANCE_ID (the default,
            # hostname:port, changes at every start of a container) adds a row, and its adoption
            # only marks it. Kept while it holds anything: a lease (a start under its id clears
            # adopted_by), an executor, a workflow its adopter has not taken over yet (a takeover cut
            # short), or an instance it adopted that still has one.
            pending = await still_to_take_over(conn)
            cur = await conn.execute(
                f"""WITH to_take_over AS MATERIALIZED ({pending}),
                         -- those, and the instances that adopted one of them: each set read once, and
                         -- anti-joined by hash (a condition per row read the PENDING workflows per row)
                         kept AS (SELECT executor_id AS instance_id FROM to_take_over
                                  UNION ALL
                                  SELECT o.adopted_by FROM relay_instances o
                                  JOIN to_take_over t ON t.executor_id = o.instance_id)
                    DELETE FROM relay_instances i
                    WHERE i.adopted_by IS NOT NULL AND i.adopted_at < now() - make_interval(secs => %s * 86400)
                      AND i.lease_expires_at < now()
                      AND NOT EXISTS (SELECT 1 FROM executors e WHERE e.relay_instance = i.instance_id)
                      AND NOT EXISTS (SELECT 1 FROM kept k WHERE k.instance_id = i.instance_id)""",
                (settings.executor_ids_days,),
            )
            instances = cur.rowcount
            await conn.execute(
                "DELETE FROM app_retention_rounds WHERE sent_at < now() - make_interval(secs => %s * 86400)",
                (settings.audit_days,),
            )
            cur = await conn.execute(
                "DELETE FROM app_metric_counts WHERE time_bucket < now() - make_interval(secs => %s * 86400)",
                (settings.app_metrics_days,),
            )
            return Pruned(audit, recoveries, executor_ids, cur.rowcount, instances)
