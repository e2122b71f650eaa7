"""Recovery frames shared by a group of deaths (relay.domain.frames), with a peer that recovers
only some of a shared frame's executors: the others fail over, and nothing is deleted before an
executor other than the one that recovered it has seen it recovered.

A real Relay and PostgreSQL; the executors are simulated (harness/simulated.py's handshake on
real sockets) because no real SDK recovers only part of what it is asked to. They share one
model of the apps' system database: which dead executor still has PENDING workflows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from harness.keys import API_KEYS, CONDUCTOR_KEYS
from harness.relay import RelayProcess
from harness.simulated import handshake, open_socket
from relay.core.peers import Peer, order_peers

StartRelay = Callable[..., RelayProcess]
GROUP = 4


@dataclass
class SystemDatabase:
    """What the simulated executors know of the app's workflows: the dead executors whose
    workflows are still PENDING, and when each was recovered (this machine's clock)."""

    pending: set[str] = field(default_factory=set)
    recovered_at: dict[str, float] = field(default_factory=dict)

    def recover(self, executor_id: str) -> None:
        if executor_id in self.pending:
            self.pending.discard(executor_id)
            self.recovered_at[executor_id] = time.time()


@dataclass
class Peer_:
    """A healthy simulated executor. ``partial``: of a frame naming several executors it
    recovers all but the last, and still answers ``success: true``; its first frame it holds
    for a second before answering, so that the deaths behind it queue up for one frame."""

    executor_id: str
    sysdb: SystemDatabase
    partial: bool = False
    frames: list[list[str]] = field(default_factory=list)
    ws: ClientConnection | None = None

    async def serve(self, url: str) -> None:
        self.ws = await open_socket(url)
        await handshake(self.ws, self.executor_id)
        with contextlib.suppress(ConnectionClosed):
            async for raw in self.ws:
                request = json.loads(raw)
                kind = request["type"]
                reply: dict[str, Any] = {"type": kind, "request_id": request["request_id"]}
                if kind == "recovery":
                    ids = list(request["executor_ids"])
                    self.frames.append(ids)
                    if self.partial and len(self.frames) == 1:
                        await asyncio.sleep(1.0)
                    for executor_id in ids[:-1] if self.partial and len(ids) > 1 else ids:
                        self.sysdb.recover(executor_id)
                    reply["success"] = True
                elif kind == "exist_pending_workflows":
                    reply["exist"] = request["executor_id"] in self.sysdb.pending
                else:
                    reply["error_message"] = f"{kind} is not supported by the simulated executor"
                await self.ws.send(json.dumps(reply))


def picking(first: str, second: str) -> str:
    """A dead executor's id for which rendezvous choice tries ``first`` before ``second``."""
    while True:
        candidate = f"dead-{uuid.uuid4()}"
        if order_peers(candidate, [Peer(first, "v1"), Peer(second, "v1")])[0].executor_id == first:
            return candidate


async def until(check: Callable[[], Awaitable[bool]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)


def at(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


async def scenario(relay: RelayProcess) -> None:
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    api = httpx.AsyncClient(
        base_url=f"{relay.http}/v2/orgs/acme", headers={"Authorization": f"Bearer {API_KEYS['acme']}"}, timeout=10
    )
    sysdb = SystemDatabase()
    partial, honest = Peer_("peer-partial", sysdb, partial=True), Peer_("peer-honest", sysdb)
    tasks = [asyncio.create_task(p.serve(url)) for p in (partial, honest)]
    dead = [picking(partial.executor_id, honest.executor_id) for _ in range(GROUP)]
    sockets = []
    for executor_id in dead:
        ws = await open_socket(url)
        await handshake(ws, executor_id)
        sockets.append(ws)
        sysdb.pending.add(executor_id)

    async def healthy() -> bool:
        executors: list[dict[str, Any]] = (await api.get("/apps/ledger/executors")).json()
        return [e["state"] for e in executors].count("HEALTHY") == GROUP + 2

    await until(healthy, 10)
    for ws in sockets:  # the group dies at once
        ws.transport.abort()

    async def all_gone() -> bool:
        codes = [(await api.get(f"/apps/ledger/executors/{d}")).status_code for d in dead]
        return codes == [404] * GROUP

    await until(all_gone, 60)
    for p in (partial, honest):
        assert p.ws is not None
        p.ws.transport.abort()
    await asyncio.gather(*tasks)
    for ws in sockets:
        await ws.wait_closed()

    # Frames were shared: the partial peer got the first death alone (holding it a second)
    # and the rest of the group together, in one frame.
    assert sorted(e for f in partial.frames for e in f) == sorted(dead), partial.frames
    shared = [f for f in partial.frames if len(f) > 1]
    assert shared, partial.frames
    skipped = {f[-1] for f in shared}
    # What the partial peer left PENDING failed over to the honest peer, alone in its frames.
    assert sorted(e for f in honest.frames for e in f) == sorted(skipped), honest.frames
    assert sysdb.pending == set()
    for executor_id in dead:
        audit = (await api.get("/audit", params={"executorId": executor_id})).json()
        actions = [(e["action"], e["peerExecutorId"]) for e in audit]
        (deleted,) = [e for e in audit if e["action"] == "executor.deleted"]
        # Deleted only after the recovery happened, and on the word of the other executor.
        assert at(deleted["at"]) >= sysdb.recovered_at[executor_id] - 0.05, (executor_id, audit)
        (recovery,) = (await api.get("/apps/ledger/recoveries", params={"executorId": executor_id})).json()
        outcomes = [(a["peerExecutorId"], a["outcome"]) for a in recovery["attempts"]]
        if executor_id in skipped:
            assert outcomes == [(partial.executor_id, "failed"), (honest.executor_id, "succeeded")], outcomes
            failed = next(e for e in audit if e["action"] == "recovery.failed")
            assert "still PENDING" in failed["detail"]["error"]
            assert honest.executor_id in failed["detail"]["error"]
            assert deleted["detail"]["verifiedBy"] == partial.executor_id
            assert ("recovery.failover", honest.executor_id) in actions
        else:
            assert outcomes == [(partial.executor_id, "succeeded")], outcomes
            assert deleted["detail"]["verifiedBy"] == honest.executor_id
    metrics = (await api.get(f"{relay.http}/metrics")).text
    frames = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("relay_recovery_frame")
    }
    sent = len(partial.frames) + len(honest.frames)
    assert frames["relay_recovery_frames_total"] == sent
    assert frames["relay_recovery_frame_executors_total"] == GROUP + len(skipped)
    await api.aclose()


def test_a_shared_frame_partly_recovered_fails_the_rest_over_and_deletes_nothing_unverified(
    start_relay: StartRelay,
) -> None:
    relay = start_relay(grace=0.5, recoveryAckTimeoutSecs=5.0, failoverBackoffInitialSecs=0.2)
    asyncio.run(scenario(relay))


async def woken_scenario(relay: RelayProcess) -> None:
    url = f"ws://127.0.0.1:{relay.port}/websocket/ledger/{CONDUCTOR_KEYS['acme']}"
    api = httpx.AsyncClient(
        base_url=f"{relay.http}/v2/orgs/acme", headers={"Authorization": f"Bearer {API_KEYS['acme']}"}, timeout=10
    )
    sysdb = SystemDatabase()
    dead = f"dead-{uuid.uuid4()}"
    ws = await open_socket(url)
    await handshake(ws, dead)
    sysdb.pending.add(dead)

    async def state() -> str | None:
        resp = await api.get(f"/apps/ledger/executors/{dead}")
        return resp.json()["state"] if resp.status_code == 200 else None

    async def healthy() -> bool:
        return await state() == "HEALTHY"

    await until(healthy, 10)
    ws.transport.abort()
    await ws.wait_closed()

    async def blocked() -> bool:
        resp = await api.get(f"/apps/ledger/executors/{dead}")
        return resp.status_code == 200 and resp.json()["blockedReason"] == "no_healthy_peer"

    # Alone, its recovery waits for a peer; one connects at once, within the half second in which
    # a group of deaths may share a read of the healthy executors: the wake-up must read afresh.
    deadline = time.monotonic() + 10
    while not await blocked():
        assert time.monotonic() < deadline, "never blocked"
        await asyncio.sleep(0.02)
    peer = Peer_("peer-late", sysdb)
    serving = asyncio.create_task(peer.serve(url))
    started = time.monotonic()

    async def gone() -> bool:
        return (await api.get(f"/apps/ledger/executors/{dead}")).status_code == 404

    await until(gone, 10)
    assert time.monotonic() - started < 5  # not the 30 s fallback re-check
    assert peer.frames == [[dead]]
    assert peer.ws is not None
    peer.ws.transport.abort()
    await serving
    await api.aclose()


def test_a_peer_that_connects_just_after_a_recovery_blocked_gets_it_at_once(start_relay: StartRelay) -> None:
    relay = start_relay(grace=0.3, recoveryAckTimeoutSecs=5.0)
    asyncio.run(woken_scenario(relay))
