"""Recovery frames coalesced per peer.

The protocol's ``recovery`` names a list of executor ids, and an SDK handles
one request at a time. So a peer has at most one recovery frame from this
instance in flight: a recovery for it that arrives meanwhile waits, and every
one that waited goes in the next frame together. One death costs one frame, as
before; a group of deaths that rendezvous choice sends to the same peer costs
that peer a frame per round trip instead of a frame per death.

A shared frame's reply is every waiter's reply. A peer that answers
``success: true`` having recovered only some of the ids is caught where a
single frame's would be: each death's recovery verifies its own executor
(``exist_pending_workflows`` per dead executor, workflows/recovery.py), fails
the attempt if anything is left PENDING, and fails over. Each waiter keeps its
own timeout, counted from when it asked: a frame waiting behind a peer that
does not answer does not get its time twice.

Everything but a single-executor ``recovery`` passes through untouched.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from relay.core.ids import ExecutorKey
from relay.errors import ExecutorTimeout
from relay_protocol import RecoveryReply, RecoveryRequest, Reply, Request

R = TypeVar("R", bound=Reply)


class Ask(Protocol):
    """Ask an executor through the instance holding its socket (:meth:`relay.net.router.Router.ask`)."""

    async def __call__(
        self, key: ExecutorKey, request: Request, expected: type[R], timeout: float, *, await_connection: bool = False
    ) -> R: ...


@dataclass
class _Waiter:
    executor_id: str
    deadline: float
    await_connection: bool
    reply: asyncio.Future[RecoveryReply]


@dataclass
class _Peer:
    waiting: list[_Waiter] = field(default_factory=list)
    sender: asyncio.Task[None] | None = None


class CoalescingAsk:
    """:meth:`relay.net.router.Router.ask`, with recovery frames to one peer coalesced."""

    def __init__(self, ask: Ask) -> None:
        self._ask = ask
        self._peers: dict[ExecutorKey, _Peer] = {}
        # For /metrics and the benchmarks: frames sent, and the deaths they carried.
        self.frames: Counter[str] = Counter()

    async def __call__(
        self, key: ExecutorKey, request: Request, expected: type[R], timeout: float, *, await_connection: bool = False
    ) -> R:
        if not isinstance(request, RecoveryRequest) or len(request.executor_ids) != 1 or expected is not RecoveryReply:
            reply: R = await self._ask(key, request, expected, timeout, await_connection=await_connection)
            return reply
        loop = asyncio.get_running_loop()
        waiter = _Waiter(request.executor_ids[0], loop.time() + timeout, await_connection, loop.create_future())
        peer = self._peers.setdefault(key, _Peer())
        peer.waiting.append(waiter)
        if peer.sender is None:
            peer.sender = loop.create_task(self._send(key, peer))
        try:
            async with asyncio.timeout(timeout):
                recovered = await asyncio.shield(waiter.reply)
        except TimeoutError:
            raise ExecutorTimeout(f"executor {key}: no reply to recovery within {timeout:g} s") from None
        finally:
            if not waiter.reply.done():
                waiter.reply.cancel()  # not sent yet: it is left out of the next frame
        assert isinstance(recovered, expected)
        return recovered

    async def _send(self, key: ExecutorKey, peer: _Peer) -> None:
        try:
            while peer.waiting:
                batch = [w for w in peer.waiting if not w.reply.done()]
                peer.waiting = []
                if not batch:
                    continue
                ids = list(dict.fromkeys(w.executor_id for w in batch))
                remaining = max(w.deadline for w in batch) - asyncio.get_running_loop().time()
                self.frames["sent"] += 1
                self.frames["executors"] += len(ids)
                try:
                    reply = await self._ask(
                        key,
                        RecoveryRequest(executor_ids=ids),
                        RecoveryReply,
                        max(remaining, 0.001),
                        await_connection=any(w.await_connection for w in batch),
                    )
                except Exception as exc:
                    for w in batch:
                        if not w.reply.done():
                            w.reply.set_exception(exc)
                    continue
                for w in batch:
                    if not w.reply.done():
                        w.reply.set_result(reply)
        finally:
            # No await since the list was last seen empty: a recovery that arrives from here on
            # finds no sender and starts one.
            peer.sender = None
            if self._peers.get(key) is peer and not peer.waiting:
                del self._peers[key]
