"""Property-based fuzzing of every frame an executor can send, against a running Relay.

One Relay (``relay serve`` on real PostgreSQL) and one honest executor (a real DBOS
application) serve the whole module. In each example a fuzzing executor opens a socket with
the valid conductor key and sends what hypothesis draws:

1. as its reply to ``executor_info``, the handshake;
2. after a valid handshake, as its reply to the ``list_workflows`` that an API call asks of it;
3. unsolicited, before and while a request is out.

What Relay does with the frames is predicted (tests/fuzz_oracle.py) and checked: the socket's
close code, the executor's record, the API's status and body. After every example Relay still
runs, ``/readyz`` is 200 (its lease is held), the honest executor is HEALTHY with the
``connectedAt`` it had at the start, no API call answered 500, and Relay's log has no error and
no traceback. The Relay bugs this found, since fixed, are tests at the end.

Derandomized and sized for about a minute on two cores; ``RELAY_FUZZ_EXAMPLES=N`` runs N
examples of each position instead.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest
from hypothesis import currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from harness.executors import ExecutorProcess
from harness.fuzzing import ECHO, Ending, FuzzingExecutor, render, websocket_url
from harness.keys import API_KEYS
from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import info_reply
from harness.waiting import assert_eventually
from relay_protocol import (
    ExecutorInfoReply,
    ListWorkflowsReply,
    WorkflowsOutput,
)
from relay_protocol.limits import has_unstorable
from tests.frame_strategies import (
    echoing,
    either,
    error_only,
    garbage,
    huge_objects,
    inflated,
    json_values,
    mangled,
    nested,
    now_and_then,
    other_types,
    oversized,
    random_request_ids,
    reply,
    short_text,
    sized,
    unsolicited,
)
from tests.fuzz_oracle import (
    CLOSE_BAD_HANDSHAKE,
    CLOSE_LOST,
    CLOSE_TOO_BIG,
    LOG_PROBLEM,
    MAX_FRAME_BYTES,
    SURROGATE,
    Expected,
    ends_as,
    expect_answer,
    expect_handshake,
    frame_of,
    outcomes,
    same_json,
    too_big,
)

HANDSHAKE_SECS = 1.0  # handshakeTimeoutSecs: no executor_info reply by then, closed (4408)
ANSWER_SECS = 1.0  # recoveryAckTimeoutSecs: how long the API waits for a list_workflows reply
SLACK_SECS = 3.0  # on top of Relay's own timeouts, for a loaded two-core machine


def examples(default: int) -> int:
    return int(os.environ.get("RELAY_FUZZ_EXAMPLES", default))


def fuzz_settings(default: int) -> settings:
    return settings(max_examples=examples(default), derandomize=True, database=None, deadline=None)


def time_limit(default: int) -> pytest.MarkDecorator:
    """pytest-timeout for a run of ``examples(default)`` examples (a slow one costs a timeout or two)."""
    return pytest.mark.timeout(max(180, 60 + 3 * examples(default)))


def note(what: str) -> None:
    """Count ``what`` in hypothesis's statistics (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        event(what)


VALID_ANSWER = {
    **ListWorkflowsReply(
        request_id="-",
        output=[
            WorkflowsOutput(workflow_id="wf-1", status="SUCCESS", created_at="1767225600000", was_forked_from=False)
        ],
    ).to_frame(),
    "request_id": ECHO,
}


# --- The running Relay, the honest executor, and the checks after every example ------------


def lease_epoch(relay: RelayProcess, conn: psycopg.Connection[Any]) -> int:
    """The epoch of the instance's lease (``/readyz`` tells only whether it is held), read on ``conn``
    (autocommit: each read sees the latest)."""
    row = conn.execute("SELECT lease_epoch FROM relay_instances WHERE instance_id = %s", (relay.instance_id,))
    return int(row.fetchone()[0])  # type: ignore[index]


def url_segment(executor_id: str) -> str:
    """The id as one URL path segment: every dot encoded too, so that "." and ".." reach Relay as
    they are rather than being resolved away by the client."""
    return quote(executor_id, safe="").replace(".", "%2E")


