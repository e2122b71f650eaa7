"""What Relay's workflows reach outside DBOS: the running Relay's hub and database.

The workflows are coroutines: thousands of grace periods cost thousands of
tasks, not threads. The hub's sockets and the database pool belong to Relay's
event loop; :meth:`Services.call` awaits a coroutine there, whichever loop the
workflow itself runs on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from dbos import DBOS

from relay.errors import DatabaseError

if TYPE_CHECKING:
    from relay.runtime import Runtime

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

# Every Relay instance must register its workflows under the same application
# version, or one instance could not recover another's. Change it only when a
# workflow changes in a way that cannot replay an older run's history.
WORKFLOWS_VERSION = "relay-workflows-1"


class Services:
    def __init__(self, runtime: Runtime, loop: asyncio.AbstractEventLoop) -> None:
        self.runtime = runtime
        self.loop = loop

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on Relay's loop, from whichever loop DBOS runs the workflow on
        (Relay's own when Relay started it; DBOS's background loop when it recovered it)."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))


_bound: Services | None = None


def bind(services: Services | None) -> None:
    global _bound
    _bound = services


def services() -> Services:
    if _bound is None:
        raise RuntimeError("Relay's workflows run only inside a started Relay")
    return _bound


def _database_trouble(exc: BaseException) -> bool:
    return isinstance(exc, DatabaseError)


def relay_step(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A DBOS step that outlives a database outage of up to about an hour.

    Without retries, one failed query would end the workflow in ERROR and
    strand its executor; requests to executors report failure as values
    instead, so only database trouble is retried here.
    """
    return DBOS.step(
        name=name,
        retries_allowed=True,
        interval_seconds=0.5,
        backoff_rate=1.5,
        max_attempts=20,
        should_retry=_database_trouble,
    )
