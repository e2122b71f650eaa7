"""The test harness's ports: below the kernel's ephemeral range, a slice per pytest worker, each
one free when handed out (harness/ports.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness import ports
from harness.relay import RelayProcess, relay_yaml

ROOT = Path(__file__).resolve().parent.parent


def _slices_at_once(workers: list[str]) -> list[range]:
    """The slices processes with these PYTEST_XDIST_WORKER values ("": none) take, all alive at once."""
    code = (
        "import sys; from harness import ports; r = ports._slice()\n"
        "print(r.start, r.stop, flush=True); sys.stdin.read()"
    )
    procs = []
    try:
        for worker in workers:
            env = {**os.environ, "PYTEST_XDIST_WORKER": worker, "PYTHONPATH": str(ROOT)}
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE))  # fmt: skip
        slices = []
        for proc in procs:
            assert proc.stdout is not None
            start, stop = map(int, proc.stdout.readline().split())
            slices.append(range(start, stop))
        return slices
    finally:
        for proc in procs:
            proc.communicate("", timeout=10)  # stdin closed: it ends


def test_ports_are_below_the_ephemeral_range_and_not_handed_out_twice() -> None:
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    assert all(ports.LOWEST <= p < low for p in got), got


def test_each_worker_has_ports_of_its_own() -> None:
    slices = _slices_at_once([f"gw{n}" for n in range(4)])
    for i, a in enumerate(slices):
        for b in slices[i + 1 :]:
            assert not set(a) & set(b), (a, b)
    assert all(len(s) >= ports.MIN_SLICE for s in slices)


def test_two_runs_at_once_do_not_share_a_slice() -> None:
    """Two runs' gw0 workers, or two processes outside pytest-xdist whose pids agree modulo
    OTHER_SLICES, took the same slice: each could hand out a port the other had handed out and not
    yet bound (a Relay of one run then answered the other's readiness check)."""
    slices = _slices_at_once(["gw0", "gw0", "", ""])
    starts = [s.start for s in slices]
    assert len(set(starts)) == len(starts), starts


def test_a_port_in_use_is_passed_over() -> None:
    ports.free_port()
    nxt = ports._next  # where the walk goes on from
    assert nxt is not None
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", nxt))
        taken.listen()
        got = ports.free_port()
        assert got != nxt
        with socket.socket() as s:
            s.bind(("127.0.0.1", got))  # and what it gave is free


class _Ready(BaseHTTPRequestHandler):
    """Answers 200 to any GET, as another run's Relay answers /readyz."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_relay_is_ready_only_when_it_answers_itself(tmp_path: Path) -> None:
    """Another process on a Relay's port (another run's server, handed the same port) answered its
    /readyz, and the test went on as if this Relay were up, before it had migrated its database.
    Now it is ready when it listens there itself; failing to, it exits and its start says why."""
    with ThreadingHTTPServer(("127.0.0.1", ports.free_port()), _Ready) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        # The port is taken before the database is touched: no database is needed to show it.
        relay = RelayProcess(tmp_path, "postgresql://127.0.0.1:1/unused", relay_yaml(other.server_port))
        try:
            with pytest.raises(RuntimeError, match="relay exited"):
                relay.start()
        finally:
            relay.stop()
            other.shutdown()
    assert "the port is in use" in relay.log(), relay.log()
