"""Executor states and the events that move them (contract section 2).

Pure. The table below is the whole state machine: the executor store
(:mod:`relay.store.executors`, the only writer of executor rows) takes every
guard from it. An event whose expected state the table does not allow raises
:class:`IllegalTransition` before any SQL is sent (a bug in the caller); a
guarded write that matches no row is a lost race, an ordinary outcome.
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
    LOST = "lost"  # its socket closed, or nothing heard for pingWaitSecs
    INSTANCE_LOST = "instance_lost"  # the Relay instance holding its socket restarted or stopped
    ADOPTED = "adopted"  # that instance's lease expired and another instance adopted its executors
    GRACE_EXPIRED = "grace_expired"  # executorTimeoutSecs passed without a reconnect
    DECLARED_DEAD = "declared_dead"  # an operator cut the grace period short
    BLOCKED = "blocked"  # no eligible peer: the recovery waits, with a reason
    RECOVERY_SENT = "recovery_sent"  # a peer was asked to recover its workflows
    RECOVERY_FAILED = "recovery_failed"  # that peer failed, timed out or went away
    RECOVERED = "recovered"  # the peer's recovery was verified: the record is deleted
    # A peer found no PENDING workflow of the dead executor: nothing to recover, the record is
    # deleted without a recovery frame (an idle executor of a version no healthy peer runs).
    NOTHING_PENDING = "nothing_pending"
    # The reconciler found PENDING workflows of an executor id Relay had deleted (or never
    # registered): its record comes back DEAD, and its recovery runs as for any death.
    STRANDED = "stranded"


class IllegalTransition(ValueError):
    def __init__(self, state: ExecutorState | None, event: ExecutorEvent) -> None:
        super().__init__(f"{event.value} is not allowed in state {state.value if state else 'new'}")
        self.state = state
        self.event = event


S = ExecutorState
E = ExecutorEvent

# (state before, event) -> state after. None stands for "no record": before
# CONNECTED, a new executor; after RECOVERED, a deleted one.
TRANSITIONS: dict[tuple[ExecutorState | None, ExecutorEvent], ExecutorState | None] = {
    (None, E.CONNECTED): S.HEALTHY,
    (None, E.STRANDED): S.DEAD,
    (S.HEALTHY, E.CONNECTED): S.HEALTHY,  # a second socket for the same id takes over
    (S.DISCONNECTED, E.CONNECTED): S.HEALTHY,
    # A process paused past its grace period (SIGSTOP, then SIGCONT) comes back
    # with the same id: it is alive again, whatever recovery has done meanwhile.
    (S.DEAD, E.CONNECTED): S.HEALTHY,
    (S.RECOVERING, E.CONNECTED): S.HEALTHY,
    (S.HEALTHY, E.LOST): S.DISCONNECTED,
    (S.HEALTHY, E.INSTANCE_LOST): S.DISCONNECTED,
    # Adoption moves every executor of the dead instance to the adopter; only
    # the ones still HEALTHY change state (their sockets died with the instance).
    (S.HEALTHY, E.ADOPTED): S.DISCONNECTED,
    (S.DISCONNECTED, E.ADOPTED): S.DISCONNECTED,
    (S.DEAD, E.ADOPTED): S.DEAD,
    (S.RECOVERING, E.ADOPTED): S.RECOVERING,
    (S.DISCONNECTED, E.GRACE_EXPIRED): S.DEAD,
    (S.DISCONNECTED, E.DECLARED_DEAD): S.DEAD,
    (S.DEAD, E.BLOCKED): S.DEAD,
    (S.DEAD, E.RECOVERY_SENT): S.RECOVERING,
    (S.RECOVERING, E.RECOVERY_FAILED): S.DEAD,
    (S.RECOVERING, E.RECOVERED): None,
    (S.DEAD, E.NOTHING_PENDING): None,
}


def check_transition(state: ExecutorState | None, event: ExecutorEvent) -> ExecutorState | None:
    """The state after ``event`` (None: the record is deleted); raises :class:`IllegalTransition`."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(state, event) from None


def states_allowing(event: ExecutorEvent) -> list[ExecutorState]:
    """The states from which ``event`` is allowed (for a guarded UPDATE's WHERE)."""
    return [s for (s, e) in TRANSITIONS if e is event and s is not None]


def targets(event: ExecutorEvent) -> dict[ExecutorState, ExecutorState | None]:
    """State before -> state after, for every existing state ``event`` is allowed from."""
    return {s: t for (s, e), t in TRANSITIONS.items() if e is event and s is not None}
