"""Requests about an app's workflows, served by the app's healthy executors (Conductor's model).

Relay keeps no copy of an application's workflows: each request goes over
the WebSocket of a healthy executor of the app, through whichever instance
holds its socket (:class:`relay.net.router.Router`), and the reply comes back.
Executors are taken in turn, so requests spread over them. A read, and a
change that is safe to repeat (cancel, resume, delete...), moves on to the
next executor when one does not answer within the per-executor timeout; the
whole request ends by a deadline that Conductor's clients wait for (they give
up at 30 s). A change that is not safe to repeat (an import) is tried once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from relay.core.ids import ExecutorKey
from relay.errors import (
    ExecutorBadReply,
    ExecutorRequestError,
    NoAnswer,
    NoHealthyExecutor,
    TooManyRequests,
    UnsendableRequest,
    UnsupportedMessage,
)
from relay.net.router import Router
from relay.store.executors import ExecutorStore
from relay_protocol import ProtocolError as WireError
from relay_protocol import Reply, Request

log = logging.getLogger("relay.gateway")
R = TypeVar("R", bound=Reply)


@dataclass(frozen=True)
class GatewayLimits:
    per_executor_secs: float = 5.0
    deadline_secs: float = 25.0
    in_flight_per_app: int = 32


class ExecutorGateway:
    def __init__(self, executors: ExecutorStore, router: Router, limits: GatewayLimits) -> None:
        self.executors = executors
        self.router = router
        self.limits = limits
        self._turns = itertools.count()
        self._in_flight: dict[tuple[str, str], int] = {}

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
        :class:`NoAnswer` (502), :class:`UnsupportedMessage` (501), :class:`TooManyRequests` (429),
        :class:`UnsendableRequest` (422) before any executor is asked."""
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
        healthy = [executor_id for executor_id, _ in await self.executors.healthy_peers(org, app)]
        if not healthy:
            raise NoHealthyExecutor(f"app {app!r} has no healthy executor connected")
        start = next(self._turns) % len(healthy)
        order = healthy[start:] + healthy[:start]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.deadline_secs
        problems: list[str] = []
        for executor_id in order if repeatable else order[:1]:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                return await self.router.ask(ExecutorKey(org, app, executor_id), make(), expected, min(per, left))
            except UnsupportedMessage:
                raise
            except ExecutorBadReply as exc:
                problems.append(str(exc))
                log.warning("app %s: %s", app, exc)
            except ExecutorRequestError as exc:
                problems.append(str(exc))
        raise NoAnswer(f"no executor of app {app!r} answered: " + "; ".join(problems[:3]))
