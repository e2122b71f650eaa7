"""What the benchmarks share: errors, the machine line, the work folder."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import re
import resource
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import psutil

# Log lines worth printing after a run.
PROBLEM_LINE = re.compile(r"\b(ERROR|WARNING|CRITICAL)\b|Traceback")


class BenchError(Exception):
    """A measurement could not be made (a process did not start or went away, counts never matched...)."""


def problem_lines(log: Path) -> list[str]:
    """The lines of a log file that look like trouble (see PROBLEM_LINE); none if there is no file."""
    if not log.exists():
        return []
    return [line for line in log.read_text(errors="replace").splitlines() if PROBLEM_LINE.search(line)]


def cpu_secs(proc: psutil.Process) -> float:
    """User and system CPU seconds of ``proc`` so far."""
    times = proc.cpu_times()
    return float(times.user + times.system)


def machine_busy_secs() -> float:
    """CPU seconds the whole machine has spent running something, all cores summed: user, nice,
    system and interrupts (guest time is already in user and nice; idle, I/O wait and a virtual
    machine's steal are not counted)."""
    machine = psutil.cpu_times()
    return float(sum(getattr(machine, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq")))


def load_average() -> str:
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def print_machine() -> None:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    print(f"machine: {os.cpu_count()} CPUs, {memory:.1f} GiB RAM, {platform.platform()}")
    print(f"python {platform.python_version()}; load average (1, 5, 15 min): {load_average()}", flush=True)


@contextlib.contextmanager
def work_directory(log_dir: str | None, prefix: str) -> Iterator[Path]:
    """``log_dir`` (kept), or a temporary folder removed afterwards."""
    if log_dir is not None:
        path = Path(log_dir).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def exit_on_sigterm(signum: int, _frame: object) -> None:
    """A SIGTERM handler that unwinds like an exception, so that ``finally`` blocks stop every process."""
    raise SystemExit(128 + signum)


def raise_open_files(needed: int) -> int:
    """Raise this process's (and so its children's) open file limit to ``needed`` if allowed; returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return int(soft)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        print(f"warning: open file limit is {target}, below the {needed} wanted", file=sys.stderr)
    return int(target)


T = TypeVar("T")


async def patiently(read: Callable[[], Awaitable[T]], attempts: int = 10) -> T:
    """A read after a phase, tried again while the instances are still too busy to answer."""
    for attempt in range(attempts):
        try:
            return await read()
        except httpx.HTTPError:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(2.0)
    raise AssertionError("unreachable")
