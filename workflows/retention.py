"""Retention of Relay's own data: a durable job, once per ``retention.intervalSecs``.

Every instance's engine starts the job for the current interval under the id
``relay-retention:{interval number}``; DBOS runs a workflow id once, so the
job runs once per interval whichever instances are up, and a crash in the
middle resumes it. It prunes Relay's records (audit, finished recoveries,
forgotten executor ids) and DBOS's own finished workflows of Relay (grace
periods, recoveries, past runs of this job) through DBOS's garbage collection.
"""

from __future__ import annotations

import asyncio
import logging
import time

from dbos import DBOS
from dbos._dbos import _get_dbos_instance
from dbos._workflow_commands import garbage_collect

from workflows.services import relay_step, services

log = logging.getLogger("relay.retention")


@relay_step("relay.retention.prune")
async def prune() -> dict[str, int]:
    svc = services()
    pruned = await svc.retention.prune(svc.retention_settings)
    return {
        "audit": pruned.audit,
        "recoveries": pruned.recoveries,
        "executorIds": pruned.executor_ids,
        "instances": pruned.instances,
        "appMetricCounts": pruned.app_metric_counts,
    }


@DBOS.step(name="relay.retention.collect_workflows")
async def collect_workflows(cutoff_epoch_ms: int) -> None:
    # DBOS deletes only finished workflows (those with a completion time) older than the cutoff.
    await asyncio.to_thread(garbage_collect, _get_dbos_instance(), cutoff_epoch_ms, None)


@DBOS.workflow(name="relay.retention", max_recovery_attempts=None)
async def retention(started_epoch_ms: int) -> dict[str, int]:
    pruned = await prune()
    days = services().retention_settings.relay_workflows_days
    await collect_workflows(started_epoch_ms - int(days * 86_400_000))
    log.info("retention: pruned %s", pruned)
    return pruned


def job_id(interval_secs: float, now: float | None = None) -> str:
    """The id of this interval's job: the same on every instance."""
    return f"relay-retention:{int((time.time() if now is None else now) // interval_secs)}"
