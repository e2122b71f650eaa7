"""Grace periods that begin together are started in one transaction (issue 15).

A disconnection's grace period is its own durable DBOS workflow
(:func:`workflows.grace.grace_period`). Started one by one, each paid for its own
transaction and commit, and then at once for its first steps (DBOS's ``recv`` and
its durable deadline), all on the loop that absorbs the closes: a thousand
sockets closing at once had their grace periods durable only after 6 to 9 s.

Here they are enqueued on the instance's own DBOS queue (:func:`grace_queue`)
as DBOS's ``DBOSClient.enqueue_in_transaction`` writes them: every start waiting when a
transaction begins (up to ``max_batch``) goes in that one transaction, all of its rows in
one statement and their inputs in another (:func:`_enqueue_together`). Once it
commits, each grace period exists as a DBOS workflow (ENQUEUED or DELAYED): a crash of
Relay from then on loses none of them. Each instance listens to its own queue
only (``DBOS.listen_queues``), so the instance that owns the executor's
connection runs its timer, as before; its deadline is counted from the
disconnection (``lost_at``), so the time it waits in the queue (about
:data:`GRACE_QUEUE_POLL_SECS`) does not lengthen it. The grace periods of a burst
(:data:`BURST_ROWS` or more in one transaction) wait :data:`BURST_DELAY_SECS` more
(DBOS's DELAYED state), so that the rest of the burst is durable before their first
steps compete with it for the interpreter. A grace period shorter than
:data:`START_AT_ONCE_BELOW_SECS` is started at once instead, without the queue
(``DBOS.start_workflow_async``; those of a burst together), so that its deadline
cannot pass in the queue.

An instance that dies leaves its queue with no listener. The adopter's repair
sweep moves the grace periods of the executors it adopted onto its own queue
(:meth:`workflows.engine.Engine.repair`), after DBOS's recovery has put the dead
instance's running ones back on that queue.

What stays per grace period:

- Its id (:func:`relay.core.ids.grace_id`): enqueuing one that exists returns
  the existing row unchanged (DBOS's insert is ``ON CONFLICT DO UPDATE`` of
  nothing), so a retry, the repair sweep and two instances at once start it once.
- Its failure. When a row makes a batch's transaction fail, each of the batch's
  starts is tried alone (when the database is unreachable, they wait together); a
  short one started at once fails alone.
  The ones that failed stay pending and are tried again after a backoff (0.2 s
  doubling to 5 s), as an executor event always was, behind any newer starts. A
  bad row never fails the others, nor holds up the next burst.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from dbos import DBOS, DBOSClient, EnqueueOptions, SetWorkflowID
from dbos._error import DBOSConflictingWorkflowError
from dbos._schemas.system_database import SystemSchema
from dbos._sys_db import WorkflowStatusInternal
from dbos._utils import generate_uuid

from relay.core.ids import ExecutorKey, grace_id
from relay.errors import DatabaseError
from relay.store.db import CONNECT_TIMEOUT_SECS, with_tcp_settings
from workflows.dburl import sqlalchemy_url
from workflows.grace import grace_period, remaining
from workflows.services import RETRY_FIRST_SECS, RETRY_MAX_SECS, WORKFLOWS_VERSION

log = logging.getLogger("relay.durable")

# How often each instance's DBOS queue worker looks for grace periods to run. A grace period
# waits at most this long before its first step; its deadline does not move.
GRACE_QUEUE_POLL_SECS = 1.0
# A grace period shorter than this starts at once, alone, and runs without waiting for the queue:
# its deadline could pass before the queue's worker took it.
START_AT_ONCE_BELOW_SECS = 2 * GRACE_QUEUE_POLL_SECS
# A burst's grace periods (a transaction of at least BURST_ROWS) wait BURST_DELAY_SECS more in
# DBOS's DELAYED state before the queue's worker may take them, so that the burst is durable
# before its first grace periods run their first steps: started at once, those steps held the
# interpreter three times as long as the enqueue of the rest (py-spy during 1,000 closes), and
# the last of 1,000 closes became durable 1.6 to 5.5 s after them; now 1.0 to 1.7 s.
# Their deadlines do not move (counted from the disconnection), and one with too little of its
# grace left to wait that long as well is not delayed: DBOS moves a DELAYED row to ENQUEUED in
# its queue manager's loop (every DELAYED_CHECK_SECS), and the queue's worker takes it at its
# next poll.
BURST_ROWS = 32
BURST_DELAY_SECS = 2.0
DELAYED_CHECK_SECS = 1.0  # DBOS 3.2's queue manager
DELAY_ONLY_WITH_SECS_LEFT = START_AT_ONCE_BELOW_SECS + BURST_DELAY_SECS + DELAYED_CHECK_SECS
GRACE_QUEUE_PREFIX = "relay.grace:"
GRACE_WORKFLOW = "relay.grace_period"


def grace_queue(instance_id: str) -> str:
    """The DBOS queue of the grace periods that ``instance_id`` runs."""
    return GRACE_QUEUE_PREFIX + instance_id


def is_grace_queue(queue: str | None) -> bool:
    return queue is not None and queue.startswith(GRACE_QUEUE_PREFIX)


def declare_queue(instance_id: str) -> None:
    """Listen to this instance's queue only: call it before ``DBOS.launch()``."""
    DBOS.listen_queues([grace_queue(instance_id)])


