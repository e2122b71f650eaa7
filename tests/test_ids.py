"""Workflow ids and recovery runs, and who verifies a recovery: pure functions, no I/O."""

from __future__ import annotations

import hashlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.core.ids import (
    APP_NAME_PATTERN,
    ExecutorKey,
    RecoveryRef,
    grace_id,
    id_part,
    recovery_id,
    recovery_run,
    valid_app_name,
)
from relay.core.peers import Mode, Peer, candidates, choose_peer, order_peers, verifiers
from workflows.appretention import round_id
from workflows.reconcile import reconcile_id

KEY = ExecutorKey("acme", "ledger", "ex-1")


def test_the_first_run_keeps_the_id_of_earlier_releases_and_later_runs_add_their_number() -> None:
    assert recovery_id(KEY, 1000007) == "recovery:acme:ledger:ex-1:1000007"  # 0.2.0's id
    assert recovery_id(KEY, 1000007, 1) == recovery_id(KEY, 1000007)
    assert recovery_id(KEY, 1000007, 2) == "recovery:acme:ledger:ex-1:1000007:2"
    with pytest.raises(ValueError):
        recovery_id(KEY, 1000007, 0)
    for run in (1, 2, 3, 17):
        rid = recovery_id(KEY, 1000007, run)
        assert recovery_run(KEY, 1000007, rid) == run
        assert RecoveryRef(KEY, 1000007, rid).run == run


def test_an_id_of_another_death_or_form_is_no_run_of_this_one() -> None:
    first = recovery_id(KEY, 1000007)
    for other in (
        recovery_id(KEY, 1000008),
        recovery_id(ExecutorKey("acme", "ledger", "ex-10"), 1000007),
        first + ":1",  # run 1 never has a suffix
        first + ":02",
        first + ":x",
        first + "0",  # epoch 10000070, not a run
        first + ":2:3",
        "grace:acme:ledger:ex-1:1000007",
    ):
        assert recovery_run(KEY, 1000007, other) is None, other
    assert RecoveryRef(KEY, 1000007, "r1").run == 1  # any other id counts as a first run


def test_an_executor_id_with_colons_and_digits_is_read_against_the_known_epoch() -> None:
    odd = ExecutorKey("acme", "ledger", "host:42")
    assert recovery_run(odd, 1000001, recovery_id(odd, 1000001, 3)) == 3
    assert recovery_run(odd, 1000001, recovery_id(odd, 1000001)) == 1


def app_ids(org: str, app: str) -> list[str]:
    """Every workflow id Relay builds from an org and an app name."""
    key = ExecutorKey(org, app, "ex:1")
    return [grace_id(key, 7), recovery_id(key, 7), recovery_id(key, 7, 2),
            round_id(org, app, 600, now=6000), reconcile_id(org, app, 60, now=6000)]  # fmt: skip


def test_an_org_and_app_with_colons_never_share_another_apps_workflow_ids() -> None:
    """Names may contain ':' (relay.yaml and the API take any printable name): org 'a:b' with app
    'c' and org 'a' with app 'b:c' are two apps, each with its own grace periods and rounds."""
    assert set(app_ids("a:b", "c")).isdisjoint(app_ids("a", "b:c"))
    assert set(app_ids("a%3Ab", "c")).isdisjoint(app_ids("a:b", "c"))  # the escape escaped in turn


def test_the_ids_of_names_without_colon_or_percent_are_those_of_earlier_releases() -> None:
    """In-place upgrades: a workflow started by an earlier release is found again under its id."""
    assert app_ids("acme", "ledger.v2_x-y z/é") == [
        "grace:acme:ledger.v2_x-y z/é:ex:1:7",
        "recovery:acme:ledger.v2_x-y z/é:ex:1:7",
        "recovery:acme:ledger.v2_x-y z/é:ex:1:7:2",
        "relay-app-retention:acme:ledger.v2_x-y z/é:10",
        "reconcile:acme:ledger.v2_x-y z/é:100",
    ]


@given(st.text(alphabet="ab:%3A", max_size=6), st.text(alphabet="ab:%3A", max_size=6))
def test_an_id_part_is_one_to_one_and_has_no_colon(one: str, other: str) -> None:
    assert ":" not in id_part(one)
    assert (id_part(one) == id_part(other)) == (one == other)
    assert id_part(one.replace(":", "").replace("%", "")) == one.replace(":", "").replace("%", "")


# The characters with which the TypeScript SDK's executor of an app reaches Relay under another name
# or none: "/" and "\" (which Node's URL parser reads as "/") split the name, "?" starts the query,
# "#" a fragment, "%" an escape (tests/test_path_names.py starts executors of such names).
NOT_SENT_AS_GIVEN = "/\\%?#"


def test_a_new_apps_name_has_no_character_an_sdk_executor_cannot_send_as_given() -> None:
    """Every other printable ASCII character is taken, by the rule and by its pattern alike: the SDK
    sends it as it is or escaped, and the server decodes it back."""
    for c in map(chr, range(0x20, 0x7F)):
        expected = c not in NOT_SENT_AS_GIVEN
        assert valid_app_name(f"a{c}b") is expected, c
        assert (re.fullmatch(APP_NAME_PATTERN, f"a{c}b") is not None) is expected, c
        assert valid_app_name(c) is (expected and c not in " ."), c  # alone: no space at either end, not "."


def test_a_new_apps_name_may_have_non_ascii_characters_but_no_invisible_ones() -> None:
    """The SDK escapes a non-ASCII character as UTF-8 and the server decodes it back."""
    for name in ("caf\u00e9", "\u65e5\u672c", "\U0001f600", "\u01c5"):
        assert valid_app_name(name) and re.fullmatch(APP_NAME_PATTERN, name), name
    for name in ("a\u00a0b", "a\u200bb", "a\u2028b", "a\x85b"):  # not printable: a space no one sees
        assert not valid_app_name(name), name


