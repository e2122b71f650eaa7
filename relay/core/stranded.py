"""Which PENDING workflows are stranded: pure, the reconciler's decision (README, "Stranded work").

A workflow is stranded when it is PENDING under an executor id that nobody
will recover: the id has no record in Relay's registry (Relay deleted it after
a recovery that left work behind, or its record was lost), and it has not
been updated for longer than the app's grace period. An id Relay never
registered counts only when the operator opts in; ``local`` (the id of DBOS
processes that run without a control plane) never does. An executor with a
record is someone else's business: HEALTHY and DISCONNECTED ones are alive or
in their grace period, DEAD and RECOVERING ones have their recovery.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

LOCAL_EXECUTOR_ID = "local"


@dataclass(frozen=True)
class PendingWorkflow:
    workflow_id: str
    executor_id: str
    application_version: str
    updated_at_ms: int | None


@dataclass(frozen=True)
class Stranded:
    """An executor id whose work is stranded, the version to recover it on, and the workflows."""

    executor_id: str
    application_version: str
    workflow_ids: tuple[str, ...]
    registered: bool  # Relay registered it once (False: an id it never saw, by opt-in)


def candidate_ids(workflows: Iterable[PendingWorkflow]) -> list[str]:
    """The executor ids worth looking up in the registry."""
    return sorted({w.executor_id for w in workflows if w.executor_id and w.executor_id != LOCAL_EXECUTOR_ID})


def find_stranded(
    workflows: Iterable[PendingWorkflow],
    gone: dict[str, bool],
    *,
    now_ms: int,
    grace_secs: float,
    include_unknown: bool,
) -> list[Stranded]:
    """The stranded executors among ``workflows``' owners.

    ``gone`` maps each executor id with no record in the registry to whether
    Relay registered it once. A workflow updated within the grace period, or
    whose update time is unknown, is left alone: its executor may be alive.
    An executor's workflows on several versions (it cannot run more than one)
    are recovered on the version most of them have.
    """
    cutoff = now_ms - int(grace_secs * 1000)
    by_executor: dict[str, list[PendingWorkflow]] = {}
    for w in workflows:
        if w.executor_id == LOCAL_EXECUTOR_ID or w.executor_id not in gone:
            continue
        if not gone[w.executor_id] and not include_unknown:
            continue
        if w.updated_at_ms is None or w.updated_at_ms > cutoff:
            continue
        by_executor.setdefault(w.executor_id, []).append(w)
    found = []
    for executor_id, mine in sorted(by_executor.items()):
        version = Counter(w.application_version for w in mine).most_common(1)[0][0]
        ids = tuple(sorted(w.workflow_id for w in mine))
        found.append(Stranded(executor_id, version, ids, gone[executor_id]))
    return found
