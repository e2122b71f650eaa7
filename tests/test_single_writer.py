"""One writer of executor state, seen at run time.

Two Relay instances go through a kill, a failover, a reconnect, an operator's
recovery, a blocked recovery, a restart, stranded work and an adoption, with psycopg's cursors
wrapped (``tests/writers/sitecustomize.py``) so that every statement writing the
executors table names the module that issued it. The events the executor store
applied are read from each instance's ``/metrics`` before it goes away.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.executors import Evidence, ExecutorProcess
from harness.keys import CONDUCTOR_KEYS
from harness.ports import free_port
from harness.relay import RelayProcess, relay_yaml
from harness.simulated import SimulatedPeer, handshake, open_socket
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.core.lifecycle import ExecutorEvent
from relay.core.peers import Peer, order_peers
from tests.prom import AUTH

WRITERS = Path(__file__).resolve().parent / "writers"
StartRelay = Callable[..., RelayProcess]
StartExecutor = Callable[..., ExecutorProcess]


@pytest.fixture
def write_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "executor-writes.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(WRITERS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("RELAY_TEST_WRITE_LOG", str(log))
    return log


def applied_events(relay: RelayProcess) -> Counter[str]:
    text = httpx.get(f"{relay.http}/metrics", headers=AUTH, timeout=5, verify=TLS).text
    return Counter(
        {
            s.labels["event"]: int(s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "relay_executor_events_total" and s.labels["outcome"] == "applied"
        }
    )


def config(port: int) -> dict[str, Any]:
    cfg = relay_yaml(port, grace=1.0, instanceLeaseSecs=1.0, recoveryAckTimeoutSecs=2.0)
    cfg["orgs"][0]["apps"] += [
        {"name": "solo", "executorTimeoutSecs": 0.3},
        {"name": "slow", "executorTimeoutSecs": 60},
    ]
    cfg["reconciler"] = {"enabled": True, "intervalSecs": 0.5}
    return cfg


def url(relay: RelayProcess, app: str) -> str:
    return f"ws://127.0.0.1:{relay.port}/websocket/{app}/{CONDUCTOR_KEYS['acme']}"


def connect_and_drop(
    relay: RelayProcess, app: str, executor_id: str, reconnect: bool = False, version: str = "v1"
) -> None:
    """A simulated executor that connects, loses its socket and (optionally) comes back with the same id."""

    async def run() -> None:
        for _ in range(2 if reconnect else 1):
            ws = await open_socket(url(relay, app))
            await handshake(ws, executor_id, version)
            await asyncio.to_thread(assert_eventually, lambda: relay.state_of("acme", app, executor_id) == "HEALTHY", 5)
            ws.transport.abort()
            await asyncio.to_thread(
                assert_eventually, lambda: relay.state_of("acme", app, executor_id) == "DISCONNECTED", 5
            )

    asyncio.run(run())


def ranked_first(dead: str, other: str) -> str:
    while True:
        candidate = f"bad-{os.urandom(4).hex()}"
        if order_peers(dead, [Peer(candidate, "v1"), Peer(other, "v1")])[0].executor_id == candidate:
            return candidate


def test_every_write_of_executor_state_comes_from_the_store_and_every_event_is_applied(
    tmp_path: Path, relay_db: str, start_executor: StartExecutor, evidence_db: str, write_log: Path
) -> None:
    relay1 = RelayProcess(tmp_path, relay_db, config(free_port()), "relay-1").start()
    relay2 = RelayProcess(tmp_path, relay_db, config(free_port()), "relay-2")
    seen: Counter[str] = Counter()
    try:
        env = {"RELAY_TEST_EVIDENCE": evidence_db}
        peer = start_executor(relay1.conductor_url, env=env)
        victim = start_executor(relay1.conductor_url, env={**env, "RELAY_TEST_JOBS": "2", "RELAY_TEST_JOB_SLEEP": "2"})
        # kill -9, grace period, a failed attempt on a peer that drops, failover, verified recovery.
        with SimulatedPeer(url(relay1, "ledger"), ranked_first(victim.executor_id, peer.executor_id), "close") as bad:
            # Each recorded HEALTHY before the death (a peer's READY or handshake comes before Relay
            # records it): a peer that drops recorded only after the grace period is not asked first.
            for executor_id in (peer.executor_id, victim.executor_id, bad.executor_id):
                assert_eventually(lambda e=executor_id: relay1.state_of("acme", "ledger", e) == "HEALTHY", 10)
            victim.kill()
            assert_eventually(lambda: relay1.executor("acme", "ledger", victim.executor_id) is None, 30)
        assert_eventually(lambda: len(Evidence(evidence_db).outcomes()) == 2, 30)
        # an idle executor of a retired version: no peer may take its work, and a peer finds it left none.
        connect_and_drop(relay1, "ledger", "retired", version="v0")
        assert_eventually(lambda: relay1.executor("acme", "ledger", "retired") is None, 20)
        # a reconnect; a recovery with no peer; an operator's recovery during a grace period.
        connect_and_drop(relay1, "ledger", "comes-back", reconnect=True)
        connect_and_drop(relay1, "solo", "alone")
        assert_eventually(lambda: (relay1.executor("acme", "solo", "alone") or {}).get("blockedReason"), 10)
        connect_and_drop(relay1, "slow", "cut-short")
        with relay1.api() as api:
            assert api.post("/apps/slow/executors/cut-short/recover").status_code == 202
        assert_eventually(lambda: (relay1.executor("acme", "slow", "cut-short") or {}).get("blockedReason"), 10)
        one_job = {"RELAY_TEST_JOBS": "1", "RELAY_TEST_JOB_SLEEP": "10", "RELAY_TEST_JOB_PREFIX": "stranded"}
        stranded = start_executor(relay1.conductor_url, env={**env, **one_job})
        assert_eventually(lambda: relay1.state_of("acme", "ledger", stranded.executor_id) == "HEALTHY", 10)
        assert_eventually(lambda: any(w == "stranded-0" for w, _, _ in Evidence(evidence_db).step_runs()), 10)
        seen += applied_events(relay1)
        # kill -9 and restart: the executors it held are marked at its start. One dies meanwhile
        # and its record is lost: the reconciler brings it back (STRANDED) and recovers it.
        relay1.signal(signal.SIGKILL)
        assert relay1.proc is not None and relay1.proc.wait(10) == -signal.SIGKILL
        stranded.kill()
        with psycopg.connect(relay_db, autocommit=True) as conn:
            conn.execute("DELETE FROM executors WHERE executor_id = %s", (stranded.executor_id,))
        relay1.start()
        assert_eventually(lambda: relay1.state_of("acme", "ledger", peer.executor_id) == "HEALTHY", 10)
        assert_eventually(lambda: applied_events(relay1)["stranded"] > 0, 15)
        seen += applied_events(relay1)
        # an instance that stays dead is adopted, and its executors with it.
        relay2.start()
        relay1.signal(signal.SIGKILL)
        relay1.proc.wait(10)
        assert_eventually(lambda: applied_events(relay2)["adopted"] > 0, 15)
        seen += applied_events(relay2)
    finally:
        relay2.stop()
        relay1.stop()

    assert {e.value for e in ExecutorEvent} <= {event for event, n in seen.items() if n > 0}, seen
    writers = Counter(line.split()[1] for line in write_log.read_text().splitlines())
    assert writers and set(writers) == {"relay.store.executors"}, writers


def test_the_write_log_names_a_module_other_than_the_store(tmp_path: Path, relay_db: str, write_log: Path) -> None:
    """The detector itself: a write issued from anywhere else is named as such."""
    code = (
        "import psycopg\n"
        f"conn = psycopg.connect({relay_db!r}, autocommit=True)\n"
        "conn.execute('CREATE TABLE IF NOT EXISTS executors (x int)')\n"
        "conn.execute('UPDATE executors SET x = 1')\n"
    )
    rogue = tmp_path / "rogue.py"
    rogue.write_text(code)
    run_as = f"import runpy; runpy.run_path({str(rogue)!r}, run_name='relay.rogue')"
    subprocess.run([sys.executable, "-c", run_as], check=True, timeout=30)
    assert [line.split()[1] for line in write_log.read_text().splitlines()] == ["relay.rogue"]
