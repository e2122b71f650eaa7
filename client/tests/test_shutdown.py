"""Stopping while the client is still trying to connect: a name resolution that hangs must hold up
neither ``stop()`` nor the interpreter's exit.

The resolver is the environment, not the client: the application's process has its
``socket.getaddrinfo`` hang for one host name, as a DNS server that does not answer would (the
C library waits out its timeouts and attempts, tens of seconds).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import app

import relay_client

HANGING_RESOLVER = """
import json, socket, sys, tempfile, threading, time
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[2]]  # the client under test, then the tests' app
import app
from dbos import DBOS
import relay_client

asked = threading.Event()
real_getaddrinfo = socket.getaddrinfo

def getaddrinfo(host, *args, **kwargs):
    if host == "relay.hangs.example":
        asked.set()
        threading.Event().wait(45)  # a DNS server that does not answer (longer than any wait here)
    return real_getaddrinfo(host, *args, **kwargs)

socket.getaddrinfo = getaddrinfo
app.launch(Path(tempfile.mkdtemp()), relay_client.new_executor_id())
connection = relay_client.connect("ws://relay.hangs.example:8080/", key="k", app="clienttest")
assert asked.wait(30), "the client never resolved Relay's host"
started = time.monotonic()
if sys.argv[3] == "stop":
    connection.stop()
else:
    DBOS.destroy()
stopped = time.monotonic() - started
print("STOPPED " + json.dumps({"secs": stopped, "running": connection.running}), flush=True)
if sys.argv[3] == "stop":
    DBOS.destroy()
"""


def run_hanging(how: str) -> tuple[dict[str, float], float]:
    """What the application saw of stopping (``stop()`` or ``DBOS.destroy()``) while the client
    resolves Relay's host, and how long the whole process took to end after that."""
    client_root = str(Path(relay_client.__file__).resolve().parents[1])
    proc = subprocess.Popen(
        [sys.executable, "-c", HANGING_RESOLVER, client_root, str(Path(app.__file__).parent), how],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(app.__file__).parent,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # ends by the line or by the process ending
        seen = time.monotonic()
        proc.wait(90)
        ended = time.monotonic() - seen
        assert line.startswith("STOPPED "), line + (proc.stderr.read() if proc.stderr else "")[-3000:]
        return json.loads(line[len("STOPPED ") :]), ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_stop_does_not_wait_for_a_name_resolution_that_hangs() -> None:
    """stop() waited out the connect attempt (5 s) and then the resolver's thread (up to its own
    timeout of 10 s): a pending connect is cancelled at once, and the process then exits without
    waiting for the resolver either."""
    stopped, ended = run_hanging("stop")
    assert stopped["running"] is False, stopped
    assert stopped["secs"] < 2.0, stopped
    assert ended < 15.0, f"the process took {ended:.1f}s to exit after stop()"


def test_dbos_destroy_does_not_wait_for_a_name_resolution_that_hangs() -> None:
    stopped, ended = run_hanging("destroy")
    assert stopped["running"] is False, stopped
    assert stopped["secs"] < 4.0, stopped  # DBOS's own destroy takes its part of that
    assert ended < 15.0, f"the process took {ended:.1f}s to exit after DBOS.destroy()"
