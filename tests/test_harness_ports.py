"""The test harness's ports: below the kernel's ephemeral range, a slice per pytest worker, each
one free when handed out (harness/ports.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from harness import ports

ROOT = Path(__file__).resolve().parent.parent


def _slice_in(worker: str) -> range:
    code = "from harness import ports; r = ports._slice(); print(r.start, r.stop)"
    env = {**os.environ, "PYTEST_XDIST_WORKER": worker, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    start, stop = map(int, out.stdout.split())
    return range(start, stop)


def test_ports_are_below_the_ephemeral_range_and_not_handed_out_twice() -> None:
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    assert all(ports.LOWEST <= p < low for p in got), got


def test_each_worker_has_ports_of_its_own() -> None:
    slices = [_slice_in(f"gw{n}") for n in range(4)]
    for i, a in enumerate(slices):
        for b in slices[i + 1 :]:
            assert not set(a) & set(b), (a, b)
    assert all(len(s) >= ports.MIN_SLICE for s in slices)


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
