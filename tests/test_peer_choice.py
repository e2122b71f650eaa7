"""Peer choice and backoff: pure functions, no I/O."""

from __future__ import annotations

from collections import Counter

import pytest

from relay.core.peers import (
    AppVersion,
    BlockedReason,
    Mode,
    Peer,
    backoff,
    blocked_note,
    choose_peer,
    latest_version,
    of_language,
    order_peers,
)
from relay_protocol import ListStepsReply, WorkflowSteps
from relay_protocol import ProtocolError as WireError
from workflows.recovery import first_unfinished_step

V1 = [Peer("a", "v1"), Peer("b", "v1"), Peer("c", "v1")]


def test_same_version_peer_first_and_never_the_dead_one() -> None:
    choice = choose_peer("dead", "v1", [Peer("dead", "v1"), Peer("new", "v2"), *V1])
    assert choice.mode is Mode.SAME_VERSION
    assert choice.peer is not None and choice.peer.application_version == "v1"
    assert choice.peer.executor_id != "dead"


def test_order_is_deterministic_for_a_dead_executor() -> None:
    first = [choose_peer("dead", "v1", V1).peer for _ in range(5)]
    assert len(set(first)) == 1
    assert choose_peer("dead", "v1", list(reversed(V1))).peer == first[0]


def test_failed_peers_are_skipped_then_the_round_starts_again() -> None:
    order = [p.executor_id for p in order_peers("dead", V1)]
    tried: set[str] = set()
    for expected in order:
        choice = choose_peer("dead", "v1", V1, tried=frozenset(tried))
        assert choice.peer is not None and choice.peer.executor_id == expected
        tried.add(expected)
    exhausted = choose_peer("dead", "v1", V1, tried=frozenset(tried))
    assert exhausted.peer is None and exhausted.exhausted and exhausted.blocked is None


def test_many_deaths_spread_over_the_peers() -> None:
    counts = Counter(choose_peer(f"dead-{i}", "v1", V1).peer for i in range(300))
    assert set(counts) == set(V1)
    assert min(counts.values()) > 60  # about 100 each, not all on one peer


@pytest.mark.parametrize("healthy", [[], [Peer("dead", "v1")]])
def test_no_other_peer_blocks_with_no_healthy_peer(healthy: list[Peer]) -> None:
    choice = choose_peer("dead", "v1", healthy, allow_latest=True, latest_version="v2")
    assert choice.peer is None and choice.blocked is BlockedReason.NO_HEALTHY_PEER


def test_only_other_versions_need_permission() -> None:
    peers = [Peer("x", "v2"), Peer("y", "v3")]
    assert choose_peer("dead", "v1", peers).blocked is BlockedReason.VERSION_UPGRADE_NOT_ALLOWED
    choice = choose_peer("dead", "v1", peers, allow_latest=True, latest_version="v3")
    assert choice.mode is Mode.LATEST_VERSION
    assert choice.peer == Peer("y", "v3")


def test_latest_unknown_or_without_a_peer_is_not_guessed() -> None:
    peers = [Peer("x", "v2")]
    assert choose_peer("dead", "v1", peers, allow_latest=True, latest_version=None).peer is None
    assert choose_peer("dead", "v1", peers, allow_latest=True, latest_version="v9").peer is None


def test_same_version_wins_even_when_latest_is_allowed() -> None:
    choice = choose_peer("dead", "v1", [Peer("x", "v2"), Peer("y", "v1")], allow_latest=True, latest_version="v2")
    assert choice.peer == Peer("y", "v1") and choice.mode is Mode.SAME_VERSION


def test_the_latest_version_is_the_newest_listed_not_the_newest_a_peer_runs() -> None:
    listed = [AppVersion("v1", 100, 100), AppVersion("v2", 200, 200)]
    # A dead v2 executor, peers only on v1 (a partial rollback): v2 is the latest, and no peer runs it.
    assert latest_version(listed, "v2") == "v2"
    assert choose_peer("dead", "v2", [Peer("x", "v1")], allow_latest=True, latest_version="v2").blocked is (
        BlockedReason.NO_HEALTHY_PEER
    )
    assert latest_version(listed, "v1") == "v2"
    assert latest_version([AppVersion("v1", 300, 100), AppVersion("v2", 200, 200)], "v0") == "v1"  # DBOS's latest
    assert latest_version([], "v1") is None


