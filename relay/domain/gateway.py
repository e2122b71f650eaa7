"""Requests about an app's workflows, served by the app's healthy executors (Conductor's model).

Relay keeps no copy of an application's workflows: each request goes over
the WebSocket of a healthy executor of the app, through whichever instance
holds its socket (:class:`relay.net.router.Router`), and the reply comes back.
Executors are taken in turn, so requests spread over them. A read, and a
change that is safe to repeat (cancel, resume, delete...), moves on to the
next executor when one does not answer within the per-executor timeout; the
whole request ends by a deadline that Conductor's clients wait for (they give
up at 30 s). A change that is not safe to repeat (an import) is tried once.
Any request moves on from an executor whose SDK does not know the message
(it did nothing); it is a 501 only if none of those asked knows it. A read or
a repeatable change moves on from an executor whose SDK cannot read a value
another language's SDK stored (an app with Python and TypeScript executors:
``Serialization js_superjson is not available``); if none can, the last such
reply is the answer.

Which executors serve an app is read from the registry at most once per
:attr:`GatewayLimits.serving_ttl_secs` for requests that may move on (a
read, a repeatable change): one that left since is skipped like one that
does not answer, and the list is read again after any executor failed. A
request that is tried once reads the registry first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from relay.core.ids import ExecutorKey
from relay.errors import (
    DatabaseError,
    ExecutorBadReply,
    ExecutorRequestError,
    NoAnswer,
    NoHealthyExecutor,
    NoSuchApp,
    RequestLost,
    RequestNotServed,
    TooManyRequests,
    UnsendableRequest,
    UnsupportedMessage,
)
from relay.net.router import Router
from relay.store.executors import ExecutorStore
from relay_protocol import ProtocolError as WireError
from relay_protocol import Reply, Request

log = logging.getLogger("relay.gateway")
# How often an app's executors held on a lapsed lease are warned of.
LAPSE_WARNING_SECS = 60.0
R = TypeVar("R", bound=Reply)
# How the Python SDK (``Serialization js_superjson is not available``) and the TypeScript SDK (``Value
# deserialization type py_pickle is not available``) say that a value was stored by another language's.
_UNREADABLE = re.compile(r"(Serialization|deserialization type) \S+ is not available")


def unreadable(reply: Reply) -> bool:
    """Whether the executor failed because its SDK cannot read a value another language's SDK wrote."""
    return bool(reply.error_message and _UNREADABLE.search(reply.error_message))


@dataclass(frozen=True)
class GatewayLimits:
    per_executor_secs: float = 5.0
    deadline_secs: float = 25.0
    in_flight_per_app: int = 32
    serving_ttl_secs: float = 1.0