class LogWatch:
    """Relay's log from where the last look stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def problems(self, since_start: bool = False) -> list[str]:
        """Error and traceback lines written since the last look (or since the start)."""
        with open(self.path, "rb") as log:
            log.seek(0 if since_start else self.offset)
            data = log.read()
        data = data[: data.rfind(b"\n") + 1]  # a record being written is read next time
        if not since_start:
            self.offset += len(data)
        text = data.decode(errors="replace")
        return [line for line in text.splitlines() if LOG_PROBLEM.search(line)]


class Fuzz:
    """A running Relay with its honest executor, and what each example needs to talk to them."""

    def __init__(self, relay: RelayProcess, honest_id: str, honest_connected_at: str) -> None:
        self.relay = relay
        # One connection for the lease's check after every example, not one each (tens of ms apiece).
        self.db = psycopg.connect(relay.database_url, autocommit=True)
        self.lease_epoch = lease_epoch(relay, self.db)
        self.honest_id = honest_id
        self.honest_connected_at = honest_connected_at
        self.url = websocket_url(relay.port)
        self.log = LogWatch(relay.log_path)
        self.runner = asyncio.Runner()
        self.api = self._client()
        self.responses: list[tuple[str, int]] = []
        self.endings: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.connected_at: dict[str, str] = {}  # the last connectedAt of each fuzzing executor id
        self._ids = itertools.count()

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=f"{self.relay.http}/v2/orgs/acme",
            headers={"Authorization": f"Bearer {API_KEYS['acme']}"},
            timeout=10,
            event_hooks={"response": [self._saw]},
        )

    async def new_client(self) -> None:
        """A fresh API client: after a 500 Starlette answers, uvicorn drops the connection without
        saying so, and the old client would reuse it."""
        await self.api.aclose()
        self.api = self._client()

    async def _saw(self, response: httpx.Response) -> None:
        self.responses.append((f"{response.request.method} {response.request.url.path}", response.status_code))

    def run(self, example: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """One example, then the checks that must hold after any example."""
        self.responses.clear()
        self.runner.run(self._checked(example))

    async def _checked(self, example: Callable[[], Coroutine[Any, Any, None]]) -> None:
        await example()
        await self.check_unharmed()

    async def check_unharmed(self) -> None:
        assert self.relay.proc is not None and self.relay.proc.poll() is None, f"Relay exited: {self.log_tail()}"
        ready = await self.api.get(f"{self.relay.http}/readyz")
        assert ready.status_code == 200, f"/readyz: {ready.status_code} {ready.text}"
        assert lease_epoch(self.relay, self.db) == self.lease_epoch, "the lease was taken again"
        honest = await self.record(self.honest_id)
        assert honest is not None and honest["state"] == "HEALTHY", f"the honest executor: {honest}"
        assert honest["connectedAt"] == self.honest_connected_at, "the honest executor's socket was disturbed"
        errors = [(call, status) for call, status in self.responses if status == 500]
        assert not errors, f"API calls answered 500: {errors}"
        problems = self.log.problems()
        assert not problems, "Relay logged:\n" + "\n".join(problems)

    def log_tail(self) -> str:
        return self.relay.log()[-4000:]

    # -- records --------------------------------------------------------------------------

    async def record(self, executor_id: str, *, search_listing: bool = True) -> dict[str, Any] | None:
        """The executor's record, or None (any id can be named in a URL, "/" included)."""
        resp = await self.api.get(f"/apps/ledger/executors/{url_segment(executor_id)}")
        assert resp.status_code in (200, 404), f"GET executor {executor_id!r}: {resp.status_code} {resp.text[:300]}"
        found: dict[str, Any] | None = resp.json() if resp.status_code == 200 else None
        assert found is None or found["executorId"] == utf8(executor_id), found
        return found

    async def connection(self, executor_id: str, state: str, previous: str | None) -> dict[str, Any]:
        """The record of a connection newer than ``previous`` (a connectedAt), once in ``state``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SLACK_SECS + 2
        while True:
            last = await self.record(executor_id)
            if last is not None and last["connectedAt"] != previous and last["state"] == state:
                self.connected_at[executor_id] = last["connectedAt"]
                return last
            assert loop.time() < deadline, f"executor {executor_id!r} never {state} (after {previous}): {last}"
            await asyncio.sleep(0.02)

    async def connect_valid(self) -> tuple[FuzzingExecutor, str]:
        """A fuzzing executor past a valid handshake, under a fresh id."""
        executor_id = f"fuzz-{next(self._ids)}"
        fuzzer = await FuzzingExecutor.connect(self.url)
        request = await fuzzer.next_request("executor_info", SLACK_SECS)
        await fuzzer.send([info_reply(request["request_id"], executor_id)])
        await self.connection(executor_id, "HEALTHY", None)
        return fuzzer, executor_id

    async def hang_up(self, fuzzer: FuzzingExecutor, executor_id: str | None) -> None:
        """Close the socket and, for an executor Relay accepted, see it recorded DISCONNECTED."""
        await fuzzer.close()
        if executor_id is not None:
            record = await self.record(executor_id)
            assert record is not None
            if record["state"] != "DISCONNECTED":
                await self.connection(executor_id, "DISCONNECTED", None)

    # -- requests ---------------------------------------------------------------------------

    async def ask_workflows(
        self, fuzzer: FuzzingExecutor, executor_id: str, plan: Sequence[Any]
    ) -> tuple[httpx.Response, list[Expected]]:
        """Ask the API for the executor's workflows and answer Relay's list_workflows with the
        frames of ``plan``; returns the API's response and the outcomes the frames allow."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        path = f"/apps/ledger/executors/{url_segment(executor_id)}/workflows"
        call = asyncio.create_task(self.api.get(path, timeout=ANSWER_SECS + 10))
        try:
            asked = asyncio.create_task(fuzzer.next_request("list_workflows", SLACK_SECS))
            await asyncio.wait([asked, call], return_when=asyncio.FIRST_COMPLETED)
            if not asked.done():
                asked.cancel()
                response = call.result()
                raise AssertionError(f"the API answered without asking: {response.status_code} {response.text[:300]}")
            request_id = asked.result()["request_id"]
            wire = [render(frame, request_id) for frame in plan]
            possible = outcomes(wire, lambda frames: expect_answer(frames, request_id))
            await fuzzer.send(wire)
            response = await call
        finally:
            call.cancel()
        elapsed = loop.time() - started
        if response.status_code == 500:
            await self.new_client()
        assert elapsed < ANSWER_SECS + SLACK_SECS, f"the API answered after {elapsed:.1f}s"
        self.statuses[response.status_code] += 1
        note(f"API {response.status_code}")
        return response, possible

    def ended(self, ending: Ending) -> None:
        self.endings[str(ending)] += 1
        note(f"socket {ending}")

    def close(self) -> None:
        self.runner.run(self.api.aclose())
        self.runner.close()
        self.db.close()


