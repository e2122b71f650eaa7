"""The instance lease behind /readyz (contract rule 5)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx
import psycopg

from tests.support.harness import RelayProcess, assert_eventually

StartRelay = Callable[..., RelayProcess]


def readyz(relay: RelayProcess) -> httpx.Response:
    return httpx.get(f"{relay.http}/readyz", timeout=5)


def test_ready_with_a_lease_and_a_new_epoch_at_each_start(start_relay: StartRelay) -> None:
    relay = start_relay(instanceLeaseSecs=1.0)
    first = readyz(relay).json()["leaseEpoch"]
    with psycopg.connect(relay.database_url) as conn:
        row = conn.execute(
            "SELECT lease_epoch, lease_expires_at > now() FROM relay_instances WHERE instance_id = 'relay-1'"
        ).fetchone()
    assert row == (first, True)
    time.sleep(1.5)  # longer than the lease: renewals keep it
    assert readyz(relay).status_code == 200
    relay.stop()
    relay.start()
    assert readyz(relay).json()["leaseEpoch"] == first + 1
    assert "relay_lease_held 1" in httpx.get(f"{relay.http}/metrics").text


def test_paused_past_its_lease_it_renews_when_nobody_took_over(start_relay: StartRelay) -> None:
    relay = start_relay(instanceLeaseSecs=0.6)
    epoch = readyz(relay).json()["leaseEpoch"]
    relay.signal(signal.SIGSTOP)
    time.sleep(1.5)
    relay.signal(signal.SIGCONT)
    assert_eventually(lambda: readyz(relay).status_code == 200, 3)
    assert readyz(relay).json()["leaseEpoch"] == epoch


def test_a_lease_taken_over_makes_the_instance_unready(start_relay: StartRelay) -> None:
    relay = start_relay(instanceLeaseSecs=0.6)
    # What an adopting instance does to an expired lease: raise its epoch.
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute("UPDATE relay_instances SET lease_epoch = lease_epoch + 1 WHERE instance_id = 'relay-1'")
    resp = assert_eventually(lambda: (r := readyz(relay)).status_code == 503 and r, 3)
    assert resp.json()["error"]["code"] == "lease_not_held"
    assert "taken over" in resp.json()["error"]["message"]
    assert "lost its lease" in relay.log()
