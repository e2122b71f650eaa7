"""A hand-written executor for protocol fuzzing: it says what the test tells it to.

Integration tests of behaviour use the real SDK (executor_app.py); this one
exists to send what a real client never would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Coroutine
from typing import Any, TypeVar

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from harness.relay import RelayProcess
from harness.waiting import assert_eventually
from relay_protocol import unknown_type_reply

T = TypeVar("T")


def info_reply(
    request_id: str, executor_id: str, version: str = "v1", hostname: str = "simulated", language: str | None = "python"
) -> str:
    """The reply to ``executor_info`` that the DBOS SDK (3.2) sends (``language``: another SDK's, or
    None for one that does not say)."""
    return json.dumps(
        {
            "type": "executor_info",
            "request_id": request_id,
            "executor_id": executor_id,
            "application_version": version,
            "hostname": hostname,
            "language": language,
            "dbos_version": "3.2.0",
            "executor_metadata": None,
        }
    )


async def open_socket(url: str, **kwargs: Any) -> ClientConnection:
    return await connect(url, ping_interval=None, open_timeout=10, **kwargs)


async def handshake(
    ws: ClientConnection, executor_id: str | None = None, version: str = "v1", language: str | None = "python"
) -> str:
    """Answer Relay's executor_info; returns the executor id used."""
    request = json.loads(await ws.recv())
    assert request["type"] == "executor_info", request
    executor_id = executor_id or str(uuid.uuid4())
    await ws.send(info_reply(request["request_id"], executor_id, version, language=language))
    return executor_id


# What a peer that lies answers: it recovered (it did nothing), and nothing is left PENDING.
LIES: dict[str, dict[str, Any]] = {
    "recovery": {"success": True},
    "exist_pending_workflows": {"exist": False},
}