@pytest.fixture(scope="module")
def fuzz(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzz]:
    """Relay with short timeouts and a 1 MiB frame limit, and one honest executor, for the module.
    Grace periods are long: fuzzing executors that leave must not set off recoveries."""
    workdir = tmp_path_factory.mktemp("fuzz")
    config = relay_yaml(
        free_port(), grace=3600, handshake=HANDSHAKE_SECS, recoveryAckTimeoutSecs=ANSWER_SECS,
        pingIntervalSecs=0.5, pingWaitSecs=3.0,
    )  # fmt: skip
    config["server"]["maxFrameBytes"] = MAX_FRAME_BYTES
    relay = RelayProcess(workdir, postgres.create_database("relay"), config)
    honest: ExecutorProcess | None = None
    fuzz: Fuzz | None = None
    try:
        relay.start()
        honest = ExecutorProcess(workdir, postgres.create_database("sys"), relay.conductor_url)
        honest_id = honest.executor_id

        def honest_healthy() -> dict[str, Any] | None:
            record = relay.executor("acme", "ledger", honest_id)
            return record if record is not None and record["state"] == "HEALTHY" else None

        record = assert_eventually(honest_healthy, 10, what="the honest executor HEALTHY")
        assert record is not None
        fuzz = Fuzz(relay, honest_id, record["connectedAt"])
        yield fuzz
    finally:
        if fuzz is not None:
            fuzz.close()
        if honest is not None:
            honest.stop()
        relay.stop()