def register_queue(instance_id: str) -> None:
    """Record this instance's queue (blocking: once DBOS has launched). DBOS's queue manager starts
    its worker within a second; what is enqueued before then waits for it."""
    DBOS.register_queue(grace_queue(instance_id), polling_interval_sec=GRACE_QUEUE_POLL_SECS)


@dataclass
class _Start:
    key: ExecutorKey
    epoch: int
    lost_at: float | None
    failed: bool = False  # its last attempt failed: it waits for the backoff
    # Callers awaiting the next attempt's outcome (None: committed).
    waiters: list[asyncio.Future[None]] = field(default_factory=list)


TimeoutOf = Callable[[str, str], Awaitable[float]]
# A grace period to start: its workflow id, its length and the workflow's arguments.
_Row = tuple[str, float, tuple[Any, ...]]
# The database (or the way to it) failed, not a row.
_CONNECTION_ERRORS = (sa.exc.OperationalError, sa.exc.InterfaceError)


class GraceStarter:
    def __init__(self, database_url: str, queue: str, timeout_of: TimeoutOf, *, max_batch: int = 500) -> None:
        self._url = sqlalchemy_url(with_tcp_settings(database_url))
        self.queue = queue
        self._timeout_of = timeout_of
        self.max_batch = max_batch
        self._engine: sa.Engine | None = None
        self._client: DBOSClient | None = None
        # A thread of its own: in the default executor, a transaction would wait behind the DBOS
        # calls of the grace periods already running (hundreds, after a burst).
        self._thread: ThreadPoolExecutor | None = None
        self._pending: dict[str, _Start] = {}  # by workflow id, in arrival order
        self._draining: asyncio.Task[None] | None = None
        # For the benchmarks and the tests: transactions committed and the grace periods they carried.
        self.batches = 0
        self.started = 0

    @property
    def waiting(self) -> list[str]:
        """The grace periods not started yet (new, or failed and waiting for their next try)."""
        return list(self._pending)

    def open(self) -> None:
        """Connect (blocking: call it from a thread)."""
        self._engine = sa.create_engine(
            self._url,
            pool_size=2,
            max_overflow=2,
            pool_pre_ping=False,  # as DBOS's engine: a stale connection fails once and the batch is retried
            connect_args={"connect_timeout": CONNECT_TIMEOUT_SECS},
        )
        self._client = DBOSClient(system_database_engine=self._engine)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-grace-start")

    async def close(self) -> None:
        """Stop starting. Starts not yet committed are left to the repair sweep (the executor
        is DISCONNECTED with no grace period), as a crash would leave them."""
        if self._draining is not None:
            self._draining.cancel()
            await asyncio.gather(self._draining, return_exceptions=True)
            self._draining = None
        for start in self._pending.values():
            _settle(start.waiters, RuntimeError("Relay is stopping: the grace period was not started"))
        self._pending.clear()
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None
        if self._client is not None:
            await asyncio.to_thread(self._client.destroy)
            self._client = None
        if self._engine is not None:
            await asyncio.to_thread(self._engine.dispose)
            self._engine = None

    def add(self, key: ExecutorKey, epoch: int, lost_at: float | None) -> str:
        """Start ``key``'s grace period for ``epoch`` soon, retried until it is; returns its id."""
        workflow_id = grace_id(key, epoch)
        if workflow_id not in self._pending:
            self._pending[workflow_id] = _Start(key, epoch, lost_at)
        if self._draining is None:
            self._draining = asyncio.get_running_loop().create_task(self._drain())
        return workflow_id

    async def start(self, key: ExecutorKey, epoch: int, lost_at: float | None = None) -> None:
        """Start it, and return once its transaction has committed; raise the error of the
        attempt that failed (it is still tried again)."""
        await self.attempted(self.add(key, epoch, lost_at), raise_error=True)

    async def attempted(self, workflow_id: str, *, raise_error: bool = False) -> None:
        """Wait until a pending start of ``workflow_id``, if any, has been tried once."""
        start = self._pending.get(workflow_id)
        if start is None:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        start.waiters.append(waiter)
        try:
            await waiter
        except Exception:
            if raise_error:
                raise

    async def _drain(self) -> None:
        """New starts go first, together; the ones that failed are tried again after a backoff, so
        that a bad row does not hold up the next burst."""
        delay = RETRY_FIRST_SECS
        try:
            while self._pending:
                if fresh := self._fresh():
                    failed = await self._attempt(fresh)
                else:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_SECS)
                    if self._fresh():
                        continue  # what arrived meanwhile goes first
                    failed = await self._attempt(list(self._pending)[: self.max_batch])
                    if not failed:
                        delay = RETRY_FIRST_SECS
                if failed:
                    log.warning("%d grace period(s) could not be started (%s); trying again",
                                len(failed), next(iter(failed.values())))  # fmt: skip
        finally:
            self._draining = None

    def _fresh(self) -> list[str]:
        return [i for i, start in self._pending.items() if not start.failed][: self.max_batch]

    async def _attempt(self, ids: list[str]) -> dict[str, BaseException]:
        """Start these: the queued ones in one transaction (or each alone when one of them made it
        fail), the short ones each at once; returns the failures."""
        starts = {i: self._pending[i] for i in ids}
        try:
            rows = await self._rows(starts)  # once: trying each alone reads no setting again
        except Exception as exc:
            failed: dict[str, BaseException] = dict.fromkeys(starts, exc)
        else:
            queued = [row for row in rows if row[1] >= START_AT_ONCE_BELOW_SECS]
            failed = await self._enqueue_together(queued) if queued else {}
            failed |= await self._start_at_once([row for row in rows if row[1] < START_AT_ONCE_BELOW_SECS])
            self.started += len(rows) - len(failed)
        for workflow_id, start in starts.items():
            if workflow_id in failed:
                start.failed = True
            else:
                del self._pending[workflow_id]
            waiters, start.waiters = start.waiters, []
            _settle(waiters, _as_database_error(failed[workflow_id]) if workflow_id in failed else None)
        return failed

    async def _enqueue_together(self, rows: list[_Row]) -> dict[str, BaseException]:
        """Enqueue these in one transaction, or each alone when one of them made it fail; returns
        the failures."""
        try:
            await self._enqueue_in_thread(rows)
            return {}
        except Exception as exc:
            if len(rows) == 1 or _unreachable(exc):
                return {row[0]: exc for row in rows}
        failed: dict[str, BaseException] = {}
        for row in rows:
            try:
                await self._enqueue_in_thread([row])
            except Exception as alone:
                failed[row[0]] = alone
        return failed

    async def _enqueue_in_thread(self, rows: list[_Row]) -> None:
        burst = len(rows) >= BURST_ROWS
        await asyncio.get_running_loop().run_in_executor(
            self._thread,
            self._enqueue,
            # args[5] is the disconnection's time (lost_at), as _rows puts it.
            [(workflow_id, args, _delay(burst, timeout, args[5])) for workflow_id, timeout, args in rows],
        )
        self.batches += 1

    async def _start_at_once(self, rows: list[_Row]) -> dict[str, BaseException]:
        """Start each one now, all of them together: one after another, a thousand took half a
        minute, the last grace periods starting (and ending) that late."""

        async def start(workflow_id: str, args: tuple[Any, ...]) -> None:
            with SetWorkflowID(workflow_id):
                await DBOS.start_workflow_async(grace_period, *args)

        outcomes = await asyncio.gather(*(start(w, args) for w, _, args in rows), return_exceptions=True)
        return {row[0]: o for row, o in zip(rows, outcomes, strict=True) if isinstance(o, BaseException)}

    async def _rows(self, starts: dict[str, _Start]) -> list[_Row]:
        """Each start's workflow id, length (the app's setting now) and arguments."""
        timeouts: dict[tuple[str, str], float] = {}
        rows = []
        for workflow_id, s in starts.items():
            app = (s.key.org, s.key.app)
            if app not in timeouts:
                timeouts[app] = await self._timeout_of(*app)
            timeout = timeouts[app]
            rows.append((workflow_id, timeout, (s.key.org, s.key.app, s.key.executor_id, s.epoch, timeout, s.lost_at)))
        return rows

    def _enqueue(self, rows: list[tuple[str, tuple[Any, ...], float | None]]) -> None:
        assert self._engine is not None and self._client is not None, "GraceStarter.open() first"
        starts = []
        for workflow_id, args, delay in rows:
            options: EnqueueOptions = {
                "queue_name": self.queue,
                "workflow_name": GRACE_WORKFLOW,
                "workflow_id": workflow_id,
                "app_version": WORKFLOWS_VERSION,
            }
            if delay is not None:
                options["delay_seconds"] = delay
            starts.append((options, args))
        for attempt in (1, 2):
            try:
                with self._engine.begin() as conn:
                    if len(starts) == 1:  # DBOS's own path: the one that names a refused row's error
                        options, args = starts[0]
                        self._client.enqueue_in_transaction(conn, options, *args)
                    else:
                        _enqueue_together(self._client, conn, starts)
                return
            except sa.exc.DBAPIError as exc:
                # A pooled connection that the database closed (it restarted since): SQLAlchemy
                # has replaced the pool, so a second try gets a new connection.
                if attempt == 2 or not exc.connection_invalidated:
                    raise


