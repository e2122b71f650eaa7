"""Refused attempts at audited changes, audited as failures (dbos-docs audit-logs.md: ``status`` is
"`failure` if the operation was rejected or errored (for example, a denied attempt or invalid
request)").

A change an API key asks for and Relay refuses, 403 (a permission the key lacks, an app or org
outside its scope, a key beyond its powers) or 422 (an invalid body or parameter), is written
as an entry of the change's action with ``detail.result: "failure"``, ``status``, ``code`` and
``error`` (Relay's reason for a 403; for a 422 only the status's title, as its detail may quote
the request), the key as actor and the target its path names. Not audited: reads (GET, HEAD),
requests without a valid key (401: no subject, and anyone could fill the table), and 404 (what the
path names does not exist, or the key may not list it: nothing was refused to the key that the
log could name).

Bounded per instance: at most :data:`MAX_REFUSALS_PER_MINUTE` entries per key and action a minute;
the others are counted into ``detail.suppressed`` of that key's next entry for the action. The
entry is written in a task of its own, which the answer does not wait for: a refusal is answered the same
whether or not its entry can be written (the database down: a line in the log). A clean stop waits for
the entries still being written, up to :data:`SETTLE_SECS` (:meth:`RefusalAudit.settled`).
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any

from starlette.requests import Request

from relay.api.context import ApiContext
from relay.auth import KeyGrant
from relay.core.window import CountedWindow
from relay.store.audit import AuditAction, AuditEntry
from relay_protocol import MAX_NAME_LEN, MAX_QUEUE_OR_SCHEDULE_NAME_BYTES, MAX_WORKFLOW_ID_BYTES, clean_text
from relay_protocol.limits import has_unstorable, utf8_length

log = logging.getLogger("relay.audit")

MAX_REFUSALS_PER_MINUTE = 10
# Entries written at once by one instance, whatever the number of keys: past it, refusals are
# counted into the next entry as the ones past the bound are.
MAX_PENDING = 64
# How long a clean stop waits for the entries still being written (a slow or locked table), before
# the pool they are written through closes.
SETTLE_SECS = 3.0
# (org, key id, action) budgets kept; the oldest is forgotten past it (keys are few).
MAX_BUDGETS = 10_000

_APP = "/v2/orgs/{org}/apps/{app}"
_WORKFLOW = f"{_APP}/workflows/{{workflow_id}}"
_SCHEDULE = f"{_APP}/schedules/{{schedule_name}}"
_TOKEN = "/v2/orgs/{org}/tokens/{token_name}"
# The audited changes, by method and route: the action their entry has when they are done.
AUDITED_ROUTES: dict[tuple[str, str], AuditAction] = {
    ("PUT", _APP): "application.create",
    ("DELETE", _APP): "application.delete",
    ("PATCH", _APP): "settings.updated",
    ("PATCH", f"{_APP}/versions/latest"): "application.set_latest_version",
    ("POST", f"{_APP}/executors/{{executor_id}}/recover"): "recovery.manual_requested",
    ("POST", f"{_APP}/workflows/import"): "workflow.import",
    ("POST", f"{_WORKFLOW}/cancel"): "workflow.cancel",
    ("POST", f"{_WORKFLOW}/resume"): "workflow.resume",
    ("POST", f"{_WORKFLOW}/fork"): "workflow.fork",
    ("DELETE", _WORKFLOW): "workflow.delete",
    ("POST", f"{_APP}/workflows/bulk-cancel"): "workflow.bulk_cancel",
    ("POST", f"{_APP}/workflows/bulk-resume"): "workflow.bulk_resume",
    ("POST", f"{_APP}/workflows/bulk-delete"): "workflow.bulk_delete",
    ("POST", f"{_APP}/workflows/bulk-fork-from-failure"): "workflow.bulk_fork_from_failure",
    ("POST", f"{_SCHEDULE}/pause"): "schedule.pause",
    ("POST", f"{_SCHEDULE}/resume"): "schedule.resume",
    ("POST", f"{_SCHEDULE}/trigger"): "schedule.trigger",
    ("POST", f"{_SCHEDULE}/backfill"): "schedule.backfill",
    ("POST", f"{_APP}/alerting-rules"): "alerting_rule.create",
    ("DELETE", f"{_APP}/alerting-rules/{{rule_id}}"): "alerting_rule.delete",
    ("POST", _TOKEN): "token.created",
    ("PATCH", _TOKEN): "token.renamed",
    ("DELETE", _TOKEN): "token.deleted",
}
REFUSALS = (403, 422)
# The path parameter that names an action's target, and the detail member it is audited under.
_TARGETS = {
    "workflow_id": "workflowIds",
    "schedule_name": "scheduleName",
    "rule_id": "ruleId",
    "token_name": "tokenName",
}

BudgetKey = tuple[str, str, str]
_AUDITED = "_relay_audited"


def mark_audited(exc: BaseException) -> None:
    """Say that ``exc``'s failure has its entry already (written by :func:`relay.api.common.audited`)."""
    setattr(exc, _AUDITED, True)


def was_audited(exc: BaseException) -> bool:
    return bool(getattr(exc, _AUDITED, False))


