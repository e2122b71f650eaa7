"""Ending a child process the harness, the tests and the benchmarks started."""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def end(proc: subprocess.Popen[Any] | None, timeout: float = 10.0, stopped: bool = False) -> None:
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