class SimulatedPeer:
    """A peer in its own thread that misbehaves on ``recovery``.

    ``on_recovery``: ``"close"`` closes its socket, ``"silent"`` never answers,
    ``"lie"`` answers ``success: true`` and then ``exist: false`` to
    ``exist_pending_workflows`` without having recovered anything, and
    ``"answer"`` sends what ``replies`` gives for it. ``replies`` maps a
    message type to the fields of its reply (besides ``type`` and
    ``request_id``), sent as they are, however wrong, or a function of the
    request that gives them. Any other request gets
    what ``others`` says: ``"error"`` an error reply, as an SDK answers a
    request it cannot serve; ``"silent"`` no answer at all (an executor that
    hangs, its socket still answering pings); ``"unknown"`` the SDK's reply to
    a message type it does not know (an older SDK). With ``hold``, its reply to
    ``recovery`` waits until ``hold`` is set (the socket keeps answering
    everything else meanwhile). ``slow`` maps a message type to how long its
    replies wait (the socket reads on meanwhile: a slow executor). ``paired`` maps a
    message type to the types that release its replies: each reply to it waits until a request of
    one of those types comes after it, so a Relay that waits for the first reply before it sends the
    second never gets one. ``language``: the SDK's language its handshake gives (None: not given).
    """

    def __init__(
        self,
        url: str,
        executor_id: str,
        on_recovery: str,
        version: str = "v1",
        replies: dict[str, dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]] | None = None,
        others: str = "error",
        hold: threading.Event | None = None,
        slow: dict[str, float] | None = None,
        paired: dict[str, Collection[str]] | None = None,
        language: str | None = "python",
    ) -> None:
        if on_recovery not in ("close", "silent", "lie", "answer"):
            raise ValueError(f"unknown behaviour {on_recovery!r}")
        if others not in ("error", "silent", "unknown"):
            raise ValueError(f"unknown behaviour {others!r}")
        self.url = url
        self.executor_id = executor_id
        self.on_recovery = on_recovery
        self.others = others
        self.version = version
        self.language = language
        self.replies = {**(LIES if on_recovery == "lie" else {}), **(replies or {})}
        self.hold = hold
        self.slow = slow or {}
        self.paired = paired or {}
        self._unpaired: list[tuple[Collection[str], asyncio.Event]] = []  # replies waiting for a release
        self._held: set[asyncio.Task[None]] = set()
        self.requests: Counter[str] = Counter()
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),), daemon=True)
        self._ws: ClientConnection | None = None

    @property
    def recovery_requests(self) -> int:
        return self.requests["recovery"]

    def __enter__(self) -> SimulatedPeer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the simulated peer did not connect")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ws is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._ws.transport.abort)  # as if the process died
        self._thread.join(10)
        self._loop.close()

    async def _run(self) -> None:
        self._ws = ws = await open_socket(self.url)
        await handshake(ws, self.executor_id, self.version, self.language)
        self._ready.set()
        try:
            async for frame in ws:
                request = json.loads(frame)
                kind = request["type"]
                self.requests[kind] += 1
                self._release(kind)
                if kind == "recovery" and self.on_recovery == "close":
                    await ws.close()
                    return
                if kind == "recovery" and self.on_recovery == "silent":
                    continue
                if kind in self.replies:
                    fields = self.replies[kind]
                    fields = fields(request) if callable(fields) else fields
                    reply = {"type": kind, "request_id": request["request_id"], **fields}
                elif self.others == "silent":
                    continue
                elif self.others == "unknown":
                    reply = unknown_type_reply(kind, request["request_id"])
                else:
                    error = {"error_message": "not supported by the simulated peer"}
                    reply = {"type": kind, "request_id": request["request_id"], **error}
                if kind == "recovery" and self.hold is not None:
                    self._later(self._send_when_released(ws, reply, self.hold))
                    continue
                if kind in self.slow:
                    self._later(self._send_after(ws, reply, self.slow[kind]))
                    continue
                if kind in self.paired:
                    released = asyncio.Event()
                    self._unpaired.append((self.paired[kind], released))
                    self._later(self._send_when_set(ws, reply, released))
                    continue
                await ws.send(json.dumps(reply))
        except ConnectionClosed:
            return
        finally:
            for task in list(self._held):  # replies still waiting die with the socket
                task.cancel()
            await asyncio.gather(*self._held, return_exceptions=True)

    def _release(self, kind: str) -> None:
        """Send the replies waiting for a request of type ``kind`` (``paired``)."""
        for waiting in [w for w in self._unpaired if kind in w[0]]:
            self._unpaired.remove(waiting)
            waiting[1].set()

    def _later(self, sending: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(sending)
        self._held.add(task)
        task.add_done_callback(self._held.discard)

    @staticmethod
    async def _send_after(ws: ClientConnection, reply: dict[str, Any], delay: float) -> None:
        await asyncio.sleep(delay)
        with contextlib.suppress(ConnectionClosed):
            await ws.send(json.dumps(reply))

    @staticmethod
    async def _send_when_set(ws: ClientConnection, reply: dict[str, Any], released: asyncio.Event) -> None:
        await released.wait()
        with contextlib.suppress(ConnectionClosed):
            await ws.send(json.dumps(reply))

    @staticmethod
    async def _send_when_released(ws: ClientConnection, reply: dict[str, Any], hold: threading.Event) -> None:
        await asyncio.to_thread(hold.wait)
        with contextlib.suppress(ConnectionClosed):
            await ws.send(json.dumps(reply))


def requests_over_runs(
    relay: RelayProcess, peers: list[SimulatedPeer], workflow_name: str, runs: int = 4
) -> tuple[int, list[Counter[str]], int]:
    """Connect ``peers`` (acme/ledger's; the first HEALTHY before the others connect, for a test
    whose first runs must find it) and, once they are all HEALTHY, wait until ``runs``
    runs of one of Relay's own workflows have begun and finished since. Returns (those runs, each
    peer's requests by type, all runs), read at a moment when no run is under way, so that every
    request counted belongs to a finished run."""
    first, *others = peers
    with contextlib.ExitStack() as stack:
        # Entered once its handshake is sent, which Relay records a moment later: waited for.
        stack.enter_context(first)
        assert_eventually(lambda: relay.state_of("acme", "ledger", first.executor_id) == "HEALTHY", 10)
        for peer in others:
            stack.enter_context(peer)
        assert_eventually(lambda: all(relay.state_of("acme", "ledger", p.executor_id) == "HEALTHY" for p in peers), 10)
        since = time.time() + 1.5  # a read of the app's healthy executors begun before is shared for a second
        assert_eventually(lambda: relay.runs_of(workflow_name, "SUCCESS", since) >= runs, 20, interval=0.2)

        def between_runs() -> tuple[int, list[Counter[str]], int] | None:
            total = relay.runs_of(workflow_name)
            if relay.runs_of(workflow_name, "SUCCESS") != total:
                return None
            asked, after = [Counter(peer.requests) for peer in peers], relay.runs_of(workflow_name, "SUCCESS", since)
            return (after, asked, total) if relay.runs_of(workflow_name) == total else None

        found = assert_eventually(between_runs, 10, interval=0.05)
    assert found is not None
    return found


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking check (HTTP to Relay, polling) without starving this loop's pongs."""
    return await asyncio.to_thread(fn, *args, **kwargs)
