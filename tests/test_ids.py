"""Who verifies a recovery: a pure function, no I/O."""

from __future__ import annotations

from relay.core.peers import Peer, order_peers, verifiers


def test_a_recovery_is_verified_by_another_executor_first_and_its_own_peer_last() -> None:
    healthy = [Peer("dead", "v1"), Peer("p", "v1"), Peer("a", "v1"), Peer("b", "v1"), Peer("new", "v2")]
    order = verifiers("dead", "v1", "p", healthy)
    assert order[-1] == "p" and order.count("p") == 1
    assert "dead" not in order
    # The dead executor's version first, in rendezvous order; other versions after.
    assert order[:2] == [q.executor_id for q in order_peers("dead", [Peer("a", "v1"), Peer("b", "v1")])]
    assert order[2] == "new"
    # Alone: the recovering peer answers for itself.
    assert verifiers("dead", "v1", "p", [Peer("p", "v1")]) == ["p"]
    assert verifiers("dead", "v1", "p", []) == ["p"]
