"""Choosing the peer that recovers a dead executor's workflows (contract section 3).

Pure: the recovery workflow gathers the facts (healthy executors of the app,
the app's settings, what an operator allowed, which peers already failed) and
this module decides. The order among equal peers is rendezvous hashing on
(dead executor, peer): deterministic for a given dead executor, and spread
evenly across peers when many executors die at once.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class BlockedReason(StrEnum):
    NO_HEALTHY_PEER = "no_healthy_peer"
    VERSION_UPGRADE_NOT_ALLOWED = "version_upgrade_not_allowed"
    # The app's healthy executors all run another language's SDK: it waits for a peer as
    # ``no_healthy_peer`` does (README: an app's executors in one language).
    NO_PEER_OF_ITS_LANGUAGE = "no_peer_of_its_language"


class Mode(StrEnum):
    SAME_VERSION = "same_version"  # the SDK's recovery frame re-enqueues the workflows
    LATEST_VERSION = "latest_version"  # cancel, then rewind each workflow onto the new version


@dataclass(frozen=True)
class Peer:
    executor_id: str
    application_version: str
    # The SDK's language, as its handshake said (None: not known). Not part of a peer's identity: a
    # recovery's checkpoint holds its candidates' ids and versions only.
    language: str | None = field(default=None, compare=False)


def of_language(peers: Sequence[Peer], language: str | None) -> list[Peer]:
    """The peers that can run the workflows of an executor on ``language``'s SDK. An SDK runs only
    the workflows its own language registered and reads only the values it stored: asked to
    recover a TypeScript executor's workflows, a Python executor took them (they became its own)
    and failed each (``Serialization js_superjson is not available``), leaving them PENDING on a
    live executor that can never run them, with nothing left for the recovery's check to find.
    A language not known (an executor recorded without one) fits any, as before."""
    if not language:
        return list(peers)
    return [p for p in peers if not p.language or p.language == language]


@dataclass(frozen=True)
class Choice:
    peer: Peer | None
    mode: Mode | None = None
    blocked: BlockedReason | None = None
    # All eligible peers of the chosen kind have failed in this round: back off, then retry them.
    exhausted: bool = False


def rank(dead_executor_id: str, peer_id: str) -> bytes:
    # The digest's bytes order as its hex spelling did (Relay 0.2.0's): the same peers come first.
    return hashlib.sha256(f"{dead_executor_id}\x00{peer_id}".encode()).digest()


def order_peers(dead_executor_id: str, peers: list[Peer]) -> list[Peer]:
    return sorted(peers, key=lambda p: (rank(dead_executor_id, p.executor_id), p.executor_id))


# A round's candidates: this many peers of each application version, the first in rendezvous
# order. The recovery's checkpoint of its facts holds these, not every healthy executor of the
# app (at 12,000 survivors that was 700 KB written per death of a group failure).
CANDIDATES_PER_VERSION = 16


def candidates(dead_executor_id: str, healthy: Sequence[Peer], per_version: int = CANDIDATES_PER_VERSION) -> list[Peer]:
    """The peers a round of a recovery may ask: the first ``per_version`` of each application
    version in rendezvous order, the dead executor left out. The first choice of each version is
    the same as among all of them; only past ``per_version`` failures in one round does a new
    round (and a new read of the app's executors) begin sooner."""
    # rank() inlined: this runs over every survivor for each death of a group failure.
    prefix, sha256 = f"{dead_executor_id}\x00", hashlib.sha256
    by_version: dict[str, list[tuple[bytes, str, int, Peer]]] = {}
    for i, peer in enumerate(healthy):  # (i: a peer listed twice is never compared itself)
        if peer.executor_id != dead_executor_id:
            keyed = (sha256((prefix + peer.executor_id).encode()).digest(), peer.executor_id, i, peer)
            by_version.setdefault(peer.application_version, []).append(keyed)
    chosen: list[Peer] = []
    for version in sorted(by_version):
        chosen += [peer for *_, peer in heapq.nsmallest(per_version, by_version[version])]
    return chosen


def _in_order(keyed: list[tuple[tuple[object, ...], str]]) -> Iterator[str]:
    """The ids of ``(key, id)`` pairs by key, sorted only as far as they are read: a group
    failure of thousands asks the first one or two of thousands of survivors."""
    heapq.heapify(keyed)
    while keyed:
        yield heapq.heappop(keyed)[1]


@dataclass(frozen=True)
class AppVersion:
    """An application version as the app's system database lists it (``list_application_versions``)."""

    name: str
    timestamp: int  # DBOS's order of "latest" (``set_latest_application_version`` moves one up)
    created_at: int


def newest_version(versions: Sequence[AppVersion]) -> AppVersion:
    """The version DBOS counts as latest: the newest by its version timestamp, then creation time."""
    return max(versions, key=lambda v: (v.timestamp, v.created_at))


def latest_version(versions: Sequence[AppVersion], dead_version: str) -> str | None:
    """The version a dead executor's workflows may be moved onto (contract rule 3): the newest one the
    system database lists, whether or not a peer runs it.

    Not one that only the peers run: a dead executor on the newest version, with peers left only on
    an older one (a partial rollback), would have its work moved back onto older code. For the same
    reason, a version created before the dead executor's own is never the answer, even when an
    operator has marked it latest in DBOS: None then, and None when nothing is listed.
    """
    if not versions:
        return None
    newest = newest_version(versions)
    own = [v for v in versions if v.name == dead_version]
    if any(newest.created_at < v.created_at for v in own):
        return None
    return newest.name


def choose_peer(
    dead_executor_id: str,
    dead_version: str,
    healthy: list[Peer],
    *,
    tried: frozenset[str] = frozenset(),
    allow_latest: bool = False,
    latest_version: str | None = None,
    other_languages: bool = False,
) -> Choice:
    """Pick the next peer to ask.

    ``healthy`` are the HEALTHY executors of the same org and app (the caller
    never passes another app's). ``latest_version`` is the newest application
    version (:func:`latest_version`); without it the newest is unknown and no
    cross-version move is proposed. With no peer on it either, the recovery
    waits for one (``no_healthy_peer``: moving is allowed, so it is a peer it
    lacks, not an operator's permission). ``healthy`` are those of the dead executor's language
    (:func:`of_language`); ``other_languages``: the app has healthy executors of another language
    besides, so that with none of its own the recovery waits for ``no_peer_of_its_language``.
    """
    others = [p for p in healthy if p.executor_id != dead_executor_id]
    if not others:
        if other_languages:
            return Choice(None, blocked=BlockedReason.NO_PEER_OF_ITS_LANGUAGE)
        return Choice(None, blocked=BlockedReason.NO_HEALTHY_PEER)
    same = [p for p in others if p.application_version == dead_version]
    if same:
        return _next(dead_executor_id, same, tried, Mode.SAME_VERSION)
    if not allow_latest:
        return Choice(None, blocked=BlockedReason.VERSION_UPGRADE_NOT_ALLOWED)
    newest = [p for p in others if p.application_version == latest_version]
    if not newest:
        # The peers run versions other than the latest one: nothing is safe to choose.
        return Choice(None, blocked=BlockedReason.NO_HEALTHY_PEER)
    return _next(dead_executor_id, newest, tried, Mode.LATEST_VERSION)


def blocked_note(
    reason: BlockedReason,
    peers: Sequence[Peer],
    latest_version: str | None,
    latest_unknown: str | None = None,
    languages: Sequence[str] = (),
) -> str | None:
    """Why a recovery waits, in words, when its ``reason`` alone would mislead: the app has healthy
    peers, only none the recovery may use. ``peers``: the healthy executors of the app other than
    the dead one. ``latest_unknown``: why the latest version could not be named, if it could not.
    ``languages``: the dead executor's language, then the others the app's healthy executors run
    (``no_peer_of_its_language``). None when there is no peer at all (``no_healthy_peer`` says it
    all)."""
    if reason is BlockedReason.NO_PEER_OF_ITS_LANGUAGE and languages:
        own, *others = languages
        return (f"the app's healthy executors run only another language's SDK ({', '.join(others)}), which cannot"
                f" run a {own} executor's workflows")  # fmt: skip
    versions = ", ".join(sorted({p.application_version for p in peers}))
    if not versions:
        return None
    if reason is BlockedReason.VERSION_UPGRADE_NOT_ALLOWED:
        return f"healthy peers run only other versions ({versions}) and moving work onto the latest is not allowed"
    if latest_version is None:
        why = latest_unknown or "no peer named it"
        return f"healthy peers run other versions ({versions}), but the latest version is not known: {why}"
    return f"no healthy peer runs the latest version, {latest_version}; healthy peers run {versions}"


def _next(dead_executor_id: str, candidates: list[Peer], tried: frozenset[str], mode: Mode) -> Choice:
    untried = [p for p in candidates if p.executor_id not in tried]
    if not untried:
        return Choice(None, mode=mode, exhausted=True)
    # The first in rendezvous order (order_peers), found without sorting them all.
    return Choice(min(untried, key=lambda p: (rank(dead_executor_id, p.executor_id), p.executor_id)), mode=mode)


def verifiers(
    dead_executor_id: str,
    dead_version: str,
    recovering_peer: str,
    healthy: Sequence[Peer],
    first: Sequence[Peer] = (),
) -> Iterator[str]:
    """Whom to ask, in turn, whether the dead executor's workflows are still PENDING after
    ``recovering_peer`` said it recovered them (contract rule 4).

    Any executor of the app can answer (it queries the app's system database),
    so the peer that recovered is asked last: every other healthy executor
    comes first, those on the dead executor's version before the others, in
    rendezvous order. A peer that lies about its recovery is then checked by
    another executor whenever the app has one that answers; only when none
    does is the recovering peer's own word taken.

    ``first``: the round's :func:`candidates`, the first of each version in that same order. Those
    still healthy are asked before the rest, which is ranked only if none of them answers: a group
    failure of thousands then ranks a few peers per death, not every survivor. (A peer that
    connected since the candidates were read comes after them, wherever its rank.)
    """

    def keyed(peers: list[Peer]) -> list[tuple[tuple[object, ...], str]]:
        def key(p: Peer) -> tuple[object, ...]:
            return p.application_version != dead_version, rank(dead_executor_id, p.executor_id), p.executor_id

        return [(key(p), p.executor_id) for p in peers]

    skip = {dead_executor_id, recovering_peer}
    if first:
        healthy_ids = {p.executor_id for p in healthy}
        still = [p for p in first if p.executor_id in healthy_ids and p.executor_id not in skip]
        for executor_id in _in_order(keyed(still)):
            skip.add(executor_id)
            yield executor_id
    yield from _in_order(keyed([p for p in healthy if p.executor_id not in skip]))
    yield recovering_peer


def backoff(attempt: int, initial: float, maximum: float) -> float:
    """Seconds to wait before attempt ``attempt`` + 1 (attempts count from 1)."""
    if attempt < 1:
        return 0.0
    return float(min(maximum, initial * 2 ** (attempt - 1)))
