"""Retention of Relay's own records: what is old enough to forget (relay.yaml's ``retention:``)."""

from __future__ import annotations

from dataclasses import dataclass

from relay.config import RetentionConfig
from relay.store.db import Database


@dataclass(frozen=True)
class Pruned:
    audit: int
    recoveries: int
    executor_ids: int
    app_metric_counts: int = 0


class RetentionStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def prune(self, settings: RetentionConfig) -> Pruned:
        """Delete audit entries, finished recoveries, forgotten executor ids, the apps' retention
        rounds (with the audit log's age) and their metric counts past their age.

        A recovery still running, and the id of an executor still in the
        registry, are kept whatever their age.
        """
        async with self.db.transaction() as conn:
            cur = await conn.execute(
                "DELETE FROM audit_log WHERE at < now() - make_interval(secs => %s * 86400)", (settings.audit_days,)
            )
            audit = cur.rowcount
            finished = """SELECT id FROM recoveries WHERE status IN ('succeeded', 'failed')
                          AND updated_at < now() - make_interval(secs => %s * 86400)"""
            await conn.execute(
                f"DELETE FROM recovery_attempts WHERE recovery_id IN ({finished})", (settings.recoveries_days,)
            )
            cur = await conn.execute(f"DELETE FROM recoveries WHERE id IN ({finished})", (settings.recoveries_days,))
            recoveries = cur.rowcount
            # Alerts delivered long ago: the audit log has forgotten them too (their ids stay distinct).
            await conn.execute(
                "DELETE FROM alerts WHERE created_at < now() - make_interval(secs => %s * 86400)",
                (settings.audit_days,),
            )
            cur = await conn.execute(
                """DELETE FROM executor_ids i WHERE last_seen_at < now() - make_interval(secs => %s * 86400)
                   AND NOT EXISTS (SELECT 1 FROM executors e
                                   WHERE e.org = i.org AND e.app = i.app AND e.executor_id = i.executor_id)""",
                (settings.executor_ids_days,),
            )
            executor_ids = cur.rowcount
            await conn.execute(
                "DELETE FROM app_retention_rounds WHERE sent_at < now() - make_interval(secs => %s * 86400)",
                (settings.audit_days,),
            )
            cur = await conn.execute(
                "DELETE FROM app_metric_counts WHERE time_bucket < now() - make_interval(secs => %s * 86400)",
                (settings.app_metrics_days,),
            )
            return Pruned(audit, recoveries, executor_ids, cur.rowcount)
