"""What the runner watches while the faults play, for the database rules (chaos/dbrules.py).

- :class:`RegistryWatch`: a thread that reads every executor's state from Relay's API every
  :data:`SAMPLE_EVERY_SECS`, from the first instance that answers (while Relay's database is out
  none may: those samples are simply missing), and notes when it first sees each instance process
  exited (the process manager's part, :meth:`chaos.run.Fleet.revive`, notices later).
- :func:`time_to_ready`: after a fault of Relay's database, how long each running instance takes
  to answer ``/readyz`` with 200.

A sample's time is when its request was sent, and an answer that took longer than
:data:`SAMPLE_TIMEOUT_SECS` is dropped: the state it reports held somewhere in
``[time, time + SAMPLE_TIMEOUT_SECS]``, which is what the checker assumes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import httpx

from chaos.dbrules import SAMPLE_TIMEOUT_SECS
from harness.keys import API_KEYS
from harness.relay import RelayProcess, list_all
from harness.web import TLS

SAMPLE_EVERY_SECS = 0.4
READY_POLL_SECS = 0.25


def _running(relay: RelayProcess) -> bool:
    return relay.proc is not None and relay.proc.poll() is None


class RegistryWatch:
    def __init__(self, relays: Sequence[RelayProcess], apps: Sequence[str], org: str = "acme") -> None:
        self.relays = relays
        self.apps = apps
        self.org = org
        # executor id -> (wall time, state), oldest first
        self.samples: dict[str, list[tuple[float, str]]] = {}
        # pid of an instance process -> when this watch first saw it exited
        self.exited: dict[int, float] = {}
        self._clients: dict[str, httpx.Client] = {}  # per instance, kept: a loaded machine connects slowly
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-watch", daemon=True)

    def start(self) -> RegistryWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.time()
            for app in self.apps:
                self._sample(app)
            self._stop.wait(max(0.0, began + SAMPLE_EVERY_SECS - time.time()))

    def _note_exits(self) -> None:
        for relay in self.relays:
            proc = relay.proc
            if proc is not None and proc.poll() is not None:
                self.exited.setdefault(proc.pid, time.time())

    def _sample(self, app: str) -> None:
        for relay in self.relays:
            self._note_exits()
            if not _running(relay):
                continue
            api = self._clients.get(relay.instance_id)
            if api is None:
                api = self._clients[relay.instance_id] = httpx.Client(
                    base_url=f"{relay.http}/v2/orgs/{self.org}",
                    headers={"Authorization": f"Bearer {API_KEYS[self.org]}"},
                    timeout=SAMPLE_TIMEOUT_SECS,
                    verify=TLS,
                )
            sent = time.time()
            try:
                rows = list_all(api, f"/apps/{app}/executors")
            except (httpx.HTTPError, ValueError):
                continue  # this instance cannot answer now (its database is out, say): the next one
            if time.time() - sent > SAMPLE_TIMEOUT_SECS:
                continue  # too slow to say when the state held
            for row in rows:
                self.samples.setdefault(str(row["executorId"]), []).append((sent, str(row["state"])))
            return


def time_to_ready(relays: Sequence[RelayProcess], since: float, cap: float) -> dict[str, float | None]:
    """Per running instance: seconds from ``since`` until its ``/readyz`` answered 200 (measured when
    the answer came), or None if it did not within ``cap``. An instance that exits meanwhile is left
    out (its exit is judged on its own)."""
    waiting = {r.instance_id: r for r in relays if _running(r)}
    ready: dict[str, float | None] = {}
    while waiting and time.time() < since + cap:
        for instance, relay in list(waiting.items()):
            if not _running(relay):
                del waiting[instance]
                continue
            try:
                ok = httpx.get(f"{relay.http}/readyz", timeout=1.0, verify=TLS).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                ready[instance] = round(time.time() - since, 2)
                del waiting[instance]
        time.sleep(READY_POLL_SECS)
    ready.update({instance: None for instance in waiting})
    return ready