def _enqueue_together(
    client: DBOSClient, conn: sa.Connection, starts: list[tuple[EnqueueOptions, tuple[Any, ...]]]
) -> None:
    """What ``client.enqueue_in_transaction`` writes for each start (DBOS 3.2's
    ``SystemDatabase._insert_workflow_status``: its status row, or the existing row unchanged, then
    its inputs), in two statements for them all: one per row made 5,000 closes a round trip each,
    twice, and under load the enqueue of a burst took 19 to 26 s. Each row is DBOS's own, built by
    its client (serialized inputs, delay, creator token). A row that DBOS would refuse (a workflow of
    that id with another function) raises, and the caller tries each start alone, DBOS's way."""
    sys_db = client._sys_db
    built = [client._build_enqueue_status(options, *args) for options, args in starts]
    status_rows = [_status_row(status) for _, status in built]
    sys_db._apply_caller_schema(conn)
    table = SystemSchema.workflow_status
    insert = (
        sys_db.dialect.insert(table)
        .on_conflict_do_update(index_elements=["workflow_uuid"], set_={"creator_xid": table.c.creator_xid})
        .returning(table.c.workflow_uuid, table.c.name, table.c.class_name, table.c.config_name)
    )
    expected = {status["workflow_uuid"]: status for _, status in built}
    for found in conn.execute(insert, status_rows):
        status = expected[found.workflow_uuid]
        if (found.name, found.class_name, found.config_name) != (
            status["name"],
            status["class_name"],
            status["config_name"],
        ):
            raise DBOSConflictingWorkflowError(found.workflow_uuid, f"it exists as {found.name}, not {status['name']}")
    inputs = sys_db.dialect.insert(SystemSchema.workflow_input).on_conflict_do_nothing(index_elements=["workflow_uuid"])
    conn.execute(
        inputs, [{"workflow_uuid": status["workflow_uuid"], "inputs": status["inputs"]} for _, status in built]
    )