def test_work_is_never_moved_onto_a_version_older_than_its_own() -> None:
    # An operator marked v1 latest in DBOS (its timestamp moved up): v2's work still does not go back to v1.
    listed = [AppVersion("v1", 300, 100), AppVersion("v2", 200, 200)]
    assert latest_version(listed, "v2") is None
    assert latest_version(listed, "v0") == "v1"  # v0 is not listed: nothing says v1 is older than it


def test_a_block_says_why_when_the_app_has_healthy_peers() -> None:
    peers = [Peer("x", "v2"), Peer("y", "v1")]
    assert blocked_note(BlockedReason.NO_HEALTHY_PEER, [], None) is None
    unknown = blocked_note(BlockedReason.NO_HEALTHY_PEER, peers, None, "x: list_application_versions: boom")
    assert unknown == (
        "healthy peers run other versions (v1, v2), but the latest version is not known: "
        "x: list_application_versions: boom"
    )
    assert blocked_note(BlockedReason.NO_HEALTHY_PEER, peers, "v3") == (
        "no healthy peer runs the latest version, v3; healthy peers run v1, v2"
    )
    forbidden = blocked_note(BlockedReason.VERSION_UPGRADE_NOT_ALLOWED, peers, None)
    assert forbidden is not None and "(v1, v2)" in forbidden


def test_exponential_backoff_is_capped() -> None:
    assert [backoff(n, 1, 30) for n in range(0, 8)] == [0, 1, 2, 4, 8, 16, 30, 30]
    assert backoff(3, 0.25, 10) == 1.0


def steps_of(*frames: dict[str, object]) -> list[WorkflowSteps]:
    """The steps as a list_steps reply carries them (the SDK always sends a name)."""
    reply = {"type": "list_steps", "request_id": "r", "output": [{"function_name": "f", **f} for f in frames]}
    return ListStepsReply.from_frame(reply).output or []


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([], 1),
        ([{"function_id": 1, "completed_at_epoch_ms": "5"}, {"function_id": 2, "completed_at_epoch_ms": "6"}], 3),
        ([{"function_id": 1, "completed_at_epoch_ms": "5"}, {"function_id": 2, "completed_at_epoch_ms": None}], 2),
        ([{"function_id": 1, "output": "x"}, {"function_id": 3, "error": "boom"}], 4),
        # TypeScript's steps start at 0: an unfinished first step is run again, not copied as done.
        ([{"function_id": 0, "completed_at_epoch_ms": None}], 0),
        ([{"function_id": 0, "completed_at_epoch_ms": "5"}, {"function_id": 1, "completed_at_epoch_ms": None}], 1),
        ([{"function_id": 0, "completed_at_epoch_ms": "5"}], 1),
    ],
)
def test_first_unfinished_step(steps: list[dict[str, object]], expected: int) -> None:
    assert first_unfinished_step(steps_of(*steps)) == expected


def test_a_list_steps_reply_with_junk_is_refused_before_it_reaches_the_choice() -> None:
    with pytest.raises(WireError):
        steps_of({"function_id": "1"})
    with pytest.raises(WireError):
        ListStepsReply.from_frame({"type": "list_steps", "request_id": "r", "output": ["junk"]})


def test_a_peer_of_another_language_is_never_chosen_and_the_block_says_so() -> None:
    """An app mixing the SDKs (README): a Python executor asked to recover a TypeScript executor's
    workflows takes them and never runs them. Only peers of the dead executor's language are
    candidates, with none the recovery waits for ``no_peer_of_its_language``, and a language not
    known (an executor recorded without one) fits any, as before."""
    python, ts, unknown = Peer("p", "v1", "python"), Peer("t", "v1", "typescript"), Peer("u", "v1")
    assert of_language([python, ts, unknown], "typescript") == [ts, unknown]
    assert of_language([python, ts], None) == of_language([python, ts], "") == [python, ts]
    fit = of_language([python], "typescript")
    choice = choose_peer("dead", "v1", fit, allow_latest=True, latest_version="v1", other_languages=True)
    assert choice.peer is None and choice.blocked is BlockedReason.NO_PEER_OF_ITS_LANGUAGE
    assert choose_peer("dead", "v1", fit).blocked is BlockedReason.NO_HEALTHY_PEER  # nobody else at all
    assert choose_peer("dead", "v1", [ts], other_languages=True).peer == ts
    assert blocked_note(BlockedReason.NO_PEER_OF_ITS_LANGUAGE, [], None, None, ["typescript", "python"]) == (
        "the app's healthy executors run only another language's SDK (python), which cannot run a typescript"
        " executor's workflows"
    )
