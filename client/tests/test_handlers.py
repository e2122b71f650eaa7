"""Every message type answered by the handlers, against a real DBOS on SQLite."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import app
import pytest
from dbos import DBOS, SetWorkflowID

import relay_protocol as p
from relay_client import aggregates, retention
from relay_client.handlers import UNSERVED, Handlers, Identity
from relay_client.retention import Retention

R = TypeVar("R", bound=p.Reply)


@pytest.fixture(scope="module")
def h(launched: str) -> Handlers:
    for i in range(3):
        with SetWorkflowID(f"add-{i}"):
            DBOS.start_workflow(app.adder, i).get_result()
    with SetWorkflowID("broken"), pytest.raises(ValueError):
        DBOS.start_workflow(app.failing, "boom").get_result()
    with SetWorkflowID("sample"):  # what the samples below act on
        DBOS.start_workflow(app.adder, 100).get_result()
    return Handlers(Identity(executor_id=launched, application_version=DBOS.application_version, metadata={"a": 1}))


def ask(h: Handlers, request: p.Request) -> dict[str, Any]:
    text = h.answer(request.to_json())
    assert text is not None
    frame: dict[str, Any] = json.loads(text)
    assert (frame["type"], frame["request_id"]) == (request.type.value, request.request_id)
    return frame


def reply(h: Handlers, request: p.Request, expected: type[R]) -> R:
    return p.parse_reply(ask(h, request), expected, request_id=request.request_id)


def iso(at: datetime) -> str:
    return at.isoformat()


NOW = datetime.now(UTC)

# One request of every type: the test below checks each gets its own reply type, or "unknown".
SAMPLES: list[p.Request] = [
    p.ExecutorInfoRequest(),
    p.RecoveryRequest(executor_ids=["nobody"]),
    p.CancelRequest(workflow_id="no-such-workflow"),
    p.DeleteRequest(workflow_id="no-such-workflow", delete_children=False),
    p.ListWorkflowsRequest(body=p.ListWorkflowsBody()),
    p.ListQueuedWorkflowsRequest(body=p.ListQueuedWorkflowsBody()),
    p.ResumeRequest(workflow_id="sample"),
    p.GetWorkflowRequest(workflow_id="add-0"),
    p.ExistPendingWorkflowsRequest(executor_id="nobody", application_version="v1"),
    p.ListStepsRequest(workflow_id="add-0"),
    p.ForkWorkflowRequest(body=p.ForkWorkflowBody(workflow_id="sample", start_step=1, new_workflow_id="sample-fork")),
    p.RetentionRequest(body=p.RetentionBody()),
    p.GetMetricsRequest(
        start_time=iso(NOW - timedelta(hours=1)), end_time=iso(NOW), metric_class="workflow_step_count"
    ),
    p.AlertRequest(name="WorkflowFailure", message="m", metadata={"k": "v"}),
    p.ExportWorkflowRequest(workflow_id="add-0", export_children=False),
    p.ImportWorkflowRequest(serialized_workflow="eA=="),
    p.ListSchedulesRequest(body=p.ListSchedulesBody()),
    p.GetScheduleRequest(schedule_name="nope"),
    p.PauseScheduleRequest(schedule_name="nope"),
    p.ResumeScheduleRequest(schedule_name="nope"),
    p.BackfillScheduleRequest(schedule_name="nope", start=iso(NOW - timedelta(hours=1)), end=iso(NOW)),
    p.TriggerScheduleRequest(schedule_name="nope"),
    p.ListApplicationVersionsRequest(),
    p.SetLatestApplicationVersionRequest(version_name="v1"),
    p.GetWorkflowEventsRequest(workflow_id="add-0"),
    p.GetWorkflowNotificationsRequest(workflow_id="add-0"),
    p.GetWorkflowStreamsRequest(workflow_id="add-0"),
    p.GetWorkflowAggregatesRequest(body=p.GetWorkflowAggregatesBody(group_by_name=True)),
    p.GetStepAggregatesRequest(body=p.GetStepAggregatesBody(group_by_function_name=True)),
    p.ForkFromFailureRequest(body=p.ForkFromFailureBody(workflow_ids=["sample"], from_last_step=True)),
    p.ListQueuesRequest(),
    p.GetQueueRequest(name="nope"),
    p.RewindWorkflowRequest(body=p.RewindWorkflowBody(workflow_id="sample")),
]


def test_the_samples_cover_every_type() -> None:
    assert sorted(s.type for s in SAMPLES) == sorted(p.MessageType)


@pytest.mark.parametrize("request_", SAMPLES, ids=lambda r: r.type.value)
def test_each_type_gets_its_reply_type_or_unknown(h: Handlers, request_: p.Request) -> None:
    frame = ask(h, request_)
    if request_.type in UNSERVED:
        assert frame == p.unknown_type_reply(request_.type.value, request_.request_id)
    else:
        parsed = p.parse_reply(frame, p.REPLIES[request_.type], request_id=request_.request_id)
        expected_error = request_.type in {p.MessageType.BACKFILL_SCHEDULE, p.MessageType.TRIGGER_SCHEDULE}
        assert (parsed.error_message is not None) == expected_error, parsed.error_message


def test_unknown_and_malformed_requests_are_answered_not_fatal(h: Handlers) -> None:
    unknown = json.loads(h.answer('{"type": "teleport", "request_id": "r1"}') or "null")
    assert unknown == {"type": "teleport", "request_id": "r1", "error_message": "Unknown message type"}
    malformed = json.loads(h.answer('{"type": "cancel", "request_id": "r2"}') or "null")
    assert (malformed["type"], malformed["request_id"]) == ("cancel", "r2")
    assert "workflow_id" in malformed["error_message"]
    assert h.answer("not json") is None and h.answer('{"type": "cancel"}') is None


def test_executor_info(h: Handlers, launched: str) -> None:
    info = reply(h, p.ExecutorInfoRequest(), p.ExecutorInfoReply)
    assert info.executor_id == launched == DBOS.executor_id
    assert (info.application_version, info.language, info.executor_metadata) == ("v1", "python", {"a": 1})
    assert info.dbos_version is not None and info.dbos_version.startswith("3.")


def test_list_and_get_workflows_render_as_the_sdk(h: Handlers, launched: str) -> None:
    body = p.ListWorkflowsBody(workflow_id_prefix="add-", sort_desc=True)
    listed = reply(h, p.ListWorkflowsRequest(body=body), p.ListWorkflowsReply).output
    assert [w.workflow_id for w in listed] == ["add-2", "add-1", "add-0"]
    first = listed[-1]
    status = DBOS.get_workflow_status("add-0")
    assert status is not None
    assert (first.status, first.workflow_name, first.executor_id) == ("SUCCESS", status.name, launched)
    assert first.output == "3" and first.input == str(status.input) and first.error is None
    assert first.created_at == str(status.created_at) and first.application_version == "v1"
    got = reply(h, p.GetWorkflowRequest(workflow_id="broken", load_input=False), p.GetWorkflowReply).output
    assert got is not None and got.status == "ERROR" and got.error == "boom" and got.input is None
    missing = reply(h, p.GetWorkflowRequest(workflow_id="nope"), p.GetWorkflowReply)
    assert missing.output is None and missing.error_message is None
    only_errors = p.ListWorkflowsBody(status="ERROR", load_input=False, load_output=False)
    assert [w.workflow_id for w in reply(h, p.ListWorkflowsRequest(body=only_errors), p.ListWorkflowsReply).output] == [
        "broken"
    ]


def test_steps_and_events(h: Handlers) -> None:
    steps = reply(h, p.ListStepsRequest(workflow_id="add-1"), p.ListStepsReply).output
    assert steps is not None
    assert [(s.function_name.rsplit(".", 1)[-1], s.output) for s in steps if "add" in s.function_name] == [
        ("add", "2"),
        ("add", "3"),
    ]
    assert all(s.completed_at_epoch_ms is not None and s.completed_at_epoch_ms.isdigit() for s in steps)
    events = reply(h, p.GetWorkflowEventsRequest(workflow_id="add-1"), p.GetWorkflowEventsReply).events
    assert events == [p.EventOutput(key="seen", value="1")]


def settled() -> None:
    """What the tests before started (a fork runs on DBOS's internal queue) has finished."""
    deadline = time.monotonic() + 60
    while DBOS.list_workflows(status=["PENDING", "ENQUEUED"], limit=1, load_input=False, load_output=False):
        assert time.monotonic() < deadline, "workflows of earlier tests still unfinished"
        time.sleep(0.1)


def test_pending_workflows_cancel_resume_and_exist_pending(h: Handlers, launched: str) -> None:
    settled()
    with SetWorkflowID("waiting"):
        DBOS.start_workflow(app.waiter, 5.0)
    pending = p.ExistPendingWorkflowsRequest(executor_id=launched, application_version="v1")
    assert reply(h, pending, p.ExistPendingWorkflowsReply).exist
    other = p.ExistPendingWorkflowsRequest(executor_id=launched, application_version="v2")
    assert not reply(h, other, p.ExistPendingWorkflowsReply).exist
    assert reply(h, p.CancelRequest(workflow_id="waiting"), p.CancelReply).success
    assert DBOS.get_workflow_status("waiting").status == "CANCELLED"  # type: ignore[union-attr]
    assert not reply(h, pending, p.ExistPendingWorkflowsReply).exist
    assert reply(h, p.ResumeRequest(workflow_id="", workflow_ids=["waiting"]), p.ResumeReply).success
    assert DBOS.get_workflow_status("waiting").status in ("ENQUEUED", "PENDING")  # type: ignore[union-attr]
    DBOS.send("waiting", "go!", "go")  # let it finish (whichever execution takes the message)
    # Recovery of an executor with nothing pending succeeds and recovers nothing.
    assert reply(h, p.RecoveryRequest(executor_ids=["gone"]), p.RecoveryReply).success
    unknown = reply(h, p.ResumeRequest(workflow_id="no-such-workflow"), p.ResumeReply)
    assert not unknown.success and unknown.error_message is not None
    assert "Exception encountered when resuming workflow(s) ['no-such-workflow']" in unknown.error_message


def test_fork_rewind_fork_from_failure_and_delete(h: Handlers) -> None:
    body = p.ForkWorkflowBody(workflow_id="add-2", start_step=2, new_workflow_id="add-2-fork")
    assert reply(h, p.ForkWorkflowRequest(body=body), p.ForkWorkflowReply).new_workflow_id == "add-2-fork"
    assert DBOS.retrieve_workflow("add-2-fork").get_result() == 7
    rewind = p.RewindWorkflowRequest(body=p.RewindWorkflowBody(workflow_id="add-2-fork", start_step=1))
    assert reply(h, rewind, p.RewindWorkflowReply).success
    assert DBOS.retrieve_workflow("add-2-fork").get_result() == 7
    failed_step = max(s["function_id"] for s in DBOS.list_workflow_steps("broken") if s["error"] is not None)
    bulk = p.ForkFromFailureBody(workflow_ids=["broken"], from_last_failure=True)
    forked = reply(h, p.ForkFromFailureRequest(body=bulk), p.ForkFromFailureReply).forked_workflow_ids
    assert forked is not None and len(forked) == 1
    with pytest.raises(ValueError):
        DBOS.retrieve_workflow(forked[0]).get_result()
    status = DBOS.get_workflow_status(forked[0])
    assert status is not None and status.forked_from == "broken"
    # Steps before the failed one were copied, not run again.
    copied = [s["function_id"] for s in DBOS.list_workflow_steps(forked[0])]
    assert min(copied) == 1 and failed_step in copied
    two_modes = p.ForkFromFailureBody(workflow_ids=["broken"], from_last_step=True, from_step=1)
    refused = reply(h, p.ForkFromFailureRequest(body=two_modes), p.ForkFromFailureReply)
    assert refused.forked_workflow_ids is None and "Exactly one of" in (refused.error_message or "")
    assert reply(h, p.DeleteRequest(workflow_id="add-2-fork", delete_children=True), p.DeleteReply).success
    assert DBOS.get_workflow_status("add-2-fork") is None


def test_schedules(h: Handlers) -> None:
    DBOS.create_schedule(schedule_name="every-hour", workflow_fn=app.ticker, schedule="0 * * * *", context={"c": 1})
    listed = reply(h, p.ListSchedulesRequest(body=p.ListSchedulesBody()), p.ListSchedulesReply).output
    assert [(s.schedule_name, s.status, s.context) for s in listed] == [("every-hour", "ACTIVE", "{'c': 1}")]
    got = reply(h, p.GetScheduleRequest(schedule_name="every-hour", load_context=False), p.GetScheduleReply).output
    assert got is not None and got.context is None and got.schedule == "0 * * * *"
    assert reply(h, p.PauseScheduleRequest(schedule_name="every-hour"), p.PauseScheduleReply).success
    assert DBOS.get_schedule("every-hour")["status"] == "PAUSED"  # type: ignore[index]
    assert reply(h, p.ResumeScheduleRequest(schedule_name="every-hour"), p.ResumeScheduleReply).success
    start = datetime(2026, 1, 1, 0, 30, tzinfo=UTC)
    backfill = p.BackfillScheduleRequest(
        schedule_name="every-hour", start=iso(start), end=iso(start + timedelta(hours=3))
    )
    ids = reply(h, backfill, p.BackfillScheduleReply).workflow_ids
    assert len(ids) == 3 and all(i.startswith("sched-every-hour-") for i in ids)
    triggered = reply(h, p.TriggerScheduleRequest(schedule_name="every-hour"), p.TriggerScheduleReply)
    assert triggered.workflow_id is not None and "trigger" in triggered.workflow_id
    missing = reply(h, p.TriggerScheduleRequest(schedule_name="nope"), p.TriggerScheduleReply)
    assert missing.workflow_id is None and "does not exist" in (missing.error_message or "")
    DBOS.delete_schedule("every-hour")


def test_versions_and_queues(h: Handlers) -> None:
    versions = reply(h, p.ListApplicationVersionsRequest(), p.ListApplicationVersionsReply).output
    assert [v.version_name for v in versions] == ["v1"]
    assert reply(h, p.SetLatestApplicationVersionRequest(version_name="v1"), p.SetLatestApplicationVersionReply).success
    DBOS.register_queue("q-limited", global_concurrency=3, worker_concurrency=2, limiter={"limit": 5, "period": 10})
    queues = reply(h, p.ListQueuesRequest(), p.ListQueuesReply).output
    limited = next(q for q in queues if q.name == "q-limited")
    assert (limited.concurrency, limited.worker_concurrency) == (3, 2)
    assert (limited.rate_limit_max, limited.rate_limit_period_sec, limited.partition_queue) == (5, 10.0, False)
    assert reply(h, p.GetQueueRequest(name="q-limited"), p.GetQueueReply).output == limited
    assert reply(h, p.GetQueueRequest(name="nope"), p.GetQueueReply).output is None


def test_alert_calls_the_apps_handler(h: Handlers) -> None:
    alert = p.AlertRequest(name="ExecutorDead", message="gone", metadata={"executorId": "x"})
    assert reply(h, alert, p.AlertReply).success
    assert app.alerts[-1] == ("ExecutorDead", "gone", {"executorId": "x"})


def test_workflow_aggregates_match_the_listing(h: Handlers) -> None:
    body = p.GetWorkflowAggregatesBody(
        group_by_status=True, group_by_name=True, select_count=True, select_max_total_latency_ms=True
    )
    rows = reply(h, p.GetWorkflowAggregatesRequest(body=body), p.GetWorkflowAggregatesReply).output
    counted: dict[tuple[str | None, str | None], int] = {}
    for w in DBOS.list_workflows(load_input=False, load_output=False):
        counted[(w.status, w.name)] = counted.get((w.status, w.name), 0) + 1
    assert {(r.group["status"], r.group["name"]): r.count for r in rows} == counted
    assert all(
        r.max_total_latency_ms is not None and r.min_created_at is None for r in rows if r.group["status"] == "SUCCESS"
    )
    bucketed = p.GetWorkflowAggregatesBody(time_bucket_size_ms=3_600_000, workflow_ids=["add-0", "add-1"])
    [row] = reply(h, p.GetWorkflowAggregatesRequest(body=bucketed), p.GetWorkflowAggregatesReply).output
    assert row.count == 2 and int(row.group["time_bucket"] or "x") % 3_600_000 == 0
    none = reply(h, p.GetWorkflowAggregatesRequest(body=p.GetWorkflowAggregatesBody()), p.GetWorkflowAggregatesReply)
    assert none.output == [] and "At least one group_by" in (none.error_message or "")


def test_step_aggregates_and_metrics(h: Handlers) -> None:
    body = p.GetStepAggregatesBody(
        group_by_function_name=True, group_by_status=True, workflow_id_prefix=["add-", "broken"]
    )
    rows = reply(h, p.GetStepAggregatesRequest(body=body), p.GetStepAggregatesReply).output
    by_group = {(r.group["function_name"], r.group["status"]): r.count for r in rows}
    add_name = next(name for name, _ in by_group if name and name.endswith("add"))
    assert by_group[(add_name, "SUCCESS")] == 3 * 2 + 1
    assert sum(n for (name, status), n in by_group.items() if status == "ERROR") == 1
    now = datetime.now(UTC)
    metrics = p.GetMetricsRequest(
        start_time=iso(now - timedelta(hours=1)), end_time=iso(now), metric_class="workflow_step_count"
    )
    data = reply(h, metrics, p.GetMetricsReply).metrics
    counts = {(m.metric_type, m.metric_name): m.value for m in data}
    assert counts[("workflow_count", DBOS.get_workflow_status("add-0").name)] >= 3  # type: ignore[union-attr]
    assert counts[("step_count", add_name)] >= 7
    wrong = p.GetMetricsRequest(start_time=iso(now), end_time=iso(now), metric_class="latency")
    assert reply(h, wrong, p.GetMetricsReply).error_message == "Unexpected metric class: latency"


def test_aggregates_refuse_to_read_without_bound(h: Handlers, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aggregates, "MAX_WORKFLOWS", 1)
    body = p.GetWorkflowAggregatesBody(group_by_name=True)
    refused = reply(h, p.GetWorkflowAggregatesRequest(body=body), p.GetWorkflowAggregatesReply)
    assert refused.output == [] and "narrow the filter" in (refused.error_message or "")


def test_retention_collects_times_out_and_skips_a_round_while_one_runs(
    h: Handlers, monkeypatch: pytest.MonkeyPatch
) -> None:
    with SetWorkflowID("old-waiter"):
        waiting = DBOS.start_workflow(app.waiter, 5.0)  # its thread outlives the cancel: keep it short
    with SetWorkflowID("old-done"):
        DBOS.start_workflow(app.adder, 10).get_result()
    done = DBOS.get_workflow_status("old-done")
    assert done is not None and done.completed_at is not None
    # Collect what completed up to old-done (inclusive), time out what started by now.
    body = p.RetentionBody(
        gc_cutoff_epoch_ms=done.completed_at + 1, gc_batch_size=2, timeout_cutoff_epoch_ms=int(time.time() * 1000)
    )
    survivors_before = {
        w.workflow_id for w in DBOS.list_workflows() if w.completed_at and w.completed_at > done.completed_at
    }
    assert reply(h, p.RetentionRequest(body=body), p.RetentionReply).success
    h.retention.join(10)
    remaining = {w.workflow_id for w in DBOS.list_workflows()}
    assert "old-done" not in remaining and "add-0" not in remaining
    assert survivors_before <= remaining
    assert waiting.get_status().status == "CANCELLED"
    # A round while one runs is skipped, and still answered success at once.
    release = threading.Event()
    monkeypatch.setattr(retention, "collect", lambda body, stopping: release.wait(10))
    busy = Retention()
    assert busy.start(p.RetentionBody()) and not busy.start(p.RetentionBody())
    release.set()
    busy.join(5)
    assert busy.start(p.RetentionBody())
    busy.join(5)


def test_rows_threshold_keeps_the_newest(h: Handlers) -> None:
    in_flight = ["PENDING", "ENQUEUED", "DELAYED"]
    deadline = time.monotonic() + 10
    while DBOS.list_workflows(status=in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
    for i in range(3):
        if i == 1:
            time.sleep(1.05)  # SQLite keeps completion times to the second
        with SetWorkflowID(f"keep-{i}"):
            DBOS.start_workflow(app.adder, i).get_result()
    retention.collect(p.RetentionBody(gc_rows_threshold=2))
    completed = [w.workflow_id for w in DBOS.list_workflows() if w.completed_at is not None]
    assert sorted(completed) == ["keep-1", "keep-2"]
