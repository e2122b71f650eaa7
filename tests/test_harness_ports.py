"""The test harness's ports: below the kernel's ephemeral range, a slice per process that no other
process holds meanwhile, each port free when handed out (harness/ports.py); and a Relay under test
ready only once it listens on its port itself (harness/relay.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness import ports
from harness.procs import listens
from harness.relay import RelayProcess, relay_yaml
from harness.waiting import assert_eventually

ROOT = Path(__file__).resolve().parent.parent


def _take_slices(
    workers: list[str], taken: list[tuple[range, subprocess.Popen[str]]], env: dict[str, str] | None = None
) -> list[tuple[range, subprocess.Popen[str]]]:
    """Processes with these PYTEST_XDIST_WORKER values ("": none), each with the slice it took, put
    in ``taken`` as they start (for the caller to end: each ends when its stdin is closed)."""
    code = (
        "import sys; from harness import ports; r = ports._slice(); ports.free_port()\n"
        "print(r.start, r.stop, flush=True); sys.stdin.read()"
    )
    for worker in workers:
        environ = {**os.environ, **(env or {}), "PYTEST_XDIST_WORKER": worker, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-c", code], env=environ, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        assert proc.stdout is not None
        start, stop = map(int, proc.stdout.readline().split())
        taken.append((range(start, stop), proc))
    return taken


def _slices_at_once(workers: list[str]) -> list[range]:
    """The slices processes with these PYTEST_XDIST_WORKER values take, all alive at once."""
    taken: list[tuple[range, subprocess.Popen[str]]] = []
    try:
        return [r for r, _ in _take_slices(workers, taken)]
    finally:
        for _, proc in taken:
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


def test_a_claim_leaves_no_file_and_ends_with_its_process(tmp_path: Path) -> None:
    """The claims were lock files in a folder under TMPDIR, which a chaos run killed by CI's
    timeout left behind (test_chaos_review forbids anything left there). A claim is the kernel's
    now: nothing in TMPDIR, and a process killed outright lets its slice go to the next one."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    taken: list[tuple[range, subprocess.Popen[str]]] = []
    try:
        [(first, proc)] = _take_slices(["gw5"], taken, env={"TMPDIR": str(tmpdir)})
        proc.kill()  # no handler, no atexit: only the kernel lets the claim go
        proc.communicate(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        [_, (again, _)] = _take_slices(["gw5"], taken, env={"TMPDIR": str(tmpdir)})
    finally:
        for _, proc in taken:
            proc.communicate("", timeout=10)
    assert again == first
    assert not list(tmpdir.iterdir())


def test_a_claim_ends_quietly_with_its_process() -> None:
    """The claim's socket was left for the interpreter's shutdown to collect, and every pytest
    worker ended CI's run with "Exception ignored ... ResourceWarning: unclosed <socket ...
    relay-test-ports-slice-N>" on its stderr. It is closed at exit."""
    code = "from harness import ports; ports.free_port()"
    environ = {**os.environ, "PYTEST_XDIST_WORKER": "gw6", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-X", "dev", "-c", code], env=environ, text=True,
                          capture_output=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "ResourceWarning" not in done.stderr and ports.CLAIM not in done.stderr, done.stderr


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


def test_a_wrapper_s_child_listening_counts_as_its_own(tmp_path: Path) -> None:
    """A server started through a wrapper (a shell script that runs it and waits) listens from
    the wrapper's child: that counts as the started process listening there, and nowhere else
    (another process's listener on the port itself: test_a_relay_is_ready_only_when_it_answers_itself)."""
    port = ports.free_port()
    serve = f"import socket, sys; s = socket.create_server(('127.0.0.1', {port})); sys.stdin.read()"
    wrapper = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "{serve}"; true'], stdin=subprocess.PIPE)
    try:
        assert_eventually(lambda: listens(wrapper.pid, port), 10, what="the wrapper's child listening")
        assert not listens(wrapper.pid, ports.free_port())
    finally:
        wrapper.communicate(b"", timeout=10)


def test_a_port_browsers_refuse_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chromium refuses to load a page from port 10080 (net::ERR_UNSAFE_PORT): a console test's Relay
    handed it failed every test of its module. The next port after it is handed out instead."""
    [refused] = ports.BROWSERS_REFUSE
    monkeypatch.setattr(ports, "_slice", lambda: range(refused, refused + 3))
    monkeypatch.setattr(ports, "_next", refused)
    assert ports.free_port() != refused
