"""DBOS's objects as the protocol's outputs, rendered the way the SDK renders them.

In workflows and steps, times, timeouts and priorities are decimal strings;
inputs, outputs, errors, contexts and event values are Python's ``str()`` of the
deserialized value; ``AuthenticatedRoles`` is ``str()`` of the list and
``Attributes`` is JSON.
"""

from __future__ import annotations

import json
from typing import Any

from dbos import Queue, StepInfo, VersionInfo, WorkflowSchedule, WorkflowStatus

from relay_protocol import (
    ApplicationVersionOutput,
    EventOutput,
    QueueOutput,
    ScheduleOutput,
    WorkflowsOutput,
    WorkflowSteps,
)


def _text(value: Any) -> str | None:
    """``str(value)``, or None for None: how the SDK puts values, times and numbers on the wire."""
    return None if value is None else str(value)


def workflow_output(status: WorkflowStatus) -> WorkflowsOutput:
    return WorkflowsOutput(
        workflow_id=status.workflow_id,
        status=status.status,
        workflow_name=status.name,
        workflow_class_name=status.class_name,
        workflow_config_name=status.config_name,
        authenticated_user=status.authenticated_user,
        assumed_role=status.assumed_role,
        authenticated_roles=_text(status.authenticated_roles),
        input=_text(status.input),
        output=_text(status.output),
        error=_text(status.error),
        created_at=_text(status.created_at),
        updated_at=_text(status.updated_at),
        queue_name=status.queue_name,
        application_version=status.app_version,
        executor_id=status.executor_id,
        workflow_timeout_ms=_text(status.workflow_timeout_ms),
        workflow_deadline_epoch_ms=_text(status.workflow_deadline_epoch_ms),
        deduplication_id=status.deduplication_id,
        priority=_text(status.priority),
        queue_partition_key=status.queue_partition_key,
        forked_from=status.forked_from,
        was_forked_from=bool(status.was_forked_from),
        parent_workflow_id=status.parent_workflow_id,
        dequeued_at=_text(status.dequeued_at),
        delay_until_epoch_ms=_text(status.delay_until_epoch_ms),
        completed_at=_text(status.completed_at),
        attributes=None if status.attributes is None else json.dumps(status.attributes),
        schedule_name=status.schedule_name,
        application_name=status.application_name,
    )


def step_output(step: StepInfo) -> WorkflowSteps:
    return WorkflowSteps(
        function_id=step["function_id"],
        function_name=step["function_name"],
        output=_text(step["output"]),
        error=_text(step["error"]),
        child_workflow_id=step["child_workflow_id"],
        started_at_epoch_ms=_text(step["started_at_epoch_ms"]),
        completed_at_epoch_ms=_text(step["completed_at_epoch_ms"]),
    )


def schedule_output(schedule: WorkflowSchedule, load_context: bool) -> ScheduleOutput:
    return ScheduleOutput(
        schedule_id=schedule["schedule_id"],
        schedule_name=schedule["schedule_name"],
        workflow_name=schedule["workflow_name"],
        workflow_class_name=schedule["workflow_class_name"],
        schedule=schedule["schedule"],
        status=schedule["status"],
        # The SDK renders a context only when asked to, and then even a None one ("None").
        context=str(schedule["context"]) if load_context else None,
        last_fired_at=schedule.get("last_fired_at"),
        automatic_backfill=bool(schedule.get("automatic_backfill", False)),
        cron_timezone=schedule.get("cron_timezone"),
        queue_name=schedule.get("queue_name"),
        application_name=schedule.get("application_name"),
    )


def version_output(version: VersionInfo) -> ApplicationVersionOutput:
    return ApplicationVersionOutput(
        version_id=version["version_id"],
        version_name=version["version_name"],
        version_timestamp=version["version_timestamp"],
        created_at=version["created_at"],
    )


def queue_output(queue: Queue) -> QueueOutput:
    # Each public property of a database-backed queue reads its row again: read each once.
    limiter = queue.limiter
    partition_concurrency = queue.partition_concurrency
    partition_worker_concurrency = queue.partition_worker_concurrency
    partition_limiter = queue.partition_limiter
    return QueueOutput(
        name=queue.name,
        concurrency=queue.global_concurrency,
        worker_concurrency=queue.worker_concurrency,
        rate_limit_max=limiter["limit"] if limiter else None,
        rate_limit_period_sec=float(limiter["period"]) if limiter else None,
        # Every queue is a priority queue; any per-partition limit makes it a partitioned one.
        priority_enabled=True,
        partition_queue=any(
            limit is not None for limit in (partition_concurrency, partition_worker_concurrency, partition_limiter)
        ),
        polling_interval_sec=float(queue.polling_interval_sec),
        application_name=queue.application_name,
        partition_concurrency=partition_concurrency,
        partition_worker_concurrency=partition_worker_concurrency,
        partition_rate_limit_max=partition_limiter["limit"] if partition_limiter else None,
        partition_rate_limit_period_sec=float(partition_limiter["period"]) if partition_limiter else None,
    )


def event_outputs(events: dict[str, Any]) -> list[EventOutput]:
    return [EventOutput(key=key, value=str(value)) for key, value in events.items()]