def test_a_recovery_is_verified_by_another_executor_first_and_its_own_peer_last() -> None:
    healthy = [Peer("dead", "v1"), Peer("p", "v1"), Peer("a", "v1"), Peer("b", "v1"), Peer("new", "v2")]
    order = list(verifiers("dead", "v1", "p", healthy))
    assert order[-1] == "p" and order.count("p") == 1
    assert "dead" not in order
    # The dead executor's version first, in rendezvous order; other versions after.
    assert order[:2] == [q.executor_id for q in order_peers("dead", [Peer("a", "v1"), Peer("b", "v1")])]
    assert order[2] == "new"
    # Alone: the recovering peer answers for itself.
    assert list(verifiers("dead", "v1", "p", [Peer("p", "v1")])) == ["p"]
    assert list(verifiers("dead", "v1", "p", [])) == ["p"]


def hex_rank(dead: str, peer: str) -> str:
    """Relay 0.2.0's rendezvous rank: the order a recovery started by that release expects."""
    return hashlib.sha256(f"{dead}\x00{peer}".encode()).hexdigest()


ids = st.text(alphabet="abcdef0123:-", min_size=1, max_size=8)


@given(
    dead=ids,
    peers=st.lists(st.tuples(ids, st.sampled_from(["v1", "v2"])), unique_by=lambda t: t[0], max_size=25),
    tried=st.sets(ids, max_size=5),
)
def test_peers_are_chosen_and_verifiers_asked_in_0_2_0s_rendezvous_order(
    dead: str, peers: list[tuple[str, str]], tried: set[str]
) -> None:
    healthy = [Peer(e, v) for e, v in peers]
    others = [p for p in healthy if p.executor_id != dead]
    expected = sorted(others, key=lambda p: (hex_rank(dead, p.executor_id), p.executor_id))
    assert order_peers(dead, others) == expected
    same = [p for p in expected if p.application_version == "v1" and p.executor_id not in tried]
    choice = choose_peer(dead, "v1", healthy, tried=frozenset(tried))
    if same:
        assert (choice.peer, choice.mode) == (same[0], Mode.SAME_VERSION)
    recovering = others[0].executor_id if others else "p"
    old = sorted(
        (p for p in others if p.executor_id != recovering),
        key=lambda p: (p.application_version != "v1", hex_rank(dead, p.executor_id), p.executor_id),
    )
    assert list(verifiers(dead, "v1", recovering, healthy)) == [*(p.executor_id for p in old), recovering]


@given(
    dead=ids,
    peers=st.lists(st.tuples(ids, st.sampled_from(["v1", "v2", "v3"])), unique_by=lambda t: t[0], max_size=30),
    tried=st.sets(ids, max_size=6),
)
def test_a_rounds_candidates_are_the_first_of_each_version_and_choose_as_all_would(
    dead: str, peers: list[tuple[str, str]], tried: set[str]
) -> None:
    healthy = [Peer(e, v) for e, v in peers]
    kept = candidates(dead, healthy, per_version=3)
    for version in {"v1", "v2", "v3"}:
        of_version = [p for p in healthy if p.application_version == version and p.executor_id != dead]
        assert sorted(p.executor_id for p in kept if p.application_version == version) == sorted(
            p.executor_id for p in order_peers(dead, of_version)[:3]
        )
    # While fewer than 3 peers of a version have failed this round, the choice is the same.
    for allow_latest, latest in ((False, None), (True, "v3")):
        full = choose_peer(
            dead, "v1", healthy, tried=frozenset(tried), allow_latest=allow_latest, latest_version=latest
        )
        if len({p.executor_id for p in kept} & tried) < 3 and not full.exhausted:
            assert (
                choose_peer(dead, "v1", kept, tried=frozenset(tried), allow_latest=allow_latest, latest_version=latest)
                == full
            )


@given(
    dead=ids,
    peers=st.lists(st.tuples(ids, st.sampled_from(["v1", "v2"])), unique_by=lambda t: t[0], max_size=30),
    gone=st.sets(ids, max_size=6),
    joined=st.lists(st.tuples(ids, st.sampled_from(["v1", "v2"])), unique_by=lambda t: t[0], max_size=4),
)
def test_verifiers_ask_the_rounds_candidates_first_and_everyone_healthy_once(
    dead: str, peers: list[tuple[str, str]], gone: set[str], joined: list[tuple[str, str]]
) -> None:
    gathered = [Peer(e, v) for e, v in peers]
    first = candidates(dead, gathered, per_version=3)
    # Since the round's read: some peers went, some joined.
    healthy = [p for p in gathered if p.executor_id not in gone]
    healthy += [Peer(e, v) for e, v in joined if e not in {p.executor_id for p in healthy}]
    recovering = healthy[0].executor_id if healthy else "p"
    asked = list(verifiers(dead, "v1", recovering, healthy, first))
    full = list(verifiers(dead, "v1", recovering, healthy))
    # The same executors, each once, the recovering peer last; none that is gone.
    assert sorted(asked) == sorted(full) and asked[-1] == recovering and len(set(asked)) == len(asked)
    # The candidates still healthy come first, in the order all of them would have been asked.
    still = [p.executor_id for p in first if p.executor_id in {h.executor_id for h in healthy}]
    still = [e for e in still if e not in (dead, recovering)]
    assert asked[: len(still)] == [e for e in full if e in still]
    # With nobody gone or joined, and no version past the candidates' count, nothing changes.
    if not gone and not joined and all(sum(v == ver for _, v in peers) <= 3 for ver in ("v1", "v2")):
        assert asked == full
