"""``retention``: garbage collection and a global timeout by cut-offs, in the background.

As the SDK did, the request is answered ``success: true`` at once and the round
runs on a thread of its own; a request that arrives while a round is still
running is skipped, and what goes wrong is only logged.

Built on public listings: the collection deletes terminal workflows (of every
application, as dbos 3.2's did) whose ``completed_at`` is before the cut-off,
``gc_batch_size`` at a time; with ``gc_rows_threshold`` the cut-off moves up to the
completion time of the threshold-th newest completed workflow, whichever
deletes more. The timeout cancels this application's PENDING, ENQUEUED and
DELAYED workflows created at or before its cut-off. Unlike 3.2 there is no
database-wide lock across executors: Relay sends a round to one executor, and
deleting or cancelling twice is harmless.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable

from dbos import DBOS

from relay_client.errors import LOGGER_NAME
from relay_client.times import iso_ms
from relay_protocol import RetentionBody

log = logging.getLogger(LOGGER_NAME)

DEFAULT_GC_BATCH_SIZE = 50_000
IN_FLIGHT = ["PENDING", "ENQUEUED", "DELAYED"]
# Listed a page at a time: the batch may be large.
PAGE = 1000


class Retention:
    """Runs one round at a time on a daemon thread; ``stopping`` ends a round between batches."""

    def __init__(self, stopping: Callable[[], bool] = lambda: False) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = stopping

    def start(self, body: RetentionBody) -> bool:
        """Start a round; False (and nothing started) if the previous one is still running."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                log.warning("Skipping retention: the previous round on this executor is still running.")
                return False
            self._thread = threading.Thread(
                target=self._round, args=(body,), name="relay-client-retention", daemon=True
            )
            self._thread.start()
            return True

    def join(self, timeout: float) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _round(self, body: RetentionBody) -> None:
        try:
            collect(body, self._stopping)
            if body.timeout_cutoff_epoch_ms is not None and not self._stopping():
                time_out(body.timeout_cutoff_epoch_ms)
        except Exception:
            if self._stopping():
                # Shutdown took DBOS away in the middle of a batch (its join is bounded); the next
                # round does the rest. dbos 3.2 logged the same at DEBUG.
                log.debug("Retention interrupted by shutdown", exc_info=True)
                return
            log.exception("Exception encountered during enforcing retention policy")


def gc_cutoff(cutoff_ms: int | None, rows_threshold: int | None) -> int | None:
    """The completion time below which terminal workflows go (None: collect nothing)."""
    if rows_threshold is not None and rows_threshold > 0:
        newest: list[int] = []  # a min-heap of the rows_threshold newest completion times
        offset = 0
        while True:
            page = DBOS.list_workflows(
                completed_after=iso_ms(0), application_name=[], limit=PAGE, offset=offset,
                load_input=False, load_output=False,
            )  # fmt: skip
            offset += len(page)
            for w in page:
                if w.completed_at is None:
                    continue
                if len(newest) < rows_threshold:
                    heapq.heappush(newest, w.completed_at)
                elif w.completed_at > newest[0]:
                    heapq.heapreplace(newest, w.completed_at)
            if len(page) < PAGE:
                break
        if len(newest) == rows_threshold and (cutoff_ms is None or newest[0] > cutoff_ms):
            cutoff_ms = newest[0]
    return cutoff_ms


def collect(body: RetentionBody, stopping: Callable[[], bool] = lambda: False) -> int:
    """Delete terminal workflows completed before the cut-off, a batch at a time; how many."""
    cutoff = gc_cutoff(body.gc_cutoff_epoch_ms, body.gc_rows_threshold)
    if cutoff is None:
        return 0
    batch = body.gc_batch_size or DEFAULT_GC_BATCH_SIZE
    deleted = 0
    while not stopping():
        ids: list[str] = []
        while len(ids) < batch:
            # completed_before is inclusive, the cut-off is not.
            want = min(PAGE, batch - len(ids))
            page = DBOS.list_workflows(
                completed_before=iso_ms(cutoff - 1), application_name=[], limit=want, offset=len(ids),
                load_input=False, load_output=False,
            )  # fmt: skip
            ids += [w.workflow_id for w in page]
            if len(page) < want:
                break
        if ids:
            DBOS.delete_workflows(ids)
            deleted += len(ids)
        if len(ids) < batch:
            break
    return deleted


def time_out(cutoff_ms: int) -> int:
    """Cancel this application's in-flight workflows created at or before the cut-off; how many."""
    ids = [
        w.workflow_id
        for w in DBOS.list_workflows(status=IN_FLIGHT, end_time=iso_ms(cutoff_ms), load_input=False, load_output=False)
    ]
    if ids:
        DBOS.cancel_workflows(ids)
    return len(ids)