def _status_row(status: WorkflowStatusInternal) -> dict[str, Any]:
    """A workflow's ``workflow_status`` row, as DBOS 3.2 writes it."""
    queued = status["status"] in ("ENQUEUED", "DELAYED")  # not taken yet: no owner, no attempt
    creator_xid = generate_uuid()
    return {
        "workflow_uuid": status["workflow_uuid"],
        "status": status["status"],
        "name": status["name"],
        "class_name": status["class_name"],
        "config_name": status["config_name"],
        "executor_id": status["executor_id"],
        "application_version": status["app_version"],
        "application_id": status["app_id"],
        "authenticated_user": status["authenticated_user"],
        "authenticated_roles": status["authenticated_roles"],
        "assumed_role": status["assumed_role"],
        "queue_name": status["queue_name"],
        "recovery_attempts": 0 if queued else 1,
        "workflow_timeout_ms": status["workflow_timeout_ms"],
        "workflow_deadline_epoch_ms": status["workflow_deadline_epoch_ms"],
        "deduplication_id": status["deduplication_id"],
        "priority": status["priority"],
        "serialization": status["serialization"],
        "queue_partition_key": status["queue_partition_key"],
        "parent_workflow_id": status["parent_workflow_id"],
        "creator_xid": creator_xid,
        "owner_xid": None if queued else creator_xid,
        "delay_until_epoch_ms": status["delay_until_epoch_ms"],
        "attributes": status["attributes"],
        "schedule_name": status["schedule_name"],
        "debounce_deadline_epoch_ms": status["debounce_deadline_epoch_ms"],
        "is_debounced": status["is_debounced"],
        "application_name": status["application_name"],
    }


def _unreachable(exc: BaseException) -> bool:
    """The database, not a row, failed the transaction: trying each row alone would only wait
    for it once per row."""
    return isinstance(exc, (*_CONNECTION_ERRORS, DatabaseError))


def _as_database_error(exc: BaseException) -> BaseException:
    """What a caller is told: the database's trouble as Relay's :class:`DatabaseError` (the repair
    sweep tries again at its next round), anything else as it is."""
    if isinstance(exc, _CONNECTION_ERRORS):
        error = DatabaseError(f"database error: {exc.orig or exc}")
        error.__cause__ = exc
        return error
    return exc


def _delay(burst: bool, timeout: float, lost_at: float | None) -> float | None:
    """How long a grace period waits DELAYED before its queue may run it (None: not at all)."""
    return BURST_DELAY_SECS if burst and remaining(timeout, lost_at) >= DELAY_ONLY_WITH_SECS_LEFT else None


def _settle(waiters: list[asyncio.Future[None]], error: BaseException | None) -> None:
    for waiter in waiters:
        if waiter.done():
            continue
        if error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(error)
