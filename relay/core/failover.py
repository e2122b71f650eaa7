"""The failover policy of one recovery: which peer next, when to wait, when to start over.

Pure: the recovery workflow (``workflows/recovery.py``) gathers the facts in a
step, asks :meth:`FailoverPolicy.decide`, and carries the decision out. The
policy remembers what a recovery has been through (attempts, peers that
failed, the reason it last waited for, an operator's permission), so the
workflow's code is a loop of "gather, decide, act" and the rules are tested
here with no DBOS and no event loop.

The rules (contract section 3): a peer on the dead executor's version first,
in rendezvous order (:func:`relay.core.peers.choose_peer`); each failed peer
is skipped for the rest of the round, and the next attempt waits an
exponential backoff; once every candidate failed, a new round starts; with no
eligible peer the recovery waits, recording its reason once, unless a peer of
any version found nothing of the dead executor left PENDING: then there is
nothing to recover, and the recovery succeeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relay.core.peers import BlockedReason, Mode, Peer, backoff, choose_peer

# Recoveries at work at once on an instance (the others wait for a turn: workflows/ordering.py).
# Enough to keep two cores busy and to fill shared recovery frames (100 measured the same); few
# enough that a group's earliest deaths are not held up by the rest.
RECOVERIES_AT_ONCE = 40
# The ``reason`` of the wake-up an operator's ``recover`` sends (relay.domain.operator).
OPERATOR_NUDGE = "operator"


@dataclass(frozen=True)
class Facts:
    """What a round of the recovery knows about the world."""

    dead: bool  # the executor is still DEAD or RECOVERING at this recovery's epoch
    peers: tuple[Peer, ...]  # HEALTHY executors of the same org and app
    allow_latest: bool  # recoverToLatestVersion, or an operator's permission
    latest: str | None  # the newest version the app's system database lists, when it was needed and known
    ack_timeout: float
    backoff_initial: float
    backoff_max: float
    # When no peer may be asked to recover: the peer that found no PENDING workflow of the dead
    # executor (None: not asked, or no peer could tell).
    nothing_pending_by: str | None = None
    # The dead executor's language (None: not known), and those of the app's healthy executors left
    # out of ``peers`` as another language's (relay.core.peers.of_language).
    language: str | None = None
    other_languages: tuple[str, ...] = ()


@dataclass(frozen=True)
class Abandon:
    """The executor is back (or its record is gone): nothing to recover. Which of the two is read
    as the run ends (relay.store.recoveries.RecoveryStore.abandon)."""


@dataclass(frozen=True)
class Block:
    """No eligible peer. ``record`` is true the first time this reason comes up."""

    reason: BlockedReason
    record: bool


@dataclass(frozen=True)
class NothingPending:
    """No eligible peer, but nothing to recover either (``verified_by`` found no PENDING workflow of
    the dead executor): the recovery succeeds without a recovery frame."""

    verified_by: str


@dataclass(frozen=True)
class NewRound:
    """Every candidate failed once: forget them and look again."""


@dataclass(frozen=True)
class Dispatch:
    """Ask ``peer`` to recover the dead executor's workflows."""

    attempt: int
    peer: Peer
    mode: Mode
    failover_from: str | None  # the peer of the previous, failed attempt
    backoff_secs: float  # how long the recovery waited before this attempt


Decision = Abandon | Block | NothingPending | NewRound | Dispatch


@dataclass
class FailoverPolicy:
    dead_executor_id: str
    dead_version: str
    attempt: int = 0
    delay: float = 0.0
    tried: list[str] = field(default_factory=list)
    blocked: BlockedReason | None = None
    last_failed: str | None = None
    operator_allows_latest: bool = False

    def decide(self, facts: Facts) -> Decision:
        if not facts.dead:
            return Abandon()
        choice = choose_peer(
            self.dead_executor_id,
            self.dead_version,
            list(facts.peers),
            tried=frozenset(self.tried),
            allow_latest=facts.allow_latest,
            latest_version=facts.latest,
            other_languages=bool(facts.other_languages),
        )
        if choice.blocked is not None:
            if facts.nothing_pending_by is not None:
                return NothingPending(facts.nothing_pending_by)
            record = choice.blocked is not self.blocked
            self.blocked = choice.blocked
            return Block(choice.blocked, record)
        self.blocked = None
        if choice.peer is None or choice.mode is None:
            self.tried = []
            return NewRound()
        self.attempt += 1
        return Dispatch(self.attempt, choice.peer, choice.mode, self.last_failed, self.delay)

    def woken(self, message: object) -> bool:
        """A wake-up, read while blocked or during a backoff; an operator's may allow moving onto the
        latest version. True if it is an operator's nudge (``recover``), which ends a backoff."""
        if not isinstance(message, dict):
            return False
        if message.get("toLatestVersion"):
            self.operator_allows_latest = True
        return message.get("reason") == OPERATOR_NUDGE

    def failed(self, dispatch: Dispatch, facts: Facts) -> float:
        """The attempt failed: skip its peer this round; returns the backoff before the next one."""
        self.tried.append(dispatch.peer.executor_id)
        self.last_failed = dispatch.peer.executor_id
        self.delay = backoff(dispatch.attempt, facts.backoff_initial, facts.backoff_max)
        return self.delay
