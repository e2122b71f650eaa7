"""Names of things: an executor's key, and the ids of Relay's workflows for it.

The workflow ids are durable: DBOS finds a workflow by its id, so starting one
twice (a retry, the start-up sweep) finds the first one. Changing a format
strands the workflows already running under the old one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutorKey:
    org: str
    app: str
    executor_id: str

    def __str__(self) -> str:
        return printable(f"{self.org}/{self.app}/{self.executor_id}")


def printable(text: str, limit: int = 300) -> str:
    """``text`` safe for a log line: control characters escaped (no forged lines), length bounded."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")


def grace_id(key: ExecutorKey, epoch: int) -> str:
    """The grace-period workflow's id: one per disconnection."""
    return f"grace:{key.org}:{key.app}:{key.executor_id}:{epoch}"


def recovery_id(key: ExecutorKey, epoch: int) -> str:
    """The recovery workflow's id, also the API's ``recoveryId``: one recovery per death."""
    return f"recovery:{key.org}:{key.app}:{key.executor_id}:{epoch}"


@dataclass(frozen=True)
class RecoveryRef:
    """One recovery: whose, for which connection's death, under which id."""

    key: ExecutorKey
    epoch: int
    rid: str

    @classmethod
    def of(cls, key: ExecutorKey, epoch: int, rid: str | None = None) -> RecoveryRef:
        return cls(key, epoch, rid if rid is not None else recovery_id(key, epoch))
