"""The apps' figures from their aggregates (relay/core/appfigures.py): pure, no I/O."""

from __future__ import annotations

from relay.core.appfigures import Aggregates, Row, Series, StepRow, Window, counts, executor_counts, series

W = Window(start_ms=1_700_000_040_000, secs=60.0)


def test_the_window_is_the_last_completed_clock_aligned_one() -> None:
    # A scrape during 12:34 reports [12:33:00, 12:34:00).
    at = 1_700_000_047.5  # 47.5 s into a minute (1_700_000_040 is a multiple of 60)
    window = Window.last_completed(at, 60.0)
    assert window.start_ms == 1_699_999_980_000
    assert (window.end_ms - window.start_ms, window.last_ms) == (60_000, window.end_ms - 1)
    assert Window.last_completed(at, 0.5).start_ms == round((int(at / 0.5) - 1) * 500)


def by_family(found: list[Series]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.family, tuple(sorted(s.labels.items()))): s.value for s in found}


def test_rates_maxima_and_point_in_time_figures() -> None:
    aggregates = Aggregates(
        started=[Row({"name": "job", "queue_name": "serial"}, 120), Row({"name": "job", "queue_name": None}, 6)],
        dequeued=[Row({"name": "job", "queue_name": "serial"}, 60), Row({"name": "job", "queue_name": None}, 9)],
        completed=[
            Row({"status": "SUCCESS", "name": "job", "queue_name": "serial"}, 30, None, 1500, 4000),
            Row({"status": "ERROR", "name": "job", "queue_name": "serial"}, 3, None, 9000, 9000),
            Row({"status": "MAX_RECOVERY_ATTEMPTS_EXCEEDED", "name": "job", "queue_name": "serial"}, 3),
            Row({"status": "CANCELLED", "name": "job", "queue_name": "serial"}, 6),
        ],
        live=[
            Row({"status": "ENQUEUED", "name": "job", "queue_name": "serial"}, 4, 1_700_000_001_000),
            Row({"status": "PENDING", "name": "job", "queue_name": "serial"}, 1, 1_700_000_003_000),
            Row({"status": "PENDING", "name": "job", "queue_name": None}, 2, 1_700_000_002_000),
        ],
        steps=[
            StepRow({"function_name": "add", "status": "SUCCESS"}, 90, 250),
            StepRow({"function_name": "add", "status": "ERROR"}, 30, 99_999),
        ],
    )
    got = by_family(series(aggregates, W))
    wq = (("queue_name", "serial"), ("workflow_name", "job"))
    assert got == {
        ("workflow_started_rate", wq): 2.0,
        ("workflow_started_rate", (("queue_name", ""), ("workflow_name", "job"))): 0.1,
        ("workflow_dequeued_rate", wq): 1.0,  # never-enqueued ones are not counted
        ("workflow_success_rate", wq): 0.5,
        ("workflow_failed_rate", wq): 0.1,  # ERROR and MAX_RECOVERY_ATTEMPTS_EXCEEDED
        ("workflow_cancelled_rate", wq): 0.1,
        ("workflow_max_queue_wait_seconds", wq): 1.5,  # over successful ones only
        ("workflow_max_total_latency_seconds", wq): 4.0,
        ("workflow_enqueued_count", wq): 4,
        ("workflow_oldest_enqueued_timestamp_seconds", wq): 1_700_000_001.0,
        ("workflow_pending_count", (("workflow_name", "job"),)): 3,  # not by queue
        ("workflow_oldest_pending_timestamp_seconds", (("workflow_name", "job"),)): 1_700_000_002.0,
        ("step_success_rate", (("step_name", "add"),)): 1.5,
        ("step_failed_rate", (("step_name", "add"),)): 0.5,
        ("step_max_duration_seconds", (("step_name", "add"),)): 0.25,
    }
    windowed = {s.family for s in series(aggregates, W) if s.windowed}
    assert "workflow_pending_count" not in windowed and "workflow_success_rate" in windowed
    assert counts(aggregates) == [("step_count", "add", 120), ("workflow_count", "job", 126)]


def test_an_empty_window_has_no_series_and_executors_use_conductors_statuses() -> None:
    assert series(Aggregates([], [], [], [], []), W) == []
    found = executor_counts([("acme", "ledger", "HEALTHY", "v1", 2), ("acme", "ledger", "RECOVERING", "v1", 1),
                             ("acme", "ledger", "DEAD", "v1", 1)])  # fmt: skip
    assert [(org, app, s.labels["status"], s.value) for org, app, s in found] == [
        ("acme", "ledger", "DEAD", 2),
        ("acme", "ledger", "HEALTHY", 2),
    ]
