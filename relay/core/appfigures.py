"""An app's workflow figures in DBOS Conductor's names (``dbos_conductor_v1_*``), from its aggregates.

Pure: the workflow that asks an app's executor for ``get_workflow_aggregates``
and ``get_step_aggregates`` hands the rows here, with the window they cover,
and stores what comes back. The figures follow DBOS's ``metrics.md``:

- rates: per-second averages over the window (a count divided by its length),
  stamped with the window's start;
- windowed: maxima over the window, stamped likewise;
- point-in-time: counts and oldest timestamps at the moment they were asked.

The window is the most recently completed clock-aligned one (a minute, as
Conductor's; shorter in tests). The queries' bounds are inclusive on both
ends in the SDK, so a window ``[start, end)`` is asked as ``[start, end - 1 ms]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

PREFIX = "dbos_conductor_v1_"

# Statuses as the SDK names them, and the rate each completed one counts towards.
COMPLETED = {
    "SUCCESS": "workflow_success_rate",
    "ERROR": "workflow_failed_rate",
    "MAX_RECOVERY_ATTEMPTS_EXCEEDED": "workflow_failed_rate",
    "CANCELLED": "workflow_cancelled_rate",
}
STEP_COMPLETED = {"SUCCESS": "step_success_rate", "ERROR": "step_failed_rate"}
# Failed, as the failure rate counts and the WorkflowFailure rule pages: an error, or recovered too
# many times (a poison workflow, dead-lettered).
FAILED_STATUSES = tuple(status for status, rate in COMPLETED.items() if rate == "workflow_failed_rate")

# Every family, with its labels besides ``org`` and ``application`` and whether it is stamped
# with the window (rates and windowed maxima) or not (point-in-time).
WF, WFQ = ("workflow_name",), ("workflow_name", "queue_name")
FAMILIES: dict[str, tuple[tuple[str, ...], bool, str]] = {
    "workflow_started_rate": (WFQ, True, "Workflows created per second over the window."),
    "workflow_dequeued_rate": (WFQ, True, "Enqueued workflows dequeued per second over the window."),
    "workflow_success_rate": (WFQ, True, "Workflows that completed successfully per second over the window."),
    "workflow_failed_rate": (
        WFQ,
        True,
        "Workflows that ended in ERROR or MAX_RECOVERY_ATTEMPTS_EXCEEDED per second over the window.",
    ),
    "workflow_cancelled_rate": (WFQ, True, "Workflows cancelled per second over the window."),
    "workflow_enqueued_count": (WFQ, False, "Workflows ENQUEUED when last asked."),
    "workflow_pending_count": (WF, False, "Workflows PENDING when last asked."),
    "workflow_oldest_enqueued_timestamp_seconds": (
        WFQ,
        False,
        "Unix time of the oldest ENQUEUED workflow when last asked; no series when none.",
    ),
    "workflow_oldest_pending_timestamp_seconds": (
        WF,
        False,
        "Unix time of the oldest PENDING workflow when last asked; no series when none.",
    ),
    "workflow_max_queue_wait_seconds": (
        WFQ,
        True,
        "Longest wait from creation to first start among workflows that succeeded in the window.",
    ),
    "workflow_max_total_latency_seconds": (
        WFQ,
        True,
        "Longest time from creation to completion among workflows that succeeded in the window.",
    ),
    "step_success_rate": (("step_name",), True, "Steps that completed successfully per second over the window."),
    "step_failed_rate": (("step_name",), True, "Steps that ended with an error per second over the window."),
    "step_max_duration_seconds": (
        ("step_name",),
        True,
        "Longest single step among those that completed successfully in the window.",
    ),
    "executor_count": (
        ("status", "application_version"),
        False,
        "Executors in Relay's registry, by Conductor's status and application version.",
    ),
}


@dataclass(frozen=True)
class Window:
    """``[start_ms, start_ms + secs * 1000)``, aligned on the clock."""

    start_ms: int
    secs: float

    @classmethod
    def last_completed(cls, now: float, secs: float) -> Window:
        """The most recently completed window at ``now`` (seconds since the epoch)."""
        index = math.floor(now / secs) - 1
        return cls(round(index * secs * 1000), secs)

    @property
    def end_ms(self) -> int:
        return self.start_ms + round(self.secs * 1000)

    @property
    def last_ms(self) -> int:
        """The last millisecond inside the window (the SDK's bounds are inclusive)."""
        return self.end_ms - 1


@dataclass(frozen=True)
class Row:
    """A ``get_workflow_aggregates`` row (``group``: the SDK's group keys, values as strings)."""

    group: dict[str, str | None]
    count: int | None = None
    min_created_at: int | None = None
    max_queue_wait_ms: int | None = None
    max_total_latency_ms: int | None = None


@dataclass(frozen=True)
class StepRow:
    """A ``get_step_aggregates`` row."""

    group: dict[str, str | None]
    count: int | None = None
    max_duration_ms: int | None = None


@dataclass(frozen=True)
class Aggregates:
    """What one executor answered about one window.

    ``started``: created in the window, by name and queue; ``dequeued``: dequeued in it, by
    name and queue; ``completed``: completed in it, by status, name and queue, with the
    maxima; ``live``: ENQUEUED and PENDING now, by status, name and queue, with the oldest
    creation; ``steps``: steps completed in it, by function name and status, with the maxima.
    """

    started: list[Row]
    dequeued: list[Row]
    completed: list[Row]
    live: list[Row]
    steps: list[StepRow]


@dataclass(frozen=True)
class Series:
    family: str  # without the prefix
    labels: dict[str, str]
    value: float
    windowed: bool


@dataclass
class _Acc:
    values: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)

    def add(self, family: str, labels: tuple[str, ...], value: float) -> None:
        key = (family, labels)
        self.values[key] = self.values.get(key, 0.0) + value

    def maximum(self, family: str, labels: tuple[str, ...], value: float) -> None:
        key = (family, labels)
        self.values[key] = max(self.values.get(key, value), value)

    def minimum(self, family: str, labels: tuple[str, ...], value: float) -> None:
        key = (family, labels)
        self.values[key] = min(self.values.get(key, value), value)


