"""Free TCP ports on the loopback interface, for servers the tests and benchmarks start.

A port is found free and bound later by another process (a Relay instance, PostgreSQL, a
receiver), so two things can take it in between:

- the kernel, for an outgoing connection: ``bind(0)`` and every ``connect`` draw from the same
  ephemeral range (``net.ipv4.ip_local_port_range``), and a test's processes open hundreds of
  connections (to PostgreSQL, between instances, to executors) while its servers start;
- another caller of :func:`free_port` (pytest's other workers, a second chaos run), which could
  be handed the same port before either bound it.

So ports come from below the ephemeral range, and each process has a slice of its own, walked in
turn: a pytest worker (``PYTEST_XDIST_WORKER``) tries its worker's slice first, a process outside
pytest-xdist one by its pid, and each takes the first slice no other process holds (a claim on the
slice's name, held while the process lives), so two runs at once (a CI run and another beside it)
do not share one. Each port is still checked by binding it. Where the ephemeral range leaves too
little room below it, the kernel's choice (``bind(0)``) is the fallback.
"""

from __future__ import annotations

import atexit
import errno
import os
import random
import socket
import threading
from pathlib import Path

# The lowest port handed out: below it are the well-known and registered ports services use
# (PostgreSQL's 5432, 8080...), which a developer's machine may have in use.
LOWEST = 10_000
# Slices: the first WORKER_SLICES for pytest-xdist workers gw0, gw1...; the rest for processes
# outside xdist (a chaos run, a benchmark), by pid.
WORKER_SLICES = 8
OTHER_SLICES = 8
MIN_SLICE = 200
# Ports a browser refuses to load a page from (Chromium's and Firefox's restricted ports, net::
# ERR_UNSAFE_PORT), of those at or above LOWEST: the console's tests drive Chromium at a Relay's port,
# and a module's Relay handed 10080 failed all thirty of test_console.py's tests in one run.
BROWSERS_REFUSE = frozenset({10080})

# A slice's claim: a Unix socket bound to this name and the slice's index in Linux's abstract
# namespace (the name starts with a NUL byte). The name is the kernel's alone: no file is made, and
# it is let go when the process ends, however it ends, so nothing is left in any TMPDIR (a chaos run
# killed by CI's timeout must leave its TMPDIR empty) and no stale claim is left to clean up. It is
# shared by every user of the machine, as its ports are.
CLAIM = "relay-test-ports-slice-"

_lock = threading.Lock()
_next: int | None = None
# This process's slice (its index, the socket that holds it, the pid that took it: a forked child
# takes one of its own).
_claim: tuple[int, socket.socket, int] | None = None


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default
    return low


def _slice() -> range | None:
    """This process's ports, or None where there is no room below the ephemeral range."""
    top = _ephemeral_low()
    size = (top - LOWEST) // (WORKER_SLICES + OTHER_SLICES)
    if size < MIN_SLICE:
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        first = int(worker[2:]) % WORKER_SLICES
    else:
        first = WORKER_SLICES + os.getpid() % OTHER_SLICES
    start = LOWEST + _claimed(first) * size
    return range(start, start + size)


def _claimed(first: int) -> int:
    """The index of the slice this process holds: ``first`` or the next that no other process
    holds. Two runs at once (two gw0 workers, two processes whose pids agree modulo OTHER_SLICES)
    took the same slice, and either could hand out a port the other had handed out and not yet
    bound (a Relay binds its port seconds after it starts)."""
    global _claim
    with _lock:
        if _claim is not None and _claim[2] == os.getpid():
            return _claim[0]
        slices = WORKER_SLICES + OTHER_SLICES
        for n in range(slices):
            index = (first + n) % slices
            # Python's sockets are not inherited across exec: the servers a process starts hold no claim.
            held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                held.bind(f"\0{CLAIM}{index}")
            except OSError as exc:
                held.close()
                if exc.errno == errno.EADDRINUSE:
                    continue
                return first  # no abstract namespace (not Linux): unclaimed, as before
            _claim = (index, held, os.getpid())
            # Closed at exit, not left to the interpreter's shutdown, which warns of every socket
            # it collects open (a ResourceWarning on each pytest worker's stderr).
            atexit.register(held.close)
            return index
        return first  # more processes at once than slices: they share, as before


def _bindable(port: int) -> bool:
    # The wildcard address: a server listening on 127.0.0.1, or on every address, makes it fail.
    # No SO_REUSEADDR, so a port with connections still in TIME_WAIT is passed over too.
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_port() -> int:
    """A TCP port nothing listens on now, unlikely to be taken before its server binds it."""
    global _next
    ports = _slice()
    if ports is None:
        return _kernel_port()
    with _lock:
        if _next is None or _next not in ports:
            _next = random.choice(ports)  # a restarted process does not reuse its predecessor's ports first
        for _ in range(len(ports)):
            port = _next
            _next = port + 1 if port + 1 in ports else ports.start
            if port not in BROWSERS_REFUSE and _bindable(port):
                return port
    return _kernel_port()
