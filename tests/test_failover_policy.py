"""The failover policy of a recovery, and the lifecycle table's new events: pure, no DBOS, no event loop."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from relay.core.failover import Abandon, Block, Dispatch, Facts, FailoverPolicy, NewRound, NothingPending
from relay.core.ids import ExecutorKey
from relay.core.lifecycle import TRANSITIONS, ExecutorEvent, ExecutorState, IllegalTransition, check_transition
from relay.core.peers import BlockedReason, Mode, Peer, order_peers
from relay.store.db import Database
from relay.store.executors import ExecutorStore
from workflows.recovery import BLOCKED_RECHECK_MAX_SECS, BLOCKED_RECHECKS_DENSE, blocked_recheck_secs

S, E = ExecutorState, ExecutorEvent
V1 = (Peer("a", "v1"), Peer("b", "v1"), Peer("c", "v1"))
FACTS = Facts(dead=True, peers=V1, allow_latest=False, latest=None, ack_timeout=30, backoff_initial=1, backoff_max=8)


def dispatch(decision: object) -> Dispatch:
    assert isinstance(decision, Dispatch), decision
    return decision


def test_candidates_in_rendezvous_order_with_exponential_backoff_then_a_new_round() -> None:
    policy = FailoverPolicy("dead", "v1")
    order = order_peers("dead", list(V1))
    delays = []
    for n, expected in enumerate(order, start=1):
        plan = dispatch(policy.decide(FACTS))
        assert (plan.attempt, plan.peer, plan.mode) == (n, expected, Mode.SAME_VERSION)
        assert plan.failover_from == (order[n - 2].executor_id if n > 1 else None)
        assert plan.backoff_secs == (delays[-1] if delays else 0.0)
        delays.append(policy.failed(plan, FACTS))
    assert delays == [1.0, 2.0, 4.0]
    assert isinstance(policy.decide(FACTS), NewRound)  # every candidate failed once
    again = dispatch(policy.decide(FACTS))
    assert (again.attempt, again.peer, again.backoff_secs) == (4, order[0], 4.0)
    policy.failed(again, FACTS)
    assert policy.delay == 8.0  # capped at backoff_max
    nxt = dispatch(policy.decide(FACTS))
    policy.failed(nxt, FACTS)
    assert policy.delay == 8.0


def test_a_peer_that_disappears_is_not_chosen_and_a_new_one_is() -> None:
    policy = FailoverPolicy("dead", "v1")
    first = dispatch(policy.decide(FACTS))
    policy.failed(first, FACTS)
    fewer = replace(FACTS, peers=(Peer("z", "v1"),))
    assert dispatch(policy.decide(fewer)).peer == Peer("z", "v1")


def test_no_peer_blocks_once_then_waits_and_a_peer_ends_the_block() -> None:
    policy = FailoverPolicy("dead", "v1")
    alone = replace(FACTS, peers=(Peer("dead", "v1"),))
    assert policy.decide(alone) == Block(BlockedReason.NO_HEALTHY_PEER, record=True)
    assert policy.decide(alone) == Block(BlockedReason.NO_HEALTHY_PEER, record=False)
    plan = dispatch(policy.decide(FACTS))
    assert plan.attempt == 1 and policy.blocked is None
    policy.failed(plan, FACTS)
    assert policy.decide(alone) == Block(BlockedReason.NO_HEALTHY_PEER, record=True)  # blocked anew: recorded again


def test_other_versions_wait_for_an_operator_whose_permission_is_remembered() -> None:
    policy = FailoverPolicy("dead", "v1")
    newer = replace(FACTS, peers=(Peer("n", "v2"),))
    assert policy.decide(newer) == Block(BlockedReason.VERSION_UPGRADE_NOT_ALLOWED, record=True)
    policy.woken({"reason": "peer_connected"})
    assert not policy.operator_allows_latest
    policy.woken({"reason": "operator", "toLatestVersion": True})
    assert policy.operator_allows_latest
    # The facts of the next round carry the permission (gathered with it) and the latest version.
    plan = dispatch(policy.decide(replace(newer, allow_latest=True, latest="v2")))
    assert plan.mode is Mode.LATEST_VERSION and plan.peer == Peer("n", "v2")
    assert policy.blocked is None


def test_only_an_operators_nudge_ends_a_backoff_and_its_permission_is_kept() -> None:
    """A backoff's wait reads wake-ups as a blocked wait does; only an operator's ends it (the
    others, left over from a block, are consumed and the wait goes on)."""
    policy = FailoverPolicy("dead", "v1")
    policy.failed(dispatch(policy.decide(FACTS)), FACTS)
    assert not policy.woken({"reason": "peer_connected", "peer": "p"})
    assert not policy.woken({"reason": "settings_updated"})
    assert not policy.woken(None) and not policy.woken("operator")
    assert policy.woken({"reason": "operator", "toLatestVersion": False})
    assert not policy.operator_allows_latest
    assert policy.woken({"reason": "operator", "toLatestVersion": True})
    assert policy.operator_allows_latest


def test_a_blocked_executor_that_left_nothing_pending_succeeds_but_a_dispatch_is_never_skipped() -> None:
    """A peer of another version listed nothing PENDING of the dead executor: nothing to wait for. The
    answer counts only where the recovery would wait; with a peer on its version, the recovery frame
    is sent as ever (the facts never carry the answer then, and the policy would not read it)."""
    policy = FailoverPolicy("dead", "v1")
    newer = replace(FACTS, peers=(Peer("n", "v2"),))
    assert policy.decide(replace(newer, nothing_pending_by="n")) == NothingPending("n")
    assert policy.decide(newer) == Block(BlockedReason.VERSION_UPGRADE_NOT_ALLOWED, record=True)
    assert policy.decide(replace(newer, nothing_pending_by="n")) == NothingPending("n")  # after a wait, too
    same = dispatch(policy.decide(replace(FACTS, nothing_pending_by="a")))
    assert same.mode is Mode.SAME_VERSION
    moving = replace(newer, allow_latest=True, latest="v2", nothing_pending_by="n")
    assert dispatch(FailoverPolicy("dead", "v1").decide(moving)).mode is Mode.LATEST_VERSION


def test_a_blocked_recoverys_recheck_backs_off_to_ten_minutes_then_further_after_a_day() -> None:
    waits = [blocked_recheck_secs(n) for n in range(8)]
    assert waits == [30.0, 60.0, 120.0, 240.0, 480.0, 600.0, 600.0, 600.0]
    assert blocked_recheck_secs(BLOCKED_RECHECKS_DENSE - 1) == BLOCKED_RECHECK_MAX_SECS
    assert blocked_recheck_secs(BLOCKED_RECHECKS_DENSE) == 2 * BLOCKED_RECHECK_MAX_SECS  # after a day, sparser


def test_a_reason_that_changes_is_recorded_again() -> None:
    policy = FailoverPolicy("dead", "v1")
    assert policy.decide(replace(FACTS, peers=())).record
    assert policy.decide(replace(FACTS, peers=(Peer("n", "v2"),))) == Block(
        BlockedReason.VERSION_UPGRADE_NOT_ALLOWED, record=True
    )


def test_an_executor_no_longer_dead_is_abandoned() -> None:
    assert isinstance(FailoverPolicy("dead", "v1").decide(replace(FACTS, dead=False)), Abandon)


# -- the lifecycle table -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "event", "after"),
    [
        (S.HEALTHY, E.INSTANCE_LOST, S.DISCONNECTED),
        (S.HEALTHY, E.ADOPTED, S.DISCONNECTED),
        (S.DISCONNECTED, E.ADOPTED, S.DISCONNECTED),
        (S.DEAD, E.ADOPTED, S.DEAD),
        (S.RECOVERING, E.ADOPTED, S.RECOVERING),
        (S.DISCONNECTED, E.DECLARED_DEAD, S.DEAD),
        (S.DEAD, E.BLOCKED, S.DEAD),
        (S.RECOVERING, E.RECOVERED, None),
        (S.DEAD, E.NOTHING_PENDING, None),
    ],
)
def test_new_events(state: ExecutorState, event: ExecutorEvent, after: ExecutorState | None) -> None:
    assert check_transition(state, event) is after


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (S.HEALTHY, E.DECLARED_DEAD),  # an operator cannot declare a connected executor dead
        (S.DEAD, E.RECOVERED),  # deleted only after a recovery was sent and verified
        (S.DISCONNECTED, E.BLOCKED),
        (None, E.ADOPTED),
        (S.RECOVERING, E.RECOVERY_SENT),
        (S.RECOVERING, E.NOTHING_PENDING),  # a recovery frame is out: its verification decides
        (S.DISCONNECTED, E.NOTHING_PENDING),
    ],
)
def test_illegal_new_events(state: ExecutorState | None, event: ExecutorEvent) -> None:
    with pytest.raises(IllegalTransition):
        check_transition(state, event)


def test_every_event_has_a_transition_and_only_connected_and_stranded_create_a_record() -> None:
    assert {e for (_, e) in TRANSITIONS} == set(ExecutorEvent)
    assert {e for (s, e) in TRANSITIONS if s is None} == {E.CONNECTED, E.STRANDED}
    # The reconciler brings a record back DEAD, and only where there is none.
    assert TRANSITIONS[(None, E.STRANDED)] is S.DEAD
    assert {s for (s, e) in TRANSITIONS if e is E.STRANDED} == {None}


def test_the_store_refuses_an_illegal_event_before_any_sql() -> None:
    # A pool that was never opened: any statement would fail with a DatabaseError, not this.
    store = ExecutorStore(Database("postgresql://nobody@127.0.0.1:1/none"))
    key = ExecutorKey("acme", "ledger", "ex-1")
    with pytest.raises(IllegalTransition, match="grace_expired is not allowed in state HEALTHY"):
        asyncio.run(store.apply(key, E.GRACE_EXPIRED, expected=S.HEALTHY))
    with pytest.raises(IllegalTransition):
        asyncio.run(store.apply(key, E.RECOVERED, expected=S.DEAD))
    assert not store.events  # nothing was counted: nothing was attempted


def test_peers_only_of_another_language_block_with_their_own_reason_and_one_of_its_language_ends_it() -> None:
    """The gathered facts hold only peers of the dead executor's language; the others are named in
    ``other_languages``. With none of its own the recovery waits for ``no_peer_of_its_language``
    (not ``no_healthy_peer``: the app has healthy executors), recorded once."""
    policy = FailoverPolicy("dead", "v1")
    others = replace(FACTS, peers=(), language="typescript", other_languages=("python",))
    assert policy.decide(others) == Block(BlockedReason.NO_PEER_OF_ITS_LANGUAGE, record=True)
    assert policy.decide(others) == Block(BlockedReason.NO_PEER_OF_ITS_LANGUAGE, record=False)
    assert policy.decide(replace(others, peers=(Peer("t", "v1"),))) == Dispatch(
        1, Peer("t", "v1"), Mode.SAME_VERSION, None, 0.0
    )