def finish(fuzz: Fuzz, position: str, required_endings: set[str], required_statuses: set[int]) -> None:
    """After a position's run: the honest executor still answers requests, the whole log is
    clean, and (in the default run) the examples reached every outcome they are meant to."""
    print(f"\n{position}: sockets {dict(fuzz.endings)}; API statuses {dict(fuzz.statuses)}")

    async def honest_answers() -> None:
        resp = await fuzz.api.get(f"/apps/ledger/executors/{fuzz.honest_id}/workflows")
        assert resp.status_code == 200, resp.text

    fuzz.runner.run(honest_answers())
    problems = fuzz.log.problems(since_start=True)
    assert not problems, "Relay logged:\n" + "\n".join(problems)
    endings, statuses = set(fuzz.endings), set(fuzz.statuses)
    fuzz.endings.clear()
    fuzz.statuses.clear()
    if examples(0) == 0:  # a full run, not one with RELAY_FUZZ_EXAMPLES
        seen = {ending.replace(f"closed {CLOSE_LOST}", f"closed {CLOSE_TOO_BIG}") for ending in endings}
        assert required_endings <= seen, f"endings seen: {endings}"
        assert required_statuses <= statuses, f"statuses seen: {statuses}"


def listing(workflows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(w["workflowId"], w["status"], w["name"], w["executorId"]) for w in workflows]


def utf8(value: str | None) -> str | None:
    """What the API's JSON shows of a string: lone surrogates replaced by U+FFFD."""
    return None if value is None else SURROGATE.sub("\ufffd", value)


def listing_of(answer: ListWorkflowsReply) -> list[tuple[Any, ...]]:
    return [(utf8(w.workflow_id), utf8(w.status), utf8(w.workflow_name), utf8(w.executor_id)) for w in answer.output]


async def answer_and_check(fuzz: Fuzz, fuzzer: FuzzingExecutor, executor_id: str, plan: Sequence[Any]) -> Ending:
    """Answer the API's list_workflows with ``plan``: the API's status and body and the socket's
    ending must be one of the outcomes the frames allow."""
    response, possible = await fuzz.ask_workflows(fuzzer, executor_id, plan)
    closing = any(p.close is not None for p in possible)
    ending = await fuzzer.ending(SLACK_SECS if closing else 0)
    matching = [p for p in possible if p.status == response.status_code and ends_as(ending, p.close)]
    assert matching, (
        f"API {response.status_code} and socket {ending}, expected one of "
        f"{[(p.status, p.close or 'open') for p in possible]}: {response.text[:500]}"
    )
    if response.status_code == 200:
        assert any(listing(response.json()) == listing_of(p.reply) for p in matching if p.reply), response.text[:500]
    return ending


async def still_served(fuzz: Fuzz, fuzzer: FuzzingExecutor, executor_id: str) -> None:
    """The socket still carries requests: a valid answer to list_workflows gets through."""
    response, _ = await fuzz.ask_workflows(fuzzer, executor_id, [VALID_ANSWER])
    assert response.status_code == 200, response.text
    assert [w["workflowId"] for w in response.json()] == ["wf-1"]
    assert response.json()[0]["createdAt"] == "2026-01-01T00:00:00.000Z"


async def send_unsolicited(fuzzer: FuzzingExecutor, frames: Sequence[Any]) -> Ending:
    """Send frames nobody asked for: they are ignored, but one too big closes the socket (1009)."""
    wire = [render(frame, "never-asked") for frame in frames]
    await fuzzer.send(wire)
    if not any(too_big(data) for data in wire):
        return Ending(open=True)  # what follows shows whether the socket is still served
    ending = await fuzzer.ending(SLACK_SECS)
    assert ends_as(ending, CLOSE_TOO_BIG), f"got {ending}"
    return ending


# --- 1. The handshake -----------------------------------------------------------------------

