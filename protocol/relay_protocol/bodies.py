"""The ``body`` objects some requests carry.

A filter typed ``str | list[str] | None`` takes one value or any of several;
None means no filter. Times in filters are ISO 8601 strings. Booleans carry the
SDK's own default for a missing key, so a body built here means the same whether
or not a key is sent.

The sparse bodies (``SPARSE``: the filters, fork-from-failure, rewind) leave an
optional field that is None or an empty list out of the frame rather than send
it: the Python SDK reads a missing key, a null and an empty list alike (no
filter, not chosen), but the TypeScript SDK (5.2) takes ``was_forked_from: null``
as "was_forked_from = NULL", which no workflow matches, ``has_parent: null`` as
"has no parent", ``status: []`` as "status IN ()", a syntax error, and a
fork-from-failure's ``from_step: null`` as a mode chosen. Required fields are
always sent. ForkWorkflowBody and RetentionBody send every field: the Python SDK
reads some of their optional ones with ``[]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from relay_protocol.limits import APP_DEFINED_NAME, QUEUE_OR_SCHEDULE_NAME, WORKFLOW_ID, meta

# Workflow ids, queues' and schedules' names and the other names an app gives (a workflow's or a
# step's name, a user, a partition key) are bounded in bytes, not as names (relay_protocol.limits).
_ID = meta(rule=WORKFLOW_ID)
_QS = meta(rule=QUEUE_OR_SCHEDULE_NAME)
_APP = meta(rule=APP_DEFINED_NAME)


@dataclass(frozen=True, kw_only=True)
class _WorkflowFilter:
    """What list_workflows and list_queued_workflows share."""

    SPARSE: ClassVar[bool] = True
    workflow_uuids: list[str] | None = field(default=None, metadata=_ID)
    workflow_name: str | list[str] | None = field(default=None, metadata=_APP)
    authenticated_user: str | list[str] | None = field(default=None, metadata=_APP)
    start_time: str | None = None
    end_time: str | None = None
    completed_after: str | None = None
    completed_before: str | None = None
    dequeued_after: str | None = None
    dequeued_before: str | None = None
    status: str | list[str] | None = None
    application_version: str | list[str] | None = None
    forked_from: str | list[str] | None = field(default=None, metadata=_ID)
    parent_workflow_id: str | list[str] | None = field(default=None, metadata=_ID)
    queue_name: str | list[str] | None = field(default=None, metadata=_QS)
    limit: int | None = None
    offset: int | None = None
    sort_desc: bool = False
    workflow_id_prefix: str | list[str] | None = field(default=None, metadata=_ID)
    load_input: bool = True
    load_output: bool = True
    executor_id: str | list[str] | None = None
    was_forked_from: bool | None = None
    has_parent: bool | None = None
    attributes: dict[str, Any] | None = None
    schedule_name: str | list[str] | None = field(default=None, metadata=_QS)
    application_name: str | list[str] | None = None


@dataclass(frozen=True, kw_only=True)
class ListWorkflowsBody(_WorkflowFilter):
    queues_only: bool = False


@dataclass(frozen=True, kw_only=True)
class ListQueuedWorkflowsBody(_WorkflowFilter):
    pass


@dataclass(frozen=True, kw_only=True)
class ForkWorkflowBody:
    """The SDK reads application_version and new_workflow_id with ``[]``: they are always sent, null or not."""

    workflow_id: str = field(metadata=_ID)
    start_step: int
    application_version: str | None = None
    new_workflow_id: str | None = field(default=None, metadata=_ID)
    queue_name: str | None = field(default=None, metadata=_QS)
    queue_partition_key: str | None = field(default=None, metadata=_APP)


@dataclass(frozen=True, kw_only=True)
class ForkFromFailureBody:
    """Fork each workflow from its last failure, its last step, a step number or a step name."""

    SPARSE: ClassVar[bool] = True

    workflow_ids: list[str] = field(metadata=_ID)
    application_version: str | None = None
    queue_name: str | None = field(default=None, metadata=_QS)
    queue_partition_key: str | None = field(default=None, metadata=_APP)
    from_last_failure: bool = False
    from_last_step: bool = False
    from_step: int | None = None
    from_step_name: str | None = field(default=None, metadata=_APP)


@dataclass(frozen=True, kw_only=True)
class RewindWorkflowBody:
    """start_step null (or 0) means step 1."""

    SPARSE: ClassVar[bool] = True

    workflow_id: str = field(metadata=_ID)
    start_step: int | None = None
    application_version: str | None = None
    queue_name: str | None = field(default=None, metadata=_QS)
    queue_partition_key: str | None = field(default=None, metadata=_APP)


@dataclass(frozen=True, kw_only=True)
class RetentionBody:
    """Epoch milliseconds and row counts; null turns that part off (gc_batch_size null: the SDK's default)."""

    gc_cutoff_epoch_ms: int | None = None
    gc_rows_threshold: int | None = None
    gc_batch_size: int | None = None
    timeout_cutoff_epoch_ms: int | None = None


@dataclass(frozen=True, kw_only=True)
class ListSchedulesBody:
    SPARSE: ClassVar[bool] = True

    status: str | list[str] | None = None
    workflow_name: str | list[str] | None = field(default=None, metadata=_APP)
    schedule_name_prefix: str | list[str] | None = field(default=None, metadata=_QS)
    application_name: str | list[str] | None = None
    load_context: bool = True


@dataclass(frozen=True, kw_only=True)
class GetWorkflowAggregatesBody:
    """At least one group_by flag must be set; with no select flag the SDK counts."""

    SPARSE: ClassVar[bool] = True

    group_by_status: bool = False
    group_by_name: bool = False
    group_by_queue_name: bool = False
    group_by_executor_id: bool = False
    group_by_application_version: bool = False
    group_by_application_name: bool = False
    select_count: bool = False
    select_min_created_at: bool = False
    select_max_queue_wait_ms: bool = False
    select_max_total_latency_ms: bool = False
    time_bucket_size_ms: int | None = None
    status: list[str] | None = None
    start_time: str | None = None
    end_time: str | None = None
    completed_after: str | None = None
    completed_before: str | None = None
    dequeued_after: str | None = None
    dequeued_before: str | None = None
    name: list[str] | None = field(default=None, metadata=_APP)
    app_version: list[str] | None = None
    executor_id: list[str] | None = None
    queue_name: list[str] | None = field(default=None, metadata=_QS)
    workflow_id_prefix: list[str] | None = field(default=None, metadata=_ID)
    workflow_ids: list[str] | None = field(default=None, metadata=_ID)
    forked_from: list[str] | None = field(default=None, metadata=_ID)
    parent_workflow_id: list[str] | None = field(default=None, metadata=_ID)
    user: list[str] | None = field(default=None, metadata=_APP)
    schedule_name: list[str] | None = field(default=None, metadata=_QS)
    application_name: list[str] | None = None
    was_forked_from: bool | None = None
    has_parent: bool | None = None
    attributes: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class GetStepAggregatesBody:
    """At least one group_by flag must be set; with no select flag the SDK counts."""

    SPARSE: ClassVar[bool] = True

    group_by_function_name: bool = False
    group_by_status: bool = False
    select_count: bool = False
    select_max_duration_ms: bool = False
    time_bucket_size_ms: int | None = None
    status: list[str] | None = None
    function_name: list[str] | None = field(default=None, metadata=_APP)
    workflow_id_prefix: list[str] | None = field(default=None, metadata=_ID)
    completed_after: str | None = None
    completed_before: str | None = None
    application_name: list[str] | None = None


@dataclass(frozen=True, kw_only=True)
class ListQueuesBody:
    SPARSE: ClassVar[bool] = True

    application_name: str | list[str] | None = None
