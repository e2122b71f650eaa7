"""Debian's haproxy, started on a configuration of the caller's: the fleet benchmark's TCP balancer
(bench/fleet.py) and the console's path-prefixing reverse proxy (tests/test_console.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from harness.procs import end, listens

ROOT = Path(__file__).resolve().parents[1]


def haproxy_binary() -> str:
    """haproxy's path; a clear error where it is not installed (``./test.sh`` installs it as root)."""
    binary = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
    if binary is None:
        raise RuntimeError("haproxy is not installed (as root: apt-get install -y haproxy)")
    return binary


class Haproxy:
    """One haproxy process on ``config`` (written next to ``log_path``), listening on ``port`` once
    this returns. haproxy binds with SO_REUSEPORT, so several may share a port: what is waited for
    is this process's own listening socket."""

    def __init__(self, config: str, port: int, log_path: Path) -> None:
        self.port = port
        self.log_path = log_path
        config_path = log_path.with_suffix(".cfg")
        config_path.write_text(config)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [haproxy_binary(), "-db", "-f", str(config_path)], stdout=log, stderr=log, cwd=ROOT
            )
        deadline = time.monotonic() + 10
        while not listens(self.proc.pid, self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited {self.proc.returncode} (see {log_path})")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"haproxy did not listen within 10 s (see {log_path})")
            time.sleep(0.05)

    def stop(self) -> None:
        end(self.proc)
