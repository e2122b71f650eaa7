"""Executor states and the transitions between them (contract section 2).

Pure: the registry asks :func:`check_transition` before it writes, and writes
with a guarded UPDATE (expected state and epoch) so that a race is seen as a
row count of zero rather than a lost update.
"""

from __future__ import annotations

from enum import StrEnum


class ExecutorState(StrEnum):
    HEALTHY = "HEALTHY"
    DISCONNECTED = "DISCONNECTED"
    DEAD = "DEAD"
    RECOVERING = "RECOVERING"


class ExecutorEvent(StrEnum):
    CONNECTED = "connected"  # executor_info answered, same or new executor id
    LOST = "lost"  # socket closed, or nothing heard for pingWaitSecs
    GRACE_EXPIRED = "grace_expired"
    RECOVERY_SENT = "recovery_sent"
    RECOVERY_FAILED = "recovery_failed"


class IllegalTransition(ValueError):
    def __init__(self, state: ExecutorState | None, event: ExecutorEvent) -> None:
        super().__init__(f"{event.value} is not allowed in state {state.value if state else 'new'}")
        self.state = state
        self.event = event


S = ExecutorState
E = ExecutorEvent

# (state before, event) -> state after; None stands for "no record yet".
TRANSITIONS: dict[tuple[ExecutorState | None, ExecutorEvent], ExecutorState] = {
    (None, E.CONNECTED): S.HEALTHY,
    (S.HEALTHY, E.CONNECTED): S.HEALTHY,  # a second socket for the same id takes over
    (S.DISCONNECTED, E.CONNECTED): S.HEALTHY,
    # A process paused past its grace period (SIGSTOP, then SIGCONT) comes back
    # with the same id: it is alive again, whatever recovery has done meanwhile.
    (S.DEAD, E.CONNECTED): S.HEALTHY,
    (S.RECOVERING, E.CONNECTED): S.HEALTHY,
    (S.HEALTHY, E.LOST): S.DISCONNECTED,
    (S.DISCONNECTED, E.GRACE_EXPIRED): S.DEAD,
    (S.DEAD, E.RECOVERY_SENT): S.RECOVERING,
    (S.RECOVERING, E.RECOVERY_FAILED): S.DEAD,
}


def check_transition(state: ExecutorState | None, event: ExecutorEvent) -> ExecutorState:
    """The state after ``event``; raises :class:`IllegalTransition` if not allowed."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(state, event) from None


def states_allowing(event: ExecutorEvent) -> list[ExecutorState]:
    """The states from which ``event`` is allowed (for a guarded UPDATE's WHERE)."""
    return [s for (s, e) in TRANSITIONS if e is event and s is not None]