metadata = st.one_of(
    huge_objects,
    nested.map(lambda value: {"nested": value}),
    st.dictionaries(short_text, json_values, max_size=6),
)
# Replies that stand a chance: any character PostgreSQL can store, lengths about a name's.
storable = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=40)
storable_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), storable),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(storable, children, max_size=4)),
    max_leaves=12,
)
plausible_info = st.fixed_dictionaries(
    {
        "type": st.just("executor_info"),
        "request_id": st.just(ECHO),
        "executor_id": st.one_of(storable.filter(bool), st.uuids().map(str)),
        "application_version": storable,
    },
    optional={
        "hostname": st.one_of(st.none(), storable),
        "language": st.one_of(st.none(), storable),
        "dbos_version": st.one_of(st.none(), storable),
        "executor_metadata": st.one_of(st.none(), st.dictionaries(storable, storable_json, max_size=6), huge_objects),
        "error_message": st.one_of(st.none(), st.just("")),
    },
)
info_drafts = st.one_of(
    plausible_info,
    reply(ExecutorInfoReply, st.just(ECHO), wild=False),
    reply(ExecutorInfoReply, st.just(ECHO), wild=True),
    st.builds(
        lambda draft, md: {**draft, "executor_metadata": md},
        reply(ExecutorInfoReply, st.just(ECHO), wild=False),
        metadata,
    ),
)
handshake_answers = either(
    st.one_of(plausible_info, sized(plausible_info, MAX_FRAME_BYTES)),
    st.one_of(
        info_drafts,
        mangled(info_drafts),
        inflated(plausible_info),
        error_only(st.just(ECHO), st.one_of(st.just("executor_info"), other_types)),
        garbage(info_drafts),
    ),
)
# An answer, perhaps after a reply to some other request (passed over), or only such a reply.
other_reply = reply(ListWorkflowsReply, st.uuids().map(lambda u: u.hex), wild=False)
handshake_plans = now_and_then(
    st.one_of(
        handshake_answers.map(lambda frame: [frame]),
        st.builds(lambda noise, frame: [noise, frame], other_reply, handshake_answers),
    ),
    other_reply.map(lambda noise: [noise]),
    one_in=20,
)


def claimed_id(wire: Sequence[str | bytes]) -> str | None:
    """The executor_id a frame names, if one does that could be stored and looked up (for NUL
    see test_an_executor_id_with_nul_in_a_url_is_a_client_error)."""
    for data in wire:
        frame = frame_of(data)
        named = frame.get("executor_id") if frame is not None else None
        if isinstance(named, str) and 0 < len(named) <= 256 and not has_unstorable(named):
            return named
    return None


async def handshake_example(fuzz: Fuzz, plan: list[Any], after: list[Any]) -> None:
    """``plan`` answers executor_info; if Relay accepts it, ``after`` follows, unsolicited."""
    fuzzer = await FuzzingExecutor.connect(fuzz.url)
    accepted: str | None = None
    try:
        request = await fuzzer.next_request("executor_info", SLACK_SECS)
        wire = [render(frame, request["request_id"]) for frame in plan]
        possible = outcomes(wire, lambda frames: expect_handshake(frames, request["request_id"]))
        await fuzzer.send(wire)
        info = possible[0].accepted
        assert all(p.accepted == info for p in possible)  # a plan's answer is its last frame
        if info is None:
            ending = await fuzzer.ending(HANDSHAKE_SECS + SLACK_SECS)
            assert any(ends_as(ending, p.close) for p in possible), f"{ending}, expected {possible}"
            named = claimed_id(wire)
            if named is not None and named not in fuzz.connected_at:
                assert await fuzz.record(named, search_listing=False) is None, "a refused executor was recorded"
        else:
            accepted = info.executor_id
            record = await fuzz.connection(info.executor_id, "HEALTHY", fuzz.connected_at.get(info.executor_id))
            assert (record["executorId"], record["applicationVersion"], record["hostname"], record["language"],
                    record["dbosVersion"]) == (info.executor_id, info.application_version, info.hostname,
                                               info.language, info.dbos_version)  # fmt: skip
            assert same_json(record["metadata"], info.executor_metadata), (record["metadata"], info.executor_metadata)
            ending = await send_unsolicited(fuzzer, after)
            if ending.open:
                await still_served(fuzz, fuzzer, info.executor_id)
        fuzz.ended(ending)
    finally:
        await fuzz.hang_up(fuzzer, accepted)


