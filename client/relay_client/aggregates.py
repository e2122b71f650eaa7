"""Workflow and step aggregates and run counts, computed here from DBOS's public listings.

dbos 3.2 answered these with one GROUP BY over its system tables; 3.3 and later
have no such call. The same numbers come from ``DBOS.list_workflows`` (metadata
only, in pages) and, for steps, ``DBOS.list_workflow_steps`` of each workflow
that can hold a step in the range. Both are bounded: past :data:`MAX_WORKFLOWS`
workflows (or :data:`MAX_STEP_WORKFLOWS` for steps) the request fails with an
error asking for a narrower filter, rather than load the database without end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dbos import DBOS, StepInfo, WorkflowStatus

from relay_client import _internals
from relay_client.times import epoch_ms, iso_ms
from relay_protocol import (
    GetStepAggregatesBody,
    GetWorkflowAggregatesBody,
    MetricData,
    StepAggregateOutput,
    WorkflowAggregateOutput,
)

PAGE = 1000
#: Workflows one aggregate request may read.
MAX_WORKFLOWS = 100_000
#: Workflows whose steps one step aggregate or metrics request may read (a query each).
MAX_STEP_WORKFLOWS = 5_000


class TooManyRows(ValueError):
    """The request would read more than its bound."""


def _workflows(limit: int, **filters: Any) -> Iterator[WorkflowStatus]:
    """Every workflow matching ``filters`` (metadata only), oldest first, paged."""
    seen = 0
    while True:
        page = DBOS.list_workflows(**filters, limit=PAGE, offset=seen, load_input=False, load_output=False)
        seen += len(page)
        if seen > limit:
            raise TooManyRows(f"more than {limit} workflows match: narrow the filter (a time range, say)")
        yield from page
        if len(page) < PAGE:
            return


def _group_value(value: object) -> str | None:
    return None if value is None else str(value)


def _bucket(at: int | None, size: int | None) -> list[str | None]:
    if size is None:
        return []
    return [None if at is None else str(at // size * size)]


def _check_grouping(groups: list[bool], bucket: int | None) -> None:
    if bucket is not None and bucket <= 0:
        raise ValueError("time_bucket_size_ms must be > 0")
    if not any(groups) and bucket is None:
        raise ValueError("At least one group_by flag must be set to True")


def _max(current: int | None, value: int | None) -> int | None:
    if value is None:
        return current
    return value if current is None else max(current, value)


@dataclass
class _WorkflowGroup:
    count: int = 0
    min_created_at: int | None = None
    max_queue_wait_ms: int | None = None
    max_total_latency_ms: int | None = None

    def add(self, w: WorkflowStatus) -> None:
        self.count += 1
        if w.created_at is not None:
            self.min_created_at = (
                w.created_at if self.min_created_at is None else min(self.min_created_at, w.created_at)
            )
            if w.dequeued_at is not None:
                self.max_queue_wait_ms = _max(self.max_queue_wait_ms, w.dequeued_at - w.created_at)
            if w.completed_at is not None:
                self.max_total_latency_ms = _max(self.max_total_latency_ms, w.completed_at - w.created_at)


_WORKFLOW_COLUMNS: list[tuple[str, Callable[[WorkflowStatus], object]]] = [
    ("status", lambda w: w.status),
    ("name", lambda w: w.name),
    ("queue_name", lambda w: w.queue_name),
    ("executor_id", lambda w: w.executor_id),
    ("application_version", lambda w: w.app_version),
    ("application_name", lambda w: w.application_name),
]


def workflow_aggregates(body: GetWorkflowAggregatesBody) -> list[WorkflowAggregateOutput]:
    flags = [
        body.group_by_status,
        body.group_by_name,
        body.group_by_queue_name,
        body.group_by_executor_id,
        body.group_by_application_version,
        body.group_by_application_name,
    ]
    _check_grouping(flags, body.time_bucket_size_ms)
    columns = [column for column, on in zip(_WORKFLOW_COLUMNS, flags, strict=True) if on]
    names = [name for name, _ in columns] + (["time_bucket"] if body.time_bucket_size_ms is not None else [])
    groups: dict[tuple[str | None, ...], _WorkflowGroup] = {}
    for w in _workflows(MAX_WORKFLOWS, **_workflow_filters(body)):
        key = tuple(_group_value(get(w)) for _, get in columns) + tuple(_bucket(w.created_at, body.time_bucket_size_ms))
        groups.setdefault(key, _WorkflowGroup()).add(w)
    # With nothing selected the SDK counts.
    count = body.select_count or not (
        body.select_min_created_at or body.select_max_queue_wait_ms or body.select_max_total_latency_ms
    )
    return [
        WorkflowAggregateOutput(
            group=dict(zip(names, key, strict=True)),
            count=group.count if count else None,
            min_created_at=group.min_created_at if body.select_min_created_at else None,
            max_queue_wait_ms=group.max_queue_wait_ms if body.select_max_queue_wait_ms else None,
            max_total_latency_ms=group.max_total_latency_ms if body.select_max_total_latency_ms else None,
        )
        for key, group in groups.items()
    ]


def _workflow_filters(body: GetWorkflowAggregatesBody) -> dict[str, Any]:
    application_name = body.application_name
    if application_name is None and body.workflow_ids:
        # An id-keyed listing is not scoped to this app by default; the SDK's aggregates always were.
        application_name = [_internals.app_name()]
    return {
        "status": body.status,
        "start_time": body.start_time,
        "end_time": body.end_time,
        "completed_after": body.completed_after,
        "completed_before": body.completed_before,
        "dequeued_after": body.dequeued_after,
        "dequeued_before": body.dequeued_before,
        "name": body.name,
        "app_version": body.app_version,
        "executor_id": body.executor_id,
        "queue_name": body.queue_name,
        "workflow_id_prefix": body.workflow_id_prefix,
        "workflow_ids": body.workflow_ids,
        "forked_from": body.forked_from,
        "parent_workflow_id": body.parent_workflow_id,
        "user": body.user,
        "schedule_name": body.schedule_name,
        "application_name": application_name,
        "was_forked_from": body.was_forked_from,
        "has_parent": body.has_parent,
        "attributes": body.attributes,
    }


def _steps(
    *,
    completed_after: int | None,
    completed_before: int | None,
    workflow_id_prefix: list[str] | None,
    application_name: list[str] | None,
    load_output: bool = False,
) -> Iterator[StepInfo]:
    """Every step that completed in the range (bounds inclusive), of workflows that can hold one.

    A step completes after its workflow starts and before it finishes, so a
    workflow created after the range or finished before it holds none.
    """
    common: dict[str, Any] = {"workflow_id_prefix": workflow_id_prefix, "application_name": application_name}
    if completed_before is not None:
        common["end_time"] = iso_ms(completed_before)
    if completed_after is None:
        candidates = _workflows(MAX_STEP_WORKFLOWS, **common)
    else:
        candidates = iter(_window_candidates(completed_after, common))
    for w in candidates:
        for step in DBOS.list_workflow_steps(w.workflow_id, load_output=load_output):
            at = step["completed_at_epoch_ms"]
            if completed_after is not None and (at is None or at < completed_after):
                continue
            if completed_before is not None and (at is None or at > completed_before):
                continue
            yield step


def _window_candidates(completed_after: int, common: dict[str, Any]) -> list[WorkflowStatus]:
    """The workflows that can hold a step completed at or after ``completed_after``: those finished
    since, those running (PENDING), and those waiting (ENQUEUED, DELAYED) that changed since. A
    waiting workflow runs no step; one that waits since before the range (a queue backlog, one
    re-enqueued by a recovery) completed its steps, if any, before it did. Those are left out before
    the bound is applied: a backlog of any size leaves a window's figures answerable. In-flight first:
    a workflow that finishes between the listings is then in the second."""
    running = list(_workflows(MAX_STEP_WORKFLOWS, **common, status=["PENDING"]))
    waiting = [
        w
        for w in _workflows(MAX_WORKFLOWS, **common, status=["ENQUEUED", "DELAYED"])
        # SQLite keeps these times to the second (Python before 3.12): a second of slack.
        if w.updated_at is None or w.updated_at + 1000 > completed_after
    ]
    finished = list(_workflows(MAX_STEP_WORKFLOWS, **common, completed_after=iso_ms(completed_after)))
    candidates = list({w.workflow_id: w for w in running + waiting + finished}.values())
    if len(candidates) > MAX_STEP_WORKFLOWS:
        raise TooManyRows(f"more than {MAX_STEP_WORKFLOWS} workflows match: narrow the filter (a time range, say)")
    return candidates


def step_aggregates(body: GetStepAggregatesBody) -> list[StepAggregateOutput]:
    _check_grouping([body.group_by_function_name, body.group_by_status], body.time_bucket_size_ms)
    names = [
        name
        for name, on in (
            ("function_name", body.group_by_function_name),
            ("status", body.group_by_status),
            ("time_bucket", body.time_bucket_size_ms is not None),
        )
        if on
    ]
    counts: dict[tuple[str | None, ...], list[int | None]] = {}
    steps = _steps(
        completed_after=None if body.completed_after is None else epoch_ms(body.completed_after),
        completed_before=None if body.completed_before is None else epoch_ms(body.completed_before),
        workflow_id_prefix=body.workflow_id_prefix,
        application_name=body.application_name,
        # A step's error is read with its output: needed only to tell its status.
        load_output=body.group_by_status or bool(body.status),
    )
    for step in steps:
        # Steps have no status of their own: an error makes one ERROR.
        status = "SUCCESS" if step["error"] is None else "ERROR"
        if body.status and status not in body.status:
            continue
        if body.function_name and step["function_name"] not in body.function_name:
            continue
        key: tuple[str | None, ...] = (
            *([step["function_name"]] if body.group_by_function_name else []),
            *([status] if body.group_by_status else []),
            *_bucket(step["completed_at_epoch_ms"], body.time_bucket_size_ms),
        )
        started, completed = step["started_at_epoch_ms"], step["completed_at_epoch_ms"]
        duration = completed - started if started is not None and completed is not None else None
        entry = counts.setdefault(key, [0, None])
        entry[0] = (entry[0] or 0) + 1
        entry[1] = _max(entry[1], duration)
    count = body.select_count or not body.select_max_duration_ms
    return [
        StepAggregateOutput(
            group=dict(zip(names, key, strict=True)),
            count=entry[0] if count else None,
            max_duration_ms=entry[1] if body.select_max_duration_ms else None,
        )
        for key, entry in counts.items()
    ]


def workflow_step_counts(start_time: str, end_time: str, application_name: list[str] | None) -> list[MetricData]:
    """Workflows created and steps completed in [start, end), by name: the ``workflow_step_count`` class."""
    start, end = epoch_ms(start_time), epoch_ms(end_time)
    workflows: dict[str, int] = {}
    for w in _workflows(MAX_WORKFLOWS, start_time=start_time, end_time=end_time, application_name=application_name):
        if w.created_at is not None and start <= w.created_at < end:
            workflows[w.name] = workflows.get(w.name, 0) + 1
    steps: dict[str, int] = {}
    for step in _steps(
        completed_after=start, completed_before=end - 1, workflow_id_prefix=None, application_name=application_name
    ):
        steps[step["function_name"]] = steps.get(step["function_name"], 0) + 1
    return [MetricData(metric_type="workflow_count", metric_name=n, value=v) for n, v in workflows.items()] + [
        MetricData(metric_type="step_count", metric_name=n, value=v) for n, v in steps.items()
    ]
