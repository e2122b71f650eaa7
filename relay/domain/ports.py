"""What the domain asks of Relay's durable workflows.

Implemented by ``workflows/`` (:class:`workflows.engine.Engine`) and handed in
by the composition root (:mod:`relay.runtime`), so that no module under
``relay/`` but that one imports ``workflows/``.
"""

from __future__ import annotations

from typing import Any, Protocol

from relay.core.ids import ExecutorKey


class Durable(Protocol):
    async def start_recovery(self, key: ExecutorKey, epoch: int, trigger: str) -> str:
        """Start (or find) the recovery workflow of this death; returns its id."""
        ...

    async def end_grace(self, key: ExecutorKey, epoch: int, reason: str) -> None:
        """Tell a running grace period to end without declaring the executor dead."""
        ...

    async def wake_recovery(self, rid: str, message: dict[str, Any]) -> None:
        """Wake a recovery waiting for a peer or an operator."""
        ...

    async def wake_app(self, org: str, app: str, message: dict[str, Any]) -> None:
        """Wake every waiting recovery of an app (its settings changed: any of them may go on now)."""
        ...

    async def refresh_blocked(self) -> None:
        """Learn which apps have waiting recoveries (some may have been blocked on another instance)."""
        ...

    async def take_over(self, instances: list[str]) -> None:
        """Resume the pending workflows of instances this one adopted, and start missing grace periods."""
        ...