class RefusalBudget:
    """How many refusals of one key and action are written per window; sans I/O (``now`` given)."""

    def __init__(self, limit: int = MAX_REFUSALS_PER_MINUTE, window: float = 60.0, size: int = MAX_BUDGETS) -> None:
        self._window: CountedWindow[BudgetKey] = CountedWindow(limit, window, size)

    def admit(self, key: BudgetKey, now: float) -> int | None:
        """None if this refusal is not written (counted instead); else the number suppressed before
        it, which its entry carries."""
        passed = self._window.admit(key, now)
        return None if passed is None else passed.held

    def suppress(self, key: BudgetKey, count: int) -> None:
        """Count ``count`` refusals that were admitted but not written into the key's next entry."""
        self._window.hold(key, count)


class RefusalAudit:
    """Writes the entries of refused attempts, off the requests' path (see the module)."""

    def __init__(self, budget: RefusalBudget | None = None) -> None:
        self.budget = budget or RefusalBudget()
        self._pending: set[asyncio.Task[None]] = set()

    def refused(self, request: Request, status: int, code: str, message: str) -> None:
        """Note a refusal the API is answering with ``status``; audits it if it is one (see the module).
        Never raises: the answer is the same whatever happens to its entry."""
        try:
            self._refused(request, status, code, message)
        except Exception:
            log.exception("could not audit a refused %s %s", request.method, request.url.path)

    def _refused(self, request: Request, status: int, code: str, message: str) -> None:
        if status not in REFUSALS or request.method in ("GET", "HEAD"):
            return
        route = request.scope.get("route")
        action = AUDITED_ROUTES.get((request.method, getattr(route, "path", "")))
        ctx: ApiContext | None = request.app.state.context
        if action is None or ctx is None:
            return
        grant = _grant(request, ctx)
        if grant is None:
            return  # 401: no subject to name
        key = (grant.org, grant.key_id, action)
        loop = asyncio.get_running_loop()
        if len(self._pending) >= MAX_PENDING:
            suppressed = self.budget.admit(key, loop.time())
            if suppressed is not None:
                self.budget.suppress(key, suppressed + 1)
            return
        suppressed = self.budget.admit(key, loop.time())
        if suppressed is None:
            return
        org, app, entry = _entry(request, grant, action, status, code, message, suppressed)
        task = asyncio.create_task(self._write(ctx, org, app, entry))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def settled(self, timeout: float = SETTLE_SECS) -> None:
        """Wait, at most ``timeout`` seconds, for the entries being written (a stop's first step); the
        ones still unwritten then are said so in the log, and lost."""
        if not self._pending:
            return
        _, late = await asyncio.wait(list(self._pending), timeout=timeout)
        if late:
            log.warning("%d refused attempts not audited: their entries were not written within %g s of the stop",
                        len(late), timeout)  # fmt: skip

    async def _write(self, ctx: ApiContext, org: str, app: str | None, entry: AuditEntry) -> None:
        try:
            await ctx.audit.write(org, app, entry)
        except Exception as exc:  # the refusal was answered; the entry is lost, and said so here
            log.warning("could not audit a refused %s by %s: %s", entry.action, entry.actor, exc)


def _grant(request: Request, ctx: ApiContext) -> KeyGrant | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return ctx.keyring.lookup(token.strip()) if scheme.lower() == "bearer" else None


def _entry(
    request: Request, grant: KeyGrant, action: AuditAction, status: int, code: str, message: str, suppressed: int
) -> tuple[str, str | None, AuditEntry]:
    # What the path names, as far as it is a name Relay could store (a refused path may be anything).
    params = {k: v for k, v in request.path_params.items() if isinstance(v, str) and _storable(k, v)}
    # A 422's detail may quote the request (a value, a member's name): only its title is kept.
    reason = clean_text(message, 500) if status == 403 else HTTPStatus(status).phrase
    detail: dict[str, Any] = {"result": "failure", "status": status, "code": code, "error": reason}
    for name, member in _TARGETS.items():
        value = params.get(name)
        if value is not None:
            detail[member] = [value] if member == "workflowIds" else value
    if suppressed:
        detail["suppressed"] = suppressed
    org, app = request.path_params.get("org"), params.get("app")
    if org != grant.org:
        # Another org's key: the attempt is its own org's to see (the other org learns no key names).
        detail["org"] = params.get("org")
        return grant.org, None, AuditEntry(action, f"api:{grant.name}", detail=detail)
    if "executor_id" in params:
        # In the detail, not as the entry's executor: an entry about an executor defers the
        # reconciler's look at it (ExecutorStore.stranded), which a refused key must not do.
        detail["executorId"] = params["executor_id"]
    return org, app, AuditEntry(action, f"api:{grant.name}", detail=detail)


# The path parameters the protocol bounds in bytes, and their bounds; every other name is bounded at
# MAX_NAME_LEN characters.
_BYTES_BOUNDS = {
    "workflow_id": MAX_WORKFLOW_ID_BYTES,
    "schedule_name": MAX_QUEUE_OR_SCHEDULE_NAME_BYTES,
}


def _storable(parameter: str, name: str) -> bool:
    bound = _BYTES_BOUNDS.get(parameter)
    fits = len(name) <= MAX_NAME_LEN if bound is None else utf8_length(name) <= bound
    return fits and not has_unstorable(name)
