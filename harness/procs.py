"""Ending a child process the harness, the tests and the benchmarks started."""

from __future__ import annotations

import signal
import subprocess
from typing import IO, Any, Protocol

import psutil


class Child(Protocol):
    """What the harness and the tests use of a child process: ``subprocess.Popen``'s, which
    harness.zygote's children answer too."""

    pid: int
    returncode: int | None
    args: Any
    stdout: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def end(proc: Child | None, timeout: float = 10.0, stopped: bool = False) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; waited for either way. ``stopped``: the
    process may be SIGSTOPped (a fault), so SIGCONT first, or the SIGTERM would wait with it."""
    if proc is None or proc.poll() is not None:
        return
    if stopped:
        proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def listens(pid: int, port: int) -> bool:
    """Whether the process ``pid``, or a process it started (a wrapper's child), listens on TCP
    ``port``: that one's server, not another process's that holds the port (another run's, handed
    the same port), answers there."""
    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.Error:
        return False
    for proc in procs:
        try:
            sockets = proc.net_connections(kind="tcp")
        except psutil.Error:  # ended meanwhile
            continue
        if any(s.status == psutil.CONN_LISTEN and s.laddr and s.laddr.port == port for s in sockets):
            return True
    return False