@time_limit(150)
def test_fuzzed_handshake_replies(fuzz: Fuzz) -> None:
    @fuzz_settings(150)
    @given(plan=handshake_plans, after=st.lists(unsolicited(MAX_FRAME_BYTES), max_size=2))
    def example(plan: list[Any], after: list[Any]) -> None:
        fuzz.run(lambda: handshake_example(fuzz, plan, after))

    example()
    finish(fuzz, "handshake", {"open", "closed 4400", "closed 4408", "closed 1009"}, {200})


# --- 2. The reply to a request --------------------------------------------------------------

# Well typed, without an error: Relay must pass every value through to the API's caller.
plausible_list = reply(ListWorkflowsReply, st.just(ECHO), wild=False).map(
    lambda draft: {**draft, "error_message": None}
)
list_answers = st.one_of(plausible_list, echoing(ListWorkflowsReply), inflated(plausible_list))
answer_noise = st.one_of(
    garbage(reply(ListWorkflowsReply, st.just(ECHO), wild=False)),
    reply(ListWorkflowsReply, random_request_ids, wild=False),
    sized(reply(ListWorkflowsReply, random_request_ids, wild=False), MAX_FRAME_BYTES),
)
answer_plans = now_and_then(
    st.one_of(
        list_answers.map(lambda frame: [frame]),
        list_answers.map(lambda frame: [frame, frame]),  # the same reply twice
        st.builds(lambda noise, frame: [*noise, frame], st.lists(answer_noise, min_size=1, max_size=2), list_answers),
        st.builds(lambda frame, noise: [frame, noise], list_answers, answer_noise),
    ),
    # A frame too big, instead of the answer, before it, or after it.
    st.builds(
        lambda big, frame, where: [big, frame][:where] if where < 2 else [frame, big],
        oversized(reply(ListWorkflowsReply, st.just(ECHO), wild=False), MAX_FRAME_BYTES),
        list_answers,
        st.sampled_from([1, 2, 3]),
    ),
    one_in=8,
)


async def answer_example(fuzz: Fuzz, plan: list[Any]) -> None:
    fuzzer, executor_id = await fuzz.connect_valid()
    try:
        ending = await answer_and_check(fuzz, fuzzer, executor_id, plan)
        if ending.open:
            await still_served(fuzz, fuzzer, executor_id)
        fuzz.ended(ending)
    finally:
        await fuzz.hang_up(fuzzer, executor_id)


@time_limit(120)
def test_fuzzed_replies_to_a_request(fuzz: Fuzz) -> None:
    @fuzz_settings(120)
    @given(plan=answer_plans)
    def example(plan: list[Any]) -> None:
        fuzz.run(lambda: answer_example(fuzz, plan))

    example()
    finish(fuzz, "replies", {"open", "closed 1009"}, {200, 502, 504})


# --- 3. Unsolicited frames ------------------------------------------------------------------


async def unsolicited_example(fuzz: Fuzz, before: list[Any], during: list[Any]) -> None:
    """``before`` goes out with no request pending; ``during`` while list_workflows waits, ahead
    of a valid answer."""
    fuzzer, executor_id = await fuzz.connect_valid()
    try:
        ending = await send_unsolicited(fuzzer, before)
        if ending.open:
            ending = await answer_and_check(fuzz, fuzzer, executor_id, [*during, VALID_ANSWER])
        fuzz.ended(ending)
    finally:
        await fuzz.hang_up(fuzzer, executor_id)


@time_limit(120)
def test_fuzzed_unsolicited_frames(fuzz: Fuzz) -> None:
    @fuzz_settings(120)
    @given(
        before=st.lists(unsolicited(MAX_FRAME_BYTES), max_size=3),
        during=st.lists(unsolicited(MAX_FRAME_BYTES), max_size=2),
    )
    def example(before: list[Any], during: list[Any]) -> None:
        fuzz.run(lambda: unsolicited_example(fuzz, before, during))

    example()
    finish(fuzz, "unsolicited", {"open", "closed 1009"}, {200})