def _name(row: Row | StepRow, key: str) -> str:
    return row.group.get(key) or ""


def series(aggregates: Aggregates, window: Window) -> list[Series]:
    """The app's figures for ``window`` (without ``org`` and ``application``, added when served)."""
    acc = _Acc()
    secs = window.secs
    for row in aggregates.started:
        acc.add("workflow_started_rate", (_name(row, "name"), _name(row, "queue_name")), (row.count or 0) / secs)
    for row in aggregates.dequeued:
        if row.group.get("queue_name"):  # a workflow never enqueued is not counted
            acc.add("workflow_dequeued_rate", (_name(row, "name"), _name(row, "queue_name")), (row.count or 0) / secs)
    for row in aggregates.completed:
        labels = (_name(row, "name"), _name(row, "queue_name"))
        rate = COMPLETED.get(_name(row, "status"))
        if rate is not None:
            acc.add(rate, labels, (row.count or 0) / secs)
        if _name(row, "status") == "SUCCESS":
            if row.max_queue_wait_ms is not None:
                acc.maximum("workflow_max_queue_wait_seconds", labels, max(0, row.max_queue_wait_ms) / 1000)
            if row.max_total_latency_ms is not None:
                acc.maximum("workflow_max_total_latency_seconds", labels, max(0, row.max_total_latency_ms) / 1000)
    for row in aggregates.live:
        name, queue = _name(row, "name"), _name(row, "queue_name")
        if _name(row, "status") == "ENQUEUED":
            acc.add("workflow_enqueued_count", (name, queue), row.count or 0)
            if row.min_created_at is not None:
                acc.minimum("workflow_oldest_enqueued_timestamp_seconds", (name, queue), row.min_created_at / 1000)
        elif _name(row, "status") == "PENDING":
            acc.add("workflow_pending_count", (name,), row.count or 0)
            if row.min_created_at is not None:
                acc.minimum("workflow_oldest_pending_timestamp_seconds", (name,), row.min_created_at / 1000)
    for step in aggregates.steps:
        step_name = (_name(step, "function_name"),)
        rate = STEP_COMPLETED.get(_name(step, "status"))
        if rate is not None:
            acc.add(rate, step_name, (step.count or 0) / secs)
        if _name(step, "status") == "SUCCESS" and step.max_duration_ms is not None:
            acc.maximum("step_max_duration_seconds", step_name, max(0, step.max_duration_ms) / 1000)
    return [
        Series(family, dict(zip(FAMILIES[family][0], labels, strict=True)), value, FAMILIES[family][1])
        for (family, labels), value in sorted(acc.values.items())
    ]


def counts(aggregates: Aggregates) -> list[tuple[str, str, int]]:
    """Conductor's ``Metric`` counts of the window: ``(metric_type, metric_name, value)``.

    ``workflow_count``: workflows created in the window, by workflow name; ``step_count``:
    steps completed in it, by step name (what the SDK's ``get_metrics`` counts).
    """
    found: dict[tuple[str, str], int] = {}
    for row in aggregates.started:
        key = ("workflow_count", _name(row, "name"))
        found[key] = found.get(key, 0) + (row.count or 0)
    for step in aggregates.steps:
        key = ("step_count", _name(step, "function_name"))
        found[key] = found.get(key, 0) + (step.count or 0)
    return [(kind, name, value) for (kind, name), value in sorted(found.items()) if value]


def conductor_status(state: str) -> str:
    """Conductor's executor status of a Relay state (a RECOVERING executor is DEAD to Conductor)."""
    return "DEAD" if state == "RECOVERING" else state


def executor_counts(rows: Iterable[tuple[str, str, str, str, int]]) -> list[tuple[str, str, Series]]:
    """``executor_count`` series from the registry's ``(org, app, state, version, n)``."""
    totals: dict[tuple[str, str, str, str], int] = {}
    for org, app, state, version, n in rows:
        key = (org, app, conductor_status(state), version)
        totals[key] = totals.get(key, 0) + n
    return [
        (org, app, Series("executor_count", {"status": status, "application_version": version}, n, False))
        for (org, app, status, version), n in sorted(totals.items())
    ]