class ExecutorGateway:
    def __init__(self, executors: ExecutorStore, router: Router, limits: GatewayLimits) -> None:
        self.executors = executors
        self.router = router
        self.limits = limits
        self._turns = itertools.count()
        self._in_flight: dict[tuple[str, str], int] = {}
        self._lapse_warned: dict[tuple[str, str], float] = {}  # (org, app) -> loop time of the last warning

    async def ask(
        self,
        org: str,
        app: str,
        make: Callable[[], Request],
        expected: type[R],
        *,
        repeatable: bool = True,
        timeout: float | None = None,
    ) -> R:
        """The reply of one healthy executor of the app to the request ``make()`` builds (a new
        request id per executor tried). Raises :class:`NoHealthyExecutor` (the API's 503),
        :class:`NoAnswer` (502), :class:`RequestNotServed` (502: every executor tried is on an
        instance that could not serve the request, so none was asked), :class:`UnsupportedMessage`
        (501), :class:`TooManyRequests` (429), :class:`UnsendableRequest` (422) before any executor
        is asked."""
        try:
            make().to_frame()
        except WireError as exc:
            raise UnsendableRequest(str(exc)) from exc
        slot = (org, app)
        if self._in_flight.get(slot, 0) >= self.limits.in_flight_per_app:
            raise TooManyRequests(f"app {app!r} has {self.limits.in_flight_per_app} requests in flight already")
        self._in_flight[slot] = self._in_flight.get(slot, 0) + 1
        try:
            return await self._ask(org, app, make, expected, repeatable, timeout or self.limits.per_executor_secs)
        finally:
            self._in_flight[slot] -= 1
            if not self._in_flight[slot]:
                del self._in_flight[slot]

    async def _ask(
        self, org: str, app: str, make: Callable[[], Request], expected: type[R], repeatable: bool, per: float
    ) -> R:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.deadline_secs
        problems: list[str] = []
        unserved = 0  # of the problems, those where the instance holding the socket could not serve
        unsupported: list[UnsupportedMessage] = []  # executors whose SDK does not know the message
        tried: set[str] = set()
        foreign: R | None = None  # a reply "cannot read that value": another executor may
        healthy, cached = await self._healthy(org, app, fresh=not repeatable)
        while True:
            if not healthy:
                raise NoHealthyExecutor(await self._none_healthy(org, app))
            start = next(self._turns) % max(len(healthy), 1)
            order = [e for e in healthy[start:] + healthy[:start] if e[0] not in tried]
            for executor_id, owner in order:
                left = deadline - loop.time()
                if left <= 0 or (not repeatable and len(tried) > len(unsupported)):
                    break
                tried.add(executor_id)
                key = ExecutorKey(org, app, executor_id)
                try:
                    reply = await self.router.ask(key, make(), expected, min(per, left), owner=owner)
                    if not (repeatable and unreadable(reply)):
                        return reply
                    foreign = reply  # another language's executor of the app may read it
                    continue
                except UnsupportedMessage as exc:
                    # Its SDK lacks the message (an app moving from dbos 3.2 to relay_client runs
                    # both): it did nothing, so another executor is asked, even for a request that
                    # is tried once. The executor is healthy all the same.
                    unsupported.append(exc)
                    problems.append(str(exc))
                    continue
                except ExecutorBadReply as exc:
                    problems.append(str(exc))
                    log.warning("app %s: %s", app, exc)
                except ExecutorRequestError as exc:
                    problems.append(str(exc))
                    # Lost: the instance took it and died; the executor may have had it.
                    unserved += isinstance(exc, RequestNotServed) and not isinstance(exc, RequestLost)
                self.executors.forget_healthy(org, app)
            if not cached or deadline <= loop.time():
                break
            # The list was read a moment ago and none of it answered: read the registry again.
            healthy, cached = await self._healthy(org, app, fresh=True)
        if foreign is not None:  # no executor asked could read it: the SDK's words are the answer
            return foreign
        if unsupported and len(unsupported) == len(problems):  # none of those asked knows the message
            raise unsupported[0]
        if problems and unserved == len(problems):  # no executor was asked: none failed to answer
            raise RequestNotServed(f"no executor of app {app!r} could be asked: " + "; ".join(problems[:3]))
        raise NoAnswer(f"no executor of app {app!r} answered: " + "; ".join(problems[:3]))

    async def _none_healthy(self, org: str, app: str) -> str:
        """The 503's detail: that the app has no healthy executor, and what the registry says of its
        executors (:class:`NoSuchApp`, a 404, if Relay knows no such app). An executor HEALTHY on an
        instance whose lease ran out is a warning as well: the app is not served though its
        executors may be connected."""
        plain = f"app {app!r} has no healthy executor connected"
        try:
            why = await self.executors.why_none_serving(org, app)
        except DatabaseError:
            return plain  # the registry was read a moment ago; what it holds is only a detail
        if why is None:
            raise NoSuchApp(f"no app {app!r} in org {org!r}")
        if why.startswith("HEALTHY"):
            # Once a minute per app: a console polling it, or the alert rounds, would repeat it.
            now = asyncio.get_running_loop().time()
            if now - self._lapse_warned.get((org, app), -LAPSE_WARNING_SECS) >= LAPSE_WARNING_SECS:
                self._lapse_warned[(org, app)] = now
                log.warning("app %s/%s not served: its executors are %s", org, app, why)
        return f"{plain} ({why})"

    async def _healthy(self, org: str, app: str, fresh: bool) -> tuple[list[tuple[str, str]], bool]:
        """The app's serving executors, and whether they are a read shared from less than the TTL
        ago (:meth:`ExecutorStore.serving`; ``fresh``: read the registry whatever the age). An empty
        shared list is read again: an executor may have connected since."""
        healthy, shared = await self.executors.serving(org, app, 0.0 if fresh else self.limits.serving_ttl_secs)
        if shared and not healthy:
            healthy, shared = await self.executors.serving(org, app)
        return healthy, shared