# --- Relay bugs the fuzzing found, each fixed: kept as tests ----------------------------------


def test_a_failed_handshake_logs_no_error(fuzz: Fuzz) -> None:
    async def bad_handshake() -> None:
        fuzzer = await FuzzingExecutor.connect(fuzz.url)
        await fuzzer.next_request("executor_info", SLACK_SECS)
        await fuzzer.send([""])
        assert await fuzzer.ending(SLACK_SECS) == Ending(open=False, code=CLOSE_BAD_HANDSHAKE)
        # A connection after it: its lines come after whatever the failed one left behind.
        fuzzer, executor_id = await fuzz.connect_valid()
        await fuzz.hang_up(fuzzer, executor_id)

    fuzz.log.problems()
    fuzz.runner.run(bad_handshake())
    with open(fuzz.relay.log_path, "rb") as log:
        log.seek(fuzz.log.offset)
        new_lines = log.read().decode(errors="replace")
    assert " ERROR " not in new_lines, new_lines


def listed(fuzz: Fuzz, workflow: dict[str, Any]) -> httpx.Response:
    """The API's answer to a listing of a fuzzing executor whose reply lists ``workflow``."""

    async def ask() -> httpx.Response:
        fuzzer, executor_id = await fuzz.connect_valid()
        try:
            frame = {"type": "list_workflows", "request_id": ECHO, "output": [{"WasForkedFrom": False, **workflow}]}
            response, _ = await fuzz.ask_workflows(fuzzer, executor_id, [frame])
            return response
        finally:
            await fuzz.hang_up(fuzzer, executor_id)

    return fuzz.runner.run(ask())


def test_a_listed_workflow_with_a_lone_surrogate_is_no_500(fuzz: Fuzz) -> None:
    response = listed(fuzz, {"WorkflowUUID": "\ud800"})
    assert response.status_code in (200, 502), response.text


def test_a_listed_workflow_created_far_in_the_future_is_no_500(fuzz: Fuzz) -> None:
    response = listed(fuzz, {"WorkflowUUID": "wf-1", "CreatedAt": "99999999999999999999"})
    assert response.status_code == 200, response.text
    assert response.json()[0]["createdAt"] is None


def test_an_executor_id_with_nul_in_a_url_is_a_client_error(fuzz: Fuzz) -> None:
    async def ask() -> httpx.Response:
        return await fuzz.api.get("/apps/ledger/executors/%00")

    response = fuzz.runner.run(ask())
    assert response.status_code == 404, response.text


def test_an_executor_id_with_a_slash_can_be_looked_up(fuzz: Fuzz) -> None:
    async def connect_and_look() -> int:
        fuzzer = await FuzzingExecutor.connect(fuzz.url)
        try:
            request = await fuzzer.next_request("executor_info", SLACK_SECS)
            await fuzzer.send([info_reply(request["request_id"], "host/1")])
            await fuzz.connection("host/1", "HEALTHY", fuzz.connected_at.get("host/1"))  # found in the listing
            response = await fuzz.api.get(f"/apps/ledger/executors/{url_segment('host/1')}")
            return response.status_code
        finally:
            await fuzz.hang_up(fuzzer, "host/1")

    assert fuzz.runner.run(connect_and_look()) == 200


def test_an_executor_id_cannot_write_its_own_log_lines(fuzz: Fuzz) -> None:
    forger = "x\nFORGED: a line of the executor's choosing"

    async def connect() -> None:
        fuzzer = await FuzzingExecutor.connect(fuzz.url)
        try:
            request = await fuzzer.next_request("executor_info", SLACK_SECS)
            await fuzzer.send([info_reply(request["request_id"], forger)])
            await fuzz.connection(forger, "HEALTHY", fuzz.connected_at.get(forger))
        finally:
            await fuzz.hang_up(fuzzer, forger)

    fuzz.runner.run(connect())
    assert not [line for line in fuzz.relay.log().splitlines() if line.startswith("FORGED")]
